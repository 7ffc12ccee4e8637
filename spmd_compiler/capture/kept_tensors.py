"""Tensors a train step keeps in Python objects: replayed after every call, or refused.

NOTE: [tensors the step keeps]
A step may store a tensor where Python code reads it after the call: a module attribute
(``self.last_hidden = h.detach()`` in ``forward``, an auxiliary loss ``self.aux_loss``),
an entry of a dict (a forward hook's ``activations[name] = out``), an attribute of an
object argument (``logger.last = loss``), or an item appended to a list or a
``collections.deque`` (``history.append(loss.item())``; a deque since the sixty-third
session: before, it kept the capture's placeholders). Traced, that Python runs once, at capture, and stores
a fake tensor: the program never stores again, and the user later finds a
``FakeTensor`` (or the same stale entry) where eager has the call's value.

So while the step is traced, the places a step can reach are snapshotted (shallowly)
before the call and compared after it:
- every submodule of the step's modules (its ``__dict__`` without nn.Module's own
  entries), and the dicts, lists and plain objects it holds;
- object arguments of the step (pytree leaves that are neither tensors, modules nor
  optimizers) and what they hold;
- each optimizer of the step (its ``__dict__`` without torch's own entries: a custom
  optimizer's ``self.last_norm`` set in its ``step``);
- the globals and closure cells named by the step function, by the ``forward`` of the
  modules' own classes and the methods they name, by hooks registered on the modules,
  by each optimizer's step pre- and post-hooks, by torch's global module and optimizer
  hooks (``register_module_forward_hook``, ``register_optimizer_step_pre_hook``), by a
  user's optimizer class's ``step``, and by the functions those reach (as NOTE: [guards
  on Python values] finds them), and the objects a bound method, a ``functools.partial``
  or a callable object among them carries (NOTE: [hooks bound to objects]); dicts,
  lists and plain objects among them, and what they hold, and a module among them that
  is not one of the step's (a closure or global metric module holding no parameters),
  walked as a plain object with its submodules and buffers (NOTE: [modules the step
  reaches beside its own]),
each to ``DEPTH`` levels. (Until the fifty-ninth session the optimizers, their hooks,
their ``step`` and torch's global hooks were not walked: a step pre-hook's
``log["grad_norm"] = norm`` held the capture's ``FakeTensor`` after every call, with no
error, and its ``norms.append(norm.item())`` was refused as a Python value changed
every run.) A traced tensor (or a returned-style ``.item()``, NOTE:
[returned .item() values]) that appeared there is kept:
- set as an attribute or a dict entry, or appended to a list or deque (nothing else in
  it changed; a deque's ``maxlen`` may have dropped its first items): it becomes one
  more output of the program, and after every call the runtime sets the attribute /
  entry to the call's value, or appends it, the global value as a returned tensor is
  (``.item()`` of it for an ``.item()``); such a list is not guarded, and a step that
  also reads it is refused (NOTE: [lists the step appends to and reads]);
- a new list, tuple or dict of traced values (nothing else in it) set as an attribute or
  a dict entry (torchvision RAFT's ``self.corr_pyramid = [corr]``, grown by appends and
  read back in the same forward; a hook's ``self.maps = {"a": x, "b": y}``): each value
  is one more output, and after every call the runtime sets a new container of the same
  type holding the call's values (``KeptTensor.part``; since the forty-third session, the
  step was refused before);
- anywhere else (a list changed otherwise, a container holding other objects or other
  containers): the step is refused, naming where; except a module's new list of its own
  parameters and buffers (``nn.LSTM._flat_weights``, rebuilt by its forward when the
  parameters were swapped for the trace's), which is the module's state, not a kept value.
A dict or list argument reaches the traced step as a copy (pytree rebuilds it), so its
entries are set in the caller's container at the same place of the call's arguments;
a Python value written there is refused (NOTE: [Python values written into arguments]).
Either way the traced objects are put back as they were before the trace, so a failed
capture leaves no fake tensor behind, and the guards are made on the objects without
the attributes and entries the step creates: the first call stores them, so the second
call finds one more attribute or entry and is traced again (once; on the values the
first call stored). A step that reads back on a later call a tensor it keeps (a hook
clipping against ``state["prev"]``, ``if hasattr(model, "prev"): ... model.prev``, a
trainer's ``getattr(self, "ema", None)``, ``opt.prev_norm``, a forward's ``self.cache``)
is refused then, naming the place and the line of the read (``refuse_kept_read_back``):
the program would hold it as a constant every call replaces. A Python number it keeps
(``model.last = loss.item()``, a float argument ``model.last_w = w``) read back is a
Python value the guards read, as any: each new value compiles (warned), as eager
computes. Before the fifty-ninth session a global or closure dict's entry read back ran
the program traced without it silently (parameters 1.35 relative off eager after 4
calls), or, from an optimizer hook, the call was refused naming only the step's line;
before the sixtieth an attribute the step created on a module, an optimizer or an
object argument held a meta tensor of its shape while the guards were made, so the
second call matched them and ran the first call's program, traced without the
attribute, on every call, silently (parameters 0.012 off eager after 4 calls for
``hasattr(model, "prev")``, 0.036 for ``opt.prev_norm``; losses 2.61 off for a kept
``.item()``). Targets are found again on each
call (modules by FQN, object arguments by position), so a new logger object per call
gets the value. What is not seen: objects deeper than ``DEPTH``, objects reached only
through other calls (a method of a library object), a global name the step rebinds
(``global last; last = loss``: module globals are read, not snapshotted), and torch's
own state; a
``print`` of a traced value is NOTE: [Python effects at capture].
Costs: each kept tensor is one output of the program, made global every call (an
all-gather of a batch-sharded activation on real ranks); a step that creates a tensor
attribute or entry is compiled twice, on its first and second calls (often anyway: an
optimizer's state made on the first call; with plain SGD, a 3-layer 64-wide MLP's
second call took 0.93 s instead of 0.09 s under ``sc.simulate``); a Python number only
stored is no guard, and compiles once (NOTE: [kept numbers only written] in
``guards.py``).
"""

from __future__ import annotations

import collections
import functools
import inspect
import operator
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from .. import _torch_private as private
from ..errors import SPMDCompileError, node_error
from .appended_lists import append_line
from .bindings import StepBindings
from .code_names import global_names_in, names_in, strings_in
from .containers import distribution_object, traced_inside
from .guards import functions_of, own_record
from .outside_tensors import FoundTensor
from .plain_objects import (
    attributes,
    plain_object,
    reads_its_own_way,
    skipped_function,
    skipped_module,
    stdlib_module,
)
from .traced_items import TracedItem

