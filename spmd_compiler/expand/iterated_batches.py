"""Batch dimensions the step iterates over, found while expanding.

NOTE: [a batch dimension iterated over]
A data-parallel mode splits each tensor argument along its batch dimension, 0 unless
``input_batch_dim`` names another. A time-major argument (an RNN's ``(T, B, F)`` input,
the ``(S, B)`` tokens of torch's own language-model tutorial) passed without naming its
batch dimension is split along time instead. In simulation, where the caller passes the
global value, DTensor puts the pieces back together and the step computes what eager
does; on real ranks each rank passes its own share, ``(T, B / world, F)``, which the
program reads as one rank's share of a sequence ``world`` times longer: shapes agree,
nothing fails, and the step trains wrong (a GRU tagger's weights 0.09-0.13 relative off
one device after 3 steps on 2 gloo ranks, fifty-third and fifty-fourth sessions).

What gives it away is torch's own time-major layers reading it, or the step walking along
it. Expansion records each such op (``BatchIterations``). Two kinds:
- torch's recurrent and attention layers (``nn.RNN`` / ``nn.GRU`` / ``nn.LSTM`` /
  ``nn.MultiheadAttention``, so ``nn.TransformerEncoderLayer`` / ``nn.Transformer``) read
  one dimension of their input (attention: query, key, value) as time: 0 with
  ``batch_first=False`` (or an unbatched input), 1 with ``batch_first=True``. The
  capture marks the values they are given with that dimension (``TIME_MAJOR_INPUT``) and
  the nodes a recurrent layer traces (``TIME_MAJOR_RNN``); a marked value split along
  its time dimension, or a walk inside such a layer, is a split along time for certain
  (attention never walks: it reads the whole sequence at once, and before the
  fifty-fifth session an encoder layer trained wrong, silently, on real ranks; before
  the fifty-sixth, a time-major input turned batch-first for a ``batch_first=True``
  layer did: 4.1e-1 relative off one device on 2 gloo ranks, an encoder layer). The
  data-parallel modes refuse the program on real ranks
  unless ``input_batch_dim`` names every argument concerned (``{'x': 1}``), and warn in
  simulation, where the result is right either way;
- a walk along the split dimension (``unbind``: ``for x_t in x``; ``split`` into pieces
  of 1; ``select`` / a slice of length 1 at two or more positions; one sample picked,
  ``x[0]``, is no walk) of a value computed from a split argument, on a mesh dimension of
  more than one rank, anywhere else in the user's code: a time loop written by hand (``for t in
  range(T): x[t]``) or a loop over samples (``for xi in x``, ``zip(x, y)``: valid code,
  which a refusal would break), which nothing here can tell apart: a warning, on real
  ranks and in simulation, naming the op, the line and both ways to say which it is.
  Walks in an installed library's code (transformers' LLaVA over its images) are loops
  over samples of batch-first inputs by convention: not warned about.
Before the fifty-fourth session all of this trained wrong silently on real ranks.

NOTE: [samples of a list stacked]
A collate function that does not stack passes the batch as a list (or tuple) of
per-sample tensors, ``wavs = [w0, w1, ...]`` of shape ``(T,)`` each, and the step stacks
them itself (``pad_sequence(wavs, batch_first=True)``, ``torch.stack(wavs)``). The mode
splits each item along its own dimension 0 as if it were a batch tensor: time here. In
simulation, where the caller passes the global list, DTensor puts the pieces back and the
step computes what eager does; on real ranks each rank passes its own samples, half as
many, and the program reads rank 0's and rank 1's i-th samples as the two halves of one
sample twice as long: a spectral-mask enhancer (stft, gain, istft) 2.1e-3 off one device
after 3 steps on 2 gloo ranks, no sign (a Conv1d model failed with an internal shape
message; sixty-first session). The list's length, the batch, is per rank, and nothing
can split it. Expansion records each op that places two or more items of one list
argument, split along their dimension 0, as the rows of a new leading dimension
(``StackedSamples``):
- each written into the first part of a row of a new tensor along its own dimension 0
  (``select_scatter`` of a ``slice_scatter``: what ``pad_sequence`` and a hand-written
  ``out[i, :len(w)] = w`` trace to): padding makes an item's dimension 0 a sequence's
  length (``pad_sequence``'s ``(L, *)``), samples for certain: refused, on real ranks and
  in simulation alike (refusing on real ranks alone would let the two compute
  differently);
- ``torch.stack(items)`` / ``torch.cat([w.unsqueeze(0), ...])`` / whole rows written by
  hand (``out[i] = w``): also what a list of batch
  tensors does, ``torch.stack([x1, x2])`` of two ``(B, F)`` views into ``(2, B, F)``, whose
  batch dimension 1 is split right: nothing in the graph tells the two apart, so a
  warning, on real ranks and in simulation, naming the op, the line and both ways to say
  which it is.
Naming the list in ``input_batch_dim`` (``{'wavs': None}``: every rank passes the same
whole list; ``{'wavs': 0}``: each item is a batch tensor) says which it is and silences
both.
"""

