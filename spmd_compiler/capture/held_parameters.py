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
than a read of its metadata, is refused before it runs, naming the line: the flag, the
gradient and the values are as the user left them. Reading ``requires_grad`` answers the
stand-in's flag (what eager's object reads, a freeze through the modules included).
Mapping the held object to its stand-in instead would have to hold on every later call
too, through the retired objects, and for every use (a gradient read, a computation),
so the uses are refused and the module form is named, which compiles and matches eager.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ..errors import SPMDCompileError, innermost_model_frame_of_stack
from .bindings import freeze_hint, reads_metadata, replacement_of, sets_requires_grad
from .optimizers_not_passed import optimizer_not_passed

_REQUIRES_GRAD: Any = torch.Tensor.requires_grad  # the descriptor


class HeldParameterUses(TorchFunctionMode):
    """While entered: a torch function on one of ``params`` (the user's parameters, by
    name) is refused, but for metadata reads; ``requires_grad`` reads answer
    ``stand_ins``' flag (see the NOTE). Inside a method of an optimizer not among
    ``optimizers`` (the step's), that optimizer is refused instead (NOTE: [optimizers
    the step was not given])."""

    def __init__(
        self, params: Mapping[str, torch.Tensor], stand_ins: Mapping[str, torch.Tensor],
        optimizers: Sequence[torch.optim.Optimizer] = (),
    ) -> None:
        super().__init__()
        self._names = {id(p): name for name, p in params.items()}
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
        if sets_requires_grad(func):
            raise SPMDCompileError(
                f"The train step sets requires_grad of parameter {name} through a reference "
                "held outside its modules (a list of parameters made before the call, "
                "`q_params = list(ac.q.parameters())`): the compiled step traces the "
                "modules' parameters, so the program would not see the freeze, even one "
                "set back later in the step, and would train the parameter with a gradient "
                "eager keeps from it (NOTE: [parameters held outside the modules]).",
                user_line=innermost_model_frame_of_stack(),
                hint=freeze_hint(name),
            )
        what = getattr(func, "__name__", str(func))
        if what in ("__get__", "__set__"):  # a descriptor's: ``p.grad``, ``p.data = v``
            attr = getattr(getattr(func, "__self__", None), "__name__", "")
            what = f".{attr} {'read' if what == '__get__' else 'set'}"
        raise SPMDCompileError(
            f"The train step uses parameter {name} ({what} on it) through a reference held "
            "outside its modules (a list of parameters made before the call): the compiled "
            "step traces the modules' parameters, so this reaches the user's parameter, "
            "whose .grad and values are not the program's (a `p.grad = None` or a "
            "clip_grad_norm_ through it would change nothing the program trains) (NOTE: "
            "[parameters held outside the modules]).",
            user_line=innermost_model_frame_of_stack(),
            hint="take the parameters from the module inside the step (`for p in "
            "ac.q.parameters(): p.grad = None`, `clip_grad_norm_(ac.q.parameters(), c)`), "
            "which compiles and computes as eager does.",
        )


__all__ = ["HeldParameterUses"]