DEPTH = 2
# the list types whose appends the runtime repeats (``_Holder`` kind "list")
_LISTS = (list, collections.deque)
_MISSING = object()
# What an nn.Module keeps in its __dict__ for itself (hooks, parameters, flags).
_MODULE_OWN = frozenset(torch.nn.Module().__dict__) | {"training"}
_HOOK_DICTS = (
    "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
)


_OPTIMIZER_HOOK_DICTS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")



def _optimizer_own() -> frozenset[str]:
    """What torch's ``Optimizer`` keeps on every optimizer object (its state, groups,
    hooks), and what an LR scheduler puts there. Made at import: a probe optimizer made
    while the step is traced would be one the step made (its parameter a fake tensor)."""
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    return frozenset(vars(probe)) | {"step", "_opt_called"}


_OPTIMIZER_OWN = _optimizer_own()


def is_traced(value: Any) -> bool:
    """A fake tensor of a trace, or a traced ``.item()``."""
    return isinstance(value, TracedItem) or private.is_fake(value)


def _leaks(value: Any) -> bool:
    """A traced value, or a container (at any depth: NOTE: [no fake tensor left behind]),
    distribution or module (NOTE: [modules made in the step and kept]) holding one; for
    a value new in its place (a module the step's own holds its traced parameters while
    the step is traced)."""
    return (
        is_traced(value) or _holds_traced(value) or _traced_distribution(value) or _traced_within(value)
        or _traced_module(value) is not None
    )


# NOTE: [modules made in the step and kept]
# A module the step makes and keeps on an object it reaches (a trainer's ``self.fast =
# copy.deepcopy(self.model)`` for an inner loop, ``self.head = nn.Linear(...)`` built on
# the first call) is made while the step is traced: its parameters and buffers are the
# trace's fake tensors. The kept-value walk looked into lists, dicts and plain objects
# only, so the module stayed after every call holding ``FakeTensor`` parameters (its
# forward then failed with "DataDependentOutputException: aten._local_scalar_dense",
# and a copy the step reads back on a later call would be the capture's). A compiled
# step runs no Python after capture: it cannot make the module anew each call. Such a
# module (also in a list, tuple or dict the step stores or appends, to ``DEPTH`` levels)
# is refused, naming the place, and the place is put back as it was.


def _traced_module(value: Any, depth: int = 4) -> torch.nn.Module | None:
    """The module holding a traced parameter, buffer or tensor attribute in ``value`` (a
    module, or a list, tuple, deque or dict of them, to ``depth`` levels), or None."""
    if depth <= 0:
        return None
    if isinstance(value, torch.nn.Module):
        held = [*value.parameters(), *value.buffers()]
        held += [v for m in value.modules() for v in vars(m).values() if isinstance(v, torch.Tensor)]
        return value if any(is_traced(t) for t in held) else None
    if isinstance(value, (tuple, list, collections.deque)):
        items: Any = value
    elif isinstance(value, dict):
        items = value.values()
    else:
        return None
    return next((m for v in items if (m := _traced_module(v, depth - 1)) is not None), None)


def _traced_within(value: Any, depth: int = 4) -> bool:
    """NOTE: [no fake tensor left behind]
    Whether a traced value sits in ``value``: in its lists, tuples, sets, deques and
    dicts, and the attributes of plain objects among them, to ``depth`` levels. The
    kept-value walk compares each place it visits with its snapshot; a value it does not
    replay (a dict of dicts, ``meter.last["nested"] = {"outer": {"logits": t}}``) must
    not stay behind either: ``collect`` refuses it, naming the place, and ``restore``
    puts the place back. The same holds for a container the walk met at its depth limit
    and did not snapshot (its entries are not compared): a traced value found in it
    after the step is refused, and ``restore`` takes it out (the entry removed: what it
    replaced was not recorded). Before the sixty-fifth session both held the capture's
    ``FakeTensor`` after every call, with no error."""
    if is_traced(value):
        return True
    if depth <= 0 or isinstance(value, (torch.Tensor, str, bytes, int, float)):
        return False
    if isinstance(value, (tuple, list, set, frozenset, collections.deque)):
        return any(_traced_within(v, depth - 1) for v in value)
    if isinstance(value, dict):
        return any(_traced_within(v, depth - 1) for v in value.values())
    if plain_object(value):
        return any(_traced_within(v, depth - 1) for v in attributes(value).values())
    return False


def _scrub(value: Any, depth: int = 4) -> None:
    """Take the traced values out of what ``_traced_within`` looks into."""
    if depth <= 0 or is_traced(value):
        return
    if type(value) in _LISTS:
        items = [v for v in value if not is_traced(v)]
        if len(items) != len(value):
            value.clear()
            value.extend(items)
        held: Any = list(value)
    elif isinstance(value, dict) and not reads_its_own_way(type(value)):
        for key in [k for k, v in value.items() if is_traced(v)]:
            del value[key]
        held = list(value.values())
    elif plain_object(value) and not isinstance(value, (tuple, frozenset, set)):
        store = attributes(value)
        for key in [k for k, v in store.items() if is_traced(v)]:
            del store[key]
        held = list(store.values())
    else:
        return
    for v in held:
        _scrub(v, depth - 1)


def _traced_distribution(value: Any) -> bool:
    """NOTE: [kept distributions]
    A ``torch.distributions`` object the step keeps (``model.last_dist =
    Categorical(logits=out.detach())``, ``HOLD.d = ...`` of a global object, a dict
    entry), or a tuple / list / dict of them, holding a value of the trace: refused as a
    returned one is (NOTE: [returned distributions] in ``containers.py``), naming the
    place. Before 2026-12-06 the walk of kept values skipped torch's objects, so after
    every compiled call the attribute held the capture's distribution: ``d.logits`` a
    ``FakeTensor``, ``d.entropy()`` a ``FakeTensor``, no error. Storing it anew each
    call would need each class's way of deriving its attributes; the step keeps the
    tensors instead (stored after every call) and the caller builds the distribution."""
    if isinstance(value, (tuple, list)):
        return any(_traced_distribution(v) for v in value)
    if isinstance(value, dict):
        return any(_traced_distribution(v) for v in value.values())
    return distribution_object(value) and traced_inside(value, is_traced) is not None


def _where(step: str, key: Any) -> str:
    return f".{key}" if step == "attr" else f"[{key!r}]"


