"""Variances over the batch as sums (NOTE: [variances by sums] in
``spmd_compiler/expand/local_rules.py``): a batch norm's statistics, and ``var`` / ``std``
/ ``std_mean`` of a step, reduce one value per channel across ranks instead of gathering
the activation. float64, 2 simulated ranks, against the undecorated step on one device.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.ir.collectives import collective_kind, is_collective, tensor_bytes
from spmd_compiler.parallel_modes import make_mode
from spmd_compiler.tools.demo.steps import classification_train_step as plain_step
from spmd_compiler.tools.parity import full_value, relative_difference

TOL = 1e-10
BATCH, CLASSES = 8, 4


class _ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(6)
        self.conv2 = nn.Conv2d(6, 6, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(6)
        self.head = nn.Linear(6, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(x + self.bn2(self.conv2(x)))
        return self.head(x.mean((2, 3)))


def statistics_step(model, optim, x, y):  # noqa: ANN001, ANN201
    """Batch statistics in the loss: a whitening penalty, unbiased and not."""
    features = model.conv1(x).mean((2, 3))
    std, mean = torch.std_mean(features, dim=0)
    penalty = (std - 1).pow(2).mean() + mean.pow(2).mean() + features.var(0, correction=0).mean()
    loss = F.cross_entropy(model(x), y) + 0.1 * penalty + 0.01 * features.std()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    return [
        (torch.randn(BATCH, 3, 8, 8, generator=gen, dtype=torch.float64) * 3 + 1,
         torch.randint(0, CLASSES, (BATCH,), generator=gen))
        for _ in range(3)
    ]


def _run(step, mode: str, run_parity):  # noqa: ANN001, ANN202
    result = run_parity(
        lambda: _ConvNet().double(),
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
        2, _batches(), step=step, mode=make_mode(mode),
    )
    result.assert_close(TOL)
    return result


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.parametrize("step", [plain_step, statistics_step], ids=["batch_norm", "statistics"])
def test_variances_over_the_batch_train_as_one_device(step, mode, run_parity):
    _run(step, mode, run_parity)


def test_batch_norms_exchange_statistics_only(run_parity):
    """Under ddp each batch norm's forward statistics travel in one all-gather of two
    values per channel and rank (its sum and squared deviations: one round trip, where
    the two-pass sums took two dependent all-reduces); no activation is gathered (before
    the sums: one all-gather of the activation per batch norm), and the rest are
    all-reduces (backward's per-channel sums, the gradients)."""
    result = _run(plain_step, "ddp", run_parity)
    graph = result.compiled.last_program.graph_module.graph
    kinds = [collective_kind(n) for n in graph.nodes if is_collective(n)]
    assert set(kinds) == {"all_reduce", "all_gather"}, kinds
    gathers = [n for n in graph.nodes if is_collective(n) and collective_kind(n) == "all_gather"]
    assert len(gathers) == 2  # one per batch norm
    for node in gathers:
        assert tensor_bytes(node) == 2 * 2 * 6 * 8  # ranks x (sum, M2) x channels x float64


def test_a_large_mean_keeps_the_variance():
    """The parts' statistics are combined without subtracting raw sums of squares: a
    batch norm of values around 1e4 with a spread of 1e-3 normalizes as eager does (the
    one-pass formula, E[x^2] - E[x]^2, is 3.7e-2 off the variance there in float64, and
    the output 1.2e-2)."""
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(3, eps=1e-12).double()
    reference = copy.deepcopy(norm)
    x = 1e4 + 1e-3 * torch.randn(BATCH, 3, dtype=torch.float64)

    def step(module, inputs):  # noqa: ANN001, ANN202
        return module(inputs)

    with sc.simulate(world_size=2) as sim:
        out = sc.compile(make_mode("ddp"))(step)(norm, x)
        assert relative_difference(full_value(out, sim), step(reference, x)) < 1e-6

