"""DataParallel: replicate (DDP) or fully shard (FSDP / ZeRO-3) the training state.

NOTE: [fully_shard as placements]
fully_shard keeps every parameter, gradient and optimizer-state tensor Shard(0) on the
mesh. The per-rank program then gathers a parameter where forward or backward reads it
(``placement_at_use``: Replicate at each use outside the optimizer, one all-gather per
parameter and group; a parameter updated by an ``optimizer.step()`` inside the step and
read again after it, by a second forward, is gathered at those uses the same way; an
element-wise update of state outside forward and backward, an EMA of the weights, is
computed on the shards) and the gradient, Partial after backward, meets the Shard(0)
optimizer state, which DTensor resolves with a reduce-scatter. With
``reshard_after_forward`` forward and backward are separate groups (two all-gathers per
parameter, the forward copy freed after its last forward use); views of a parameter
that forward made and backward reuses (``t(weight)``) are re-made from the backward
gather, so no gathered parameter lives across the forward/backward boundary.
"""

from __future__ import annotations

import dataclasses
import enum
import operator
from collections.abc import Mapping
from typing import Literal

import torch
import torch.fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from spmd_compiler import _torch_private as private
from spmd_compiler.capture.bindings import StepBindings
from spmd_compiler.capture.gradients import marked_gradient
from spmd_compiler.capture.trace import CaptureOptions
from spmd_compiler.expand.retrace import DistributedProgram, Placements
from spmd_compiler.ir.graph_utils import node_arg, placeholders
from spmd_compiler.ir.node_meta import (
    MODULE_FQN,
    OPTIMIZER_PHASE,
    PHASE,
    Phase,
    in_module_forward,
    phase,
)
from spmd_compiler.ir.signature import CapturedStep, Kind, StateRef, TensorMeta
from spmd_compiler.ir.use_step import UseGroup, UseHook, UseStep
from spmd_compiler.passes import OverlapOptions, PassOptions

from .base import ParallelMode, replicate
from .batch_dims import (
    BatchDims,
    batch_dim_of,
    check_batch_dim_names,
    check_batch_iterations,
    check_list_arguments,
    checked_batch_dims,
)
from .local_indices import IndexOf, checked_index_of
from .mixed_precision import MixedPrecisionPolicy
from .padding import elementwise_op, pad_uneven_state

Style = Literal["replicate", "fully_shard"]


class _Default(enum.Enum):
    """An option left at its default (told apart from the same value given)."""

    DEFAULT = "default"

    def __repr__(self) -> str:
        return "<default>"


_DEFAULT = _Default.DEFAULT

# Ops that only re-view or re-type a parameter; forward's results of these are re-made
# in backward from the backward gather (NOTE: [fully_shard as placements]).
_PARAM_VIEW_OPS = {
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.t.default,
    torch.ops.aten.view.default,
    torch.ops.aten.reshape.default,
    torch.ops.aten.transpose.int,
    torch.ops.aten.permute.default,
    torch.ops.aten.expand.default,
    torch.ops.aten.unsqueeze.default,
    torch.ops.aten.squeeze.dim,
    torch.ops.aten._to_copy.default,
}


