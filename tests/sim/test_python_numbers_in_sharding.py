"""A Python number added to a partial sum is added once, whatever DTensor's native sharding
cache holds (NOTE: [Python numbers in DTensor's native sharding cache] in
``_torch_private.py``).

DTensor's C++ cache keyed ``add(P, 2.0)`` like ``add(P, R)`` with ``R`` a 0-d replicated
tensor of the number's dtype, and reused that decision (keep the sum partial, split
``R``): the number was added on every rank. Before the fix, the first test's loss was
54.1 where one device gives 52.1 (its parameters followed), and the second test's step
compiled after another went wrong the same way; the third order failed with
"'float' object has no attribute 'placements'"."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import spmd_compiler as sc
from spmd_compiler.parallel_modes import DataParallel
from spmd_compiler.tools.parity import full_state, relative_difference

TOL = 1e-12


class Offsets(nn.Module):
    """A partial 0-d sum plus a 0-d replicated parameter, and/or plus a Python number."""

    def __init__(self, tensor: bool, number: bool) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 4, dtype=torch.float64))
        self.b = nn.Parameter(torch.tensor(0.5, dtype=torch.float64))
        self.tensor, self.number = tensor, number

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = (x * self.w).sum() / 10
        if self.tensor:
            total = total + self.b
        if self.number:
            total = total + 2.0
        return total.square()  # the gradients depend on the value


def _step(model: nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
    loss = model(x)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _assert_like_one_device(mode: str, model: nn.Module, sim: sc.Simulation | None = None) -> None:
    reference = copy.deepcopy(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.01)
    step = sc.compile(parallel_mode=DataParallel(mode))(_step)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        x = torch.randn(8, 4, dtype=torch.float64, generator=gen)
        got, want = step(model, optim, x), _step(reference, ref_optim, x)
        assert abs(got.item() - want.item()) <= TOL * abs(want.item()), (got, want)
    state, expected = full_state(model, optim, sim), full_state(reference, ref_optim, None)
    assert max(relative_difference(state[k], expected[k]) for k in expected) <= TOL


@pytest.mark.parametrize("mode", ["replicate", "fully_shard"])
def test_a_number_after_a_tensor_in_one_program(mode):
    with sc.simulate(world_size=2) as sim:
        _assert_like_one_device(mode, Offsets(tensor=True, number=True), sim)


@pytest.mark.parametrize("order", ["tensor_then_number", "number_then_tensor"])
def test_a_step_compiled_after_another(order):
    kinds = [(True, False), (False, True)]
    if order == "number_then_tensor":
        kinds.reverse()
    with sc.simulate(world_size=2) as sim:
        for tensor, number in kinds:
            _assert_like_one_device("replicate", Offsets(tensor=tensor, number=number), sim)
