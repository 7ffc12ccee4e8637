"""Optimizer state made before the first program, so that one program serves every call.

NOTE: [optimizer state made before the first program]
An optimizer makes its state on its first ``step()`` (Adam's ``exp_avg``, ``exp_avg_sq``
and step counter). Traced as it is, the first call is a program of its own that creates
the state, and the second call, which finds the state, compiles the steady program: two
captures, two expansions, two runs of the passes, for programs that differ only in where
the state comes from. Instead, the first call's capture goes like this:

1. Trace the step once (the first trace only, no functionalization or expansion: about
   a quarter of a compile). The optimizer's state dicts record each new entry when it
   is first assigned: the node of the trace that made the tensor, or the Python value.
2. Each new tensor must come from factory ops alone (``zeros_like(p)``, ``zeros(())``,
   ``full_like(p, v)``, a constant): ops that read nothing but shapes and dtypes, or
   constants. Those nodes are evaluated on real tensors, so the state is made as the
   optimizer would make it, and put into the optimizer. A value read from the batch or
   a gradient (SGD's momentum buffer is the first gradient) is not made this way: the
   step keeps its first program, from the trace of step 1.
3. The step is traced again, now finding the state: the steady step. It is used only
   if it is the first trace with the made tensors read as inputs: the same ops in the
   same order on the same arguments, the same constants, the same outputs by name, and
   no other difference the capture records. Then the steady program, fed the made
   state, computes exactly what the first call's program would have, and it is the one
   program compiled. Otherwise the state is taken out again and the first trace goes on
   as before (NOTE: [capture in two traces]).

Tensors the step reads from outside its arguments (NOTE: [tensors read from outside the
arguments]) are part of what is compared: the same objects at the same versions in both
traces (since 2026-12-03; such a step, diffusers' ``scheduler.add_noise`` reading its
``alphas_cumprod``, compiled two programs before: a tiny UNet +44 s).

So an Adam step compiles once, not twice; for torch's Adam and AdamW the first trace is
skipped too (NOTE: [Adam's first state predicted]). Steps with an ``if`` on a tensor value
compile as before. With the persistent compile cache a restart makes the same state from
a state entry and loads the program without tracing (NOTE: [optimizer state made on a
restart]; until the fiftieth session such steps kept both programs instead). If the
compile or the first call fails, the made state is taken out of the optimizer again.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx

from .. import _torch_private as private
from ..errors import SourceLocation, innermost_model_frame_of_stack
from ..ir.graph_utils import output_args, placeholders
from ..ir.signature import Kind, StateRef

# ops whose output depends on their first argument's shape, dtype and device alone
_FROM_METADATA = frozenset({
    "aten::zeros_like", "aten::ones_like", "aten::full_like",
    "aten::new_zeros", "aten::new_ones", "aten::new_full",
})
# ops whose output depends on their arguments' values, which must be made here too
_FROM_VALUES = frozenset({
    "aten::zeros", "aten::ones", "aten::full", "aten::scalar_tensor",
    "aten::lift_fresh_copy", "aten::clone", "aten::_to_copy", "aten::detach", "aten::alias",
})


class _PythonValue:
    """A non-tensor state entry as it was first assigned."""

    def __init__(self, value: Any) -> None:
        self.value = value


class RecordedState(dict):
    """One parameter's optimizer state during capture: notes how each entry was first
    set (the trace node that made a tensor, or the value). A change it cannot see
    entry by entry marks it ``unobserved``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.made: dict[Any, torch.fx.Node | _PythonValue | None] = {}
        self.unobserved = False
        self.removed_at: SourceLocation | str | None = None  # NOTE: [optimizer state removed in the step]

    def __setitem__(self, key: Any, value: Any) -> None:
        if key not in self.made:
            self.made[key] = (
                private.traced_node_of(value) if isinstance(value, torch.Tensor) else _PythonValue(value)
            )
        super().__setitem__(key, value)

    def update(self, *args: Any, **kwargs: Any) -> None:
        self.unobserved = True
        super().update(*args, **kwargs)

    def setdefault(self, *args: Any) -> Any:
        self.unobserved = True
        return super().setdefault(*args)

    def __ior__(self, other: Any) -> Any:  # type: ignore[misc]
        self.unobserved = True
        return super().__ior__(other)


