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

What a mode author implements, and the files touched: docs/modes/writing_a_mode.md.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Placement, Replicate, Shard

from spmd_compiler import _torch_private as private
from spmd_compiler.capture.bindings import StepBindings
from spmd_compiler.capture.trace import CaptureOptions
from spmd_compiler.expand.retrace import DistributedProgram, Placements, expand
from spmd_compiler.ir.signature import CapturedStep, Kind, StateRef, TensorMeta
from spmd_compiler.ir.use_step import UseHook
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

    def local_index_inputs(self) -> dict[str, str]:
        """Index arguments numbered from 0 on each rank, each with the argument whose batch
        dimension its values index (NOTE: [indices into the global batch] in
        ``parallel_modes/local_indices.py``); none by default."""
        return {}

    def capture_options(self) -> CaptureOptions:
        """How the single-device program computes (e.g. mixed precision)."""
        return CaptureOptions()

    @abc.abstractmethod
    def placement_of(self, ref: StateRef, meta: TensorMeta, mesh: DeviceMesh) -> Placements:
        """The placement of one graph input or output on ``mesh``."""

    def placements(
        self, ref: StateRef, meta: TensorMeta, mesh: DeviceMesh, param_shape: Sequence[int] | None = None
    ) -> Placements:
        """``placement_of``, with the rule every mode shares for optimizer state shaped
        unlike its parameter (NOTE: [state shaped unlike its parameter]);
        ``param_shape``: the global shape of the parameter ``ref`` names, for state."""
        placements = self.placement_of(ref, meta, mesh)
        if ref.kind is Kind.OPTIM_STATE and param_shape is not None:
            return placements_for_state(placements, tuple(meta.shape), tuple(param_shape))
        return placements

    def partition(self, captured: CapturedStep, mesh: DeviceMesh) -> DistributedProgram:
        """Phase 1: the distributed per-rank program for ``captured``."""
        params = captured.param_metas()

        def placements(ref: StateRef, meta: TensorMeta) -> Placements:
            param = params.get(ref.name)
            return self.placements(ref, meta, mesh, param.shape if param is not None else None)

        inputs = [placements(ref, meta) for ref, meta in captured.inputs]
        self.check_arguments(captured, mesh, inputs)
        outputs = [
            placements(ref, meta)
            for ref, meta in zip(captured.outputs, captured.output_metas, strict=True)
        ]
        return expand(
            captured, mesh, inputs, outputs, self.placement_at_use(captured, mesh),
            self.gradient_placement(captured, mesh), self.gradient_rows(captured, mesh),
            self.rounds_low_precision_sums(), batch_dims_named=hasattr(self, "input_batch_dim"),
        )

    def check_arguments(self, captured: CapturedStep, mesh: DeviceMesh, placements: list[Placements]) -> None:
        """Refuse arguments ``placements`` would split wrong, before expansion reads
        them (a list of samples split as batch tensors: NOTE: [a list of samples split
        as batch tensors] in ``expand/listed_samples.py``); nothing by default."""
        return

    def rounds_low_precision_sums(self) -> bool:
        """Whether a pending sum cast up from float16 / bfloat16 (a weight gradient
        under ``torch.autocast``) is rounded back to that dtype where it is reduced, as
        one device rounds its whole sum (NOTE: [low-precision partials rounded where
        reduced] in ``expand/retrace.py``). Yes by default; a mode whose mixed-precision
        policy names the dtype gradients are reduced in says no."""
        return True

    def gradient_placement(
        self, captured: CapturedStep, mesh: DeviceMesh
    ) -> Callable[[str], Placements | None] | None:
        """Where a parameter's gradient settles when something outside backward first
        reads it (NOTE: [gradients settle after backward]): by default its ``GRAD``
        placement on a 1-D mesh; None leaves gradients as DTensor propagates them (a
        mode that reduces them itself, as FSDP x TP does at the update)."""
        if mesh.ndim != 1:
            return None
        metas = captured.param_metas()

        def placement(name: str) -> Placements | None:
            meta = metas.get(name)
            return None if meta is None else self.placement_of(StateRef(Kind.GRAD, name), meta, mesh)

        return placement

    def gradient_rows(
        self, captured: CapturedStep, mesh: DeviceMesh
    ) -> Callable[[str], Placements | None] | None:
        """Where each parameter's gradient ends up sharded, read for its ``Shard``
        entries only: a gradient that is one ``mm`` of operands replicated on such a mesh
        dimension is computed on the rank's rows there (NOTE: [weight gradients computed
        on the rows kept] in ``expand/retrace.py``). By default where it settles
        (``gradient_placement``); a mode that reduces gradients itself names its own."""
        return self.gradient_placement(captured, mesh)

    def placement_at_use(self, captured: CapturedStep, mesh: DeviceMesh) -> UseHook | None:
        """Placements values must have where particular nodes read them (default: none).

        Returns ``hook(consumer, arg) -> [UseStep, ...] | None`` (``ir/use_step.py``); uses
        whose steps share a key share one redistribution.
        """
        return None

    def local_batch(
        self, x: torch.Tensor, rank: int, *, index: int = 0, mesh: DeviceMesh | None = None,
        name: str = "",
    ) -> torch.Tensor:
        """Rank ``rank``'s share of ``x``, the step's ``index``-th tensor argument of the
        global batch: what that rank passes on real ranks.

        By default the rank's piece of ``x`` under ``placement_of`` for the argument,
        which is what a simulated rank gets from the global batch.

        Args:
            x: the global tensor.
            rank: the global rank whose share to cut.
            index: the position of ``x`` among the step's tensor arguments.
            mesh: the mode's mesh; by default ``self.mesh(x.device.type)``.
            name: the argument's name in the step (``h``, ``batch['mask']``), which a
                mode may place by (``input_batch_dim``, NOTE: [inputs by name]).
        """
        if name and name in self.local_index_inputs():
            # NOTE: [indices into the global batch]: the slice holds global ids, and the
            # runtime would add the rank's offset again (silently wrong from 3 ranks)
            raise ValueError(
                f"local_batch({name!r}): {name} is named in input_index_of, so each rank "
                "passes ids numbered from 0, and the runtime adds the rank's offset; the "
                "slice of the global batch holds global ids. Collate each rank's share "
                "itself (its ids from 0), or drop input_index_of and pass global ids."
            )
        mesh = mesh if mesh is not None else self.mesh(x.device.type)
        meta = TensorMeta(tuple(x.shape), x.dtype, x.device, False)
        placements = self.placement_of(StateRef(Kind.INPUT, name=name, index=index), meta, mesh)
        return shard_for_rank(x, mesh, placements, rank)

    def transform_and_compile(
        self, program: DistributedProgram, options: PassOptions | None = None
    ) -> DistributedProgram:
        """Phase 2: run the mode's pass pipeline over the per-rank program."""
        return run_pipeline(program, options or PassOptions())

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def replicate(mesh: DeviceMesh) -> tuple[Placement, ...]:
    return tuple(Replicate() for _ in range(mesh.ndim))


