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

from ..capture.bindings import StepBindings
from ..capture.guards import Guards
from ..expand.retrace import DistributedProgram, Placements
from ..ir.signature import StateRef
from ..lower import Executable, LoweringOptions
from .runner import FeedPlan, install_state, run_finish, run_program
from .same_inputs import InputAgreement, describe_constants, describe_values_read, values_digest
from .simulate import Simulation

#: ``ParallelMode.placements``: (ref, global meta, mesh[, parameter's shape, for state])
PlacementOf = Callable[..., Placements]


@dataclass
class PendingUpdate:
    """The deferred part of the last call, not yet applied."""

    bindings: StepBindings
    carry: list[torch.Tensor]
    sim: Simulation | None


@dataclass(frozen=True)
class CallResult:
    """What one call returned, and where its time went: ``lower_seconds`` > 0 when the
    call lowered a graph (NOTE: [lowering]), so ``run_seconds`` is not a step time."""

    value: Any
    run_seconds: float
    lower_seconds: float


# Executables holding a deferred update, so that code reading the state can finish them.
_WITH_PENDING_UPDATES: weakref.WeakSet[StepExecutable] = weakref.WeakSet()


def flush_pending_updates() -> int:
    """Apply every deferred update of every compiled step; returns how many there were.
    Checkpointing calls this before it reads state."""
    return sum(exe.flush() for exe in list(_WITH_PENDING_UPDATES))


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
        # NOTE: [hyper-parameters without a device sync]
        self._hyperparams: dict[StateRef, tuple[float, torch.Tensor]] = {}
        self._feed = FeedPlan.of(program)  # NOTE: [one walk over the state per call]

    @property
    def has_pending_update(self) -> bool:
        return self._pending is not None

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
                    self._values_read
                )
            agreement.constants, agreement.values_read = self._constants, self._values_read
        pending = self._pending
        if pending is not None and (pending.sim is not sim or not _same_objects(pending.bindings, bindings)):
            self.flush()
            pending = None
        install_state(bindings, self.placement_of, self.program.mesh, sim, self._installed)
        lowered_before = self.lowered.compile_seconds
        start = time.perf_counter()
        value, carry = run_program(
            self.program, self.lowered, bindings, tensor_args, sim,
            pending.carry if pending else None, agreement, self._hyperparams, self._feed,
        )
        elapsed = time.perf_counter() - start
        self._pending = None
        if carry is not None:
            self._pending = PendingUpdate(bindings, carry, sim)
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
        run_finish(self.program, self.lowered, pending.bindings, pending.carry, pending.sim)
        return True


def _same_objects(a: StepBindings, b: StepBindings) -> bool:
    return all(
        len(x) == len(y) and all(p is q for p, q in zip(x, y))
        for x, y in ((a.modules, b.modules), (a.optimizers, b.optimizers))
    )