@dataclass(eq=False)
class KeptTensor:
    """One place a step stores a traced value, set again after every call.

    Attributes:
        root: how the object holding it is found on a call: ``("module", mi, fqn)``,
            ``("optimizer", oi)``, ``("arg", position in flat_args)`` (an object
            argument), ``("call",)`` (the
            call's ``(args, kwargs)``: a dict or list argument) or ``("live", obj)`` (a
            global or closure object, held by reference).
        path: attribute names / dict keys from the root to the container.
        how: "attr" (set an attribute), "key" (set a dict entry) or "append".
        key: the attribute name or dict key ("append": None).
        index: the RETURN output holding the value (set by the tracer).
        as_item: the step stored ``.item()`` of it, or the value stands for a Python
            number (a float argument, a group value: NOTE: [kept Python numbers]).
        as_int: it stands for an int group value (``int(.item())``).
        label: where, for messages and logs.
        part: for a value in a container the step set (a new list, tuple or dict):
            ``(type, slot, i, n)``, the container's type, the value's index or key, its
            place among the ``n`` values; the first makes the container, the last of a
            tuple freezes it.
    """

    root: tuple
    path: tuple[tuple[str, Any], ...]
    how: str
    key: Any
    label: str
    as_item: bool = False
    as_int: bool = False
    index: int = -1
    part: tuple[type, Any, int, int] | None = None

    def __post_init__(self) -> None:
        own_record(self)  # its root holds a global or closure object: no read of it by the user

    def held_in(self) -> tuple[tuple, ...]:
        """The tuple by which it holds the user's object (``guards.own_record``)."""
        return (self.root,)

    def container(self, bindings: StepBindings) -> Any:
        if self.root[0] == "module":
            obj: Any = bindings.modules[self.root[1]].get_submodule(self.root[2])
        elif self.root[0] == "optimizer":
            obj = bindings.optimizers[self.root[1]]
        elif self.root[0] == "arg":
            obj = bindings.flat_args[self.root[1]]
        elif self.root[0] == "call":
            obj = bindings.call
        else:
            obj = self.root[1]
        for how, key in self.path:
            obj = getattr(obj, key) if how == "attr" else obj[key]
        return obj

    def write(self, bindings: StepBindings, value: Any) -> None:
        """Store this call's value where the step stored it."""
        if self.as_int:
            value = int(value.item())
        self.store(bindings, value.item() if self.as_item else value)

    def store(self, bindings: StepBindings, value: Any) -> None:
        target = self.container(bindings)
        if self.how == "append":
            target.append(value)
            return
        if self.part is not None:
            kind, slot, i, n = self.part
            if i == 0:  # a new container every call, as the step makes one
                self._set(target, {} if kind is dict else [None] * n)
            held = getattr(target, self.key) if self.how == "attr" else target[self.key]
            held[slot] = value
            if i == n - 1 and kind is tuple:
                self._set(target, tuple(held))
            return
        self._set(target, value)

    def _set(self, target: Any, value: Any) -> None:
        if self.how == "attr":
            setattr(target, self.key, value)
        else:
            target[self.key] = value


@dataclass
class _Holder:
    obj: Any
    kind: str  # "object" (its __dict__), "dict" or "list"
    root: tuple
    path: tuple[tuple[str, Any], ...]
    label: str
    last: bool = False  # at the walk's depth: what it holds is not walked (``_unwalked``)
    before: Any = None

    def storage(self) -> Any:
        """The dict the entries live in (an object's ``__dict__``, or its slots:
        ``attributes``)."""
        return attributes(self.obj) if self.kind == "object" else self.obj

    def entries(self) -> Any:
        if self.kind == "object":
            d = attributes(self.obj)
            if isinstance(self.obj, torch.nn.Module):
                return {k: v for k, v in d.items() if k not in _MODULE_OWN}
            if isinstance(self.obj, torch.optim.Optimizer):  # its state is the program's
                return {k: v for k, v in d.items() if k not in _OPTIMIZER_OWN}
            return d
        return self.obj


