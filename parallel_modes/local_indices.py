"""Index-valued arguments numbered from 0 on each rank: ``DataParallel(input_index_of=...)``.

NOTE: [indices into the global batch]
A data-parallel mode reads each rank's tensor arguments as its share of ONE global batch:
rank r's ``x`` of ``n`` rows is rows ``r*n .. r*n+n-1`` of the global ``x``. An argument
whose values index the batch dimension of another split argument (a graph's
``edge_index`` into the node features, a ``batch`` vector of graph ids per node into the
labels, ``ptr`` offsets, token positions) therefore holds ids into the GLOBAL batch. A
torch-DDP script collates each rank's own graphs (DistributedSampler + PyG's collate), so
its ids start at 0 on every rank, and rank 1's ids pointed at rank 0's nodes and graphs:
a GNN trained 0.199 relative off eager on the global batch after 3 Adam steps on 2 gloo
ranks (losses 1.183 / 0.932 / 0.829 against 1.132 / 0.864 / 0.705), without a word
(sixty-first session). ``input_index_of={'ei': 'x', 'batch': 'y'}`` says the values of
``ei`` index the batch dimension of ``x``, numbered from 0 on each rank: on real ranks
the runtime feeds ``ei + rank * (x's local size along its batch dimension)`` (a new
tensor; the caller's is left as it is). Every rank passes shares of equal shapes (the
modes require it), so that offset is the global id exactly. In simulation the caller
passes the global batch, whose ids are global already: nothing is added. Values must lie
in ``[0, local size)``: a negative id (a padding ``-1``) would be moved as well.

Both names are argument paths as ``input_batch_dim`` spells them (``data.edge_index``,
``batch['ptr']``), each naming one tensor argument of the call. Refused: a name that
names no tensor argument, an index argument that is not of an integer dtype, and an
index or target argument the mode does not split (0-d, or ``input_batch_dim`` None):
an offset on a tensor every rank passes whole would make the ranks' copies differ.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from spmd_compiler.errors import SPMDCompileError, node_error
from spmd_compiler.expand.retrace import DistributedProgram
from spmd_compiler.ir.graph_utils import placeholders
from spmd_compiler.ir.signature import Kind

from .batch_dims import _spelled

IndexOf = Mapping[str, str]

_INTEGER = (torch.int32, torch.int64)  # the index dtypes of torch's index ops


def checked_index_of(index_of: IndexOf | None) -> dict[str, str]:
    """``index_of`` as a mode keeps it (names spelled as argument paths are); raises
    TypeError / ValueError on anything else."""
    if index_of is None:
        return {}
    if not isinstance(index_of, Mapping):
        raise TypeError(
            "input_index_of must be a dict from the name of an index argument to the name of "
            f"the argument whose batch dimension its values index, got {index_of!r}"
        )
    out: dict[str, str] = {}
    for name, target in index_of.items():
        if not isinstance(name, str) or not name or not isinstance(target, str) or not target:
            raise TypeError(f"input_index_of maps argument names to argument names, got {name!r}: {target!r}")
        spelled, aim = _spelled(name), _spelled(target)
        if spelled in out:
            raise ValueError(f"input_index_of names {spelled!r} twice (as {name!r} too)")
        if spelled == aim:
            raise ValueError(f"input_index_of[{name!r}] names the argument itself")
        out[spelled] = aim
    return out


def index_inputs(
    index_of: dict[str, str], names: Sequence[str], tensors: Sequence[torch.Tensor],
    placements: Sequence[Sequence[object]], where: str | None = None,
) -> list[tuple[int, int, int]]:
    """``(index argument, target argument, target's split dimension)`` positions among
    the call's tensor arguments for each entry of ``input_index_of`` (NOTE: [indices
    into the global batch]); ``names``, ``tensors``, ``placements``: the call's tensor
    arguments as ``input_batch_dim`` names them, and their placements.

    Raises:
        SPMDCompileError: a name names no tensor argument, an index argument is not of an
            integer dtype, or either argument is not split over the ranks.
    """
    position = {name: k for k, name in enumerate(names)}
    shown = ", ".join(names[:12]) + (f" and {len(names) - 12} more" if len(names) > 12 else "")
    out = []
    for name, target in index_of.items():
        for label in (name, target):
            if label not in position:
                raise SPMDCompileError(
                    f"input_index_of names {label!r} ({name!r}: {target!r}), but no tensor argument "
                    f"of this call is {label!r}. The tensor arguments, as input_batch_dim and "
                    f"input_index_of name them: {shown or 'none'}.",
                    user_line=where,
                    hint="name the index argument and the argument whose batch dimension it indexes "
                    "as the step reads them: input_index_of={'edge_index': 'x', 'batch': 'y'}.",
                )
        k, t = position[name], position[target]
        dtype = tensors[k].dtype
        if dtype not in _INTEGER:
            raise SPMDCompileError(
                f"input_index_of names {name!r} as holding ids into {target!r}, but {name!r} is a "
                f"{dtype} tensor: only an int64 or int32 tensor's values are ids (torch's index "
                "ops take those) that can be moved to the global batch.",
                user_line=where,
                hint=f"pass {name!r} as an integer tensor (torch.long), or leave it out of input_index_of.",
            )
        for label, j in ((name, k), (target, t)):
            split = [p for p in placements[j] if isinstance(p, Shard)]
            if not split or tensors[j].dim() == 0:
                raise SPMDCompileError(
                    f"input_index_of maps {name!r} to {target!r}, but the mode does not split "
                    f"{label!r} over the ranks (every rank passes it whole): ids numbered from 0 "
                    "on each rank are only meaningful between arguments each rank passes its "
                    "own share of.",
                    user_line=where,
                    hint=f"drop {name!r} from input_index_of, or give {label!r} its batch dimension "
                    f"in input_batch_dim instead of None.",
                )
        out.append((k, t, next(p.dim for p in placements[t] if isinstance(p, Shard))))
    return out


def global_ids(
    entries: list[tuple[int, int, int]], tensors: list[torch.Tensor], mesh: DeviceMesh
) -> list[torch.Tensor]:
    """``tensors`` with each index argument of ``entries`` moved from this rank's ids to
    the global batch's: plus rank * the target's local size along its batch dimension
    (NOTE: [indices into the global batch]). New tensors: the caller's are not written."""
    rank = mesh.get_local_rank(0) if mesh.ndim > 1 else mesh.get_local_rank()
    if rank == 0 or not entries:
        return tensors
    out = list(tensors)
    for k, t, dim in entries:
        out[k] = tensors[k] + rank * tensors[t].shape[dim]
    return out


