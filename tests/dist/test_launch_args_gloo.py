"""What ``sc.launch(fn, world_size, args=(...))`` hands each rank is that rank's own copy
(NOTE: [each rank its own copy of the arguments] in ``spmd_compiler/runtime/launch.py``),
on 2 real gloo ranks, float64. Before its fix every tensor in ``args`` was ONE shared
memory for all ranks and the parent: a rank's write showed in the other rank and the
parent, and a model built in the parent and passed in ``args`` trained wrong with no error
(both ranks updated the same memory; Adam, 3 calls, replicate: losses 2.3e-2 to 2.7e-2
relative off eager, state up to 1.0) and came back changed in the parent (fully_shard too:
its BatchNorm buffers). One launch serves every test here."""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import spmd_compiler as sc
from spmd_compiler.parallel_modes import DataParallel
from spmd_compiler.tools.demo.steps import classification_batches, classification_train_step
from spmd_compiler.tools.parity import backend_under_test, full_state, relative_difference

pytestmark = pytest.mark.dist

WORLD_SIZE, GLOBAL_BATCH, STEPS = 2, 8, 3
MODES = ("replicate", "fully_shard")


def _model_and_optimizer(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    # buffers too: fully_shard copies parameters into their shards at the first call, but
    # running statistics stay whole, so before the fix both modes wrote the parent's memory
    model = nn.Sequential(nn.Linear(6, 16, bias=False), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3)).double()
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return classification_batches(STEPS, GLOBAL_BATCH, 6, 3, torch.float64)


def _worker(
    rank: int, world_size: int, written: torch.Tensor, trained: dict[str, Any], backend: str,
    *, bound: torch.Tensor,
) -> dict[str, Any]:
    dist.barrier()
    if rank == 0:  # rank 0 alone writes into its argument and into what fn carries
        written.add_(1.0)
        bound.add_(1.0)
    dist.barrier()  # rank 1 reads after rank 0 wrote
    out: dict[str, Any] = {"seen": written.clone(), "returned": written, "bound": bound.clone()}
    rows = slice(rank * GLOBAL_BATCH // world_size, (rank + 1) * GLOBAL_BATCH // world_size)
    for mode in MODES:
        model, optim = trained[mode]  # built in the parent
        step = sc.compile(DataParallel(mode), backend=backend)(classification_train_step)
        losses = [step(model, optim, x[rows], y[rows]).detach().clone() for x, y in _batches()]
        out[mode] = (torch.stack(losses), full_state(model, optim, None))
    return out


@pytest.fixture(scope="module")
def launched() -> tuple[list[dict[str, Any]], torch.Tensor, dict[str, Any], dict[str, Any]]:
    written, bound = torch.zeros(3, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    trained = {mode: _model_and_optimizer(seed) for seed, mode in enumerate(MODES)}
    before = copy.deepcopy(trained)
    fn = functools.partial(_worker, bound=bound)  # a tensor carried by fn itself
    results = sc.launch(fn, WORLD_SIZE, args=(written, trained, backend_under_test()), timeout_s=600)
    assert bound.tolist() == [0.0, 0.0], "the parent's tensor carried by fn was written by a rank"
    return results, written, trained, before


def test_a_rank_writing_into_an_argument_is_not_seen_elsewhere(launched) -> None:
    results, written, _, _ = launched
    assert results[0]["seen"].tolist() == [1.0, 1.0, 1.0], "rank 0's own write is lost"
    assert results[1]["seen"].tolist() == [0.0, 0.0, 0.0], "rank 1 saw rank 0's write"
    assert written.tolist() == [0.0, 0.0, 0.0], "the parent's tensor was written by a rank"
    assert [r["bound"].tolist() for r in results] == [[1.0, 1.0], [0.0, 0.0]]
    # what comes back aliases neither another rank's result nor the parent's argument
    results[0]["returned"].add_(10.0)
    assert results[1]["returned"].tolist() == [0.0, 0.0, 0.0]
    assert written.tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("mode", MODES)
def test_a_model_passed_in_args_trains_as_eager(launched, mode: str) -> None:
    results, _, trained, before = launched
    model, optim = copy.deepcopy(before[mode])  # the optimizer still holds these parameters
    losses = torch.stack([classification_train_step(model, optim, x, y).detach() for x, y in _batches()])
    expected = full_state(model, optim, None)
    for rank, result in enumerate(results):
        got_losses, got_state = result[mode]
        assert relative_difference(got_losses, losses) < 1e-12, (rank, got_losses, losses)
        assert got_state.keys() == expected.keys()
        worst = max(got_state, key=lambda k: relative_difference(got_state[k], expected[k]))
        assert relative_difference(got_state[worst], expected[worst]) < 1e-10, (rank, worst)
    # the parent's model and optimizer are left as they were: untrained, no Adam state
    parent_model, parent_optim = trained[mode]
    assert not parent_optim.state, "the ranks' optimizer steps reached the parent's optimizer"
    for name, value in before[mode][0].state_dict().items():
        assert torch.equal(parent_model.state_dict()[name], value), name