class DataParallel(ParallelMode):
    """Data parallelism: every rank trains on its share of the global batch.

    Args:
        style: ``"replicate"`` (DDP: state Replicate, gradients all-reduced) or
            ``"fully_shard"`` (FSDP: state Shard(0), parameters gathered at use,
            gradients reduce-scattered).
        input_batch_dim: the dimension of each tensor argument that holds the batch:
            one for all, or ``{argument name: dimension}`` for the arguments whose batch
            lies elsewhere, with None for one that holds no batch (every rank passes the
            same whole tensor: class weights, a table); arguments not named use 0. Names
            as the step's signature has them, ``batch['mask']`` inside one (NOTE:
            [inputs by name] in ``parallel_modes/batch_dims.py``).
        input_index_of: ``{index argument: argument it indexes}`` for integer arguments
            whose values index the batch dimension of another split argument
            (``{'edge_index': 'x', 'batch': 'y'}``: a graph's node ids into the node
            features, each node's graph id into the labels), numbered from 0 on each rank
            as a torch-DDP script's per-rank collate makes them. Without it such values are
            read as ids into the global batch. On real ranks each rank's ids are moved by
            rank * the indexed argument's local size along its batch dimension before the
            program runs; in simulation the global batch is passed, ids global, and nothing
            is added (NOTE: [indices into the global batch] in
            ``parallel_modes/local_indices.py``).
        mesh: a 1-D mesh; by default all ranks of the default process group.
        reshard_after_forward: fully_shard only: free gathered parameters after
            forward and gather them again in backward.
        mp_policy: mixed precision (``MixedPrecisionPolicy``): parameters are cast to
            ``param_dtype`` before they are gathered, compute runs in it, gradients are
            reduced in ``reduce_dtype``; master weights and optimizer state stay fp32.
            torch's own ``torch.distributed.fsdp.MixedPrecisionPolicy`` is converted
            (its ``output_dtype`` and ``cast_forward_inputs=False`` refused).
        prefetch_depth: fully_shard only: how many all-gather buckets may run ahead of
            the one in use (NOTE: [FSDP prefetch] in ``passes/schedule_overlap.py``); 1
            is FSDP2's prefetch of the next unit, None issues every gather as early as
            the in-flight cap allows. Merged into ``schedule_overlap``'s options unless
            they give a ``prefetch_depth`` themselves (refused if that differs from one
            given here).
    """

    def __init__(
        self,
        style: Style = "replicate",
        *,
        input_batch_dim: BatchDims | None = None,
        input_index_of: IndexOf | None = None,
        mesh: DeviceMesh | None = None,
        reshard_after_forward: bool = True,
        mp_policy: MixedPrecisionPolicy | None = None,
        prefetch_depth: int | None | _Default = _DEFAULT,
    ) -> None:
        if style not in ("replicate", "fully_shard"):
            raise ValueError(f"DataParallel style must be 'replicate' or 'fully_shard', got {style!r}")
        if mesh is not None and mesh.ndim != 1:
            raise ValueError(f"DataParallel takes a 1-D mesh, got a {mesh.ndim}-D mesh {mesh}")
        if prefetch_depth is not None and not isinstance(prefetch_depth, _Default) and (
            isinstance(prefetch_depth, bool) or not isinstance(prefetch_depth, int) or prefetch_depth < 0
        ):  # refused here, not at the first call's schedule_overlap
            raise ValueError(
                f"DataParallel prefetch_depth must be an int >= 0 (1: FSDP2's prefetch of the "
                f"next unit) or None (no limit), got {prefetch_depth!r}"
            )
        fsdp_only = {
            name: value
            for name, value, default in (
                ("reshard_after_forward", reshard_after_forward, True),
                ("prefetch_depth", prefetch_depth, 1),
            )
            if value is not _DEFAULT and value != default
        }
        if style == "replicate" and fsdp_only:
            # they were taken and dropped: nothing is gathered to reshard or prefetch
            given = ", ".join(f"{k}={v!r}" for k, v in fsdp_only.items())
            raise ValueError(
                f"DataParallel('replicate', {given}): these options apply to 'fully_shard' "
                "only (replicate gathers no parameters); drop them or use 'fully_shard'."
            )
        super().__init__(mesh)
        # NOTE: [prefetch depth beside other overlap options]: whether the caller chose it
        self._prefetch_depth_given = not isinstance(prefetch_depth, _Default)
        if isinstance(prefetch_depth, _Default):
            prefetch_depth = 1  # FSDP2's prefetch of the next unit
        self.style = style
        self.input_batch_dim = checked_batch_dims(0 if input_batch_dim is None else input_batch_dim)
        # NOTE: [a batch dimension iterated over]: whether the dimension was chosen
        self.batch_dim_given = input_batch_dim is not None
        self.input_index_of = checked_index_of(input_index_of)
        self.reshard_after_forward = reshard_after_forward
        self.mp_policy = MixedPrecisionPolicy.of(mp_policy) if mp_policy is not None else MixedPrecisionPolicy()
        self.prefetch_depth: int | None = prefetch_depth
        self.name = "ddp" if style == "replicate" else "fsdp"

    @property
    def sharded(self) -> bool:
        return self.style == "fully_shard"

    def prepare(self, bindings: StepBindings) -> None:
        check_batch_dim_names(self.input_batch_dim, bindings, self)

    def local_index_inputs(self) -> dict[str, str]:
        return self.input_index_of

    def capture_options(self) -> CaptureOptions:
        return CaptureOptions(param_dtype=self.mp_policy.param_dtype)

    def rounds_low_precision_sums(self) -> bool:
        """Not under a ``param_dtype`` policy: its gradients are reduced in
        ``reduce_dtype`` and kept as reduced, as FSDP2 keeps them (a float32
        ``reduce_dtype`` is asked for to not round the sum to ``param_dtype``)."""
        return self.mp_policy.param_dtype is None

    def placement_of(self, ref: StateRef, meta: TensorMeta, mesh: DeviceMesh) -> Placements:
        if ref.kind is Kind.INPUT:
            dim = batch_dim_of(self.input_batch_dim, ref, meta)
            return replicate(mesh) if dim is None else (Shard(dim),)
        if self.sharded and ref.kind in (Kind.PARAM, Kind.GRAD, Kind.OPTIM_STATE) and meta.shape:
            return (Shard(0),)
        return replicate(mesh)

    def transform_and_compile(
        self, program: DistributedProgram, options: PassOptions | None = None
    ) -> DistributedProgram:
        """The pipeline, with fully_shard's gather prefetch depth as ``schedule_overlap``'s
        default (the caller's own options for that pass win)."""
        options = options or PassOptions()
        if self.sharded:
            overlap = self._overlap_with_prefetch(options.pass_options.get("schedule_overlap"))
            options = dataclasses.replace(
                options, pass_options={**options.pass_options, "schedule_overlap": overlap}
            )
        return super().transform_and_compile(program, options)

    def _overlap_with_prefetch(self, given: object) -> object:
        """``schedule_overlap``'s options with this mode's ``prefetch_depth`` merged in.

        NOTE: [prefetch depth beside other overlap options]: the depth was passed only
        when ``compile`` got no options for the pass at all, so any of them
        (``{"max_in_flight_bytes": ...}``, even the defaults) dropped it: the gathers ran
        as early as the cap allowed (the probe's 6-layer MLP, 600-byte buckets: 25,344
        gathered bytes at once instead of 20,608 at depth 0 or 1). A depth the caller
        gives the pass (a dict's ``prefetch_depth`` key, or a non-None field of
        ``OverlapOptions``, whose None default cannot be told from unset) wins over the
        mode's default; one that differs from a depth also given to the mode is refused,
        naming both. Options of another type are left to the pass's own check."""
        if given is None:
            return OverlapOptions(prefetch_depth=self.prefetch_depth)
        if isinstance(given, OverlapOptions):
            explicit, theirs = given.prefetch_depth is not None, given.prefetch_depth
        elif isinstance(given, Mapping):
            explicit, theirs = "prefetch_depth" in given, given.get("prefetch_depth")
        else:
            return given
        if not explicit:
            if isinstance(given, OverlapOptions):
                return dataclasses.replace(given, prefetch_depth=self.prefetch_depth)
            return {**given, "prefetch_depth": self.prefetch_depth}
        if self._prefetch_depth_given and theirs != self.prefetch_depth:
            raise ValueError(
                f"DataParallel('fully_shard', prefetch_depth={self.prefetch_depth!r}) and "
                f"pass_options['schedule_overlap'] prefetch_depth={theirs!r} disagree; give the "
                "depth in one of the two places."
            )
        return given

    def check_arguments(self, captured: CapturedStep, mesh: DeviceMesh, placements: list[Placements]) -> None:
        check_list_arguments(captured, mesh, placements, self.input_batch_dim)

    def partition(self, captured: CapturedStep, mesh: DeviceMesh) -> DistributedProgram:
        padded: dict[str, tuple[int, int]] = {}
        cast_gradients_for_reduction(captured, self.mp_policy.effective_reduce_dtype)
        if self.sharded:
            padded = pad_uneven_state(captured, mesh.size())
            if self.reshard_after_forward:
                remake_param_views_for_backward(captured)
        # every mesh dimension splits the arguments: a convolution's spatial shard is a
        # mislabelled batch (NOTE in _torch_private, ``convolution_spatial_shards_kept``)
        with private.convolution_spatial_shards_kept(range(mesh.ndim)):
            program = super().partition(captured, mesh)
        program.padded = padded
        check_batch_iterations(program, self.input_batch_dim, self.batch_dim_given)
        return program

    def placement_at_use(self, captured: CapturedStep, mesh: DeviceMesh) -> UseHook | None:
        params = _param_values(captured)
        casts = _param_casts(captured)
        grad_casts = self._low_precision_grad_casts(captured)
        if not self.sharded and not grad_casts:
            return None
        local = _shard_local_updates(captured, params) if self.sharded else set()
        gathered = replicate(mesh)
        reduced = (Shard(0),) if self.sharded else gathered

        def at_use(consumer: torch.fx.Node, arg: torch.fx.Node) -> list[UseStep] | None:
            step = one_step(consumer, arg)
            return None if step is None else [step]

        def one_step(consumer: torch.fx.Node, arg: torch.fx.Node) -> UseStep | None:
            if consumer in grad_casts and arg is consumer.args[0]:
                # reduce in reduce_dtype, then cast up; a gradient whose rows do not
                # divide evenly is all-reduced (its padded shard is cut locally after)
                rows = arg.meta["val"].shape[0] if arg.meta["val"].dim() else 0
                return UseStep(UseGroup.REDUCE, reduced if rows % mesh.size() == 0 else gathered)
            if not self.sharded or consumer.meta.get(PHASE) == OPTIMIZER_PHASE:
                return None
            if consumer in local or consumer.op == "output":
                # NOTE: [state updated element-wise outside forward]; an output leaves
                # in the placement the program gives it, gathered or not
                return None
            if arg in params and consumer in casts:
                return None  # cast the shard; the cast is what gets gathered
            if arg not in params and arg not in casts:
                return None
            if not self.reshard_after_forward:
                return UseStep(UseGroup.COMPUTE, gathered)
            return UseStep(UseGroup.FORWARD if in_module_forward(consumer) else UseGroup.BACKWARD, gathered)

        return at_use

    def _low_precision_grad_casts(self, captured: CapturedStep) -> set[torch.fx.Node]:
        """Backward's casts of gradients from ``reduce_dtype`` to the parameter dtype:
        the gradient is reduced before them (NOTE: [gradients reduced in reduce_dtype])."""
        low = self.mp_policy.effective_reduce_dtype
        if low is None:
            return set()
        casts = set()
        for node in captured.graph_module.graph.nodes:
            if node.target is not torch.ops.aten._to_copy.default or in_module_forward(node):
                continue
            if node.meta.get(PHASE) == OPTIMIZER_PHASE:
                continue
            source, out = node.args[0].meta.get("val"), node.meta.get("val")
            if source is not None and out is not None and source.dtype == low and out.dtype != low:
                # read by the update, or marked as the gradient backward leaves (NOTE:
                # [gradients settle after backward])
                if any(u.meta.get(PHASE) == OPTIMIZER_PHASE or marked_gradient(u) for u in node.users):
                    casts.add(node)
        return casts

    def __repr__(self) -> str:
        extra = f", reshard_after_forward={self.reshard_after_forward}" if self.sharded else ""
        if self.sharded and self._prefetch_depth_given:
            extra += f", prefetch_depth={self.prefetch_depth!r}"
        if self.mp_policy != MixedPrecisionPolicy():
            extra += f", mp_policy={self.mp_policy}"
        if self.input_index_of:
            extra += f", input_index_of={self.input_index_of!r}"
        return f"DataParallel({self.style!r}, input_batch_dim={self.input_batch_dim!r}{extra})"


