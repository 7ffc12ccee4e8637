"""An optimizer the traced step calls that is not among the step's optimizers.

NOTE: [optimizers the step was not given]
``step()`` of an optimizer that is not among the step's optimizers (NOTE: [modules and
optimizers by name] in ``capture/bindings.py``) is refused by a step pre-hook
(``OptimizerNotPassed``), and the refusal says which optimizer and what to do. The
everyday order calls ``zero_grad()`` first, though: it reads ``p.grad`` of the user's
parameters, which the optimizer holds, and the refusal of a parameter held outside the
modules (NOTE: [parameters held outside the modules]) fired first, naming "parameter
0.weight" (the optimizer's own numbering), "a list of parameters made before the call"
and the advice to take the parameters from the module: nothing the user wrote, and no
word of the optimizer not found (a probe of Parallel WaveGAN's trainer, sixty-ninth
session, whose optimizers sat in a dict on ``self``). Where that refusal is met inside a
method of an optimizer that is not among the step's (the innermost such frame of the
running code), the optimizer's refusal is raised instead, naming the method called.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch

from .call_optimizers import OptimizerNotPassed


def optimizer_not_passed(passed: Sequence[torch.optim.Optimizer]) -> OptimizerNotPassed | None:
    """The refusal of the optimizer whose method the running code is inside (the
    innermost frame whose ``self`` is an optimizer), where that optimizer is not among
    ``passed``; None otherwise (see the NOTE)."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            code = frame.f_code
            if code.co_argcount and code.co_varnames[0] == "self":
                owner = frame.f_locals.get("self")
                if isinstance(owner, torch.optim.Optimizer):
                    return None if any(owner is p for p in passed) else OptimizerNotPassed(owner, method=code.co_name)
            frame = frame.f_back
        return None
    finally:
        del frame  # no cycle through this frame (``inspect``'s advice)


__all__ = ["OptimizerNotPassed", "optimizer_not_passed"]
