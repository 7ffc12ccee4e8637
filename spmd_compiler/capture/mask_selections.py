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
  local tensor). A boolean-indexed write of one value on a mask not selected by a read
  (``x[mask] = 0``: a fixed size) is a ``torch.where`` (NOTE: [mask writes of one
  value]); one of rows is torch's own.

``masked_scatter`` (a vision-language model writing image features into the embeddings at
the image tokens; the backward of ``masked_select``) has a fixed size but no DTensor rule:
it is written here in plain ops, for any mask. Each true element takes the source element
at its rank among the true elements (a ``cumsum`` of the mask), and its backward adds the
gradient back from those positions.

NOTE: [rows of one count]
Masked pretraining keeps the same number of elements of every example: VideoMAE's
``x[~bool_masked_pos].reshape(batch_size, -1, C)``, an MAE-style mask of a fixed ratio.
The selection is then of a fixed size after all, ``B * K`` rows for ``K`` true elements
per example, and its rows are each example's, in order. Where capture can read the mask's
value (a mask computed from the step's tensor arguments alone, with no random draw: the
subgraph computing it runs on the real arguments, in the capture, apart from the trace)
and finds one count ``K`` in every row along the first dim (0 < K < the row's size),
the selection is compiled for that count:

- ``x[mask]`` (a mask over ``x``'s leading dims) is each row's true positions in order
  (a stable sort of the row's mask) gathered along the row: ``(B * K, *rest)``, a view of
  the batch, so a batch sharded on its first dim stays sharded; ``masked_select``,
  ``nonzero`` / ``torch.where(mask)`` and the backward's ``index_put`` (a scatter into
  the same positions) likewise; rows kept in place (NOTE: [selected rows kept in place])
  that settle are compacted the same way. Where a release's DTensor ``scatter`` rule
  replicates every operand (torch 2.11), a write of rows is ``scatter_add`` into zeros
  and a ``where`` instead (``_written``): the same values, the batch kept sharded.
- The count is a value check (NOTE: [value checks]): every call verifies that every row
  of the mask holds ``K`` true elements, before any state is written; a call where one
  does not raises ``SPMDRuntimeError`` naming the line, and nothing is updated.
- On real ranks each rank reads its own share of the batch: the ranks agree on ``K`` (an
  all-reduce of the count during capture; ranks that disagree compile the mask as all
  true, which the check then refuses), so every rank compiles the same program. A step
  whose capture read a count has no cache entry before capture (every rank captures).

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
from ..ir.graph_utils import ancestors
from ..ir.signature import STATE_KINDS, Kind, StateRef
from .value_checks import own_check, where_now

aten = torch.ops.aten


class MaskWithFalseElements(Exception):
    """The trace of a selection by a mask whose elements are not all true (the other
    answer of the value check): its size would depend on the values."""

    def __init__(self, per_row: int | None = None, use: str | None = None, advice: str | None = None) -> None:
        compiled = (
            "a mask that selects everything" if per_row is None
            else f"{per_row} true elements in every row along its first dim, the count "
            "read from the arguments at capture (NOTE: [rows of one count])"
        )
        what = "has false elements" if per_row is None else f"does not hold {per_row} in every row"
        # a reduction of the selection with a form exact for any mask: that form
        # (NOTE: [spreads of selected rows])
        hint = (
            f"{use or 'This reduction'} of a mask selection is compiled only for masks with no "
            f"false element; for any mask write {advice}" if advice else
            "Select with fixed shapes: masked_fill, torch.where(mask, x, 0), a loss's ignore_index; "
            f"for indices (a count, a confusion matrix) write {INDEX_FORM}"
        )
        super().__init__(
            f"the mask {what}; its selection (nonzero, x[mask], ...) is used "
            f"where its size matters ({'by ' + use if use else 'indices, row count, rows returned'}), compiled for "
            f"{compiled}. {hint}"
            + (_CONCATENATED_ROWS if use == "torch.cat" else "")
        )


# The fixed-shape form of selected indices: ``torch.where(mask, i, 0)`` alone sends every
# dropped element to index 0 (a confusion matrix then counts the ignored pixels in
# ``cm[0, 0]``); their value must be zero too (NOTE: [counts of selected rows])
INDEX_FORM = (
    "the dropped elements at a valid index with a zero value: `cm.index_put_((torch.where(mask, "
    "y, 0), torch.where(mask, p, 0)), mask.to(cm.dtype), accumulate=True)`, `t.index_add_(0, "
    "torch.where(mask, i, 0), torch.where(mask, v, 0))` (torch.where(mask, i, 0) alone counts "
    "every dropped element at index 0)"
)


# NOTE: [selections concatenated row by row]
# ESPnet's and SpeechBrain's CTC targets are each row's selection, concatenated:
# ``torch.cat([y[y != ignore] for y in ys_pad])``. Each row's selection is settled by
# ``torch.cat`` and refused on the first batch with padding, and the advice (masked_fill,
# torch.where, ignore_index) cannot apply to ctc_loss's targets. The same selection made
# over the whole batch at once, ``ys_pad[ys_pad != ignore]``, reaches ctc_loss kept in
# place (NOTE: [selected rows kept in place]) and compiles exactly (NOTE: [CTC loss at
# capture]); the refusal of a selection used by torch.cat names that form, and padded
# 2-D targets.
_CONCATENATED_ROWS = (
    "; selections of each row concatenated (CTC targets: `torch.cat([y[y != ignore] for "
    "y in ys_pad])`) compile as one selection over the whole batch, "
    "`ys_pad[ys_pad != ignore]`, which gives the same targets in the same order, or "
    "as ctc_loss's padded 2-D targets (`ys_pad` itself, with the target lengths)"
)


# A mask's decision: every element selected, or K (> 0) in every row (NOTE: [rows of one
# count]), or its own value, a constant (NOTE: [masks made from shapes alone])
EVERY = -1
CONSTANT = -2


class _Selections:
    """The trace's state: which graph inputs are state, and the masks decided."""

    def __init__(
        self, refs: list[StateRef], real_input: Callable[[int], torch.Tensor] | None = None
    ) -> None:
        self.refs = refs
        self.real_input = real_input  # the real tensor of INPUT k (NOTE: [rows of one count])
        self.decided: dict[torch.fx.Node, int] = {}
        self.constants: dict[torch.fx.Node, torch.Tensor] = {}  # the real masks of CONSTANT
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
# lines whose mask's count was read in this capture (NOTE: [rows of one count])
_COUNTED: list[str] = []


@contextmanager
def mask_selections(
    refs: list[StateRef], real_input: Callable[[int], torch.Tensor] | None = None
) -> Iterator[None]:
    """While the step is traced on ``refs`` (the graph inputs, in order): selections by a
    mask of the batch are compiled as all true, or for one count per row read from the
    real arguments (``real_input(k)``: INPUT ``k``) (see the NOTEs)."""
    _ACTIVE.append(_Selections(refs, real_input))
    try:
        yield
    finally:
        _ACTIVE.pop()


def forget_settled() -> None:
    """A capture begins: no selection of its traces compiled as all true yet."""
    _SETTLED.clear()
    _COUNTED.clear()


def counted_in_capture() -> list[str]:
    """The lines whose mask's count per row this capture read (NOTE: [rows of one count])."""
    return list(dict.fromkeys(_COUNTED))


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


# NOTE: [masks shaped like the model's tensors]
# ``torch.zeros_like(logits).scatter_(1, y[:, None], 1) == 1`` (AdaCos' target-class mask)
# takes only ``logits``' shape, dtype and device, never its values: the ``*_like`` and
# ``new_*`` factories below read nothing else of their first argument, and the program's
# shapes are fixed. Before the sixty-fourth session the walk from a mask to the graph
# inputs it is computed from went through that argument, so the mask counted as computed
# from the model and ``torch.median(theta[mask])`` was refused as rows of a model mask
# used by their number, while the same mask written ``F.one_hot(y, C) == 1`` compiled
# (one true element per row, NOTE: [rows of one count]) and matched eager. The walk
# (``_value_ancestors``) skips that argument; where the mask's real value is computed
# (``_real_value``) the factory runs on a stand-in of the argument's traced shape, dtype
# and device, only where every argument it reads has its traced shape (on real ranks a
# batch sharded by the mode does not, and such a mask is compiled as all true, checked
# every call: refused on a call with false elements, never a guess).
_SHAPED_LIKE = frozenset({
    aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default,
    aten.full_like.default, aten.new_zeros.default, aten.new_ones.default,
    aten.new_empty.default, aten.new_full.default,
})


def _shape_only_source(n: torch.fx.Node) -> torch.fx.Node | None:
    """The argument whose shape alone ``n`` reads (NOTE: [masks shaped like the model's
    tensors]), or None."""
    if n.op == "call_function" and n.target in _SHAPED_LIKE and n.args and isinstance(n.args[0], torch.fx.Node):
        return n.args[0]
    return None


def _value_ancestors(node: torch.fx.Node) -> set[torch.fx.Node]:
    """``node`` and every node whose values it is computed from: ``ancestors`` but for the
    argument of a ``*_like`` factory (NOTE: [masks shaped like the model's tensors])."""
    return ancestors(node, _shape_only_source)


def _inputs_read(node: torch.fx.Node) -> set[torch.fx.Node]:
    """The graph inputs whose values ``node`` is computed from."""
    return {n for n in _value_ancestors(node) if n.op == "placeholder"}


def _computed_from_state(node: torch.fx.Node, selections: _Selections) -> bool:
    """``node`` reads, through any chain of ops, the values of a graph input that is
    program state (a ``*_like`` factory reads only its argument's shape)."""
    return bool(_inputs_read(node) & selections.state_inputs(node.graph))


def active() -> _Selections | None:
    """The selections of the step being traced, if any."""
    return _ACTIVE[-1] if _ACTIVE else None


def traced(mask: torch.Tensor) -> bool:
    """A mask the step's trace computed (not a real constant)."""
    if not _ACTIVE or private.is_real_tensor_constant(mask):
        return False
    return private.traced_node_of(mask) is not None


class RowsThatCannotFit(Exception):
    """``x[mask] = rows`` with rows of another count than the compiled selection's
    (NOTE: [rows written by a mask that cannot fit]): refused at capture."""


class RowsOfAModelMaskCounted(Exception):
    """Rows selected by a mask computed from the model's state, used where their number
    matters: a value-dependent shape (refused at capture)."""


# NOTE: [advice for rows of a model mask counted]
# The refusal of ``RowsOfAModelMaskCounted`` said only mixture-of-experts routing
# (``y[mask] += expert(h[mask]) * gate[mask]``), also to a metric-learning loss taking
# the median of its selected angles or pytorch-metric-learning's default reducer counting
# its losses (``len(losses)`` in ``threshold_reducer.py``). The hint names the
# fixed-shape form of each use: a count, one element per row, a statistic over the
# selection, routed experts; where a frame of the traceback is in that library's
# ``reducers``, the reducer that averages every loss.
_MODEL_MASK_HINT = (
    "keep the rows in place and combine with the mask instead of indexing by what it "
    "selects: a count is `mask.sum()` (not `len(x[mask])` or `x[mask].shape[0]`), a mean "
    "`(x * mask).sum() / mask.sum().clamp(min=1)`; one element per row is "
    "`x.gather(1, index[:, None])`; a median or another statistic over the selection is "
    "taken with the others set to NaN, `torch.nanmedian(torch.where(mask, x, float('nan')))`; "
    "routed experts: `y[mask] += expert(h[mask]) * gate[mask]` or "
    "`torch.where(mask[..., None], expert(h), 0)`. A mask built from the "
    "labels and shapes alone (`F.one_hot(y, C) == 1`, `torch.zeros_like(x).scatter_(...)`) "
    "compiles as it is; losses and sums over the selected rows work as they are."
)
_PML_REDUCER_HINT = (
    "pytorch-metric-learning's default reducer for this loss (a ThresholdReducer such as "
    "AvgNonZeroReducer) counts the losses past its threshold with `len(losses)`, a number "
    "the model decides: pass `reducer=reducers.MeanReducer()` to the loss (`from "
    "pytorch_metric_learning import reducers`), which compiles; it averages every loss, "
    "zeros included, where the default averages the non-zero ones."
)


def model_mask_hint(tb: Any) -> str:
    """The hint for ``RowsOfAModelMaskCounted`` raised with traceback ``tb`` (NOTE: [advice
    for rows of a model mask counted])."""
    import traceback

    for frame, _ in traceback.walk_tb(tb):
        path = frame.f_code.co_filename.replace("\\", "/")
        if "/pytorch_metric_learning/reducers/" in path:
            return _PML_REDUCER_HINT
    return _MODEL_MASK_HINT


def settle_selection(
    mask: torch.Tensor, where: str | None = None, use: str | None = None, advice: str | None = None
) -> int | None:
    """A selection by ``mask`` (made at ``where``) whose rows were kept in place (NOTE:
    [selected rows kept in place]) used where only the eager value will do: compiled as
    all true (None) or for ``K`` true elements per row (returned; NOTE: [rows of one
    count]), verified every call, for a mask of the batch; as the mask's own value
    (``CONSTANT`` returned) for a mask made from shapes and Python values alone (NOTE:
    [masks made from shapes alone]); refused at capture as a value-dependent shape for a
    mask computed from the model's state. ``use`` (the op that needs the rows' number)
    is named by the check's error, and ``advice`` (a form exact for any mask) given as its hint."""
    decision = _decide(mask, use, advice)
    if decision == CONSTANT:  # NOTE: [masks made from shapes alone]: its own count
        return CONSTANT
    if decision is not None:
        _SETTLED.append(where or "an unknown line")
        return None if decision == EVERY else decision
    raise RowsOfAModelMaskCounted(
        f"the rows selected at {where or 'an unknown line'} by a mask computed from the "
        f"model's state{_state_read(mask)} are used where their number matters"
        + (f" (by {use})" if use else "")
    )


# NOTE: [where a model mask comes from]
# The refusal said "a mask computed from the model" and nothing more, also where the mask
# is the batch compared with a number and the model enters only as a buffer of indices
# (a spline coupling's ``x[:, self.idx_tr]``: the probe read it as a mask of the batch).
# It names the state the mask is computed from (a buffer, a parameter), a few at most,
# and the op that needed the rows' number.
def _state_read(mask: torch.Tensor) -> str:
    """`` (it reads buffer c.0.idx_tr)``: the program state ``mask`` is computed from."""
    node = private.traced_node_of(mask)
    if not _ACTIVE or node is None:
        return ""
    selections = _ACTIVE[-1]
    placeholders = [n for n in node.graph.nodes if n.op == "placeholder"]
    read = _inputs_read(node) & selections.state_inputs(node.graph)
    names = [str(ref) for n, ref in zip(placeholders, selections.refs, strict=False) if n in read]
    if not names:
        return ""
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return f" (it reads {', '.join(names[:3])}{more})"


def _refuse_a_model_mask(mask: torch.Tensor) -> None:
    """A selection by a mask computed from the model that reaches torch's own op (its rows
    were not kept in place: a selection of rows already selected, ``sel[conf > t]``, or
    indices used as they are): refused as the rows of such a mask used by their number,
    with the advice to combine with the mask, not torch's raw error on ``nonzero``."""
    if not _ACTIVE or private.is_real_tensor_constant(mask):
        return
    node = private.traced_node_of(mask)
    if node is not None and _computed_from_state(node, _ACTIVE[-1]):
        raise RowsOfAModelMaskCounted(
            "a selection by a mask computed from the model has one row per true element, a "
            "number the model decides, and these rows cannot be kept in place beside the "
            "mask (as for rows selected from rows already selected; NOTE: [selected rows "
            "kept in place])"
        )


def _selects_everything(mask: torch.Tensor) -> bool:
    """Whether this selection is compiled as all true (or as the mask's constant value):
    False when torch's own op must run (no trace of ours, a real constant, a mask
    computed from state) or the mask was compiled for a count per row."""
    return _decide(mask) in (EVERY, CONSTANT)


def _decide(mask: torch.Tensor, use: str | None = None, advice: str | None = None) -> int | None:
    """How this selection is compiled: ``EVERY`` element, ``K`` per row, or None when
    torch's own op must run (see ``_selects_everything``)."""
    if not _ACTIVE or private.is_real_tensor_constant(mask):
        return None
    selections = _ACTIVE[-1]
    node = private.traced_node_of(mask)
    if node is None or _computed_from_state(node, selections):
        return None
    if node in selections.decided:
        return selections.decided[node]
    if not _inputs_read(node):
        # NOTE: [masks made from shapes alone]
        # A mask the trace computed from no input at all (factories, shapes and Python
        # values: ``torch.combinations`` selects the upper triangle of an index grid) is a
        # constant of the program: its value, computed apart from the trace, answers the
        # selection exactly. Before 2026-12-02 such a mask was compiled as all true, and
        # the value check failed on every call. Rows it selects that were kept in place
        # (NOTE: [selected rows kept in place]) and then used where their number matters
        # (SimCLR's ``labels[~torch.eye(2 * n, dtype=torch.bool)].view(2 * n, -1)``) are
        # its selection by these indices: the count is the constant's, the same on every
        # call with these shapes (``settle_selection`` returns CONSTANT and the rows are
        # compacted). Before the sixty-third session they were refused as a value-dependent shape.
        real = _real_value(node, selections)
        if real is not None:
            selections.constants[node] = real
            selections.decided[node] = CONSTANT
            return CONSTANT
    per_row = _count_per_row(mask, node, selections)
    # the value check (NOTE: [value checks]): answered by the trace's decisions
    # decided on the spot (NOTE: [checks of this package decided on the spot])
    if per_row is not None:
        counts = (mask.reshape(mask.shape[0], -1) != 0).sum(1)
        with own_check(lambda: MaskWithFalseElements(per_row, use, advice)):
            holds = bool((counts == per_row).all())
        if not holds:
            raise MaskWithFalseElements(per_row, use, advice)
        _COUNTED.append(where_now() or "an unknown line")
    else:
        with own_check(lambda: MaskWithFalseElements(use=use, advice=advice)):
            holds = bool(mask.all())
        if not holds:
            raise MaskWithFalseElements(use=use, advice=advice)
    decision = EVERY if per_row is None else per_row
    selections.decided[node] = decision
    return decision


def _count_per_row(mask: torch.Tensor, node: torch.fx.Node, selections: _Selections) -> int | None:
    """K when the real mask holds K true elements in every row along its first dim, with
    0 < K < the row's size, agreed by every rank; None otherwise (NOTE: [rows of one
    count])."""
    if mask.dim() < 2 or mask.shape[0] == 0 or selections.real_input is None:
        return None
    row = math.prod(mask.shape[1:])
    local = -1
    real = _real_value(node, selections)
    if real is not None and real.dim() == mask.dim() and tuple(real.shape[1:]) == tuple(mask.shape[1:]):
        with private.outside_the_trace():  # real tensors: nothing of this is traced
            counts = (real.reshape(real.shape[0], -1) != 0).sum(1)
            if counts.numel() and bool((counts == counts[0]).all()) and 0 < int(counts[0]) < row:
                local = int(counts[0])
    agreed = _agreed_by_every_rank(local, real.device if real is not None else mask.device)
    return agreed if agreed > 0 else None


def _agreed_by_every_rank(value: int, device: torch.device) -> int:
    """``value`` when every real rank read the same one, else -1 (simulated ranks read
    the global batch: no round)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1 or private.is_fake_process_group():
        return value
    with private.outside_the_trace():  # real tensors: read them before the trace resumes
        both = torch.tensor([value, -value], dtype=torch.int64, device=device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        most, least = int(both[0]), -int(both[1])
    return value if most == least == value else -1


def _real_value(node: torch.fx.Node, selections: _Selections) -> torch.Tensor | None:
    """``node``'s value on the real arguments: the part of the trace computing it run
    eagerly, apart from the trace; None when it reads anything but the step's tensor
    arguments, draws random numbers or fails."""
    needed = _value_ancestors(node)
    inputs = [n for n in node.graph.nodes if n.op == "placeholder"]
    env: dict[torch.fx.Node, Any] = {}
    for n, ref in zip(inputs, selections.refs, strict=False):
        if n in needed:
            if ref.kind is not Kind.INPUT or selections.real_input is None:
                return None
            env[n] = selections.real_input(ref.index)
    # a ``*_like`` factory of a tensor not computed here runs on a stand-in of its traced
    # shape, only where every argument read has its traced shape (NOTE: [masks shaped
    # like the model's tensors])
    stand_ins = {s for n in needed if (s := _shape_only_source(n)) is not None and s not in needed}
    if stand_ins and not all(
        isinstance(v, torch.Tensor) and isinstance(n.meta.get("val"), torch.Tensor)
        and tuple(v.shape) == tuple(n.meta["val"].shape) for n, v in env.items()
    ):
        return None
    for n in needed:
        if n.op == "get_attr":  # a constant of the step (``torch.tensor([...])``): guarded
            # where it came from outside (NOTE: [tensors read from outside the arguments])
            env[n] = private.trace_constant(n)
            if not isinstance(env[n], torch.Tensor):
                return None
    try:
        with private.outside_the_trace():
            for n in stand_ins:
                fake = n.meta["val"]
                env[n] = torch.zeros(tuple(fake.shape), dtype=fake.dtype, device=fake.device)
            for n in node.graph.nodes:
                if n not in needed or n.op in ("placeholder", "get_attr"):
                    continue
                if n.op != "call_function" or private.random_op(n.target):
                    return None
                args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: env[a])
                env[n] = n.target(*args, **kwargs)
                if n is node:
                    break
    except Exception:  # noqa: BLE001 - a mask this cannot compute is compiled as all true
        return None
    value = env.get(node)
    return value if isinstance(value, torch.Tensor) else None


def row_positions(mask: torch.Tensor, per_row: int) -> torch.Tensor:
    """``(B, K)``: the positions of each row's true elements, in order (the row is the
    mask flattened past its first dim)."""
    flat = mask.reshape(mask.shape[0], -1).to(torch.bool)
    return torch.sort((~flat).to(torch.int32), dim=1, stable=True).indices[:, :per_row]


def _by_example(rows: torch.Tensor, mask: torch.Tensor, per_row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` (``(mask.numel(), *rest)``) as ``(B, row, *rest)``, and the index of each
    example's true rows along dim 1, ``(B, K, *rest)``."""
    b, rest = mask.shape[0], tuple(rows.shape[1:])
    index = row_positions(mask, per_row).reshape((b, per_row) + (1,) * len(rest))
    return rows.reshape((b, -1) + rest), index.expand((b, per_row) + rest)


def compact_rows(rows: torch.Tensor, mask: torch.Tensor, per_row: int) -> torch.Tensor:
    """``rows`` (``(mask.numel(), *rest)``, one per element of ``mask``) with the rows of
    the true elements kept, each example's in order: ``(B * K, *rest)``."""
    grid, index = _by_example(rows, mask, per_row)
    return grid.gather(1, index).reshape((-1,) + tuple(grid.shape[2:]))


def every_index(shape: torch.Size, device: torch.device) -> torch.Tensor:
    """``torch.nonzero`` of an all-true tensor of ``shape``: (numel, ndim), row-major."""
    if len(shape) == 0:
        return torch.zeros((1, 0), dtype=torch.long, device=device)
    grids = torch.meshgrid(
        *[torch.arange(n, device=device) for n in shape], indexing="ij"
    )
    return torch.stack([g.reshape(-1) for g in grids], dim=1)


def _constant_indices(mask: torch.Tensor, size: int | None = None, fill_value: int = -1) -> torch.Tensor:
    """``torch.nonzero`` of a mask decided CONSTANT (``nonzero_static`` with ``size``):
    made in the trace from its values, as ``torch.tensor([...])`` written in the step is
    (a constant of the program)."""
    real = _ACTIVE[-1].constants[private.traced_node_of(mask)]  # type: ignore[index]
    with private.outside_the_trace():
        values = torch.nonzero(real.expand(mask.shape)).tolist()
    if size is not None:
        values = values[:size] + [[fill_value] * mask.dim()] * max(size - len(values), 0)
    return torch.tensor(values, dtype=torch.long, device=mask.device).reshape(-1, mask.dim())


def _nonzero_static(mask: torch.Tensor, *, size: int, fill_value: int = -1) -> Any:
    """``nonzero_static`` (torch 2.14's ``torch.combinations`` lists its pairs with it) of a
    mask made from shapes alone: its constant value; any other is torch's own."""
    node = private.traced_node_of(mask) if _ACTIVE else None
    if node is None or _inputs_read(node) or _decide(mask) != CONSTANT:
        return NotImplemented
    return _constant_indices(mask, size, fill_value)


def _indices_of(mask: torch.Tensor) -> torch.Tensor:
    """The indices a mask decided EVERY or CONSTANT selects, as ``torch.nonzero``."""
    if _decision_of(mask) == CONSTANT:
        return _constant_indices(mask)
    return every_index(mask.shape, mask.device)


def _nonzero(mask: torch.Tensor) -> Any:
    decision = _decide(mask)
    if decision is None:
        _refuse_a_model_mask(mask)
        return NotImplemented
    if decision in (EVERY, CONSTANT):
        return _indices_of(mask)
    b = mask.shape[0]
    positions = row_positions(mask, decision)  # (B, K) within the flattened row
    columns = [torch.arange(b, device=mask.device).reshape(b, 1).expand(b, decision)]
    for size in reversed(mask.shape[1:]):  # unravel, last dim first
        columns.insert(1, positions % size)
        positions = positions // size
    return torch.stack([c.reshape(-1) for c in columns], dim=1)


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
            converted.extend(_indices_of(i).unbind(1))
            changed = True
        elif all_or_none:
            return None
        else:
            converted.append(i)
    return converted if changed else None


def _decision_of(mask: torch.Tensor) -> int | None:
    """The decision a read earlier in this trace made for ``mask`` (None: none)."""
    return _ACTIVE[-1].decided.get(private.traced_node_of(mask)) if _ACTIVE else None  # type: ignore[arg-type]


def _decided(mask: torch.Tensor) -> bool:
    """The mask was compiled as all true, or as its constant value, by a read earlier in
    this trace."""
    return _decision_of(mask) in (EVERY, CONSTANT)


def _leading_mask(x: torch.Tensor, indices: list[torch.Tensor | None]) -> torch.Tensor | None:
    """The mask of ``x[mask]`` indexing ``x``'s leading dims alone, else None."""
    if len(indices) != 1 or not _is_mask(indices[0]):
        return None
    mask = indices[0]
    assert mask is not None
    k = mask.dim()
    return mask if k >= 1 and tuple(x.shape[:k]) == tuple(mask.shape) else None


def _index(x: torch.Tensor, indices: list[torch.Tensor | None]) -> Any:
    mask = _leading_mask(x, indices)
    if mask is not None:
        decision = _decide(mask)
        if decision is not None and decision not in (EVERY, CONSTANT):  # NOTE: [rows of one count]
            return compact_rows(x.reshape((-1,) + tuple(x.shape[mask.dim():])), mask, decision)
    converted = _masks_as_every_index(indices, _selects_everything, all_or_none=True)
    if converted is None:
        for i in indices:
            if i is not None and _is_mask(i):
                _refuse_a_model_mask(i)
        return NotImplemented
    return aten.index.Tensor(x, converted)


def _index_put_as(op: Any, x, indices, values, accumulate=False, unsafe=False):  # noqa: ANN001, ANN202
    """``index_put`` / ``index_put_`` / ``_index_put_impl_`` (the backward of ``x[mask]``)
    on a mask a read compiled as all true: by its every index; for a count per row: a
    scatter into each row's true positions."""
    mask = _leading_mask(x, list(indices))
    per_row = _decision_of(mask) if mask is not None else None
    if mask is not None and per_row is None and values.dim() > x.dim() - mask.dim() and values.numel() > 1:
        # rows written (``out[mask] = rows``): as many as selected; a value with no more
        # dims than an element of the selection (a row broadcast to every selected
        # element) is one value (NOTE: [mask writes of one value])
        per_row = _decide(mask)
        _rows_fit_the_selection(x, mask, values, per_row)
    if mask is not None and per_row is not None and per_row not in (EVERY, CONSTANT):
        grid, index = _by_example(x.reshape((-1,) + tuple(x.shape[mask.dim():])), mask, per_row)
        source = values.expand((index.shape[0] * per_row,) + index.shape[2:]).reshape(index.shape).to(x.dtype)
        put = grid.scatter_add(1, index, source) if accumulate else _written(grid, mask, index, source)
        put = put.reshape(x.shape)
        return put if op is aten.index_put.default else x.copy_(put)
    one = _one_value_per_selection(x, list(indices), values, accumulate)
    if one is not None:  # NOTE: [mask writes of one value]
        return one if op is aten.index_put.default else x.copy_(one)
    converted = _masks_as_every_index(indices, _decided, all_or_none=False)
    if converted is None:
        flat = _mask_over_one_dim(x, list(indices), values, accumulate)
        if flat is not None:  # NOTE: [mask writes of one value]
            return flat if op is aten.index_put.default else x.copy_(flat)
        return NotImplemented
    return op(x, converted, values, accumulate)


# NOTE: [rows written by a mask that cannot fit]
# The PyTorch DQN tutorial writes the target network's values of the non-final next
# states, passed as their own argument, into the rows its mask selects:
# ``next_state_values[non_final_mask] = target_net(non_final_next_states).max(1).values``.
# The written rows are as many as the true elements of the mask, a count the data decides
# and that another argument's shape carries, not a selection by the mask. Compiled for the
# mask that selects everything (NOTE: [selections by a mask of the batch]), the write
# puts the 6 rows given into 8 places: every call with a false element failed at run time
# in torch's words ("shape mismatch: value tensor of shape [6] cannot be broadcast to
# indexing result of shape [8]"), before the mask's own check could say why. When the rows
# written are neither one row (broadcast) nor as many as the compiled selection, no call
# can run the program, so the write is refused at capture, naming the line, with the
# fixed-shape form: the rows of the whole batch, selected by the same mask.
ROWS_FOR_EVERY_ELEMENT = (
    "the rows for every element of the batch, selected by the same mask: pass the rows "
    "of every element (all next states, not only the non-final ones) and write "
    "`out[mask] = f(all_rows[mask])`, or "
    "`out = torch.where(mask, f(all_rows), out)` (NOTE: [rows written by a mask that cannot "
    "fit])"
)


def _rows_fit_the_selection(x: torch.Tensor, mask: torch.Tensor, values: torch.Tensor, per_row: int | None) -> None:
    """Refuse ``x[mask] = rows`` whose row count no call of the compiled selection can
    take (NOTE: [rows written by a mask that cannot fit])."""
    if per_row is None or per_row == CONSTANT:
        return
    selected = mask.numel() if per_row == EVERY else mask.shape[0] * per_row
    rows = values.shape[0] if values.dim() == x.dim() - mask.dim() + 1 else None
    if rows is not None and rows not in (1, selected) and isinstance(rows, int):
        compiled = "every element" if per_row == EVERY else f"{per_row} in every row"
        raise RowsThatCannotFit(
            f"`x[mask] = rows` writes {rows} rows where the mask of the batch, compiled as "
            f"selecting {compiled} (a compiled program has fixed shapes), selects {selected}: "
            "the rows are not a selection by this mask (their count comes from another "
            "tensor's shape), so no call could run this write. For any mask, write "
            + ROWS_FOR_EVERY_ELEMENT
        )


def _mask_after_nones(
    x: torch.Tensor, indices: list[torch.Tensor | None]
) -> tuple[int, torch.Tensor] | None:
    """``(j, mask)`` where ``indices`` is ``j`` Nones then one boolean mask of at least one
    dim shaped as the dims of ``x`` it covers (``x[:, mask]``); None otherwise."""
    j = next((i for i, index in enumerate(indices) if index is not None), len(indices))
    if j != len(indices) - 1 or not _is_mask(indices[j]):
        return None
    mask = indices[j]
    assert mask is not None
    k = mask.dim()
    if k == 0 or x.dim() < j + k or tuple(x.shape[j:j + k]) != tuple(mask.shape):
        return None
    return j, mask


def _mask_over_one_dim(
    x: torch.Tensor, indices: list[torch.Tensor | None], values: torch.Tensor, accumulate: bool
) -> torch.Tensor | None:
    """``x[..., mask] = rows`` with a mask of 2 or more dims (after Nones) as the same
    write on those dims flattened into one, by the flattened mask: the same elements in
    the same order, and an index of one dim, which is what DTensor's rule takes a
    boolean mask for (NOTE: [mask writes of one value]); None when not such a write."""
    found = _mask_after_nones(x, indices)
    if found is None or found[1].dim() < 2:
        return None
    j, mask = found
    k = mask.dim()
    flat = aten.index_put.default(
        x.flatten(j, j + k - 1), [None] * j + [mask.reshape(-1)], values, accumulate
    )
    return flat.reshape(x.shape)


# NOTE: [mask writes of one value]
# ``x[mask] = v`` with ``v`` the same for every selected element (a Python number,
# wav2vec2's ``logits[1:][neg_is_pos] = float("-inf")``, a per-row value ``x[:, mask] =
# v[:, None]``) and ``index_put_((mask,), v, accumulate=True)`` are ``torch.where(mask, v,
# x)`` (``x + v`` added): the same values for any mask, ``v``'s gradient the sum over the
# selected elements as eager's. torch's own ``index_put`` failed under DTensor once the
# batch was in a dim the mask covers past its first (the contrastive logits ``(K + 1, B,
# T)``): DTensor's rule (torch 2.13) reads a boolean mask as an index of one dim, so it
# kept ``x`` sharded on the mask's second dim and gave the kernel the whole mask ("The
# shape of the mask [3, 4, 6] at index 1 does not match the shape of the indexed tensor
# [3, 2, 6]"); a ``where`` keeps any sharding. Before 2026-12-06 only a tensor value on
# the leading dims became a ``where`` (``_write_of_one_row`` in ``selected_rows.py``).
# A write of rows (one value per selected element, ``x[:, mask] = rows``) that reaches
# torch's own op with a mask of 2 or more dims is the same write on those dims flattened
# into one (``_mask_over_one_dim``): DTensor then reads its index right, and gathers the
# batch where it is in one of those dims.
def _one_value_per_selection(
    x: torch.Tensor, indices: list[torch.Tensor | None], values: torch.Tensor, accumulate: bool
) -> torch.Tensor | None:
    """``x[..., mask] = v`` (NOTE: [mask writes of one value]) as ``torch.where``: ``x``
    with ``v`` written (or, with ``accumulate``, added) at the mask's true elements, when
    ``indices`` is Nones then one boolean mask shaped as the dims it covers and ``v`` is
    the same for every selected element; None leaves the write to what follows."""
    found = _mask_after_nones(x, indices)
    if found is None:
        return None
    j, mask = found
    k = mask.dim()
    after = tuple(x.shape[j + k:])
    if values.dtype != x.dtype or values.dim() > j + 1 + len(after):
        return None  # eager raises (or writes rows): torch's own write says so
    # values broadcast to eager's (*x.shape[:j], selected, *after): the same value for
    # every selected element when its dim there is 1 (or absent)
    aligned = (1,) * (j + 1 + len(after) - values.dim()) + tuple(values.shape)
    if aligned[j] != 1:
        return None
    one_row = tuple(x.shape[:j]) + (1,) + after
    try:
        if torch.broadcast_shapes(aligned, one_row) != one_row:
            return None
    except RuntimeError:
        return None
    value = values.reshape(aligned[:j] + (1,) * k + aligned[j + 1:])
    written = mask.to(torch.bool).reshape((1,) * j + tuple(mask.shape) + (1,) * len(after))
    return torch.where(written, x + value if accumulate else value, x)


def _written(grid: torch.Tensor, mask: torch.Tensor, index: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """``grid`` (``(B, row, *rest)``) with ``source`` written at each example's true
    positions ``index``. Where DTensor's ``scatter`` rule replicates every operand (torch
    2.11: the batch would be gathered), the same values by ``scatter_add`` into zeros
    (each position written once, so the sum is the value) and a ``where``: both keep a
    batch-sharded grid sharded."""
    if not private.dtensor_scatter_replicates_only():
        return grid.scatter(1, index, source)
    written = mask.reshape(grid.shape[:2] + (1,) * (grid.dim() - 2)).to(torch.bool)
    return torch.where(written, torch.zeros_like(grid).scatter_add(1, index, source), grid)


def _masked_select(x: torch.Tensor, mask: torch.Tensor) -> Any:
    x, wide = torch.broadcast_tensors(x, mask)
    decision = _decide(mask if wide.shape == mask.shape else wide)
    if decision is None:
        _refuse_a_model_mask(mask)
        return NotImplemented
    if decision == CONSTANT:  # NOTE: [masks made from shapes alone]
        return x[_indices_of(mask if wide.shape == mask.shape else wide).unbind(1)]
    if decision != EVERY:  # NOTE: [rows of one count]
        return compact_rows(x.reshape(-1), wide, decision)
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
        aten.nonzero_static.default: _nonzero_static,
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
    "EVERY", "MaskWithFalseElements", "RowsOfAModelMaskCounted", "active", "compact_rows",
    "model_mask_hint",
    "counted_in_capture", "every_index", "row_positions", "traced",
    "mask_selection_decompositions", "mask_selections", "settle_selection",
    "forget_settled", "settled_in_capture",
]