# NOTE: [gradients reduced in reduce_dtype]
# FSDP2 casts each gradient to ``reduce_dtype`` before its reduce-scatter / all-reduce
# and the reduced gradient back to the parameter's dtype after it. With ``param_dtype``
# set, backward's gradients are already in it and capture casts them up to the
# parameter's dtype where ``backward()`` leaves them; reducing before that cast is
# ``reduce_dtype == param_dtype``. Any other ``reduce_dtype`` was ignored before
# (2026-12-06: ``(None, bf16)`` and ``(bf16, fp16)`` reduced in float32, twice the
# bytes asked for): now each marked gradient not already in ``reduce_dtype`` (nor cast
# up from it) gets ``_to_copy(reduce_dtype)`` then ``_to_copy(its own dtype)`` before the
# mark, and the mode reduces between the two like the bf16 case. A ``reduce_dtype``
# equal to the gradient's dtype inserts nothing (float32 reduce of bf16 compute reduces
# after capture's cast up, as before). Gradients of ``torch.autograd.grad``, and those
# that require grad, are not marked (NOTE: [gradients settle after backward]) and are
# reduced in their own dtype.


def cast_gradients_for_reduction(captured: CapturedStep, reduce_dtype: torch.dtype | None) -> int:
    """Insert the casts of NOTE: [gradients reduced in reduce_dtype]; returns how many
    gradients got them (0 on a second call: the inserted cast up is from reduce_dtype)."""
    if reduce_dtype is None:
        return 0
    graph = captured.graph_module.graph
    count = 0
    for mark in list(graph.nodes):
        if marked_gradient(mark) is None:
            continue
        grad = mark.args[0]
        val = grad.meta.get("val") if isinstance(grad, torch.fx.Node) else None
        if not isinstance(val, torch.Tensor) or not val.is_floating_point() or val.dtype == reduce_dtype:
            continue
        if grad.target is torch.ops.aten._to_copy.default:
            source = grad.args[0].meta.get("val") if isinstance(grad.args[0], torch.fx.Node) else None
            if isinstance(source, torch.Tensor) and source.dtype == reduce_dtype:
                continue  # capture's cast up from param_dtype == reduce_dtype, or ours
        meta = {k: v for k, v in mark.meta.items() if k not in ("val", "tensor_meta", MODULE_FQN)}
        with graph.inserting_before(mark):
            down = graph.call_function(torch.ops.aten._to_copy.default, (grad,), {"dtype": reduce_dtype})
            up = graph.call_function(torch.ops.aten._to_copy.default, (down,), {"dtype": val.dtype})
        down.meta = {**meta, "val": val.to(reduce_dtype)}
        up.meta = {**meta, "val": val.to(reduce_dtype).to(val.dtype)}
        mark.replace_input_with(grad, up)
        count += 1
    if count:
        captured.graph_module.recompile()
    return count


