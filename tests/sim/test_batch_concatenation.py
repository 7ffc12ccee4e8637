"""Views of one batch concatenated along the batch dimension (NOTE: [batch
concatenation] in ``spmd_compiler/expand/local_rules.py``): SimCLR's two augmented views
through one encoder, RAFT's ``feature_encoder(torch.cat([image1, image2]))`` chunked
back, a siamese network. Each rank concatenates its own shares, so the encoder runs on
the rank's rows only, with no collective before it.

float64, 2 simulated ranks, ddp and fsdp, against the undecorated step on one device on
the global batch. Before the rule, torch 2.13's ``cat`` gathered the batch (every rank ran
the encoder on every row) and torch 2.14's sharded the channels, whose convolution was
refused by the local shape check.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from spmd_compiler.ir.collectives import collective_stats
from spmd_compiler.parallel_modes import make_mode

TOL = 1e-10
BATCH, CLASSES = 4, 5


class _Encoder(nn.Module):
    def __init__(self, batch_norm: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 7, stride=2, padding=3)
        # a batch norm's statistics gather the activations (var_mean over the batch)
        self.norm = nn.BatchNorm2d(6) if batch_norm else nn.GroupNorm(2, 6)
        self.proj = nn.Linear(6, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.relu(self.norm(self.conv(x))).mean((2, 3)))


class _TwoViews(nn.Module):
    """RAFT's pattern: both images through one encoder, chunked back, compared."""

    def __init__(self, batch_norm: bool = True) -> None:
        super().__init__()
        self.encoder = _Encoder(batch_norm)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        f1, f2 = torch.chunk(self.encoder(torch.cat([a, b], dim=0)), 2, dim=0)
        return self.head(f1 * f2)


def two_views_step(model, optim, a, b, y):  # noqa: ANN001, ANN201
    loss = F.cross_entropy(model(a, b), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def simclr_step(model, optim, a, b, y):  # noqa: ANN001, ANN201
    """NT-Xent over the concatenated views: every embedding against every other."""
    z = F.normalize(model.encoder(torch.cat([a, b])), dim=-1)
    n = a.shape[0]
    similarity = z @ z.t() / 0.5
    similarity = similarity.masked_fill(torch.eye(2 * n, dtype=torch.bool), float("-inf"))
    targets = torch.cat([torch.arange(n, 2 * n), torch.arange(n)])
    loss = F.cross_entropy(similarity, targets)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def views_reshaped_step(model, optim, a, b, y):  # noqa: ANN001, ANN201
    """The concatenation viewed as (views, batch, ...) and its views averaged."""
    z = model.encoder(torch.cat([a, b, a.flip(-1)])).view(3, a.shape[0], -1)
    loss = F.cross_entropy(model.head(z.mean(0)), y) + z.var(0).mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def uneven_views_step(model, optim, a, b, y):  # noqa: ANN001, ANN201
    """Views of different sizes (a crop of half the batch): no placement states them."""
    z = model.encoder(torch.cat([a, b[: b.shape[0] // 2]]))
    loss = F.cross_entropy(model.head(z[: a.shape[0]]), y) + z[a.shape[0]:].pow(2).mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _batches() -> list[tuple[torch.Tensor, ...]]:
    # 64 x 64 images: at this size torch 2.14's ``cat`` rule shards the channels
    gen = torch.Generator().manual_seed(3)
    return [
        (
            torch.randn(BATCH, 3, 64, 64, generator=gen, dtype=torch.float64),
            torch.randn(BATCH, 3, 64, 64, generator=gen, dtype=torch.float64),
            torch.randint(0, CLASSES, (BATCH,), generator=gen),
        )
        for _ in range(2)
    ]


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    # SGD: the conv bias before the BatchNorm has a zero gradient in exact arithmetic,
    # which Adam would turn into noise-sized updates
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _parity(step, mode: str, run_parity, batch_norm: bool = True):  # noqa: ANN001, ANN202
    result = run_parity(
        lambda: _TwoViews(batch_norm).double(), _sgd, 2, _batches(), step=step,
        mode=make_mode(mode),
    )
    if batch_norm:
        bias = result.state_differences.pop("param.encoder.conv.bias")
        assert bias < 1e-8  # zero gradient in exact arithmetic: noise, compared loosely
        result.state_differences.pop("optim.g0.p1.momentum_buffer")
    result.assert_close(TOL)
    return result


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.parametrize(
    "step", [two_views_step, simclr_step, views_reshaped_step, uneven_views_step],
    ids=["two_views", "simclr", "views_reshaped", "uneven_views"],
)
def test_concatenated_views_train_as_one_device(step, mode, run_parity):
    _parity(step, mode, run_parity)


@pytest.mark.skipif(
    tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 13),
    reason="torch 2.11's convolution rule has no _StridedShard input: it gathers (exact)",
)
def test_the_encoder_runs_on_the_ranks_own_rows(run_parity):
    """Under ddp nothing is gathered (a group norm: no batch statistics): the rank's views
    are its rows of the concatenation, and ``chunk`` gives back each view's share."""
    result = _parity(two_views_step, "ddp", run_parity, batch_norm=False)
    stats = collective_stats(result.compiled.last_program.graph_module)
    assert set(stats.counts) == {"all_reduce"}, stats.counts
