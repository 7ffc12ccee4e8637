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
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode


def _is_int_scalar_tensor(value: Any) -> bool:
    return (isinstance(value, torch.Tensor) and value.dim() == 0
            and not value.dtype.is_floating_point and not value.dtype.is_complex
            and value.dtype not in (torch.bool, torch.uint8))


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
    entries = list(index) if isinstance(index, tuple) else [index]
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


class TensorIndicesTaken(TorchFunctionMode):
    """While the step is traced: ``Tensor.__getitem__`` with 0-d integer tensors in its
    index is computed by the program (NOTE: [0-d tensor indices at capture])."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.__getitem__ and len(args) == 2 and not kwargs:
            selected = selected_by_tensors(args[0], args[1])
            if selected is not None:
                return selected
        return func(*args, **kwargs)


__all__ = ["TensorIndicesTaken", "selected_by_tensors"]
