"""Selections by a mask of the batch: compiled for the mask that selects everything.

NOTE: [selections by a mask of the batch]
(``x[mask]``, ``masked_select``, ``where(mask)``, ``nonzero`` and ``argwhere`` whose rows
end in a loss or a reduction are answered first, exactly for any mask, by NOTE: [selected
rows kept in place] in ``selected_rows.py``; what follows is for the other uses.)
``torch.nonzero(mask)``, a boolean index ``x[mask]``, ``torch.where(mask)`` and
``x.masked_select(mask)`` have one row per true element of the mask: a size the data
decides, which a compiled program, with fixed shapes, cannot have. A step meets them on
masks that hold for every example of a clean batch: DeBERTa's classification loss (its
default) selects the labelled rows with ``(labels >= 0).nonzero()`` and gathers them.

- A mask computed from the step's inputs alone (the batch; no parameter, buffer,
  gradient or optimizer state among what it is computed from) is compiled as all true:
  ``nonzero`` is every index, in the order torch gives them (row-major), a boolean index
  selects every element. ``mask.all()`` is a value check (NOTE: [value checks] in
  ``value_checks.py``), verified every call before any state is written: a call whose
  mask holds a false element raises ``SPMDRuntimeError`` naming the line, and nothing is
  updated. The result never depends on a guess: the program runs only on masks it is
  exact for.
- A mask computed from the model (mixture-of-experts routing, ``torch.where(choice ==
  e)`` with ``choice`` from a gate) changes as the model trains, and is never all true
  for routing: it stays refused at capture as a value-dependent shape, naming the line.
- A real constant mask (made from Python values in the step) is torch's own: its value
  is known, the trace computes it.
- One decision per mask tensor per trace: the backward of ``x[mask]`` reads the same
  mask again and is not asked twice; its ``index_put`` takes the mask's every index too
  (torch 2.11's DTensor gave a boolean-indexed ``index_put`` the global mask beside a
  local tensor). A boolean-indexed write on a mask not selected by a read (``x[mask] =
  0``: a fixed size) is torch's own.

``masked_scatter`` (a vision-language model writing image features into the embeddings at
the image tokens; the backward of ``masked_select``) has a fixed size but no DTensor rule:
it is written here in plain ops, for any mask. Each true element takes the source element
at its rank among the true elements (a ``cumsum`` of the mask), and its backward adds the
gradient back from those positions.

The other way, a mask with false elements on the batch (padding), cannot be one program
of fixed shapes; the error says to write the selection with fixed shapes (``masked_fill``,
``torch.where(mask, x, 0)``, a loss's ``ignore_index``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .. import _torch_private as private
from ..ir.graph_utils import placeholders_read_by
from ..ir.signature import STATE_KINDS, StateRef

aten = torch.ops.aten


class MaskWithFalseElements(Exception):
    """The trace of a selection by a mask whose elements are not all true (the other
    answer of the value check): its size would depend on the values."""

    def __init__(self) -> None:
        super().__init__(
            "the mask has false elements; its selection (nonzero, x[mask], ...) is used "
            "where its size matters (indices, row count, rows returned), compiled for a "
            "mask that selects everything. Select with fixed shapes: masked_fill, "
            "torch.where(mask, x, 0), a loss's ignore_index"
        )


class _Selections:
    """The trace's state: which graph inputs are state, and the masks decided."""

    def __init__(self, refs: list[StateRef]) -> None:
        self.refs = refs
        self.decided: set[torch.fx.Node] = set()
        self._state_inputs: set[torch.fx.Node] | None = None

    def state_inputs(self, graph: torch.fx.Graph) -> set[torch.fx.Node]:
        """The graph's placeholders that are program state (read once per trace: the
        placeholders are all there before the step runs)."""
        if self._state_inputs is None:
            inputs = [n for n in graph.nodes if n.op == "placeholder"]
            self._state_inputs = {
                n for n, ref in zip(inputs, self.refs, strict=False) if ref.kind in STATE_KINDS
            }
        return self._state_inputs


_ACTIVE: list[_Selections] = []
# lines of the rows compiled as all true by the traces of this capture (every answer of
# its value checks), for a failed capture's error
_SETTLED: list[str] = []


