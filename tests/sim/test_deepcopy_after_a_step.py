"""``copy.deepcopy`` of a model (and its optimizer) after a compiled step: DQN's target
network and EMA copies are made so (NOTE: [placed state that deepcopy copies]). It
raised torch's "Attempted to call copy_() on an invalid python storage" on the weight's
gradient, a view at offset 4 of a flat buffer; the copy is now an independent model with
the same placed values."""

import copy

import pytest
import torch
import torch.nn as nn

import spmd_compiler as sc
from spmd_compiler.parallel_modes import make_mode
from spmd_compiler.tools.parity import full_value


def _step(model, optim, x):  # noqa: ANN001, ANN202
    loss = model(x).pow(2).mean()
    optim.zero_grad()
    loss.backward()
    optim.step()
    return loss.detach()


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_deepcopy_after_a_step_is_an_independent_copy_with_the_same_values(mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 4))
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    with sc.simulate(world_size=2) as sim:
        step = sc.compile(make_mode(mode))(_step)
        step(model, optim, torch.randn(8, 6))
        target = copy.deepcopy(model)
        optim_copy = copy.deepcopy(optim)
        names = [name for name, _ in model.named_parameters()]
        for name, p, q in zip(names, model.parameters(), target.parameters(), strict=True):
            assert q is not p
            assert torch.equal(full_value(q, sim), full_value(p, sim)), name
            assert torch.equal(full_value(q.grad, sim), full_value(p.grad, sim)), name
        assert len(optim_copy.state) == len(optim.state) == len(names)
        before = [full_value(p, sim).clone() for p in target.parameters()]
        step(model, optim, torch.randn(8, 6))  # the original moves, the copy does not
        for b, p, q in zip(before, model.parameters(), target.parameters(), strict=True):
            assert torch.equal(full_value(q, sim), b)
            assert not torch.equal(full_value(p, sim), b)
