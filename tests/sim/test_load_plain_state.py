"""Plain tensors loaded into a model a compiled step placed (NOTE: [loading plain
tensors into a placed model] in ``spmd_compiler/runtime/eager_calls.py``).

``model.load_state_dict(best)`` with the ``"model"`` entry of ``full_state_dict`` (rolling
back to the best weights) failed in torch's ``copy_`` ("got mixed torch.Tensor and
DTensor"). Now each plain tensor is placed like the parameter it replaces, and training
goes on as it does eagerly from the same weights.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import spmd_compiler as sc
from spmd_compiler.parallel_modes import DataParallel


def _batches(n):
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 8, generator=gen, dtype=torch.float64), torch.randint(0, 4, (8,), generator=gen))
            for _ in range(n)]


@pytest.mark.parametrize("mode", ["replicate", "fully_shard"])
@pytest.mark.parametrize("where", ["inside", "after_the_block"])
def test_rolling_back_to_plain_weights_trains_as_eager(mode, where, train_step):
    _step = train_step
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4)).double()
    reference = copy.deepcopy(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    reference_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
    compiled = sc.compile(parallel_mode=DataParallel(mode))(_step)
    batches = _batches(4)
    with sc.simulate(world_size=2):
        compiled(model, optim, *batches[0])
        best = sc.checkpoint.full_state_dict(model)["model"]
        compiled(model, optim, *batches[1])
        if where == "inside":
            model.load_state_dict(best)
    if where == "after_the_block":
        model.load_state_dict(best)
    # the reference: the same two steps, rolled back to its own weights after the first
    _step(reference, reference_optim, *batches[0])
    reference_best = copy.deepcopy(reference.state_dict())
    _step(reference, reference_optim, *batches[1])
    reference.load_state_dict(reference_best)
    assert all(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())
    with sc.simulate(world_size=2):
        for x, y in batches[2:]:
            loss = compiled(model, optim, x, y)
            assert torch.allclose(loss, _step(reference, reference_optim, x, y), rtol=1e-12, atol=0)
        state = sc.checkpoint.full_state_dict(model)["model"]
    for name, value in reference.state_dict().items():
        assert torch.allclose(state[name], value, rtol=1e-10, atol=1e-14), name


def test_a_submodule_loads_its_own_plain_weights(train_step):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).double()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = sc.compile(parallel_mode=DataParallel("fully_shard"))(train_step)
    fresh = nn.Linear(16, 4).double()
    with sc.simulate(world_size=2):
        compiled(model, optim, *_batches(1)[0])
        model[2].load_state_dict(fresh.state_dict())
        state = sc.checkpoint.full_state_dict(model)["model"]
    assert torch.equal(state["2.weight"], fresh.weight.detach())
    assert torch.equal(state["2.bias"], fresh.bias.detach())


class _Symmetric(nn.Module):
    def forward(self, x):  # noqa: ANN001
        return x.triu() + x.triu(1).transpose(-1, -2)

    def right_inverse(self, a):  # noqa: ANN001
        return a.triu()


def _parametrized(kind):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)).double()
    if kind == "symmetric":
        torch.nn.utils.parametrize.register_parametrization(model[0], "weight", _Symmetric())
    else:
        torch.nn.utils.parametrizations.orthogonal(model[0])
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


@pytest.mark.parametrize("mode", ["replicate", "fully_shard"])
@pytest.mark.parametrize("kind", ["symmetric", "orthogonal"])
def test_assigning_a_parametrized_weight_between_calls_trains_as_eager(mode, kind, train_step):
    """NOTE: [assigning a parametrized tensor of a placed model]: ``model[0].weight = A``
    on a parametrized weight (through ``right_inverse``) failed with torch's "Cannot swap
    t1 and t2 if they have different slots" once a compiled step placed the original.
    Now the placed original takes the new value, placed like it, and training goes on
    as eager (the same Parameter: Adam's state goes on with it)."""
    gen = torch.Generator().manual_seed(5)
    new = torch.randn(8, 8, generator=gen, dtype=torch.float64)
    new = new + new.T if kind == "symmetric" else torch.eye(8, dtype=torch.float64)
    model, optim = _parametrized(kind)
    reference, reference_optim = _parametrized(kind)
    compiled = sc.compile(parallel_mode=DataParallel(mode))(train_step)
    batches = _batches(4)
    with sc.simulate(world_size=2):
        for i, (x, y) in enumerate(batches):
            if i == 2:
                placed = model[0].parametrizations.weight.original
                model[0].weight = new
                reference[0].weight = new
                assert model[0].parametrizations.weight.original is placed  # in place, as eager's set_
            loss, expected = compiled(model, optim, x, y), train_step(reference, reference_optim, x, y)
            assert torch.allclose(loss, expected, rtol=1e-12, atol=0), i
        state = sc.checkpoint.full_state_dict(model)["model"]
    assert isinstance(placed, torch.distributed.tensor.DTensor)
    for name, value in reference.state_dict().items():
        assert torch.allclose(state[name], value, rtol=1e-10, atol=1e-14), name
