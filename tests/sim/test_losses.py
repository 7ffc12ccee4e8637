"""Every common loss keeps single-device equivalence on a batch-sharded step.

This guards against wrong DTensor sharding rules for loss backward ops (torch 2.13's
``mse_loss_backward`` with reduction="mean" divided by the local element count; we
decompose such ops at capture, see NOTE: [ops decomposed at capture]).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.tools.parity import compare_models, max_difference

LOSSES = {
    "mse": lambda out, y: F.mse_loss(out, y),
    "mse_sum": lambda out, y: F.mse_loss(out, y, reduction="sum"),
    "l1": lambda out, y: F.l1_loss(out, y),
    "smooth_l1": lambda out, y: F.smooth_l1_loss(out, y, beta=0.5),
    "huber": lambda out, y: F.huber_loss(out, y, delta=0.5),
    "bce": lambda out, y: F.binary_cross_entropy(torch.sigmoid(out), torch.sigmoid(y)),
    "bce_logits": lambda out, y: F.binary_cross_entropy_with_logits(out, torch.sigmoid(y)),
    "cross_entropy_smoothing": lambda out, y: F.cross_entropy(out, y.argmax(-1), label_smoothing=0.1),
    "nll": lambda out, y: F.nll_loss(F.log_softmax(out, -1), y.argmax(-1)),
    "kl_div": lambda out, y: F.kl_div(F.log_softmax(out, -1), F.softmax(y, -1), reduction="batchmean"),
    # NOTE: [margin losses at capture]: their backward ops have no DTensor rule
    "multi_margin": lambda out, y: F.multi_margin_loss(out, y.argmax(-1)),
    "multi_margin_p2_weighted_sum": lambda out, y: F.multi_margin_loss(
        out, y.argmax(-1), p=2, margin=0.5, weight=torch.linspace(0.5, 1.5, 6), reduction="sum"
    ),
    "multilabel_margin": lambda out, y: nn.MultiLabelMarginLoss()(out, _two_labels_then_stop(y)),
    # NOTE: [covariance at capture]: ATen's cov reads its degrees of freedom as a value;
    # the covariance of the features over the global batch, as a decorrelation penalty
    "cov_penalty": lambda out, y: F.mse_loss(out, y) + 0.1 * torch.cov(out.T).triu(1).pow(2).sum(),
    "corrcoef_penalty": lambda out, y: F.mse_loss(out, y) + 0.1 * out.T.corrcoef().triu(1).pow(2).sum(),
    # NOTE: [diagonals at capture]: the diagonal's backward is a diagonal_scatter (no rule
    # on torch 2.11), fill_diagonal_ an as_strided view (refused by DTensor)
    "barlow_twins_diagonal": lambda out, y: F.mse_loss(out, y)
    + 0.1 * (1 - (out.T @ y / out.shape[0]).diagonal()).pow(2).sum(),
    "contrastive_fill_diagonal": lambda out, y: F.cross_entropy(
        (out @ out.T).fill_diagonal_(float("-inf")), (torch.arange(out.shape[0]) + 1) % out.shape[0]
    ),
}


def _two_labels_then_stop(y: torch.Tensor) -> torch.Tensor:
    """Each sample's two largest entries as its labels, then -1 (the end of the list),
    then classes after the end that do not count."""
    order = y.argsort(-1, descending=True)
    return torch.cat([order[:, :2], torch.full_like(order[:, :1], -1), order[:, 3:]], -1)


def _check_parity(loss_fn, make_batch, tolerance: float, buffers: dict | None = None) -> None:
    """Two SGD steps of the compiled step on 2 simulated ranks beside the eager step on
    one device: losses and parameters within ``tolerance`` (relative)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 6))
    reference = copy.deepcopy(model)
    for name, value in (buffers or {}).items():  # module state: every rank holds it
        for m in (model, reference):
            m.register_buffer(name, value.clone())
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1)

    def step(model, optim, x, y):
        loss = loss_fn(model, x, y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    compiled = sc.compile()(step)
    gen = torch.Generator().manual_seed(3)
    with sc.simulate(2) as sim:
        for _ in range(2):
            x, y = make_batch(gen)
            got, want = compiled(model, optim, x, y), step(reference, ref_optim, x, y)
            assert abs(got.item() - want.item()) <= tolerance * abs(want.item())
        assert max_difference(compare_models(model, reference, sim)) < tolerance


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_loss_parity_world_2(name):
    loss_fn = LOSSES[name]
    _check_parity(
        lambda model, x, y: loss_fn(model(x), y),
        lambda gen: (torch.randn(8, 6, generator=gen), torch.randn(8, 6, generator=gen)),
        1e-5,
    )


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "class_weights"])
def test_cross_entropy_mean_with_ignored_targets_uneven_across_ranks(weighted):
    """Rank 0's half of the batch has 3 ignored targets, rank 1's none: the global mean
    is sum / (global count), not the average of the two ranks' means (DTensor's rule for
    ``nll_loss_forward``; NOTE: [ops decomposed at capture]). Class weights live on the
    model."""

    def batch(gen):
        x = torch.randn(8, 6, generator=gen)
        y = torch.randint(0, 6, (8,), generator=gen)
        y[:3] = -100
        return x, y

    weights = {"class_weight": torch.tensor([1.0, 2.0, 0.5, 1.5, 1.0, 3.0])} if weighted else None
    _check_parity(
        lambda model, x, y: F.cross_entropy(
            model(x), y, weight=getattr(model, "class_weight", None)
        ),
        batch,
        1e-6,
        weights,
    )


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "class_weights"])
@pytest.mark.parametrize("spatial", [(5,), (3, 4)], ids=["sequence_NCL", "segmentation_NCHW"])
def test_cross_entropy_over_positions_with_ignored_targets_uneven_across_ranks(spatial, weighted):
    """Logits (N, C, *spatial) go through ``nll_loss2d_forward``: rank 0's samples have
    ignored positions (label 255), rank 1's none. The returned mean was the average of
    the ranks' means (1.5e-2 off in a probe) while the gradients were right."""

    def batch(gen):
        x = torch.randn(8, *spatial, 6, generator=gen)
        y = torch.randint(0, 6, (8, *spatial), generator=gen)
        y[:4, :2] = 255
        return x, y

    weights = {"class_weight": torch.tensor([1.0, 2.0, 0.5, 1.5, 1.0, 3.0])} if weighted else None
    _check_parity(
        lambda model, x, y: F.cross_entropy(
            model(x).movedim(-1, 1), y, weight=getattr(model, "class_weight", None), ignore_index=255
        ),
        batch,
        1e-6,
        weights,
    )
