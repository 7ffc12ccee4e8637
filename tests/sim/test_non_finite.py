"""NaN and inf propagate on simulated ranks exactly as in eager.

A NaN or inf in the input (and the NaN mean of an empty batch) makes the loss, the
gradients and then the parameters non-finite. The compiled step on simulated ranks must
return the same non-finite values at the same positions as the eager single-device step,
not fail because NaN != NaN when the replicated result is checked across ranks.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.parallel_modes import DataParallel
from spmd_compiler.runtime.simulate import same_value
from spmd_compiler.tools.parity import full_state


def regression_step(model, optim, x, y):
    out = model(x)
    loss = F.mse_loss(out, y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss, out.detach().sum()


def _assert_same_with_non_finite(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    actual, expected = actual.detach(), expected.detach()
    assert actual.shape == expected.shape, what
    assert torch.equal(actual.isnan(), expected.isnan()), f"{what}: NaN positions differ"
    assert torch.equal(actual.isposinf(), expected.isposinf()), f"{what}: +inf positions differ"
    assert torch.equal(actual.isneginf(), expected.isneginf()), f"{what}: -inf positions differ"
    finite = expected.isfinite()
    torch.testing.assert_close(actual[finite], expected[finite], rtol=1e-5, atol=1e-6, msg=what)


def _batch(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
    if kind == "nan":
        x[5, 2] = float("nan")  # in rank 1's share
    elif kind == "inf":
        x[1, 0] = float("inf")  # in rank 0's share
    elif kind == "empty":
        x, y = x[:0], y[:0]
    return x, y


@pytest.mark.parametrize("mode", ["replicate", "fully_shard"])
@pytest.mark.parametrize("kind", ["nan", "inf", "empty"])
def test_non_finite_values_propagate_as_in_eager(mode: str, kind: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 3))
    reference = copy.deepcopy(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    reference_optim = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    step = sc.compile(DataParallel(mode))(regression_step)
    clean = _batch("clean")
    with sc.simulate(world_size=2) as sim:
        for i, (x, y) in enumerate([clean, _batch(kind), clean]):
            got = step(model, optim, x, y)
            want = regression_step(reference, reference_optim, x, y)
            for name, a, b in zip(("loss", "output sum"), got, want):
                _assert_same_with_non_finite(a, b, f"step {i} {name}")
        state = full_state(model, optim, sim)
    expected = full_state(reference, reference_optim, None)
    assert set(state) == set(expected)
    if kind != "empty":  # an empty batch leaves the state finite (zero gradients)
        assert any(not v.isfinite().all() for v in expected.values()), "nothing non-finite"
    for key, value in expected.items():
        _assert_same_with_non_finite(state[key], value, key)


def test_same_value_treats_nan_as_equal_only_at_the_same_position() -> None:
    nan = float("nan")
    assert same_value(torch.tensor([1.0, nan]), torch.tensor([1.0, nan]))
    assert not same_value(torch.tensor([1.0, nan]), torch.tensor([nan, 1.0]))
    assert not same_value(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5]))
    assert same_value(torch.tensor([float("inf")]), torch.tensor([float("inf")]))
    assert not same_value(torch.tensor([float("inf")]), torch.tensor([float("-inf")]))
    assert same_value(torch.tensor([3, 4]), torch.tensor([3, 4]))
