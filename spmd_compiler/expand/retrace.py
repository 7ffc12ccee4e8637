"""Expand a captured single-device graph into the per-rank program.

NOTE: [expansion by DTensor re-tracing]
The captured graph is run node by node on DTensors (fake local tensors wrapped with
``DTensor.from_local``) inside a ``make_fx`` trace. For each node DTensor's sharding
propagation picks input and output placements; where an input's placement differs from
what the op needs, DTensor redistributes it, which traces as explicit functional
collectives (``all_reduce``, ``all_gather_into_tensor``, ``reduce_scatter_tensor``,
``all_to_all_single``), each followed by ``wait_tensor``. View and factory shape
arguments come out local. Redistributions are memoized per (value, source, target), so a
Partial gradient used by several optimizer ops is reduced once. Values made by factory
ops (``arange``, ``zeros``) are the same on every rank and enter as Replicate. Each traced
node records the placement of the value it computes in ``node.meta[PLACEMENT]`` and the
source node it came from in ``node.meta[ORIGIN]``.

NOTE: [compile work bounds]
While tracing, DTensor turns off its own caches, and on a 2-D mesh it prices every
candidate strategy of every op by planning a redistribution that traces the run-time
mesh coordinate (dead graph nodes). ``private.memoized_redistribute_cost`` prices each
(source, target) pair once per trace without tracing anything, and plans evenly sharded
redistributions without the coordinate; the per-rank program is unchanged (node names
aside). The fsdp_tp demo's compile went from 70.8 to ~22 CPU seconds. Then (NOTE: [even
shard selections] in ``_torch_private.py``) each Replicate -> Shard at the coordinate is
traced as its live nodes only, its fake slice decided from value ranges, and local shapes
and strided-shard sizes of even splits are answered without tracing the coordinate or an
arange: the 2x2 demo's expansion went from ~11 to ~6 CPU seconds, same programs. A test
bounds the plans and traced coordinates by the program's size (tests/sim/test_fsdp_tp.py).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.fx import traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import make_fx

from .. import _torch_private as private
from .. import progress
from ..capture.gradients import GRADIENT, marked_gradient, settled_gradient_name
from ..errors import SPMDCompileError, exception_summary, node_error
from ..ir.collectives import is_wait
from ..ir.graph_utils import RetracingInterpreter, placeholders, replace_with_input
from ..ir.node_meta import PADDED, PLACEMENT, Phase, phase
from ..ir.signature import PADDED_KINDS, CapturedStep, Kind, StateRef, TensorMeta, contiguous_stride
from ..ir.use_step import UseGroup, UseHook, UseStep
from .iterated_batches import BatchIterations, IteratedBatch, StackedSamples, stacked_samples_error
from .listed_samples import sequences_holding
from .local_rules import LocalRules

if TYPE_CHECKING:  # typing only: lowering and the runtime import this module
    from ..lower import Executable
    from ..runtime.cross_iteration import DeferredPlan

Placements = tuple[Placement, ...]
# Longest time DTensor may search one op's sharding through its decomposition
# (private.bounded_decomposition_propagation); beyond it the op is refused.
PROPAGATION_BUDGET_SECONDS = 30.0


# the namespaces of torch.distributed._functional_collectives' ops
_FUNCTIONAL_COLLECTIVES = frozenset({"_c10d_functional", "_c10d_functional_autograd", "c10d_functional"})

@dataclass
class DistributedProgram:
    """The per-rank program: one graph, identical on every rank, plus its signature.

    ``input_placements[i]`` / ``output_placements[j]`` are the DTensor placements of the
    i-th placeholder / j-th output; ``local_inputs[i]`` is the local metadata a rank feeds.
    """

    graph_module: torch.fx.GraphModule
    captured: CapturedStep
    mesh: DeviceMesh
    input_placements: list[Placements]
    output_placements: list[Placements]
    local_inputs: list[TensorMeta]
    # parameter name -> (true rows, padded rows), see NOTE: [uneven shards]
    padded: dict[str, tuple[int, int]] = field(default_factory=dict)
    # parameter name -> the padded dimension, where it is not 0 (tensor parallel)
    padded_dims: dict[str, int] = field(default_factory=dict)
    # collective launches per kind as expansion made them, before any pass
    collectives_before_passes: dict[str, int] = field(default_factory=dict)
    expand_seconds: float = 0.0
    passes_applied: list[str] = field(default_factory=list)
    pass_seconds: dict[str, float] = field(default_factory=dict)
    # the programs of a step whose last gradient bucket finishes in the next call
    # (NOTE: [cross-iteration overlap]); None when nothing is deferred
    deferred: DeferredPlan | None = None
    # the lowered graphs that run (``lower.Executable``), set once the passes are done
    executable: Executable | None = None
    # ops iterating over a split argument's batch dimension, as expansion found them
    # (NOTE: [a batch dimension iterated over]; read by the data-parallel modes, not cached)
    iterated_batches: list[IteratedBatch] = field(default_factory=list)
    # ops stacking a list argument's items as samples (NOTE: [samples of a list stacked])
    stacked_samples: list[StackedSamples] = field(default_factory=list)

    def pads(self, ref: StateRef) -> bool:
        """Whether the runtime feeds ``ref`` row-padded and unpads what it writes back
        (NOTE: [uneven shards])."""
        return ref.name in self.padded and ref.kind in PADDED_KINDS


def format_placements(placements: Sequence[Placement]) -> str:
    """Short form used in dumps and errors: ``S(0)``, ``R``, ``P(sum)``."""
    out = []
    for p in placements:
        if private.is_strided_shard(p):
            out.append(f"SS({p.dim},{p.split_factor})")
        elif isinstance(p, Shard):
            out.append(f"S({p.dim})")
        elif isinstance(p, Replicate):
            out.append("R")
        elif p.is_partial():
            out.append(f"P({getattr(p, 'reduce_op', 'sum')})")
        else:
            out.append(str(p))
    return "[" + ", ".join(out) + "]"


_FACTORED_STATE_HINT = (
    "this optimizer state is shaped unlike its parameter (Adafactor's factored second "
    "moments: a row factor and a column factor), and the mode shards it as it shards the "
    "parameter; run this optimizer where its state is replicated (ddp), or use an optimizer "
    "whose state is shaped like its parameters (Adam, AdamW, SGD, ...) in this mode."
)


def _batch_hint(argument: str, size: int, n: int) -> str:
    """What to do where a step argument's batch dimension does not divide by ``n``
    ranks; a size of 1 reads first as a tensor broadcast over the batch (position ids of
    shape (1, S)), which holds no batch. An item of a list may be one sample's (a
    torchvision target's boxes), which no name of the item makes right (NOTE: [a list
    of samples split as batch tensors] in ``expand/listed_samples.py``)."""
    # the data-loading advice first (a partial last batch of 7 on 2 ranks is the common
    # case; README's Limitations promised it, the message gave only input_batch_dim;
    # sixty-fifth session): drop it, or pad it with rows that add nothing to the loss
    padded = -(-size // n) * n
    split = (
        f"use a global batch that is a multiple of {n} (each rank gets an equal share): a "
        f"batch_size that is a multiple of {n}, and for a partial last batch, drop it "
        f"(DataLoader(drop_last=True)) or pad it to {padded} rows with a mask or zero "
        f"weights so that the padded rows add nothing to the loss (divide by the count of "
        f"real rows). Programs compiled for other batch shapes keep working"
    )
    none, other = f"input_batch_dim={{{argument!r}: None}}", f"input_batch_dim={{{argument!r}: 1}}"
    lists = sequences_holding(argument)
    sample = "" if not lists else (
        f"if the items of the list {lists[-1][0]!r} are samples (one per image, as torchvision's "
        "targets), the mode cannot split the list: pad its items into one batch tensor in the "
        "collate function, with a count or validity mask, or "
        f"input_batch_dim={{{lists[-1][0]!r}: None}} only if every rank passes the same whole "
        "list. Otherwise: "
    )
    if size == 1:
        return sample + (
            f"if this argument is broadcast over the batch (size 1) or holds no batch (a step "
            f"counter torch.tensor([i]), a temperature of shape (1,)): say so "
            f"with {none}, and every rank reads it whole. If it is a batch, {split}. If its "
            f"batch lies in another dimension, {other}."
        )
    return sample + (
        f"{split}. Only if this argument holds no batch (per-feature weights, a step "
        f"counter), or its batch lies in another dimension, say so: {none} or {other}."
    )


def local_meta(
    meta: TensorMeta, mesh: DeviceMesh, placements: Placements, what: str, argument: str | None = None,
    hint: str | None = None, batch_dims_named: bool = True,
) -> TensorMeta:
    """Local metadata of a tensor sharded evenly by ``placements`` on ``mesh``;
    ``argument``: the step argument's name, for a tensor argument; ``hint``: what to do
    where a state tensor does not divide; ``batch_dims_named``: whether the mode names
    its arguments' batch dimensions with ``input_batch_dim`` (DataParallel, FSDP x TP),
    else an argument's placement is the mode's own (``DTensorExpandMode``'s
    ``input_placements``), which the message names instead.

    Raises:
        SPMDCompileError: a sharded dimension is missing or not divisible.
    """
    shape = list(meta.shape)
    for mesh_dim, p in enumerate(placements):
        if private.is_shard_like(p):
            n = mesh.size(mesh_dim)
            if p.dim >= len(shape) or p.dim < -len(shape):
                raise SPMDCompileError(
                    f"{what} of shape {tuple(meta.shape)} has no dimension {p.dim} to "
                    f"shard on (placement {format_placements(placements)}).",
                    hint="choose a placement for this input that fits its shape.",
                )
            if shape[p.dim] % n:
                # an argument: say that the mode splits it as a batch (a step counter
                # torch.tensor([i]) read as a batch of one; sixty-second session)
                split = "" if argument is None else (
                    f", which the parallel mode splits as the batch (its input_batch_dim, "
                    f"dimension 0 unless named) over the {n} ranks: {meta.shape[p.dim]} is "
                    f"not divisible by the {n} ranks of mesh dimension {mesh_dim}."
                    if batch_dims_named else
                    # a mode without input_batch_dim (DTensorExpandMode(input_placements=
                    # {0: (Shard(1),)})) was said to split it "as the batch (its
                    # input_batch_dim ...)" and told to name one (review of 8d45f0e)
                    f", which the parallel mode's placement for it "
                    f"{format_placements(placements)} splits over the {n} ranks of mesh "
                    f"dimension {mesh_dim}: {meta.shape[p.dim]} is not divisible by {n}."
                )
                placed_hint = (
                    f"give it a size in dimension {p.dim} that is a multiple of {n}, or "
                    "place it otherwise where the mode takes a placement per argument "
                    "(DTensorExpandMode's input_placements: (Replicate(),) passes it whole)."
                )
                raise SPMDCompileError(
                    f"{what} has size {meta.shape[p.dim]} in dimension {p.dim}"
                    + (split or f", which is not divisible by the {n} ranks of mesh dimension {mesh_dim}."),
                    hint=hint if argument is None else (
                        _batch_hint(argument, meta.shape[p.dim], n) if batch_dims_named else placed_hint),
                )
            shape[p.dim] //= n
    return TensorMeta(tuple(shape), meta.dtype, meta.device, False)


def expand(
    captured: CapturedStep,
    mesh: DeviceMesh,
    input_placements: list[Placements],
    output_placements: list[Placements],
    placement_at_use: UseHook | None = None,
    gradient_placement: Callable[[str], Placements | None] | None = None,
    gradient_rows: Callable[[str], Placements | None] | None = None,
    round_low_precision_sums: bool = True,
    batch_dims_named: bool = True,
) -> DistributedProgram:
    """Turn the captured single-device graph into the per-rank program.

    Args:
        captured: the functional single-device step.
        mesh: the device mesh every placement refers to.
        input_placements: one placement tuple per placeholder.
        output_placements: the placement each output must leave the graph with.
        placement_at_use: ``(consumer, arg) -> [UseStep, ...] | None``: the mode may
            require ``arg`` in other placements when ``consumer`` reads it (FSDP gathers
            a parameter at its use; TP lays out a module's output, then the next
            module's input). Steps apply in order; one redistribution per (arg,
            ``UseStep.key``) is traced, at the first use with that key (see
            ``ir/use_step.py``).
        gradient_placement: parameter name -> the placement its gradient settles in
            where something outside backward first reads it (NOTE: [gradients settle
            after backward]); None (or None for a name): read as DTensor propagates it.
        gradient_rows: parameter name -> the placement its gradient ends up in, read for
            its ``Shard`` entries: a gradient that is one ``mm`` is computed on the rows
            kept there (NOTE: [weight gradients computed on the rows kept]); None: as
            DTensor propagates it.
        round_low_precision_sums: round a pending sum cast up from float16 / bfloat16
            to that dtype where it is reduced (NOTE: [low-precision partials rounded
            where reduced]).
        batch_dims_named: whether the mode takes ``input_batch_dim`` (``local_meta``'s
            message for an argument that does not divide names it only then).
    """
    start = time.perf_counter()
    params = captured.param_metas()
    iterations = BatchIterations(captured.graph_module.graph)
    local = [
        local_meta(
            meta, mesh, pl, str(ref), ref.name if ref.kind is Kind.INPUT else None,
            _FACTORED_STATE_HINT if ref.kind is Kind.OPTIM_STATE
            and ref.name in params and params[ref.name].shape != meta.shape else None,
            batch_dims_named,
        )
        for (ref, meta), pl in zip(captured.inputs, input_placements, strict=True)
    ]

    def per_rank(*locals_: torch.Tensor) -> list[torch.Tensor]:
        dtensors = [
            DTensor.from_local(t, mesh, pl, run_check=False, shape=torch.Size(meta.shape),
                               stride=contiguous_stride(meta.shape))
            for t, pl, (_, meta) in zip(locals_, input_placements, captured.inputs, strict=True)
        ]
        with (
            private.memoized_redistribution() as memo,
            private.memoized_redistribute_cost(),
            fx_traceback.preserve_node_meta(),
            private.quiet_sequential_collective_warning(),
            private.bounded_decomposition_propagation(PROPAGATION_BUDGET_SECONDS),
        ):
            rules = local_rules(captured, mesh, input_placements)
            interpreter = _ExpandingInterpreter(
                captured, mesh, placement_at_use, memo, rules, gradient_placement, gradient_rows,
                iterations, round_low_precision_sums,
            )
            progress.current().set_total(len(captured.graph_module.graph.nodes))
            outs = interpreter.run(*dtensors)
            results = []
            for k, (value, target) in enumerate(zip(outs, output_placements, strict=True)):
                dt = _as_dtensor(value, mesh)
                if tuple(dt.placements) != tuple(target):
                    dt = _redistribute_output(dt, mesh, target, captured, k)
                results.append(private.local_tensor_of(dt))
        return results

    gm = _trace_rank_generic(per_rank, local, mesh)
    _check_output_dtypes(gm, captured)
    _views_to_reshapes(gm)
    _drop_detaches(gm)
    _drop_repeated_waits(gm)
    for node, pl in zip(placeholders(gm), input_placements, strict=True):
        node.meta[PLACEMENT] = tuple(pl)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return DistributedProgram(
        graph_module=gm,
        captured=captured,
        mesh=mesh,
        input_placements=[tuple(p) for p in input_placements],
        output_placements=[tuple(p) for p in output_placements],
        local_inputs=local,
        expand_seconds=time.perf_counter() - start,
        iterated_batches=iterations.found,
        stacked_samples=iterations.stacked,
    )


def local_rules(
    captured: CapturedStep, mesh: DeviceMesh, input_placements: list[Placements]
) -> LocalRules:
    """The rules of NOTE: [local batch only] and NOTE: [fused projections] for this
    program: the global size of every sharded dimension of a step argument (per mesh
    dimension), and whether any state is _StridedShard on a 1-D mesh."""
    batch: dict[int, set[int]] = {}
    fused = False
    for (ref, meta), placements in zip(captured.inputs, input_placements, strict=True):
        for mesh_dim, p in enumerate(placements):
            if ref.kind is Kind.INPUT and type(p) is Shard and meta.shape:
                batch.setdefault(mesh_dim, set()).add(meta.shape[p.dim])
            fused |= mesh.ndim == 1 and private.is_strided_shard(p)
    return LocalRules(mesh, {m: frozenset(s) for m, s in batch.items()}, fused)


def _trace_rank_generic(fn: Callable[..., Any], local: list[TensorMeta], mesh: DeviceMesh) -> torch.fx.GraphModule:
    """Trace the per-rank program so that one graph is right on every rank.

    NOTE: [one program for every rank]
    Some redistributions are local but rank-dependent (Replicate -> Shard keeps this
    rank's slice). Traced on rank 0 they would bake rank 0's slice into the graph. With
    torch's ``compile_on_one_rank`` the rank's mesh coordinate is computed at run time
    by an op in the graph (and simulated per rank by LocalTensorMode). Where DTensor
    cannot reason about that symbolic coordinate (a shard size it must know statically),
    we trace once per mesh coordinate with the coordinate fixed and accept the program
    only if all traces are identical, i.e. the program does not depend on the rank.
    """
    def fakes(shape_env: bool) -> list[torch.Tensor]:
        with private.fake_tensor_mode(with_shape_env=shape_env):
            return [torch.empty(m.shape, dtype=m.dtype, device=m.device) for m in local]

    try:
        with private.compile_on_one_rank():
            gm = make_fx(fn, tracing_mode="fake")(*fakes(True))
        private.lift_group_names(gm, mesh)
        return gm
    except SPMDCompileError as exc:
        if not _caused_by_symbolic_coordinate(exc):
            raise
        symbolic_failure = exc
    programs = []
    for coordinate in private.mesh_coordinates(mesh):
        with private.fixed_mesh_coordinate(mesh, coordinate):
            try:
                programs.append((coordinate, make_fx(fn, tracing_mode="fake")(*fakes(False))))
            except SPMDCompileError as exc:
                # NOTE: [a coordinate that does not fix the trace]: with the coordinate
                # fixed, DTensor can still read a shard's size off a tensor (torch 2.13's
                # uneven Shard -> Replicate under ``SequenceParallel()`` alone on a norm,
                # T=7 at tp 2): the same cause as the symbolic failure, refused as one
                if not _caused_by_symbolic_coordinate(exc):
                    raise
                raise _differs_between_coordinates(
                    f"(placing this node needed the rank's coordinate as a number even with it "
                    f"fixed to {coordinate})", exc,
                ) from exc
    first_coordinate, first = programs[0]
    for coordinate, gm in programs[1:]:
        if gm.code != first.code:
            # name the node whose redistribution needed the coordinate
            raise _differs_between_coordinates(f"{first_coordinate} and {coordinate}", symbolic_failure)
    private.lift_group_names(first, mesh)
    return first


def _differs_between_coordinates(where: str, failure: SPMDCompileError) -> SPMDCompileError:
    """The refusal of a step whose per-rank program depends on the rank's mesh coordinate
    (NOTE: [one program for every rank]), naming ``failure``'s node."""
    return SPMDCompileError(
        f"The per-rank program differs between mesh coordinates {where}: DTensor's "
        "handling of this node depends on the rank in a way the program cannot compute at "
        "run time (shards of different sizes on different ranks where a dimension does not "
        "split evenly, or a rank's offset into a sharded dimension read by a data-dependent "
        "op), so one program cannot serve every rank.",
        op=failure.op, node=failure.node, module_fqn=failure.module_fqn, user_line=failure.user_line,
        hint="use sizes the mesh dimensions divide for what this node reads (a "
        "parameter's sharded dimension; under SequenceParallel the sequence length, "
        "which it splits over tp: pad it to a multiple of the tp size), or shard the batch "
        "on dimension 0; if the sizes divide, compute this op on replicated values (leave "
        "its module out of the plan).",
    )


def _redistribute_output(
    dt: DTensor, mesh: DeviceMesh, target: Placements, captured: CapturedStep, k: int
) -> DTensor:
    """Output ``k`` moved to the placements the mode keeps it in.

    NOTE: [outputs moved by way of Replicate]
    torch 2.13's redistribution from a strided shard on a 2-D mesh to another 2-D
    sharding can fail an internal check (fsdp_tp 2x2: a momentum buffer computed in
    ``[_StridedShard(0, sf=2), Shard(0)]`` for ``[Shard(0), Shard(1)]`` raised a bare
    "Expected cond to be True" from DTensor's unpadding, the step never compiled). Where
    the direct move from a strided shard fails, the output is gathered whole and cut as
    the mode keeps it:
    more bytes, for this output only, the same values. A failure of that too becomes an
    error naming the output and both placements."""
    try:
        try:
            return dt.redistribute(mesh, target)
        except Exception:
            if not any(private.is_strided_shard(p) for p in dt.placements):
                raise  # only the strided move is known to fail in torch: anything else is named
        whole = dt.redistribute(mesh, [Replicate()] * mesh.ndim)
        return whole.redistribute(mesh, target)
    except Exception as exc:  # noqa: BLE001 - re-raised naming the output
        what = str(captured.outputs[k]) if k < len(captured.outputs) else f"output {k}"
        raise SPMDCompileError(
            f"Expansion could not move {what} (global shape {tuple(dt.shape)}) from the "
            f"placements the step computed it in, {format_placements(dt.placements)}, to "
            f"those the mode keeps it in, {format_placements(tuple(target))}: "
            f"{exception_summary(exc)}.",
            hint="a tensor the step builds with a size equal to the global batch (a table "
            "made by torch.zeros / torch.full of that many rows) is split as the batch "
            "(NOTE: [local batch only]); build it from a size that is not the batch, or "
            "pass it to the step as an argument named None in input_batch_dim.",
        ) from exc


def _check_output_dtypes(gm: torch.fx.GraphModule, captured: CapturedStep) -> None:
    """Each output of the per-rank program has the dtype the single-device step gives it.

    The runtime writes outputs into the model's state as they come: an expansion that
    changed a dtype (DTensor made an int64 counter partial by dividing it, NOTE:
    [integer sums made partial] in ``_torch_private.py``) would store a float32 in an
    int64 buffer, and a lowered program read its bytes as int64 (values of 1e18 on 2
    gloo ranks). Refused here instead, naming the value.

    Raises:
        SPMDCompileError: an output whose dtype differs.
    """
    output = next(n for n in gm.graph.nodes if n.op == "output")
    values = output.args[0] if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
    for i, (node, ref, meta) in enumerate(zip(values, captured.outputs, captured.output_metas, strict=False)):
        val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
        if isinstance(val, torch.Tensor) and val.dtype != meta.dtype:
            raise SPMDCompileError(
                f"Expanding the step changed the dtype of output {i} ({ref}) from {meta.dtype} "
                f"to {val.dtype}: refused rather than storing it with the wrong dtype. This is "
                "a bug in spmd_compiler or in a sharding rule it relies on.",
                hint="report the step; until then, keep that value in a floating dtype or "
                "update it outside the compiled step.",
            )


def _views_to_reshapes(gm: torch.fx.GraphModule) -> None:
    """Turn ``view`` nodes into ``reshape`` (a view whenever the strides allow one).

    Fake tensors predict output strides by meta functions; a few CPU kernels pick other
    (contiguous) strides at run time, e.g. ``mse_loss_backward`` on a transposed input,
    after which a traced ``view`` fails. ``reshape`` is identical when a view is
    possible and copies only when it is not.
    """
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.view.default:
            node.target = torch.ops.aten.reshape.default


def _drop_detaches(gm: torch.fx.GraphModule) -> None:
    """Replace ``detach`` and ``detach_`` nodes by their input.

    The per-rank program runs no autograd (the capture made backward explicit ops), so
    both are their input. Expansion traces them where DTensor lifts a tensor constant
    (the mesh tensor the rank's coordinate is computed from: ``lift_fresh_copy`` then
    ``detach_``). ``detach_``'s schema is in place, so the passes took it for a side
    effect that no collective or fused optimizer update may cross: one in the optimizer
    section of the demo GPT's fsdp_tp program left all 35 parameters' AdamW updates
    unfused (630 ops where the 1-D modes run 18 foreach ops).
    """
    detaches = (torch.ops.aten.detach.default, torch.ops.aten.detach_.default)
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in detaches:
            replace_with_input(node)


def _drop_repeated_waits(gm: torch.fx.GraphModule) -> None:
    """Replace a ``wait_tensor`` of a ``wait_tensor``'s result by that result.

    DTensor waits on a collective's result where it redistributes, and waits again where
    a later step of the same redistribution reads it (torch 2.13: each dp reduce-scatter
    of a gradient summed over tp, 24 in the demo GPT's fsdp_tp program). The second wait
    waits for nothing, but to the passes it is the result's first use, right after the
    collective: no two such reduce-scatters could share a bucket (NOTE: [buckets in
    rounds] in passes/bucket_collectives.py).
    """
    for node in list(gm.graph.nodes):
        if is_wait(node) and isinstance(node.args[0], torch.fx.Node) and is_wait(node.args[0]):
            replace_with_input(node)


def _caused_by_symbolic_coordinate(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, private.data_dependent_error_types()):
            return True
        seen = seen.__cause__ or seen.__context__
    return False



def _as_dtensor(value: Any, mesh: DeviceMesh) -> Any:
    if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
        # A value no DTensor flowed into (factory ops, tensor constants): identical on
        # every rank. See NOTE: [tensor constants].
        if private.is_real_tensor_constant(value):
            value = private.lift_constant(value)
        return DTensor.from_local(value, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return value


# NOTE: [sparse tensors and segment_reduce refused]
# DTensor has no sharding rules for sparse layouts (``torch.sparse.mm`` of a COO
# adjacency: ``aten._sparse_addmm``; ``torch.sparse_coo_tensor`` built in the step:
# ``aten._sparse_coo_tensor_with_dims_and_tensors``) nor for ``torch.segment_reduce``.
# They were refused with DTensor's generic "replace the op with one DTensor supports, or
# register a sharding strategy", which says neither that sparse tensors are out nor what
# works instead (GNN probes, sixty-first session). The refusal names them and the dense
# ops that compile: message passing by ``index_add_`` / ``scatter_reduce`` over an
# edge_index or segment ids, or a dense matmul.
_SEGMENT_REDUCE = {torch.ops.aten.segment_reduce.default, torch.ops.aten._segment_reduce_backward.default}
_SPARSE_MESSAGE = (
    "Sparse tensors (torch.sparse_coo_tensor, torch.sparse.mm, Tensor.to_sparse, the CSR / "
    "CSC / BSR layouts) are not supported by the compiled step: its per-rank program is "
    "made of DTensor ops on dense (strided) tensors."
)
_SPARSE_HINT = (
    "keep the graph dense: pass its edges as an edge_index (2, E) and pass messages with "
    "index_add_ (out = torch.zeros_like(h).index_add_(0, ei[1], h[ei[0]] * w[:, None])), or "
    "scatter_reduce for a mean / max; or, for a small graph, multiply by a dense adjacency "
    "(A.to_dense() @ h)."
)
_SEGMENT_MESSAGE = (
    "torch.segment_reduce is not supported by the compiled step: DTensor has no sharding "
    "rule for it."
)
_SEGMENT_HINT = (
    "reduce by each element's segment id instead (a graph batch vector: segment i's "
    "elements hold i): torch.zeros(n, *x.shape[1:]).index_add_(0, ids, x) sums each "
    "segment (divide by its count, torch.zeros(n).index_add_(0, ids, torch.ones(len(ids))), "
    "for a mean), and torch.zeros(n, *x.shape[1:]).scatter_reduce_(0, ids[:, None]."
    "expand_as(x), x, 'amax', include_self=False) takes its max."
)


def _refuse_sparse_or_segments(n: torch.fx.Node, failure: str, exc: BaseException) -> None:
    """Raise the refusal of a sparse tensor or ``segment_reduce`` at ``n``, its message
    after ``failure`` (how expansion failed), if ``n`` is one (NOTE: [sparse tensors and
    segment_reduce refused])."""
    unsupported = _sparse_or_segments(n)
    if unsupported is not None:
        message, hint = unsupported
        raise node_error(failure + message, n, hint=hint) from exc


def _sparse_or_segments(n: torch.fx.Node) -> tuple[str, str] | None:
    """What to say, and what to do, where node ``n`` is ``torch.segment_reduce`` (or its
    gradient) or reads or makes a sparse tensor (NOTE: [sparse tensors and segment_reduce
    refused]); None for any other node."""
    if n.target in _SEGMENT_REDUCE:
        return _SEGMENT_MESSAGE, _SEGMENT_HINT
    values: list[Any] = [n.meta.get("val")] + [a.meta.get("val") for a in n.all_input_nodes]
    tensors = [t for v in values for t in (v if isinstance(v, (list, tuple)) else [v]) if isinstance(t, torch.Tensor)]
    if any(t.layout != torch.strided for t in tensors) or "sparse" in str(n.target).lower():
        return _SPARSE_MESSAGE, _SPARSE_HINT
    return None


_LAYOUT_HINT = (
    "the op cannot be placed on the layouts its inputs have here: compute it on values laid "
    "out otherwise (a parallel style's output_layouts, a redistribution before it), or leave "
    "the modules producing them out of the plan."
)
# where the mode split a step argument (before 2026-12-02 every failed expansion said
# this, tensor parallel too, which splits no argument)
_BATCH_DIM_HINT = (
    "where the op's input is a step argument whose dimension 0 is not its batch dimension "
    "(an unbatched (C, L) input, a time-major (T, N, C) sequence), name its batch dimension "
    "with the mode's input_batch_dim (DataParallel('replicate', input_batch_dim={'x': 1}); "
    "None passes it whole); otherwise " + _LAYOUT_HINT
)
# DTensor's view rule, where a view splits a sharded dimension into groups the ranks do
# not divide (3 attention heads of a colwise q projection over 2 tp ranks); torch 2.11's
# words for it, then 2.13's and 2.14's
_UNEVEN_UNFLATTEN = ("into multiple subdimensions", "Cannot unflatten unevenly sharded tensor")
_UNEVEN_HEADS_HINT = (
    "this view splits a dimension the mesh shards into groups its ranks do not divide: "
    "most often attention heads (or key / value heads under grouped-query attention) of "
    "column-wise q / k / v projections, fewer or not a multiple of the tp ranks. Use a tp "
    "size that divides the number of heads and of key / value heads, or leave those "
    "projections (and the row-wise output projection) out of the plan. Without attention, "
    "most often fixed-size blocks or groups that straddle two ranks' shards (block-wise or "
    "group-wise quantization: w.reshape(out, in // group, group), an optimizer state's "
    ".reshape(-1, block)): use a block size that divides each rank's share of that "
    "dimension, or leave that layer out of the plan (ddp and fsdp compute it as it is)."
)
# the same view of a batch a mode split (GRPO's ``rewards.view(-1, group)``, DPO's
# ``logps.view(2, -1)``): groups spanning ranks; before, the heads hint above was given.
# On a 1-D mesh (ddp, fsdp) such a view is computed on the gathered batch (NOTE: [groups
# spanning ranks gathered]); this is the hint on a 2-D mesh. Until the sixtieth session
# it blamed "a group larger than one rank's rows", which G = B (one group) is and
# compiles, and B=12, G=2 on 4 ranks (3 rows a rank) is not and was refused.
_UNEVEN_BATCH_HINT = (
    "this view splits a dimension the mesh shards into groups its ranks do not divide: "
    "with a batch split over the ranks, a number of groups (rewards.view(-1, group_size): "
    "batch / group_size groups) that is not a multiple of the ranks sharding the batch, so "
    "groups span ranks (one group of the whole batch works). ddp and fsdp compute such a "
    "view on the gathered batch; on this mesh make the number of groups a multiple of the "
    "batch's ranks (batch = k x ranks x group_size), or select without a view (chunk / "
    "slices work); under tensor parallel, the heads of column-wise q / k / v projections "
    "that the tp ranks do not divide."
)
_VIEWS = frozenset({torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default})


def _view_groups(before: Sequence[int], after: Sequence[int]) -> list[list[int]]:
    """The sizes of ``after`` each dimension of ``before`` is split into by a view
    (only where dimensions split or stay: a merge gives no group)."""
    groups: list[list[int]] = []
    j = 0
    for size in before:
        group: list[int] = []
        product = 1
        while j < len(after) and (product < size or (size == 1 and not group)):
            group.append(after[j])
            product *= after[j]
            j += 1
        groups.append(group if product == size else [])
    return groups


_ATEN = torch.ops.aten
# ops that keep each dimension where it is, and those that take a tensor's parts along a
# dimension (its position in their arguments, its default)
_SAME_DIMS = frozenset({_ATEN.clone.default, _ATEN.alias.default, _ATEN.detach.default,
                        _ATEN._to_copy.default})
_PARTS_ALONG = {
    _ATEN.unbind.int: (1, 0), _ATEN.select.int: (1, None), _ATEN.split.Tensor: (2, 0),
    _ATEN.split_with_sizes.default: (2, 0), _ATEN.chunk.default: (2, 0),
    _ATEN.slice.Tensor: (1, 0), _ATEN.narrow.default: (1, None),
    _ATEN.index_select.default: (1, None),
}


def _parts_taken_along(node: torch.fx.Node, dim: int, hops: int = 8) -> bool:
    """Whether the program takes ``node``'s parts along dimension ``dim`` (``unbind``,
    ``select``, ``split``, ``chunk``, slices), through permutes and transposes of it:
    what a fused layer's output is for (``q, k, v = qkv.unbind(2)``, ``qkv.permute(2,
    0, 3, 1, 4)`` then ``q, k, v = qkv``), and what attention heads are not."""
    value = node.meta.get("val")
    ndim = value.dim() if isinstance(value, torch.Tensor) else 0
    for user in node.users:
        if not user.args or user.args[0] is not node:
            continue
        if user.target in _PARTS_ALONG:
            position, default = _PARTS_ALONG[user.target]
            along = user.args[position] if len(user.args) > position else user.kwargs.get("dim", default)
            if isinstance(along, int) and along % max(ndim, 1) == dim:
                return True
        elif hops <= 0:
            continue
        elif user.target in _SAME_DIMS and _parts_taken_along(user, dim, hops - 1):
            return True
        elif user.target is _ATEN.permute.default and isinstance(user.args[1], (list, tuple)):
            order = [d % ndim if isinstance(d, int) else -1 for d in user.args[1]]
            if dim in order and _parts_taken_along(user, order.index(dim), hops - 1):
                return True
        elif (user.target is _ATEN.transpose.int and len(user.args) == 3
              and isinstance(user.args[1], int) and isinstance(user.args[2], int)):
            a, b = user.args[1] % ndim, user.args[2] % ndim
            moved = b if dim == a else a if dim == b else dim
            if _parts_taken_along(user, moved, hops - 1):
                return True
    return False


def _fused_view_hint(exc: BaseException, node: torch.fx.Node) -> str | None:
    """The hint for a view that splits a column-wise layer's output into three or more
    subdimensions whose leading one the ranks do not divide: a fused layer (nanoGPT's
    ``qkv(x).view(B, T, 3, h, dh)``: "output dimension 0 (size 3)" on 2 tp ranks); None
    otherwise (``view(B, T, h, dh)`` with heads the ranks do not divide keeps the heads
    hint). The heads hint blamed heads there, which 2 heads on 2 ranks divide
    (sixty-second session).

    The shapes alone cannot tell a fused layer's parts from heads: a plain q with 3 heads
    viewed as rotary pairs (``view(B, T, 3, dh // 2, 2)``) was told to use
    FusedColwiseParallel(chunks=3) (review of 8d45f0e). The fused hint is given where the
    program then takes the parts along that dimension (``_parts_taken_along``); otherwise
    the heads hint, naming the fused layer as the other reading."""
    found = re.search(r"output dimension 0 \(size (\d+)\) is not evenly divisible by mesh "
                      r"dimension \d+ \(size (\d+)\)", str(exc))
    source = node.args[0] if node.args else None
    before = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
    after = node.meta.get("val")
    if found is None or not isinstance(before, torch.Tensor) or not isinstance(after, torch.Tensor):
        return None
    chunks, ranks = int(found.group(1)), int(found.group(2))
    groups = _view_groups([int(d) for d in before.shape], [int(d) for d in after.shape])
    if not any(len(group) >= 3 and group[0] == chunks for group in groups):
        return None
    fused = (
        f"FusedColwiseParallel(chunks={chunks}) (spmd_compiler.parallel_modes), which gives "
        "each rank its block of each part (the heads must then divide by the tp ranks), "
        f"split it with .chunk({chunks}) (compiles under ColwiseParallel, with an "
        "all-gather), or leave it out of the plan."
    )
    starts, at = [], 0
    for group in groups:
        if not group:  # a merge: the dimensions after it cannot be placed
            break
        if len(group) >= 3 and group[0] == chunks:
            starts.append(at)
        at += len(group)
    if not any(_parts_taken_along(node, start) for start in starts):
        return (
            _UNEVEN_HEADS_HINT + f" If instead the {chunks} parts are a fused layer's (q, k "
            f"and v in one Linear), shard it with " + fused
        )
    return (
        f"this view splits a column-wise sharded output into {chunks} leading parts that "
        f"the {ranks} ranks do not divide, and the program takes them apart along that "
        f"dimension: a fused layer (q, k and v in one Linear) split by .view(B, T, {chunks}, "
        "heads, head_dim), where ColwiseParallel gives each rank a contiguous block of the "
        "fused output rather than its share of each part. Shard the layer with " + fused
    )

# NOTE: [views of a Python number]
# Autograd holds a Python number operand as a 0-d "wrapped number" tensor, and a
# formula's view of it (``mul``'s backward: ``grad * other.conj()``) is captured as a
# view of the number itself: ``aten._conj(1j)`` for ``(torch.fft.rfft(h) * 1j).real``.
# Plain torch computes that, but torch's LocalTensorMode (the simulated ranks) asserts
# that a view's input is a tensor ("Called aten._conj.default with input of type
# <class 'complex'>"): such a step compiled and then failed at its first call
# (2026-12-06). A view of a number shares storage with nothing, so the per-rank program
# takes it of a fresh 0-d tensor holding the number, in the captured value's dtype.
# Tested by tests/sim/test_complex_parameters.py.
_NUMBER_DTYPES = {bool: torch.bool, int: torch.int64, float: torch.float64, complex: torch.complex128}
_STRIDE_REFUSALS = ("Cannot view a tensor", "view size is not compatible with input tensor's size and stride")


# NOTE: [masked partials reduced before use]
# An embedding over a vocabulary-sharded table (a table tied to a planned head, the
# embedding itself unplanned) gives a ``_MaskPartial`` value: a sum pending over tp whose
# reduction first zeroes, by a mask shaped like the indices, the rows other ranks own,
# and then drops the mask. torch 2.11 carries the placement, mask and all, on through
# ops linear in it (the RMSNorm's ``x * rsqrt(...)``): a second value sharing the mask,
# whose own reduction then finds it gone (an assertion in DTensor), and whose rows, after
# an op that moves them (a transpose), the mask would no longer line up with. There every
# op reading such a value reads it reduced (``Replicate`` on that mesh dimension; one
# all-reduce, shared by every reader through the redistribution memo). torch 2.13 and
# 2.14 redistribute it at its first reader themselves (NOTE: [a masked partial
# redistributed twice] in ``_torch_private.py``); their programs are unchanged.
def _masked_partials_reduced(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    def masked(value: Any) -> bool:
        return isinstance(value, DTensor) and any(map(private.is_mask_partial, value.placements))

    if not any(map(masked, private.pytree.tree_leaves((args, kwargs)))):
        return args, kwargs

    def reduced(value: Any) -> Any:
        if not masked(value):
            return value
        placements = tuple(Replicate() if private.is_mask_partial(p) else p for p in value.placements)
        return value.redistribute(value.device_mesh, placements)

    return private.pytree.tree_map(reduced, (args, kwargs))


# NOTE: [low-precision partials rounded where reduced]
# Under ``torch.autocast`` a weight's gradient leaves backward in float16 (bfloat16) and
# autograd casts it up to the parameter's float32 (``_to_copy``, the backward of
# autocast's cast). One device computes that gradient's sum over the whole batch in the
# low precision: rounded once, inf where it passes float16's 65504. The ranks hold
# partial sums, which DTensor keeps partial through the cast and reduces in float32:
# never rounded, and finite where one device's overflows. With ``GradScaler`` that
# decided the step: ``nn.Linear(4, 2)`` on ``ones(8, 4)`` at scale 8192 gives 65536 on
# one device (inf: the step is skipped and the scale halved) and 32768 per rank of 2,
# reduced to a finite 65536 in float32 (the compiled step updated the weights and kept
# the scale; on data, an overflow eager skipped at call 7 was stepped, the parameters
# 6e-2 off eager's after 8 calls). So a cast up from float16 / bfloat16 of a pending
# sum (or of such a cast, through ops that move values without computing: views, copies,
# a zero pad) names its local tensor in the redistribution memo, and the redistribution
# that reduces its last pending mesh dimension rounds the reduced value to the low dtype
# and back (``_to_copy`` twice): one device's ``fp32(fp16(sum))``. The reduction itself
# stays in the wide dtype, as before: the sum of the partials, rounded once, as one
# device's kernel accumulates and rounds once. Steps with no low-precision partial get no
# extra op. Not under a mode's mixed-precision policy (``DataParallel(mp_policy=...)``
# with a ``param_dtype``): there the gradients are reduced in its ``reduce_dtype`` and
# kept so, as FSDP2 keeps them (``ParallelMode.rounds_low_precision_sums``). Not
# matched: partials that overflow where their sum does not (+inf on one rank, -inf on
# another: NaN where one device's sum is finite), and a pending sum that an op computes
# on before its reduction (two backward calls accumulating into ``.grad``): README's
# Limitations. Tested by tests/sim/test_autocast_reductions.py.
_UPCASTS = frozenset({
    torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default,
    torch.ops.aten.to.dtype, torch.ops.aten.to.dtype_layout,
})
_LOW_PRECISION = frozenset({torch.float16, torch.bfloat16})
# ops whose result rounds as their input does: an element moved, copied or zero
_ROUNDING_KEPT = frozenset({
    torch.ops.aten.t.default, torch.ops.aten.transpose.int, torch.ops.aten.permute.default,
    torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default,
    torch.ops.aten.clone.default, torch.ops.aten.alias.default, torch.ops.aten.contiguous.default,
    torch.ops.aten.squeeze.dim, torch.ops.aten.unsqueeze.default,
    torch.ops.aten.constant_pad_nd.default,
})


def _low_precision_sum(
    memo: private.RedistributionCache, target: Any, args: tuple, result: Any,
) -> torch.dtype | None:
    """The dtype ``result``'s pending sum rounds to once reduced (see the NOTE), or None."""
    if not (args and isinstance(args[0], DTensor) and isinstance(result, DTensor)):
        return None
    if not any(p.is_partial() and getattr(p, "reduce_op", "sum") in ("sum", "avg") for p in result.placements):
        return None
    source = args[0]
    low = memo.rounding_of(private.local_tensor_of(source))
    if target in _UPCASTS:
        low = low or (source.dtype if any(p.is_partial() for p in source.placements) else None)
        wider = result.dtype.is_floating_point and result.dtype.itemsize > source.dtype.itemsize
        return low if low in _LOW_PRECISION and wider else None
    if target is torch.ops.aten.constant_pad_nd.default and len(args) > 2 and args[2] != 0:
        return None
    return low if target in _ROUNDING_KEPT else None


class _ExpandingInterpreter(RetracingInterpreter):
    def __init__(
        self,
        captured: CapturedStep,
        mesh: DeviceMesh,
        placement_at_use: UseHook | None,
        memo: private.RedistributionCache,
        rules: LocalRules | None = None,
        gradient_placement: Callable[[str], Placements | None] | None = None,
        gradient_rows: Callable[[str], Placements | None] | None = None,
        iterations: BatchIterations | None = None,
        round_low_precision_sums: bool = True,
    ) -> None:
        super().__init__(captured.graph_module, on_node=self._record)
        self.round_low_precision_sums = round_low_precision_sums
        # our errors name the node, op and train-step line: torch's "While executing ...
        # Original traceback ... Use tlparse" appended to them repeated those in its terms
        self.extra_traceback = False
        self.iterations = iterations or BatchIterations(captured.graph_module.graph)
        self.input_refs = [ref for ref, _ in captured.inputs]
        # whether the mode split a tensor argument of the step (data parallel), set as the
        # placeholders are read: only then can naming its batch dimension be the way out
        # of a failed expansion
        self.split_an_argument = False
        self._placeholders_read = 0
        self.mesh = mesh
        self.rules = rules
        self.memo = memo
        self.placement_at_use = placement_at_use
        self.gradient_placement = gradient_placement
        self.at_use: dict[tuple[torch.fx.Node, tuple[UseGroup, str]], DTensor] = {}
        self.narrowed = _gradients_computed_narrow(captured.graph_module.graph, gradient_rows)
        self._node: torch.fx.Node | None = None

    def fetch_args_kwargs_from_env(self, n: torch.fx.Node) -> tuple[tuple, dict]:
        if self.placement_at_use is None and self.gradient_placement is None:
            args, kwargs = super().fetch_args_kwargs_from_env(n)
        else:
            args = tuple(torch.fx.node.map_arg(n.args, lambda a: self._value_at_use(n, a)))
            kwargs = dict(torch.fx.node.map_arg(n.kwargs, lambda a: self._value_at_use(n, a)))
        return private.arguments_for_dtensor_rules(n.target, args, kwargs)

    def _value_at_use(self, consumer: torch.fx.Node, arg: torch.fx.Node) -> Any:
        value = self.env[arg]
        if self.gradient_placement is not None and isinstance(value, DTensor):
            value = self._settled_gradient(consumer, arg, value)
        steps = self.placement_at_use(consumer, arg) if self.placement_at_use else None
        if not steps or not isinstance(value, DTensor):
            return value
        for step in steps:
            if not isinstance(step, UseStep):
                raise TypeError(
                    f"the mode's placement_at_use returned {step!r} for {consumer.name} reading "
                    f"{arg.name}; return a list of UseStep (spmd_compiler.parallel_modes)"
                )
            key = (arg, step.key)
            if key not in self.at_use:
                self.at_use[key] = self._redistribute(value, step)
            value = self.at_use[key]
        return value

    def _settled_gradient(self, consumer: torch.fx.Node, arg: torch.fx.Node, value: DTensor) -> DTensor:
        """A marked gradient read outside backward, in its mode's placement, reduced once
        (NOTE: [gradients settle after backward] in ``capture/gradients.py``); a gradient
        padded for uneven shards, at its pad (NOTE: [padded gradients settle at their
        pad])."""
        name = settled_gradient_name(consumer, arg)
        if name is None:
            return value
        key = (arg, (UseGroup.REDUCE, "gradient"))
        if key not in self.at_use:
            self.at_use[key] = self._settle(value, name)
        return self.at_use[key]

    # NOTE: [padded gradients settle at their pad]
    # A gradient settles in its mode's placement where backward leaves it, except where
    # that placement is an uneven shard (the parameter's rows do not divide the ranks):
    # the padding of uneven state (NOTE: [uneven shards] in parallel_modes/padding.py)
    # zero-pads the gradient where the optimizer reads it, and only the padded value
    # splits evenly. Before, that pad stayed partial and DTensor reduced it at each use:
    # Adagrad's and RMSprop's ``addcdiv(grad, std, value=-lr)`` multiplies the padded
    # gradient by ``-lr`` (linear: still partial) before its reduce-scatter, beside the
    # one ``addcmul(grad, grad)`` needed, so every uneven gradient was reduce-scattered
    # twice (DLRM with tables of 1001, 7 and 11 rows, fsdp on 2 ranks: 134,736 gradient
    # bytes per step against SGD's 69,328). Padding names the parameter on its pad
    # (``PADDED_GRADIENT``) and the pad's readers get it settled, once, like a marked
    # gradient's: the padded rows split evenly. A zero pad of a partial sum is the
    # partial sum of the zero pads, so it is the same value.
    def _settle(self, value: DTensor, name: str) -> DTensor:
        assert self.gradient_placement is not None
        target = self.gradient_placement(name)
        if target is None or not any(p.is_partial() for p in value.placements):
            return value
        for mesh_dim, p in enumerate(target):  # an uneven shard: as DTensor propagates it
            if isinstance(p, Shard) and value.shape[p.dim] % self.mesh.size(mesh_dim):
                return value
        with self.memo.bypass():
            return value.redistribute(self.mesh, tuple(target))

    def _redistribute(self, value: DTensor, step: UseStep) -> DTensor:
        """``value`` as ``step`` wants it, traced as its own redistribution."""
        if step.redistribute is not None:  # the mode redistributes itself
            with self.memo.bypass():
                return step.redistribute(value)
        assert step.placements is not None
        # None keeps the value's current placement on that mesh dimension
        placements = tuple(
            current if want is None else want
            for current, want in zip(value.placements, step.placements, strict=True)
        )
        if tuple(value.placements) == placements:
            return value
        with self.memo.bypass():  # each key gets its own redistribution
            return value.redistribute(self.mesh, placements)

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        if target is GRADIENT:  # NOTE: [gradients settle after backward]: read through
            return args[0]
        # NOTE: [Python numbers in DTensor's native sharding cache]
        with private.numbers_kept_out_of_sharding_cache(args, kwargs):
            result = self._call_function(target, args, kwargs)
        low = _low_precision_sum(self.memo, target, args, result) if self.round_low_precision_sums else None
        if low is not None:  # NOTE: [low-precision partials rounded where reduced]
            self.memo.round_when_reduced(private.local_tensor_of(result), low)
        return result

    def _call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        if self._node is not None:  # NOTE: [a batch dimension iterated over]
            self.iterations.op(self._node, target, args, kwargs)
        if private.derived_values_share_masks():
            args, kwargs = _masked_partials_reduced(args, kwargs)
        if self._node in self.narrowed:
            args = _narrowed_matmul(args, self.narrowed[self._node], self.mesh)
        if self.rules is not None:
            result = self.rules.apply(target, args, kwargs)
            if result is not None:
                return result
        if target in _VIEWS and args and isinstance(args[0], DTensor):
            return self._view(target, args, kwargs)
        if (
            private.is_op_overload(target) and args and type(args[0]) in _NUMBER_DTYPES
            and target._schema._is_view_op()
        ):
            args = (self._number_as_tensor(args[0]), *args[1:])
        if private.is_op_overload(target) and private.has_complex_number(args, kwargs):
            return self._with_complex_number(target, args, kwargs)
        return super().call_function(target, args, kwargs)

    def _number_as_tensor(self, number: Any) -> torch.Tensor:
        """NOTE: [views of a Python number]: the 0-d tensor autograd held for ``number``,
        of the dtype the captured view has (a wrapped number's otherwise)."""
        captured = self._node.meta.get("val") if self._node is not None else None
        dtype = captured.dtype if isinstance(captured, torch.Tensor) else _NUMBER_DTYPES[type(number)]
        return torch.ops.aten.scalar_tensor.default(number, dtype=dtype)

    def _with_complex_number(self, target: Any, args: tuple, kwargs: dict) -> Any:
        """NOTE: [complex numbers in DTensor's dispatch]: the op through DTensor's Python
        dispatch steps, which can key a Python ``complex``."""
        why = private.complex_number_dispatch_unsupported(target)
        if why is not None:
            message = (f"DTensor cannot dispatch {target} with a Python complex number argument "
                       f"(its native sharding cache cannot key one), and {why}.")
            hint = "pass the complex number as a tensor (torch.tensor(c)) or apply the op out of place."
            if self._node is None:
                raise SPMDCompileError(f"{message} {hint}")
            raise node_error(message, self._node, hint=hint)
        return private.dispatch_with_complex_number(target, args, kwargs)

    def _view(self, target: Any, args: tuple, kwargs: dict) -> Any:
        """NOTE: [views on strides that functionalization misreports]: the captured graph
        is functional, but ``torch.func.functionalize`` reports a view of a regenerated
        base (an in-place write to a view, replayed as a scatter and the view again) with
        the strides the view had before, not those of the ops it recorded. A ``view``
        traced on those strides can fail on the real ones (Longformer's backward: "Cannot
        view a tensor ..."). With no mutation in the graph a copy is the same value, so
        such a view is taken of a contiguous copy; the failed attempt's nodes are dead.
        The same holds where a rank's shard has other strides than the whole tensor the
        capture saw: a tensor-parallel activation transposed so that its sharded dimension
        moves, whose gradient the Linear's backward views (2026-12-02: refused before, with
        the ``ValueError`` a view of a local tensor raises)."""
        if args[0].numel() == 0:
            return self._empty_view(target, args, kwargs)
        try:
            return super().call_function(target, args, kwargs)
        except (RuntimeError, ValueError) as exc:
            if self._groups_spanning_ranks(exc, args[0]):
                return self._view_of_the_whole_batch(target, args, kwargs)
            if not any(text in str(exc) for text in _STRIDE_REFUSALS):
                raise
        # a copy always (``contiguous()`` reads the whole tensor's strides, which may call
        # it contiguous where the rank's shard is not)
        copied = torch.ops.aten.clone.default(args[0], memory_format=torch.contiguous_format)
        return super().call_function(target, (copied, *args[1:]), kwargs)

    def _groups_spanning_ranks(self, exc: Exception, value: DTensor) -> bool:
        """Whether ``exc`` is DTensor's refusal of a view that splits a batch a 1-D data
        parallel mesh shards into groups the ranks do not divide (NOTE: [groups spanning
        ranks gathered])."""
        return (
            self.split_an_argument
            and self.mesh.ndim == 1
            and any(text in str(exc) for text in _UNEVEN_UNFLATTEN)
            and any(p.is_shard() for p in value.placements)
        )

    def _view_of_the_whole_batch(self, target: Any, args: tuple, kwargs: dict) -> Any:
        """NOTE: [groups spanning ranks gathered]
        GRPO's group normalisation ``rewards.view(-1, G)`` (DPO's ``logps.view(2, -1)``) of
        a batch split over the ranks gives ``B / G`` groups; where the ranks do not divide
        that number (B=8, G=4 on 4 ranks: 2 groups, 2 rows a rank), groups span ranks and
        DTensor refuses the view ("Cannot unflatten unevenly sharded tensor"). Where
        ``B / G`` is a multiple of the ranks each rank holds whole groups, and one group
        (G=B) is a size-1 dimension with the batch sharded after it: both compile as they
        are. Here the value is gathered (Shard -> Replicate, an all-gather of that tensor)
        and viewed whole: the same numbers on every rank, which the ops after it slice
        again where they meet batch-sharded values. Only on a 1-D mesh a mode split an
        argument on (ddp, fsdp): under tensor parallel the same refusal is most often
        attention heads a plan shards, whose gathering would repeat the attention on
        every tp rank; that stays refused with its hint. Cost: one all-gather of the
        viewed tensor (a reward vector: B numbers)."""
        value = args[0]
        whole = tuple(Replicate() if p.is_shard() else p for p in value.placements)
        gathered = value.redistribute(self.mesh, whole)
        return super().call_function(target, (gathered, *args[1:]), kwargs)

    def _empty_view(self, target: Any, args: tuple, kwargs: dict) -> Any:
        """A view of a tensor with no elements: a new empty tensor of the view's shape,
        replicated. DTensor's view rule never returns on some such shapes (its
        ``view_groups`` loops forever on ``[0, 4] -> [0]``, torch 2.11 to 2.14: an empty
        batch flattened hung the compile, 2026-12-02); with no element there is nothing
        for a view to share, so a new tensor is the same value."""
        with private.outside_the_trace():  # the view's shape, -1 resolved, on meta
            shape = target(torch.empty(tuple(args[0].shape), device="meta"), *args[1:], **kwargs).shape
        return super().call_function(torch.ops.aten.new_empty.default, (args[0], list(shape)), {})

    def run_node(self, n: torch.fx.Node) -> Any:
        progress.current().advance()
        self._node = n
        try:
            return super().run_node(n)
        except SPMDCompileError:
            raise
        except NotImplementedError as exc:
            _refuse_sparse_or_segments(n, f"DTensor has no sharding rule for this op: {str(exc).splitlines()[0]} ", exc)
            budget = private.budget_exceeded_in(exc)
            if budget is not None:
                raise node_error(
                    f"DTensor has no sharding rule for {budget.op}, and its "
                    f"decomposition-based sharding search did not finish within "
                    f"{budget.seconds:g} s ({budget.attempts} placement combinations); "
                    "refused rather than searching for minutes.",
                    n,
                    hint="replace the op with ops DTensor has rules for, or register a "
                    "sharding strategy for it (torch.distributed.tensor.experimental."
                    "register_sharding).",
                ) from exc
            if getattr(n.target, "namespace", None) in _FUNCTIONAL_COLLECTIVES:
                # NOTE: [torch.distributed inside the step]: the functional collectives
                # (torch.distributed._functional_collectives) trace as ops, not as calls
                # the capture answers; "register a sharding strategy" misled there
                raise node_error(
                    f"The train step calls a functional collective ({n.target}, from "
                    "torch.distributed._functional_collectives): a compiled step is traced as "
                    "one device on the global batch, where every value is already global, "
                    "so there is nothing for it to reduce or gather.",
                    n,
                    hint="drop the collective (and any division by the world size after it); "
                    "the parallel mode's placements insert the collectives the program needs. "
                    "(NOTE: [torch.distributed inside the step])",
                ) from exc
            gradient = phase(n) is Phase.BACKWARD
            raise node_error(
                f"DTensor has no sharding rule for this op: {str(exc).splitlines()[0]}"
                + (" It is an op of the backward pass (autograd's gradient of a forward op, "
                   "run by the train step's backward line), not one the step calls itself."
                   if gradient else ""),
                n,
                hint=("replace the forward op whose gradient this is (torch.take's gradient is an "
                      "aten.put, for one) with ops DTensor supports, or register a "
                      "sharding strategy for it (torch.distributed.tensor.experimental.register_sharding)."
                      if gradient else
                      "replace the op with one DTensor supports, or register a sharding "
                      "strategy for it (torch.distributed.tensor.experimental.register_sharding)."),
            ) from exc
        except Exception as exc:  # noqa: BLE001 - re-raised with the node named
            _refuse_sparse_or_segments(n, f"Expanding this node to the per-rank program failed: {exception_summary(exc)}. ", exc)
            hint = _BATCH_DIM_HINT if self.split_an_argument else _LAYOUT_HINT
            if n.target in _VIEWS and any(text in str(exc) for text in _UNEVEN_UNFLATTEN):
                hint = _UNEVEN_BATCH_HINT if self.split_an_argument else (
                    _fused_view_hint(exc, n) or _UNEVEN_HEADS_HINT)
            raise node_error(
                f"Expanding this node to the per-rank program failed: {exception_summary(exc)}",
                n, hint=hint,
            ) from exc

    def placeholder(self, target: Any, args: tuple, kwargs: dict) -> Any:
        value = super().placeholder(target, args, kwargs)
        ref = self.input_refs[self._placeholders_read] if self._placeholders_read < len(self.input_refs) else None
        self._placeholders_read += 1
        if ref is not None and ref.kind is Kind.INPUT and isinstance(value, DTensor):
            self.split_an_argument |= any(p.is_shard() for p in value.placements)
            if any(p.is_shard() for p in value.placements):
                private.split_argument_read(value)
            if self._node is not None:
                self.iterations.argument(self._node, ref.name or str(ref), value)
        return value

    def _record(self, source: torch.fx.Node, result: Any, created: list[torch.fx.Node]) -> Any:
        result = _wrap_tree(result, self.mesh)
        values = result if isinstance(result, (list, tuple)) else [result]
        captured = source.meta.get("val")
        captured = captured if isinstance(captured, (list, tuple)) else [captured]
        for i, value in enumerate(values):
            if isinstance(value, DTensor):
                if len(captured) == len(values):
                    _check_global_shape(source, value, captured[i])
                _check_local_shape(source, value, self.iterations)
                node = private.traced_node_of(private.local_tensor_of(value))
                if node is not None and node in created:
                    node.meta[PLACEMENT] = tuple(value.placements)
        return result


# NOTE: [weight gradients computed on the rows kept]
# A Linear whose output a tensor-parallel plan replicates (``ColwiseParallel(
# output_layouts=Replicate())``, transformers' ``colwise_rep``: the head of most of its
# plans) gets the output gradient whole on every tp rank, and DTensor computed the weight
# gradient ``mm(t(grad_out), x)`` whole from it (no redistribution either way), to be
# sliced to the rank's rows where the update reads it: tp times that matmul's work (the
# head's: vocabulary x width x tokens). Where a parameter's gradient is that ``mm``
# (through transposes only) and the gradient settles sharded on a mesh dimension where
# both operands are replicated, the operand holding the sharded dimension is sliced
# first (a local slice, no collective) and the ``mm`` computes the rank's rows only: the
# same values, 1/tp of the work. The mode names where gradients end
# (``ParallelMode.gradient_rows``): on a 1-D mesh where they settle, under FSDP x TP the
# parameter's TP rows (its gradient is then reduce-scattered over dp at the update; the
# operands are batch-sharded on dp, so only tp narrows).
_TRANSPOSES = (torch.ops.aten.t.default,)


def _gradients_computed_narrow(
    graph: torch.fx.Graph, gradient_rows: Callable[[str], Placements | None] | None
) -> dict[torch.fx.Node, list[tuple[int, int]]]:
    """``mm`` node -> [(mesh dim, output dim)] to compute sharded: see the NOTE."""
    if gradient_rows is None:
        return {}
    narrowed: dict[torch.fx.Node, list[tuple[int, int]]] = {}
    for node in graph.nodes:
        name = marked_gradient(node)
        if name is None or not isinstance(node.args[0], torch.fx.Node):
            continue
        source, flipped = node.args[0], False
        while source.target in _TRANSPOSES and len(source.users) == 1 and isinstance(source.args[0], torch.fx.Node):
            source, flipped = source.args[0], not flipped
        if source.target is not torch.ops.aten.mm.default or len(source.users) != 1:
            continue
        target = gradient_rows(name) or ()
        dims = [(m, 1 - p.dim if flipped else p.dim) for m, p in enumerate(target)
                if type(p) is Shard and p.dim in (0, 1)]
        if dims:
            narrowed[source] = dims
    return narrowed


def _narrowed_matmul(args: tuple, dims: list[tuple[int, int]], mesh: DeviceMesh) -> tuple:
    """``mm``'s operands with the one holding each output dim sharded on its mesh dim,
    where both are replicated there and the dim splits evenly (see the NOTE)."""
    operands = list(args[:2])
    if not all(isinstance(a, DTensor) for a in operands):
        return args
    for mesh_dim, out_dim in dims:
        if not all(isinstance(a.placements[mesh_dim], Replicate) for a in operands):
            continue
        # output rows come from the first operand's rows, columns from the second's
        if operands[out_dim].shape[out_dim] % mesh.size(mesh_dim):
            continue
        placements = list(operands[out_dim].placements)
        placements[mesh_dim] = Shard(out_dim)
        operands[out_dim] = operands[out_dim].redistribute(mesh, tuple(placements))
    return (*operands, *args[2:])


# NOTE: [local shape check]
# DTensor runs an op's local kernel with the op's non-tensor arguments as the single-device
# graph has them. Where such an argument is a size read off a global shape (group norm's
# N, C and HxW; DTensor adjusts views, factories and the ops it knows, not an op whose
# rule it derived from the op's decomposition), the local kernel computes on a wrong
# shape: it fails, or it returns a tensor of the wrong local size, which is a wrong
# result downstream. Every output is therefore checked against the local shape its
# placements imply, and every output's global shape against the single-device value's
# (padded where a mode pads it, NOTE: [uneven shards]); a mismatch is refused with the
# node named. The second check found a value the padding had missed (an updated weight
# read again after ``optimizer.step()``). A dimension sharded unevenly has a local size
# that depends on the rank, and is not compared; until 2026-12-02 such an output was not
# checked at all, so a wrong rule placing a result on a size-1 dimension went unseen
# while its other dimensions were plainly wrong (``cdist`` between inputs of different
# ranks: a batch-sized dimension half the batch).
def _check_global_shape(source: torch.fx.Node, value: DTensor, captured: Any) -> None:
    """The DTensor's global shape is the captured value's (the padded size along the
    padded dim of a value a mode holds padded): NOTE: [local shape check]."""
    if not isinstance(captured, torch.Tensor):
        return
    expected = list(captured.shape)
    padding = source.meta.get(PADDED)
    if padding is not None and len(expected) > padding[2]:
        expected[padding[2]] = padding[1]
    if tuple(value.shape) == tuple(expected):
        return
    padded = _padded_ancestor(source)
    hint = (
        "this is a bug in spmd_compiler or in the parallel mode; please report it with the step."
        if padded is None else
        f"it computes from a value the mode holds padded ({padded[0]} rows of dimension "
        f"{padded[2]} stored as {padded[1]}: a size its ranks do not divide), through "
        "ops that move the padded dimension (a transpose into a matrix product: Muon's "
        "Newton-Schulz, a whitening); give that dimension a size the ranks divide (a "
        "vocabulary padded to a multiple of the tp degree), or leave its module out of the plan."
    )
    raise node_error(
        f"Expanding this op gave a value of global shape {tuple(value.shape)}, where the "
        f"single-device step computes shape {tuple(expected)}: refused rather than "
        "computing on the wrong shape (NOTE: [local shape check]).",
        source,
        hint=hint,
    )


def _padded_ancestor(source: torch.fx.Node) -> tuple[int, int, int] | None:
    """The ``PADDED`` meta (true size, padded size, dim) of the nearest value ``source``
    computes from that a mode holds padded, or None."""
    seen, todo = {source}, [source]
    while todo:
        node = todo.pop(0)
        padding = node.meta.get(PADDED) if node is not source else None
        if padding is not None:
            return padding
        for parent in node.all_input_nodes:
            if parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return None


def _check_local_shape(source: torch.fx.Node, value: DTensor, iterations: BatchIterations) -> None:
    local = tuple(private.local_tensor_of(value).shape)
    expected = private.local_sizes_where_even(tuple(value.shape), value.device_mesh, value.placements)
    if expected is None or len(expected) != len(local) or all(
        want is None or type(got) is not int or got == want for got, want in zip(local, expected)
    ):
        return
    shown = tuple("?" if want is None else want for want in expected)
    split = sorted(iterations.reaching(source))
    # samples of a list stacked (a convolution over their split time dimension): that
    # is what went wrong, and what to say (NOTE: [samples of a list stacked])
    stacked = [r for r in iterations.stacked if set(r.items) & set(split)]
    if stacked:
        raise stacked_samples_error(next((r for r in stacked if r.padded), stacked[0]))
    named = (
        "if " + ", ".join(repr(a) for a in split) + (" holds" if len(split) == 1 else " hold")
        + " the batch on another dimension "
        "than the one the mode splits (a time-major (T, B, ...) argument is split along "
        "time), name it: input_batch_dim={" + ", ".join(f"{a!r}: <its batch dimension>" for a in split)
        + "}; otherwise " if split else ""
    )
    raise node_error(
        f"DTensor computed this op's local result with shape {local}, where its "
        f"placement {format_placements(value.placements)} of the global shape "
        f"{tuple(value.shape)} means {shown} (?: unevenly sharded, by rank): an argument of the op is a size read off "
        "the global shape, which DTensor passed to the local kernel unchanged. Refused "
        "rather than computing on the wrong shape (NOTE: [local shape check]).",
        source,
        hint=f"{named}register a sharding strategy that localizes the op's size arguments, "
        "or replace the op with ops DTensor adjusts (views, reshapes).",
    )


def _wrap_tree(result: Any, mesh: DeviceMesh) -> Any:
    if isinstance(result, (list, tuple)):
        return type(result)(_as_dtensor(r, mesh) for r in result)
    return _as_dtensor(result, mesh)
