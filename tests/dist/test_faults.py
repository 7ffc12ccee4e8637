"""A rank that fails mid-training: the others end with a clear error within the
collective timeout instead of hanging, and keep the state of the last completed step."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler import _torch_private as private
from spmd_compiler.parallel_modes import DataParallel
from spmd_compiler.demo.steps import classification_train_step

COLLECTIVE_TIMEOUT_S = 8.0


_step = classification_train_step


def _worker(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = sc.compile(DataParallel("fully_shard"))(_step)
    gen = torch.Generator().manual_seed(1 + rank)
    batch = lambda: (torch.randn(4, 8, generator=gen), torch.randint(0, 4, (4,), generator=gen))  # noqa: E731
    for _ in range(2):
        step(model, optim, *batch())
    if rank == 1:
        return {"rank": 1, "left": True}  # this rank stops taking part: it "dies" here
    snapshot = {n: private.local_tensor_of(p).clone() for n, p in model.named_parameters()}
    state = {
        (i, k): private.local_tensor_of(v).clone()
        for i, s in enumerate(optim.state.values()) for k, v in s.items()
    }
    start = time.monotonic()
    try:
        step(model, optim, *batch())
    except sc.SPMDRuntimeError as exc:
        intact = all(
            torch.equal(private.local_tensor_of(p), snapshot[n]) for n, p in model.named_parameters()
        ) and all(
            torch.equal(private.local_tensor_of(v), state[(i, k)])
            for i, s in enumerate(optim.state.values()) for k, v in s.items()
        )
        return {"rank": 0, "error": str(exc), "seconds": time.monotonic() - start, "intact": intact}
    return {"rank": 0, "error": None}


@pytest.mark.dist
def test_surviving_rank_fails_clearly_with_state_intact():
    results = sc.launch(_worker, 2, timeout_s=120, collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    survivor = results[0]
    assert survivor["error"] is not None, "the step should not complete without its peer"
    assert "rank 0" in survivor["error"] and "last completed step" in survivor["error"]
    assert survivor["seconds"] < COLLECTIVE_TIMEOUT_S + 30
    assert survivor["intact"]
    assert results[1]["left"]
