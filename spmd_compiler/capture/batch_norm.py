"""Batch norm with a cumulative moving average (``momentum=None``) at capture.

NOTE: [cumulative batch norm at capture]
``nn.BatchNorm*d(momentum=None)`` keeps a cumulative moving average of the batch
statistics: in training, ``forward`` counts the batch (``num_batches_tracked += 1``) and
updates the running statistics with the factor ``1.0 / float(num_batches_tracked)``. That
``float()`` reads a tensor's value in Python, which a traced step has not got, so the
step was refused. While the step is traced, such a module (training, tracking running
statistics, torch's own ``forward``; the mode and the momentum are read when it is
called, as the step may switch them) runs this module's ``forward`` instead, which keeps
the factor a tensor: the output is ``F.batch_norm`` on the batch statistics without an
update, and the running statistics are updated from the batch's mean and unbiased
variance with torch's formula (``factor * batch + (1 - factor) * running``, the factor
in float64 as Python's division gives it). The batch statistics are reductions over the
batch, so on N ranks they are the global batch's (as for any batch norm here, NOTE: [ops
decomposed at capture]). The module's ``forward`` is its own again after the trace.
Numerics: float64 tests agree with eager within 1e-15 relative. Every batch norm with
torch's ``forward`` is replaced, whatever its momentum when the trace starts, and this
``forward`` runs torch's own where the momentum is not ``None`` when it is called:
``torch.optim.swa_utils.update_bn(loader, swa_model)`` in a compiled step sets
``momentum = None`` on each batch norm for its passes and restores it after. Before the
sixty-fourth session the choice was made once, from the momentum when the trace started,
and that step was refused (torch's ``float()`` of ``num_batches_tracked``).

NOTE: [SyncBatchNorm at capture]
``nn.SyncBatchNorm`` (what ``convert_sync_batchnorm`` makes of a DDP model's batch norms)
normalizes with the statistics of every rank's batch, gathered by collectives in its
``forward``. A compiled step is written for one device on the global batch, where a batch
norm's statistics are already the global batch's, so while the step is traced a
``SyncBatchNorm`` runs torch's plain batch norm ``forward`` (and the cumulative one above
for ``momentum=None``). Before, capture failed on CPU, where torch refuses the module
("expected input tensor to be on GPU"); on a GPU its ``forward`` would have run its own
collectives inside the trace (not tried: no GPU when this was written). The replacement is
``SyncBatchNorm.forward`` itself on the class while the step is traced, for the step's
modules (any other instance runs torch's), so a subclass whose ``forward`` calls
``super().forward(x)`` (timm's ``SyncBatchNormAct``, what ``timm.layers.
convert_sync_batchnorm`` makes) reaches it too: before 2026-12-05 only an instance whose
class kept torch's ``forward`` was replaced, and such a subclass failed at capture with
torch's CPU refusal. Refused, with the line: a ``SyncBatchNorm`` whose ``process_group``
spans fewer ranks than the world (statistics over a subset of the batch, which the
program does not compute).
"""

from __future__ import annotations

import contextlib
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import _torch_private as private
from ..errors import SPMDCompileError, innermost_model_frame_of_stack

_TORCH_FORWARDS = (torch.nn.BatchNorm1d.forward,)  # the three share _BatchNorm's forward


def _patched(module: torch.nn.Module) -> bool:
    """A batch norm with torch's own ``forward``, whatever its momentum (training or
    not: the step may switch its mode, and set ``momentum = None``, as ``update_bn``
    does; ``cumulative_forward`` reads both when it is called)."""
    return (
        getattr(type(module), "forward", None) in _TORCH_FORWARDS
        and "forward" not in vars(module)
    )


class _SyncedModules:
    """The ids of the ``SyncBatchNorm`` modules of the steps being traced (a trace per
    thread may run at once); ``SyncBatchNorm.forward`` is replaced while any is."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active: list[frozenset[int]] = []
        self.original: Callable[..., Any] | None = None

    def holds(self, module: torch.nn.Module) -> bool:
        return any(id(module) in ids for ids in list(self.active))


_SYNCED = _SyncedModules()


def _sync_batch_norm_forward(self: Any, input: torch.Tensor) -> torch.Tensor:
    """``SyncBatchNorm.forward`` while steps are traced: ``sync_forward`` for their
    modules, torch's for any other (NOTE: [SyncBatchNorm at capture])."""
    if _SYNCED.holds(self):
        return sync_forward(self, input)
    original = _SYNCED.original
    assert original is not None
    return original(self, input)


