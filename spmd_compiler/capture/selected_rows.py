"""Rows selected by a mask, kept in place with the mask beside them.

NOTE: [selected rows kept in place]
``x[mask]``, ``x.masked_select(mask)`` and ``torch.where(mask)`` have one row per true
element: a size the data decides. Where the mask comes from the batch (padding: ``logits[labels != -100]``,
``pred[~torch.isnan(y)]``, ELECTRA's ``logits[attention_mask == 1]``, the labels
``Wav2Vec2ForCTC`` flattens for its CTC loss), NOTE: [selections by a mask of the batch]
compiles the selection for the mask that selects everything and verifies that every
call. This module answers the selection exactly for any mask, as long as what the step
does with the rows is understood:

- While the step is traced, the selection is the whole tensor with the mask's dims
  flattened into one leading row dim, ``(N, *rest)``, the mask flattened beside it as
  the rows' validity. The rows the mask drops hold a neutral value (1 for floating
  point, 0 for integers, False) instead of their data: padding labels (-100) never
  index, missing targets (NaN) never reach a gradient, and the backward of the
  selection gives the dropped rows exactly zero.
- An op on such rows that treats rows independently keeps them (its result is rows with
  the same validity): pointwise ops (ATen's ``pointwise`` tag, random ones excluded) with
  other tensors broadcast over the rows, dtype and device conversions, ``F.linear`` /
  ``matmul`` by a weight, views that keep the leading dim (a reshape must put ``-1``
  there, as eager's size is unknown), ops along another dim (softmax, ``gather``,
  reductions, ``cat``, ``topk``, ``sort``), an ``einsum`` keeping the row letter first
  (``"nd,de->ne"``), ``F.embedding`` and ``F.one_hot`` of selected indices; reads and
  writes along the other dims (``size(-1)``, ``F.pad``, ``r[..., 0] = c``, ``scatter``,
  ``searchsorted``: NOTE: [rows along their other dims] in ``rows_along_other_dims.py``).
- Where the rows end, the dropped rows are left out: a reduction over the rows (``sum``,
  ``mean`` divided by the true count, ``amax``, ``all``, ...) fills them with its
  identity first; ``var`` / ``std`` / ``var_mean`` / ``std_mean`` are eager's two passes
  over the kept rows (NOTE: [spreads of selected rows] in ``row_spreads.py``); counts into
  fixed bins (``histc``, ``bincount`` by ``minlength``, ``index_put_(accumulate=True)``,
  ``index_add_`` / ``scatter_add_`` along dim 0 by selected indices) keep the dropped rows
  at a valid index adding an exact zero (NOTE: [counts of selected rows] in
  ``counts_of_rows.py``); a loss (``cross_entropy`` and ``nll_loss`` by ``ignore_index``, the
  elementwise losses by their unreduced values, ``kl_div``'s ``batchmean`` by the
  count) reduces over the kept rows only; ``ctc_loss`` gets its concatenated targets
  moved to the front, in order (a stable sort by validity).
- ``target[mask] = rows`` with rows of that mask writes each kept row to its place
  (``out[mask] = f(h[mask])``, and ``index_put((mask,), rows)``); ``target[mask] = v`` with ``v`` one row broadcast over
  the selected rows (BERT's and MAE's mask token) is ``torch.where(mask, v, target)``.
- ``x[mask, None]``, ``x[mask, ...]`` and ``x[mask, i, 1:]`` (ints, slices, None after
  the mask) are ``x[:, None][mask]`` and so on: the mask is the only advanced index, so
  its rows come first, as in eager. ``x[mask, i]`` with ``i`` integer rows of that
  selection (``logits[keep, labels[keep]]``) is a ``gather`` of each row's own entry.
- ``torch.where(mask)``, ``nonzero`` and ``argwhere`` are every index of the mask, in
  row-major order, kept the same way; indexing an unselected tensor on its leading dims
  by such indices (``x[i, j]``, ``index_select(0, i)``, ``gather(0, i)``) gives rows
  (the dropped rows' indices are 0 there, so that they index). Indexing by the whole
  tuple ``torch.where(mask)`` on leading dims shaped as the mask is ``x[mask]`` itself:
  the rows are a view of ``x`` (a batch sharded there stays sharded), not a gather by
  indices covering every position, which gathers the batch.
- Anything else (a read of the row count, ``.shape[0]``, ``item()``, a reduction whose
  index would differ, an op that mixes rows, a custom ``autograd.Function``, whose
  ``apply`` no torch function mode sees, a value the step returns or keeps) is
  the eager value only when the mask selects everything: the selection settles there
  into NOTE: [selections by a mask of the batch] (a value check verified every call),
  exactly as it was compiled before.

A mask computed from the model's state (OHEM's ``losses[losses > threshold]``, pseudo
labels kept above a confidence) is kept in place the same way: exact for any mask. Where
its rows settle it cannot be compiled as all true (routing is never all true), so such a
use is refused at capture as a value-dependent shape, naming the line. The dropped rows' neutral values can make a
later op's derivative infinite there (``log(1 - rows)``), which reaches a weight's
gradient as ``0 * inf`` only if such an op takes that weight (``w * log(1 - rows)``):
torch's own ``log`` of the kept rows would have met the same values had they been
selected.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .. import _torch_private as private
from .._torch_private import pytree
from . import counts_of_rows, mask_selections, row_spreads, rows_along_other_dims
from .rows_along_other_dims import arg_of
from .value_checks import eager_check, located, where_now

Compute = Callable[[Any, tuple, dict], Any]


@dataclass(eq=False)
class _Rows:
    """One selection's validity: ``valid`` (N,) bool, from ``mask``."""

    valid: torch.Tensor
    mask: torch.Tensor
    where: str | None  # the selection's line
    key: Any  # the mask's elements (_mask_key)
    settled: bool = False
    # settled for K true elements per row (NOTE: [rows of one count]) or for the mask's own
    # value (mask_selections.CONSTANT: NOTE: [masks made from shapes alone])
    per_row: int | None = None

    def count(self) -> torch.Tensor:
        return self.valid.sum()

    def along(self, t: torch.Tensor) -> torch.Tensor:
        """The validity shaped to broadcast over ``t``'s rows."""
        return self.valid.reshape((-1,) + (1,) * (t.dim() - 1))


@dataclass
class _Registry:
    rows: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)
    by_mask: dict[Any, _Rows] = field(default_factory=dict)  # by _mask_key
    # torch.where(mask)'s index tensors: (their rows, which dim of the mask, its shape)
    grids: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)
    keys: dict[torch.fx.Node, Any] = field(default_factory=dict)  # by node: NOTE: [mask keys interned]
    interned: dict[tuple, torch.fx.Node] = field(default_factory=dict)  # structure -> its first node
    # ``nonzero`` / ``argwhere`` of a 1-D mask, by the key of its elements (``_key_of``):
    # a reshape of it (``.squeeze(1)``, ``.view(-1)``) is ``torch.where(mask)[0]``
    flat_grids: dict[Any, _Rows] = field(default_factory=dict)
    # rows settled for a count per row -> the kept rows alone (NOTE: [rows of one count])
    compacted: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)
    counted: bool = False  # some rows settled so
    compacting: bool = False  # inside _compacted: ops run as they are


