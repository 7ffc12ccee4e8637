"""Value-dependent shapes of tensors made from Python values alone: refused with a hint
that fits.

NOTE: [value-dependent shapes of Python values]
``torch.unique_consecutive``, ``torch.unique`` and ``torch.bincount`` have a size their
input's values decide, which a compiled program (fixed shapes) cannot have; capture
refuses them naming the line, with a hint by op (``_VALUE_SHAPE_HINTS`` in
``trace.py``: count with a fixed length, ``one_hot(labels, n).sum(0)``). That hint is for
labels of the batch. Where the input is made from Python values alone (no argument,
parameter or state of the step reaches it: DINO's ``MultiCropWrapper`` groups its crops
by resolution with ``torch.unique_consecutive(torch.tensor([inp.shape[-1] for inp in
x]), return_counts=True)``), the values are Python's before they are a tensor, and the
grouping is best done there: the refusal says so (``itertools.groupby`` over the shapes),
which compiles and is exact. Computing the op at capture instead would not get such a
step further: DINO then slices its list of crops by the counts (``x[start:end]`` with
0-d tensors), a value read in Python.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from .. import _torch_private as private
from ..ir.graph_utils import placeholders_read_by
from .mask_selections import active

aten = torch.ops.aten

_UNIQUE = "sorted(set(sizes)) and collections.Counter(sizes) for unique's values and counts"
_OPS = {  # op: (its name in torch, what to write over the Python values)
    aten.unique_consecutive.default: (
        "unique_consecutive", "itertools.groupby(sizes) for unique_consecutive's values and counts"
    ),
    aten._unique2.default: ("unique", _UNIQUE),
    aten.unique_dim.default: ("unique", _UNIQUE),
    aten.bincount.default: ("bincount", "collections.Counter(sizes) for bincount's counts"),
}


def _made_from_python_values(t: Any) -> bool:
    """``t`` is a tensor the step's trace made from no graph input (shapes, Python
    numbers and lists), or a real constant."""
    if not isinstance(t, torch.Tensor) or active() is None:
        return False
    if private.is_real_tensor_constant(t):
        return True
    node = private.traced_node_of(t)
    return node is not None and not placeholders_read_by(node)


def grouping_hint(op: Any) -> str:
    """What to write instead of ``op`` (one of ``_OPS``) on Python values."""
    name, grouping = _OPS[op]
    return (
        f"the input of {name} is made from Python values alone (shapes, numbers, lists), "
        "so group those values in Python before they become a tensor: sizes = "
        f"[inp.shape[-1] for inp in x], then {grouping} (DINO's crops by resolution: ends "
        "= list(itertools.accumulate(len(list(g)) for _, g in itertools.groupby(sizes)))); "
        "Python numbers compile as constants and are exact (NOTE: [value-dependent "
        "shapes of Python values])."
    )


def _refused_with_grouping(op: Any, *args: Any, **kwargs: Any) -> Any:
    if not args or not _made_from_python_values(args[0]):
        return NotImplemented  # torch's own (fake tensors refuse it, with the hint by op)
    error = private.value_dependent_shape_error(op)
    error.hint = grouping_hint(op)  # type: ignore[attr-defined]
    raise error


def python_valued_shape_decompositions() -> dict[Any, Callable[..., Any]]:
    """The capture decompositions of the NOTE."""
    return {op: functools.partial(_refused_with_grouping, op) for op in _OPS}


__all__ = ["grouping_hint", "python_valued_shape_decompositions"]