# NOTE: [ids that look numbered from 0 on each rank]
# Without ``input_index_of`` a per-rank collate's ids train wrong on real ranks without a
# sign (NOTE: [indices into the global batch]). On a step's first call on real ranks
# (the compile: nothing per call) each integer argument the mode splits is followed into
# the index ops of the captured step (index_select, index_add / index_copy / index_fill
# / index_reduce, scatter*, gather, advanced indexing and index_put, through views,
# selects and casts of it) whose indexed dimension is dimension 0 and has the global size
# of a split argument's batch dimension (so is itself split: the node rows of ``h =
# lin(x)``, the graphs of ``zeros(y.shape[0])``); not where it indexes a parameter, a
# buffer or an argument passed whole (``class_weights[y]``), nor another dimension
# (``logits.gather(1, y)``: classes, even where their count equals the batch's). Global ids on rank r > 0 reach r * the local size
# and more; where every value this rank passes lies in ``[0, local size)`` they look
# numbered from 0 on this rank, and the rank warns, naming the argument, the op and the
# line. A heuristic: ids that legitimately point at rank 0's share only (an edge into
# another rank's nodes) warn as well, and ids on rank 0 cannot be told apart.

# NOTE: [counts passed as Python ints]
# A Python int argument is one value of the global step: every rank must pass the same
# (NOTE: [same inputs on all ranks]) and the step is captured with it as it is. PyG's
# ``data.num_graphs`` after a per-rank collate is this rank's count, and a per-graph
# mean (GraphNorm, a virtual node, ``global_mean_pool(h, batch, size=num_graphs)``) built
# as ``zeros(num_graphs).index_add(0, batch, h)`` then pools every rank's graph j
# together: 2 gloo ranks trained 5.99e-2 off eager after 3 Adam steps (losses 1.18353 /
# 1.15011 / 1.11924 against 1.17664 / 1.14644 / 1.11996), without a word (sixty-fourth
# session), for the ``zeros(4)`` it indexes had no split size for the check above to
# see. So on a first call on real ranks, rank r > 0 also follows each split integer
# argument into index ops on dimension 0 of a tensor the step made (not a parameter,
# buffer or argument passed whole: ``embedding(ids)``) whose size is no split batch size
# but the value of an int argument of the call, and warns, naming both, where this
# rank's ids start at 0 and lie below that count: global ids on rank r > 0 start after
# rank 0's graphs. The working form takes the count from a split tensor
# (``graphs = torch.zeros(num_graphs, 0)``, ``graphs.shape[0]``, ``input_index_of={'batch':
# 'graphs'}``): its size is this rank's, times the ranks at capture, and the ids move.
# Not refused: an int argument may be a global number (``zeros(num_classes).index_add_(
# 0, y, ...)``, a label histogram) indexed by split labels, exactly as the warning's
# case looks; ids need not start at 0 there, so the check is a warning that may be
# ignored. Not offered: ``input_index_of`` naming an int argument (the count times the
# ranks fed to the step): the int reaches the capture, the program key and the step's
# own Python reads as the caller passed it, and changing it there would change more
# than the indexed rows; a tensor's size is the form the modes already scale.

