"""Counts of a fixed length: ``bincount`` by ``minlength``, and the counting ops given rows
selected by a mask, kept in place.

NOTE: [counts of a fixed length]
``torch.bincount(labels, minlength=n)`` (class weights from the labels of a batch) has
``max(n, labels.max() + 1)`` bins: a size the values decide, refused at capture before
the sixty-seventh session ("makes a tensor of value-dependent shape"). With ``n > 0`` it
is ``n`` bins for every call whose values are all below ``n``: it compiles as that
count, ``zeros(n).index_add_(0, labels, ones or weights)`` (an index clamped into range,
so that the program's own write never goes out of bounds), and ``0 <= labels < n`` stays
in the program as a value check (NOTE: [value checks]): a call with a larger value (eager
would return more bins) or a negative one (eager raises) raises ``SPMDRuntimeError``
naming the line before any state is written. The dtype is eager's: int64 counts, the
weights' own dtype for float32 / float64 weights, float64 for any other. Without
``minlength`` (or 0) the size is the values' alone and stays refused, with the hint by
op (``_VALUE_SHAPE_HINTS`` in ``trace.py``); so are inputs that are not 1-D integers and
weights of another length (eager's own errors are met by eager's op).

NOTE: [counts of selected rows]
Segmentation metrics and class weights count the labelled pixels: ``torch.histc(pred[valid],
bins=C, min=0, max=C - 1)`` (mmseg's intersect-and-union), a confusion matrix
``cm.index_put_((y[valid], pred[valid]), torch.ones(()), accumulate=True)``,
``torch.bincount(y[valid], minlength=C)``. The rows of ``x[valid]`` are kept in place
beside the mask (NOTE: [selected rows kept in place] in ``selected_rows.py``); these ops
settled them, compiled for the mask that selects everything, so the first batch with an
ignored pixel raised ``MaskWithFalseElements`` (a run whose first batches had none
compiled and failed mid-training). Each is a sum over the rows into fixed bins, so the
dropped rows are kept and made to add nothing, exactly:

- ``histc(rows, bins, min, max)`` with Python numbers ``min < max``: the dropped rows are
  ``-inf``, outside ``[min, max]``, which ``histc`` skips as it skips any value outside
  (a value equal to ``max`` counts in the last bin, NaN is skipped: the kept rows meet
  eager's own kernel). ``min == max`` (the data's own range) and integer rows (eager
  raises) settle as before.
- ``index_put(_)(target, (i, j, ...), values, accumulate=True)`` with every index rows of
  the mask (1-D integers), ``index_add(_)(0, i, source)`` and ``scatter_add(_)(0, i,
  src)`` with ``i`` rows of the mask, into a target that is not: each dropped row indexes
  0 (``where(valid, i, 0)``) and adds an exact zero (``where(valid, v, 0)``); a value
  broadcast over the rows (``torch.ones(())``) is spread over them first, so that it too
  is zero on the dropped rows. The values are rows of the same mask or have no size of
  their own along the rows. A dim other than 0 puts row ``k`` of the selection at
  position ``k`` of the target, an index eager counts among the kept rows only: it settles.
- ``bincount(rows, weights, minlength=n)`` (``n > 0``): the fixed-length count above of
  ``where(valid, i, 0)`` weighted by the mask (or by ``where(valid, w, 0)``); the value check
  is on the kept rows alone.

``+ 0`` turns a ``-0.0`` already in the target into ``0.0``, as a kept row adding 0
would. A non-accumulating write by selected indices (``cm[y[valid], p[valid]] = v``)
would write the dropped rows at index 0: it settles, and its refusal gives the form
above; so does ``sort`` along the rows (Berman's Lovasz-softmax sorts ``probs[valid]``'s
errors), whose exact fixed-shape form is zero errors for the dropped pixels (sorted
last, their weights multiplied by 0) and a label no class has.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .mask_selections import INDEX_FORM
from .value_checks import eager_check

Compute = Callable[[Any, tuple, dict], Any]
Along = Callable[[Any], "torch.Tensor | None"]

_INTEGERS = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)

# the forms exact for any mask, for the refusal of an op that settled rows
# (MaskWithFalseElements' hint; NOTE: [counts of selected rows])
FORMS = {
    **dict.fromkeys(("__setitem__", "index_put", "index_put_", "index_add", "index_add_", "scatter_add",
                     "scatter_add_"), INDEX_FORM),
    "histc": ("`torch.histc(torch.where(mask, x, float('-inf')), bins, min, max)` with "
              "numbers min < max (values outside [min, max] are not counted)"),
    "bincount": ("`torch.bincount(torch.where(mask, y, 0), weights=mask.to(torch.float64), "
                 "minlength=n)` (n bins: a call with a value >= n raises)"),
    "sort": ("fixed shapes: zero errors for the dropped elements, sorted last, and a label "
             "no class has (Lovasz-softmax: `probs * mask[:, None]` and `torch.where(mask, "
             "labels, C)`)"),
}
FORMS["argsort"] = FORMS["sort"]


def count_dtype(weights: torch.Tensor | None) -> torch.dtype:
    """eager's bincount dtype: int64 counts, float32 / float64 weights' own, else float64."""
    if weights is None:
        return torch.int64
    return weights.dtype if weights.dtype in (torch.float32, torch.float64) else torch.float64


def fixed_count(x: torch.Tensor, weights: torch.Tensor | None, minlength: int,
                dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.bincount(x, weights, minlength)`` for values in ``[0, minlength)``, those
    bounds verified every call (NOTE: [counts of a fixed length]); ``dtype``: the
    result's, eager's by default."""
    eager_check(x >= 0, "bincount only supports 1-d non-negative integral inputs.")
    eager_check(x < minlength, f"bincount: a value >= minlength={minlength}, which gives eager more "
                f"than {minlength} bins; the compiled step counts into minlength bins (NOTE: [counts "
                "of a fixed length]): pass a minlength above every value")
    dtype = dtype or count_dtype(weights)
    added = torch.ones_like(x, dtype=dtype) if weights is None else weights.to(dtype)
    index = x.long().clamp(0, minlength - 1)
    return torch.zeros(minlength, dtype=dtype, device=x.device).index_add(0, index, added)


