"""``repeat_interleave`` by a tensor of counts with a given ``output_size``, as a gather.

NOTE: [repeats of a fixed total at capture]
``torch.repeat_interleave(x, repeats, dim, output_size=N)`` with ``repeats`` a tensor
(FastSpeech-2's length regulator: phoneme states repeated by their durations, padded so
every row sums to ``T``) has a fixed shape, but its kernel ``aten.repeat_interleave.Tensor``
(repeats to indices) has no DTensor rule on any supported torch: refused at expansion
until the sixty-sixth session ("Operator aten.repeat_interleave.Tensor does not have a
sharding strategy registered"). While the step is traced, a ``TorchFunctionMode`` answers
it with its indices computed in plain ops that have rules:

    index = searchsorted(cumsum(repeats), arange(N), right=True)   # clamped in range
    x.index_select(dim, index)         # dim=None: of x flattened; no x: index itself

ATen's composite does the same ``index_select`` of its indices, so values and the
gradient into ``x`` (``index_select``'s backward, an ``index_add``) are eager's. A 0-d or
one-element ``repeats`` is expanded over the dimension first, as ATen does. Eager's
kernel checks that no count is negative and that the counts sum to ``output_size``; both
stay in the program as value checks (NOTE: [value checks]), so a call that breaks one
raises ``SPMDRuntimeError`` naming the line and eager's message instead of gathering
wrong rows; the index is clamped so that the program's own gather never reads out of
range before the checks are compared. Anything else (an int ``repeats``, which is a
shape; no ``output_size``, a size the values decide; no counts; a wrong dtype or length) goes to
torch as it is, which compiles, refuses with the hint by op (``_VALUE_SHAPE_HINTS`` in
``trace.py``) or raises eager's error.
"""

from __future__ import annotations

from typing import Any

import torch

from .value_checks import eager_check

_COUNT_DTYPES = (torch.int64, torch.int32)


def _signature(func: Any, args: tuple, kwargs: dict) -> tuple[Any, Any, Any, Any]:
    """(input, repeats, dim, output_size) of ``torch.repeat_interleave`` /
    ``Tensor.repeat_interleave``, the function's self-less form giving input None (the
    method has none: torch refuses it)."""
    names = ("input", "repeats", "dim")
    bound = dict(zip(names, args, strict=False)) | {
        ("input" if k == "self" else k): v for k, v in kwargs.items()
    }
    x, repeats = bound.get("input"), bound.get("repeats")
    if repeats is None and func is torch.repeat_interleave:  # (repeats, output_size=N)
        x, repeats = None, x
    return x, repeats, bound.get("dim"), bound.get("output_size")


def _answered_here(x: Any, repeats: Any, dim: Any, output_size: Any) -> bool:
    if not isinstance(repeats, torch.Tensor) or repeats.dtype not in _COUNT_DTYPES or not repeats.numel():
        return False
    if not isinstance(output_size, int) or isinstance(output_size, bool) or output_size < 0:
        return False
    if x is None:
        return repeats.dim() == 1
    if not isinstance(x, torch.Tensor):
        return False
    if dim is not None and (not isinstance(dim, int) or not -x.dim() <= dim < x.dim()):
        return False  # torch's own IndexError
    size = x.numel() if dim is None else x.size(dim)
    return size > 0 and (repeats.dim() == 0 or (repeats.dim() == 1 and repeats.size(0) in (1, size)))


def repeat_interleave(func: Any, *args: Any, **kwargs: Any) -> Any:
    """``func`` (``torch.repeat_interleave`` or the method) as the NOTE's gather where it
    applies, else ``func`` itself."""
    x, repeats, dim, output_size = _signature(func, args, kwargs)
    if not _answered_here(x, repeats, dim, output_size):
        return func(*args, **kwargs)
    if x is not None:
        if dim is None:
            x, dim = x.flatten(), 0
        if repeats.dim() == 0 or repeats.size(0) != x.size(dim):
            repeats = repeats.reshape(1).expand(x.size(dim))
    eager_check(repeats >= 0, "repeat_interleave: repeats can not be negative")
    ends = repeats.cumsum(0)
    eager_check(ends[-1] == output_size, f"repeat_interleave: the repeats sum to another total than "
                f"output_size={output_size} (eager: allocated size does not match required size)")
    positions = torch.arange(output_size, device=repeats.device, dtype=ends.dtype)
    index = torch.searchsorted(ends, positions, right=True).clamp(max=repeats.numel() - 1)
    if x is None:
        return index.to(repeats.dtype)
    return x.index_select(dim, index)


__all__ = ["repeat_interleave"]
