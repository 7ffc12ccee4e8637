"""Overlapping windows made by ``as_strided``, gathered by index at capture.

NOTE: [windows by as_strided]
Code frames a signal, or chunks a sequence into overlapping attention windows
(Longformer's ``_chunk``), with ``x.as_strided(size, stride)`` on ``x``'s own strides.
DTensor refuses every ``as_strided`` (a stride names memory, which a shard does not
have). While the step is traced, ``Tensor.as_strided`` / ``torch.as_strided`` is answered
here when it names only ``x``'s own elements:

- Leading dimensions with ``x``'s own size and stride (the batch, the heads) are kept.
- Every other element is found from its storage offset by ``x``'s strides (checked at
  capture for each element of the window grid: an offset ``x``'s strides cannot reach,
  the storage around a slice, is not answered) and gathered by index, with the kept
  dimensions moved last: neither the gather nor its backward (an accumulating
  ``index_put``) has a ``None`` before its indices, so a batch sharded there stays
  sharded (no all-gather under ddp).
- Autograd derives the backward from the gather, above the ATen ``as_strided`` whose
  own backward writes a whole storage (a flat buffer, which gathers the batch).

The answer is a copy where eager's is a view. So a write in place to the windows or to
the tensor they view, after the windows were made, is refused at capture with the line:
eager would see it through the view, the copy would not. Any ``as_strided`` not answered
here (a negative stride, an offset elsewhere, a reach past ``x``'s elements, more than
``MAX_WINDOW_ELEMENTS`` per leading index) is traced as it is and refused at expansion
naming the op; views of ATen's own (``_as_strided_as_view`` in ``trace.py``) are not
affected.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterator
from typing import Any

import torch

from .. import _torch_private as private
from ..errors import SPMDCompileError, innermost_model_frame_of_stack

# elements of one window grid checked at capture (per leading index)
MAX_WINDOW_ELEMENTS = 1 << 20

_COPIED: list[list[Any]] = []  # per trace: storages of windows and of what they view


def windows_by_index(x: torch.Tensor, size: list[int], stride: list[int]) -> Any:
    """``x.as_strided(size, stride)`` gathered by index (see the NOTE); ``NotImplemented``
    where it names an element ``x`` does not hold."""
    if len(stride) != len(size) or math.prod(size) == 0 or any(s < 0 for s in stride):
        return NotImplemented
    lead = 0
    while (
        lead < min(len(size), x.dim()) and size[lead] == x.shape[lead]
        and stride[lead] == x.stride()[lead]
    ):
        lead += 1
    inner_size, inner_stride = size[lead:], stride[lead:]
    strides = list(x.stride())
    dims = sorted(range(lead, x.dim()), key=lambda d: -strides[d])
    if not inner_size or math.prod(inner_size) > MAX_WINDOW_ELEMENTS:
        return NotImplemented
    for index in itertools.product(*(range(n) for n in inner_size)):
        offset = sum(i * s for i, s in zip(index, inner_stride, strict=True))
        for d in dims:  # the element of x at this offset, if any
            if strides[d] > 0:
                offset -= min(offset // strides[d], x.shape[d] - 1) * strides[d]
        if offset != 0:
            return NotImplemented
    offsets = torch.zeros((), dtype=torch.long, device=x.device)
    for n, s in zip(inner_size, inner_stride, strict=True):
        offsets = offsets.unsqueeze(-1) + torch.arange(n, device=x.device) * s
    indices: list[torch.Tensor] = []
    for d in range(lead, x.dim()):
        rest = offsets
        for e in dims:
            if e == d:
                break
            if strides[e] > 0:
                rest = rest - torch.clamp(rest // strides[e], max=x.shape[e] - 1) * strides[e]
        indices.append(torch.clamp(rest // max(strides[d], 1), max=x.shape[d] - 1))
    kept = list(range(lead))
    moved = x.movedim(kept, [x.dim() - lead + k for k in kept]) if lead else x
    gathered = moved[tuple(indices)]
    inner = gathered.dim() - lead
    return gathered.movedim([inner + k for k in kept], kept) if lead else gathered


def names_its_elements_in_order(
    x: torch.Tensor, size: list[int], stride: Any, storage_offset: Any = None, in_place: bool = False
) -> bool:
    """``x.as_strided(size, stride, storage_offset)`` is a view of ``x``: its own shape
    and strides, or (not in place) a contiguous ``x``'s elements in their order."""
    if storage_offset is not None and storage_offset != x.storage_offset():
        return False
    same_shape = size == list(x.shape) and _strides_agree(size, stride, x.stride())
    return same_shape or (
        not in_place and x.is_contiguous() and math.prod(size) == x.numel()
        and _strides_agree(size, stride, _contiguous_strides(size))
    )


def _strides_agree(size: list[int], stride: Any, other: Any) -> bool:
    """The strides address the same elements (a dimension of length 1 has no stride)."""
    return len(stride) == len(size) and all(
        n == 1 or s == t for n, s, t in zip(size, stride, other, strict=False)
    )


def _contiguous_strides(size: list[int]) -> list[int]:
    strides, step = [], 1
    for n in reversed(size):
        strides.append(step)
        step *= max(n, 1)
    return strides[::-1]


def as_strided(x: torch.Tensor, size: Any, stride: Any, storage_offset: Any = None) -> Any:
    """``Tensor.as_strided`` while the step is traced: windows of ``x`` gathered by index
    where they name only its elements (see the NOTE), else ATen's (a view of ours where
    it only names ``x``'s elements in order, ``_as_strided_as_view`` in ``trace.py``)."""
    answered = NotImplemented
    if names_its_elements_in_order(x, list(size), stride, storage_offset):
        return torch.Tensor.as_strided(x, size, stride, storage_offset)
    if storage_offset is None or storage_offset == x.storage_offset():
        answered = windows_by_index(x, list(size), list(stride))
    if answered is NotImplemented:
        return torch.Tensor.as_strided(x, size, stride, storage_offset)
    if _COPIED:
        _COPIED[-1].extend([private.storage_ref(x), private.storage_ref(answered)])
    return answered


_IN_PLACE_DUNDERS = frozenset({
    "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
    "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
})


def refuse_writes_through_windows(func: Any, args: tuple, kwargs: dict) -> None:
    """Refuse an in-place write to gathered windows or to the tensor they view (the NOTE)."""
    if not _COPIED or not _COPIED[-1] or not args or not isinstance(args[0], torch.Tensor):
        return
    name = getattr(func, "__name__", "")
    in_place = (name.endswith("_") and not name.endswith("__")) or name in _IN_PLACE_DUNDERS
    if not (in_place or kwargs.get("out") is not None):
        return
    target = private.storage_ref(args[0])
    if any(target == seen for seen in _COPIED[-1]):
        raise SPMDCompileError(
            f"`{name}` writes in place to windows made by as_strided, or to the tensor they "
            "view; in the compiled step the windows are gathered copies (NOTE: [windows by "
            "as_strided]), so eager's write through the view cannot be matched.",
            user_line=innermost_model_frame_of_stack(),
            hint="compute the windows after the write, or write out of place "
            "(x = x + ..., torch.where).",
        )


@contextlib.contextmanager
def strided_windows() -> Iterator[None]:
    """While the step is traced: the storages of windows gathered so far (the NOTE)."""
    _COPIED.append([])
    try:
        yield
    finally:
        _COPIED.pop()


__all__ = [
    "MAX_WINDOW_ELEMENTS", "as_strided", "names_its_elements_in_order",
    "refuse_writes_through_windows", "strided_windows", "windows_by_index",
]
