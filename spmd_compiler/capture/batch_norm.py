"""Batch norm with a cumulative moving average (``momentum=None``) at capture.

NOTE: [cumulative batch norm at capture]
``nn.BatchNorm*d(momentum=None)`` keeps a cumulative moving average of the batch
statistics: in training, ``forward`` counts the batch (``num_batches_tracked += 1``) and
updates the running statistics with the factor ``1.0 / float(num_batches_tracked)``. That
``float()`` reads a tensor's value in Python, which a traced step has not got, so the
step was refused. While the step is traced, such a module (training, tracking running
statistics, torch's own ``forward``; the mode is read when it is called, as the step
may switch it) runs this module's ``forward`` instead, which keeps
the factor a tensor: the output is ``F.batch_norm`` on the batch statistics without an
update, and the running statistics are updated from the batch's mean and unbiased
variance with torch's formula (``factor * batch + (1 - factor) * running``, the factor
in float64 as Python's division gives it). The batch statistics are reductions over the
batch, so on N ranks they are the global batch's (as for any batch norm here, NOTE: [ops
decomposed at capture]). The module's ``forward`` is its own again after the trace.
Numerics: float64 tests agree with eager within 1e-15 relative.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from .. import _torch_private as private

_TORCH_FORWARDS = (torch.nn.BatchNorm1d.forward,)  # the three share _BatchNorm's forward


def _patched(module: torch.nn.Module) -> bool:
    """A batch norm with torch's own ``forward`` and no momentum (training or not: the
    step may switch its mode)."""
    return (
        getattr(type(module), "forward", None) in _TORCH_FORWARDS
        and "forward" not in vars(module)
        and getattr(module, "momentum", 0.1) is None
    )


def cumulative_forward(self: Any, input: torch.Tensor) -> torch.Tensor:
    """``_BatchNorm.forward`` with the cumulative factor a tensor (training, tracking
    running statistics); torch's own ``forward`` otherwise."""
    if not (
        self.training and self.track_running_stats and self.momentum is None
        and self.num_batches_tracked is not None
        and self.running_mean is not None and self.running_var is not None
    ):
        return type(self).forward(self, input)
    private.check_batch_norm_input(self, input)
    self.num_batches_tracked.add_(1)
    factor = torch.reciprocal(self.num_batches_tracked.to(torch.float64))
    out = F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)
    dims = [0, *range(2, input.dim())]
    with torch.no_grad():
        var, mean = torch.var_mean(input.detach(), dims, correction=0)
        count = input.numel() / input.size(1)  # above 1: F.batch_norm refused a single value
        unbiased = var * (count / (count - 1))
        self.running_mean.copy_(factor * mean + (1 - factor) * self.running_mean)
        self.running_var.copy_(factor * unbiased + (1 - factor) * self.running_var)
    return out


@contextlib.contextmanager
def cumulative_batch_norms(modules: list[torch.nn.Module]) -> Iterator[None]:
    """Inside: the batch norms of ``modules`` that keep a cumulative average compute its
    factor as a tensor (see the NOTE); their ``forward`` is restored on the way out."""
    patched = [m for root in modules for m in root.modules() if _patched(m)]
    for m in patched:
        m.forward = types.MethodType(cumulative_forward, m)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for m in patched:
            vars(m).pop("forward", None)


__all__ = ["cumulative_batch_norms", "cumulative_forward"]