@contextlib.contextmanager
def _sync_batch_norms(modules: list[torch.nn.Module]) -> Iterator[None]:
    """Inside: ``SyncBatchNorm.forward``, however it is reached (the module's own
    ``forward`` or a subclass's ``super().forward(x)``), runs ``sync_forward`` for the
    ``SyncBatchNorm`` submodules of ``modules``; torch's again on the way out."""
    ids = frozenset(
        id(m) for root in modules for m in root.modules() if isinstance(m, torch.nn.SyncBatchNorm)
    )
    if not ids:
        yield
        return
    with _SYNCED.lock:
        if not _SYNCED.active:
            _SYNCED.original = torch.nn.SyncBatchNorm.__dict__["forward"]
            torch.nn.SyncBatchNorm.forward = _sync_batch_norm_forward  # type: ignore[method-assign]
        _SYNCED.active.append(ids)
    try:
        yield
    finally:
        with _SYNCED.lock:
            _SYNCED.active.remove(ids)
            original = _SYNCED.original
            if not _SYNCED.active and original is not None:
                torch.nn.SyncBatchNorm.forward = original  # type: ignore[method-assign]
                _SYNCED.original = None


def sync_forward(self: Any, input: torch.Tensor) -> torch.Tensor:
    """A ``SyncBatchNorm``'s ``forward`` in a traced step: the plain batch norm over the
    (global) batch; refused for a process group of part of the world (the NOTE)."""
    group = self.process_group
    if group is not None and dist.is_initialized() and dist.get_world_size(group) != dist.get_world_size():
        raise SPMDCompileError(
            f"nn.SyncBatchNorm with a process_group of {dist.get_world_size(group)} of the "
            f"{dist.get_world_size()} ranks normalizes each group's part of the batch with that "
            "part's statistics; a compiled step computes the whole batch's (NOTE: "
            "[SyncBatchNorm at capture]).",
            user_line=innermost_model_frame_of_stack(),
            hint="leave process_group unset (the whole batch), or use nn.BatchNorm*d with "
            "statistics per sample group computed in the model.",
        )
    if self.momentum is None:
        return cumulative_forward(self, input)
    return private.plain_batch_norm_forward(self, input)


def cumulative_forward(self: Any, input: torch.Tensor) -> torch.Tensor:
    """``_BatchNorm.forward`` with the cumulative factor a tensor (training, tracking
    running statistics); torch's own ``forward`` otherwise."""
    if not (
        self.training and self.track_running_stats and self.momentum is None
        and self.num_batches_tracked is not None
        and self.running_mean is not None and self.running_var is not None
    ):
        return private.plain_batch_norm_forward(self, input)
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
def forwards_replaced(
    modules: list[torch.nn.Module], replacement: Callable[[torch.nn.Module], Callable[..., Any] | None]
) -> Iterator[None]:
    """Inside: each submodule of ``modules`` for which ``replacement`` gives a function
    runs it as its ``forward`` (set on the instance); taken off on the way out."""
    patched = []
    for root in modules:
        for m in root.modules():
            forward = replacement(m)
            if forward is not None:
                m.forward = types.MethodType(forward, m)  # type: ignore[method-assign]
                patched.append(m)
    try:
        yield
    finally:
        for m in patched:
            vars(m).pop("forward", None)


@contextlib.contextmanager
def cumulative_batch_norms(modules: list[torch.nn.Module]) -> Iterator[None]:
    """Inside: the batch norms of ``modules`` that keep a cumulative average compute its
    factor as a tensor, and ``SyncBatchNorm`` runs the plain batch norm (see the NOTEs);
    their ``forward`` is restored on the way out."""
    with _sync_batch_norms(modules), forwards_replaced(
        modules, lambda m: cumulative_forward if _patched(m) else None
    ):
        yield


__all__ = ["cumulative_batch_norms", "cumulative_forward", "forwards_replaced", "sync_forward"]