def _param_nodes(captured: CapturedStep) -> set[torch.fx.Node]:
    return {
        node
        for node, ref in zip(placeholders(captured.graph_module), captured.input_refs(), strict=True)
        if ref.kind is Kind.PARAM
    }


# NOTE: [parameters updated inside the step]
# A step that calls ``optimizer.step()`` before another forward (a GAN's discriminator
# step, then the generator's loss through it; a model updated twice per call) reads the
# update's result, an optimizer value, where it reads the parameter. fully_shard holds
# that value Shard(0) like the parameter it replaces; left to DTensor's propagation, the
# later forward computed on the rows, tensor-parallel style (the batch all-gathered at
# 2 ranks), and on 1 rank, where every redistribution is free, it sharded a Linear(16, 1)
# head's output on its size-1 feature dimension, which the ``squeeze(-1)`` after it
# cannot remove (2026-12-05: SPMDCompileError "would remove or reshape sharded dimension
# 1"). Such a value is gathered at its uses outside the optimizer as the parameter is
# (fsdp_tp gathers it the same way): gathering is exact whatever the value is; any other
# optimizer value read after the step (a step count) is replicated already. Element-wise
# updates of state from it (an EMA of the weights) compute on the shards instead, and a
# step's output is not gathered: NOTE: [state updated element-wise outside forward].


