"""Optimizers the train step did not get: refused, or traced when made over the call's own tensors.

NOTE: [optimizers over tensors made in the call]
Reptile as learn2learn and the reptile-pytorch examples write it makes, in every call,
``fast = copy.deepcopy(model)`` and ``inner = torch.optim.SGD(fast.parameters(), lr)``,
runs a few ``inner.step()``, sets ``p.grad = p - p_fast`` on the model's parameters and
steps the meta optimizer. Until the sixty-ninth session every ``step()`` of an optimizer
the step was not given was refused (NOTE: [steps without an optimizer] in ``trace.py``),
this one as a lazily made one (NOTE: [optimizers created inside the step]), with a hint
to build it over the model's parameters, which would have trained the meta-parameters
in the inner loop. Such an optimizer changes nothing that outlives the call: its
parameters are tensors the call made (fake tensors of the trace that share no storage
with a stand-in of the step's state or inputs), its state (momentum buffers, Adam's
moments and step counters) is made by its first ``step()`` in the call, and the object
is dropped when the call returns; every call makes it afresh, with the same step
counts. So its ``step()`` runs as eager runs it, traced into ordinary ops of the
program, where Adam's ``.item()`` of its step counter reads a constant of the call.
What it takes:
- ``foreach`` and ``fused`` are set to False in its groups for that ``step()`` (put back
  after it): DTensor has no sharding rule for ``_foreach_addcdiv.ScalarList`` (Adam's
  foreach path) nor for the fused kernels; the single-tensor path computes the same
  numbers, as for the optimizers the step was given (NOTE: [capture in two traces]).
- torch's global step hooks and the optimizer's own run at capture as for any
  optimizer, and what they keep is seen where the step's objects are walked (NOTE:
  [tensors the step keeps]).
- An optimizer torch cannot run compiled (LBFGS, SparseAdam: NOTE: [optimizers a
  compiled step cannot run]) is refused here too.
- It must not outlive the call: kept in an attribute, a global, a container or returned,
  it would hold the capture's fake tensors where eager holds the call's values, and a
  lazily kept one (``if self.inner is None: ...``) would step state the program does not
  have. After the step returned, each such optimizer must be gone (weak references,
  after a garbage collection where one is still alive); one still held is refused,
  naming the line of its ``step()``.
An optimizer holding any stand-in (a lazily made ``AdamW(self.model.parameters())``, a
``p.detach()`` alias of a parameter, which shares its storage) stays refused.
``tests/sim/test_optimizers_made_in_the_call.py``.
"""

from __future__ import annotations

import gc
import linecache
import sys
import types
import weakref
from typing import Any

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from .. import _torch_private as private
from ..errors import SourceLocation, SPMDCompileError
from .optimizers import UNSUPPORTED

_FLAGS = ("foreach", "fused")  # NOTE: [optimizers over tensors made in the call]


