"""Parallel modes: how a captured train step is spread over a device mesh."""

from collections.abc import Callable

from spmd_compiler.ir.use_step import UseGroup, UseHook, UseStep

from .base import ParallelMode
from .data_parallel import DataParallel
from .dtensor_expand import DTensorExpandMode
from .fsdp_tp import FullyShardTensorParallel
from .mixed_precision import MixedPrecisionPolicy
from .tensor_parallel import FusedColwiseParallel, MultiheadAttentionParallel, TensorParallel

__all__ = [
    "DTensorExpandMode", "DataParallel", "FullyShardTensorParallel", "FusedColwiseParallel",
    "MixedPrecisionPolicy", "MultiheadAttentionParallel", "ParallelMode", "TensorParallel",
    "UseGroup", "UseHook", "UseStep",
]


def make_mode(name: str, **kwargs) -> ParallelMode:
    """A parallel mode by its demo name (``--mode``)."""
    factories: dict[str, Callable[..., ParallelMode]] = {
        "dtensor_expand": DTensorExpandMode,
        "ddp": lambda **kw: DataParallel("replicate", **kw),
        "fsdp": lambda **kw: DataParallel("fully_shard", **kw),
        "tp": TensorParallel,
        "fsdp_tp": FullyShardTensorParallel,
    }
    if name not in factories:
        raise ValueError(f"unknown mode {name!r}; choose from {sorted(factories)}")
    return factories[name](**kwargs)


__all__ += ["make_mode"]
