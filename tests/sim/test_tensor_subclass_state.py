"""A buffer that is a plain subclass of torch.Tensor of the user's (``__torch_function__``
only, as ``t.as_subclass(Tagged)`` makes; NOTE: [plain tensor subclasses simulated]).

Before 2026-12-06 simulated ranks crashed placing it (``Multiple dispatch failed for
'aten.detach.default'`` from LocalTensorMode), where 2 real gloo ranks train as eager
and keep the subclass in the placed DTensor's local tensor. Simulated ranks now do the
same: float64 under ddp and fsdp within 1e-10 of the undecorated step on one device on
the global batch, and the buffer's full value is still the user's class.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import spmd_compiler as sc
from spmd_compiler.parallel_modes import make_mode
from spmd_compiler.tools.demo.steps import classification_train_step as train_step
from spmd_compiler.tools.parity import compare_models, compare_optimizers

TOL = 1e-10


class Tagged(torch.Tensor):
    pass


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 4)
        self.register_buffer("mask", (torch.arange(4.0) + 1).as_subclass(Tagged))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.mask


def _model() -> nn.Module:
    torch.manual_seed(0)  # a Tensor subclass without new_empty() cannot be deep-copied
    return Masked().double()


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_a_plain_tensor_subclass_buffer_trains_as_eager(mode):
    model, reference = _model(), _model()
    assert type(model.mask) is Tagged
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    reference_optim = torch.optim.Adam(reference.parameters(), lr=1e-2)
    step = sc.compile(make_mode(mode))(train_step)
    gen = torch.Generator().manual_seed(1)
    with sc.simulate(world_size=2) as sim:
        for _ in range(3):
            x = torch.randn(8, 16, generator=gen, dtype=torch.float64)
            y = torch.randint(0, 4, (8,), generator=gen)
            loss, expected = step(model, optim, x, y), train_step(reference, reference_optim, x, y)
            assert abs(float(loss) - float(expected)) < TOL
        state = {**compare_models(model, reference, sim), **compare_optimizers(optim, reference_optim, sim)}
        mask = sim.full_tensor(model.mask)
    assert max(state.values()) < TOL, state
    assert type(mask) is Tagged and torch.equal(mask.as_subclass(torch.Tensor), torch.arange(4.0).double() + 1)