@contextmanager
def mask_selections(refs: list[StateRef]) -> Iterator[None]:
    """While the step is traced on ``refs`` (the graph inputs, in order): selections by a
    mask of the batch are compiled as all true (see the NOTE)."""
    _ACTIVE.append(_Selections(refs))
    try:
        yield
    finally:
        _ACTIVE.pop()


def forget_settled() -> None:
    """A capture begins: no selection of its traces compiled as all true yet."""
    _SETTLED.clear()


def settled_in_capture() -> str:
    """For a failed capture's error: the selections its traces compiled as all true, as a
    sentence ('' when none), since a size error after one comes from that assumption."""
    if not _SETTLED:
        return ""
    lines = ", ".join(dict.fromkeys(_SETTLED))
    return (
        f". Note: the rows selected by a mask at {lines} were traced as if the mask selected "
        "every element, since their number is used (NOTE: [selections by a mask of the "
        "batch]); a size error here is that assumption: a size that must equal the number "
        "of selected rows cannot be compiled"
    )


def _computed_from_state(node: torch.fx.Node, selections: _Selections) -> bool:
    """``node`` reads, through any chain of ops, a graph input that is program state."""
    return bool(placeholders_read_by(node) & selections.state_inputs(node.graph))


def active() -> _Selections | None:
    """The selections of the step being traced, if any."""
    return _ACTIVE[-1] if _ACTIVE else None


def traced(mask: torch.Tensor) -> bool:
    """A mask the step's trace computed (not a real constant)."""
    if not _ACTIVE or private.is_real_tensor_constant(mask):
        return False
    return private.traced_node_of(mask) is not None


class RowsOfAModelMaskCounted(Exception):
    """Rows selected by a mask computed from the model's state, used where their number
    matters: a value-dependent shape (refused at capture)."""


def settle_selection(mask: torch.Tensor, where: str | None = None) -> None:
    """A selection by ``mask`` (made at ``where``) whose rows were kept in place (NOTE:
    [selected rows kept in place]) used where only the eager value will do: compiled as
    all true, verified every call, for a mask of the batch; refused at capture as a
    value-dependent shape for a mask computed from the model's state."""
    if _selects_everything(mask):
        _SETTLED.append(where or "an unknown line")
        return
    raise RowsOfAModelMaskCounted(
        f"the rows selected at {where or 'an unknown line'} by a mask computed from the "
        "model are used where their number matters"
    )


def _selects_everything(mask: torch.Tensor) -> bool:
    """Whether this selection is compiled as all true: False when torch's own op must
    run (no trace of ours, a real constant, a mask computed from state)."""
    if not _ACTIVE or private.is_real_tensor_constant(mask):
        return False
    selections = _ACTIVE[-1]
    node = private.traced_node_of(mask)
    if node is None or _computed_from_state(node, selections):
        return False
    if node in selections.decided:
        return True
    # the value check (NOTE: [value checks]): answered by the trace's decisions
    if not bool(mask.all()):
        raise MaskWithFalseElements()
    selections.decided.add(node)
    return True


def every_index(shape: torch.Size, device: torch.device) -> torch.Tensor:
    """``torch.nonzero`` of an all-true tensor of ``shape``: (numel, ndim), row-major."""
    if len(shape) == 0:
        return torch.zeros((1, 0), dtype=torch.long, device=device)
    grids = torch.meshgrid(
        *[torch.arange(n, device=device) for n in shape], indexing="ij"
    )
    return torch.stack([g.reshape(-1) for g in grids], dim=1)


def _nonzero(mask: torch.Tensor) -> Any:
    if not _selects_everything(mask):
        return NotImplemented
    return every_index(mask.shape, mask.device)


def _is_mask(index: torch.Tensor | None) -> bool:
    return index is not None and index.dtype in (torch.bool, torch.uint8)


def _masks_as_every_index(
    indices: list[torch.Tensor | None],
    convert: Callable[[torch.Tensor], bool],
    all_or_none: bool,
) -> list[torch.Tensor | None] | None:
    """``indices`` with each boolean mask that ``convert`` accepts replaced by its every
    index; a mask it refuses stays as it is, or, with ``all_or_none``, leaves everything
    to torch. None when nothing was replaced."""
    converted: list[torch.Tensor | None] = []
    changed = False
    for i in indices:
        if i is None or not _is_mask(i):
            converted.append(i)
        elif convert(i):
            converted.extend(every_index(i.shape, i.device).unbind(1))
            changed = True
        elif all_or_none:
            return None
        else:
            converted.append(i)
    return converted if changed else None


