"""Variance and standard deviation of rows selected by a mask, kept in place.

NOTE: [spreads of selected rows]
Pitch or energy normalised by the statistics of the valid frames, ``(p - p[mask].mean())
/ p[mask].std()`` (a TTS variance adaptor), reaches ``std`` with the rows of ``p[mask]``
kept in place beside the mask (NOTE: [selected rows kept in place] in
``selected_rows.py``). ``mean`` was answered from the masked sum and the true count;
``var`` / ``std`` / ``var_mean`` / ``std_mean`` were not, so they settled, compiled for the
mask that selects everything, and the first padded batch was refused at run time (2
simulated ranks, before the sixty-sixth session). Over the rows' dim they are answered
here for any mask, as eager computes them, in its two passes:

    n        = true rows * the size of the other dims reduced
    mean     = sum(where(valid, x, 0), dims, keepdim=True) / n
    var      = sum(where(valid, x - mean, 0) ** 2, dims, keepdim) / max(n - correction, 0)
    std      = sqrt(var), its gradient 0 where std is 0 (eager's ``std_backward``)

``n - correction <= 0`` gives what eager's division by zero gives, spelled out (nan for
a sum of squares of 0 or nan, inf otherwise: on N ranks the sum of squares is a sum over
ranks, and dividing each rank's part by 0 made a rank with no row add its 0 / 0, nan, to
the others' inf); eager also warns, which a compiled step cannot do per call, and its
gradient there is inf / nan where this one's is 0 (the loss is already nan or inf). eager's
``var(dim=[])`` reduces every dim but its backward divides by ``1 - correction`` (inf):
that form settles (eager's own op, on a full mask). The gradient
is autograd's of these ops: eager's ``2 (x - mean) / (n - correction)`` up to the
rounding of the sum of the deviations. Reductions along other dims keep the rows as
before; complex and integer rows settle (eager's own op, and its errors).

The other reductions of ``_REDUCTIONS`` that keep no exact answer here (a median, whose
index among ties differs; ``argmax``, whose index is into the selection; ``max(dim)``'s
indices; ``aminmax``; ``norm``) still settle: compiled for the mask that selects
everything, checked every call. Their refusal names the op, the line and a form that
compiles for any mask (``REDUCTION_FORMS``), and the run-time error says the step itself
raises nothing there (NOTE: [checks of this package decided on the spot]).
"""

from __future__ import annotations

import math
from typing import Any

import torch

SPREADS = frozenset({"var", "std", "var_mean", "std_mean"})
_SPREAD_KEYWORDS = frozenset({"dim", "unbiased", "keepdim", "correction"})

# the working form of a reduction of a selection that settles, for its refusal
_NAN_MEDIAN = ("`torch.where(mask, x, float('nan')).nanmedian()` (with `dim=`: along the "
               "mask's dims)")
REDUCTION_FORMS = {
    "median": _NAN_MEDIAN + ", the same value where the selected values hold no NaN",
    "nanmedian": _NAN_MEDIAN,
    "argmax": ("`torch.where(mask, x, float('-inf')).argmax()` (an index into the whole "
               "tensor, not into the selection)"),
    "argmin": ("`torch.where(mask, x, float('inf')).argmin()` (an index into the whole "
               "tensor, not into the selection)"),
    "max": "`x[mask].amax(dim)` for the values (their indices are into the selection)",
    "min": "`x[mask].amin(dim)` for the values (their indices are into the selection)",
    "aminmax": "`x[mask].amin()` and `x[mask].amax()`",
    "norm": "`torch.where(mask, x, 0).norm(p)` (p > 0)",
}


def spread_arguments(args: tuple, kwargs: dict) -> tuple[Any, float, bool] | None:
    """``(dim, correction, keepdim)`` of a call of ``var`` / ``std`` / ``var_mean`` /
    ``std_mean`` (``args[0]`` the input), read as eager reads its overloads:
    ``(unbiased)``, ``(dim, unbiased, keepdim)``, ``(dim, *, correction, keepdim)``. None
    for anything else, which eager's own op answers (with its errors)."""
    rest = args[1:]
    if set(kwargs) - _SPREAD_KEYWORDS:
        return None
    if rest and isinstance(rest[0], bool):  # var(unbiased)
        if len(rest) > 1 or kwargs:
            return None
        return None, 1.0 if rest[0] else 0.0, False
    if len(rest) > 3 or any(k in kwargs for k in ("dim", "unbiased", "keepdim")[:len(rest)]):
        return None
    named = dict(zip(("dim", "unbiased", "keepdim"), rest, strict=False)) | kwargs
    unbiased, correction = named.get("unbiased"), named.get("correction")
    keepdim = named.get("keepdim", False)
    if (unbiased is not None and correction is not None) or not isinstance(keepdim, bool):
        return None
    if unbiased is not None and not isinstance(unbiased, bool):
        return None
    if correction is None:
        correction = 0 if unbiased is False else 1
    if isinstance(correction, bool) or not isinstance(correction, (int, float)):
        return None
    return named.get("dim"), float(correction), keepdim


def spread(name: str, x: torch.Tensor, valid: torch.Tensor, dims: tuple[int, ...],
           correction: float, keepdim: bool) -> Any:
    """``name`` (one of ``SPREADS``) of the rows of ``x`` where ``valid`` (shaped to
    broadcast over ``x``, false on the dropped rows) over ``dims`` (holding 0, the rows'
    dim), as eager computes it on the selected rows alone (NOTE: [spreads of selected
    rows])."""
    dtype = x.dtype
    if x.element_size() < 4:  # half and bfloat16 accumulate in float32, as eager's kernels
        x = x.float()
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    n = (valid.sum() * math.prod(x.shape[d] for d in dims if d != 0)).to(x.dtype)
    mean = torch.where(valid, x, zero).sum(dims, keepdim=True) / n
    deviation = torch.where(valid, x - mean, zero)
    squares = (deviation * deviation).sum(dims, keepdim=keepdim)
    divisor = n - correction
    # no degrees of freedom: eager's squares / 0, spelled out: on N ranks ``squares`` is a
    # sum over ranks, and a rank with none of the rows would add its own 0 / 0 (nan) to inf
    nothing_left = torch.where(squares > 0, math.inf, math.nan).to(x.dtype)
    var = torch.where(divisor > 0, squares / torch.where(divisor > 0, divisor, 1.0), nothing_left)
    value = var
    if name.startswith("std"):
        # eager's std_backward masks the gradient where std is 0; sqrt's alone is inf there
        nothing = var == 0
        value = torch.where(nothing, zero, torch.where(nothing, torch.ones_like(var), var).sqrt())
    value = value.to(dtype)
    if name.endswith("_mean"):
        return value, (mean if keepdim else mean.squeeze(dims)).to(dtype)
    return value


__all__ = ["REDUCTION_FORMS", "SPREADS", "spread", "spread_arguments"]