class OptimizerNotPassed(Exception):
    """An optimizer that is not among the step's optimizers was called while the step
    was traced: ``method`` (``step``; ``zero_grad`` where that came first: NOTE:
    [optimizers the step was not given] in ``optimizers_not_passed.py``) of ``optimizer``."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, holds_stand_ins: bool = False, method: str = "step"
    ) -> None:
        super().__init__(f"{type(optimizer).__name__}.{method}() of an optimizer not passed to the step")
        self.optimizer = optimizer
        self.method = method
        # made in the step over the trace's stand-ins (NOTE: [optimizers created inside the step])
        self.holds_stand_ins = holds_stand_ins


def optimizer_name(opt: torch.optim.Optimizer) -> str:
    return f"{type(opt).__module__}.{type(opt).__name__}"


class OtherOptimizers:
    """While the step is traced: refuse ``step()`` of an optimizer the step was not given
    (``OptimizerNotPassed``, turned into a message by the capture), unless it is made
    over tensors made in the call (NOTE: [optimizers over tensors made in the call]);
    ``refuse_kept()`` after the step returned refuses such an optimizer still alive."""

    def __init__(self, passed: list[Any], stand_ins: list[torch.Tensor], step_code: Any) -> None:
        self.passed = passed
        self.held = {private.storage_ref(t) for t in stand_ins}
        self.step_code = step_code
        # one entry per optimizer traced: (weak reference, class name, line of its first step())
        self.traced: list[tuple[weakref.ref, str, SourceLocation | None]] = []
        self.flags: dict[int, list[tuple[dict, str, Any]]] = {}  # id(opt) -> flags to put back

    def __enter__(self) -> OtherOptimizers:
        self.handles = [
            register_optimizer_step_pre_hook(self._pre_hook),
            register_optimizer_step_post_hook(self._post_hook),
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()
        for key in list(self.flags):  # a step() that raised
            self._put_back(key)

    def made_in_the_call(self, opt: torch.optim.Optimizer) -> bool:
        params = [p for group in opt.param_groups for p in group["params"]]
        return bool(params) and all(
            private.is_fake(p) and private.storage_ref(p) not in self.held for p in params
        )

    def holds_stand_ins(self, opt: torch.optim.Optimizer) -> bool:
        """Whether ``opt`` updates a stand-in of the step's state or inputs, or a tensor
        sharing its memory (``p.detach()``)."""
        return any(
            private.is_fake(p) and private.storage_ref(p) in self.held
            for group in opt.param_groups
            for p in group["params"]
        )

    def _pre_hook(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if any(opt is p for p in self.passed):
            return
        if not self.made_in_the_call(opt):
            raise OptimizerNotPassed(opt, self.holds_stand_ins(opt))
        line = self._step_line()
        _refuse_unsupported(opt, line)
        if all(ref() is not opt for ref, _, _ in self.traced):
            self.traced.append((weakref.ref(opt), optimizer_name(opt), line))
        # None too: torch picks foreach by the parameters' types, which a trace can change
        changed = [
            (group, key, group[key]) for group in opt.param_groups for key in _FLAGS
            if key in group and group[key] is not False
        ]
        for group, key, _ in changed:
            group[key] = False
        self.flags[id(opt)] = changed

    def _post_hook(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._put_back(id(opt))

    def _put_back(self, key: int) -> None:
        for group, flag, value in self.flags.pop(key, []):
            group[flag] = value

    def _step_line(self) -> SourceLocation | None:
        """The line of the step's frame running now (the ``step()`` call)."""
        frame: types.FrameType | None = sys._getframe(1)
        while frame is not None and frame.f_code is not self.step_code:
            frame = frame.f_back
        if frame is None:
            return None
        return SourceLocation(
            frame.f_code.co_filename, frame.f_lineno, linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
        )

    def refuse_kept(self) -> None:
        """After the step returned: refuse an optimizer made over the call's tensors that
        something still holds (NOTE: [optimizers over tensors made in the call])."""
        if not any(ref() is not None for ref, _, _ in self.traced):
            return
        gc.collect()  # a reference cycle through it is not a holder
        for ref, name, line in self.traced:
            if ref() is not None:
                raise SPMDCompileError(
                    f"The train step keeps the {name} it creates over tensors made in the call "
                    "(a per-call clone's parameters, as in Reptile) after the call returns (in an "
                    "attribute, a global or a container, or returned). A compiled step runs that "
                    "optimizer's update inside the program; the object kept would hold the "
                    "capture's stand-in tensors, not the call's values, and a later call would "
                    "not step it (NOTE: [optimizers over tensors made in the call]).",
                    user_line=line,
                    hint="keep the optimizer a local variable of the step, made afresh in every "
                    "call, and keep what you need of it as tensors (they are kept after every "
                    "call); or write its update by hand (`with torch.no_grad(): p -= lr * p.grad`).",
                )


def _refuse_unsupported(opt: torch.optim.Optimizer, line: SourceLocation | None) -> None:
    """NOTE: [optimizers a compiled step cannot run], for one made in the call."""
    for cls in type(opt).__mro__:
        reason = UNSUPPORTED.get(cls.__name__)
        if reason is not None and cls.__module__.startswith("torch."):
            raise SPMDCompileError(
                f"The train step calls step() of a {optimizer_name(opt)} it creates over tensors "
                f"made in the call, which a compiled train step cannot run: {reason[0]}.",
                user_line=line,
                hint="use another optimizer (SGD, Adam, AdamW, ...) for the tensors made in the "
                "call, or write its update by hand.",
            )