from __future__ import annotations

import dataclasses
import operator
import os
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch.distributed.tensor import DTensor

from .. import _torch_private as private
from ..errors import SPMDCompileError, in_installed_package, node_error, stack_trace_frames
from ..ir.node_meta import RNN_HIDDEN, TIME_MAJOR_INPUT, TIME_MAJOR_RNN
from .listed_samples import sequences_holding

# op -> the position of its dimension argument and its default
_UNBIND = torch.ops.aten.unbind.int
_SELECT = torch.ops.aten.select.int
_SPLIT = torch.ops.aten.split.Tensor
_SLICE = torch.ops.aten.slice.Tensor
_DIMENSION: dict[Any, tuple[int, int | None]] = {_UNBIND: (1, 0), _SELECT: (1, None), _SPLIT: (2, 0), _SLICE: (1, 0)}


@dataclass(frozen=True)
class IteratedBatch:
    """``node`` (of the captured graph) iterates over dimension ``dim`` of a value whose
    split dimension comes from the step arguments ``arguments``."""

    node: torch.fx.Node
    arguments: tuple[str, ...]
    dim: int
    # the time-major torch layer (``"'fqn' (Class)"``) that reads dimension ``dim`` as
    # time (NOTE's first kind), if any
    recurrent: str | None = None
    # a walk's number of positions, and the walked value's size along ``dim``, global and
    # one rank's share (NOTE: [fixed rows walked]); None for a time-major layer's input
    walked: int | None = None
    size: int | None = None
    share: int | None = None
    # a walk inside a recurrent layer of its hidden state's layers, dimension 0 of a
    # (num_layers * directions, B, H) value (NOTE: [a hidden state's layers walked])
    hidden: bool = False


@dataclass(frozen=True)
class StackedSamples:
    """``node`` (of the captured graph) places the items ``items`` of the list argument
    ``argument``, each split along its dimension 0, as rows of a new leading dimension
    (NOTE: [samples of a list stacked]); ``padded``: row by row into a new tensor
    (``pad_sequence``), samples for certain."""

    node: torch.fx.Node
    argument: str
    items: tuple[str, ...]
    padded: bool


_STACK = torch.ops.aten.stack.default
_CAT = torch.ops.aten.cat.default
_SELECT_SCATTER = torch.ops.aten.select_scatter.default
_SLICE_SCATTER = torch.ops.aten.slice_scatter.default
_UNSQUEEZE = torch.ops.aten.unsqueeze.default
# ops an item passes through unchanged in layout before it is stacked (a dtype or
# device cast, a copy)
_AS_ITSELF = {
    torch.ops.aten.clone.default, torch.ops.aten._to_copy.default, torch.ops.aten.alias.default,
    torch.ops.prims.convert_element_type.default,
}
_ITEM = re.compile(r"^(.+)\[(\d+)\]$")