class KeptTensors:
    """Snapshot of what a step can reach (see the NOTE); ``collect`` after the step ran,
    ``restore`` always."""

    def __init__(self, func: Callable[..., Any], bindings: StepBindings, traced_call: Any) -> None:
        self.holders: list[_Holder] = []
        self.kept: list[tuple[KeptTensor, Any]] = []
        # id(tensor) -> each place it was found (where, its dict or closure cell, key):
        # NOTE: [tensors read from outside the arguments]; NOTE: [every place a constant
        # is read from]
        self.outside: dict[int, list[FoundTensor]] = {}
        # id -> (an outside leaf that requires grad, its .grad before the trace)
        self._grads_before: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        # id(tensor) -> which module's state it is and where the module was found, for a
        # module the walk meets that is not one of the step's (NOTE: [modules read by name
        # beside the given ones])
        self.unplaced: dict[int, str] = {}
        self._state_modules = {id(sub) for mod in bindings.modules for sub in mod.modules()}
        # the modules the walk met beyond the step's own (NOTE: [hooks a refused step
        # registered] puts back their hooks)
        self.reached_modules: dict[int, torch.nn.Module] = {}
        self.where: str | None = None  # the step's line, for the refusals of ``collect``
        self._seen: set[int] = set()
        self._seen_code: set[int] = set()
        self._codes: list[types.CodeType] = []  # the code walked, for the line of an append
        # NOTE: [tensors of modules and classes read by name]: the user's modules and
        # classes the walked code loads (each with its label and the names looked up in
        # it so far), and every name the walked code reads
        self._namespaces: dict[int, tuple[Any, str, set[str]]] = {}
        self._read_names: set[str] = set()
        # id(tensor) -> a class attribute the code names that a base class holds, for
        # the refusal (NOTE: [tensors of modules and classes read by name])
        self.inherited: dict[int, str] = {}
        for mi, mod in enumerate(bindings.modules):
            for fqn, sub in mod.named_modules():
                name = (f"{mi}." if len(bindings.modules) > 1 else "") + (fqn or "<root>")
                self._visit(sub, ("module", mi, fqn), (), f"module {name} ({type(sub).__name__})", DEPTH)
        for oi, opt in enumerate(bindings.optimizers):
            name = f"optimizer[{oi}] ({type(opt).__name__})"
            self._visit(opt, ("optimizer", oi), (), name, DEPTH)
        for i, arg in enumerate(bindings.flat_args):
            if plain_object(arg):
                self._visit(arg, ("arg", i), (), f"argument {i} of the step ({type(arg).__name__})", DEPTH)
        args, kwargs = traced_call
        for i, arg in enumerate(args):
            self._arguments(arg, (("key", 0), ("key", i)), f"the step's argument {i}")
        for name, arg in kwargs.items():
            self._arguments(arg, (("key", 1), ("key", name)), f"the step's argument {name!r}")
        self._functions(func, bindings)
        for h in self.holders:
            h.before = dict(h.entries()) if h.kind != "list" else list(h.obj)

    # -- what the step can reach -------------------------------------------------------
    def _visit(self, obj: Any, root: tuple, path: tuple, label: str, depth: int) -> None:
        if id(obj) in self._seen:
            return
        if type(obj) in _LISTS:
            kind = "list"
        elif isinstance(obj, dict) and not reads_its_own_way(type(obj)):
            kind = "dict"  # else its attributes (NOTE: [containers that read their own way])
        elif isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)) or plain_object(obj):
            kind = "object"
        else:
            return
        self._seen.add(id(obj))
        holder = _Holder(obj, kind, root, path, label, last=depth <= 0)
        self.holders.append(holder)
        if kind == "list":
            for i, value in enumerate(list(obj) if depth > 0 else ()):  # a global list of meters
                if isinstance(value, torch.nn.Module) and id(value) not in self._state_modules:
                    self._module(value, f"{label}[{i}]")
                    self._visit(value, root, (*path, ("key", i)), f"{label}[{i}]", depth - 1)
            return
        step = "attr" if kind == "object" else "key"
        for key, value in list(holder.entries().items()):
            if isinstance(value, torch.Tensor) and root[0] != "call":
                self._outside(value, holder.storage(), key, label + _where(step, key), root[0] == "arg")
            elif isinstance(value, torch.nn.Module):
                self._module(value, label + _where(step, key))
            if depth <= 0 or isinstance(value, torch.Tensor) or id(value) in self._state_modules:
                continue  # the step's modules are visited by FQN; tensors are leaves
            if (type(value) in _LISTS or isinstance(value, (dict, torch.nn.Module))
                    or plain_object(value)):  # NOTE: [modules the step reaches beside its own]
                self._visit(value, root, (*path, (step, key)), label + _where(step, key), depth - 1)
        if isinstance(obj, torch.nn.Module) and id(obj) not in self._state_modules:
            self._reached_module(obj, root, path, label, depth)

    def _reached_module(self, module: torch.nn.Module, root: tuple, path: tuple, label: str, depth: int) -> None:
        """NOTE: [modules the step reaches beside its own]
        A module that is not one of the step's (a metric or loss module with a cache and
        no parameters, which NOTE: [modules read by name beside the given ones] leaves
        out; one held by a plain object, a list or a dict) is walked as a plain object
        is: its ``__dict__`` without nn.Module's own entries (``meter.last["logits"] =
        logits.detach()``, ``meter.prev = ...``, ``meter.history.append(...)``), its
        submodules by attribute name (``meter.inner.cache``), and its buffers' dict
        (``meter.norm = ...`` of a registered buffer lands in ``_buffers``), so what the
        step keeps there is stored after every call, or refused, as for a plain object.
        Until the sixty-fifth session the walk stopped at any module ("visited by FQN"),
        which only the step's own are: a factory's ``make_step(meter)`` closure module,
        a global one, a bound method's ``self`` or a ``functools.partial`` argument held
        the capture's ``FakeTensor`` after every call, with no error (reading it raised
        DataDependentOutputException), and an append to its list was refused as a Python
        value changed every run. Its parameters and buffers stay unread state: a read of
        one is refused (``unplaced``)."""
        if module._buffers:
            self._seen.add(id(module._buffers))
            self.holders.append(_Holder(module._buffers, "dict", root, (*path, ("attr", "_buffers")), label))
        for name, child in module.named_children():  # each at the depth, as the step's are
            if id(child) not in self._state_modules:
                self._visit(child, root, (*path, ("attr", name)), f"{label}.{name}", depth)

    def _arguments(self, node: Any, path: tuple, label: str) -> None:
        """The dicts and lists among the arguments: the step sees copies pytree rebuilt,
        so their targets are the caller's containers at the same path (``bindings.call``)."""
        if type(node) is tuple:
            children: Any = enumerate(node)
        elif type(node) is list or isinstance(node, dict):
            self._visit(node, ("call",), path, label, 0)
            children = node.items() if isinstance(node, dict) else enumerate(node)
        else:
            return
        for key, value in list(children):
            self._arguments(value, (*path, ("key", key)), f"{label}[{key!r}]")

    def _functions(self, func: Any, bindings: StepBindings) -> None:
        starts: list[tuple[types.FunctionType, type | None]] = []
        self._callable(func, "the step's object", starts)
        hook_dicts = [hooks for _, hooks in private.global_hook_dicts()]
        classes: dict[type, None] = {}
        for mod in bindings.modules:
            for sub in mod.modules():
                classes.setdefault(type(sub))
                hook_dicts += [getattr(sub, attr, {}) for attr in _HOOK_DICTS]
        for opt in (*bindings.optimizers, *bindings.wrappers):  # NOTE: [optimizers forwarding to an inner one]
            hook_dicts += [vars(opt).get(attr, {}) for attr in _OPTIMIZER_HOOK_DICTS]
            if not skipped_module(type(opt).__module__):  # a user's step(): self.last_norm = ...
                step = inspect.unwrap(inspect.getattr_static(type(opt), "step", None))
                starts += [(fn, type(opt)) for fn in functions_of(step)]
        for hooks in hook_dicts:
            for hook in list(hooks.values()):
                self._callable(hook, "a hook's object", starts)
        for owner in classes:
            if not skipped_module(owner.__module__):
                starts += [(fn, owner) for fn in functions_of(inspect.getattr_static(owner, "forward", None))]
        for fn, cls in starts:
            self._function(fn, cls)
        self._named_attributes()

    def _named_attributes(self) -> None:
        """NOTE: [tensors of modules and classes read by name]
        The attributes the walked code names (``names_in``: ``cfg.POS_WEIGHT``,
        ``Cfg.POS_WEIGHT``, ``getattr(cfg, "w")``) of the user's modules and classes it
        loads (a config module ``import recsys_cfg as cfg``, a class ``Cfg`` holding
        settings): a tensor is a program constant guarded in the module's or class's
        ``__dict__`` (NOTE: [tensors read from outside the arguments]), as a global
        tensor is in the globals; a function is walked as the step's code (a helper
        ``losses.weighted(out, y)`` reading its own module's global tensor); an object, a
        container, a module or a class is walked on. Only the names some walked code
        reads are looked up (a module's ``__dict__`` holds all it imports), until no
        walked code adds one. Before the sixty-first session a module or class was not
        walked: the step was refused as reading a tensor "from a place the compiled
        step cannot watch", and where the script also held the same tensor as a global
        of the attribute's name (``from cfg import POS_WEIGHT``), the walk took the
        attribute name for that global and guarded it there: ``cfg.POS_WEIGHT = new``
        between calls ran the old program (losses 0.848 where eager gave 0.952, no
        warning). A tensor class attribute inherited from a base class is not guarded in
        the base (a value set on the class later would shadow it unseen): the step is
        refused, naming the attribute and the base (``inherited``), also where the
        step reads the same tensor at a place that is guarded (``Cfg.W`` beside
        ``Sub.W``: that guard does not see ``Sub.W = new``; parameters 5e-2 off eager,
        silently, before a review)."""
        grew = True
        while grew:
            grew = False
            for obj, label, done in list(self._namespaces.values()):
                held = vars(obj)
                for name in sorted((held.keys() & self._read_names) - done):
                    done.add(name)
                    grew = True
                    value = held[name]
                    where = f"attribute {name!r} of {_namespace_name(obj)} ({label})"
                    if isinstance(value, torch.Tensor):
                        self._outside(value, held, name, where)
                    elif isinstance(value, (staticmethod, classmethod)) and isinstance(value.__func__, types.FunctionType):
                        self._function(value.__func__, None)
                    elif isinstance(value, types.FunctionType):
                        self._function(value, None)
                    else:
                        self._reach(value, where)
                if isinstance(obj, type):
                    self._inherited(obj, label, done)

    def _inherited(self, cls: type, label: str, done: set[str]) -> None:
        """The tensors of the bases of ``cls`` that the code names of it (``Cfg.W``
        where ``Base`` holds ``W``): not watched, named in the refusal."""
        for name in sorted(self._read_names - done):
            for base in cls.__mro__[1:]:
                value = vars(base).get(name, _MISSING)
                if value is _MISSING:
                    continue
                if isinstance(value, torch.Tensor) and not is_traced(value):
                    self.inherited.setdefault(
                        id(value), f"attribute {name!r} of class {cls.__qualname__}, inherited from "
                        f"class {base.__qualname__} ({label})",
                    )
                break

    def _callable(self, func: Any, what: str, starts: list[tuple[types.FunctionType, type | None]]) -> None:
        """NOTE: [hooks bound to objects]
        The code a callable runs goes to ``starts``, and the objects it carries are
        walked: a bound method's ``self`` (``opt.register_step_pre_hook(logger.hook)``
        whose ``self.v = norm``), a ``functools.partial``'s arguments, an object with
        ``__call__`` (its own attributes). Until the fifty-ninth session only the
        function under them was walked, and a hook's ``self.v = norm`` held the
        capture's ``FakeTensor`` after every call, silently (eager: the call's norm)."""
        for container, key, value, label in _partial_tensors(func):
            self._outside(value, container, key, f"{label} ({what})")
        fn, carried = _unwrap(func)
        for obj in carried:
            self._reach(obj, f"{type(obj).__name__} ({what})")
        owner = carried[0] if carried and isinstance(func, types.MethodType) else None
        if isinstance(fn, types.FunctionType):
            # the methods a bound method names of its object (``self._norm(...)``) too
            cls = type(owner) if owner is not None and not isinstance(owner, type) else None
            starts.append((fn, cls if cls is not None and not skipped_module(cls.__module__) else None))
        elif plain_object(fn):  # an object with __call__
            self._reach(fn, f"{type(fn).__name__} ({what})")
            starts += [(f, type(fn)) for f in functions_of(inspect.getattr_static(type(fn), "__call__", None))]

    def _function(self, fn: types.FunctionType, cls: type | None) -> None:
        if id(fn.__code__) in self._seen_code or skipped_function(fn):
            return
        self._seen_code.add(id(fn.__code__))
        self._codes.append(fn.__code__)
        names = set(names_in(fn.__code__))
        self._read_names.update(names)
        self._read_names.update(strings_in(fn.__code__))  # getattr(cfg, "pos_weight")
        if cls is not None:
            for name in names:
                for method in functions_of(inspect.getattr_static(cls, name, None)):
                    self._function(method, cls)
        where = f"{fn.__qualname__} ({fn.__code__.co_filename}:{fn.__code__.co_firstlineno})"
        # (value, its dict or closure cell, key, label). The globals the code loads, not
        # every name of ``co_names`` (NOTE: [globals by the bytecode]): the attribute read
        # ``cfg.POS_WEIGHT`` is no read of a script's global ``POS_WEIGHT``, and finding
        # the tensor there guarded the global, not ``cfg.POS_WEIGHT`` (NOTE: [tensors of
        # modules and classes read by name])
        values: list[tuple[Any, Any, Any, str]] = [
            (fn.__globals__.get(n, _MISSING), fn.__globals__, n, f"global {n!r} read by {where}")
            for n in global_names_in(fn.__code__) if n.isidentifier()
        ]
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True):
            try:
                values.append((cell.cell_contents, cell, None, f"closure value {name!r} of {where}"))
            except ValueError:
                continue
        # NOTE: [tensors read from outside the arguments]: a tensor default argument
        # (``def step(model, opt, x, y, w=W0)``, a helper's ``def weighted(out, y, w=W0)``)
        # is read as a global is, guarded at ``fn.__defaults__`` / ``fn.__kwdefaults__``
        # (``guards._default_of``: code may assign either whole). Before 2026-12-06 the
        # walk did not look there and the step was refused as reading a tensor from a place
        # the compiled step cannot watch, while the same ``W0`` read as a global compiled.
        for key, name, value in _tensor_defaults(fn):
            self._outside(value, fn, key, f"default of {name!r} of {where}")
        for value, container, key, label in values:
            if isinstance(value, torch.Tensor):
                self._outside(value, container, key, label)
            elif isinstance(value, types.FunctionType):
                self._function(value, None)
            elif value is not _MISSING:
                self._reach(value, label)

    def _outside(
        self, value: torch.Tensor, container: Any, key: Any, label: str, in_argument: bool = False
    ) -> None:
        """A tensor the step may read that is not its argument or its modules' state
        (NOTE: [tensors read from outside the arguments])."""
        if is_traced(value):
            return
        if value.requires_grad and value.is_leaf and not is_traced(value.grad):
            self._grads_before.setdefault(id(value), (value, value.grad))  # NOTE: [gradients of outside leaves]
        places = self.outside.setdefault(id(value), [])
        if not any(p.container is container and p.key == key for p in places):
            places.append(FoundTensor(label, container, key, value, in_argument))

    def _module(self, module: torch.nn.Module, label: str) -> None:
        """A module found outside the step's modules: its state, by tensor, for the
        refusal of a read of it (NOTE: [modules read by name beside the given ones])."""
        if id(module) in self._state_modules:
            return
        self.reached_modules.setdefault(id(module), module)
        what = f"a {type(module).__name__} ({label})"
        for name, p in module.named_parameters():
            self.unplaced.setdefault(id(p), f"parameter {name} of {what}")
        for name, b in module.named_buffers():
            self.unplaced.setdefault(id(b), f"buffer {name} of {what}")

    def _reach(self, value: Any, label: str) -> None:
        if _namespace(value):  # NOTE: [tensors of modules and classes read by name]
            self._namespaces.setdefault(id(value), (value, label, set()))
            return
        if isinstance(value, torch.nn.Module):
            self._module(value, label)
        if isinstance(value, torch.Tensor) or id(value) in self._state_modules:
            return  # the step's modules are visited by FQN
        self._visit(value, ("live", value), (), label, DEPTH)  # NOTE: [modules the step reaches beside its own]

    # -- after the step ----------------------------------------------------------------
    def collect(self, where: str | None = None) -> list[tuple[KeptTensor, Any]]:
        """The traced values the step stored, each with where; refuses the places that
        cannot be replayed (``where``: the step's line, for those messages)."""
        self.where = where
        for h in self.holders:
            if h.kind == "list":
                self._list(h)
                continue
            step = "attr" if h.kind == "object" else "key"
            for key, value in list(h.entries().items()):
                old = h.before.get(key, _MISSING)
                if value is old:
                    if h.last and not isinstance(value, torch.Tensor) and _traced_within(value):
                        raise _refused(  # NOTE: [no fake tensor left behind]
                            h.label + _where(step, key), "deeper than the compiled step looks for kept values",
                            hint="keep the tensor nearer the object the step reads (meter.last = t, "
                            "meter.cache['x'] = t) or return it from the step; the refused call took it out.",
                        )
                    continue
                where = h.label + _where(step, key)
                if _traced_distribution(value):  # NOTE: [kept distributions]
                    kind = type(value).__name__
                    raise _refused(
                        where, (f"a {kind} holding a torch.distributions object" if not distribution_object(value)
                                else f"a torch.distributions {kind}")
                        + " built from a traced tensor: NOTE: [kept distributions]",
                        hint="keep the tensors the distribution is built from instead (model.last_logits = "
                        "out.detach(), stored after every call) and build the distribution from them outside "
                        "the compiled step (Categorical(logits=model.last_logits)); or return them from the step.",
                    )
                if is_traced(value):
                    self.kept.append((KeptTensor(
                        h.root, h.path, step, key, where,
                        as_item=isinstance(value, TracedItem),
                    ), value))
                elif h.root[0] == "call" and not _leaks(value) and not _same_number(value, old):
                    raise _python_write(  # NOTE: [Python values written into arguments]
                        where, self.where,
                        "a tensor from outside the step" if isinstance(value, torch.Tensor) else "a Python value",
                    )
                elif _leaks(value) and not _own_state_cache(h.obj, value):
                    parts = _container_parts(value)
                    for i, (slot, item) in enumerate(parts or ()):
                        self.kept.append((KeptTensor(
                            h.root, h.path, step, key, f"{where}[{slot!r}]",
                            as_item=isinstance(item, TracedItem),
                            part=(type(value), slot, i, len(parts or ())),
                        ), item))
                    if parts:
                        continue
                    if (module := _traced_module(value)) is not None:
                        raise _module_kept(where, module)  # NOTE: [modules made in the step and kept]
                    raise _refused(
                        where, f"a new {type(value).__name__} holding a traced tensor",
                        hint=f"a container the step builds is repeated after the call only "
                        "when it is a list, tuple or dict of tensors and nothing else. If the "
                        "step reads it back itself (a cache), delete it in the step once "
                        f"used (del <owner>{_where(step, key)}), or keep it in a local variable; "
                        "if you need it after the call, return it from the step.",
                    )
        return self.kept

    def _list(self, h: _Holder) -> None:
        now, before = list(h.obj), h.before
        old = set(map(id, before))
        appended = _appended(h.obj, before)
        only_appended = appended is not None and all(is_traced(v) for v in appended)
        appended = appended or []
        containers = [v for v in appended if not is_traced(v) and _leaks(v)]
        if containers:
            if (module := _traced_module(containers[0])) is not None:
                raise _module_kept(h.label, module)  # NOTE: [modules made in the step and kept]
            raise self._containers_appended(h, containers[0])
        if h.root[0] == "call" and not only_appended:  # NOTE: [Python values written into arguments]
            raise _python_write(h.label, self.where, "a change other than appending values the step computes")
        if not any(_leaks(v) and id(v) not in old for v in now):
            return
        if not only_appended:
            raise _refused(h.label, "a list the step changed other than by appending traced tensors")
        for value in appended:
            self.kept.append((KeptTensor(
                h.root, h.path, "append", None, h.label, as_item=isinstance(value, TracedItem),
            ), value))

    def _containers_appended(self, h: _Holder, value: Any) -> SPMDCompileError:
        """NOTE: [containers appended to a kept list]
        Lightning's ``self.validation_step_outputs.append((probs, y))`` (or a dict of
        them) appends a container of traced tensors: the runtime appends tensors (and
        ``.item()`` numbers) after every call, not containers of them, so the step is
        refused. Before the sixty-fourth session the refusal said the list was "changed
        other than by appending" and advised to "append it to a list", which the step
        did, naming no line. It now says to append the tensors, one list per field, and
        names the line of the append where the walked code has exactly one append to
        that name (``appended_lists.append_line``), else the step's."""
        kind = type(value).__name__
        name = h.path[-1][1] if h.path and isinstance(h.path[-1][1], str) else None
        line = append_line([*self._codes, *self._owner_codes(h)], name) if name is not None else None
        return SPMDCompileError(
            f"The train step appends a {kind} holding traced tensors to {h.label}. A "
            "compiled step runs no Python after capture: after every call it appends the "
            "call's tensors (or .item() numbers) to the list, one per append, but not a "
            f"{kind} of them (NOTE: [tensors the step keeps]). Nothing was changed: the "
            "list is as the call found it.",
            user_line=line or self.where,
            hint="append the tensors themselves, one list per field (self.val_probs.append(probs); "
            "self.val_targets.append(y), zipped after the loop, e.g. in on_validation_epoch_end), "
            "or return them from the step ((probs, y) or {'probs': probs, 'target': y}) and "
            "append the returned value outside the compiled step.",
        )

    def _owner_codes(self, h: _Holder) -> list[types.CodeType]:
        """The code of the user's functions of the classes of the objects holding
        ``h``'s list (a LightningModule's ``validation_step``, which a step reaching it
        through an argument calls without the walk seeing it)."""
        owners = [o.obj for o in self.holders if o.kind == "object" and any(v is h.obj for v in o.entries().values())]
        return [
            fn.__code__
            for owner in owners for cls in type(owner).__mro__ if not skipped_module(cls.__module__)
            for value in vars(cls).values() for fn in functions_of(value) if not skipped_function(fn)
        ]

    def restore(self) -> None:
        """Put every traced value back out of the user's objects (see the NOTE)."""
        # NOTE: [gradients of outside leaves]
        # A leaf tensor that requires grad, read from outside the step's modules (SAC's
        # bare ``self.log_alpha = torch.zeros(1, requires_grad=True)``), took the trace's
        # backward into its ``.grad``: a refused capture (such a tensor is refused as a
        # constant, or its optimizer as not given) left a FakeTensor there, which broke
        # the user's next eager use. The program never writes it: its ``.grad`` is put back.
        for tensor, grad in self._grads_before.values():
            if tensor.grad is not grad:
                tensor.grad = grad
        for h in self.holders:
            if h.kind == "list":
                old = set(map(id, h.before))
                if any(_leaks(v) and id(v) not in old for v in h.obj):
                    if isinstance(h.obj, collections.deque):  # its items pushed out by a maxlen too
                        added = [v for v in h.obj if id(v) not in old and not _leaks(v)]
                        h.obj.clear()
                        h.obj.extend([*h.before, *added])
                    else:
                        h.obj[:] = [v for v in h.obj if id(v) in old or not _leaks(v)]
                continue
            for key, value in list(h.entries().items()):
                if value is h.before.get(key, _MISSING) and h.last and not isinstance(value, torch.Tensor):
                    _scrub(value)  # NOTE: [no fake tensor left behind]
                if value is h.before.get(key, _MISSING) or not _leaks(value):
                    continue
                if key in h.before:
                    h.storage()[key] = h.before[key]
                else:
                    del h.storage()[key]


