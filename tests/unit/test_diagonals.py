"""Writes to a diagonal as selects (NOTE: [diagonals at capture]) against torch's own ops,
bit for bit: ``diagonal_scatter`` for every pair of dimensions and offset of 2- to 4-D
tensors (negative dimensions too), and ``fill_diagonal_`` with and without ``wrap``."""

from __future__ import annotations

import itertools

import pytest
import torch

from spmd_compiler.capture.diagonals import diagonal_scatter_by_mask, fill_diagonal_


@pytest.mark.parametrize("shape", [(4, 4), (3, 5), (5, 3), (2, 3, 4), (3, 2, 4, 5)], ids=str)
def test_diagonal_scatter_matches_torch(shape):
    gen = torch.Generator().manual_seed(0)
    dims = len(shape)
    for d1, d2 in itertools.permutations(range(dims), 2):
        for offset in range(-6, 7):
            x = torch.randn(shape, generator=gen, dtype=torch.float64)
            src = torch.randn(x.diagonal(offset, d1, d2).shape, generator=gen, dtype=torch.float64)
            expected = torch.diagonal_scatter(x, src, offset, d1, d2)
            for a, b in ((d1, d2), (d1 - dims, d2), (d1, d2 - dims)):
                got = diagonal_scatter_by_mask(x, src, offset, a, b)
                assert torch.equal(got, expected), (shape, a, b, offset)


def test_diagonal_scatter_carries_the_gradient_to_both_inputs():
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    src = torch.randn(4, dtype=torch.float64, requires_grad=True)  # min(4, 6 - 2)
    weights = torch.randn(4, 6, dtype=torch.float64)
    got = torch.autograd.grad((diagonal_scatter_by_mask(x, src, 2) * weights).sum(), (x, src))
    expected = torch.autograd.grad((torch.diagonal_scatter(x, src, 2) * weights).sum(), (x, src))
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)


@pytest.mark.parametrize(
    ("shape", "wrap"),
    [((4, 4), False), ((3, 5), False), ((7, 3), False), ((7, 3), True), ((11, 3), True),
     ((4, 3), True), ((3, 3, 3), False), ((2, 2, 2, 2), True)],
    ids=str,
)
@pytest.mark.parametrize("value", [0.0, float("-inf"), 2])
def test_fill_diagonal_matches_torch(shape, wrap, value):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    expected = x.clone().fill_diagonal_(value, wrap=wrap)
    target = x.clone()
    got = fill_diagonal_(target, value, wrap=wrap)
    assert got is target  # in place, as torch's
    assert torch.equal(got, expected)


def test_fill_diagonal_refuses_what_torch_refuses():
    with pytest.raises(RuntimeError, match="dimensions must larger than 1"):
        fill_diagonal_(torch.zeros(3), 1.0)
    with pytest.raises(RuntimeError, match="equal length"):
        fill_diagonal_(torch.zeros(2, 2, 3), 1.0)