class BatchIterations:
    """Collects ``IteratedBatch`` records while the expanding interpreter runs: told of
    each split argument as its placeholder is read and of each op before it runs."""

    def __init__(self, graph: torch.fx.Graph) -> None:
        self._graph = graph
        self._split: dict[torch.fx.Node, str] = {}  # placeholder -> argument name
        self._mesh_dims: set[int] = set()  # mesh dimensions that split an argument
        self._reach: dict[torch.fx.Node, frozenset[str]] | None = None
        self._seen: set[tuple[tuple[str, ...], bool]] = set()
        # (the selected value's node, dimension) -> the indices selected from it
        self._selected: dict[tuple[Any, int], set[Any]] = {}
        # (the selected value's node, dimension) -> the index in ``found`` of its record
        self._walk_of: dict[tuple[Any, int], int] = {}
        self.found: list[IteratedBatch] = []
        # placeholder -> argument name, for items split along their own dimension 0
        self._split_at_0: dict[torch.fx.Node, str] = {}
        # list argument and whether padded -> its items written as rows of a new tensor
        # so far
        self._rows: dict[str, set[str]] = {}
        self.stacked: list[StackedSamples] = []

    def argument(self, node: torch.fx.Node, name: str, value: Any) -> None:
        """Placeholder ``node`` holds step argument ``name`` as ``value``."""
        if not isinstance(value, DTensor):
            return
        mesh = value.device_mesh
        dims = {m for m, p in enumerate(value.placements) if private.is_shard_like(p) and mesh.size(m) > 1}
        if dims:
            self._split[node] = name
            self._mesh_dims |= dims
            if value.ndim and any(private.is_shard_like(p) and p.dim == 0
                                  for m, p in enumerate(value.placements) if m in dims):
                self._split_at_0[node] = name

    def _split_along(self, value: DTensor, dim: int) -> bool:
        return any(
            private.is_shard_like(p) and p.dim == dim
            for m, p in enumerate(value.placements) if m in self._mesh_dims
        )

    def op(self, node: torch.fx.Node, target: Any, args: tuple, kwargs: dict) -> None:
        """Record ``node`` if it reads a time-major layer's input split along time, or
        walks along the split dimension of its input."""
        if not self._split:
            return
        if self._split_at_0 and target in (_STACK, _CAT, _SELECT_SCATTER):
            self._stacked(node, target, args, kwargs)
        for source, value in zip(node.args, args):
            if not isinstance(source, torch.fx.Node) or not isinstance(value, DTensor):
                continue
            timed = source.meta.get(TIME_MAJOR_INPUT)
            if timed is not None and value.ndim > timed[1] and self._split_along(value, timed[1]):
                self._record(node, source, timed[1], timed[0])
        if target not in _DIMENSION or not args or not isinstance(args[0], DTensor):
            return
        position, default = _DIMENSION[target]
        dim = args[position] if len(args) > position else kwargs.get("dim", default)
        value = args[0]
        if not isinstance(dim, int) or not value.ndim:
            return
        dim %= value.ndim
        if not self._split_along(value, dim):
            return
        if target is _SPLIT and args[1] != 1:
            return  # pieces of more than one: a batch cut in parts, no walk
        if target in (_SELECT, _SLICE):
            if target is _SLICE:  # a slice of length 1 is a select
                start, end = (list(args[2:4]) + [None, None])[:2]
                if not isinstance(start, int) or not isinstance(end, int) or end - start != 1:
                    return
                where: Any = start
            else:
                where = args[2] if len(args) > 2 else None
            # one sample picked (``x[0]``: a penalty on the first sample) is no walk; a
            # second position of the same value and dimension is
            key = (node.args[0], dim)
            picked = self._selected.setdefault(key, set())
            picked.add(where)
            if len(picked) < 2:
                return
            walked = len(picked)
            if key in self._walk_of:  # a further position of a walk recorded
                index = self._walk_of[key]
                self.found[index] = dataclasses.replace(self.found[index], walked=walked)
        else:
            key, walked = None, value.shape[dim]
        recurrent = node.meta.get(TIME_MAJOR_RNN)
        if recurrent is None and (_in_a_library(node) or _read_out(node)):
            # batch-first by convention (transformers' LLaVA walks its images), or the
            # values read out as Python numbers (``.tolist()``), which computes nothing
            return
        ranks = 1
        for m, p in enumerate(value.placements):
            if m in self._mesh_dims and private.is_shard_like(p) and p.dim == dim:
                ranks *= value.device_mesh.size(m)
        share = value.shape[dim] // ranks
        layers, widths = node.meta.get(RNN_HIDDEN) or (None, ())
        hidden = recurrent is not None and dim == 0 and value.ndim == 3 and layers in (
            value.shape[0], share) and value.shape[2] in widths
        if self._record(node, node, dim, recurrent, (walked, value.shape[dim], share), hidden):
            if key is not None:
                self._walk_of[key] = len(self.found) - 1

    def _item(self, node: Any, unsqueezed: bool) -> str | None:
        """The split list item (``wavs[3]``) ``node`` is, through casts and copies (and
        one ``unsqueeze(0)`` where ``unsqueezed``); None where it is none."""
        for _ in range(6):
            if not isinstance(node, torch.fx.Node):
                return None
            if node in self._split_at_0:
                name = self._split_at_0[node]
                return name if not unsqueezed and _ITEM.match(name) else None
            if unsqueezed and node.target is _UNSQUEEZE and len(node.args) > 1 and node.args[1] == 0:
                unsqueezed = False
            elif node.target is _SLICE_SCATTER and len(node.args) > 1:
                node = node.args[1]  # the item written into a row's slice
                continue
            elif node.target not in _AS_ITSELF:
                return None
            node = node.args[0] if node.args else None
        return None

    def _stacked(self, node: torch.fx.Node, target: Any, args: tuple, kwargs: dict) -> None:
        """Record ``node`` if it places items of a split list argument as the rows of a
        new leading dimension (NOTE: [samples of a list stacked])."""
        if target is _SELECT_SCATTER:
            dim = node.args[2] if len(node.args) > 2 else kwargs.get("dim")
            item = self._item(node.args[1], False) if len(node.args) > 1 and dim == 0 else None
            if item is None:
                return
            # padded: written into the first part of its row along its own dimension 0
            # (``pad_sequence``, ``out[i, :len(w)] = w``), which makes that dimension a
            # length; a whole row (``out[i] = w``) is what a stack does
            source = node.args[1]
            padded = isinstance(source, torch.fx.Node) and source.target is _SLICE_SCATTER and bool(
                (source.args[2] if len(source.args) > 2 else source.kwargs.get("dim", 0)) == 0
            )
            argument = _ITEM.match(item).group(1)  # type: ignore[union-attr]
            rows = self._rows.setdefault(f"{argument}{padded}", set())
            rows.add(item)
            if len(rows) == 2:  # once, at the second item
                self._add_stacked(StackedSamples(node, argument, tuple(sorted(rows)), padded=padded))
            return
        dim = node.args[1] if len(node.args) > 1 else kwargs.get("dim", 0)
        if dim != 0 or not node.args or not isinstance(node.args[0], (list, tuple)):
            return
        items = [self._item(n, target is _CAT) for n in node.args[0]]
        if len(items) < 2 or any(i is None for i in items):
            return
        lists = {_ITEM.match(i).group(1) for i in items if i is not None}  # type: ignore[union-attr]
        if len(lists) == 1 and len(set(items)) == len(items):
            self._add_stacked(StackedSamples(node, lists.pop(), tuple(i for i in items if i), padded=False))

    def _add_stacked(self, record: StackedSamples) -> None:
        if not any(r.argument == record.argument and r.padded == record.padded for r in self.stacked):
            self.stacked.append(record)

    def _record(
        self, node: torch.fx.Node, value: torch.fx.Node, dim: int, layer: str | None,
        walk: tuple[int, int, int] | None = None, hidden: bool = False,
    ) -> bool:
        """Record ``node``; ``walk``: positions walked, size and one rank's share along
        ``dim``. Whether a record was made (one per set of arguments and kind)."""
        arguments = tuple(sorted(self._reaching(value)))
        if arguments and (arguments, layer is None) not in self._seen:
            self._seen.add((arguments, layer is None))
            walked, size, share = walk if walk is not None else (None, None, None)
            self.found.append(IteratedBatch(node, arguments, dim, layer, walked, size, share, hidden))
            return True
        return False

    def reaching(self, node: torch.fx.Node) -> frozenset[str]:
        """The names of the split step arguments ``node`` (of the captured graph) is
        computed from."""
        return self._reaching(node)

    def _reaching(self, node: torch.fx.Node) -> frozenset[str]:
        """The split arguments ``node`` is computed from (one pass over the graph, the
        first time it is asked)."""
        if self._reach is None:
            self._reach = {}
            for n in self._graph.nodes:
                names = {self._split[n]} if n in self._split else set()
                for source in n.all_input_nodes:
                    names |= self._reach.get(source, frozenset())
                self._reach[n] = frozenset(names)
        return self._reach.get(node, frozenset())