# op -> positions of (indexed tensor, dimension, index), or None for a list of indices
_INDEX_OPS: dict[object, tuple[int, int, int] | None] = {}
for _name in ("index_select", "index_add", "index_copy", "index_fill", "index_reduce",
              "scatter", "scatter_add", "scatter_reduce", "gather"):
    for _suffix in ("", "_"):
        _packet = getattr(torch.ops.aten, _name + _suffix, None)
        if _packet is not None:
            for _overload in _packet.overloads():
                _INDEX_OPS[getattr(_packet, _overload)] = (0, 1, 2)
for _op in (torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default,
            torch.ops.aten._unsafe_index.Tensor, torch.ops.aten._unsafe_index_put.default):
    _INDEX_OPS[_op] = None

# ops an index flows through unchanged in value (a row of ``edge_index``, a cast)
_PASS_THROUGH = {
    torch.ops.aten.select.int, torch.ops.aten.slice.Tensor, torch.ops.aten.view.default,
    torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.unsqueeze.default,
    torch.ops.aten.squeeze.dim, torch.ops.aten.squeeze.default, torch.ops.aten.expand.default,
    torch.ops.aten.clone.default, torch.ops.aten._to_copy.default, torch.ops.aten.alias.default,
    torch.ops.aten.t.default, torch.ops.aten.flatten.using_ints, torch.ops.aten.contiguous.default,
    torch.ops.aten.expand_as.default, torch.ops.aten.detach.default,
}


def _source(node: Any) -> Any:
    """The node an index value comes from, through ops that keep its values."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _PASS_THROUGH:
        node = node.args[0]
    return node


def _index_uses(node: torch.fx.Node) -> list[tuple[Any, int, Any]]:
    """``(indexed tensor, dimension, index)`` of each index the op ``node`` reads."""
    positions = _INDEX_OPS.get(node.target)
    if positions is None:
        indices = node.args[1] if len(node.args) > 1 else ()
        if not isinstance(indices, (list, tuple)):
            return []
        return [(node.args[0], dim, i) for dim, i in enumerate(indices) if isinstance(i, torch.fx.Node)]
    this, at, index = positions
    dim = node.args[at] if len(node.args) > index else None
    if not isinstance(dim, int) or not isinstance(node.args[index], torch.fx.Node):
        return []
    return [(node.args[this], dim, node.args[index])]


def warn_on_local_ids(
    program: DistributedProgram, tensor_args: Sequence[torch.Tensor], index_of: Mapping[str, str],
    counts: Sequence[tuple[str, int]] = (),
) -> None:
    """Warn where an integer argument looks numbered from 0 on this rank (> 0) although
    it indexes a split dimension (NOTE: [ids that look numbered from 0 on each rank]), or
    indexes a tensor the step sized by a Python int argument (NOTE: [counts passed as
    Python ints]); run once per program, on real ranks; ``index_of``: the arguments the
    mode moves; ``counts``: the call's int arguments, as (path, value)."""
    mesh = program.mesh
    if mesh.ndim != 1 or mesh.size() < 2:
        return
    rank, world = mesh.get_local_rank(), mesh.size()
    if rank == 0:
        return
    captured = program.captured
    inputs: dict[torch.fx.Node, tuple[str, torch.Tensor]] = {}
    split_inputs: set[torch.fx.Node] = set()
    batch_sizes: dict[int, list[str]] = {}  # global batch size -> the arguments split so
    for node, (ref, meta), placements in zip(
        placeholders(captured.graph_module), captured.inputs, program.input_placements, strict=True
    ):
        split = [p for p in placements[:1] if isinstance(p, Shard)]
        if ref.kind is not Kind.INPUT or not split:
            continue
        split_inputs.add(node)
        batch_sizes.setdefault(meta.shape[split[0].dim], []).append(ref.name or f"input[{ref.index}]")
        if meta.dtype in _INTEGER and ref.name not in index_of:
            inputs[node] = (ref.name or f"input[{ref.index}]", tensor_args[ref.index])
    warned: set[str] = set()
    for node, name, value, size in _split_ids_into_made_rows(captured.graph_module, inputs, split_inputs):
        if name in warned or value.numel() == 0:
            continue
        if size in batch_sizes:
            message = _looks_local(name, value, size, world, rank, batch_sizes[size])
        else:
            message = _per_rank_count(name, value, size, counts)
        if message is not None:
            warned.add(name)
            warnings.warn(str(node_error(message[0], node, hint=message[1])), stacklevel=3)