def _bincount_arguments(args: tuple, kwargs: dict) -> tuple[Any, Any, Any] | None:
    if set(kwargs) - {"input", "weights", "minlength"} or len(args) > 3:
        return None
    bound = dict(zip(("input", "weights", "minlength"), args, strict=False))
    if set(bound) & set(kwargs):
        return None
    bound |= kwargs
    return bound.get("input"), bound.get("weights"), bound.get("minlength", 0)


def _counted_here(x: Any, weights: Any, minlength: Any) -> bool:
    if not isinstance(minlength, int) or isinstance(minlength, bool) or minlength <= 0:
        return False
    if not isinstance(x, torch.Tensor) or x.dim() != 1 or x.dtype not in _INTEGERS:
        return False
    # weights that carry a gradient: eager's bincount has no derivative and raises; the
    # index_add form would train (a review: parameters 0.47 off where eager raised)
    return weights is None or (
        isinstance(weights, torch.Tensor) and weights.shape == x.shape and not weights.requires_grad
    )


def bincount(*args: Any, **kwargs: Any) -> Any:
    """``torch.bincount`` with a ``minlength`` as the fixed-length count of the NOTE,
    anything else as torch's own."""
    bound = _bincount_arguments(args, kwargs)
    if bound is None or not _counted_here(*bound):
        return torch.bincount(*args, **kwargs)
    return fixed_count(*bound)


def answer(name: str, args: tuple, kwargs: dict, along: Along, compute: Compute, func: Any) -> Any:
    """``func`` (named ``name``) with rows of one selection among its arguments, answered
    exactly for any mask (NOTE: [counts of selected rows]); None: it settles. ``along(t)``
    is the rows' validity shaped to broadcast over ``t`` where ``t`` holds the rows, else None."""
    if name == "histc":
        return _histc(args, kwargs, along, compute, func)
    if name == "bincount":
        bound = _bincount_arguments(args, kwargs)
        if bound is None or not _counted_here(*bound) or along(bound[0]) is None:
            return None
        x, weights, minlength = bound
        valid = along(x)
        assert valid is not None
        if weights is not None and along(weights) is None:
            return None
        added = valid if weights is None else _zero_where_dropped(valid, weights)
        return fixed_count(torch.where(valid, x, 0), added, minlength, count_dtype(weights))
    if name in ("index_put", "index_put_"):
        return _index_put(args, kwargs, along, compute, func)
    if name in ("index_add", "index_add_", "scatter_add", "scatter_add_"):
        return _add_along_rows(name, args, kwargs, along, compute, func)
    return None