_READ_OUT = torch.ops.aten._local_scalar_dense.default
_WALKS_OR_VIEWS = {_UNBIND, _SELECT, _SPLIT, _SLICE, torch.ops.aten.view.default, torch.ops.aten.alias.default}


def _read_out(node: torch.fx.Node, depth: int = 0) -> bool:
    """Whether every use of ``node``'s pieces ends in ``.item()`` or the step's outputs
    (``.tolist()`` walks its tensor and reads each element out as a Python number, the
    capture returning them as outputs: a walk that computes nothing)."""
    if depth > 8 or not node.users:
        return False
    for user in node.users:
        if user.target is _READ_OUT or user.op == "output":
            continue
        if (user.target is operator.getitem or user.target in _WALKS_OR_VIEWS) and _read_out(user, depth + 1):
            continue
        return False
    return True


_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def _in_a_library(node: torch.fx.Node) -> bool:
    """Whether the innermost frame outside torch that traced ``node`` is an installed
    package's (a library loops over its batch-first inputs' samples, not over time: a
    walk there is not warned about; torch's own recurrent layers are marked apart)."""
    files = [os.path.abspath(frame[0]) for frame in stack_trace_frames(node.meta.get("stack_trace"))]
    outside = [f for f in files if not f.startswith(_TORCH_DIR)]
    return bool(outside) and in_installed_package(outside[-1])