_SAME_ELEMENTS = {  # ops whose result has its input's elements in row-major order
    "view.default", "_unsafe_view.default", "reshape.default", "alias.default",
    "flatten.using_ints", "unsqueeze.default", "squeeze.default", "squeeze.dim",
    "squeeze.dims", "detach.default", "clone.default", "lift_fresh_copy.default",
}
# NOTE: [mask keys interned]
# A mask's key (``_mask_key``) says which masks have the same elements: equal keys, the
# same mask value. It was the nested tuple of the ops computing the mask, down to 32
# levels; tuples share their parts but Python does not cache a tuple's hash, so each
# ``by_mask`` lookup hashed the whole tree as if expanded. A loop whose mask reads the
# previous step's values twice (farthest point sampling's ``mask = dist < distance;
# distance[mask] = dist[mask]``) doubles that tree each step: its first call took 28 s
# of capture for 9 points and never finished for PointNet++'s 512. Each node's key is
# now computed once, from its inputs' keys, and interned: the key is the first node seen
# with that structure (target, arguments' keys, keywords), so equal structures get the
# same node and a lookup hashes one object. The meaning is the one above at any depth:
# two nodes share a key exactly when their structures are equal, their inputs' keys
# equal in turn; the walk is iterative, so no depth cap is needed against recursion.


def _key_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes whose keys ``node``'s key is made from."""
    if node.op != "call_function":
        return []
    if _same_elements(node):
        return [node.args[0]]  # type: ignore[list-item]
    return node.all_input_nodes


def _same_elements(node: torch.fx.Node) -> bool:
    return (getattr(node.target, "__name__", "") in _SAME_ELEMENTS and bool(node.args)
            and isinstance(node.args[0], torch.fx.Node))


def _mask_key(registry: _Registry, node: torch.fx.Node) -> Any:
    """Masks with one key have the same flattened elements: the same traced node up to
    views (``mask.view(-1)`` taken twice), or the same ops on the same inputs
    (``labels.view(-1) != -100`` computed twice): NOTE: [mask keys interned]."""
    keys = registry.keys
    stack = [node]
    while stack:
        n = stack[-1]
        if n in keys:
            stack.pop()
            continue
        missing = [a for a in _key_inputs(n) if a not in keys]
        if missing:
            stack.extend(missing)
            continue
        stack.pop()
        keys[n] = _own_key(registry, n)
    return keys[node]


