"""Adam / AdamW at a learning rate of exactly 0 (NOTE: [Adam's update as eager's] in
``spmd_compiler/capture/optimizers.py``).

Every transformers warmup schedule starts at 0. The capturable update torch writes for
graphs divides by ``-lr / bias_correction``: at 0 an element whose second moment is 0
(an embedding row no batch used) became 0 / -0 = NaN, and the whole model NaN a step
later, silently; eager leaves the parameters as they are. The update now takes eager's
own formula. Each case failed before (NaN).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.parallel_modes import DataParallel


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


def _step(model, optim, scheduler, ids, labels):
    loss = F.cross_entropy(model(ids).flatten(0, 1), labels.flatten())
    loss.backward()
    optim.step()
    scheduler.step()
    optim.zero_grad()
    return loss


@pytest.mark.parametrize("mode", ["replicate", "fully_shard"])
@pytest.mark.parametrize("optimizer", ["Adam", "AdamW_amsgrad"])
def test_a_warmup_from_zero_trains_as_eager(mode, optimizer):
    torch.manual_seed(0)
    model = TinyLM().double()
    reference = copy.deepcopy(model)

    def parts(m: nn.Module) -> tuple:
        opt = (torch.optim.Adam(m.parameters(), lr=1e-2) if optimizer == "Adam"
               else torch.optim.AdamW(m.parameters(), lr=1e-2, amsgrad=True))
        warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 2))  # 0, 0.5, 1
        return opt, warmup

    (optim, scheduler), (reference_optim, reference_scheduler) = parts(model), parts(reference)
    gen = torch.Generator().manual_seed(1)
    compiled = sc.compile(parallel_mode=DataParallel(mode))(_step)
    with sc.simulate(world_size=2):
        for _ in range(4):
            ids = torch.randint(0, 4, (8, 3), generator=gen)  # rows 4..15 never used
            labels = torch.randint(0, 16, (8, 3), generator=gen)
            loss = compiled(model, optim, scheduler, ids, labels)
            expected = _step(reference, reference_optim, reference_scheduler, ids, labels)
            assert torch.allclose(loss, expected, rtol=1e-12, atol=0)
        state = sc.checkpoint.full_state_dict(model, optim)
    for name, value in reference.state_dict().items():
        assert not state["model"][name].isnan().any(), name
        assert torch.allclose(state["model"][name], value, rtol=1e-12, atol=1e-15), name