# NOTE: [fixed rows walked]
# A GNN's edge_index (2, E) left at the default batch dimension 0 is split into rows:
# on 2 real ranks each passes (2, E) and the program reads (4, E), whose ``ei[0]`` and
# ``ei[1]`` are rank 0's rows; the walk warning called it "a loop over samples or a
# time-major argument" and suggested ``{'ei': 1}`` or ``{'ei': 0}``, the second of which
# silences the warning and keeps the wrong split (parameters 9e-2 relative off one
# device after 3 steps, sixty-first session). A walk whose number of positions is what
# each rank passed along the dimension, fewer than the program's global size, took its
# count from the user's code, not the batch: a fixed number of rows. There (and in
# simulation, where the caller passes the global value, for a walk of all of a dimension
# of 3 or fewer, shorter than another) the hint names the dimension that holds the
# samples, or None; on real ranks not dimension 0.
def _fixed_rows(record: IteratedBatch, simulated: bool) -> bool:
    """Whether ``record`` walks a fixed number of rows, not samples (NOTE: [fixed rows
    walked])."""
    walked, size, share = record.walked, record.size, record.share
    if walked is None or size is None or share is None:
        return False
    if simulated:
        return walked == size <= 3
    return walked == share < size


def check_iterated_batches(
    found: list[IteratedBatch], named: Callable[[str], bool], split: dict[str, tuple[int, tuple[int, ...]]],
    simulated: bool, hint: str | None = None,
) -> None:
    """Refuse or warn, once for all records whose arguments ``input_batch_dim`` does not
    name (NOTE: [a batch dimension iterated over]). ``split``: each split argument's split
    dimension and global shape, to suggest the arguments laid out alike (``(T, B)`` labels
    beside a ``(T, B, F)`` input: naming the input alone would leave them cut along time);
    ``hint``: what to do, for a mode without ``input_batch_dim``.

    Raises:
        SPMDCompileError: on real ranks, where a time-major torch recurrent layer walks
            the split dimension.
    """
    _check_named_time(found, named, split)
    records = [r for r in found if any(not named(a) for a in r.arguments)]
    if not records:
        return
    unnamed = list(dict.fromkeys(a for r in records for a in r.arguments if not named(a)))
    recurrent = next((r for r in records if r.recurrent is not None), None)
    record = recurrent or records[0]
    listed = ", ".join(repr(a) for a in unnamed)
    sizes = {split[a][1][split[a][0]] for a in unnamed if a in split}
    alike = [a for a, (d, shape) in split.items()
             if len(shape) > 1 and not named(a) and (a in unnamed or shape[d] in sizes)]
    others = [a for a in alike if a not in unnamed]
    also = (
        f" ({', '.join(repr(a) for a in others)} {'has' if len(others) == 1 else 'have'} a "
        "dimension 0 of the same size: name every argument laid out this way)" if others else ""
    )
    per_sample = "{" + ", ".join(f"{a!r}: 0" for a in unnamed) + "}"
    time_major = (
        f"input_batch_dim={{{', '.join(f'{a!r}: 1' for a in alike)}}} for time-major (T, B, ...) "
        f"arguments{also}, or " if alike else ""
    )
    fixed = _fixed_rows(record, simulated)
    # NOTE: [fixed rows walked]: the dimension that holds the samples, not dimension 0
    elsewhere = {a: next((d for d in range(len(split[a][1])) if d != split[a][0]), None)
                 for a in unnamed if a in split}
    # a loop over a list of samples walks each rank's count of them too (NOTE: [a list of
    # samples split as batch tensors]): where a list's items are split, say so
    lists = list(dict.fromkeys(held[-1][0] for a in split if (held := sequences_holding(a))))
    samples = "" if not (fixed and lists) else (
        f"; a loop over the items of the list argument {lists[0]!r} (for i, t in "
        f"enumerate({lists[0]}): pred[i]) walks each rank's own samples as well: if they are "
        "samples, pad them into one batch tensor in the collate function, with a count or "
        "validity mask"
    )
    if fixed and recurrent is None and any(d is not None for d in elsewhere.values()):
        named_here = "{" + ", ".join(f"{a!r}: {d}" for a, d in elsewhere.items()) + "}"
        whole = "{" + ", ".join(f"{a!r}: None" for a in elsewhere) + "}"
        hint = hint or (
            "name the dimension that holds the samples (an edge_index (2, E): its edges, "
            f"dimension 1): input_batch_dim={named_here}, or input_batch_dim={whole} for an "
            "argument every rank passes whole"
            + (f"; {per_sample} only if dimension {record.dim} is the batch and the step "
               f"loops over its {record.walked} samples" if simulated else
               f" (naming dimension {record.dim} would keep the split this warning is about)")
            + samples + "."
        )
    # NOTE: [a hidden state's layers walked]: an LSTM's unnamed (h0, c0), split along
    # dimension 0, is walked there inside the layer; that dimension is its layers
    # (num_layers * directions), not time, and its batch is dimension 1. The message
    # said "reads dimension 0 of ... 'hc[0]', 'hc[1]' as time" (sixty-fourth session).
    # The capture marks what a recurrent layer traces with its hidden state's shape
    # (``RNN_HIDDEN``); a walk there of dimension 0 of a value of that shape (its
    # layers as each rank passed it, or in simulation as a whole) is one along layers.
    hidden = recurrent is not None and recurrent.hidden
    if hidden and hint is None:
        hint = (
            "name the hidden state's batch dimension in the mode: input_batch_dim="
            + "{" + ", ".join(f"{a!r}: 1" for a in alike or unnamed) + "}"
            + f"{also}."
        )
    whole = "{" + ", ".join(f"{a!r}: None" for a in unnamed) + "}"
    # an argument of a few numbers every rank passes alike (CutMix's box, (4,)) is walked
    # as the batch too; the hint named only dimension 0 (sixty-sixth session's probe)
    hint = hint or (
        f"name the batch dimension in the mode: {time_major}input_batch_dim={per_sample} if "
        f"dimension 0 is the batch and the step loops over samples, or input_batch_dim={whole} "
        "for an argument that holds no batch and that every rank passes whole (a CutMix "
        "box, a few coordinates)."
    )
    if fixed and recurrent is None and not simulated:
        world = (record.size or 0) // (record.share or 1)
        message = (
            f"This op walks {record.walked} positions along dimension {record.dim} of a value "
            f"computed from the step argument(s) {listed}, the dimension the mode splits as the "
            f"batch (input_batch_dim does not name it): as many as each rank passed there, "
            f"not the {record.size} of all ranks the program reads, so that dimension holds a "
            "fixed number of rows (an edge_index (2, E): its source and target rows), not "
            f"samples. Split over the ranks, each rank's rows are read as its part of a "
            f"dimension {world} times longer, and the step would train wrong."
            + (f" Or the loop runs over the items of the list argument {lists[0]!r}, each "
               "rank's own samples, and the list is what is split wrong: the mode splits its "
               "items as batch tensors." if lists else "")
        )
    elif hidden and recurrent is not None:  # NOTE: [a hidden state's layers walked]
        message = (
            f"The layer {recurrent.recurrent} walks dimension 0 of a value computed from the "
            f"step argument(s) {listed}, its hidden state's layers (num_layers * directions: "
            "the hidden state (h0, c0) is (num_layers * directions, B, H), its batch in "
            "dimension 1), the dimension the mode splits as the batch (input_batch_dim does "
            "not name it): on real ranks each rank's share would be read as its part of as "
            "many times more layers as there are ranks, and the step would train wrong."
        )
    elif recurrent is not None:
        message = (
            f"The layer {recurrent.recurrent} reads dimension "
            f"{record.dim} of a value computed from the step argument(s) {listed} as time, the "
            "dimension the mode splits as the batch (input_batch_dim does not name it): on real "
            "ranks each rank's share would be read as its part of a sequence as many times "
            "longer as there are ranks, and the step would train wrong."
        )
    else:
        message = (
            f"This op walks along dimension {record.dim} of a value computed from the step "
            f"argument(s) {listed}, the dimension the mode splits as the batch (input_batch_dim "
            "does not name it): a loop over samples (valid), or over the time steps of a "
            "time-major (T, B, ...) argument, which on real ranks each rank's share would "
            "make part of a sequence as many times longer as there are ranks: the step would "
            "train wrong."
        )
    error = node_error(message, record.node, hint=hint)
    if recurrent is not None and not simulated:
        raise error
    warnings.warn(
        f"{error}" + (" (refused on real ranks; simulated ranks are passed the global value, "
                      "which is split right either way)" if recurrent is not None else ""),
        stacklevel=2,
    )


