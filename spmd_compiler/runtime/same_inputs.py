"""Every rank passes tensor arguments of the same shapes and dtypes, checked every call.

NOTE: [same inputs on all ranks]
The per-rank program is one program for all ranks: a rank whose local batch has another
shape runs (or compiles) another program, and the two then wait in different collectives
until the collective timeout. So every call, before the program cache is consulted,
each rank reduces a 56-bit digest of its tensor arguments' shapes and dtypes with one
all-reduce (MAX of ``(digest, -digest)``: the ranks agree exactly when max == min). Only
when they disagree do the ranks exchange their descriptions (an all-gather of bytes) and
raise, every rank the same error naming each rank's shapes. Tensor collectives only
(object collectives need numpy). On NCCL the check runs on a CPU (gloo) side group, so it
never waits for the GPU.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..errors import SPMDCompileError, SPMDRuntimeError
from .faults import attribution

# One gloo side group per default group, for NCCL jobs (see NOTE above).
_CPU_GROUPS: dict[int, Any] = {}


def describe_inputs(tensor_args: Sequence[torch.Tensor]) -> str:
    """``(4, 8) float32, (4,) int64``: what the digest is taken of."""
    parts = [
        f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in tensor_args
    ]
    return ", ".join(parts) or "no tensors"


def _digest(description: str) -> int:
    return int.from_bytes(hashlib.blake2b(description.encode(), digest_size=7).digest(), "big")


def _cpu_group() -> Any:
    """The default group when it is gloo, else a gloo group over the same ranks."""
    if dist.get_backend() == "gloo":
        return None
    key = id(dist.group.WORLD)
    if key not in _CPU_GROUPS:
        _CPU_GROUPS[key] = dist.new_group(backend="gloo")
    return _CPU_GROUPS[key]


def check_same_inputs_on_all_ranks(tensor_args: Sequence[torch.Tensor]) -> None:
    """Raise ``SPMDCompileError`` on every rank when ranks pass different shapes or dtypes.

    A collective (every rank calls it once per step): see NOTE: [same inputs on all
    ranks]. A failure of the collective itself (a peer died) is an ``SPMDRuntimeError``
    naming the rank that failed first.
    """
    world = dist.get_world_size()
    if world == 1:
        return
    group = _cpu_group()
    description = describe_inputs(tensor_args)
    digest = _digest(description)
    bounds = torch.tensor([digest, -digest], dtype=torch.int64)
    _collective(lambda: dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=group))
    if int(bounds[0]) == -int(bounds[1]):
        return
    everyone = _all_descriptions(description, group, world)
    lines = "\n".join(f"    rank {rank}: {text}" for rank, text in enumerate(everyone))
    raise SPMDCompileError(
        "The ranks pass tensor arguments of different shapes or dtypes to the train step, "
        "so they would run different programs (and wait for each other until the "
        f"collective timeout). Tensor arguments per rank:\n{lines}",
        hint="give every rank a local batch of the same shape (split the global batch "
        "evenly; drop or pad the last partial batch).",
    )


def _all_descriptions(description: str, group: Any, world: int) -> list[str]:
    mine = torch.tensor(list(description.encode()), dtype=torch.uint8)
    length = torch.tensor([mine.numel()], dtype=torch.int64)
    _collective(lambda: dist.all_reduce(length, op=dist.ReduceOp.MAX, group=group))
    padded = torch.zeros(int(length), dtype=torch.uint8)
    padded[: mine.numel()] = mine
    gathered = [torch.empty_like(padded) for _ in range(world)]
    _collective(lambda: dist.all_gather(gathered, padded, group=group))
    return [bytes(t.tolist()).rstrip(b"\0").decode() for t in gathered]


def _collective(call: Any) -> None:
    try:
        call()
    except Exception as exc:
        rank = dist.get_rank()
        raise SPMDRuntimeError(
            f"The compiled step failed on rank {rank} while comparing input shapes with "
            "the other ranks: "
            f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}. "
            f"{attribution(rank)} The model and optimizer hold the state of the last "
            "completed step."
        ) from exc
