"""What a compile returns and every call runs: the per-rank program, lowered, with the
update its last call deferred.

A ``StepExecutable`` is the one runtime object of a compiled program. ``run`` installs
the state, runs the program (its ``first`` / ``steady`` programs when cross-iteration
overlap deferred a reduction, NOTE: [cross-iteration overlap]) and keeps the deferred
update until the next call or ``flush``. All the bookkeeping of deferred updates lives
here: ``CompiledTrainStep`` only runs the executable of the call's program and flushes
the previous one when the program changes.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .. import _torch_private as private
from ..capture.bindings import StepBindings
from ..capture.guards import Guards
from ..errors import SPMDRuntimeError
from ..expand.retrace import DistributedProgram, Placements
from ..ir.signature import Kind, StateRef
from ..lower import Executable, LoweringOptions
from .faults import default_store, record_failure
from .runner import (
    FeedPlan,
    current_state_value,
    install_state,
    run_finish,
    run_program,
    state_value,
)
from .same_inputs import (
    InputAgreement,
    describe_constants,
    describe_generators,
    describe_values_read,
    drawn_devices,
    traced_text,
    values_digest,
)
from .simulate import Simulation

#: ``ParallelMode.placements``: (ref, global meta, mesh[, parameter's shape, for state])
PlacementOf = Callable[..., Placements]


@dataclass
class PendingUpdate:
    """The deferred part of the last call, not yet applied."""

    bindings: StepBindings
    carry: list[torch.Tensor]
    sim: Simulation | None
    # what the call left in each state tensor ``finish`` writes (NOTE: [writes between
    # calls while an update is pending])
    left: list[StateLeft]


@dataclass(frozen=True)
class CallResult:
    """What one call returned, and where its time went: ``lower_seconds`` > 0 when the
    call lowered a graph (NOTE: [lowering]), so ``run_seconds`` is not a step time."""

    value: Any
    run_seconds: float
    lower_seconds: float


# Executables holding a deferred update, so that code reading the state can finish them.
_WITH_PENDING_UPDATES: weakref.WeakSet[StepExecutable] = weakref.WeakSet()


def any_pending_updates() -> bool:
    """Whether some compiled step holds a deferred update."""
    return len(_WITH_PENDING_UPDATES) > 0


def flush_pending_updates(keep: StepExecutable | None = None, sharing: StepBindings | None = None) -> int:
    """Apply every deferred update of every compiled step (but ``keep``'s; with
    ``sharing``, only those on a module, parameter or optimizer of it); returns how many
    there were. Checkpointing, loading a state dict and every compiled call (NOTE:
    [another step flushes first]) call this before they read or write state."""
    return sum(
        exe.flush() for exe in list(_WITH_PENDING_UPDATES)
        if exe is not keep and (sharing is None or exe.shares_objects(sharing))
    )


# NOTE: [another step flushes first]
# A step with a deferred update leaves the parameters of its last bucket (and their
# optimizer state) one update behind until its next call or ``flush()``. A second compiled
# step on the same model and optimizer (an evaluation step, a second task's loss, the
# same step compiled twice) read those stale values and wrote its own update into them,
# and the first step's next call then wrote its deferred update over that, computed from
# the values before: AdamW, an overlap step and a plain step alternating, lost 0.06 -> 3248
# -> 1.6e7 (eager 0.0716, 1.43, 0.033), silently. Every compiled call now first applies
# the pending update of every other step that holds one of its modules, parameters or
# optimizers (``CompiledTrainStep.__call__``; a weak set, usually empty). Steps on other
# objects (a GAN's generator and discriminator steps) keep theirs: flushing them would
# be correct too, but each would then run its ``first`` program, without the overlap.


# NOTE: [writes between calls while an update is pending]
# Between calls of a step with a deferred update, its deferred parameters and their
# optimizer state hold the previous step's values, and the next call (or ``flush()``)
# writes the deferred update over them, computed from the values the step saw. A write the
# user made in between (``model.load_state_dict(best)``, ``head.weight.mul_(0.5)``,
# ``optimizer.load_state_dict``) was thrown away silently (9e-2, 9.6 and 1.4e-1 relative
# off eager). ``load_state_dict`` of a model or optimizer a compiled step placed flushes
# first (its pre-hooks, ``runtime/eager_calls.py``), so a load lands on the completed
# step's state, as eagerly. Any other write is found before the update is applied: each
# call records the identity and version counter of every state tensor ``finish`` writes
# (the DTensor and its local shard, after the call's own write-back), and the next call
# and ``flush()`` compare; a difference is refused naming the tensor, the pending update
# is dropped (applying it would overwrite the write; the error says the state is
# inconsistent and how to avoid it).
@dataclass(frozen=True)
class StateLeft:
    """One state tensor as a call left it: the object, its local shard and the version
    counters of both (an in-place op on a DTensor advances the DTensor's own counter, not
    its shard's; a write through ``to_local()`` the shard's)."""

    ref: StateRef
    obj: torch.Tensor
    local: torch.Tensor
    version: tuple[int, int]


def _versions(obj: torch.Tensor, local: torch.Tensor) -> tuple[int, int]:
    return private.version_of(obj), private.version_of(local)


def _left_by(program: DistributedProgram, bindings: StepBindings) -> list[StateLeft]:
    plan = program.deferred
    assert plan is not None
    out = []
    for j in plan.positions:
        ref = program.captured.outputs[j]
        obj = state_value(bindings, ref)
        local = private.local_tensor_of(obj) if isinstance(obj, DTensor) else obj
        out.append(StateLeft(ref, obj, local, _versions(obj, local)))
    return out


def _first_write(left: list[StateLeft], bindings: StepBindings, current_param: bool) -> tuple[StateRef, str] | None:
    """The first state tensor written since the call that left ``left``, and how."""
    for entry in left:
        try:
            obj = current_state_value(bindings, entry.ref) if current_param else state_value(bindings, entry.ref)
        except KeyError:
            return entry.ref, "was removed"
        if obj is not entry.obj:
            return entry.ref, "was replaced by another tensor"
        local = private.local_tensor_of(obj) if isinstance(obj, DTensor) else obj
        if local is not entry.local:
            return entry.ref, "was replaced by another tensor"
        if _versions(obj, local) != entry.version:
            return entry.ref, "was written in place"
    return None


def _batch_split_everywhere(program: DistributedProgram) -> bool:
    """Whether every batch argument is split over every mesh dimension (data
    parallelism), with at least one: NOTE: [generators agree across ranks]."""
    batch = [
        placements for (ref, meta), placements in zip(program.captured.inputs, program.input_placements, strict=True)
        if ref.kind is Kind.INPUT and meta.shape
    ]
    return bool(batch) and all(
        len(placements) == program.mesh.ndim and all(private.is_shard_like(p) for p in placements)
        for placements in batch
    )


class StepExecutable:
    """One compiled program, ready to run on the user's state."""

    def __init__(
        self,
        program: DistributedProgram,
        placement_of: PlacementOf,
        lowering: LoweringOptions,
        inductor_dir: Path | None = None,
    ) -> None:
        self.program = program
        self.placement_of = placement_of
        # the lowered graphs (lazily compiled on a real rank's first call)
        self.lowered = Executable.of(program, lowering, inductor_dir)
        program.executable = self.lowered
        self._pending: PendingUpdate | None = None
        # ids of state tensors install_state checked, and the walks it checked them on
        self._installed: set[Any] = set()
        self._constants: str | None = None  # NOTE: [constants agree across ranks]
        # the guards the program was compiled under (set by who compiled it), whose
        # values the ranks compare: NOTE: [Python values agree across ranks]
        self.guards: Guards | None = None
        self._values_read = ""
        # the device types whose default generator the program draws from (None: not
        # looked at yet): NOTE: [generators agree across ranks]
        self._drawn: tuple[str, ...] | None = None
        # NOTE: [hyper-parameters without a device sync]
        self._hyperparams: dict[StateRef, tuple[float, torch.Tensor]] = {}
        self._feed = FeedPlan.of(program)  # NOTE: [one walk over the state per call]
        # the number of the compiled step's call that last ran it: NOTE: [programs kept in
        # memory] in api.py
        self.last_used = 0
        # whether a call completed on it, the way its `if`s on values went (NOTE:
        # [programs for the ways of ifs] in capture/value_checks.py)
        self.completed = False

    @property
    def has_pending_update(self) -> bool:
        return self._pending is not None

    def shares_objects(self, bindings: StepBindings) -> bool:
        """Whether the pending update is on a module, parameter or optimizer of
        ``bindings`` (NOTE: [another step flushes first])."""
        pending = self._pending
        if pending is None:
            return False
        mine = pending.bindings
        if any(m is n for m in mine.modules for n in bindings.modules):
            return True
        if any(o is p for o in mine.optimizers for p in bindings.optimizers):
            return True
        ids = {id(p) for p in mine.params.values()}
        return any(id(p) in ids for p in bindings.params.values())

    def run(
        self, bindings: StepBindings, tensor_args: list[torch.Tensor], sim: Simulation | None,
        agreement: InputAgreement | None = None,
    ) -> CallResult:
        """One step on ``bindings``' state; a deferred update of another set of objects
        (or another simulation) is applied first. ``agreement``: the input check's round
        of a call on real ranks (NOTE: [same inputs on all ranks])."""
        if agreement is not None:
            if self._constants is None:  # once: a constant cannot change under a program
                self._values_read = describe_values_read(self.guards.across_ranks() if self.guards else [])
                self._constants = describe_constants(self.program.captured.outside) + values_digest(
                    traced_text(self.program.captured)  # NOTE: [the traced step as captured]
                )
            agreement.constants, agreement.values_read = self._constants, self._values_read
            if self._drawn is None:
                self._drawn = drawn_devices(
                    self.program.captured.graph_module, _batch_split_everywhere(self.program),
                    self.program.graph_module, self.program.mesh.ndim,
                )
            if self._drawn:  # every call: the draws move the state (NOTE: [generators agree across ranks])
                agreement.generators = describe_generators(self._drawn)
        pending = self._pending
        if pending is not None and (pending.sim is not sim or not _same_objects(pending.bindings, bindings)):
            self.flush()
            pending = None
        if pending is not None:  # NOTE: [writes between calls while an update is pending]
            self._refuse_writes(pending, bindings, current_param=False)
        if agreement is not None and self.program.deferred is not None:
            agreement.pending_update = pending is not None  # NOTE: [a flush on some ranks only]
        install_state(
            bindings, self.placement_of, self.program.mesh, sim, self._installed,
            agreement.before_install if agreement is not None else None,
        )
        lowered_before = self.lowered.compile_seconds
        rewind = _generator_states(self.program.captured.rewound_generators)
        start = time.perf_counter()
        value, carry = run_program(
            self.program, self.lowered, bindings, tensor_args, sim,
            pending.carry if pending else None, agreement, self._hyperparams, self._feed,
        )
        elapsed = time.perf_counter() - start
        for put_back in rewind:  # NOTE: [a step's own fork_rng]
            put_back()
        self._pending = None
        if carry is not None:
            self._pending = PendingUpdate(bindings, carry, sim, _left_by(self.program, bindings))
            _WITH_PENDING_UPDATES.add(self)
            if sim is not None and pending is None:
                sim.at_exit(self.flush)
        return CallResult(value, elapsed, self.lowered.compile_seconds - lowered_before)

    def flush(self) -> bool:
        """Apply the update the last call deferred; returns whether there was one."""
        pending, self._pending = self._pending, None
        _WITH_PENDING_UPDATES.discard(self)
        if pending is None:
            return False
        # an earlier call's bindings: its parameters are looked up in the modules afresh
        self._refuse_writes(pending, pending.bindings, current_param=True)
        run_finish(self.program, self.lowered, pending.bindings, pending.carry, pending.sim)
        return True


    def _refuse_writes(self, pending: PendingUpdate, bindings: StepBindings, current_param: bool) -> None:
        """Refuse to apply ``pending`` over a write made since its call (NOTE: [writes
        between calls while an update is pending]); the update is dropped then."""
        found = _first_write(pending.left, bindings, current_param)
        if found is None:
            return
        self._pending = None
        _WITH_PENDING_UPDATES.discard(self)
        ref, how = found
        # its reductions are waited for (an in-flight collective must not be left), its
        # result thrown away
        run_finish(self.program, self.lowered, pending.bindings, pending.carry, pending.sim, discard=True)
        message = (
            f"{ref} {how} between calls of a compiled step with cross_iteration_overlap, "
            "while the last call's update of it was still deferred: applying that update "
            "would overwrite the write silently. The deferred update was dropped, so the "
            "deferred parameters and optimizer state that were not written lack the last "
            "step's update: restore the model and optimizer (a checkpoint) before going "
            "on. Call step.flush() before writing the model or optimizer between calls "
            "(load_state_dict of a model or optimizer does it by itself)."
        )
        if pending.sim is None:  # the other ranks' next collective says why this one left
            store = default_store()
            if store is not None:
                record_failure(store, dist.get_rank(), f"a state write refused: {ref} {how} while its update was deferred")
        raise SPMDRuntimeError(message)


def _generator_states(device_types: tuple[str, ...]) -> list[Any]:
    """For each device type in ``device_types``, a function that sets its default
    generator back to its state now (NOTE: [a step's own fork_rng]; CUDA's of the
    current device, the rank's)."""
    out: list[Any] = []
    for kind in device_types:
        if kind == "cpu":
            state = torch.get_rng_state()
            out.append(lambda state=state: torch.set_rng_state(state))
        elif kind == "cuda":
            state = torch.cuda.get_rng_state()
            out.append(lambda state=state: torch.cuda.set_rng_state(state))
    return out


def _same_objects(a: StepBindings, b: StepBindings) -> bool:
    return all(
        len(x) == len(y) and all(p is q for p, q in zip(x, y))
        for x, y in ((a.modules, b.modules), (a.optimizers, b.optimizers))
    )