# NOTE: [a named batch dimension read as time]
# ``input_batch_dim`` names an argument's batch dimension, and the checks above left
# out every record whose arguments it names: a named dimension was trusted. A batch-first
# ``(B, T)`` token argument named ``{'x': 1}`` (following a capture failure's hint about
# a module buffer, not the argument) into an Embedding and a ``batch_first=True`` GRU,
# which reads dimension 1 as time, compiled with no warning and trained wrong on 2 gloo
# ranks (losses 2.5453 / 2.4390 / 2.4200 against eager's 2.5536 / 2.4317 / 2.4284,
# weights 1.5e-2..0.188 relative off; sixty-fourth session). The batch dimension a torch
# recurrent or attention layer reads as time contradicts the name: either the name or
# the layer's batch_first is wrong, and nothing here can tell which. Refused, on real
# ranks and in simulation alike (refusing on real ranks alone would let the two compute
# differently; in simulation the result is right by accident of DTensor), naming the
# layer, the argument and both dimensions. The layer's input (its ``TIME_MAJOR_INPUT``
# mark) and a walk inside the layer count alike (a batch-first input passed straight in
# is walked after the layer's transpose, along its dimension 0). A name of
# dimension 0 is left out: it is the default, and the way the warning above offers to
# say "dimension 0 is the batch" (``input_batch_dim=0`` names every argument so).
def _check_named_time(
    found: list[IteratedBatch], named: Callable[[str], bool], split: dict[str, tuple[int, tuple[int, ...]]]
) -> None:
    """Refuse a record of a time-major layer reading, as time, the dimension that
    ``input_batch_dim`` names as the batch of every argument it comes from (NOTE: [a
    named batch dimension read as time]).

    Raises:
        SPMDCompileError: where there is one.
    """
    record = next(
        (r for r in found if r.recurrent is not None and r.arguments
         and all(named(a) and split.get(a, (0,))[0] != 0 for a in r.arguments)),
        None,
    )
    if record is None:
        return
    names = ", ".join(
        f"{a!r} as dimension {split[a][0]}" if a in split else repr(a) for a in record.arguments
    )
    zero = "{" + ", ".join(f"{a!r}: 0" for a in record.arguments) + "}"
    read = "its hidden state's layers" if record.hidden else "time"
    raise node_error(
        f"input_batch_dim names the batch of {names}, but the layer {record.recurrent} reads "
        f"dimension {record.dim} of a value computed from it as {read}: the same dimension "
        "cannot be both. Split as the batch, each rank's share would be read as its part of "
        f"{'as many times more layers' if record.hidden else 'a sequence as many times longer'} as there are ranks, and the step would train wrong "
        "on real ranks.",
        record.node,
        hint="a hidden state (num_layers * directions, B, H) has its batch in dimension 1: "
        "input_batch_dim={" + ", ".join(f"{a!r}: 1" for a in record.arguments) + "}." if record.hidden else (
            f"if the argument is batch-first ((B, T, ...), what a batch_first=True layer "
            f"reads), its batch is dimension 0: leave it out of input_batch_dim or name it "
            f"{zero}; if it is time-major ((T, B, ...)), build the layer with "
            "batch_first=False. A size mismatch with a module buffer (a hidden state kept on "
            "the module) is no reason to name another dimension: size the buffer for the "
            "global batch, or pass it as an argument."
        ),
    )