def refuse_kept_read_back(
    gm: torch.fx.GraphModule, outside: list[Any], kept: list[KeptTensor],
    bindings: StepBindings, line: str | None,
) -> None:
    """Refuse a step that reads a tensor from a place it keeps one in (a hook's
    ``state["prev"]`` read back on the next call, adaptive clipping against the last
    norm, ``if hasattr(model, "prev"): ... model.prev``, an EMA of the loss kept as
    ``self.ema``): the program would read it as a constant (NOTE: [tensors read from
    outside the arguments]) that every call replaces, and carrying it from one call to
    the next is not done. The error names the place and the step's line of the read
    (``gm``: the first graph, whose constant it is; ``line``, the step's own, where no
    node reads it)."""
    for o in outside:
        for k in kept:
            if k.how == "append":
                continue
            try:
                target = k.container(bindings)
            except (AttributeError, KeyError, IndexError, TypeError):
                continue
            held = target if k.how == "key" else attributes(target)
            if o.key == k.key and (o.container is held or o.container is target):
                message = (
                    f"The train step reads the tensor it keeps in {k.label} back on a later "
                    "call (the value the call before stored). A compiled step stores that "
                    "tensor after every call (NOTE: [tensors the step keeps]) but cannot "
                    "carry it into the next call's program: it would be a constant of the "
                    "program, replaced every call."
                )
                hint = (
                    "keep the value in a tensor the step updates in place (a module "
                    "buffer made before the first call: self.register_buffer('prev', "
                    "torch.zeros(())); self.prev.copy_(norm)), or pass it to the step as "
                    "an argument and return the new value."
                )
                node = _reading(gm, o.tensor)
                if node is not None:
                    raise node_error(message, node, hint=hint)
                raise SPMDCompileError(message, user_line=line, hint=hint)