def _own_key(registry: _Registry, node: torch.fx.Node) -> Any:
    """``node``'s key, its inputs' keys known."""
    if node.op != "call_function":
        return node
    if _same_elements(node):
        return registry.keys[node.args[0]]  # type: ignore[index]

    def part(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            return registry.keys[a]
        if isinstance(a, (list, tuple)):
            return tuple(part(b) for b in a)
        return a if isinstance(a, (int, float, bool, str, type(None), torch.dtype)) else id(a)

    structure = (node.target, part(node.args), tuple(sorted((k, part(v)) for k, v in node.kwargs.items())))
    return registry.interned.setdefault(structure, node)


def _registry() -> _Registry | None:
    selections = mask_selections.active()
    if selections is None:
        return None
    if not hasattr(selections, "selected_rows"):
        selections.selected_rows = _Registry()  # type: ignore[attr-defined]
    return selections.selected_rows  # type: ignore[attr-defined, no-any-return]


def _neutral(dtype: torch.dtype) -> Any:
    if dtype == torch.bool:
        return False
    return 1 if dtype.is_floating_point or dtype.is_complex else 0


def _is_mask(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) and t.dim() > 0


def _keep_in_place(registry: _Registry, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
    """The rows of ``x[mask]`` kept in place, or None when the selection is left to
    NOTE: [selections by a mask of the batch]."""
    k = mask.dim()
    if x.dim() < k or tuple(x.shape[:k]) != tuple(mask.shape) or not mask_selections.traced(mask):
        return None
    key = _key_of(registry, mask)
    rows = registry.by_mask.get(key)
    if rows is None:
        # a copy: the mask written in place later does not change the rows selected now
        rows = _Rows(mask.reshape(-1).to(torch.bool, copy=True), mask, where_now(), key)
        registry.by_mask[key] = rows
    kept = _rows_in_place(rows, x, k)
    registry.rows[kept] = rows
    return kept


def _rows_in_place(rows: _Rows, x: torch.Tensor, k: int) -> torch.Tensor:
    """``x`` with its first ``k`` dims (the mask's) flattened into rows, the dropped rows
    holding the neutral value of ``x``'s dtype."""
    flat = x.reshape((-1,) + tuple(x.shape[k:]))
    return torch.where(rows.along(flat), flat, torch.full((), _neutral(x.dtype), dtype=x.dtype, device=x.device))


def _key_of(registry: _Registry, mask: torch.Tensor) -> Any:
    node = private.traced_node_of(mask)
    return (_mask_key(registry, node) if node is not None else id(mask), mask.numel())


def _bare_mask(index: Any) -> Any:
    """``mask`` for an index ``mask``, ``(mask, :, ...)`` or ``(mask, ...)``."""
    if isinstance(index, tuple) and index and sum(i is Ellipsis for i in index[1:]) <= 1 and all(
        i is Ellipsis or (isinstance(i, slice) and i == slice(None)) for i in index[1:]
    ):
        return index[0]
    return index


def _mask_then_basic(index: Any) -> tuple[torch.Tensor, tuple, int] | None:
    """(mask, rest, dims rest indexes) for an index ``(mask, i, j, ...)`` whose other
    entries are ints, slices, None and at most one Ellipsis (basic indices after the
    mask's dimensions), else None."""
    if not (isinstance(index, tuple) and len(index) > 1 and _is_mask(index[0])):
        return None
    rest = index[1:]
    if not all(type(i) is int or isinstance(i, slice) or i is None or i is Ellipsis for i in rest):
        return None
    if sum(i is Ellipsis for i in rest) > 1:
        return None
    return index[0], rest, sum(1 for i in rest if i is not None and i is not Ellipsis)


def _indices_in_place(registry: _Registry, name: str, args: tuple, kwargs: dict) -> Any:
    """``torch.where(mask)``, ``nonzero`` and ``argwhere``: every index of the mask, in
    row-major order, the mask's elements as the rows' validity (None: not ours)."""
    as_tuple = name == "where" or bool(kwargs.get("as_tuple", False))
    if len(args) != 1 or set(kwargs) - {"as_tuple"} or (name == "where" and kwargs):
        return None
    x = args[0]
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or not mask_selections.traced(x):
        return None
    mask = x if x.dtype == torch.bool else x != 0
    key = ("indices", _key_of(registry, x))
    rows = registry.by_mask.get(key)
    if rows is None:
        rows = _Rows(mask.reshape(-1).to(torch.bool, copy=True), x, where_now(), key)
        registry.by_mask[key] = rows
    grid = mask_selections.every_index(x.shape, x.device)
    if not as_tuple and x.dim() == 1:  # NOTE: [writes by the indices of a mask]
        registry.flat_grids[_key_of(registry, grid)] = rows
    found = grid.unbind(1) if as_tuple else (grid,)
    for d, t in enumerate(found):
        registry.rows[t] = rows
        if as_tuple:
            registry.grids[t] = (rows, d, tuple(x.shape))
    return found if as_tuple else grid


def _rows_of_the_grid(registry: _Registry, x: torch.Tensor, index: Sequence[Any]) -> torch.Tensor | None:
    """``x[torch.where(mask)]`` (or ``index_select(0, i)`` with ``i, = torch.where(mask)``)
    on ``x``'s leading dims shaped as the mask: ``x[mask]``'s rows kept in place (a view
    of ``x``, so a batch sharded there stays sharded), not a gather by indices that
    cover every position (which gathers it); None when ``index`` is not that grid."""
    found: list[tuple[_Rows, int, tuple[int, ...]]] = []
    for i in index:
        entry = registry.grids.get(i) if isinstance(i, torch.Tensor) else None
        if entry is None:
            return None
        found.append(entry)
    if not found:
        return None
    rows, _, shape = found[0]
    if (any(f[0] is not rows or f[1] != d for d, f in enumerate(found)) or len(found) != len(shape)
            or tuple(x.shape[:len(shape)]) != shape):
        return None
    return _rows_in_place(rows, x, len(shape))


def _selection(registry: _Registry, name: str, args: tuple, kwargs: dict) -> Any:
    if name in ("where", "nonzero", "argwhere"):
        return _indices_in_place(registry, name, args, kwargs)
    if kwargs or len(args) != 2 or not isinstance(args[0], torch.Tensor):
        return None
    x, index = args
    if name == "__getitem__":
        index = _bare_mask(index)
        if _is_mask(index):
            return _keep_in_place(registry, x, index)
        basic = _mask_then_basic(index)
        if basic is not None:  # ``x[mask, k]`` is ``x[:, k][mask]`` (a router's top-k
            # weights of the tokens an expert takes; refused before as a nonzero), and
            # ``x[mask, None]`` / ``x[mask, ...]`` are ``x[:, None][mask]`` / ``x[mask]``
            # (the mask is the only advanced index: its rows come first, as in eager)
            mask, rest, used = basic
            if mask.dim() + used <= x.dim():
                return _keep_in_place(registry, x[(slice(None),) * mask.dim() + rest], mask)
        return None
    if name == "masked_select" and _is_mask(index):
        x, mask = torch.broadcast_tensors(x, index)
        return _keep_in_place(registry, x, mask)  # flat rows; the mask keeps its shape
    return None


# NOTE: [writes by the indices of a mask]
# ``final[torch.where(cond)] = 0`` (pytorch-metric-learning's CircleLoss and other losses
# zeroing the anchors without a positive), ``final[torch.where(cond)[0]] = 0`` and
# ``final[cond.nonzero().squeeze(1)] = 0`` write exactly the elements ``final[cond] = 0``
# writes (the indices are every true element's, in row-major order, each once), and
# reads by these indices were already ``x[mask]`` (``_rows_of_the_grid``). Writes were
# not: the indices settled as all true, and every call with a false element raised
# (MaskWithFalseElements at the first call, 2 simulated ranks) where ``final[cond] = 0``
# matched eager. A ``__setitem__`` / ``index_put(_)`` whose indices are the whole grid
# of one mask on the target's leading dims (``where``'s tuple, or for a 1-D mask its one
# index, or a reshape of ``nonzero`` / ``argwhere`` told by the key of its elements) is
# answered as the same write by the mask itself. Anything else is torch's own (and
# settles as before): indices changed in value (``where(cond)[0] + 1``), a part of a
# k-D mask's grid, a mask not shaped as the target's leading dims.
def _mask_of_indices(registry: _Registry, target: Any, index: Any) -> torch.Tensor | None:
    """The boolean mask whose every index ``index`` is, on ``target``'s leading dims (NOTE:
    [writes by the indices of a mask]); None otherwise."""
    items = tuple(index) if isinstance(index, (tuple, list)) else (index,)
    if not isinstance(target, torch.Tensor) or not items or not all(isinstance(i, torch.Tensor) for i in items):
        return None
    found = [registry.grids.get(i) for i in items]
    rows: _Rows | None = None
    if all(f is not None for f in found):
        first = found[0]
        assert first is not None
        rows, _, shape = first
        if any(f is None or f[0] is not rows or f[1] != d for d, f in enumerate(found)) or len(found) != len(shape):
            return None
    elif len(items) == 1 and items[0].dim() == 1 and not items[0].dtype.is_floating_point:
        rows = registry.flat_grids.get(_key_of(registry, items[0]))
    if rows is None or registry.rows.get(items[0]) is not rows:
        return None
    mask = rows.mask if rows.mask.dtype == torch.bool else rows.mask != 0
    if target.dim() < mask.dim() or tuple(target.shape[:mask.dim()]) != tuple(mask.shape):
        return None
    return mask


def _write_of_one_row(registry: _Registry, args: tuple, kwargs: dict) -> bool:
    """``x[mask] = v`` with a tensor ``v`` broadcast over the selected rows (BERT's and
    MAE's mask token, wav2vec2's ``masked_spec_embed``): written as ``torch.where(mask,
    v, x)``, the same values for any mask, and ``v``'s gradient the sum over the kept
    positions, as eager's. True when written so; False leaves the write to torch (rows
    of a selection as ``v``: ``_write_back``)."""
    if kwargs or len(args) != 3:
        return False
    target, index, value = args[0], _bare_mask(args[1]), args[2]
    if not (isinstance(target, torch.Tensor) and isinstance(value, torch.Tensor) and _is_mask(index)):
        return False
    k = index.dim()
    one_row = value.shape[1:] if value.dim() == target.dim() - k + 1 and value.shape[0] == 1 else value.shape
    if (target.dim() < k or tuple(target.shape[:k]) != tuple(index.shape) or value.dtype != target.dtype
            or len(one_row) > target.dim() - k or not mask_selections.traced(index)
            or any(registry.rows.get(t) is not None for t in (target, index, value))):
        return False  # eager raises on other dtypes: torch's own write says so
    try:
        if torch.broadcast_shapes(tuple(one_row), tuple(target.shape[k:])) != tuple(target.shape[k:]):
            return False
    except RuntimeError:  # eager raises: torch's own write says so
        return False
    written = index.to(torch.bool).reshape(tuple(index.shape) + (1,) * (target.dim() - k))
    target.copy_(torch.where(written, value.reshape(one_row), target))
    return True


# -- which ops keep rows --------------------------------------------------------------

_DUNDER = {
    "__radd__": "add", "__rsub__": "rsub", "__rmul__": "mul", "__truediv__": "div",
    "__rtruediv__": "div", "__div__": "div", "__rdiv__": "div", "__pow__": "pow",
    "__rpow__": "pow", "__and__": "bitwise_and", "__rand__": "bitwise_and",
    "__or__": "bitwise_or", "__ror__": "bitwise_or", "__xor__": "bitwise_xor",
    "__rxor__": "bitwise_xor", "__invert__": "bitwise_not", "__neg__": "neg", "__abs__": "abs",
    "__eq__": "eq", "__ne__": "ne", "__lt__": "lt", "__le__": "le", "__gt__": "gt",
    "__ge__": "ge", "__mod__": "remainder", "__iadd__": "add", "__isub__": "sub",
    "__imul__": "mul", "__itruediv__": "div", "__ipow__": "pow", "__iand__": "bitwise_and",
    "__ior__": "bitwise_or",
}
_EXTRA_POINTWISE = {"logsigmoid", "softsign", "tanhshrink", "relu6", "hardtanh", "threshold"}
_POINTWISE_CACHE: dict[str, bool] = {}


def _pointwise(name: str) -> bool:
    name = _DUNDER.get(name, name)
    if name in _EXTRA_POINTWISE:
        return True
    base = name[:-1] if name.endswith("_") and not name.startswith("_") else name
    if base not in _POINTWISE_CACHE:
        op = getattr(torch.ops.aten, base, None)
        tags: list[Any] = []
        if op is not None:
            try:
                tags = [t for o in op.overloads() for t in getattr(op, o).tags]
            except (AttributeError, RuntimeError):
                tags = []
        _POINTWISE_CACHE[base] = (
            torch.Tag.pointwise in tags and torch.Tag.nondeterministic_seeded not in tags
        )
    return _POINTWISE_CACHE[base]


_METADATA = {
    "dim", "ndimension", "is_floating_point", "is_complex", "element_size", "get_device",
    "is_contiguous", "data_ptr", "__hash__", "is_signed",
}
_METADATA_GETTERS = {
    "dtype", "device", "ndim", "requires_grad", "grad_fn", "is_leaf", "layout", "is_cuda",
    "is_cpu", "is_meta", "is_sparse", "is_quantized", "names", "is_nested", "itemsize",
}
_CONVERSIONS = {
    "float", "double", "half", "bfloat16", "long", "int", "short", "bool", "byte", "char",
    "to", "type", "type_as", "detach", "detach_", "clone", "contiguous", "requires_grad_",
    "cpu", "cuda",
}
# a tensor of one value shaped as the rows (``out = torch.zeros_like(h)``, a mixture of
# experts' output summed over experts) is rows of that value; before 2026-12-06 it
# settled (random ``*_like`` and ``empty_like``, whose dropped rows hold no set value, still do)
_LIKE = {"zeros_like", "ones_like", "full_like"}
_ALONG_A_DIM = {  # name: (position of dim, default dim)
    "softmax": (1, None), "log_softmax": (1, None), "cumsum": (1, None), "cumprod": (1, None),
    "logcumsumexp": (1, None), "normalize": (2, 1), "glu": (1, -1), "flip": (1, None),
    # NOTE: [ops along a dim of the rows]: before 2026-12-06 these settled, and a router's
    # top-k of each token's expert scores (``probs.topk(2, dim=-1)``) was refused on the
    # first padded batch; along the rows' own dim (``topk(k, 0)``, ``msort``) they still
    # settle: their result depends on the rows' number
    "topk": (2, -1), "sort": (1, -1), "argsort": (1, -1), "kthvalue": (2, -1),
    "mode": (1, -1), "cummax": (1, None), "cummin": (1, None),
}
_REDUCTIONS = {"sum", "nansum", "mean", "amax", "amin", "max", "min", "prod", "logsumexp",
               "all", "any", "argmax", "argmin", "norm", "std", "var", "count_nonzero",
               "median", "nanmedian", "nanmean", "aminmax", "var_mean", "std_mean"}
_FILL = {"sum": 0, "nansum": 0, "prod": 1, "amax": -math.inf, "max": -math.inf,
         "amin": math.inf, "min": math.inf, "logsumexp": -math.inf, "all": True, "any": False,
         "count_nonzero": 0}
_LOSSES = {"mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
           "binary_cross_entropy_with_logits", "soft_margin_loss", "kl_div", "poisson_nll_loss"}
_SETTLE = object()
_COUNTS = {"histc", "bincount", "index_put", "index_put_", "index_add", "index_add_", "scatter_add", "scatter_add_"}


def _dims(spec: Any, ndim: int) -> tuple[int, ...] | None:
    """``dim`` argument -> normalized dims; None when it is not one."""
    if isinstance(spec, int) and not isinstance(spec, bool):
        spec = (spec,)
    if isinstance(spec, (tuple, list)) and all(isinstance(d, int) for d in spec):
        return tuple(d % max(ndim, 1) for d in spec)
    return None


class _Answer:
    """One op with rows among its arguments: the rule that keeps them, or settles."""

    def __init__(self, registry: _Registry, func: Any, args: tuple, kwargs: dict, compute: Compute) -> None:
        self.registry, self.func, self.args, self.kwargs = registry, func, args, kwargs
        self.compute = compute
        leaves = pytree.tree_leaves((args, kwargs))
        self.tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        self.ragged = [t for t in self.tensors if self.rows_of(t) is not None]
        found = {id(self.rows_of(t)): self.rows_of(t) for t in self.ragged}
        self.rows = next(iter(found.values())) if len(found) == 1 else None

    def rows_of(self, t: torch.Tensor) -> _Rows | None:
        rows = self.registry.rows.get(t)
        return None if rows is None or rows.settled else rows

    def keep(self, result: Any) -> Any:
        assert self.rows is not None
        n = self.rows.valid.shape[0]
        for leaf in pytree.tree_leaves(result):
            if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] == n:
                self.registry.rows[leaf] = self.rows
        return result

    def run(self, args: tuple | None = None, kwargs: dict | None = None) -> Any:
        return self.compute(self.func, self.args if args is None else args,
                            self.kwargs if kwargs is None else kwargs)

    # -- rules -------------------------------------------------------------------------
    def answer(self, name: str) -> Any:
        if name in _METADATA or (name == "__get__" and self._getter() in _METADATA_GETTERS):
            return self.run()
        if self.rows is None or self.kwargs.get("out") is not None:
            return _SETTLE
        self_ragged = bool(self.args) and isinstance(self.args[0], torch.Tensor) and self.rows_of(self.args[0]) is not None
        for rule in (self._size, self._loss, self._reduction, self._view):
            result = rule(name, self_ragged)
            if result is not None:
                return result
        if (name in _CONVERSIONS or name in _LIKE) and self_ragged and len(self.ragged) == 1:
            return self.keep(self.run())
        if name in _ALONG_A_DIM and self_ragged and len(self.ragged) == 1:
            position, default = _ALONG_A_DIM[name]
            dims = _dims(arg_of(self.args, self.kwargs, position, "dim", default), self.args[0].dim())
            return _SETTLE if dims is None or 0 in dims else self.keep(self.run())
        if name == "dropout" and not (arg_of(self.args, self.kwargs, 2, "training", True)
                                      and arg_of(self.args, self.kwargs, 1, "p", 0.5) > 0):
            return self.keep(self.run())
        if _pointwise(name) and not (name == "where" and len(self.args) + len(self.kwargs) < 3):
            return self.keep(self.run()) if self._broadcast_over_rows() else _SETTLE
        return self._structural(name, self_ragged)

    def _getter(self) -> str:
        owner = getattr(self.func, "__self__", None)
        return getattr(owner, "__name__", "")

    def _size(self, name: str, self_ragged: bool) -> Any:
        if name == "size" and self_ragged and len(self.args) + len(self.kwargs) == 2:
            dims = _dims(arg_of(self.args, self.kwargs, 1, "dim"), self.args[0].dim())
            return self.run() if dims is not None and 0 not in dims else _SETTLE
        return None

    def _broadcast_over_rows(self) -> bool:
        """Every tensor is rows of this selection of one rank, or broadcasts over them
        without a size of its own along the rows."""
        ranks = {t.dim() for t in self.ragged}
        if len(ranks) != 1:
            return False
        (rank,) = ranks
        for t in self.tensors:
            if self.rows_of(t) is not None:
                continue
            if t.dim() > rank or (t.dim() == rank and t.shape[0] != 1):
                return False
        return True

    def _reduction(self, name: str, self_ragged: bool) -> Any:
        if name not in _REDUCTIONS or not self_ragged or len(self.ragged) != 1:
            return None
        x = self.args[0]
        spread = row_spreads.spread_arguments(self.args, self.kwargs) if name in row_spreads.SPREADS else None
        if spread is not None:  # NOTE: [spreads of selected rows]
            spec, correction, keepdim = spread
        else:
            spec = arg_of(self.args, self.kwargs, 2 if name == "norm" else 1, "dim")  # norm(p, dim)
        if isinstance(spec, torch.Tensor):  # max(other): elementwise
            return None
        dims = tuple(range(x.dim())) if spec is None else _dims(spec, x.dim())
        if dims is None or (dims == () and spread is not None):  # eager's var(dim=[]) has
            return _SETTLE  # a backward of its own (inf): eager's op, for a full mask
        if dims == ():  # dim=[]: every dim, as eager (before the sixty-sixth session
            dims = tuple(range(x.dim()))  # x[mask].sum(dim=[]) summed the dropped rows too)
        if 0 not in dims:
            return self.keep(self.run())
        assert self.rows is not None
        if spread is not None:
            if x.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
                return _SETTLE  # eager's own op: complex rows, and its errors for integers
            return row_spreads.spread(name, x, self.rows.along(x), dims, correction, keepdim)
        if name == "nanmean" and x.dtype.is_floating_point and set(self.kwargs) <= {"dim", "keepdim", "dtype"}:
            # eager's nansum divided by the count of non-NaN elements, of the kept rows
            keepdim = arg_of(self.args, self.kwargs, 2, "keepdim", False)
            dtype = self.kwargs.get("dtype")
            total = torch.nansum(self._filled(x, 0), dims, keepdim=keepdim, dtype=dtype)
            return total / (self.rows.along(x) & ~torch.isnan(x)).sum(dims, keepdim=keepdim)
        if name in ("max", "min") and spec is not None:  # (values, indices): indices differ
            return _SETTLE
        if name == "mean":
            if not (x.dtype.is_floating_point or x.dtype.is_complex or "dtype" in self.kwargs):
                return _SETTLE  # eager raises
            total = self.compute(torch.sum, (self._filled(x, 0),) + tuple(self.args[1:]), self.kwargs)
            per_row = math.prod(x.shape[d] for d in dims if d != 0)
            return total / (self.rows.count() * per_row)
        if name not in _FILL:
            return _SETTLE
        if name in ("amax", "max", "amin", "min"):
            eager_check(self.rows.valid.any(), f"{name}(): the selection is empty (a reduction with no identity)")
        return self.run((self._filled(x, _FILL[name]),) + tuple(self.args[1:]))

    def _filled(self, x: torch.Tensor, value: Any) -> torch.Tensor:
        assert self.rows is not None
        if not (x.dtype.is_floating_point or x.dtype.is_complex) and isinstance(value, float):
            info = torch.iinfo(x.dtype) if x.dtype != torch.bool else None
            value = (info.min if value < 0 else info.max) if info is not None else value > 0
        return torch.where(self.rows.along(x), x, torch.full((), value, dtype=x.dtype, device=x.device))

    def _view(self, name: str, self_ragged: bool) -> Any:
        if not self_ragged or len(self.ragged) != 1:
            return None
        x = self.args[0]
        if name in ("view", "reshape") and not self.kwargs:
            shape = self.args[1:]
            if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
                shape = tuple(shape[0])
            if not shape or not all(isinstance(s, int) for s in shape):
                return _SETTLE
            keeps = shape[0] == -1 and -1 not in shape[1:] and math.prod(shape[1:]) == math.prod(x.shape[1:])
            return self.keep(self.run()) if keeps else _SETTLE
        single = {"flatten": (1, 0), "unflatten": (1, None), "unsqueeze": (1, None),
                  "narrow": (1, None), "select": (1, None), "chunk": (2, 0), "split": (2, 0),
                  "unbind": (1, 0), "tensor_split": (2, 0), "index_select": (1, None)}
        if name in single:
            position, default = single[name]
            dim = arg_of(self.args, self.kwargs, position, "start_dim" if name == "flatten" else "dim", default)
            size = x.dim() + 1 if name == "unsqueeze" else x.dim()
            return self.keep(self.run()) if isinstance(dim, int) and dim % size != 0 else _SETTLE
        if name == "squeeze":
            dims = _dims(arg_of(self.args, self.kwargs, 1, "dim"), x.dim())
            return self.keep(self.run()) if dims and 0 not in dims else _SETTLE
        if name in ("transpose", "swapaxes", "swapdims"):
            dims = _dims(list(self.args[1:3]), x.dim())
            return self.keep(self.run()) if dims and len(dims) == 2 and 0 not in dims else _SETTLE
        if name == "permute":
            order = self.args[1] if len(self.args) == 2 else self.args[1:]
            dims = _dims(list(order), x.dim())
            return self.keep(self.run()) if dims and dims[0] == 0 else _SETTLE
        if name == "expand":
            sizes = self.args[1] if len(self.args) == 2 and not isinstance(self.args[1], int) else self.args[1:]
            return self.keep(self.run()) if sizes and sizes[0] == -1 else _SETTLE
        if name == "__getitem__":
            return self.keep(self.run()) if self._keeps_rows(self.args[1], x.dim()) else _SETTLE
        return None

    @staticmethod
    def _keeps_rows(index: Any, ndim: int) -> bool:
        items = index if isinstance(index, tuple) else (index,)
        if any(isinstance(i, torch.Tensor) or isinstance(i, (list, bool)) for i in items):
            return False
        if not items:
            return True
        first = items[0]
        if first == slice(None):
            return True
        if first is Ellipsis:
            return sum(1 for i in items[1:] if i is not None) < ndim
        return False

    def _in_bounds(self, index: torch.Tensor) -> torch.Tensor:
        """A selected index with the dropped rows' entries 0, so that they index."""
        return self._filled(index, 0)

    def _by_selected_indices(self, name: str) -> Any:
        """``x[i0, i1, ...]`` / ``index_select(0, i)`` / ``gather(0, i)`` with selected
        integer indices on the leading dims of an unselected ``x``: one row each."""
        rows = self.rows
        assert rows is not None
        x = self.args[0]
        if not isinstance(x, torch.Tensor) or self.rows_of(x) is not None or len(self.args) < 2:
            return _SETTLE

        def selected_index(t: Any) -> bool:
            return (isinstance(t, torch.Tensor) and self.rows_of(t) is rows
                    and not t.dtype.is_floating_point and t.dtype != torch.bool)

        if name == "__getitem__" and not self.kwargs:
            items = self.args[1] if isinstance(self.args[1], tuple) else (self.args[1],)
            if items and _is_mask(items[0]):
                return self._picked_per_row(x, items, selected_index)
            m = next((j for j, i in enumerate(items) if not selected_index(i)), len(items))
            ok = (0 < m <= x.dim() and all(items[j].dim() == 1 for j in range(m))
                  and all(isinstance(i, slice) and i == slice(None) for i in items[m:]))
            if not ok:
                return _SETTLE
            in_place = _rows_of_the_grid(self.registry, x, items[:m])
            if in_place is not None:
                return self.keep(in_place)
            index = tuple(self._in_bounds(i) for i in items[:m]) + tuple(items[m:])
            return self.keep(self.run((x, index)))
        if name in ("index_select", "gather"):
            dim, index = arg_of(self.args, self.kwargs, 1, "dim"), arg_of(self.args, self.kwargs, 2, "index")
            if not (isinstance(dim, int) and dim % x.dim() == 0 and selected_index(index)
                    and len(self.ragged) == 1 and (name == "gather" or index.dim() == 1)):
                return _SETTLE
            in_place = _rows_of_the_grid(self.registry, x, [index]) if name == "index_select" else None
            if in_place is not None:
                return self.keep(in_place)
            return self.keep(self.compute(self.func, (x, dim, self._in_bounds(index)), {}))
        return _SETTLE

    def _picked_per_row(self, x: torch.Tensor, items: tuple, selected_index: Callable[[Any], bool]) -> Any:
        """``x[mask, i]`` with ``i`` integer rows of that mask's selection (each row's
        target logit, ``logits[keep, labels[keep]]``): eager pairs the k-th true element
        of the mask with ``i``'s k-th entry, so each row in place takes its own entry
        of ``x[mask]``'s rows along their next dim (a ``gather`` there: the batch stays
        sharded); the dropped rows take 1 (their index is 0)."""
        rows = self.rows
        assert rows is not None
        if len(items) < 2 or not selected_index(items[1]):
            return _SETTLE
        mask, index = items[0], items[1]
        k = mask.dim()
        if not (index.dim() == 1
                and all(isinstance(i, slice) and i == slice(None) for i in items[2:])
                and x.dim() > k and tuple(x.shape[:k]) == tuple(mask.shape)
                and mask_selections.traced(mask) and _key_of(self.registry, mask) == rows.key):
            return _SETTLE
        kept = _rows_in_place(rows, x, k)  # (N, size, *rest), the dropped rows neutral
        size, rest = kept.shape[1], tuple(kept.shape[2:])
        # eager indexes from the end for a negative index; a gather does not
        at = self._in_bounds(torch.where(index < 0, index + size, index))
        at = at.reshape((-1, 1) + (1,) * len(rest)).expand((at.shape[0], 1) + rest)
        return self.keep(kept.gather(1, at).squeeze(1))

    def _along(self, t: Any) -> torch.Tensor | None:
        """The validity shaped to broadcast over ``t`` where ``t`` is rows of this selection."""
        if not isinstance(t, torch.Tensor) or self.rows is None or self.rows_of(t) is not self.rows:
            return None
        return self.rows.along(t)

    def _structural(self, name: str, self_ragged: bool) -> Any:
        rows = self.rows
        assert rows is not None
        if name in _COUNTS:  # NOTE: [counts of selected rows]
            counted = counts_of_rows.answer(name, self.args, self.kwargs, self._along, self.compute, self.func)
            if counted is not None:
                return counted
        if not self_ragged and name in ("__getitem__", "index_select", "gather"):
            return self._by_selected_indices(name)
        along = rows_along_other_dims.answer(self, name, self_ragged)  # NOTE: [rows along their other dims]
        if along is not None:
            return None if along is rows_along_other_dims.WRITTEN else along
        if name in ("linear", "matmul", "mm") and self_ragged and len(self.ragged) == 1:
            other = self.args[1] if len(self.args) > 1 else self.kwargs.get("weight")
            ok = self.args[0].dim() >= 2 and isinstance(other, torch.Tensor) and other.dim() <= 2
            return self.keep(self.run()) if ok else _SETTLE
        if name == "gather" and self_ragged:
            dim, index = arg_of(self.args, self.kwargs, 1, "dim"), arg_of(self.args, self.kwargs, 2, "index")
            ok = isinstance(dim, int) and dim % self.args[0].dim() != 0 and self.rows_of(index) is rows
            return self.keep(self.run()) if ok else _SETTLE
        if name in ("cat", "concat", "concatenate", "stack"):
            tensors = self.args[0] if self.args else self.kwargs.get("tensors", ())
            dim = arg_of(self.args, self.kwargs, 1, "dim", 0)
            ok = (isinstance(dim, int) and all(self.rows_of(t) is rows for t in tensors)
                  and dim % (tensors[0].dim() + (name == "stack")) != 0)
            return self.keep(self.run()) if ok else _SETTLE
        if name == "embedding" and self.rows_of(self.args[0]) is rows and len(self.ragged) == 1:
            # max_norm renormalizes, scale_grad_by_freq counts, the rows indexed: kept ones only
            counts = self.kwargs.get("max_norm") is not None or self.kwargs.get("scale_grad_by_freq")
            return _SETTLE if counts or len(self.args) > 2 else self.keep(self.run())
        if name in ("__setitem__", "index_put", "index_put_"):
            return self._write_back(name)
        if name == "einsum":
            return self.keep(self.run()) if self._einsum_keeps_rows() else _SETTLE
        if name == "one_hot" and self_ragged and arg_of(self.args, self.kwargs, 1, "num_classes", -1) > 0:
            return self.keep(self.run())
        if name in ("layer_norm", "rms_norm") and self_ragged and len(self.ragged) == 1:
            shape = arg_of(self.args, self.kwargs, 1, "normalized_shape")
            ok = isinstance(shape, (tuple, list, torch.Size)) and len(shape) < self.args[0].dim()
            return self.keep(self.run()) if ok else _SETTLE
        return _SETTLE

    def _write_back(self, name: str) -> Any:
        """``target[mask] = rows`` with the rows of that mask: each kept row written to
        its own place, the others left as they are. ``index_put_((mask,), rows,
        accumulate)`` is the same write (each position is indexed once, so accumulating
        adds the row there), and ``index_put`` its copy: before 2026-12-06 these settled,
        and a step that spelled ``out[mask] = rows`` so was refused on any mask with a
        false element."""
        rows = self.rows
        assert rows is not None
        if name == "__setitem__":
            if len(self.args) != 3 or self.kwargs:
                return _SETTLE
            target, index, value = self.args[0], _bare_mask(self.args[1]), self.args[2]
            accumulate = False
        else:
            if len(self.args) < 3 or set(self.kwargs) - {"accumulate"}:
                return _SETTLE
            target, indices, value = self.args[:3]
            accumulate = arg_of(self.args, self.kwargs, 3, "accumulate", False)
            if (not isinstance(indices, (tuple, list)) or len(indices) != 1 or not isinstance(accumulate, bool)
                    or not isinstance(value, torch.Tensor) or value.dtype != target.dtype):
                return _SETTLE  # eager's own op (and its errors) for anything else
            index = indices[0]
        if not _is_mask(index) or self.rows_of(value) is not rows or len(self.ragged) != 1:
            return _SETTLE
        k = index.dim()
        if (tuple(target.shape[:k]) != tuple(index.shape) or tuple(value.shape[1:]) != tuple(target.shape[k:])
                or _key_of(self.registry, index) != rows.key):
            return _SETTLE
        flat = target.reshape((-1,) + tuple(target.shape[k:]))
        value = value.to(target.dtype)
        written = torch.where(rows.along(value), value + flat if accumulate else value, flat).reshape(target.shape)
        if name == "index_put":
            return written
        target.copy_(written)
        return target if name == "index_put_" else None

    def _einsum_keeps_rows(self) -> bool:
        """``torch.einsum`` keeps the rows when each operand of rows has the same letter
        for its first dim (``"nd,de->ne"``, ``"nd,nd->n"``), there only, no other
        operand has it, and the output starts with it: every row of the result is from
        the same row of the operands alone. A row dim summed over (``"nd,ne->de"``) or
        moved mixes or counts the rows."""
        args = self.args
        if self.kwargs or not args or not isinstance(args[0], str):
            return False
        operands = list(args[1:])
        if len(operands) == 1 and isinstance(operands[0], (tuple, list)):
            operands = list(operands[0])
        equation = args[0].replace(" ", "")
        inputs, arrow, output = equation.partition("->")
        terms = inputs.split(",")
        if len(terms) != len(operands) or not all(isinstance(t, torch.Tensor) for t in operands):
            return False
        letters = [term.replace("...", "") for term in terms]
        ragged = [i for i, t in enumerate(operands) if self.rows_of(t) is not None]
        firsts = {terms[i][:1] for i in ragged}
        if len(firsts) != 1:
            return False
        (row,) = firsts
        if not row.isalpha():
            return False
        if not arrow:  # the implicit output: the letters used once, in order, ellipsis first
            if "..." in inputs:
                return False
            joined = "".join(letters)
            output = "".join(sorted(c for c in set(joined) if joined.count(c) == 1))
        return (output[:1] == row and output.count(row) == 1
                and all(letters[i].count(row) == (1 if i in ragged else 0) for i in range(len(terms))))

    # -- losses ------------------------------------------------------------------------
    def _loss(self, name: str, self_ragged: bool) -> Any:
        if name in ("cross_entropy", "nll_loss"):
            return self._class_loss()
        if name == "ctc_loss":
            return self._ctc()
        if name in _LOSSES:
            return self._elementwise_loss(name)
        return None

    def _legacy(self) -> bool:
        return self.kwargs.get("size_average") is not None or self.kwargs.get("reduce") is not None

    def _reduce(self, losses: torch.Tensor, reduction: str) -> Any:
        assert self.rows is not None
        if reduction == "none":
            return self.keep(losses)
        total = self._filled(losses, 0).sum()
        if reduction == "sum":
            return total
        if reduction == "batchmean":
            return total / self.rows.count()
        return total / (self.rows.count() * math.prod(losses.shape[1:]))

    def _class_loss(self) -> Any:
        rows = self.rows
        assert rows is not None
        inputs, target = self.args[0], arg_of(self.args, self.kwargs, 1, "target")
        if self._legacy() or len(self.args) > 2 or not isinstance(target, torch.Tensor):
            return _SETTLE
        if self.rows_of(inputs) is not rows or self.rows_of(target) is not rows:
            return _SETTLE
        weight = self.kwargs.get("weight")
        if weight is not None and self.rows_of(weight) is not None:
            return _SETTLE
        reduction = self.kwargs.get("reduction", "mean")
        if target.dtype.is_floating_point:  # class probabilities
            losses = self.run(kwargs={**self.kwargs, "reduction": "none"})
            return self._reduce(losses, "sum" if reduction == "sum" else reduction)
        ignore = self.kwargs.get("ignore_index", -100)
        kept = torch.where(rows.along(target), target, torch.full((), ignore, dtype=target.dtype, device=target.device))
        result = self.run((inputs, kept) + tuple(self.args[2:]), self.kwargs)
        return self.keep(result) if reduction == "none" else result

    def _elementwise_loss(self, name: str) -> Any:
        if self._legacy() or len(self.args) > 2 or not self._broadcast_over_rows():
            return _SETTLE
        reduction = self.kwargs.get("reduction", "mean")
        if reduction not in ("none", "sum", "mean") + (("batchmean",) if name == "kl_div" else ()):
            return _SETTLE
        losses = self.run(kwargs={**self.kwargs, "reduction": "none"})
        return self._reduce(losses, reduction)

    def _ctc(self) -> Any:
        rows = self.rows
        assert rows is not None
        targets = arg_of(self.args, self.kwargs, 1, "targets")
        if len(self.ragged) != 1 or self.rows_of(targets) is not rows or targets.dim() != 1:
            return _SETTLE
        lengths = arg_of(self.args, self.kwargs, 3, "target_lengths")
        if isinstance(lengths, torch.Tensor):
            eager_check(lengths.sum() <= rows.count(), "ctc_loss: target_lengths sum past the concatenated targets")
        # the kept labels first, in order: eager's concatenated targets, then the others
        order = torch.sort((~rows.valid).to(torch.int32), stable=True).indices
        args = list(self.args)
        if len(args) > 1:
            args[1] = targets[order]
            return self.run(tuple(args), self.kwargs)
        return self.run(tuple(args), {**self.kwargs, "targets": targets[order]})


_SOURCES = {"__getitem__", "masked_select", "where", "nonzero", "argwhere"}


def answer(func: Any, args: tuple, kwargs: dict | None, compute: Compute) -> Any:
    """``func(*args, **kwargs)`` while the step is traced, with selected rows kept in
    place (see the NOTE); ``compute`` runs an op the usual way."""
    kwargs = kwargs or {}
    registry = _registry()
    if registry is None or registry.compacting:
        return compute(func, args, kwargs)
    if registry.counted:
        args, kwargs = _compacted(registry, (args, kwargs))
    name = getattr(func, "__name__", "")
    if name in _SOURCES and not any(
        registry.rows.get(t) is not None for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor)
    ):
        kept = _selection(registry, name, args, kwargs)
        if kept is not None:
            return kept
    if name in ("__setitem__", "index_put", "index_put_") and len(args) >= 3:
        mask = _mask_of_indices(registry, args[0], args[1])  # NOTE: [writes by the indices of a mask]
        if mask is not None:
            index = mask if name == "__setitem__" else (mask,)
            return answer(func, (args[0], index, *args[2:]), kwargs, compute)
    if name == "__setitem__" and _write_of_one_row(registry, args, kwargs):
        return None
    if not len(registry.rows):
        return compute(func, args, kwargs)
    one = _Answer(registry, func, args, kwargs, compute)
    if not one.ragged:
        return compute(func, args, kwargs)
    result = one.answer(name)
    if result is _SETTLE:
        settle(one.ragged, use=_op_label(func), advice=_advice(name, args))
        if registry.counted:
            args, kwargs = _compacted(registry, (args, kwargs))
        return compute(func, args, kwargs)
    return result


