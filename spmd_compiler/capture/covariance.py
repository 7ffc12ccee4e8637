"""``torch.cov`` and ``torch.corrcoef`` as plain ops at capture.

NOTE: [covariance at capture]
ATen's ``cov`` checks its degrees of freedom with a value read (``norm_factor <= 0``, a
tensor made from the observation count), so a step with ``torch.cov(z.T)`` or
``torch.corrcoef`` over the batch (a decorrelation or whitening penalty, CORAL's
feature covariances) was refused as reading a tensor's value. Unweighted, that count is
the input's shape: while the step is traced, a ``TorchFunctionMode`` answers both with
ATen's own formula in plain ops, the degrees of freedom a Python number:

    in = x viewed as (variables, observations)
    c = mm(in - in.sum(1) / n, (in - in.sum(1) / n).t().conj()) / (n - correction)
    corrcoef: c / sqrt(diag(c)) on rows, then on columns, clipped to [-1, 1]

``n - correction <= 0`` warns as torch does and divides by zero as torch does. The
observations are the batch in the usual ``cov(z.T)``: the sums and the matrix product
reduce over it, so on N ranks they are the global batch's. With ``fweights`` or
``aweights`` the count depends on the weights' values (and torch checks their signs):
those calls go to torch, which refuses them at capture with the user's line.
"""

from __future__ import annotations

import warnings

import torch


def _as_variables_by_observations(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.dim() > 2:
        raise RuntimeError(f"{name}(): expected input to have two or fewer dimensions but got an input with {x.dim()} dimensions")
    if x.dtype == torch.bool:
        raise RuntimeError(f"{name}(): bool dtype is not supported for input")
    return x.view(1, -1) if x.dim() < 2 else x


def _cov(x: torch.Tensor, correction: int, name: str) -> torch.Tensor:
    data = _as_variables_by_observations(x, name)
    observations = data.size(1)
    norm_factor = observations - correction
    if norm_factor <= 0:
        warnings.warn(
            "cov(): degrees of freedom is <= 0. Correction should be strictly less than the "
            "number of observations.",
            stacklevel=3,
        )
        norm_factor = 0
    centered = data - (data.sum(1) / observations).unsqueeze(1)
    return torch.true_divide(torch.mm(centered, centered.t().conj()), norm_factor).squeeze()


def cov(input: torch.Tensor, *, correction: int = 1, fweights: torch.Tensor | None = None,
        aweights: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.cov`` (NOTE: [covariance at capture])."""
    if fweights is not None or aweights is not None:
        return torch.cov(input, correction=correction, fweights=fweights, aweights=aweights)
    return _cov(input, correction, "cov")


def corrcoef(input: torch.Tensor) -> torch.Tensor:
    """``torch.corrcoef`` (NOTE: [covariance at capture])."""
    c = _cov(input, 1, "corrcoef")
    if c.dim() == 0:
        return c / c  # nan for a covariance of nan, inf or 0, as torch
    # indexed, not ``c.diagonal()``: torch 2.11 decomposes the diagonal's backward into
    # an in-place copy (``prims.copy_to``) that functionalization refuses
    rows = torch.arange(c.shape[0], device=c.device)
    diagonal = c[rows, rows]
    stddev = torch.sqrt(diagonal.real if diagonal.is_complex() else diagonal)
    c = c / stddev.view(-1, 1)
    c = c / stddev.view(1, -1)
    if c.is_complex():
        return torch.complex(c.real.clip(-1, 1), c.imag.clip(-1, 1))
    return c.clip(-1, 1)


__all__ = ["corrcoef", "cov"]