def _removing(base: type, name: str) -> Any:
    """``base``'s method ``name``, which takes entries out, noting the user's line
    (NOTE: [optimizer state removed in the step])."""
    method = getattr(base, name)

    def remove(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.removed_at is None:
            self.removed_at = innermost_model_frame_of_stack() or f"{base.__name__}.{name}()"
        return method(self, *args, **kwargs)

    remove.__name__ = name
    return remove


_REMOVING = ("clear", "pop", "popitem", "__delitem__")
for _name in _REMOVING:
    setattr(RecordedState, _name, _removing(dict, _name))


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


class RecordedStates(defaultdict):
    """An optimizer's ``state`` during capture: each parameter's dict a
    ``RecordedState``; ``before`` holds the keys each parameter had; ``read_by`` where
    code other than the optimizer's own class (``owners``: the files of its classes) and
    this package read the dict (NOTE: [Adam's first state predicted])."""

    def __init__(self, owners: frozenset[str] = frozenset()) -> None:
        super().__init__(RecordedState)
        self.before: dict[int, set[Any]] = {}
        self.unobserved = False
        self.owners = owners
        self.read_by: list[str] = []
        # the traced param groups whose tensors are outputs (NOTE: [tensors held in a param group])
        self.group_tensors: list[tuple[int, str, dict[str, Any]]] = []
        # where the step took entries out, or set ``optimizer.state`` to another dict
        # (NOTE: [optimizer state removed in the step])
        self.removed_at: SourceLocation | str | None = None

    def update(self, *args: Any, **kwargs: Any) -> None:
        self.unobserved = True  # whole dicts set at once, as ``__setitem__`` of a dict
        super().update(*args, **kwargs)

    def setdefault(self, *args: Any) -> Any:
        self.unobserved = True
        return super().setdefault(*args)

    def __setitem__(self, key: Any, value: Any) -> None:
        if not isinstance(value, RecordedState):
            self.unobserved = True  # a whole dict set at once (``self.state[p] = {...}``)
        super().__setitem__(key, value)

    def _read(self) -> None:
        frame = sys._getframe(2)  # the caller of the reading method
        where = frame.f_code.co_filename
        if where not in self.owners and not where.startswith(_PACKAGE):
            self.read_by.append(f"{where}:{frame.f_lineno}")


def _reading(name: str) -> Any:
    """``dict``'s method ``name``, noting the read (``RecordedStates._read``)."""
    method = getattr(defaultdict, name)

    def read(self: RecordedStates, *args: Any, **kwargs: Any) -> Any:
        self._read()
        return method(self, *args, **kwargs)

    read.__name__ = name
    return read


for _name in ("__getitem__", "get", "__contains__", "__iter__", "__len__", "keys", "values",
              "items", "copy", "__repr__"):
    setattr(RecordedStates, _name, _reading(_name))
for _name in _REMOVING:
    setattr(RecordedStates, _name, _removing(defaultdict, _name))


def class_files(obj: Any) -> frozenset[str]:
    """The source files of ``obj``'s classes but ``torch.optim.Optimizer``'s (which
    reads the state for ``state_dict()``) and ``object``'s."""
    files = set()
    for cls in type(obj).__mro__:
        if cls in (torch.optim.Optimizer, object):
            continue
        module = sys.modules.get(cls.__module__)
        where = getattr(module, "__file__", None)
        if where:
            files.add(where)
    return frozenset(files)


@dataclasses.dataclass
class MadeState:
    """The state entries made before the first program: (optimizer index, parameter
    name, key, value)."""

    entries: list[tuple[int, str, Any, Any]]
    predicted: bool = False  # NOTE: [Adam's first state predicted], not traced

    def install(self, bindings: Any) -> None:
        for oi, name, key, value in self.entries:
            bindings.optimizers[oi].state[bindings.params[name]][key] = value
        _refresh(bindings)

    def remove(self, bindings: Any) -> None:
        """Take the made entries out again (of whatever state dict the parameter has
        now: the runtime may have placed it)."""
        for oi, name, key, _ in self.entries:
            state = bindings.optimizers[oi].state
            p = bindings.params[name]
            entries = state.get(p)
            if entries is None:
                continue
            entries.pop(key, None)
            if not entries:
                del state[p]
        _refresh(bindings)

    def without(self, entries: set[tuple[int, str, Any]], bindings: Any) -> MadeState | None:
        """This state but ``entries`` (oi, name, key), which are taken out of the
        optimizers again; None when nothing is left."""
        dropped = MadeState([e for e in self.entries if e[:3] in entries], self.predicted)
        dropped.remove(bindings)
        kept = [e for e in self.entries if e[:3] not in entries]
        return MadeState(kept, self.predicted) if kept else None

    def names(self) -> list[str]:
        return sorted({f"optimizer[{oi}] {key!r}" for oi, _, key, _ in self.entries})

    def recipe(self, bindings: Any) -> list[list[Any]]:
        """The entries as JSON data that ``made_from`` makes again (NOTE: [optimizer
        state made on a restart]). Raises ValueError for an entry it cannot describe."""
        return [_entry_recipe(oi, name, key, value, bindings.params[name]) for oi, name, key, value in self.entries]


# NOTE: [optimizer state made on a restart]
# With the persistent compile cache a restarted job loads its program without tracing
# (NOTE: [cache key before capture] in ``step_key.py``), but the first call of a fresh
# job finds no optimizer state, and the program it loads reads state. So the first job
# also records the state it made (a *state entry*, under the key the call had before
# the state existed), and a restart makes the same state from it, then looks the steady
# program up by the key the call has with the state. The state is described, not
# stored: only entries the capture made from factory ops are made here, and those are
# a uniform fill (zeros, a step counter); each is kept as its shape, strides, dtype,
# device (its parameter's, or the CPU) and the fill's exact value (``float.hex``), or
# as a plain Python value (int, float, bool, str, None). Anything else (a tensor of
# several values, another device, a state key that is not a string) has no state entry:
# such a restart captures, making the state as the first job did.
_PLAIN_TYPES = (int, float, bool, str, type(None))


def _entry_recipe(oi: int, name: str, key: Any, value: Any, param: torch.Tensor) -> list[Any]:
    if type(key) is not str:
        raise ValueError(f"state key {key!r} of {name} is not a string")
    if type(value) in _PLAIN_TYPES:
        return ["value", oi, name, key, float.hex(value) if type(value) is float else value, type(value).__name__]
    if type(value) is not torch.Tensor or value.requires_grad or value.is_complex():
        raise ValueError(f"state {key!r} of {name} is a {type(value).__name__}")
    if value.device == param.device:
        where = "param"
    elif value.device.type == "cpu":
        where = "cpu"
    else:
        raise ValueError(f"state {key!r} of {name} is on {value.device}")
    fill = value.reshape(-1)[0].item() if value.numel() else 0
    made = _filled(list(value.shape), list(value.stride()), value.dtype, value.device, fill)
    if not (torch.equal(made, value) and torch.equal(_bits(made), _bits(value))):
        raise ValueError(f"state {key!r} of {name} holds more than one value")
    encoded = float.hex(fill) if isinstance(fill, float) else int(fill)
    return ["tensor", oi, name, key, list(value.shape), list(value.stride()), str(value.dtype), where, encoded]


def _filled(shape: list[int], stride: list[int], dtype: torch.dtype, device: torch.device, fill: Any) -> torch.Tensor:
    return torch.empty_strided(shape, stride, dtype=dtype, device=device).fill_(fill)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Signs too: ``torch.equal`` holds -0.0 equal to 0.0."""
    return torch.signbit(t) if t.is_floating_point() else t


def made_from(recipe: list[list[Any]], bindings: Any) -> MadeState:
    """The state ``recipe`` describes (``MadeState.recipe``), made for ``bindings``'s
    parameters; not installed. Raises ValueError where the recipe names what is not there."""
    entries: list[tuple[int, str, Any, Any]] = []
    for kind, oi, name, key, *rest in recipe:
        if oi >= len(bindings.optimizers) or name not in bindings.params:
            raise ValueError(f"optimizer {oi} or parameter {name} is not in this step")
        if kind == "value":
            value, type_name = rest
            entries.append((oi, name, key, float.fromhex(value) if type_name == "float" else value))
            continue
        shape, stride, dtype_name, where, fill = rest
        dtype = getattr(torch, dtype_name.removeprefix("torch."))
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {dtype_name}")
        device = bindings.params[name].device if where == "param" else torch.device("cpu")
        value = float.fromhex(fill) if isinstance(fill, str) else fill
        entries.append((oi, name, key, _filled(shape, stride, dtype, device, value)))
    return MadeState(entries)


def _refresh(bindings: Any) -> None:
    # the walk memo's optimizer part and the state dicts it kept describe the old state
    bindings.unchanged = False
    bindings.forget_state_dicts()


class NotPlanned(Exception):
    """Why the state cannot be made before the first program."""


@dataclasses.dataclass
class StatePlan:
    """What the first trace made, and how to check the steady trace against it."""

    graph: torch.fx.GraphModule
    refs: list[StateRef]
    roots: dict[torch.fx.Node, StateRef]  # the node that made each tensor -> its state
    made_nodes: set[torch.fx.Node]  # the nodes that only make the state
    out_refs: list[StateRef]
    side: tuple[Any, ...]  # what else the capture records, compared as is
    made: MadeState

    def differs_from(
        self, graph: torch.fx.GraphModule, refs: list[StateRef], out_refs: list[StateRef],
        side: tuple[Any, ...],
    ) -> str | None:
        """Why the steady trace (``graph`` with inputs ``refs``) is not this first
        trace with the made tensors read as inputs; None when it is."""
        if not _same_side(self.side, side):
            return "the capture recorded other returns, checks or kept values"
        node_of = dict(zip(refs, placeholders(graph), strict=True))
        mapping: dict[torch.fx.Node, torch.fx.Node] = {}
        for node, ref in zip(placeholders(self.graph), self.refs, strict=True):
            if ref not in node_of:
                return f"the steady trace has no input {ref}"
            mapping[node] = node_of[ref]
        for root, ref in self.roots.items():
            target = node_of.get(ref)
            if target is None:
                return f"the steady trace has no input for {ref}"
            if not _same_meta(root.meta.get("val"), target.meta.get("val")):
                return f"{ref} is read as another shape or dtype than it was made"
            mapping[root] = target
        used = set(mapping.values())
        for node in placeholders(graph):
            if node not in used and node.users:
                return f"the steady trace reads {node.name}, which the first did not"
        first = [n for n in self.graph.graph.nodes
                 if n.op not in ("placeholder", "output") and n not in self.made_nodes]
        steady = [n for n in graph.graph.nodes if n.op not in ("placeholder", "output")]
        if len(first) != len(steady):
            return f"{len(first)} ops against {len(steady)}"
        for a, b in zip(first, steady, strict=True):
            reason = _node_differs(a, b, self.graph, graph, mapping)
            if reason:
                return reason
            mapping[a] = b
        firsts = dict(zip(self.out_refs, output_args(self.graph), strict=True))
        steadies = dict(zip(out_refs, output_args(graph), strict=True))
        if set(firsts) != set(steadies):
            return "other outputs"
        for ref, value in firsts.items():
            if not _same_arg(value, steadies[ref], mapping):
                return f"output {ref} differs"
        return None


def _recorded_entries(
    swapped: list[tuple[RecordedStates, dict[str, tuple[int, torch.Tensor]]]],
) -> Iterator[tuple[int, str, int, RecordedState, list[Any]]]:
    """Each parameter's recorded state dict that holds entries, as (optimizer index,
    parameter name, group index, the dict, the keys the trace added to it). Raises
    ``NotPlanned`` where a trace set state the records cannot follow: a whole dict at
    once, entries by ``update()`` / ``setdefault()``, or state taken out (NOTE:
    [optimizer state removed in the step])."""
    for oi, (states, by_param) in enumerate(swapped):
        if states.removed_at is not None:
            raise NotPlanned(f"the step takes optimizer[{oi}].state out ({states.removed_at})")
        if states.unobserved:
            raise NotPlanned("a parameter's whole state dict was set at once")
        for name, (gi, traced_p) in by_param.items():
            entries = dict.get(states, traced_p)  # not a read of the step's
            removed_at = getattr(entries, "removed_at", None)
            if removed_at is not None:
                raise NotPlanned(f"the step takes optimizer[{oi}] state of {name} out ({removed_at})")
            if not entries:
                continue
            if entries.unobserved:
                raise NotPlanned("state set by update() or setdefault()")
            before = states.before.get(id(traced_p), set())
            yield oi, name, gi, entries, [key for key in entries if key not in before]


def plan(
    graph: torch.fx.GraphModule, refs: list[StateRef], out_refs: list[StateRef],
    swapped: list[tuple[RecordedStates, dict[str, tuple[int, torch.Tensor]]]],
    side: tuple[Any, ...],
) -> StatePlan | None:
    """The plan for the state the first trace made (None: it made none). Raises
    ``NotPlanned`` when some of it cannot be made before the program."""
    roots: dict[torch.fx.Node, StateRef] = {}
    python: list[tuple[int, str, Any, Any]] = []
    for oi, name, gi, entries, new in _recorded_entries(swapped):
        for key in new:
            value, made = entries[key], entries.made.get(key)
            if isinstance(value, torch.Tensor):
                if not isinstance(made, torch.fx.Node):
                    raise NotPlanned(f"{key!r} was not made by a traced op")
                if made in roots:
                    raise NotPlanned(f"{key!r} is the same tensor as another entry")
                roots[made] = StateRef(Kind.OPTIM_STATE, name, key, oi, gi)
            elif isinstance(made, _PythonValue) and made.value is value:
                python.append((oi, name, key, value))
            else:
                raise NotPlanned(f"{key!r} changed after it was set")
    if not roots and not python:
        return None
    made_nodes: set[torch.fx.Node] = set()
    values = _Evaluator(graph, made_nodes)
    tensors = [(ref.optimizer, ref.name, ref.key, values(root)) for root, ref in roots.items()]
    return StatePlan(graph, refs, roots, made_nodes, out_refs, side, MadeState(tensors + python))


class _Evaluator:
    """Evaluate the nodes that make a state tensor on real tensors, noting each."""

    def __init__(self, graph: torch.fx.GraphModule, seen: set[torch.fx.Node]) -> None:
        self.graph, self.seen = graph, seen
        self.values: dict[torch.fx.Node, Any] = {}

    def __call__(self, node: torch.fx.Node) -> torch.Tensor:
        with torch.no_grad():
            value = self._value(node)
        if not isinstance(value, torch.Tensor) or not _same_meta(value, node.meta.get("val")):
            raise NotPlanned(f"{node.name} made another tensor here than in the trace")
        return value

    def _value(self, node: torch.fx.Node) -> Any:
        if node in self.values:
            return self.values[node]
        if node.op == "get_attr":
            value = getattr(self.graph, str(node.target))
            if not isinstance(value, torch.Tensor):
                raise NotPlanned(f"{node.name} is not a tensor constant")
            value = value.clone()
        elif node.op == "call_function" and private.is_op_overload(node.target):
            op: Any = node.target
            name = op._schema.name
            if name in _FROM_METADATA:
                first = _stand_in(node.args[0])
                args = [first, *[self._argument(a) for a in node.args[1:]]]
            elif name in _FROM_VALUES:
                args = [self._argument(a) for a in node.args]
            else:
                raise NotPlanned(f"the state is made by {node.target}")
            kwargs = {k: self._argument(v) for k, v in node.kwargs.items()}
            value = op(*args, **kwargs)
        else:
            raise NotPlanned(f"the state is made from {node.name}")
        self.seen.add(node)
        self.values[node] = value
        return value

    def _argument(self, arg: Any) -> Any:
        if isinstance(arg, torch.fx.Node):
            return self._value(arg)
        if isinstance(arg, (list, tuple)):
            return type(arg)(self._argument(a) for a in arg)
        if isinstance(arg, torch.Tensor):
            raise NotPlanned("a tensor argument outside the graph")
        return arg


def _stand_in(node: Any) -> torch.Tensor:
    """An uninitialized tensor of ``node``'s shape, strides, dtype and device: what an
    op that reads only those is given in its place."""
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor):
        raise NotPlanned("an argument of unknown metadata")
    return torch.empty_strided(tuple(val.shape), tuple(val.stride()), dtype=val.dtype, device=val.device)


def _same_meta(a: Any, b: Any) -> bool:
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return False
    return (tuple(a.shape), a.dtype, a.device) == (tuple(b.shape), b.dtype, b.device)


def _node_differs(
    a: torch.fx.Node, b: torch.fx.Node, graph_a: torch.fx.GraphModule, graph_b: torch.fx.GraphModule,
    mapping: dict[torch.fx.Node, torch.fx.Node],
) -> str | None:
    where = f"{a.name} ({a.target}) against {b.name} ({b.target})"
    if a.op != b.op:
        return where
    if a.op == "get_attr":
        ta, tb = getattr(graph_a, str(a.target)), getattr(graph_b, str(b.target))
        if not (isinstance(ta, torch.Tensor) and isinstance(tb, torch.Tensor)):
            return where
        if not _same_meta(ta, tb) or not torch.equal(ta, tb):
            return f"constant {where}"
        return None
    if a.op != "call_function" or a.target is not b.target:
        return where
    if not _same_arg(a.args, b.args, mapping) or not _same_arg(a.kwargs, b.kwargs, mapping):
        return f"arguments of {where}"
    va, vb = a.meta.get("val"), b.meta.get("val")
    if isinstance(va, torch.Tensor) != isinstance(vb, torch.Tensor):
        return f"the result of {where}"
    if isinstance(va, torch.Tensor) and not _same_meta(va, vb):
        return f"the result's shape or dtype of {where}"
    return None


_PLAIN = (int, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def _same_arg(a: Any, b: Any, mapping: dict[torch.fx.Node, torch.fx.Node]) -> bool:
    if isinstance(a, torch.fx.Node):
        return isinstance(b, torch.fx.Node) and mapping.get(a) is b
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_arg(x, y, mapping) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_arg(a[k], b[k], mapping) for k in a)
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, slice):
        return _same_arg((a.start, a.stop, a.step), (b.start, b.stop, b.step), mapping)
    if isinstance(a, _PLAIN) or a is Ellipsis:
        return a == b
    if callable(a):  # an op, a function
        return a is b
    return False


def _same_side(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    try:
        return len(a) == len(b) and all(x == y for x, y in zip(a, b, strict=True))
    except Exception:  # noqa: BLE001 - something that cannot be compared is not the same
        return False


# NOTE: [Adam's first state predicted]
# Making the state from a first trace (NOTE: [optimizer state made before the first
# program]) costs that trace: a third of a compile, most of it the optimizer's own update
# ops (GPT-2, 8 layers: 59% of the captured nodes are AdamW's per-parameter update). For
# torch's Adam and AdamW (those exact classes) the state their first step makes is known
# without tracing: ``_init_group`` gives each parameter with a gradient, on the capturable
# path the capture takes (torch 2.11 to 2.14, one code): ``step``, a 0-d zero on the
# parameter's device (float64 in the trace: NOTE: [float64 step counters]), and
# ``exp_avg``, ``exp_avg_sq`` (and ``max_exp_avg_sq`` with ``amsgrad``), zeros shaped like
# the parameter; no other line of their first step differs from a later one's. So that
# state is put in and the steady step traced once. It is the step's program only when
# the trace shows the prediction changed nothing but the state Adam read:
# 1. each parameter's predicted entries are read by ops of the trace (Adam found and
#    used them), or none of them is read but as the trace's outputs: a parameter
#    without a gradient, or a call that does not step (gradient accumulation), whose
#    state Adam does not make. Those entries are taken out of the trace's inputs and
#    outputs and out of the optimizer (``trace._drop_unread_state``): nothing read them,
#    so the trace is the one taken without them;
# 2. the trace made no state of its own, and kept no values or checks;
# 3. no code but the optimizer's own classes and this package read the state dicts
#    (``RecordedStates.read_by``: a step asking ``len(opt.state)`` or calling
#    ``opt.state_dict()`` would see the predicted state where its first eager call sees
#    none). The trace's inputs differ from a first trace's in the state dicts alone, so
#    code that reads none of them runs the same both ways;
# 4. the step took no state out (``clear``, ``pop``, ``del``, ``popitem``, or
#    ``optimizer.state`` set to a new dict): entries it threw away are read by nothing
#    either, but are not a parameter Adam skipped (NOTE: [optimizer state removed in
#    the step]).
# Otherwise the state is taken out and the two traces go on as before. A dict kept from
# before the call (``s = opt.state`` at module level, read inside the step) is not seen
# by 3. ``tests/sim/test_adam_state_predicted.py`` compares the predicted state and the
# program with what the first trace makes, for each setting of these optimizers.
_PREDICTED = (torch.optim.Adam, torch.optim.AdamW)


def predicted(bindings: Any) -> MadeState | None:
    """The state torch's Adam / AdamW make on their first step, for each parameter that
    requires grad; None when some optimizer is another, has state, or takes a path
    this does not know."""
    entries: list[tuple[int, str, Any, Any]] = []
    for oi, opt in enumerate(bindings.optimizers):
        if type(opt) not in _PREDICTED or any(opt.state.values()):  # an empty dict is no state
            return None
        for group in opt.param_groups:
            if group.get("differentiable"):
                return None
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                name = bindings.param_name(p)
                # the trace's stand-in of ``p`` is contiguous (``trace._fake``)
                like = {"dtype": p.dtype, "device": p.device}
                entries.append((oi, name, "step", torch.zeros((), dtype=torch.float64, device=p.device)))
                entries.append((oi, name, "exp_avg", torch.zeros(p.shape, **like)))
                entries.append((oi, name, "exp_avg_sq", torch.zeros(p.shape, **like)))
                if group["amsgrad"]:
                    entries.append((oi, name, "max_exp_avg_sq", torch.zeros(p.shape, **like)))
    return MadeState(entries, predicted=True) if entries else None


def prediction_differs(
    made: MadeState, graph: torch.fx.GraphModule, refs: list[StateRef],
    swapped: list[tuple[RecordedStates, dict[str, tuple[int, torch.Tensor]]]],
) -> tuple[str | None, set[tuple[int, str, Any]]]:
    """Why the steady trace (``graph``, inputs ``refs``, the optimizers' state dicts
    ``swapped``) does not show ``made`` to be the first step's state (None when it
    does), and the entries of the parameters the optimizer did not step, which nothing
    read: those the first step does not make (NOTE: [Adam's first state predicted])."""
    for oi, (states, _) in enumerate(swapped):
        if states.read_by:
            return f"optimizer[{oi}].state is read at {states.read_by[0]}", set()
    try:
        for oi, name, _gi, _entries, new in _recorded_entries(swapped):
            if new:
                return f"the trace made optimizer[{oi}] state of {name}", set()
    except NotPlanned as exc:
        return str(exc), set()
    read = {
        (ref.optimizer, ref.name, ref.key)
        for ref, node in zip(refs, placeholders(graph), strict=True)
        # read by an op: every state tensor also leaves the trace as an output
        if ref.kind is Kind.OPTIM_STATE and any(user.op != "output" for user in node.users)
    }
    read_of: dict[tuple[int, str], set[bool]] = defaultdict(set)
    for oi, name, key, _ in made.entries:
        read_of[(oi, name)].add((oi, name, key) in read)
    for (oi, name), seen in read_of.items():
        if len(seen) > 1:
            return f"optimizer[{oi}] read part of the state of {name}", set()
    unread = {(oi, name, key) for oi, name, key, _ in made.entries if (oi, name, key) not in read}
    return None, unread
