"""Selected rows read and written along their other dims.

NOTE: [rows along their other dims]
Rows kept in place (NOTE: [selected rows kept in place] in ``selected_rows.py``) are
``(N, *rest)`` while traced, ``N`` the mask's element count, not eager's number of true
elements. Everything a row-wise op does along ``rest`` is the same for any mask; only
what reads or mixes along the rows' own dim is not. Before the sixty-seventh session
these uses settled (compiled for the mask that selects everything), and a rational-
quadratic spline flow with linear tails (nflows' ``unconstrained_rational_quadratic_spline``:
``outputs[inside], logabsdet[inside] = spline(inputs[inside], uw[inside, :], ...)``) was
refused on its first ``num_bins = uw.shape[-1]``, then at ``F.pad`` and at
``cumwidths[..., 0] = left``:

- ``rows.shape`` / ``rows.size()`` is a ``RowShape``: its other dims read as they are
  (``shape[-1]``, ``shape[1:]``, ``len``); anything that reads the first (``shape[0]``,
  ``shape[:-1]``, unpacking, iterating, comparing, printing, a torch function given the
  shape) settles the rows first and answers with the settled shape, exactly as
  ``rows.size(0)`` did.
- ``F.pad`` / ``constant_pad_nd`` padding dims past the first; ``rows[idx] = v`` with a
  basic index keeping the rows' dim whole (``r[..., 0] = c``, ``r[:, 1:] = s``) and ``v``
  a number, rows of the same selection indexed the same way, or a tensor broadcast over
  the rows (no extent of its own along them); ``scatter`` / ``scatter_add`` /
  ``scatter_reduce`` along another dim by rows of the same selection; ``take_along_dim``
  along another dim; ``searchsorted`` of rows in rows of the same selection (or in one
  1-D sequence); ``t.expand_as(rows)`` of a ``t`` broadcast over the rows.
- Anything else, and any of these touching the rows' dim (``F.pad`` of every dim, a
  write at ``r[0]``, a scatter along dim 0), settles as before.

Where a settled shape reaches Python code through C (``"%s" % rows.shape`` formats the
tuple's items directly) the traced count shows; no torch op or Python int reaches it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .selected_rows import _Answer


class RowShape(tuple):
    """``rows.shape`` of rows kept in place (NOTE: [rows along their other dims]):
    ``settled()`` is the eager shape, after the rows settle."""

    rows: torch.Tensor  # the tensor whose shape this is
    _settled: Callable[[], torch.Size]

    def __new__(cls, shape: torch.Size, rows: torch.Tensor, settled: Callable[[], torch.Size]) -> RowShape:
        made = super().__new__(cls, shape)
        made.rows = rows
        made._settled = settled
        return made

    def settled(self) -> torch.Size:
        return self._settled()

    def __getitem__(self, index: Any) -> Any:
        size = tuple.__len__(self)
        if isinstance(index, int) and not isinstance(index, bool) and -size <= index < size and index % size:
            return tuple.__getitem__(self, index)
        if isinstance(index, slice) and 0 not in range(size)[index]:
            return torch.Size(tuple.__getitem__(self, index))
        return self.settled()[index]


def _via_settled(method: str) -> Callable[..., Any]:
    def call(self: RowShape, *args: Any) -> Any:
        return getattr(self.settled(), method)(*args)

    call.__name__ = method
    return call


for _method in ("__iter__", "__reversed__", "__contains__", "__eq__", "__ne__", "__lt__", "__le__",
                "__gt__", "__ge__", "__hash__", "__add__", "__mul__", "__rmul__", "__repr__",
                "__str__", "__format__", "__reduce__", "__reduce_ex__", "__copy__", "__deepcopy__",
                "count", "index", "numel", "__getnewargs__"):
    setattr(RowShape, _method, _via_settled(_method))
RowShape.__radd__ = lambda self, other: other + self.settled()  # type: ignore[attr-defined]


def settled_shapes(values: Any, leaves: list[Any]) -> Any:
    """``values`` with each ``RowShape`` among ``leaves`` (their pytree leaves) settled:
    a torch function given the shape reads its first dim."""
    from .._torch_private import pytree

    if not any(isinstance(v, RowShape) for v in leaves):
        return values
    return pytree.tree_map(lambda v: v.settled() if isinstance(v, RowShape) else v, values)


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
        dim = _arg(args, kwargs, 1, "dim")
        index = _arg(args, kwargs, 2, "index")
        src = _arg(args, kwargs, 3, "src", kwargs.get("value"))
        ok = (isinstance(dim, int) and dim % args[0].dim() != 0 and isinstance(index, torch.Tensor)
              and one.rows_of(index) is rows
              and (isinstance(src, (int, float, bool)) or (isinstance(src, torch.Tensor) and one.rows_of(src) is rows)))
        return one.keep(one.run()) if ok else None
    if name == "take_along_dim" and self_ragged:
        dim, index = _arg(args, kwargs, 2, "dim"), _arg(args, kwargs, 1, "indices")
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


def _arg(args: tuple, kwargs: dict, position: int, name: str, default: Any = None) -> Any:
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
    sequence = _arg(args, kwargs, 0, "sorted_sequence")
    values = _arg(args, kwargs, 1, "input", kwargs.get("self"))
    sorter = kwargs.get("sorter")
    if not (isinstance(sequence, torch.Tensor) and isinstance(values, torch.Tensor)) or one.rows_of(values) is not one.rows:
        return None
    if one.rows_of(sequence) is one.rows:
        ok = sequence.dim() == values.dim() and (sorter is None or one.rows_of(sorter) is one.rows)
    else:
        ok = sequence.dim() == 1 and sorter is None
    return one.keep(one.run()) if ok else None


__all__ = ["WRITTEN", "RowShape", "answer", "settled_shapes"]