def _param_values(captured: CapturedStep) -> set[torch.fx.Node]:
    """The parameters and their values updated inside the step (NOTE: [parameters
    updated inside the step]): the optimizer's results read by a call outside it."""
    values = _param_nodes(captured)
    for node in captured.graph_module.graph.nodes:
        if node.meta.get(PHASE) == OPTIMIZER_PHASE and any(
            user.op == "call_function" and user.meta.get(PHASE) != OPTIMIZER_PHASE
            for user in node.users
        ):
            values.add(node)
    return values


# NOTE: [state updated element-wise outside forward]
# An EMA of the weights updated after ``optimizer.step()`` (``ema.mul_(d).add_(p, alpha=1
# - d)``, ``AveragedModel.update_parameters``), or a weight decay applied by hand, reads
# the parameters and their updated values with element-wise ops and writes the result
# back to Shard(0) state. Gathered at those uses like forward's reads, the EMA parameters
# and (NOTE: [parameters updated inside the step]) the updated weights were all-gathered
# and the result cut back to Shard(0): on a Linear(16, 16) and its EMA copy at 2 ranks,
# 2 all-gathers a step (6528 bytes; 4352 before that note) where the step without the
# EMA needs 1 (2176 bytes). Such an op computes each row from the same row of its
# inputs, so it is left to DTensor on the shards, exact and with no collective, where:
# - it is element-wise (``torch.Tag.pointwise``, or a copy/cast), not random, outside
#   any module's forward, backward and the optimizer;
# - every tensor input is a gathered-at-use value (parameter, updated value) or such an
#   op's result, of the result's shape, or a 0-d tensor;
# - its result is read only by such ops or by the step's outputs (a state write-back).
# A read whose value goes anywhere else (a loss term, a matmul, a view, a padded
# parameter's true-row slice) is gathered as before; so is every forward and backward
# read, where fully_shard computes on whole weights.


