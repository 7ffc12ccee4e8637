"""``torch.amp.GradScaler`` in a compiled step on 2 real gloo ranks (NOTE: [loss scaling in
the program]): each rank passes its half of the global batch; a batch whose inf sits on
rank 1's half only makes both ranks skip the optimizer step and back the scale off, as
one device does on the whole batch. Parameters, optimizer state and the scaler's state
against the undecorated step (float64).
"""

from __future__ import annotations

import pytest
import torch

import spmd_compiler as sc
from spmd_compiler.parallel_modes import make_mode
from spmd_compiler.tools.parity import (
    backend_under_test,
    full_state,
    launch_timeout,
    relative_difference,
)
from tests.sim.test_grad_scaler import (
    BATCH,
    SETTINGS,
    _batches,
    _model,
    scaled_step,
    skip_detecting_step,
)

pytestmark = pytest.mark.dist


def _worker(rank: int, world: int) -> dict:
    model = _model()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", **SETTINGS)
    step = sc.compile(make_mode("fsdp"), backend=backend_under_test())(scaled_step)
    share = BATCH // world
    rows = slice(rank * share, (rank + 1) * share)
    losses = [step(model, optim, scaler, x[rows], y[rows]).detach().clone() for x, y in _batches()]
    return {"losses": losses, "state": full_state(model, optim, None), "scaler": scaler.state_dict()}


def test_grad_scaler_skips_on_every_rank_when_one_shard_overflows() -> None:
    results = sc.launch(_worker, 2, timeout_s=launch_timeout(300))
    model = _model()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", **SETTINGS)
    losses = [scaled_step(model, optim, scaler, x, y).detach() for x, y in _batches()]
    state = full_state(model, optim, None)
    for rank, got in enumerate(results):
        for a, b in zip(got["losses"], losses, strict=True):
            assert bool(torch.isnan(a)) == bool(torch.isnan(b)), (rank, a, b)
            if not torch.isnan(b):
                assert relative_difference(a, b) < 1e-12, (rank, a, b)
        worst = max(relative_difference(got["state"][k], v) for k, v in state.items())
        assert worst < 1e-12, (rank, worst)
        assert got["scaler"] == scaler.state_dict(), rank


def _skip_worker(rank: int, world: int) -> dict:
    model = _model()
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", **SETTINGS)
    scheduler = torch.optim.lr_scheduler.StepLR(optim, 1, gamma=0.5)
    step = sc.compile(make_mode("ddp"), backend=backend_under_test())(skip_detecting_step)
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    skips = [step(model, optim, scaler, scheduler, x[rows], y[rows])[1:] for x, y in _batches(4)]
    return {"skips": skips, "state": full_state(model, optim, None)}


def test_the_scale_read_before_update_tells_the_skip_on_every_rank() -> None:
    """NOTE: [an item is its value at the read]: `get_scale()` before `update()` was the
    updated scale, so the scheduler stepped on the skipped call."""
    results = sc.launch(_skip_worker, 2, timeout_s=launch_timeout(300))
    model = _model()
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", **SETTINGS)
    scheduler = torch.optim.lr_scheduler.StepLR(optim, 1, gamma=0.5)
    skips = [skip_detecting_step(model, optim, scaler, scheduler, x, y)[1:] for x, y in _batches(4)]
    assert [s for _, s in skips] == [False, False, True, False]
    state = full_state(model, optim, None)
    for rank, got in enumerate(results):
        assert got["skips"] == skips, rank
        worst = max(relative_difference(got["state"][k], v) for k, v in state.items())
        assert worst < 1e-12, (rank, worst)
