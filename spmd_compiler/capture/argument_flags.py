"""Where the train step switches on requires_grad of its own tensor arguments.

NOTE: [requires_grad set on an argument by the step]
A step may call ``x.requires_grad_()`` on a tensor argument (a residual flow's
Hutchinson estimator, an R1 penalty). Eager sets the flag on the caller's tensor, so the
same tensor passed again, or first run through the step eagerly (a parity check beside
the compiled step), arrives requiring grad, and a ``backward()`` reaching it is refused
(NOTE: [tensor arguments that require grad]). Until the sixty-seventh session that
refusal told the user to pass ``x`` without requires_grad although their code passed a
plain tensor and the step's own line set the flag. While the step is traced,
``Tensor.requires_grad_`` notes the first line (the innermost outside torch) that
switched the flag on for each argument, and the refusal names that line with the
in-step form ``x = x.detach().requires_grad_()``, which leaves the caller's tensor alone
in eager and compiled alike.
"""

from __future__ import annotations

import contextlib
from typing import Any
from unittest import mock

import torch

from ..errors import SourceLocation, innermost_model_frame_of_stack


class RequiresGradCalls(contextlib.AbstractContextManager):
    """While entered: ``set_at[id(t)]``, the line of the first ``t.requires_grad_(True)``
    on each of ``arguments``."""

    def __init__(self, arguments: list[torch.Tensor]) -> None:
        self.set_at: dict[int, SourceLocation | None] = {}
        self._watched = {id(t) for t in arguments}
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> RequiresGradCalls:
        real = torch.Tensor.requires_grad_

        def requires_grad_(t: torch.Tensor, requires_grad: bool = True) -> Any:
            if requires_grad and id(t) in self._watched and id(t) not in self.set_at:
                self.set_at[id(t)] = innermost_model_frame_of_stack()
            return real(t, requires_grad)

        self._stack.enter_context(mock.patch.object(torch.Tensor, "requires_grad_", requires_grad_))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()


__all__ = ["RequiresGradCalls"]