def check_stacked_samples(stacked: list[StackedSamples], named: Callable[[str], bool]) -> None:
    """Refuse or warn, once for all records whose list argument ``input_batch_dim`` does
    not name (NOTE: [samples of a list stacked]); on real ranks and in simulation alike.

    Raises:
        SPMDCompileError: where the items are written row by row into a new tensor
            (``pad_sequence``): samples for certain.
    """
    records = [r for r in stacked if not any(named(i) for i in r.items)]
    if not records:
        return
    record = next((r for r in records if r.padded), records[0])
    error = stacked_samples_error(record)
    if record.padded:
        raise error
    warnings.warn(f"{error}", stacklevel=2)


def stacked_samples_error(record: StackedSamples) -> SPMDCompileError:
    """The error (a warning's text, for ``torch.stack``) about ``record`` (NOTE: [samples
    of a list stacked]); also raised where such samples fail expansion first (a
    convolution over the split time dimension)."""
    name = record.argument
    how = "padded row by row into a new tensor (pad_sequence)" if record.padded else "stacked"
    also = "" if record.padded else (
        " (or as batch tensors, torch.stack([x1, x2]) of two (B, F) views, which is split right)"
    )
    hint = (
        "stack (pad) the samples in the collate function and pass one batch tensor (its "
        f"dimension 0 is then split), or name it in the mode: input_batch_dim={{{name!r}: None}} "
        "if every rank passes the same whole list"
    )
    return node_error(
        f"The items of the list argument {name!r} ({', '.join(record.items[:3])}"
        f"{', ...' if len(record.items) > 3 or record.padded else ''}) are {how} along a new "
        f"dimension 0, as samples of one batch{also}, but the mode splits each item along its "
        "own dimension 0 as if it were a batch tensor (a sample's time or channels): on real "
        "ranks each rank passes its own samples, and the program would read the ranks' i-th "
        "samples as pieces of one longer sample; the step would train wrong.",
        record.node,
        hint=hint + ("." if record.padded else f", or input_batch_dim={{{name!r}: 0}} if each item "
                     "is a batch tensor whose dimension 0 is its batch."),
    )
