"""Ranks that pass different input shapes or dtypes fail at once, all with one clear error.

Before the check ran on every call, a rank whose shapes changed after the first compile
entered a new compile while the others entered the cached program's collectives: both
blocked until the collective timeout and neither error mentioned shapes.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn as nn

import spmd_compiler as sc
from spmd_compiler.tools.demo.steps import classification_train_step
from spmd_compiler.parallel_modes import DataParallel

pytestmark = pytest.mark.dist

# (rows of x on rank 0, on rank 1, dtype of x on rank 1) per call.
CALLS = [(4, 4, torch.float32), (4, 4, torch.float32), (4, 3, torch.float32),
         (3, 4, torch.float32), (4, 4, torch.float64), (4, 4, torch.float32)]


def _worker(rank: int, world_size: int) -> list[dict]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = sc.compile(DataParallel("replicate"))(classification_train_step)
    gen = torch.Generator().manual_seed(rank)
    out = []
    for rows0, rows1, dtype1 in CALLS:
        rows = rows0 if rank == 0 else rows1
        x = torch.randn(rows, 8, generator=gen).to(dtype1 if rank == 1 else torch.float32)
        y = torch.randint(0, 4, (rows,), generator=gen)
        start = time.monotonic()
        try:
            loss = step(model, optim, x, y)
            out.append({"loss": float(loss), "seconds": time.monotonic() - start})
        except sc.SPMDCompileError as exc:
            out.append({"error": str(exc), "seconds": time.monotonic() - start})
    return out


def test_mismatched_shapes_and_dtypes_fail_on_every_rank_within_seconds() -> None:
    results = sc.launch(_worker, 2, timeout_s=240, collective_timeout_s=60)
    for rank, calls in enumerate(results):
        assert [("error" in c) for c in calls] == [False, False, True, True, True, False], (
            f"rank {rank}: {calls}"
        )
        cached, uncached, dtype = calls[2], calls[3], calls[4]
        # call 2: rank 0 has a cached program for its shapes, rank 1 would compile
        assert "rank 0: (4, 8) float32, (4,) int64" in cached["error"]
        assert "rank 1: (3, 8) float32, (3,) int64" in cached["error"]
        assert "rank 0: (3, 8) float32, (3,) int64" in uncached["error"]
        assert "rank 1: (4, 8) float64, (4,) int64" in dtype["error"]
        for call in (cached, uncached, dtype):
            assert call["seconds"] < 5.0, f"rank {rank} took {call['seconds']:.1f} s"
    # the ranks stayed in step: training continues after the refused calls
    assert results[0][5]["loss"] == results[1][5]["loss"]


def _round_worker(rank: int, world_size: int) -> dict:
    from spmd_compiler.runtime.same_inputs import InputAgreement

    agreement = InputAgreement([torch.zeros(4, 8), torch.zeros(4, dtype=torch.int64)])
    count = torch.tensor(float(rank + 3))  # float32
    pair = torch.tensor([1, 2 + rank])  # int64
    if rank == 1:  # rank 1 compiles first: rank 0's round meets its pending one, then again
        agreement.before_compile()
    sums = agreement.before_run("count and pair", [count, pair])
    out: dict = {"sums": [s.tolist() for s in sums], "dtypes": [str(s.dtype) for s in sums]}
    # an in-flight round: the rank computes, then reads the sums
    flying = agreement.start("count", [count])
    torch.randn(64, 64) @ torch.randn(64, 64)
    out["flying"] = flying.finish()[0].item()
    try:  # the programs send different things: every rank refuses, none reads garbage
        agreement.before_run("count" if rank == 0 else "another count", [count])
    except sc.SPMDRuntimeError as exc:
        out["error"] = str(exc)
    return out


def test_the_round_carries_the_programs_sums_and_waits_for_a_compiling_rank() -> None:
    """NOTE: [reductions that ride the input check]: the round's values come back summed
    in their own dtypes, a rank that compiles first is waited for, and ranks whose
    programs send different values refuse together."""
    results = sc.launch(_round_worker, 2, timeout_s=120, collective_timeout_s=30)
    for out in results:
        assert out["sums"] == [7.0, [2, 5]]
        assert out["dtypes"] == ["torch.float32", "torch.int64"]
        assert out["flying"] == 7.0
        assert "different programs" in out["error"]
