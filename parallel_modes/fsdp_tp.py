"""2-D parallelism: FSDP on the ``dp`` mesh dimension, tensor parallel on ``tp``.

Every parameter is ONE DTensor on the parent (dp, tp) mesh: its TP placement on tp and
FSDP's Shard(0) on dp (another dimension for a strided TP split, NOTE: [strided TP under
FSDP]), nested right-to-left where both shard the same tensor dimension
(NOTE: [parent-mesh sharding] in spmd_compiler/expand/parent_mesh.py). Parameters are gathered
over dp only at their use (forward and backward groups, as in fully_shard) and stay TP
sharded; activations follow the TP plan's layouts on tp and keep their batch sharding on
dp; gradients are reduce-scattered over dp.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import cast

import torch
import torch.fx
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from spmd_compiler import _torch_private as private
from spmd_compiler.capture.bindings import StepBindings
from spmd_compiler.errors import SPMDCompileError
from spmd_compiler.expand.parent_mesh import parent_placements
from spmd_compiler.expand.retrace import DistributedProgram, Placements
from spmd_compiler.ir.graph_utils import placeholders
from spmd_compiler.ir.node_meta import OPTIMIZER_PHASE, PHASE, in_module_forward
from spmd_compiler.ir.signature import CapturedStep, Kind, StateRef, TensorMeta
from spmd_compiler.ir.use_step import UseGroup, UseHook, UseStep

from .base import ParallelMode
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
    """

    name = "fsdp_tp"

    def __init__(
        self,
        plan: Mapping[str, Style],
        *,
        mesh: DeviceMesh | None = None,
        mesh_shape: tuple[int, int] | None = None,
        reshard_after_forward: bool = True,
    ) -> None:
        if mesh is not None and mesh.ndim != 2:
            raise ValueError(f"FullyShardTensorParallel takes a 2-D (dp, tp) mesh, got {mesh}")
        if mesh is None and (mesh_shape is None or len(mesh_shape) != 2):
            raise ValueError("give a 2-D mesh or mesh_shape=(dp, tp)")
        super().__init__(mesh)
        self.mesh_shape = tuple(mesh.shape) if mesh is not None else tuple(cast(tuple[int, int], mesh_shape))
        self.tp = TensorParallel(plan)
        self.reshard_after_forward = reshard_after_forward

    def mesh(self, device_type: str) -> DeviceMesh:
        if self._mesh is None:
            self._mesh = init_device_mesh(device_type, self.mesh_shape, mesh_dim_names=("dp", "tp"))
        return super().mesh(device_type)

    def prepare(self, bindings: StepBindings) -> None:
        self.tp.prepare(bindings)

    def placement_of(self, ref: StateRef, meta: TensorMeta, mesh: DeviceMesh) -> Placements:
        if ref.kind is Kind.INPUT:
            return (Shard(0), Replicate()) if meta.shape else (Replicate(), Replicate())
        if ref.kind in (Kind.PARAM, Kind.GRAD, Kind.OPTIM_STATE) and meta.shape:
            tp = self.tp.placement_of(ref, meta, mesh)[0]
            dp = _dp_placement(tp, tuple(meta.shape), mesh.size(DP))
            return parent_placements(mesh, {TP: tp}, {DP: dp}, len(meta.shape))
        return (Replicate(), Replicate())

    def partition(self, captured: CapturedStep, mesh: DeviceMesh) -> DistributedProgram:
        for ref, meta in captured.inputs:
            if ref.kind is Kind.PARAM and meta.shape:
                tp = self.tp.placement_of(ref, meta, mesh)[0]
                if private.is_strided_shard(tp):
                    continue  # FSDP shards its columns or keeps it (NOTE: [strided TP under FSDP])
                rows = meta.shape[0] // (mesh.size(TP) if tp == Shard(0) else 1)
                if meta.shape[0] % (mesh.size(TP) if tp == Shard(0) else 1) or rows % mesh.size(DP):
                    raise SPMDCompileError(
                        f"{ref} has {meta.shape[0]} rows; FSDP x TP needs its TP shard to "
                        f"split evenly over the {mesh.size(DP)} dp ranks.",
                        hint="use sizes divisible by dp x tp (uneven shards are supported by "
                        "DataParallel('fully_shard') alone).",
                    )
        if self.reshard_after_forward:
            remake_param_views_for_backward(captured)
        return super().partition(captured, mesh)

    def placement_at_use(self, captured: CapturedStep, mesh: DeviceMesh) -> UseHook | None:
        params = _param_nodes(captured)

        def gather_over_dp(value: DTensor) -> DTensor:
            """All-gather the dp pieces: with TP inner and FSDP outer, rank (d, t) holds
            piece d of TP shard t, so one all-gather over dp yields TP shard t (done by
            hand: DTensor's planner mishandles _StridedShard -> Replicate when traced)."""
            dp = value.placements[DP]
            if not (isinstance(dp, Shard) or private.is_strided_shard(dp)):
                return value
            local = private.all_gather_along(private.local_tensor_of(value), dp.dim, mesh, DP)
            return DTensor.from_local(
                local, mesh, (Replicate(), value.placements[TP]), run_check=False,
                shape=value.shape, stride=value.stride(),
            )

        state = {
            node for node, ref in zip(placeholders(captured.graph_module), captured.input_refs(), strict=True)
            if ref.kind is not Kind.INPUT
        }

        def reduce_scatter_over_dp(value: DTensor) -> DTensor:
            """A gradient Partial over dp becomes this rank's FSDP piece of its TP shard
            with one reduce-scatter (the inverse of gather_over_dp), or is all-reduced
            where FSDP keeps the parameter whole (NOTE: [strided TP under FSDP])."""
            dp, tp = value.placements
            if not dp.is_partial() or tp.is_partial() or value.dim() == 0:
                return value
            reduce_op = cast(Partial, dp).reduce_op
            target = _dp_placement(tp, tuple(value.shape), mesh.size(DP))
            if isinstance(target, Shard):
                local = private.reduce_scatter_along(
                    private.local_tensor_of(value), reduce_op, target.dim, mesh, DP
                )
            else:
                local = private.all_reduce_along(private.local_tensor_of(value), reduce_op, mesh, DP)
            placements = parent_placements(mesh, {TP: tp}, {DP: target}, value.dim())
            return DTensor.from_local(
                local, mesh, placements, run_check=False, shape=value.shape, stride=value.stride()
            )

        def at_use(consumer: torch.fx.Node, arg: torch.fx.Node) -> list[UseStep] | None:
            if consumer.meta.get(PHASE) == OPTIMIZER_PHASE:
                if arg in state or arg.meta.get(PHASE) == OPTIMIZER_PHASE:
                    return None
                # a gradient entering the update
                return [UseStep(UseGroup.REDUCE, redistribute=reduce_scatter_over_dp)]
            if arg in params:  # gather over dp, stay tensor-parallel
                group = UseGroup.COMPUTE
                if self.reshard_after_forward:
                    group = UseGroup.FORWARD if in_module_forward(consumer) else UseGroup.BACKWARD
                return [UseStep(group, redistribute=gather_over_dp)]
            steps = self.tp.layout_at_boundary(consumer, arg, state)
            return None if steps is None else [_on_tp(step) for step in steps]

        return at_use

    def __repr__(self) -> str:
        return f"FullyShardTensorParallel(plan={self.tp.plan}, mesh_shape={self.mesh_shape})"


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


def _dp_placement(tp: Placement, shape: tuple[int, ...], dp_size: int) -> Placement:
    """FSDP's placement on dp for a parameter with TP placement ``tp``."""
    if not private.is_strided_shard(tp):
        return Shard(0)
    for dim, size in enumerate(shape):
        if dim != tp.dim and size % dp_size == 0:
            return Shard(dim)
    return Replicate()


def _on_tp(step: UseStep) -> UseStep:
    """A 1-D tensor-parallel step on the (dp, tp) mesh: dp keeps its placement."""
    assert step.placements is not None, "TensorParallel's layout steps are placements"
    return dataclasses.replace(step, placements=(None, *step.placements))