# NOTE: [state shaped unlike its parameter]
# A mode places an optimizer's state as it places the state's parameter: the state is
# read beside the parameter, element by element, in the update. Some optimizers keep
# state of another shape: torch's Adafactor keeps a 2-D weight's second moment as a row
# factor (rows, 1) and a column factor (1, cols). Sharding those as the weight is sharded
# (fsdp's Shard(0)) would split the column factor's single row over the ranks, which no
# even shard can do. So a shard of state stays on a mesh dimension only where the state
# has the parameter's size in the sharded dimension (the row factor keeps the weight's
# row shard); elsewhere the state is replicated on that mesh dimension. Any placement is
# exact (DTensor's rules bring operands to a common placement), so this chooses layout,
# not numbers: the column factor, a mean over the weight's rows, is all-reduced once and
# kept whole on every rank (cols elements), where a shard of it would be redistributed at
# every use. The runner installs state by the same rule (``ParallelMode.placements``), so
# the program and the state agree. State of a parameter padded to an uneven shard stays
# refused (``padding._refuse_state_shaped_otherwise``): its factors are computed across
# the zero rows.
def placements_for_state(
    placements: Placements, shape: tuple[int, ...], param_shape: tuple[int, ...]
) -> Placements:
    """``placements`` (the parameter's) for state of global ``shape``: a shard kept on a
    mesh dimension only where ``shape`` has the parameter's size in the sharded dim."""
    if shape == param_shape:
        return placements
    out: list[Placement] = []
    for p in placements:
        if private.is_shard_like(p):
            dim = p.dim % len(shape) if shape and -len(shape) <= p.dim < len(shape) else None
            if dim is None or dim >= len(param_shape) or shape[dim] != param_shape[dim]:
                p = Replicate()
        out.append(p)
    return tuple(out)


def shard_for_rank(
    x: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement], rank: int
) -> torch.Tensor:
    """Rank ``rank``'s piece of the global ``x`` placed ``placements`` on ``mesh``
    (``distribute_tensor``'s pieces: mesh dimensions left to right, ``torch.chunk``).

    Raises:
        ValueError: ``rank`` is not in ``mesh``, a placement is neither Shard nor
            Replicate, or a sharded dimension does not divide evenly.
    """
    coordinate = private.mesh_coordinate(mesh, rank)
    if coordinate is None:
        raise ValueError(f"rank {rank} is not in {mesh}")
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Replicate):
            continue
        if type(p) is not Shard:
            raise ValueError(f"a step argument placed {p} has no per-rank share to cut")
        n = mesh.size(mesh_dim)
        if p.dim >= x.dim() or p.dim < -x.dim() or x.shape[p.dim] % n:
            raise ValueError(
                f"a step argument of shape {tuple(x.shape)} does not split evenly over "
                f"the {n} ranks of mesh dimension {mesh_dim} on its dimension {p.dim}"
            )
        x = x.chunk(n, p.dim)[coordinate[mesh_dim]]
    return x.contiguous()
