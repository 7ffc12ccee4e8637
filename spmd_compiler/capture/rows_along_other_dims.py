"""Selected rows read and written along their other dims.

NOTE: [rows along their other dims]
Rows kept in place (NOTE: [selected rows kept in place] in ``selected_rows.py``) are
``(N, *rest)`` while traced, ``N`` the mask's element count, not eager's number of true
elements. Everything a row-wise op does along ``rest`` is the same for any mask; only
what reads or mixes along the rows' own dim is not. Before the sixty-seventh session
these uses settled (compiled for the mask that selects everything), and a rational-
quadratic spline flow with linear tails (nflows' ``unconstrained_rational_quadratic_spline``:
``outputs[inside], logabsdet[inside] = spline(inputs[inside], uw[inside, :], ...)``) was
refused (with ``num_bins = uw.size(-1)``) at ``F.pad`` and at
``cumwidths[..., 0] = left``:

- ``rows.size(d)`` of a dim past the first reads as it is (as before this session);
  ``rows.shape`` and ``rows.size()`` settle the rows (the whole shape holds the
  rows' number). A stand-in tuple for the shape was tried and removed: it is no
  ``torch.Size`` (which cannot be subclassed), so ``isinstance(r.shape, torch.Size)``
  and ``torch.Size(...) == r.shape`` (tuple's own comparison of the raw items) took
  other branches than eager's, silently (a review). Write ``rows.size(-1)``.
- ``F.pad`` / ``constant_pad_nd`` padding dims past the first; ``rows[idx] = v`` with a
  basic index keeping the rows' dim whole (``r[..., 0] = c``, ``r[:, 1:] = s``) and ``v``
  a number, rows of the same selection indexed the same way, or a tensor broadcast over
  the rows (no extent of its own along them); ``scatter`` / ``scatter_add`` /
  ``scatter_reduce`` along another dim by rows of the same selection; ``take_along_dim``
  along another dim; ``searchsorted`` of rows in rows of the same selection, 2-D or more (or in one
  1-D sequence); ``t.expand_as(rows)`` of a ``t`` broadcast over the rows.
- Anything else, and any of these touching the rows' dim (``F.pad`` of every dim, a
  write at ``r[0]``, a scatter along dim 0), settles as before.

"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .selected_rows import _Answer


_SCATTERS = {"scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_"}


def answer(one: _Answer, name: str, self_ragged: bool) -> Any:
    """The rule of the NOTE for ``name``, or None when it has none."""
    args, kwargs = one.args, one.kwargs
    rows = one.rows
    if name in ("pad", "constant_pad_nd") and self_ragged and len(one.ragged) == 1:
        pad = args[1] if len(args) > 1 else kwargs.get("pad")
        ok = isinstance(pad, (list, tuple)) and len(pad) % 2 == 0 and len(pad) // 2 < args[0].dim()
        return one.keep(one.run()) if ok else None
    if name == "__setitem__" and self_ragged and len(args) == 3 and not kwargs:
        return _written_along(one) if one._keeps_rows(args[1], args[0].dim()) else None
    if name in _SCATTERS and self_ragged:
        dim = arg_of(args, kwargs, 1, "dim")
        index = arg_of(args, kwargs, 2, "index")
        src = arg_of(args, kwargs, 3, "src", kwargs.get("value"))
        ok = (isinstance(dim, int) and dim % args[0].dim() != 0 and isinstance(index, torch.Tensor)
              and one.rows_of(index) is rows
              and (isinstance(src, (int, float, bool)) or (isinstance(src, torch.Tensor) and one.rows_of(src) is rows)))
        return one.keep(one.run()) if ok else None
    if name == "take_along_dim" and self_ragged:
        dim, index = arg_of(args, kwargs, 2, "dim"), arg_of(args, kwargs, 1, "indices")
        ok = (isinstance(dim, int) and dim % args[0].dim() != 0 and isinstance(index, torch.Tensor)
              and one.rows_of(index) is rows and index.dim() == args[0].dim())
        return one.keep(one.run()) if ok else None
    if name == "searchsorted":
        return _searched(one)
    if name == "expand_as" and len(args) == 2 and not kwargs:
        t, other = args
        if one.rows_of(other) is rows and (one.rows_of(t) is rows or t.dim() < other.dim() or t.shape[0] == 1):
            return one.keep(one.run())
    return None


def arg_of(args: tuple, kwargs: dict, position: int, name: str, default: Any = None) -> Any:
    """An op's argument ``name`` at ``position``, given by keyword or position."""
    if name in kwargs:
        return kwargs[name]
    return args[position] if len(args) > position else default


def _indexed_dims(index: Any, ndim: int) -> int:
    """The dims of ``x[index]`` for a basic index that keeps the rows (``keeps_rows``)."""
    items = index if isinstance(index, tuple) else (index,)
    return ndim - sum(1 for i in items if isinstance(i, int)) + sum(1 for i in items if i is None)


def _written_along(one: _Answer) -> Any:
    """``rows[index] = value`` along the rows' other dims (see the NOTE)."""
    target, index, value = one.args
    dims = _indexed_dims(index, target.dim())
    if isinstance(value, torch.Tensor):
        if one.rows_of(value) is not None:
            ok = one.rows_of(value) is one.rows and value.dim() == dims
        else:
            ok = value.dim() < dims or (value.dim() == dims and value.shape[0] == 1)
        if not ok:
            return None
    elif not isinstance(value, (int, float, bool, complex)):
        return None
    one.run()
    return WRITTEN


WRITTEN = object()  # __setitem__ answered: its result is None


def _searched(one: _Answer) -> Any:
    """``torch.searchsorted(sequence, values)``: each row of ``values`` looked up in the
    same row of ``sequence`` (both rows of one selection, of one rank) or in one 1-D
    ``sequence``: row by row."""
    args, kwargs = one.args, one.kwargs
    sequence = arg_of(args, kwargs, 0, "sorted_sequence")
    values = arg_of(args, kwargs, 1, "input", kwargs.get("self"))
    sorter = kwargs.get("sorter")
    if not (isinstance(sequence, torch.Tensor) and isinstance(values, torch.Tensor)) or one.rows_of(values) is not one.rows:
        return None
    if one.rows_of(sequence) is one.rows:
        # 1-D rows searched in 1-D rows look up across the rows, not row by row: the
        # dropped rows would be found (a review: 12.06 for eager's 5.80)
        ok = sequence.dim() == values.dim() >= 2 and (sorter is None or one.rows_of(sorter) is one.rows)
    else:
        ok = sequence.dim() == 1 and sorter is None
    return one.keep(one.run()) if ok else None


__all__ = ["WRITTEN", "answer", "arg_of"]
