"""DTensorExpandMode: replicate all state, shard tensor inputs on dimension 0."""

from __future__ import annotations

import weakref
from collections.abc import Sequence

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard

from spmd_compiler import _torch_private as private
from spmd_compiler.errors import SPMDCompileError
from spmd_compiler.expand.listed_samples import check_listed_samples
from spmd_compiler.expand.retrace import DistributedProgram, Placements
from spmd_compiler.ir.signature import CapturedStep, Kind, StateRef, TensorMeta
from spmd_compiler.runtime.simulate import active_simulation

from .base import ParallelMode, replicate
from .batch_dims import check_program_iterations

# per mode, the input_placements indices that named a tensor argument of an earlier call
_COVERED: weakref.WeakKeyDictionary[object, set[int]] = weakref.WeakKeyDictionary()


class DTensorExpandMode(ParallelMode):
    """Data parallelism by plain DTensor expansion (the original ``_spmd`` behaviour).

    Parameters, buffers and optimizer state are Replicate; every tensor argument of the
    step is Shard(0) (each rank passes its own local batch) unless ``input_placements``
    overrides it; 0-d tensor arguments are Replicate. Gradients come out of backward
    Partial and are all-reduced once, where the optimizer first needs them.

    Args:
        input_placements: ``{i: placements}`` for the i-th tensor argument of the step
            (counting tensor arguments only, in call order, from 0), one placement per
            mesh dimension; an index that names no tensor argument of the first call
            that lacks it (and of no earlier call) is refused, naming the valid ones.
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

    def check_arguments(self, captured: CapturedStep, mesh: DeviceMesh, placements: list[Placements]) -> None:
        # NOTE: [a list of samples split as batch tensors]: an item given a placement
        # is the user's word for it
        given = {ref.name for ref, _ in captured.inputs if ref.kind is Kind.INPUT and ref.index in self.input_placements}
        check_listed_samples(
            captured, mesh, placements, lambda name: name in given, active_simulation() is not None,
            hint="pad the per-sample tensors into one batch tensor in the collate function, with "
            "a count or validity mask, and use them in the step batched or masked (its dimension "
            "0 is then split with the batch); or give each item input_placements={i: "
            "(Replicate(),)} only if every rank passes the same whole list.",
        )

    def partition(self, captured: CapturedStep, mesh: DeviceMesh) -> DistributedProgram:
        self._check_input_placements(captured, mesh)
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

    def _check_input_placements(self, captured: CapturedStep, mesh: DeviceMesh) -> None:
        """Refuse an index that is no tensor argument of the call (it was ignored: the
        argument it meant stayed Shard(0)), and placements of a length other than the
        mesh's dimensions (a 2-tuple on a 1-D mesh failed in DTensor with "zip()
        argument 2 is shorter than argument 1")."""
        arguments = {ref.index: ref.name for ref, _ in captured.inputs if ref.kind is Kind.INPUT}
        shown = ", ".join(f"{i} ({name})" for i, name in sorted(arguments.items())) or "none"
        # an index that covered an argument of an earlier call: an optional argument this
        # call leaves out (kept by the mode's identity, as batch_dims' _COVERED is)
        covered = _COVERED.setdefault(self, set())
        covered.update(i for i in self.input_placements if i in arguments)
        for index, placements in self.input_placements.items():
            if index not in arguments and index in covered:
                continue
            if index not in arguments:
                raise SPMDCompileError(
                    f"DTensorExpandMode input_placements names index {index}, but the step "
                    f"has {len(arguments)} tensor argument(s) in this call; the argument it "
                    "meant would be split on dimension 0. Valid indices (tensor arguments "
                    f"only, in call order, counted from 0): {shown}.",
                    hint="key input_placements by one of the valid indices.",
                )
            if len(placements) != mesh.ndim:
                raise SPMDCompileError(
                    f"DTensorExpandMode input_placements[{index}] for tensor argument "
                    f"{arguments[index]!r} has {len(placements)} entries {placements}, but the "
                    f"mesh has {mesh.ndim} dimension(s): one placement per mesh dimension.",
                    hint=f"give {mesh.ndim} placement(s), e.g. "
                    f"{tuple(Replicate() for _ in range(mesh.ndim))}.",
                )

    def __repr__(self) -> str:
        return f"DTensorExpandMode(input_placements={self.input_placements})"
