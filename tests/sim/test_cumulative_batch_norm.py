"""Batch norm with a cumulative moving average (``momentum=None``; NOTE: [cumulative batch
norm at capture]) against the undecorated step on one device on the global batch,
float64: every parameter and buffer (running mean and variance, the batch count) within
1e-12 after three steps, then an evaluation with the running statistics."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.errors import SPMDCompileError
from spmd_compiler.parallel_modes import make_mode
from spmd_compiler.tools.demo.steps import classification_train_step
from spmd_compiler.tools.parity import compare_models

TOL = 1e-12
STEPS = 3


class _Dense(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8, momentum=None)
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.relu(self.bn(self.fc(x))))


class _Conv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4, momentum=None)
        self.ema_bn = nn.BatchNorm2d(4)  # an ordinary one beside it
        self.out = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ema_bn(F.relu(self.bn(self.conv(x))))
        return self.out(h.mean((2, 3)))


step = classification_train_step  # forward, cross entropy, backward, step, zero_grad


def evaluate(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    model.eval()
    try:
        with torch.no_grad():
            return model(x)
    finally:
        model.train()


SHAPES = {_Dense: (8, 6), _Conv: (8, 2, 5, 5)}


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.parametrize("net", [_Dense, _Conv], ids=["batchnorm1d", "batchnorm2d"])
def test_cumulative_running_statistics_match_one_device(mode, net) -> None:
    torch.manual_seed(0)
    model = net().double()
    reference = copy.deepcopy(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    reference_optim = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    compiled = sc.compile(make_mode(mode))(step)
    compiled_eval = sc.compile(make_mode(mode))(evaluate)
    batches = [
        (torch.randn(SHAPES[net], dtype=torch.float64) * (i + 1) + i, torch.randint(0, 3, (8,)))
        for i in range(STEPS)
    ]
    with sc.simulate(world_size=2) as sim:
        for x, y in batches:
            loss = compiled(model, optim, x, y)
            expected = step(reference, reference_optim, x, y)
            assert abs(float(loss) - float(expected)) <= TOL * abs(float(expected))
        differences = compare_models(model, reference, sim)
        assert max(differences.values()) <= TOL, differences
        assert {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"} <= {
            k.removeprefix("param.").removeprefix("buffer.") for k in differences
        }, sorted(differences)
        assert float(sim.full_tensor(model.bn.num_batches_tracked)) == STEPS
        got = sim.full_tensor(compiled_eval(model, batches[0][0]))
    want = evaluate(reference, batches[0][0])
    assert torch.allclose(got, want, rtol=TOL, atol=TOL)
    assert compiled.compile_count == 2  # the first call (optimizer state), the steady state
    assert "forward" not in vars(model.bn)  # the module's own forward again


def test_an_input_of_the_wrong_rank_is_refused_as_eager_refuses_it() -> None:
    model = nn.Sequential(nn.BatchNorm2d(2, momentum=None), nn.Flatten(), nn.Linear(10, 3)).double()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 2, 5, dtype=torch.float64), torch.zeros(8, dtype=torch.long)
    with pytest.raises(ValueError, match="expected 4D input"):
        step(copy.deepcopy(model), optim, x, y)
    compiled = sc.compile(make_mode("ddp"))(step)
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError, match="expected 4D input"):
        compiled(model, optim, x, y)
    assert "forward" not in vars(model[0])


def _bn_step(avg: nn.Module, loader: list[torch.Tensor]) -> None:
    torch.optim.swa_utils.update_bn(loader, avg)  # momentum = None for its passes, then restored


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_update_bn_in_a_compiled_step_matches_one_device(mode) -> None:
    # torch's SWA recipe: update_bn sets momentum = None on each batch norm while the
    # step is traced (their momentum is 0.1 when the trace starts); before the
    # sixty-fourth session the step was refused (float() of num_batches_tracked)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3)).double()
    reference = copy.deepcopy(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    reference_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
    batches = [(torch.randn(8, 6, dtype=torch.float64) + i, torch.randint(0, 3, (8,))) for i in range(STEPS)]
    loader = [x for x, _ in batches]
    reference_swa = torch.optim.swa_utils.AveragedModel(reference)
    for x, y in batches:
        step(reference, reference_optim, x, y)
        reference_swa.update_parameters(reference)
    torch.optim.swa_utils.update_bn(loader, reference_swa)
    compiled = sc.compile(make_mode(mode))(step)
    compiled_bn = sc.compile(make_mode(mode))(_bn_step)
    compiled_eval = sc.compile(make_mode(mode))(evaluate)
    with sc.simulate(world_size=2) as sim:
        swa = None
        for x, y in batches:
            compiled(model, optim, x, y)
            swa = swa or torch.optim.swa_utils.AveragedModel(model)
            swa.update_parameters(model)
        compiled_bn(swa, loader)
        differences = compare_models(swa, reference_swa, sim)
        assert max(differences.values()) <= TOL, differences
        got = sim.full_tensor(compiled_eval(swa, batches[0][0]))
    want = evaluate(reference_swa, batches[0][0])
    assert torch.allclose(got, want, rtol=TOL, atol=TOL)
    assert swa.module[1].momentum == 0.1  # restored by update_bn, as in eager
    assert "forward" not in vars(swa.module[1])


def test_update_bn_outside_a_step_is_refused_naming_the_compiled_form() -> None:
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)).double()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randint(0, 3, (8,))
    compiled = sc.compile(make_mode("ddp"))(step)
    with sc.simulate(world_size=2):
        compiled(model, optim, x, y)
        with pytest.raises(SPMDCompileError, match=r"update_bn\(loader, model\)"):
            torch.optim.swa_utils.update_bn([x], model)
