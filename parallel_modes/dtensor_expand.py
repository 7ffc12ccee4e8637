"""DTensorExpandMode: replicate all state, shard tensor inputs on dimension 0."""

from __future__ import annotations

from collections.abc import Sequence

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Shard

from spmd_compiler import _torch_private as private
from spmd_compiler.expand.retrace import DistributedProgram, Placements
from spmd_compiler.ir.signature import CapturedStep, Kind, StateRef, TensorMeta

from .base import ParallelMode, replicate
from .batch_dims import check_program_iterations


class DTensorExpandMode(ParallelMode):
    """Data parallelism by plain DTensor expansion (the original ``_spmd`` behaviour).

    Parameters, buffers and optimizer state are Replicate; every tensor argument of the
    step is Shard(0) (each rank passes its own local batch) unless ``input_placements``
    overrides it; 0-d tensor arguments are Replicate. Gradients come out of backward
    Partial and are all-reduced once, where the optimizer first needs them.

    Args:
        input_placements: ``{i: placements}`` for the i-th tensor argument of the step
            (counting tensor arguments only, in call order).
        mesh: a 1-D mesh; by default all ranks of the default process group.
    """

    name = "dtensor_expand"

    def __init__(
        self,
        input_placements: dict[int, Sequence[Placement]] | None = None,
        mesh: DeviceMesh | None = None,
    ) -> None:
        super().__init__(mesh)
        self.input_placements = {int(k): tuple(v) for k, v in (input_placements or {}).items()}

    def placement_of(self, ref: StateRef, meta: TensorMeta, mesh: DeviceMesh) -> Placements:
        if ref.kind is Kind.INPUT:
            if ref.index in self.input_placements:
                return self.input_placements[ref.index]
            if len(meta.shape) == 0:
                return replicate(mesh)
            return tuple(Shard(0) for _ in range(mesh.ndim))
        return replicate(mesh)

    def partition(self, captured: CapturedStep, mesh: DeviceMesh) -> DistributedProgram:
        # the arguments are split over every mesh dimension: a convolution's spatial
        # shard is a mislabelled batch (``convolution_spatial_shards_kept``)
        with private.convolution_spatial_shards_kept(range(mesh.ndim)):
            program = super().partition(captured, mesh)
        # NOTE: [a batch dimension iterated over]: this mode names no batch dimension
        given = {ref.name for ref, _ in captured.inputs if ref.kind is Kind.INPUT and ref.index in self.input_placements}
        check_program_iterations(
            program, lambda name: name in given,
            hint="this mode splits every tensor argument on dimension 0: compile with "
            "DataParallel('replicate', input_batch_dim={'x': 1}) for a time-major argument "
            "x (and its (T, B) labels), or give this mode input_placements={i: (Shard(1),)} "
            "for the i-th tensor argument; input_placements={i: (Shard(0),)} says dimension 0 "
            "is the batch of a step that loops over samples.",
        )
        return program

    def __repr__(self) -> str:
        return f"DTensorExpandMode(input_placements={self.input_placements})"