def _histc(args: tuple, kwargs: dict, along: Along, compute: Compute, func: Any) -> Any:
    if set(kwargs) - {"bins", "min", "max"} or len(args) > 4 or not args:
        return None
    bound = dict(zip(("input", "bins", "min", "max"), args, strict=False))
    if set(bound) & set(kwargs):
        return None
    bound |= kwargs
    x, lo, hi = bound["input"], bound.get("min", 0), bound.get("max", 0)
    valid = along(x) if isinstance(x, torch.Tensor) else None
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (lo, hi))
    if valid is None or not x.dtype.is_floating_point or not numbers or not lo < hi:
        return None  # the data's own range, integers (eager raises): settles
    outside = torch.where(valid, x, torch.full((), -torch.inf, dtype=x.dtype, device=x.device))
    return compute(func, (outside,), {"bins": bound.get("bins", 100), "min": lo, "max": hi})


def _zero_where_dropped(valid: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.where(valid, v, torch.zeros((), dtype=v.dtype, device=v.device))


def _index_put(args: tuple, kwargs: dict, along: Along, compute: Compute, func: Any) -> Any:
    if len(args) < 3 or set(kwargs) - {"accumulate"}:
        return None
    target, indices, values = args[:3]
    accumulate = kwargs.get("accumulate", args[3] if len(args) > 3 else False)
    if accumulate is not True or not isinstance(indices, (tuple, list)) or not indices:
        return None  # a plain write would put the dropped rows at index 0: settles
    if not isinstance(target, torch.Tensor) or along(target) is not None or not isinstance(values, torch.Tensor):
        return None
    if any(not isinstance(i, torch.Tensor) or along(i) is None or i.dim() != 1 or i.dtype not in _INTEGERS
           for i in indices) or len(indices) > target.dim() or values.dtype != target.dtype:
        return None
    rows = indices[0].shape[0]
    shape = (rows, *target.shape[len(indices):])
    valid = along(indices[0])
    assert valid is not None
    value_valid = along(values)
    if value_valid is None and values.dim() == len(shape) and values.shape[0] != 1:
        return None  # a size of its own along the rows
    try:
        spread = values.expand(shape) if values.dim() <= len(shape) else None
    except RuntimeError:
        return None  # eager's own op raises
    if spread is None:
        return None
    kept = _zero_where_dropped(valid.reshape((-1,) + (1,) * (len(shape) - 1)), spread)
    at = tuple(_zero_where_dropped(valid, i) for i in indices)
    return compute(func, (target, at, kept, True), {})


def _shapes_fit(target: torch.Tensor, index: torch.Tensor, source: torch.Tensor, by_index: bool) -> bool:
    """The shapes eager's ``index_add`` (``by_index``) / ``scatter_add`` along dim 0 takes
    (a lax meta kernel would let a mismatch through to the backward)."""
    if by_index:
        return index.dim() == 1 and source.dim() == target.dim() and source.shape[1:] == target.shape[1:]
    return (index.dim() == source.dim() == target.dim()
            and all(i <= min(s, t) for i, s, t in zip(index.shape[1:], source.shape[1:], target.shape[1:], strict=True)))


def _add_along_rows(name: str, args: tuple, kwargs: dict, along: Along, compute: Compute, func: Any) -> Any:
    if len(args) != 4 or set(kwargs) - {"alpha"}:
        return None
    target, dim, index, source = args
    if not (isinstance(target, torch.Tensor) and isinstance(index, torch.Tensor)
            and isinstance(source, torch.Tensor) and isinstance(dim, int) and target.dim() > 0):
        return None
    if along(target) is not None or dim % target.dim() != 0 or index.dtype not in _INTEGERS:
        return None
    index_valid, source_valid = along(index), along(source)
    if index_valid is None or source_valid is None or not _shapes_fit(target, index, source, name.startswith("index_add")):
        return None  # torch's own op (eager raises where these do not fit)
    zero = torch.zeros((), dtype=index.dtype, device=index.device)
    return compute(func, (target, dim, torch.where(index_valid, index, zero),
                          _zero_where_dropped(source_valid, source)), kwargs)


__all__ = ["FORMS", "answer", "bincount", "count_dtype", "fixed_count"]