def _advice(name: str, args: tuple) -> str | None:
    """A form exact for any mask of the op ``name`` whose use settled rows, for the
    refusal's hint: a reduction's (NOTE: [spreads of selected rows]), a count's or a write
    by selected indices' (NOTE: [counts of selected rows])."""
    if name in _REDUCTIONS:
        return row_spreads.REDUCTION_FORMS.get(name)
    if name == "__setitem__" and len(args) > 1 and _is_mask(_bare_mask(args[1])):
        return None  # a write by the mask itself, not by selected indices
    return counts_of_rows.FORMS.get(name)


def _op_label(func: Any) -> str:
    """``torch.Tensor.topk`` for the check's error: which op needed the rows' number."""
    try:
        label = torch.overrides.resolve_name(func) or ""
    except (AttributeError, TypeError):
        label = ""
    label = label or getattr(func, "__qualname__", "") or getattr(func, "__name__", "") or repr(func)
    return label.replace("torch.functional.", "torch.").removesuffix(".__get__")


def _compacted(registry: _Registry, values: Any) -> Any:
    """``values`` with rows settled for a count per row replaced by the kept rows alone,
    each example's in order (NOTE: [rows of one count])."""

    def compact(t: Any) -> Any:
        rows = registry.rows.get(t) if isinstance(t, torch.Tensor) else None
        if rows is None or not rows.settled or rows.per_row is None:
            return t
        kept = registry.compacted.get(t)
        if kept is None:
            # eager's x[mask], below autograd by the decomposition of the mask's decided
            # count: its backward is index_put's scatter into the same positions, which
            # keeps a sharded batch sharded (a gather's backward here would not)
            grid = t.reshape(tuple(rows.mask.shape) + tuple(t.shape[1:]))
            kept = torch.ops.aten.index.Tensor(grid, [rows.mask.to(torch.bool)])
            registry.compacted[t] = kept
        return kept

    registry.compacting = True
    try:
        return pytree.tree_map(compact, values)
    finally:
        registry.compacting = False