def _split_ids_into_made_rows(
    graph_module: torch.fx.GraphModule, inputs: Mapping[torch.fx.Node, tuple[str, torch.Tensor]],
    split_inputs: set[torch.fx.Node],
) -> Iterator[tuple[torch.fx.Node, str, torch.Tensor, int]]:
    """``(index op, argument name, this rank's value, indexed size)`` wherever one of
    ``inputs`` indexes dimension 0 of a tensor that is no parameter, buffer or argument
    passed whole: a split argument or a tensor the step made."""
    for node in graph_module.graph.nodes:
        if node.op != "call_function" or node.target not in _INDEX_OPS:
            continue
        for indexed, dim, index in _index_uses(node):
            source = _source(index)
            if source not in inputs or not isinstance(indexed, torch.fx.Node):
                continue
            shape = getattr(indexed.meta.get("val"), "shape", None)
            if shape is None or not -len(shape) <= dim < len(shape) or dim % len(shape):
                continue  # a class dimension (logits.gather(1, y)) is no batch
            held = _source(indexed)
            if isinstance(held, torch.fx.Node) and held.op == "placeholder" and held not in split_inputs:
                continue  # a parameter, buffer or whole argument (class_weights[y]): no batch
            name, value = inputs[source]
            yield node, name, value, int(shape[dim])


def _looks_local(
    name: str, value: torch.Tensor, size: int, world: int, rank: int, split_as: list[str]
) -> tuple[str, str] | None:
    """(message, hint) where ``value`` indexes a split dimension of global ``size`` and
    lies in ``[0, size / world)`` (NOTE: [ids that look numbered from 0 on each rank])."""
    local = size // world
    if size % world or int(value.min()) < 0 or int(value.max()) >= local:
        return None
    aims = [a for a in split_as if a != name]
    aim = repr(aims[0]) if aims else "<the argument it indexes>"
    return (
        f"Argument {name!r} indexes dimension 0 of a tensor split over the ranks "
        f"(global size {size}, {local} on each rank), but every value this rank ({rank}) "
        f"passes lies in [0, {local}): its ids look numbered from 0 on each rank, as a "
        "per-rank collate (DistributedSampler + PyG) makes them. The mode reads them as "
        "ids into the global batch, so they point at rank 0's share and the step trains "
        "wrong.",
        f"if they are numbered from 0 on each rank, name them: "
        f"DataParallel(..., input_index_of={{{name!r}: {aim}}}); if "
        "they are global ids that point at rank 0's share on purpose, ignore this.",
    )


def _per_rank_count(
    name: str, value: torch.Tensor, size: int, counts: Sequence[tuple[str, int]]
) -> tuple[str, str] | None:
    """(message, hint) where ``value`` indexes the rows of a tensor the step made ``size``
    long, ``size`` is the value of an int argument, and this rank's ids start at 0
    (NOTE: [counts passed as Python ints])."""
    sized_by = [path for path, n in counts if n == size]
    if not sized_by or int(value.min()) != 0 or int(value.max()) >= size:
        return None
    count = sized_by[0]
    return (
        f"Argument {name!r} is split over the ranks (each rank passes its share of one "
        f"global batch) and indexes the {size} rows of a tensor the step makes, {size} long as "
        f"the int argument {count!r} is. A Python int argument is read as one global value "
        f"on every rank, not as this rank's count: if {count!r} counts this rank's graphs "
        f"(PyG's data.num_graphs) and {name!r} numbers them from 0 on each rank, every rank's "
        "graph j is pooled with the other ranks' graph j and the step trains wrong, without "
        "an error.",
        f"take the count from a tensor argument split with the batch and name {name!r} in "
        f"input_index_of: pass graphs=torch.zeros(num_graphs, 0), use graphs.shape[0] as the "
        f"count, and DataParallel(..., input_index_of={{{name!r}: 'graphs'}}) (or the graph "
        f"labels: y.shape[0], input_index_of={{{name!r}: 'y'}}); if {count!r} is the same "
        "global number on every rank (a number of classes), ignore this.",
    )
