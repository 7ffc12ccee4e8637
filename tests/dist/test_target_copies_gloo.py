"""A hard target update inside the step (``q_targ.load_state_dict(q.state_dict())`` on
some calls) on 2 real gloo ranks, against one device on the global batch, float64 (NOTE:
[state written as another state's value] in ``spmd_compiler/capture/written_state.py``).
Before its fix ``q_targ`` came out as ``q`` after the update on every call that copied.
The backend under test (NOTE: [test backend]); Inductor's lowered program (its own
donation, ``state_donation.donate``) in the slow case."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import spmd_compiler as sc
from spmd_compiler.tools.parity import backend_under_test, full_state, relative_difference
from tests.sim.test_target_copies import _dqn_step

pytestmark = pytest.mark.dist

WORLD_SIZE, GLOBAL_BATCH = 2, 8
HARD = [True, False, True, True]


def _setup() -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    q = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4)).double()
    q_targ = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4)).double()
    q_targ.requires_grad_(False)
    return q, q_targ, torch.optim.Adam(q.parameters(), lr=1e-2)


def _batches() -> list[tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(5)
    f64 = torch.float64
    return [
        (torch.randn(GLOBAL_BATCH, 6, generator=gen, dtype=f64), torch.randint(0, 4, (GLOBAL_BATCH,), generator=gen),
         torch.randn(GLOBAL_BATCH, generator=gen, dtype=f64), torch.randn(GLOBAL_BATCH, 6, generator=gen, dtype=f64))
        for _ in HARD
    ]


def _worker(rank: int, world: int, mode: str, backend: str) -> list[dict[str, torch.Tensor]]:
    q, q_targ, optim = _setup()
    step = sc.compile(parallel_mode=sc.parallel_modes.DataParallel(mode), backend=backend)(_dqn_step)
    share = GLOBAL_BATCH // world
    rows = slice(rank * share, (rank + 1) * share)
    states = []
    for batch, hard in zip(_batches(), HARD, strict=True):
        step(q, q_targ, optim, *(t[rows] for t in batch), hard)
        states.append(_named(full_state(q_targ, None, None), full_state(q, optim, None)))
    return states


def _named(target: dict[str, torch.Tensor], online: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {**{f"q_targ.{k}": v for k, v in target.items()}, **{f"q.{k}": v for k, v in online.items()}}


def _reference() -> list[dict[str, torch.Tensor]]:
    q, q_targ, optim = _setup()
    q, q_targ = copy.deepcopy(q), copy.deepcopy(q_targ)
    optim = torch.optim.Adam(q.parameters(), lr=1e-2)
    states = []
    for batch, hard in zip(_batches(), HARD, strict=True):
        _dqn_step(q, q_targ, optim, *batch, hard)
        states.append(_named(full_state(q_targ, None, None), full_state(q, optim, None)))
    return states


def _check(mode: str, backend: str) -> None:
    results = sc.launch(_worker, WORLD_SIZE, args=(mode, backend), timeout_s=900)
    want = _reference()
    for rank_states in results:
        for call, (got, expected) in enumerate(zip(rank_states, want, strict=True)):
            assert got.keys() == expected.keys()
            for name, value in expected.items():
                assert relative_difference(got[name], value) < 1e-10, (call, name)


@pytest.mark.parametrize("mode", ["replicate", "fully_shard"])
def test_a_hard_target_update_in_the_step(mode: str) -> None:
    _check(mode, backend_under_test())


@pytest.mark.slow
@pytest.mark.inductor
def test_a_hard_target_update_lowered() -> None:
    _check("replicate", "inductor")