def compacted(values: Any) -> Any:
    """``values`` (what the step returns or keeps) as eager has them, after ``settle``."""
    registry = _registry()
    return values if registry is None or not registry.counted else _compacted(registry, values)


def settle(
    values: Sequence[Any], at_selection: bool = False, use: str | None = None, advice: str | None = None
) -> None:
    """The rows among ``values`` become the selection's eager value: their mask selects
    everything, verified every call (NOTE: [selections by a mask of the batch]); the
    check is reported at the line using them, or with ``at_selection`` (rows the step
    returns or keeps) at the selection's line, naming ``use`` (what needs their number) and
    ``advice`` (a form exact for any mask: NOTE: [spreads of selected rows])."""
    registry = _registry()
    if registry is None:
        return
    for t in pytree.tree_leaves(list(values)):
        rows = registry.rows.get(t) if isinstance(t, torch.Tensor) else None
        if rows is not None and not rows.settled:
            with located(rows.where if at_selection else None):
                rows.per_row = mask_selections.settle_selection(rows.mask, rows.where, use, advice)
            rows.settled = True
            registry.counted |= rows.per_row is not None


@contextlib.contextmanager
def custom_functions_settle() -> Iterator[None]:
    """Inside: a custom ``autograd.Function`` given rows gets eager's value (its
    ``apply`` is not a torch function: a mode sees only the ops inside its forward, and
    its own backward would see the dropped rows)."""
    original = torch.autograd.Function.__dict__["apply"]

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        settle([args, kwargs], use=f"{cls.__name__}.apply")
        # a classmethod on 2.13, a C classmethod_descriptor (no __func__) on 2.14
        return original.__get__(None, cls)(*args, **kwargs)

    torch.autograd.Function.apply = classmethod(apply)  # type: ignore[assignment, method-assign]
    try:
        yield
    finally:
        torch.autograd.Function.apply = original  # type: ignore[method-assign]


__all__ = ["answer", "compacted", "custom_functions_settle", "settle"]
