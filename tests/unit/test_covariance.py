"""``torch.cov`` / ``torch.corrcoef`` in plain ops (NOTE: [covariance at capture]) against
torch's own, values and gradients, for the input shapes and corrections they take."""

from __future__ import annotations

import warnings

import pytest
import torch

from spmd_compiler.capture.covariance import corrcoef, cov


def _input(shape: tuple[int, ...], dtype: torch.dtype = torch.float64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).requires_grad_(dtype.is_floating_point)


@pytest.mark.parametrize("shape", [(3, 7), (1, 5), (6,), (4, 1)])
@pytest.mark.parametrize("correction", [0, 1, 2])
def test_cov_matches_torch(shape, correction):
    x = _input(shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (4, 1) with correction >= 1: torch warns too
        got, expected = cov(x, correction=correction), torch.cov(x, correction=correction)
    torch.testing.assert_close(got, expected, rtol=1e-14, atol=1e-14, equal_nan=True)
    if expected.isfinite().all():
        (g,) = torch.autograd.grad(got.sum(), x)
        (e,) = torch.autograd.grad(expected.sum(), x)
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-14)


def test_cov_of_integers_and_complex_matches_torch():
    ints = torch.randint(-5, 5, (3, 6), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(cov(ints), torch.cov(ints))
    z = torch.randn(3, 6, dtype=torch.complex128, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(cov(z), torch.cov(z), rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(corrcoef(z), torch.corrcoef(z), rtol=1e-14, atol=1e-14)


def test_too_few_observations_warn_as_torch_does():
    x = _input((2, 1))
    with pytest.warns(UserWarning, match="degrees of freedom is <= 0"):
        got = cov(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(got, torch.cov(x), equal_nan=True)


@pytest.mark.parametrize("shape", [(3, 7), (5,), (2, 9)])
def test_corrcoef_matches_torch(shape):
    x = _input(shape)
    got, expected = corrcoef(x), torch.corrcoef(x)
    torch.testing.assert_close(got, expected, rtol=1e-14, atol=1e-14, equal_nan=True)
    (g,) = torch.autograd.grad(got.sum(), x)
    (e,) = torch.autograd.grad(expected.sum(), x)
    torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-13)


def test_weighted_cov_goes_to_torch():
    x = _input((3, 5))
    w = torch.tensor([1, 2, 1, 3, 1])
    torch.testing.assert_close(cov(x, fweights=w), torch.cov(x, fweights=w))
