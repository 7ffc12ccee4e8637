"""2-D parallelism: FSDP on the ``dp`` mesh dimension, tensor parallel on ``tp``.

Every parameter is ONE DTensor on the parent (dp, tp) mesh: its TP placement on tp and
FSDP's Shard(0) on dp (another dimension for a strided TP split, NOTE: [strided TP under
FSDP], or where sizes do not divide, NOTE: [uneven shards under FSDP x TP]), nested right-to-left where both shard the same tensor dimension
(NOTE: [parent-mesh sharding] in spmd_compiler/expand/parent_mesh.py). Parameters are gathered
over dp only at their use (forward and backward groups, as in fully_shard) and stay TP
sharded; activations follow the TP plan's layouts on tp and keep their batch sharding on
dp; gradients are reduce-scattered over dp.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Mapping
from typing import cast

import torch
import torch.distributed as dist
import torch.fx
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from spmd_compiler import _torch_private as private
from spmd_compiler.capture.bindings import StepBindings
from spmd_compiler.capture.gradients import gradient_settles, marked_gradient
from spmd_compiler.errors import mesh_of_another_size
from spmd_compiler.expand.parent_mesh import parent_placements
from spmd_compiler.expand.retrace import DistributedProgram, Placements
from spmd_compiler.ir.graph_utils import placeholders
from spmd_compiler.ir.node_meta import OPTIMIZER_PHASE, PHASE, in_module_forward
from spmd_compiler.ir.signature import CapturedStep, Kind, StateRef, TensorMeta
from spmd_compiler.ir.use_step import UseGroup, UseHook, UseStep
from spmd_compiler.runtime.simulate import mesh_is_live

from .base import ParallelMode
from .batch_dims import (
    BatchDims,
    batch_dim_of,
    check_batch_dim_names,
    check_batch_iterations,
    check_list_arguments,
    checked_batch_dims,
)
from .data_parallel import _param_nodes, remake_param_views_for_backward
from .tensor_parallel import Style, TensorParallel

DP, TP = 0, 1


class FullyShardTensorParallel(ParallelMode):
    """FSDP x TP on a 2-D (dp, tp) mesh.

    Args:
        plan: the tensor-parallel plan (see ``TensorParallel``).
        mesh: a 2-D mesh whose right-most dimension is tp, or ``mesh_shape=(dp, tp)``
            to build one over the default process group.
        reshard_after_forward: gather parameters again in backward.
        input_batch_dim: the dimension of each tensor argument that holds the batch,
            split over dp (every tp rank of a dp group passes the same share): as
            ``DataParallel``'s, one for all or ``{argument name: dimension or None}``.
    """

    name = "fsdp_tp"

    def __init__(
        self,
        plan: Mapping[str, Style],
        *,
        mesh: DeviceMesh | None = None,
        mesh_shape: tuple[int, int] | None = None,
        reshard_after_forward: bool = True,
        input_batch_dim: BatchDims | None = None,
    ) -> None:
        if mesh is not None and mesh.ndim != 2:
            raise ValueError(f"FullyShardTensorParallel takes a 2-D (dp, tp) mesh, got {mesh}")
        if mesh is None and (mesh_shape is None or len(mesh_shape) != 2):
            raise ValueError("give a 2-D mesh or mesh_shape=(dp, tp)")
        super().__init__(mesh)
        self._own_mesh = mesh is None
        self.mesh_shape = tuple(mesh.shape) if mesh is not None else tuple(cast(tuple[int, int], mesh_shape))
        self.tp = TensorParallel(plan)
        self.reshard_after_forward = reshard_after_forward
        self.input_batch_dim = checked_batch_dims(0 if input_batch_dim is None else input_batch_dim)
        # NOTE: [a batch dimension iterated over]: whether the dimension was chosen
        self.batch_dim_given = input_batch_dim is not None

    def mesh(self, device_type: str) -> DeviceMesh:
        # its own mesh is made again once its simulation has ended (NOTE: [state after a
        # simulation]); a mesh the user gave stays the user's
        if self._mesh is None or (self._own_mesh and not mesh_is_live(self._mesh)):
            # a shape of another size than the world: the library's refusal, not torch's
            # "Mesh should not be bigger than default world size" (``mesh_of_another_size``)
            size, world = math.prod(self.mesh_shape), dist.get_world_size()
            if size != world:
                raise mesh_of_another_size(type(self).__name__, size, world, tuple(self.mesh_shape))
            self._mesh = init_device_mesh(device_type, self.mesh_shape, mesh_dim_names=("dp", "tp"))
        return super().mesh(device_type)

    def prepare(self, bindings: StepBindings) -> None:
        check_batch_dim_names(self.input_batch_dim, bindings, self)
        self.tp.prepare(bindings)

    def placement_of(self, ref: StateRef, meta: TensorMeta, mesh: DeviceMesh) -> Placements:
        if ref.kind is Kind.INPUT:
            dim = batch_dim_of(self.input_batch_dim, ref, meta)
            return (Replicate() if dim is None else Shard(dim), Replicate())
        if ref.kind in (Kind.PARAM, Kind.GRAD, Kind.OPTIM_STATE) and meta.shape:
            tp = self._tp_placement(ref, meta, mesh)
            dp = _dp_placement(tp, tuple(meta.shape), mesh.size(DP), mesh.size(TP))
            return parent_placements(mesh, {TP: tp}, {DP: dp}, len(meta.shape))
        return (Replicate(), Replicate())

    def _tp_placement(self, ref: StateRef, meta: TensorMeta, mesh: DeviceMesh) -> Placement:
        """The plan's TP placement, or Replicate where its dimension does not divide tp
        (NOTE: [uneven shards under FSDP x TP]) or the tensor has no such dimension
        (NOTE: [state with fewer dimensions than its parameter])."""
        tp = self.tp.placement_of(ref, meta, mesh)[0]
        if private.is_shard_like(tp) and not -len(meta.shape) <= cast(Shard, tp).dim < len(meta.shape):
            return Replicate()
        if isinstance(tp, Shard) and not private.is_strided_shard(tp) and meta.shape[tp.dim] % mesh.size(TP):
            return Replicate()
        return tp

    def check_arguments(self, captured: CapturedStep, mesh: DeviceMesh, placements: list[Placements]) -> None:
        check_list_arguments(captured, mesh, placements, self.input_batch_dim)

    def partition(self, captured: CapturedStep, mesh: DeviceMesh) -> DistributedProgram:
        whole_on_tp: dict[str, int] = {}
        whole_on_dp: list[str] = []
        for ref, meta in captured.inputs:
            if ref.kind is not Kind.PARAM or not meta.shape:
                continue
            planned = self.tp.placement_of(ref, meta, mesh)[0]
            tp = self._tp_placement(ref, meta, mesh)
            if tp != planned:
                whole_on_tp[ref.name] = meta.shape[cast(Shard, planned).dim]
            strided = private.is_strided_shard(tp)  # NOTE: [strided TP under FSDP]
            if not strided and _dp_placement(tp, tuple(meta.shape), mesh.size(DP), mesh.size(TP)) == Replicate():
                whole_on_dp.append(_why_whole_on_dp(ref.name, tp, tuple(meta.shape), mesh.size(DP), mesh.size(TP)))
        self.tp.compute_whole(
            whole_on_tp,
            f"FullyShardTensorParallel: {{modules}} shard(s) a dimension that does not divide "
            f"the {mesh.size(TP)} tp ranks ({{sizes}}); these parameters are not split over tp "
            "(FSDP still shards them over dp) and these modules compute on whole activations.",
        )
        if whole_on_dp:
            warnings.warn(
                "FullyShardTensorParallel: no dimension that tp leaves free splits evenly "
                f"over the {mesh.size(DP)} dp ranks ({'; '.join(whole_on_dp)}); kept whole on "
                "dp (its gradient is all-reduced over dp, its state is not sharded there). A "
                f"size that divides by {mesh.size(DP)} in a dimension tp does not split lets "
                "FSDP shard it.",
                stacklevel=2,
            )
        if self.reshard_after_forward:
            remake_param_views_for_backward(captured)
        # dp splits the arguments: a convolution's spatial shard there is a mislabelled
        # batch; on tp it is sequence parallelism, gathered (``convolution_spatial_shards_kept``)
        with private.convolution_spatial_shards_kept([DP]):
            program = super().partition(captured, mesh)
        check_batch_iterations(program, self.input_batch_dim, self.batch_dim_given)
        return program

    def _tp_shards(self, captured: CapturedStep, mesh: DeviceMesh) -> dict[str, Shard]:
        """Parameter name -> its plain TP shard, for the parameters the plan shards."""
        return {
            ref.name: tp for ref, meta in captured.inputs
            if ref.kind is Kind.PARAM and meta.shape
            and type(tp := self._tp_placement(ref, meta, mesh)) is Shard
        }

    def gradient_rows(
        self, captured: CapturedStep, mesh: DeviceMesh
    ) -> Callable[[str], Placements | None] | None:
        """A gradient ends on its parameter's TP rows (the dp reduce-scatter follows at
        its use): one computed whole on tp from replicated operands (a colwise layer whose
        output the plan replicates) is computed on those rows (NOTE: [weight gradients
        computed on the rows kept] in ``expand/retrace.py``)."""
        tp_shards = self._tp_shards(captured, mesh)

        def rows(name: str) -> Placements | None:
            tp = tp_shards.get(name)
            return None if tp is None else (Replicate(), tp)

        return rows

    def placement_at_use(self, captured: CapturedStep, mesh: DeviceMesh) -> UseHook | None:
        params = _param_nodes(captured)

        def gather_over_dp(value: DTensor) -> DTensor:
            """All-gather the dp pieces: with TP inner and FSDP outer, rank (d, t) holds
            piece d of TP shard t, so one all-gather over dp yields TP shard t (done by
            hand: DTensor's planner mishandles _StridedShard -> Replicate when traced)."""
            dp, tp = value.placements
            if not private.is_shard_like(dp):
                return value
            if not private.is_strided_shard(dp) and isinstance(tp, Shard) and tp.dim == dp.dim:
                # dp outer on the same dim (an update DTensor sharded (Shard(d), Shard(d))):
                # its dp pieces are not this rank's TP shard; DTensor's plan moves it
                return value.redistribute(mesh, (Replicate(), tp))
            local = private.all_gather_along(private.local_tensor_of(value), dp.dim, mesh, DP)
            return DTensor.from_local(
                local, mesh, (Replicate(), tp), run_check=False,
                shape=value.shape, stride=value.stride(),
            )

        state = {
            node for node, ref in zip(placeholders(captured.graph_module), captured.input_refs(), strict=True)
            if ref.kind is not Kind.INPUT
        }

        # each parameter's plain TP shard: where its gradient arrives whole on tp, this
        # rank's rows of it (NOTE: [a gradient computed whole on tp])
        tp_shards = self._tp_shards(captured, mesh)

        def reduce_scatter_over_dp(value: DTensor, tp_shard: Placement | None = None) -> DTensor:
            """A gradient Partial over dp becomes this rank's FSDP piece of its TP shard
            with one reduce-scatter (the inverse of gather_over_dp), or is all-reduced
            where FSDP keeps the parameter whole (NOTE: [strided TP under FSDP])."""
            dp, tp = value.placements
            if not dp.is_partial() or value.dim() == 0:
                return value
            if tp.is_partial():  # summed over tp too (a norm's weight under a tp-split batch)
                value = value.redistribute(mesh, (dp, Replicate()))
                tp = Replicate()
            if isinstance(tp, Replicate) and tp_shard is not None:
                value = value.redistribute(mesh, (dp, tp_shard))  # a slice, no collective
                tp = tp_shard
            reduce_op = cast(Partial, dp).reduce_op
            target = _dp_placement(tp, tuple(value.shape), mesh.size(DP), mesh.size(TP))
            partial = private.local_tensor_of(value)
            if isinstance(target, Shard):
                local = private.reduce_scatter_along(partial, reduce_op, target.dim, mesh, DP)
            else:
                local = private.all_reduce_along(partial, reduce_op, mesh, DP)
            # an autocast gradient rounded as one device rounds its whole-batch sum
            # (NOTE: [low-precision partials rounded where reduced])
            local = private.round_reduced_sum(partial, local)
            placements = parent_placements(mesh, {TP: tp}, {DP: target}, value.dim())
            return DTensor.from_local(
                local, mesh, placements, run_check=False, shape=value.shape, stride=value.stride()
            )

        def reduced(arg: torch.fx.Node) -> list[UseStep]:
            tp_shard = tp_shards.get(marked_gradient(arg) or "")
            return [UseStep(UseGroup.REDUCE, redistribute=lambda v: reduce_scatter_over_dp(v, tp_shard))]

        def at_use(consumer: torch.fx.Node, arg: torch.fx.Node) -> list[UseStep] | None:
            if consumer.meta.get(PHASE) == OPTIMIZER_PHASE:
                if arg in state or arg.meta.get(PHASE) == OPTIMIZER_PHASE:
                    return None
                return reduced(arg)  # a gradient entering the update
            if gradient_settles(consumer, arg):
                # read between backward and the update (clipped, unscaled): reduced the
                # same way, once (NOTE: [gradients settle after backward])
                return reduced(arg)
            updated = arg.meta.get(PHASE) == OPTIMIZER_PHASE and consumer.op == "call_function"
            if arg in params or updated:
                # a parameter, or its update read again after the step (an eval forward;
                # not the state written back), is gathered over dp by hand and stays
                # tensor-parallel
                group = UseGroup.COMPUTE
                if self.reshard_after_forward:
                    group = UseGroup.FORWARD if in_module_forward(consumer) else UseGroup.BACKWARD
                return [UseStep(group, redistribute=gather_over_dp)]
            steps = self.tp.layout_at_boundary(consumer, arg, state)
            return None if steps is None else [_on_tp(step) for step in steps]

        return at_use

    def __repr__(self) -> str:
        extra = f", input_batch_dim={self.input_batch_dim!r}" if self.input_batch_dim != 0 else ""
        return f"FullyShardTensorParallel(plan={self.tp.plan}, mesh_shape={self.mesh_shape}{extra})"


# NOTE: [strided TP under FSDP]
# A parameter whose TP placement is strided (FusedColwiseParallel's q/k/v blocks,
# MultiheadAttentionParallel's packed in_proj: _StridedShard(0, sf=3) on tp) cannot be
# split again on dim 0 by FSDP: rank (d, t) would hold piece d of TP shard t, rows of two
# blocks at once, which no DTensor placement on the (dp, tp) mesh describes; nesting a
# second _StridedShard on dp (sf=3*tp) describes a regular layout, but torch 2.13
# gathers such a doubly strided DTensor wrongly (full_tensor() of a distribute_tensor
# made with (_S(0, 6), _S(0, 3)) returns rows out of order and zeros), a silent wrong
# result for anyone reading the parameter. So FSDP shards such a parameter along its
# first OTHER dimension that dp divides (the columns of in_proj_weight, independent of
# the row blocks: (Shard(1), _S(0, 3)), which DTensor gathers right; the rows of a
# transposed Conv1D weight), and keeps it whole on dp where there is none (a bias: its
# gradient is all-reduced over dp instead of reduce-scattered).


# NOTE: [a gradient computed whole on tp]
# A head planned colwise with its logits replicated (``ColwiseParallel(output_layouts=
# Replicate())``, transformers' own plans) gets the logits' gradient whole on every tp rank;
# DTensor computes the weight gradient from it unsliced (no redistribution either way),
# so it arrives at the update whole on tp while the parameter and its state hold rows.
# Reduced over dp as it was, the update then gathered the parameter and its AdamW state
# over both mesh dimensions every step (HF Qwen2's lm_head: two all-gathers after the
# reduce-scatter). The gradient is cut to the parameter's rows on tp first, a slice of
# the rank's own copy, then reduce-scattered over dp into the parameter's layout. Since
# the fiftieth session a gradient that is one ``mm`` of such operands is computed on those
# rows in the first place (``gradient_rows``, NOTE: [weight gradients computed on the
# rows kept] in ``expand/retrace.py``: 1/tp of the matmul); the cut stays for gradients
# of other shapes.


# NOTE: [state with fewer dimensions than its parameter]
# Optimizer state is placed as its parameter is (NOTE: [state shaped unlike its
# parameter] in base.py), but some state has fewer dimensions: an Adafactor or SM3 that
# keeps a 2-D weight's column statistics as a 1-D (cols,) vector. The TP plan's split of
# a rowwise weight, Shard(1), names a dimension such state does not have (reading its
# size raised a bare IndexError). Such state is replicated on tp, as TensorParallel
# alone ends up placing it (``placements_for_state``); dp then shards it where its size
# allows, and ``placements_for_state`` keeps that shard only where the state has the
# parameter's size in that dimension. The layout only: DTensor brings the operands of
# each use to a common placement, so the numbers are eager's (tested in float64 under
# 2x2 and 2x1 meshes, tests/sim/test_fsdp_tp.py).


# NOTE: [uneven shards under FSDP x TP]
# One program serves every rank, so every shard must have one shape; fully_shard alone
# pads rows (NOTE: [uneven shards]), but padding a dimension that two mesh dimensions
# split would need padded shards within padded shards. Instead each parameter takes the
# even layout nearest to the plan:
# - tp: the plan's split where its dimension divides the tp size; else the parameter is
#   not split over tp and its modules compute on whole activations (a warning names them;
#   TensorParallel alone pads the parameter, with the same compute);
# - dp: Shard(0) where the TP shard's rows divide the dp size, else the first other
#   dimension dp divides and tp does not split (a 3-class head, (3, 64): its 64 columns;
#   a vocabulary of 65: its columns), else whole on dp (a norm of width 7: its gradient is
#   all-reduced over dp, its state not sharded there; a warning names it).
# Values DTensor computes from these keep even layouts too (NOTE: [even layouts
# preferred] in _torch_private.py): tested in float64 with widths 7, 15, 10 and 3
# classes, clipping and an evaluation after the update (tests/sim/test_fsdp_tp.py).


def _dp_placement(tp: Placement, shape: tuple[int, ...], dp_size: int, tp_size: int) -> Placement:
    """FSDP's placement on dp for a parameter with TP placement ``tp``: Shard(0) where
    the TP shard's rows split evenly over dp, else the first other dimension that dp
    divides and TP does not split, else Replicate (NOTE: [uneven shards under FSDP x TP];
    a strided TP split never takes Shard(0) on top of it: NOTE: [strided TP under FSDP])."""
    strided = private.is_strided_shard(tp)
    tp_dim = cast(Shard, tp).dim if strided or isinstance(tp, Shard) else None
    if strided:
        candidates = [dim for dim in range(len(shape)) if dim != tp_dim]
    else:
        if shape[0] // (tp_size if tp_dim == 0 else 1) % dp_size == 0:
            return Shard(0)
        candidates = [dim for dim in range(1, len(shape)) if dim != tp_dim]
    for dim in candidates:
        if shape[dim] % dp_size == 0:
            return Shard(dim)
    return Replicate()


def _why_whole_on_dp(name: str, tp: Placement, shape: tuple[int, ...], dp_size: int, tp_size: int) -> str:
    """Why ``_dp_placement`` keeps parameter ``name`` whole on dp, dimension by dimension:
    ``out.weight (1, 16): dimension 0 (1) does not divide by 2, dimension 1 (16) is split
    over the 2 tp ranks``. Before, the warning said that no dimension of ``(1, 16)``
    split evenly over 2 dp ranks, where 16 does: that dimension is tp's, which dp splits
    again only for dimension 0 (a rowwise ``out.weight`` under a (2, 2) mesh, sixty-first
    session)."""
    tp_dim = cast(Shard, tp).dim % len(shape) if isinstance(tp, Shard) else None
    reasons = []
    for dim, size in enumerate(shape):
        if dim == tp_dim and dim == 0:
            reasons.append(f"dimension 0 ({size}) is split over the {tp_size} tp ranks and its "
                           f"tp share ({size // tp_size}) does not divide by {dp_size}")
        elif dim == tp_dim:
            reasons.append(f"dimension {dim} ({size}) is split over the {tp_size} tp ranks")
        else:
            reasons.append(f"dimension {dim} ({size}) does not divide by {dp_size}")
    return f"{name} {shape}: {', '.join(reasons)}"


def _on_tp(step: UseStep) -> UseStep:
    """A 1-D tensor-parallel step on the (dp, tp) mesh: dp keeps its placement."""
    assert step.placements is not None, "TensorParallel's layout steps are placements"
    return dataclasses.replace(step, placements=(None, *step.placements))