def _reading(gm: torch.fx.GraphModule, tensor: torch.Tensor) -> torch.fx.Node | None:
    """The first node that uses the constant ``tensor`` of ``gm`` (for its line)."""
    for node in gm.graph.nodes:
        if node.op == "get_attr" and operator.attrgetter(str(node.target))(gm) is tensor:
            return next(iter(node.users), node)
    return None


def kept_container_ids(kept: list[KeptTensor], bindings: StepBindings) -> frozenset[int]:
    """The lists and deques the step appends to (guards must not compare them across
    calls; a read of one is refused: NOTE: [lists the step appends to and reads])."""
    return frozenset(id(k.container(bindings)) for k in kept if k.how == "append")


def _own_state_cache(owner: Any, value: Any) -> bool:
    """A module's list or tuple of its own parameters and buffers (as swapped in for the
    trace), such as ``nn.LSTM._flat_weights``, which its forward rebuilds when the
    parameters change: a view of the module's state, not a value the step keeps;
    ``restore`` puts the old one back."""
    if not isinstance(owner, torch.nn.Module) or not isinstance(value, (list, tuple)):
        return False
    own = {id(t) for t in (*owner.parameters(recurse=False), *owner.buffers(recurse=False))}
    return all(v is None or id(v) in own for v in value)