def _decided(mask: torch.Tensor) -> bool:
    """The mask was compiled as all true by a read earlier in this trace."""
    return bool(_ACTIVE) and private.traced_node_of(mask) in _ACTIVE[-1].decided


def _index(x: torch.Tensor, indices: list[torch.Tensor | None]) -> Any:
    converted = _masks_as_every_index(indices, _selects_everything, all_or_none=True)
    return NotImplemented if converted is None else aten.index.Tensor(x, converted)


def _index_put_as(op: Any, x, indices, values, accumulate=False, unsafe=False):  # noqa: ANN001, ANN202
    """``index_put`` / ``index_put_`` / ``_index_put_impl_`` (the backward of ``x[mask]``)
    on a mask a read compiled as all true: by its every index."""
    converted = _masks_as_every_index(indices, _decided, all_or_none=False)
    return NotImplemented if converted is None else op(x, converted, values, accumulate)


def _masked_select(x: torch.Tensor, mask: torch.Tensor) -> Any:
    if not _selects_everything(mask):
        return NotImplemented
    x, mask = torch.broadcast_tensors(x, mask)
    return x.reshape(-1)


def _source_positions(mask: torch.Tensor, source_numel: int) -> torch.Tensor:
    """For each element of the (flat) mask: the source element a true one takes."""
    taken = mask.reshape(-1).to(torch.long).cumsum(0) - 1
    return taken.clamp(min=0, max=max(source_numel - 1, 0))


def _masked_scatter(x: torch.Tensor, mask: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    x, mask = torch.broadcast_tensors(x, mask)
    if source.numel() == 0:  # no element can be true (torch checks the count)
        return x.clone()
    flat = mask.reshape(-1)
    values = source.reshape(-1)[_source_positions(flat, source.numel())]
    return torch.where(flat, values, x.reshape(-1)).reshape(x.shape)


def _masked_scatter_(x: torch.Tensor, mask: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    return x.copy_(_masked_scatter(x, mask, source))


def _masked_scatter_backward(
    grad: torch.Tensor, mask: torch.Tensor, sizes: list[int]
) -> torch.Tensor:
    """The source's gradient: source element ``k`` takes the gradient of the element
    holding the (k+1)-th true value (a search in the mask's running count), 0 past the
    count. A gather: no accumulation (torch 2.11's ``index_put`` rule mis-shards one)."""
    numel = math.prod(sizes)
    grad, mask = torch.broadcast_tensors(grad, mask)
    flat_grad = grad.reshape(-1)
    if flat_grad.numel() == 0 or numel == 0:
        return grad.new_zeros(sizes)
    counts = mask.reshape(-1).to(torch.long).cumsum(0)
    wanted = torch.arange(1, numel + 1, device=grad.device)
    holder = torch.searchsorted(counts, wanted).clamp(max=flat_grad.numel() - 1)
    zero = torch.zeros((), dtype=grad.dtype, device=grad.device)
    return torch.where(wanted <= counts[-1:], flat_grad[holder], zero).reshape(sizes)


def mask_selection_decompositions() -> dict[Any, Callable[..., Any]]:
    """The capture decompositions of the NOTE."""
    return {
        aten.nonzero.default: _nonzero,
        aten.index.Tensor: _index,
        aten.masked_select.default: _masked_select,
        aten.index_put.default: functools.partial(_index_put_as, aten.index_put.default),
        aten.index_put_.default: functools.partial(_index_put_as, aten.index_put_.default),
        aten._index_put_impl_.default: functools.partial(_index_put_as, aten.index_put_.default),
        aten.masked_scatter.default: _masked_scatter,
        aten.masked_scatter_.default: _masked_scatter_,
        aten.masked_scatter_backward.default: _masked_scatter_backward,
    }


__all__ = [
    "MaskWithFalseElements", "RowsOfAModelMaskCounted", "active", "every_index", "traced",
    "mask_selection_decompositions", "mask_selections", "settle_selection",
    "forget_settled", "settled_in_capture",
]
