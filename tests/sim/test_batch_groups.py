"""A view that splits a data-parallel batch into groups (GRPO's ``rewards.view(-1, G)``,
a listwise loss over each group's scores) where the groups span ranks: ddp and fsdp on 2
and 4 simulated ranks train as eager on one device, float64 (NOTE: [groups spanning
ranks gathered] in ``spmd_compiler/expand/retrace.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import spmd_compiler as sc
from spmd_compiler.parallel_modes import make_mode

TOL = 1e-12


def _grpo_step(group: int):  # noqa: ANN202
    def step(model, optim, x, rewards):  # noqa: ANN001, ANN202
        r = rewards.view(-1, group)  # (groups, G)
        advantage = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1)
        loss = -(model(x).squeeze(-1) * advantage).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        return loss.detach()

    return step


def _listwise_step(group: int):  # noqa: ANN202
    """The gradient flows through the view: a softmax over each group's scores."""

    def step(model, optim, x, target):  # noqa: ANN001, ANN202
        scores = model(x).squeeze(-1).view(-1, group)
        loss = -(torch.log_softmax(scores, -1) * target.view(-1, group)).sum(-1).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        return loss.detach()

    return step


def _run(step, batch: int, mode: str | None, world: int):  # noqa: ANN001, ANN202
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1)).double()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(1)
    batches = [(torch.randn(batch, 4, dtype=torch.float64, generator=data),
                torch.rand(batch, dtype=torch.float64, generator=data)) for _ in range(2)]
    if mode is None:
        losses = [float(step(model, optim, x, r)) for x, r in batches]
        return losses, [p.detach().clone() for p in model.parameters()]
    compiled = sc.compile(make_mode(mode))(step)
    with sc.simulate(world_size=world):
        losses = [float(compiled(model, optim, x, r)) for x, r in batches]
        params = [p.full_tensor().clone() for p in model.parameters()]
    return losses, params


@pytest.mark.parametrize(
    ("make", "batch", "group"),
    [
        (_grpo_step, 8, 4),  # 2 groups on 4 ranks: refused before
        (_grpo_step, 12, 2),  # 6 groups on 4 ranks (3 rows a rank): refused before
        (_grpo_step, 8, 8),  # one group: compiled before too
        (_listwise_step, 8, 4),
        (_listwise_step, 12, 6),  # 2 groups of 6 on 4 ranks of 3 rows
    ],
)
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_groups_spanning_ranks_train_as_eager(make, batch, group, mode) -> None:
    step = make(group)
    eager_losses, eager_params = _run(step, batch, None, 1)
    for world in (2, 4):
        losses, params = _run(step, batch, mode, world)
        assert losses == pytest.approx(eager_losses, rel=TOL), world
        for p, e in zip(params, eager_params):
            torch.testing.assert_close(p, e, rtol=TOL, atol=1e-14)
