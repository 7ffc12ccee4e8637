"""Every parallel style on real gloo ranks, on the backend under test (NOTE: [test backend]):
ddp, fsdp and tp on 2 ranks, fsdp_tp on a 2x2 mesh (4 ranks), float32 and float64, each
against the undecorated step on one device on the global batch.

`SPMD_TEST_BACKEND=inductor pytest tests/dist/test_backend_parity.py -m ""` checks the
Inductor-lowered program; unset, the fx interpreter. Tolerances (relative, max|a-b|/max|b|
over every parameter, optimizer-state tensor and loss): float32 1e-5, float64 1e-10. What
was measured on both backends is in the README ("Running the program as kernels").
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import spmd_compiler as sc
from spmd_compiler.lower import resolve_backend
from spmd_compiler.parallel_modes import make_mode
from spmd_compiler.tools.demo.steps import (
    classification_batches,
    classification_train_step,
    eager_classification_losses,
)
from spmd_compiler.tools.parity import backend_under_test, full_state, relative_difference

pytestmark = [pytest.mark.dist, pytest.mark.slow]

STEPS, GLOBAL_BATCH = 3, 8
FEATURES, HIDDEN, CLASSES = 8, 16, 4
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10}
DTYPES = {"float32": torch.float32, "float64": torch.float64}
WORLD = {"ddp": 2, "fsdp": 2, "tp": 2, "fsdp_tp": 4}


def _plan() -> dict:
    return {"0": ColwiseParallel(), "2": RowwiseParallel()}


def _mode(name: str):
    if name == "tp":
        return make_mode("tp", plan=_plan())
    if name == "fsdp_tp":
        return make_mode("fsdp_tp", plan=_plan(), mesh_shape=(2, 2))
    return make_mode(name)


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(FEATURES, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, CLASSES)
    ).to(dtype)


def _batches(dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return classification_batches(STEPS, GLOBAL_BATCH, FEATURES, CLASSES, dtype)


def _rows(mode: str, rank: int, world: int) -> slice:
    """This rank's share of the global batch: tp ranks all see the whole batch; on the
    (dp, tp) mesh the ranks of one dp coordinate (rank // tp) share a slice."""
    if mode == "tp":
        return slice(0, GLOBAL_BATCH)
    dp, dp_rank = (world // 2, rank // 2) if mode == "fsdp_tp" else (world, rank)
    share = GLOBAL_BATCH // dp
    return slice(dp_rank * share, (dp_rank + 1) * share)


def _worker(rank: int, world: int, modes: tuple[str, ...], backend: str) -> dict:
    out = {}
    for mode in modes:
        for dtype_name, dtype in DTYPES.items():
            model = _model(dtype)
            optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
            step = sc.compile(_mode(mode), backend=backend)(classification_train_step)
            rows = _rows(mode, rank, world)
            losses = [
                step(model, optim, x[rows], y[rows]).detach().clone()
                for x, y in _batches(dtype)
            ]
            lowered = step.last_program.executable.step
            out[(mode, dtype_name)] = {
                "losses": losses,
                "state": full_state(model, optim, None),  # a collective: every rank calls
                "lowered": lowered._compiled is not None,
                "backend": lowered.options.backend,
            }
    return out


@functools.cache
def _launch(world: int) -> list[dict]:
    modes = tuple(m for m, w in WORLD.items() if w == world)
    return sc.launch(_worker, world, args=(modes, backend_under_test()), timeout_s=1800)


def _reference(dtype: torch.dtype) -> tuple[list[torch.Tensor], dict]:
    model = _model(dtype)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return eager_classification_losses(model, optim, _batches(dtype)), full_state(model, optim, None)


@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
@pytest.mark.parametrize("mode", sorted(WORLD))
def test_matches_single_device(mode: str, dtype_name: str) -> None:
    dtype = DTYPES[dtype_name]
    results = _launch(WORLD[mode])
    losses, state = _reference(dtype)
    backend = resolve_backend(backend_under_test(), "cpu")
    tolerance = TOLERANCE[dtype]
    for rank, per_rank in enumerate(results):
        got = per_rank[(mode, dtype_name)]
        assert got["backend"] == backend, got["backend"]
        assert got["lowered"] == (backend == "inductor"), "lowered on the wrong backend"
        loss_diff = max(relative_difference(a, b) for a, b in zip(got["losses"], losses))
        worst = max(relative_difference(got["state"][k], v) for k, v in state.items())
        print(f"{backend} {mode} {dtype_name} rank {rank}: loss {loss_diff:.2e} state {worst:.2e}")
        assert loss_diff <= tolerance, f"rank {rank}: loss rel diff {loss_diff:.2e}"
        assert worst <= tolerance, f"rank {rank}: max state rel diff {worst:.2e}"
