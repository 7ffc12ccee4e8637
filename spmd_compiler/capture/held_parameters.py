"""The user's parameters reached, while the step is traced, through references held outside
its modules.

NOTE: [parameters held outside the modules]
The trace runs the step on stand-ins swapped into the modules, so code that reaches a
parameter through a reference it holds from before the call (Spinning Up's SAC / TD3:
``q_params = list(ac.q.parameters())`` made once, then ``for p in q_params:
p.requires_grad = False`` around the actor loss's backward and ``= True`` after it)
acts on the user's parameter object, which the program neither reads nor trains. Before
the sixty-eighth session such a freeze set back within the step passed the check of
NOTE: [requires_grad set in the step] (it compares each parameter's flag before and
after the trace only), and call 0 silently trained the critic with the actor loss's
gradient (SGD 0.1, float64, 2 simulated ranks: ``q.2.bias`` 1.0e-1 off eager, the lr
times one); ``p.grad = None`` and ``clip_grad_norm_(q_params, c)`` through the list
acted on the user's empty ``.grad`` and left the program's gradients alone (4.3e-2 off
eager). Call 1, on the held ``ReplacedParameter`` objects (NOTE: [replaced parameters
held outside the step]), was refused with an unrelated hint, or failed (KeyError).
While the step's own code runs, this mode is the innermost: any torch function on one of
the step's parameters, or on a ``ReplacedParameter`` whose replacement is one, other
than a read of its metadata (``shape``, ``stride()``, ``is_contiguous()``: since the
sixty-ninth session these too), is refused before it runs, naming the line: the flag,
the gradient and the values are as the user left them. Reading ``requires_grad``
answers the stand-in's flag (what eager's object reads, a freeze through the modules
included). Mapping the held object to its stand-in instead would have to hold on every
later call too, through the retired objects, and for every use (a gradient read, a
computation), so the uses are refused and the module form is named, which compiles and
matches eager. The hint fits the use (since the sixty-ninth session; before, every use
got Spinning Up's gradient examples, an EMA's ``_foreach_lerp_`` and a tied weight read
in forward too): the module's own ``.parameters()`` for a gradient or an in-place update
in the step, the module's attribute for a read of the values; the parameter is named
as the user knows it (``ShownName``: "'0.weight' of `ema`", not "1.0.weight").

NOTE: [parameters held for lookups]
A set, a dict or ids of the step's parameters made before the call and looked up in the
step (weight decay only on ``decay = {p for n, p in m.named_parameters() if
n.endswith("weight")}``: ``if p in decay``; a per-parameter rule ``names.get(p)``;
``id(p) in ids``) missed every parameter: the lookup hashes the stand-in, whose hash
and id are its own, so the program computed as if no parameter were in it, silently
(Sequential(Linear(4, 8), Tanh, Linear(8, 2)), SGD 0.1, float64, 2 simulated ranks,
3 calls: parameters 0.158 / 0.094 / 0.239 off eager), and ``names[p]`` failed with
``KeyError: Parameter(FakeTensor(...))``. None of this reaches a torch function (a
tensor's ``__hash__`` is ``id(self)``, not dispatched to a mode; ``id`` is Python's),
so ``HeldParameterUses`` cannot see it, and it cannot be answered soundly either: a
stand-in has one hash, while the held object is the user's parameter on call 0 and,
after the first compiled call replaced it, either the old object (a set made before
that call) or the new one (made after); and what the lookup decided would be a
constant of the program that a later change of the set must recompile. So the guards'
walk, which meets before the capture every Python value the step's code can reach
(NOTE: [guards on Python values]), notes each one that holds a parameter of the step
(``parameter_identities``: the modules' parameters and the old objects they replaced)
as a set member or a dict key, or the id of one anywhere (``parameters_held``), and
the compile is refused before the trace runs, naming it, the parameter and the line
that reads it (as NOTE: [lists the step appends to and reads] finds a read in the
walked code's bytecode), with the form that works: the set built inside the step from
the parameters' names, or names held instead of parameters (strings are guarded by
value: a set changed later recompiles); for an optimizer's own dict keyed by
parameters (a custom optimizer's ``self.scale = {p: 0.5 ...}`` read in ``step()``:
before, every factor read 1.0, silently), a setting in its param groups. A container
reached by a name that no walked code reads (a dict entry whose key the code never
names) is let be; one with no name (an item of a list) is refused at the step's line.
A buffer is a stand-in too, and checked alike. Not seen, as for every guard: a
container only code the walk does not reach reads, and ``p is held[0]`` (an identity
test is no lookup: the list is left to ``HeldParameterUses``, which sees its uses).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ..errors import SPMDCompileError, innermost_model_frame_of_stack, readable_name
from .appended_lists import read_line
from .bindings import (
    ShownName,
    StepBindings,
    freeze_hint,
    reads_metadata,
    replacement_of,
    sets_requires_grad,
)
from .code_names import step_where
from .guards import Guards
from .optimizers_not_passed import optimizer_not_passed

_REQUIRES_GRAD: Any = torch.Tensor.requires_grad  # the descriptor
_GRAD: Any = torch.Tensor.grad  # the descriptor
# in-place updates spelled as operators (``p += d``, ``p[i] = v``)
_IN_PLACE_OPERATORS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__"})


# how each kind of container the walk notes is looked up, for the refusal's words
_LOOKUPS = {
    "a set of parameters": "`p in decay`",
    "a dict keyed by parameters": "`names[p]`, `names.get(p)`",
    "ids of parameters": "`id(p) in ids`",
    "the id of a parameter": "`id(p) == first`",
}


class HeldParameterUses(TorchFunctionMode):
    """While entered: a torch function on one of ``bindings``' parameters (the user's
    objects) is refused, but for metadata reads; ``requires_grad`` reads answer
    ``stand_ins``' flag (see the NOTE). Inside a method of an optimizer not among
    ``optimizers`` (the step's), that optimizer is refused instead (NOTE: [optimizers
    the step was not given])."""

    def __init__(
        self, bindings: StepBindings, stand_ins: dict[str, torch.Tensor],
        optimizers: Sequence[torch.optim.Optimizer] = (),
    ) -> None:
        super().__init__()
        self._bindings = bindings
        self._names = {id(p): name for name, p in bindings.params.items()}
        self._stand_ins = stand_ins
        self._optimizers = optimizers

    def _held(self, value: Any) -> str | None:
        if not isinstance(value, torch.Tensor):
            return None
        name = self._names.get(id(value))
        if name is None and (new := replacement_of(value)) is not None:
            name = self._names.get(id(new))
        return name

    def _first_held(self, args: tuple, kwargs: dict) -> str | None:
        for value in (*args, *kwargs.values()):
            for leaf in value if isinstance(value, (list, tuple)) else (value,):
                if (name := self._held(leaf)) is not None:
                    return name
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        name = self._first_held(args, kwargs)
        if name is None:
            return func(*args, **kwargs)
        if getattr(func, "__name__", None) == "__get__" and getattr(func, "__self__", None) is _REQUIRES_GRAD:
            return self._stand_ins[name].requires_grad
        if reads_metadata(func):
            return func(*args, **kwargs)
        if (not_passed := optimizer_not_passed(self._optimizers)) is not None:
            raise not_passed  # NOTE: [optimizers the step was not given]
        shown = self._bindings.shown_parameter(name)
        if sets_requires_grad(func):
            raise SPMDCompileError(
                f"The train step sets requires_grad of parameter {shown} through a reference "
                "held outside its modules (a list of parameters made before the call, "
                "`q_params = list(ac.q.parameters())`): the compiled step traces the "
                "modules' parameters, so the program would not see the freeze, even one "
                "set back later in the step, and would train the parameter with a gradient "
                "eager keeps from it (NOTE: [parameters held outside the modules]).",
                user_line=innermost_model_frame_of_stack(),
                hint=freeze_hint(shown),
            )
        what, hint = _use_of(func, shown)
        raise SPMDCompileError(
            f"The train step uses parameter {shown} ({what} on it) through a reference held "
            "outside its modules (a list of parameters made before the call): the compiled "
            "step traces the modules' parameters, so this reaches the user's parameter, "
            "whose .grad and values are not the program's: the program would neither see "
            "nor make this use (NOTE: [parameters held outside the modules]).",
            user_line=innermost_model_frame_of_stack(),
            hint=hint,
        )


def _use_of(func: Any, shown: ShownName) -> tuple[str, str]:
    """What ``func`` does to a held parameter, in words, and the form that works for
    that use (see the NOTE)."""
    what = getattr(func, "__name__", str(func))
    descriptor = getattr(func, "__self__", None) if what in ("__get__", "__set__") else None
    if descriptor is not None:  # ``p.grad``, ``p.data = v``
        what = f".{getattr(descriptor, '__name__', '')} {'read' if what == '__get__' else 'set'}"
    if descriptor is _GRAD:
        return what, (
            "take the parameters from the module inside the step (`for p in "
            "ac.q.parameters(): p.grad = None`, `clip_grad_norm_(ac.q.parameters(), c)`), "
            "which compiles and computes as eager does."
        )
    in_place = what.endswith(" set") or what in _IN_PLACE_OPERATORS or (
        what.endswith("_") and not what.startswith("__")
    )
    if in_place:
        return what, (
            f"take the list from the module inside the step, `list({shown.holder}.parameters())`, "
            "in place of one made before the call (an EMA: `torch._foreach_lerp_("
            "list(ema.parameters()), list(model.parameters()), 0.1)`), which compiles and "
            "computes as eager does."
        )
    return what, (
        f"read it through the module that holds it, `{shown.expression()}` in the step "
        "(in the module's own forward, its attribute: `self.emb.weight`; a list kept on "
        "the module holds the submodule instead, `self._tied = [self.emb]`, read as "
        "`self._tied[0].weight`), which compiles and computes as eager does."
    )


def refuse_parameters_held_for_lookups(guards: Guards, bindings: StepBindings) -> None:
    """Refuse a step whose code reads a container that holds its parameters for lookups,
    which the walk of ``guards`` met (see the NOTE), naming it, the parameter and the
    line; before the trace runs."""
    for name, cell, label, what, param in guards.held_parameters:
        line = read_line(guards.codes, name, cell, label) if name is not None else step_where(bindings.step)
        if line is None:
            continue  # no walked code reads it
        shown = bindings.shown_parameter(param)
        model = shown.holder
        kind = "parameter" if param in bindings.params else "buffer"
        by_id = what.startswith(("ids", "the id"))
        at = re.match(r"optimizer\[(\d+)\]", label)  # an optimizer's own container
        optimizer = type([*bindings.optimizers, *bindings.wrappers][int(at.group(1))]).__name__ if at else None
        raise SPMDCompileError(
            f"The train step reads {readable_name(label)}, {what} made before the call (it "
            f"holds {kind} {shown}{' by its id' if by_id else ''}): while the step is traced "
            "its modules hold stand-ins for their parameters and buffers, whose hash and id "
            f"are their own, so a lookup of one in it ({_LOOKUPS[what]}) would not find it "
            "and the program would compute as if none were in it, silently (NOTE: "
            "[parameters held for lookups]). Nothing of the step ran.",
            user_line=line,
            hint=(_OPTIMIZER_HINT if optimizer is not None else
                  _DICT_HINT if what.startswith("a dict") else _SET_HINT).format(model=model, optimizer=optimizer)
            + ", which compiles and computes as eager does.",
        )


_SET_HINT = (
    "build it inside the step from the parameters' names (`decay = {{p for n, p in "
    "{model}.named_parameters() if n.endswith('weight')}}`), or hold names instead of "
    "parameters or ids (`decay = {{n for n, p in {model}.named_parameters() if ...}}` made "
    "once, read in the step as `for n, p in {model}.named_parameters(): if n in decay: ...`)"
)
# an optimizer's own container (``self.scale = {p: 0.5 ...}`` in a custom optimizer)
_OPTIMIZER_HINT = (
    "hold a per-parameter setting in the optimizer's param groups (`{optimizer}([{{'params': "
    "decay, 'scale': 0.5}}, {{'params': rest}}], lr)`, read in step() as `group['scale']`)"
)
_DICT_HINT = (
    "key it by the parameters' names (`rules = {{n: ... for n, p in "
    "{model}.named_parameters()}}` made once, read in the step as `for n, p in "
    "{model}.named_parameters(): rule = rules.get(n)`), or build it inside the step"
)


__all__ = ["HeldParameterUses", "refuse_parameters_held_for_lookups"]
