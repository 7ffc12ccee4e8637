"""The margin losses in plain ops (NOTE: [margin losses at capture]) against torch's
kernels, eager, float64: losses and input gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spmd_compiler.capture.margin_losses import multi_margin_loss, multilabel_margin_loss

TOL = 1e-14
N, C = 5, 6


def _close(ours: torch.Tensor, theirs: torch.Tensor, x: torch.Tensor) -> None:
    g_ours, = torch.autograd.grad(ours.sum(), x)
    g_theirs, = torch.autograd.grad(theirs.sum(), x)
    assert torch.allclose(ours, theirs, rtol=TOL, atol=TOL)
    assert torch.allclose(g_ours, g_theirs, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("p,margin,weighted", [(1, 1.0, False), (2, 0.3, True), (1, 0.5, True)])
def test_multi_margin_matches_the_kernel(reduction, p, margin, weighted) -> None:
    gen = torch.Generator().manual_seed(p * 10 + int(weighted))
    for _ in range(10):
        x = torch.randn(N, C, dtype=torch.float64, generator=gen, requires_grad=True)
        y = torch.randint(0, C, (N,), generator=gen)
        w = torch.rand(C, dtype=torch.float64, generator=gen) if weighted else None
        _close(
            multi_margin_loss(x, y, p=p, margin=margin, weight=w, reduction=reduction),
            F.multi_margin_loss(x, y, p=p, margin=margin, weight=w, reduction=reduction), x,
        )


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_multilabel_margin_matches_the_kernel(reduction) -> None:
    """Target lists end at the first -1 (classes after it do not count); a class listed
    twice counts twice."""
    gen = torch.Generator().manual_seed(1)
    for trial in range(10):
        x = torch.randn(N, C, dtype=torch.float64, generator=gen, requires_grad=True)
        t = torch.randint(-1, C, (N, C), generator=gen)
        t[:, 0] = torch.randint(0, C, (N,), generator=gen)
        if trial % 2:
            t[:, 1] = t[:, 0]
        _close(multilabel_margin_loss(x, t, reduction=reduction),
               F.multilabel_margin_loss(x, t, reduction=reduction), x)


def test_one_sample_and_legacy_arguments() -> None:
    x = torch.randn(C, dtype=torch.float64, requires_grad=True)
    _close(multi_margin_loss(x, torch.tensor(2)), F.multi_margin_loss(x, torch.tensor(2)), x)
    t = torch.tensor([3, 0, -1, 1, 1, 1])
    _close(multilabel_margin_loss(x, t), F.multilabel_margin_loss(x, t), x)
    xb = torch.randn(N, C, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, C, (N,))
    _close(multi_margin_loss(xb, y, size_average=False), F.multi_margin_loss(xb, y, size_average=False), xb)
    with pytest.raises(ValueError, match="p == 1 and p == 2"):
        multi_margin_loss(xb, y, p=3)