def _container_parts(value: Any) -> list[tuple[Any, Any]] | None:
    """``(slot, value)`` of a non-empty list, tuple or dict (exactly those types; a
    dict with str or int keys) of traced values only; None for any other container."""
    if type(value) in (list, tuple) and value and all(is_traced(v) for v in value):
        return list(enumerate(value))
    if type(value) is dict and value and all(
        isinstance(k, (str, int)) and is_traced(v) for k, v in value.items()
    ):
        return list(value.items())
    return None


def _appended(now: list | collections.deque, before: list[Any]) -> list[Any] | None:
    """The items appended to ``now`` since it held ``before``; None if it changed
    otherwise. A deque with a ``maxlen`` drops its first items as items are appended
    (the runtime's appends drop them as eager's do): what is left of ``before`` must
    then be its last items."""
    items = list(now)
    if isinstance(now, collections.deque) and now.maxlen is not None and len(items) == now.maxlen:
        kept = next((n for n in range(len(before), -1, -1)
                     if n <= len(items) and all(a is b for a, b in zip(items, before[len(before) - n:]))), 0)
        return items[kept:] if kept == len(before) or kept < len(items) else None
    if len(items) < len(before) or not all(a is b for a, b in zip(items, before)):
        return None
    return items[len(before):]


def _holds_traced(value: Any) -> bool:
    if isinstance(value, (tuple, list, set, frozenset, collections.deque)):
        return any(is_traced(v) for v in value)
    if isinstance(value, dict):
        return any(is_traced(v) for v in value.values())
    return False


def _unwrap(func: Any) -> tuple[Any, list[Any]]:
    """The function under bound methods and ``functools.partial`` (as the guards'
    ``callable`` walk unwraps them), and the objects they carry: the objects the
    methods are bound to, the partials' arguments (NOTE: [hooks bound to objects])."""
    carried: list[Any] = []
    while isinstance(func, (types.MethodType, functools.partial)):
        if isinstance(func, types.MethodType):
            carried.append(func.__self__)
            func = func.__func__
        else:
            carried += [*func.args, *func.keywords.values()]
            func = func.func
    return func, carried


