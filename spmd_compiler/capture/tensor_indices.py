"""Indexing by a 0-d integer tensor the step computed: a select the program computes.

NOTE: [0-d tensor indices at capture]
``h[:, j]`` with ``j`` a 0-d integer tensor (``j = scores.argmax()``, a top-k delay, a
token position read from the batch) selects one entry, as ``h[:, int(j)]`` would: torch
reads ``j``'s value on the host (``item``) and removes the dimension. A trace has no
value to read, so the capture failed as a value read. While the step is traced, such an
index is taken by the program instead: for each 0-d integer tensor of the index, at the
dimension it stands for, ``index_select(d, where(j < 0, j + size, j).reshape(1))`` then
``squeeze(d)`` (last dimension first, so earlier positions hold), and the rest of the
index is applied as it was. That is torch's order too (its selects run first, then any
advanced index on the dimensions left), so ``x[j, :, rows]`` and ``x[rows, j]`` keep
eager's result shapes, and ``index_select``'s backward adds the gradient into the one
row as ``select``'s does. An index out of range fails in the program's kernel at run
time, as eager raises ``IndexError``. A 0-d *bool* tensor (``x[flag]``) and a tensor
used as a slice bound (``x[:n]``, a size) still read the value, and are refused as
before.

The write ``x[j] = v`` (a ring buffer's ``mem.x[mem.ptr] = row``, a reservoir sample's
``mem.x[pos] = where(keep, row, mem.x[pos])``) read ``j``'s value the same way, and was
refused until 2026-12-08. Torch runs it as ``copy_to(x.select(d, int(j)), v)`` (or an
``index_put_`` on that select for an advanced index in the rest): the rest of the index
is set within the selected slice, ``v`` broadcast to it after its leading size-1
dimensions are stripped, a Python number filled, a value of another dtype cast. It is
taken as: ``rows = x.index_select(d, j1).squeeze(d)`` for the first 0-d integer tensor
``j`` (``j1`` normalized as above), ``rows[rest] = v`` with the rest of the index (the
entry for ``j`` removed: the entries before it index the same dimensions of ``rows``,
those after it the next ones; further 0-d tensors in the rest taken the same way), then
``x.index_copy_(d, j1, rows.unsqueeze(d))``. The set on ``rows`` is torch's own, so the
value's broadcasting and cast are eager's; ``index_copy_``'s backward zeroes the row in
``x``'s gradient and passes it to ``rows``, whose set zeroes what ``v`` replaced, so the
untouched part of the row keeps its gradient and ``v`` gets the rest, as in eager. A
leaf that requires grad is refused by ``index_copy_`` as eager refuses the write, and an
index out of range fails in ``index_select``'s kernel at run time. ``x[j] += v`` (a read,
an in-place add on it, a write) is the same write of the added row.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode


def _is_int_scalar_tensor(value: Any) -> bool:
    return (isinstance(value, torch.Tensor) and value.dim() == 0
            and not value.dtype.is_floating_point and not value.dtype.is_complex
            and value.dtype not in (torch.bool, torch.uint8))


def _entries(index: Any) -> list[Any]:
    return list(index) if isinstance(index, tuple) else [index]


def _dims_taken(entry: Any) -> int:
    """How many dimensions of the indexed tensor one index entry stands for."""
    if entry is None:
        return 0
    if isinstance(entry, torch.Tensor) and entry.dtype in (torch.bool, torch.uint8):
        return entry.dim()  # a mask: one per mask dimension (a 0-d one: none)
    return 1


def selected_by_tensors(x: torch.Tensor, index: Any) -> torch.Tensor | None:
    """``x[index]`` with its 0-d integer tensors taken by ``index_select`` (the NOTE);
    None when ``index`` holds none."""
    entries = _entries(index)
    if not any(_is_int_scalar_tensor(e) for e in entries):
        return None
    explicit = sum(_dims_taken(e) for e in entries if e is not Ellipsis)
    dim, selects, rest = 0, [], []
    for entry in entries:
        if entry is Ellipsis:
            dim += x.dim() - explicit
            rest.append(entry)
        elif _is_int_scalar_tensor(entry):
            selects.append((dim, entry))
            dim += 1
        else:
            dim += _dims_taken(entry)
            rest.append(entry)
    out = x
    for d, position in reversed(selects):
        size = out.shape[d]
        position = torch.where(position < 0, position + size, position)
        out = out.index_select(d, position.reshape(1)).squeeze(d)
    return out[tuple(rest)] if rest else out


def _first_tensor_position(x: torch.Tensor, entries: list[Any]) -> tuple[int, int] | None:
    """(entry number, dimension of ``x``) of the first 0-d integer tensor of the index."""
    explicit = sum(_dims_taken(e) for e in entries if e is not Ellipsis)
    dim = 0
    for number, entry in enumerate(entries):
        if _is_int_scalar_tensor(entry):
            return number, dim
        dim += x.dim() - explicit if entry is Ellipsis else _dims_taken(entry)
    return None


def written_by_tensors(x: torch.Tensor, index: Any, value: Any) -> bool:
    """``x[index] = value`` with its 0-d integer tensors taken by ``index_select`` /
    ``index_copy_`` (the NOTE); False, and nothing written, when ``index`` holds none."""
    entries = _entries(index)
    found = _first_tensor_position(x, entries)
    if found is None:
        return False
    number, d = found
    position = entries[number]
    position = torch.where(position < 0, position + x.shape[d], position).reshape(1).long()  # index_copy_ takes long only
    rows = x.index_select(d, position).squeeze(d)
    rest = tuple(entries[:number] + entries[number + 1:])
    if not written_by_tensors(rows, rest, value):
        rows[rest if rest else ...] = value
    x.index_copy_(d, position, rows.unsqueeze(d))
    return True


class TensorIndicesTaken(TorchFunctionMode):
    """While the step is traced: ``Tensor.__getitem__`` and ``Tensor.__setitem__`` with
    0-d integer tensors in their index are computed by the program (NOTE: [0-d tensor
    indices at capture])."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.__getitem__ and len(args) == 2 and not kwargs:
            selected = selected_by_tensors(args[0], args[1])
            if selected is not None:
                return selected
        if func is torch.Tensor.__setitem__ and len(args) == 3 and not kwargs:
            if written_by_tensors(*args):
                return None
        return func(*args, **kwargs)


__all__ = ["TensorIndicesTaken", "selected_by_tensors", "written_by_tensors"]
