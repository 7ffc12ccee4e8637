"""NOTE: [SyncBatchNorm at capture]: a model converted for DDP
(``nn.SyncBatchNorm.convert_sync_batchnorm``) compiles, its batch norms normalizing with
the global batch's statistics, as on one device; eagerly torch refuses the module on CPU.
The reference is the same model with its plain batch norms, run eagerly on one device on
the global batch (float64, 2 simulated ranks, every parameter and buffer within 1e-10)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import spmd_compiler as sc
from spmd_compiler.errors import SPMDCompileError
from spmd_compiler.parallel_modes import make_mode
from spmd_compiler.tools.demo.steps import classification_train_step as step
from spmd_compiler.tools.parity import compare_models, compare_optimizers

TOL = 1e-10


def _net(momentum: float | None) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8, momentum=momentum), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4), nn.BatchNorm1d(4, momentum=momentum),
    ).double()


def _batches():
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 3, 6, 6, generator=gen, dtype=torch.float64), torch.randint(0, 4, (8,), generator=gen))
        for _ in range(3)
    ]


def _trains_as(model: nn.Module, reference: nn.Module, mode: str) -> Any:
    """Three SGD-momentum calls of ``model`` compiled under ``mode`` (the third in eval
    mode) against ``reference`` eagerly on one device; returns the compiled step."""
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    reference_optim = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    compiled = sc.compile(make_mode(mode))(step)
    with sc.simulate(world_size=2) as sim:
        for i, (x, y) in enumerate(_batches()):
            if i == 2:  # an evaluation-mode call: the running statistics normalize
                model.eval()
                reference.eval()
            loss = compiled(model, optim, x, y)
            expected = step(reference, reference_optim, x, y).detach()
            assert abs(float(loss) - float(expected)) <= TOL * abs(float(expected))
        differences = compare_models(model, reference, sim)
        differences.update(compare_optimizers(optim, reference_optim, sim))
    assert "param.1.running_var" in differences
    assert max(differences.values()) < TOL, sorted(differences.items(), key=lambda kv: -kv[1])[:3]
    return compiled


@pytest.mark.parametrize("momentum", [0.1, None], ids=["exponential", "cumulative"])
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_sync_batch_norm_is_the_global_batch_norm(mode: str, momentum: float | None) -> None:
    reference = _net(momentum)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(reference))
    assert sum(isinstance(m, nn.SyncBatchNorm) for m in model.modules()) == 2
    _trains_as(model, reference, mode)
    assert all("forward" not in vars(m) for m in model.modules())  # the module is untouched


def test_a_process_group_of_part_of_the_world_is_refused() -> None:
    model = nn.SyncBatchNorm.convert_sync_batchnorm(_net(0.1))
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = sc.compile(make_mode("ddp"))(step)
    with sc.simulate(world_size=2):
        part = dist.new_group(ranks=[0])
        for m in model.modules():
            if isinstance(m, nn.SyncBatchNorm):
                m.process_group = part
        with pytest.raises(SPMDCompileError, match="process_group of 1 of the 2 ranks"):
            compiled(model, optim, *_batches()[0])


class _SyncBatchNormAct(nn.SyncBatchNorm):
    """timm's ``SyncBatchNormAct`` in miniature: its own ``forward`` calls torch's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(super().forward(x))


class _BatchNormAct(nn.BatchNorm2d):
    """The same on one device, on the global batch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(super().forward(x))


def _net_act(norm: type[nn.Module], momentum: float | None) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), norm(8, momentum=momentum),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
    ).double()


@pytest.mark.parametrize("momentum", [0.1, None], ids=["exponential", "cumulative"])
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_a_subclass_calling_super_forward_is_the_global_batch_norm(mode: str, momentum: float | None) -> None:
    """Before 2026-12-05 only a module whose class kept torch's ``forward`` ran the plain
    batch norm: a subclass's ``super().forward(x)`` reached torch's, which refused the CPU
    input at capture ("SyncBatchNorm expected input tensor to be on GPU")."""
    reference = _net_act(_BatchNormAct, momentum)
    model = _net_act(_SyncBatchNormAct, momentum)
    compiled = _trains_as(model, reference, mode)
    assert compiled.compile_count == 3  # the first call, with momentum buffers, evaluation: no more
    assert nn.SyncBatchNorm.__dict__["forward"] is _SYNC_FORWARD  # torch's again after capture


_SYNC_FORWARD = nn.SyncBatchNorm.__dict__["forward"]
