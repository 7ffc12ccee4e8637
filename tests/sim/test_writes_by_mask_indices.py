"""Writes by the indices of a mask (NOTE: [writes by the indices of a mask]).

``final[torch.where(cond)] = 0``, ``final[torch.where(cond)[0]] = 0``,
``final[cond.nonzero().squeeze(1)] = 0`` and ``final.index_put_(torch.where(cond), v)``
(pytorch-metric-learning's CircleLoss zeroing the anchors without a positive) are
``final[cond] = 0``: they match the undecorated step on one device on the global batch
(float64, within 1e-12; ddp and fsdp, 2 simulated ranks, 3 calls, batches with and
without such anchors). Indices changed in value are torch's own: a call with a false
element raises, nothing is guessed.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.errors import SPMDRuntimeError
from spmd_compiler.parallel_modes import make_mode
from spmd_compiler.tools.parity import run_against_eager

TOL = 1e-12


def _zeroed(kind: str, final: torch.Tensor, cond: torch.Tensor) -> None:
    if kind == "mask":
        final[cond] = 0
    elif kind == "where":
        final[torch.where(cond)] = 0
    elif kind == "where0":
        final[torch.where(cond)[0]] = 0
    elif kind == "nonzero":
        final[cond.nonzero().squeeze(1)] = 0
    elif kind == "index_put_":
        final.index_put_(torch.where(cond), torch.zeros((), dtype=final.dtype))
    elif kind == "shifted":  # not the mask's indices
        final[(torch.where(cond)[0] + 1) % final.shape[0]] = 0
    else:
        raise ValueError(kind)


def _step(kind: str):  # noqa: ANN202
    def step(model, optim, x, y):  # noqa: ANN001
        z = F.normalize(model(x))
        sim = z @ z.T
        same = (y[:, None] == y[None]) & ~torch.eye(x.shape[0], dtype=torch.bool)
        losses = F.softplus(torch.logsumexp(sim.masked_fill(~same, -1e9), 1) - torch.logsumexp(sim, 1))
        cond = same.sum(1) == 0  # anchors without a positive
        final = torch.ones_like(losses)
        _zeroed(kind, final, cond)
        loss = (losses * final).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss.detach()

    return step


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    labels = [[0, 0, 1, 1, 2, 3, 3, 4], [0, 1, 1, 2, 2, 3, 3, 0], [5, 0, 1, 1, 2, 2, 0, 6]]
    return [(torch.randn(8, 8, generator=gen, dtype=torch.float64), torch.tensor(y)) for y in labels]


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.parametrize("kind", ["mask", "where", "where0", "nonzero", "index_put_"])
def test_a_write_by_the_indices_of_a_mask_matches_one_device(kind, mode):
    torch.manual_seed(0)
    pairs, differences, compiled = run_against_eager(
        nn.Linear(8, 6).double(), _step(kind), make_mode(mode), _batches(), lr=0.5
    )
    for i, (loss, expected) in enumerate(pairs):
        assert torch.allclose(loss, expected, rtol=TOL, atol=0), f"step {i}"
    assert max(differences.values()) < TOL, differences
    assert compiled.compile_count == 1


def test_indices_changed_in_value_are_torchs_own():
    torch.manual_seed(0)
    model = nn.Linear(8, 6).double()
    optim = torch.optim.SGD(model.parameters(), lr=0.5)
    compiled = sc.compile(make_mode("ddp"))(_step("shifted"))
    with sc.simulate(world_size=2), pytest.raises(SPMDRuntimeError, match="MaskWithFalseElements"):
        for x, y in _batches():
            compiled(model, optim, x, y)
