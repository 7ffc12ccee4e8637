"""The ParallelMode contract: plan placements, partition, transform and compile.

NOTE: [two-phase ParallelMode contract]
Kept from torch's former SPMD compiler. ``partition`` turns the captured single-device
graph into the distributed per-rank program (placements chosen by the mode, collectives
inserted by expansion); ``transform_and_compile`` applies the mode's passes and returns
what runs. A mode decides placements through one function, ``placement_of(ref, meta,
mesh)``, asked for every graph input and output. It is asked before capture for the
step's tensor arguments (a real rank derives the global shape from its local batch) and
after capture for state and returned values. Because it depends only on the ref and the
global metadata, new state keeps the placement of the state it replaces.
"""

from __future__ import annotations

import abc

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Placement, Replicate

from spmd_compiler.capture.bindings import StepBindings
from spmd_compiler.capture.trace import CaptureOptions
from spmd_compiler.expand.retrace import DistributedProgram, Placements, UseHook, expand
from spmd_compiler.ir.signature import CapturedStep, StateRef, TensorMeta
from spmd_compiler.passes import PassOptions, run_pipeline


class ParallelMode(abc.ABC):
    """How a train step is spread over ranks. Subclasses choose placements."""

    #: Name shown in dumps and the demo (``--mode``).
    name: str = "parallel_mode"

    def __init__(self, mesh: DeviceMesh | None = None) -> None:
        self._mesh = mesh

    def mesh(self, device_type: str) -> DeviceMesh:
        """The mode's mesh; by default 1-D over every rank of the default group."""
        if self._mesh is None:
            return init_device_mesh(device_type, (dist.get_world_size(),))
        if self._mesh.device_type != device_type:
            raise ValueError(
                f"{type(self).__name__} was given a {self._mesh.device_type} mesh but the "
                f"model lives on {device_type}."
            )
        return self._mesh

    def prepare(self, bindings: StepBindings) -> None:  # noqa: B027 - optional hook
        """Look at the step's modules before capture (e.g. match a plan); default no-op."""

    def capture_options(self) -> CaptureOptions:
        """How the single-device program computes (e.g. mixed precision)."""
        return CaptureOptions()

    @abc.abstractmethod
    def placement_of(self, ref: StateRef, meta: TensorMeta, mesh: DeviceMesh) -> Placements:
        """The placement of one graph input or output on ``mesh``."""

    def partition(self, captured: CapturedStep, mesh: DeviceMesh) -> DistributedProgram:
        """Phase 1: the distributed per-rank program for ``captured``."""
        inputs = [self.placement_of(ref, meta, mesh) for ref, meta in captured.inputs]
        outputs = [
            self.placement_of(ref, meta, mesh)
            for ref, meta in zip(captured.outputs, captured.output_metas, strict=True)
        ]
        return expand(captured, mesh, inputs, outputs, self.placement_at_use(captured, mesh))

    def placement_at_use(self, captured: CapturedStep, mesh: DeviceMesh) -> UseHook | None:
        """Placements values must have where particular nodes read them (default: none).

        Returns ``hook(consumer, arg) -> (placements, group) | None``; uses in one group
        share one redistribution (see ``expand``).
        """
        return None

    def transform_and_compile(
        self, program: DistributedProgram, options: PassOptions | None = None
    ) -> DistributedProgram:
        """Phase 2: run the mode's pass pipeline over the per-rank program."""
        return run_pipeline(program, options or PassOptions())

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def replicate(mesh: DeviceMesh) -> tuple[Placement, ...]:
    return tuple(Replicate() for _ in range(mesh.ndim))