def _elementwise(target: object) -> bool:
    """padding's element-wise ops, and ``clone`` (a copy of the weights kept as the EMA's
    start)."""
    return target is torch.ops.aten.clone.default or elementwise_op(target)


def _shard_local_updates(captured: CapturedStep, gathered: set[torch.fx.Node]) -> set[torch.fx.Node]:
    """The element-wise ops outside forward, backward and the optimizer that compute on
    the shards of ``gathered`` values (NOTE: [state updated element-wise outside forward])."""
    nodes = [n for n in captured.graph_module.graph.nodes if _elementwise_outside_compute(n)]
    local = set(nodes)
    changed = True
    while changed:
        changed = False
        for node in nodes:
            if node.target is operator.getitem:  # one tensor of a foreach op's results
                reads = node.args[0] in local
            else:
                reads = _reads_only_shards(node, gathered | local)
            if node in local and not (reads and all(u in local or u.op == "output" for u in node.users)):
                local.discard(node)
                changed = True
    return local


def _elementwise_outside_compute(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or in_module_forward(node) or phase(node) is not Phase.FORWARD:
        return False
    target = node.target
    if target is operator.getitem:
        source = node.args[0]
        return isinstance(source, torch.fx.Node) and _elementwise_outside_compute(source)
    if not private.is_op_overload(target):
        return False
    tags = getattr(target, "tags", ())
    if torch.Tag.nondeterministic_seeded in tags:
        return False
    name = getattr(target, "__name__", "").split(".")[0]
    if name.startswith("_foreach_") and getattr(target, "namespace", None) == "aten":
        # per tensor as the op it names (the shapes are checked: ``_foreach_max`` and
        # ``_foreach_norm`` make 0-d results)
        packet = getattr(torch.ops.aten, name.removeprefix("_foreach_"), None)
        overloads = [getattr(packet, o) for o in packet.overloads()] if packet is not None else []
        return any(_elementwise(o) for o in overloads)
    return _elementwise(target)


def _reads_only_shards(node: torch.fx.Node, sharded: set[torch.fx.Node]) -> bool:
    """Whether each tensor ``node`` reads is in ``sharded`` with the shape of the result
    it makes (a foreach op: the result at its index) or is 0-d."""
    outs = node.meta.get("val")
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    if not outs or not all(isinstance(o, torch.Tensor) and o.dim() > 0 for o in outs):
        return False

    def fits(arg: object, out: torch.Tensor) -> bool:
        val = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
        if not isinstance(val, torch.Tensor):
            return False
        return val.dim() == 0 or (arg in sharded and val.shape == out.shape)

    for arg in (*node.args, *node.kwargs.values()):
        if isinstance(arg, torch.fx.Node):
            if not all(fits(arg, out) for out in outs):
                return False
        elif isinstance(arg, (list, tuple)) and any(isinstance(a, torch.fx.Node) for a in arg):
            if len(arg) != len(outs) or not all(fits(a, out) for a, out in zip(arg, outs, strict=True)):
                return False
    return True


def _param_casts(captured: CapturedStep) -> set[torch.fx.Node]:
    """Compute's casts of parameters (mixed precision): ``_to_copy(P, dtype=bf16)``."""
    params = _param_values(captured)
    return {
        user
        for p in params
        for user in p.users
        if user.target is torch.ops.aten._to_copy.default
        and user.meta.get(PHASE) != OPTIMIZER_PHASE
    }



def remake_param_views_for_backward(captured: CapturedStep) -> int:
    """Give backward its own copies of forward's views of parameters.

    Before: ``t = aten.t(w)`` in forward, used by forward's ``addmm`` and by backward's
    ``mm``. After: backward's ``mm`` reads ``t_1 = aten.t(w)`` made just before it (whole
    view chains are re-made back to the parameter). Returns the number of nodes created;
    0 when forward and backward share no view, and on a second call.
    """
    graph = captured.graph_module.graph
    params = _param_values(captured)
    views: list[torch.fx.Node] = []
    derived = params | _param_casts(captured)
    for node in graph.nodes:
        if node.target in _PARAM_VIEW_OPS and in_module_forward(node) and node.args[0] in derived:
            views.append(node)
            derived.add(node)
    view_set = set(views)
    created = 0

    def copy_chain(view: torch.fx.Node, before: torch.fx.Node) -> torch.fx.Node:
        nonlocal created
        source = node_arg(view)
        new_source = copy_chain(source, before) if source in view_set else source
        with graph.inserting_before(before):
            copy = graph.node_copy(view, lambda a: new_source if a is source else a)
        copy.meta = {k: v for k, v in view.meta.items() if k != MODULE_FQN}
        created += 1
        return copy

    for view in views:
        for user in list(view.users):
            if user in view_set or in_module_forward(user) or user.op == "output":
                continue
            if user.meta.get(PHASE) == OPTIMIZER_PHASE:
                continue
            user.replace_input_with(view, copy_chain(view, user))
    if created:
        captured.graph_module.recompile()
    return created
