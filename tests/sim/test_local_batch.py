"""A data-parallel rank holds only its local batch (NOTE: [local batch only]).

The gradient of a ``.sum()`` loss is ``expand(ones_like(loss), batch shape)`` and a mask
made in forward with ``torch.ones(batch, ...)`` has the batch shape too; neither depends
on a sharded input, so DTensor made them Replicate with the GLOBAL batch on every rank.
Each case checks parity with the eager step on the global batch and that no node of the
per-rank program has the global batch size in any dimension.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import spmd_compiler as sc
from spmd_compiler.parallel_modes import DataParallel, DTensorExpandMode
from spmd_compiler.tools.parity import compare_states, full_state, relative_difference

WORLD, BATCH, WIDTH = 4, 64, 10
TOL = 1e-5


class MaskedMLP(nn.Module):
    """forward makes a (batch, width) tensor from a factory, like a default attention mask."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.ones(x.shape[0], WIDTH) * 0.5
        return self.fc2(torch.relu(self.fc1(x)) * mask)


def sum_step(model, optim, x):
    loss = model(x).sum()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _modes():
    return [DTensorExpandMode(), DataParallel("replicate"), DataParallel("fully_shard")]


@pytest.mark.parametrize("masked", [False, True], ids=["sum_loss", "factory_mask"])
@pytest.mark.parametrize("mode", _modes(), ids=lambda m: m.name)
def test_rank_holds_only_local_batch(mode, masked):
    torch.manual_seed(0)
    model = MaskedMLP() if masked else nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH))
    reference = type(model)() if masked else nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH))
    reference.load_state_dict(model.state_dict())
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    step = sc.compile(parallel_mode=mode)(sum_step)
    gen = torch.Generator().manual_seed(1)
    with sc.simulate(WORLD) as sim:
        for _ in range(2):
            x = torch.randn(BATCH, WIDTH, generator=gen)
            loss, expected = step(model, optim, x), sum_step(reference, ref_optim, x)
            assert relative_difference(loss, expected) < TOL
        diffs = compare_states(full_state(model, optim, sim), full_state(reference, ref_optim, None))
    assert max(diffs.values()) < TOL
    for node in step.last_program.graph_module.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            assert BATCH not in val.shape, f"{node.format_node()} holds the global batch {tuple(val.shape)}"