def _partial_tensors(func: Any) -> list[tuple[Any, Any, torch.Tensor, str]]:
    """NOTE: [tensors bound by a partial]
    The tensors ``functools.partial`` s (under bound methods and partials of partials)
    bind, each with where it is read from: the partial and the position (its positional
    arguments cannot be replaced but by ``__setstate__``; ``guards._read`` reads
    ``partial.args`` anew) or the keyword's name (``step.keywords["mask"] = new``;
    ``partial.keywords`` read anew too: before 2026-12-06 the dict read at capture was
    guarded, and one put whole by ``__setstate__`` ran the old tensor, parameters 0.105
    off eager, silently). Such a
    tensor (``partial(train_step, class_weights)``, ``partial(step, mask=m)``) is read
    as a global tensor is, a constant of the program guarded there (NOTE: [tensors read
    from outside the arguments]): changed in place or replaced between calls, the next
    call compiles anew and computes with the new values. Before 2026-12-06 the walk
    reached what a partial binds only as objects to search, so the step was refused as
    reading a tensor "from a place the compiled step cannot watch"."""
    found: list[tuple[Any, Any, torch.Tensor, str]] = []
    for _ in range(16):
        if isinstance(func, types.MethodType):
            func = func.__func__
        elif isinstance(func, functools.partial):
            found += [(func, i, v, f"argument {i} of the partial") for i, v in enumerate(func.args)
                      if isinstance(v, torch.Tensor)]
            found += [(func, k, v, f"keyword {k!r} of the partial") for k, v in func.keywords.items()
                      if isinstance(v, torch.Tensor)]
            func = func.func
        else:
            break
    return found


def _namespace(value: Any) -> bool:
    """A user's module or class, whose attributes the walk looks up by the names the
    code reads (NOTE: [tensors of modules and classes read by name]): not torch's, this
    compiler's or the standard library's."""
    if isinstance(value, types.ModuleType):
        return not skipped_module(value.__name__) and not stdlib_module(value.__name__)
    if isinstance(value, type):
        return not skipped_module(value.__module__) and not stdlib_module(value.__module__)
    return False


def _namespace_name(value: Any) -> str:
    if isinstance(value, types.ModuleType):
        return f"module {value.__name__}"
    return f"class {value.__qualname__}"


def _same_number(value: Any, old: Any) -> bool:
    """A Python scalar written over an equal one of its type (``d["mode"] = "train"``
    where it was already): the caller's container ends the same either way."""
    return type(value) is type(old) and type(value) in (bool, int, float, str, type(None)) and value == old


def _python_write(where: str, line: str | None, what: str) -> SPMDCompileError:
    """NOTE: [Python values written into arguments]
    A dict or list argument reaches the traced step as a copy pytree rebuilt. A traced
    value the step stores there (``metrics["loss"] = loss.item()``, a tensor) is kept:
    set in the caller's container after every call (NOTE: [tensors the step keeps]).
    Any other write into the copy (a Python value: ``state["micro"] += 1``,
    ``metrics["steps"] = metrics.get("steps", 0) + 1``, a list changed other than by
    appending traced values) ran once, at capture, on the copy: the caller's container
    never saw it, and until the fifty-fifth session it was dropped silently (a
    micro-step counter gating ``opt.step()`` stayed 0 and the optimizer never stepped:
    weights 0.60 relative off after 4 calls). It is refused now, as a write into a
    dataclass or namespace argument is (NOTE: [batch containers]): replaying it exactly
    would need the value recomputed from the container every call, which a program
    that runs no Python cannot do. A value from outside the step (a constant flag, a
    global tensor) is refused too, though the same every call: the key it adds would
    not reach the caller's container either. Writing back an equal Python scalar stays
    allowed, and so does deleting an entry (``inputs.pop("labels")``), which is not
    replayed: the caller's dict keeps the entry eager would have removed."""
    return SPMDCompileError(
        f"The train step writes {what} into {where}: a compiled "
        "step passes a dict or list argument to the traced step as a copy, and runs no "
        "Python after capture, so the write would happen once, on the copy, and never "
        "reach the caller's container (NOTE: [Python values written into arguments]).",
        user_line=line,
        hint="keep the counter or setting outside the compiled step (count calls in the "
        "training loop) or in a tensor (a module buffer); return values from the step; "
        "a tensor or .item() stored in a dict argument is set after every call.",
    )


def _module_kept(where: str, module: torch.nn.Module) -> SPMDCompileError:
    kind = type(module).__name__
    return _refused(
        where, f"a {kind} made in the step, whose parameters and buffers are the trace's tensors: "
        "NOTE: [modules made in the step and kept]",
        hint="keep the module in a local variable (fast = copy.deepcopy(model)), or take it out of "
        f"{where} before the step returns (del self.fast of an attribute, .pop() of a list or dict); "
        "to use its weights after the call, keep tensors instead (self.fast_weights = [p.detach() for p in "
        "fast.parameters()], stored after every call) or return them. A module used across calls is made "
        "outside the step and passed to it. The refused call put the place back as it was.",
    )


def _refused(where: str, what: str, hint: str | None = None) -> SPMDCompileError:
    return SPMDCompileError(
        f"The train step keeps a traced tensor in {where} ({what}). A compiled step runs "
        "no Python after capture, and this is not a place it can store the value of "
        "every call (NOTE: [tensors the step keeps]).",
        hint=hint or "return the value from the step (return loss, {'loss': loss.item()}) "
        "and store it outside the compiled step; or set it as a module attribute, a dict "
        "entry, or append it to a list, which the compiled step repeats every call.",
    )



def _tensor_defaults(fn: types.FunctionType) -> list[tuple[tuple[str, Any], str, torch.Tensor]]:
    """The tensor default arguments of ``fn``: each one's key for ``guards._default_of``
    (``("__defaults__", position)`` or ``("__kwdefaults__", name)``), its parameter's
    name and the tensor."""
    found: list[tuple[tuple[str, Any], str, torch.Tensor]] = []
    parameters = fn.__code__.co_varnames[: fn.__code__.co_argcount]
    positional = fn.__defaults__ or ()
    for position, value in enumerate(positional):
        if isinstance(value, torch.Tensor):
            found.append((("__defaults__", position), parameters[len(parameters) - len(positional) + position], value))
    for name, value in (fn.__kwdefaults__ or {}).items():
        if isinstance(value, torch.Tensor):
            found.append((("__kwdefaults__", name), name, value))
    return found

__all__ = [
    "KeptTensor", "KeptTensors", "is_traced", "kept_container_ids",
    "refuse_kept_read_back",
]
