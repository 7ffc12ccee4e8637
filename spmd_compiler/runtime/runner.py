"""Own the sharded training state, run the per-rank program, write new state back.

NOTE: [state ownership]
After the first compile the user's parameters, buffers, gradients and optimizer state
are DTensors with the mode's placements (``install_state``): the same ``nn.Parameter``
objects are replaced everywhere they appear (tied weights stay tied), the optimizer's
param groups and state are re-keyed, so ``model.state_dict()`` and
``optimizer.state_dict()`` hold DTensors and torch.distributed.checkpoint works. Each
step feeds the graph the local shards and installs the new local shards by swapping each
DTensor's local tensor (no copy). Nothing is installed until compilation has succeeded.
"""

from __future__ import annotations

import logging
import operator
import weakref
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from .. import _torch_private as private
from .._torch_private import pytree
from ..capture.bindings import (
    StepBindings,
    forget_replacement,
    record_placed_away,
    record_replacement,
)
from ..capture.containers import close_returned
from ..capture.trace import HYPERPARAM_DTYPE, state_dtype
from ..capture.value_checks import OWN_CHECK, REFUSED_ITEM, REFUSED_WAY_TEXTS, UNTRACED, stop_of
from ..errors import SPMDCompileError, SPMDRuntimeError, collective_failure, exception_summary
from ..expand.retrace import DistributedProgram, Placements, format_placements
from ..ir.signature import (
    Kind,
    StateRef,
    TensorMeta,
    ValueCheck,
    contiguous_stride,
    optim_state_dtype,
)
from ..lower import Executable, LoweredGraph
from ..state_donation import donation_pairs
from .eager_calls import (
    flush_before_loads,
    guard_direct_calls,
    intercept_data_assignment,
    place_loaded_state,
)
from .faults import attribution, default_store, describe_exception, record_failure
from .kernel_failures import failing_node, failing_site, in_a_collective, where
from .rank_failures import drain_collectives, failed_everywhere
from .same_inputs import InputAgreement, RanksFailed, StatusRound
from .simulate import RanksDisagree, Simulation, mesh_is_live

log = logging.getLogger("spmd_compiler")


@dataclass
class StepTimings:
    """Seconds spent by one compiled step, summed over its compiles. ``compile_seconds``
    is all of it (capture, expansion, passes, cache loads and lowering on first calls);
    the others are its parts. ``step_seconds`` holds the seconds of the latest calls that
    did not lower, oldest first (at most ``STEP_TIMES_KEPT``: a long run's step keeps a
    bounded history, not a float per step it ever ran)."""

    compile_seconds: float = 0.0
    capture_seconds: float = 0.0
    expand_seconds: float = 0.0
    pass_seconds: float = 0.0
    lower_seconds: float = 0.0
    cache_load_seconds: float = 0.0
    step_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=STEP_TIMES_KEPT))


STEP_TIMES_KEPT = 10_000


# NOTE: [a failed first call leaves the model as it was]
# The first call of a step places the model and optimizer state (``_install``: each
# parameter and buffer replaced in its module by a DTensor, the optimizers pointed at the
# new parameters, their state converted) before the program runs. When that call then
# fails (a value check that came out the way no program holds, a fault on a rank, an
# error in a branch's compile), nothing was updated, but the model was left placed: its
# parameters DTensors, so the user could not go on eagerly (calling the model raised),
# where a failure at capture leaves the model untouched. Each install records how to put
# back what it replaced; the call that made it undoes it if it fails (``undo_installs``,
# from ``CompiledTrainStep._call``) and keeps it otherwise (``keep_installs``). The old
# parameter objects come back (what the user holds is the model's again), with their
# gradients and the optimizers' old state dicts, and the verified-set of the program
# that installed is cleared.
_UNDO: list[Callable[[], None]] = []


def undo_installs() -> None:
    """Put back what this call's installs replaced (see the NOTE), newest first."""
    while _UNDO:
        _UNDO.pop()()


def keep_installs() -> None:
    """This call succeeded: its installs stay."""
    _UNDO.clear()


def install_state(
    bindings: StepBindings,
    placement_of: Any,
    mesh: DeviceMesh,
    sim: Simulation | None,
    verified: set[Any] | None = None,
    before_placing: Callable[[], None] | None = None,
) -> None:
    """Turn every plain state tensor of the step into a DTensor with its placement.

    ``before_placing`` is called first when some state tensor is still a plain one
    (its placing broadcasts on real ranks: NOTE: [a rank that fails before its program]).

    ``verified`` (kept by the compiled step) holds the ids of state tensors already
    installed and checked; when every tensor of the call is among them, nothing is
    walked again (the common case: every step after the first two). When the call's
    walks found every object of the last fresh walk (``WalkMemo``) and this set was
    last checked against that walk, not even that (NOTE: [one walk over the state per
    call]).
    """
    walk = bindings.walk
    if verified is not None and walk is not None and walk in verified:
        return
    if verified is not None and all(
        isinstance(t, DTensor) and id(t) in verified for t in _state_tensors(bindings)
    ):
        if walk is not None:
            verified.add(walk)
        return
    if before_placing is not None and not all(isinstance(t, DTensor) for t in _state_tensors(bindings)):
        before_placing()
    _install(bindings, placement_of, mesh, sim)
    bindings.forget_state_dicts()  # the optimizers' state dicts are new ones now
    if verified is not None:
        verified.update(id(t) for t in _state_tensors(bindings))
        _UNDO.append(verified.clear)  # undone first: ids of the DTensors undone


def _state_tensors(bindings: StepBindings) -> list[torch.Tensor]:
    # isinstance(x, DTensor) first: isinstance(x, torch.Tensor) goes through
    # torch.Tensor's metaclass for a subclass, ~105 ns a call against 13 (hundreds of
    # state tensors, every call; NOTE: [one walk over the state per call])
    out: list[torch.Tensor] = [*bindings.params.values(), *bindings.buffers.values()]
    for opt in bindings.optimizers:
        for entries in opt.state.values():
            out += [v for v in entries.values() if isinstance(v, DTensor) or isinstance(v, torch.Tensor)]
    return out


def _install(
    bindings: StepBindings, placement_of: Any, mesh: DeviceMesh, sim: Simulation | None
) -> None:
    rehome = _Rehome(mesh)
    new_params: dict[int, torch.nn.Parameter] = {}
    # the name of each placed parameter and buffer, by id (NOTE: [data replaced between calls])
    placed_names = {id(t): name for name, t in (*bindings.params.items(), *bindings.buffers.items())}
    _UNDO.append(_undo_of(bindings))
    p: torch.Tensor  # a parameter, later an optimizer's state key
    value: torch.Tensor | None  # a parameter, a buffer, later an optimizer's state entry
    for name, p in list(bindings.params.items()):
        ref = StateRef(Kind.PARAM, name)
        placements = placement_of(ref, TensorMeta.of(p), mesh)
        if isinstance(p, DTensor):
            rehome(p)
            _check_installed(ref, p, mesh, placements, sim)
            rehome(p.grad)
            continue
        dt = _distribute(p.detach(), mesh, placements, sim)
        new = torch.nn.Parameter(dt, requires_grad=p.requires_grad)
        _placed_by_a_step(new)  # NOTE: [a DTensor parameter the user placed]
        # NOTE: [Python attributes of parameters]: the replacement holds the same dict of
        # attributes, so the guards built on the parameter see what code sets on it later
        # (with the mark ``mark_parameters`` put there)
        new.__dict__ = p.__dict__
        if p.grad is not None:
            grad_ref = StateRef(Kind.GRAD, name)
            new.grad = _distribute(p.grad, mesh, placement_of(grad_ref, TensorMeta.of(p.grad), mesh), sim)
        new_params[id(p)] = new
        placed_names[id(new)] = name
        record_replacement(p, new, bindings.shown_parameter(name))
        record_placed_away(p)
    # NOTE: [a buffer held by several modules]: one buffer tensor registered in two
    # modules (shared running state: one writes it in place, the other reads it), or in
    # two model arguments, is one state tensor of the capture (``_walk_modules`` dedupes
    # buffers by id). It was placed once per (module, attribute): two DTensors, the
    # program's write-back went to one, the other module kept reading the old zeros
    # (losses off from the second call). It is placed once, and the same DTensor goes in
    # every module that holds it, as for parameters.
    new_buffers: dict[int, DTensor] = {}
    for mod in bindings.modules:
        for sub in mod.modules():
            for attr, value in list(sub._parameters.items()):
                if value is not None and id(value) in new_params:
                    value = sub._parameters[attr] = new_params[id(value)]
                if isinstance(value, DTensor) and id(value) in placed_names:
                    intercept_data_assignment(sub, attr, placed_names[id(value)], value)
            for attr, value in list(sub._buffers.items()):
                if value is None or isinstance(value, DTensor):
                    rehome(value)
                    if value is not None and id(value) in placed_names:
                        intercept_data_assignment(sub, attr, placed_names[id(value)], value)
                    if value is None or not _placed_otherwise(bindings, value, placement_of, mesh):
                        continue
                placed = new_buffers.get(id(value))
                if placed is None:
                    name = _buffer_name(bindings, value)
                    ref = StateRef(Kind.BUFFER, name)
                    record_placed_away(value)
                    placed = new_buffers[id(value)] = _distribute(
                        value, mesh, placement_of(ref, TensorMeta.of(value), mesh), sim
                    )
                sub._buffers[attr] = placed
                if id(value) in placed_names:
                    intercept_data_assignment(sub, attr, placed_names[id(value)], placed)
    for oi, opt in enumerate(bindings.optimizers):
        for group in opt.param_groups:
            group["params"] = [new_params.get(id(p), p) for p in group["params"]]
        new_state: defaultdict = defaultdict(dict)
        for p, entries in opt.state.items():
            new_p = new_params.get(id(p), p)
            name = bindings.param_name(p)
            converted = {}
            for key, value in entries.items():
                rehome(value)
                if isinstance(value, DTensor) and value.dtype != optim_state_dtype(tuple(value.shape), value.dtype):
                    # a float32 step counter put back as a DTensor (``load_state_dict`` of a
                    # fused Adam's state casts it): the programs count in float64 (NOTE:
                    # [float64 step counters]); before, the program ran on the float32 one
                    value = value.to(torch.float64)
                if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
                    ref = StateRef(Kind.OPTIM_STATE, name, key, oi, _group_of(opt, new_p))
                    meta = TensorMeta.of(value)
                    value = value.to(state_dtype(ref, meta))
                    # NOTE: [state shaped unlike its parameter] in parallel_modes/base.py
                    placements = placement_of(ref, meta, mesh, tuple(new_p.shape))
                    value = _distribute(value, mesh, placements, sim)
                converted[key] = value
            new_state[new_p] = converted
        opt.state = new_state
    guard_direct_calls(bindings.modules)  # NOTE: [calling a placed model directly]
    place_loaded_state(bindings.modules)  # NOTE: [loading plain tensors into a placed model]
    flush_before_loads(bindings.optimizers)  # NOTE: [writes between calls while an update is pending]
    for name, p in list(bindings.params.items()):
        bindings.params[name] = new_params.get(id(p), p)
    for name in list(bindings.buffers):
        bindings.buffers[name] = _find_buffer(bindings, name)


def _undo_of(bindings: StepBindings) -> Callable[[], None]:
    """How to put back everything ``_install`` may replace for ``bindings`` (NOTE: [a
    failed first call leaves the model as it was])."""
    slots: list[tuple[dict[str, Any], dict[str, Any]]] = [
        (entries, dict(entries))
        for mod in bindings.modules for sub in mod.modules()
        for entries in (sub._parameters, sub._buffers)
    ]
    optimizers = [
        (opt, opt.state, [(group, group["params"]) for group in opt.param_groups])
        for opt in bindings.optimizers
    ]
    params: dict[str, Any] = dict(bindings.params)
    buffers: dict[str, Any] = dict(bindings.buffers)

    def undo() -> None:
        for entries, before in slots:
            entries.clear()
            entries.update(before)
        for opt, state, groups in optimizers:
            opt.state = state
            for group, group_params in groups:
                group["params"] = group_params
        bindings.params.clear()
        bindings.params.update(params)
        bindings.buffers.clear()
        bindings.buffers.update(buffers)
        bindings.forget_state_dicts()
        for t in (*params.values(), *buffers.values()):
            forget_replacement(t)

    return undo


# NOTE: [state placed for another world size]
# A compiled model's parameters and optimizer state are sharded for the ranks of its first
# compiled call; they cannot be run at another world size in place. Calling the same step
# first in ``simulate(world_size=2)`` and then in ``simulate(world_size=4)`` ran the
# world-size-2 program (the program key did not hold the world size) and failed feeding
# its inputs with torch's bare ``AssertionError`` (``get_coordinate`` of the local-tensor
# mesh); a new step on that model said "use one parallel mode per model". Both now refuse
# before anything runs, naming the two world sizes and the way to move a model to other
# ranks (through ``sc.checkpoint``, into a fresh model and optimizer); the state is left as
# it was, and a call at the old world size goes on. The program key holds the world size,
# so a fresh model at the new one compiles its own program
# (``tests/sim/test_state_after_simulation.py``).
def state_on_another_world(what: str, placed: DeviceMesh, world: int, sim: Simulation | None) -> SPMDCompileError:
    """The error of a call at ``world`` ranks on state (``what``) placed on ``placed``
    (NOTE: [state placed for another world size])."""
    here = f"`simulate(world_size={world})`" if sim is not None else f"a process group of {world} ranks"
    return SPMDCompileError(
        f"{what} is placed on {placed.size()} ranks (by a compiled step's first call), but this "
        f"call runs on {here}: a compiled model's parameters and optimizer state are sharded "
        f"for one world size and cannot run at another in place. Nothing was changed; calls "
        f"on {placed.size()} ranks go on as before.",
        hint=(
            f"to go on at {world} ranks, move the state into a fresh model and optimizer: "
            "`sc.checkpoint.save(path, model, optim)` on the old ranks, then build a new model "
            "and optimizer and `sc.checkpoint.load(path, new_model, new_optim)` at the new "
            "world size (it reshards; the step may be the same compiled one), or, for the "
            "weights alone, `new_model.load_state_dict(sc.checkpoint.full_state_dict(model)"
            "['model'])`."
        ),
    )


def check_state_world(bindings: StepBindings, world: int, sim: Simulation | None) -> None:
    """Refuse a call at ``world`` ranks whose model state is placed on another number of
    ranks (NOTE: [state placed for another world size]); run when the step's mesh changes."""
    for kind, tensors in (("param", bindings.params), ("buffer", bindings.buffers)):
        for name, t in tensors.items():
            if isinstance(t, DTensor) and t.device_mesh.size() != world:
                raise state_on_another_world(f"{kind} {name}", t.device_mesh, world, sim)


# NOTE: [a DTensor parameter the user placed]
# A parameter the user made a DTensor (``nn.Parameter(distribute_tensor(w, mesh,
# [Shard(0)]))``, torch's ``fully_shard`` / ``parallelize_module``) under a mode that
# places it otherwise (DataParallel('replicate'): Replicate) was refused with "a compiled
# model's state stays placed as the first step placed it ... the steps that placed it go
# on as before", though no compiled step had placed it (2 gloo ranks, sixty-first
# session). The ids of the parameters a step placed are kept; any other DTensor
# parameter is the user's, and the refusal says so and what to do.
# No weak reference to the parameter: one makes ``torch.utils.swap_tensors`` refuse it,
# which ``model.double()`` / ``.to()`` of a placed model use (NOTE: [data replaced
# between calls]); ids only, so a dead parameter's id reused by the user's own DTensor
# changes which of the two refusals is given, nothing else.
_PLACED_BY_A_STEP: set[int] = set()


def _placed_by_a_step(p: torch.Tensor) -> None:
    _PLACED_BY_A_STEP.add(id(p))


def _placed_by_the_user(ref: StateRef, p: DTensor, mesh: DeviceMesh, placements: Placements) -> SPMDCompileError:
    """The refusal of a DTensor parameter no compiled step placed, which the mode would
    place otherwise (NOTE: [a DTensor parameter the user placed])."""
    return SPMDCompileError(
        f"{ref} is a DTensor placed {format_placements(p.placements)} on {p.device_mesh} by "
        f"your code (distribute_tensor, DTensor.from_local, torch's fully_shard or "
        f"parallelize_module), not by a compiled step; this step's parallel mode places it "
        f"{format_placements(placements)} on {mesh}. A compiled step places the model's "
        "state itself and does not move a placement it did not make. Nothing was changed.",
        hint=(
            "pass plain tensors and let the mode place them (a parameter made from "
            "`nn.Parameter(dt.full_tensor())` for your DTensor `dt`, before the first "
            "compiled call), or compile with a mode whose placement is yours"
            + (" (DataParallel('fully_shard') places parameters Shard(0) on a 1-D mesh of "
               "all ranks)." if tuple(p.placements) == (Shard(0),) else ".")
        ),
    )


def _check_installed(
    ref: StateRef, p: DTensor, mesh: DeviceMesh, placements: Placements, sim: Simulation | None
) -> None:
    if p.device_mesh.size() != mesh.size():  # NOTE: [state placed for another world size]
        raise state_on_another_world(str(ref), p.device_mesh, mesh.size(), sim)
    if (p.device_mesh != mesh or tuple(p.placements) != tuple(placements)) and id(p) not in _PLACED_BY_A_STEP:
        raise _placed_by_the_user(ref, p, mesh, placements)
    if p.device_mesh != mesh or tuple(p.placements) != tuple(placements):
        raise SPMDCompileError(
            f"{ref} is already a DTensor with placement {format_placements(p.placements)} on "
            f"{p.device_mesh}, but this compiled step wants {format_placements(placements)} "
            f"on {mesh}: a compiled model's state stays placed as the first step placed it, "
            "and a step with another parallel mode or plan cannot run on it in place. "
            "Nothing was changed; the steps that placed it go on as before.",
            hint=(
                "to go on under the new mode or plan, move the state into a fresh model and "
                "optimizer: `sc.checkpoint.save(path, model, optim)`, then build a new model "
                "and optimizer and `sc.checkpoint.load(path, new_model, new_optim)` (it "
                "reshards), and call the new step on them; or, for the weights alone, "
                "`new_model.load_state_dict(sc.checkpoint.full_state_dict(model)['model'])`."
            ),
        )


class _Rehome:
    """Moves a DTensor of a simulation that has ended onto this step's mesh of the same
    ranks (NOTE: [state after a simulation] in simulate.py); anything else stays. Which
    meshes are live is found once per mesh for one install (a second step's state sits
    on the first step's mesh: hundreds of tensors, one mesh)."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh
        self.live: dict[int, bool] = {}

    def __call__(self, t: torch.Tensor | None) -> None:
        if not isinstance(t, DTensor) or t.device_mesh is self.mesh or t.device_mesh != self.mesh:
            return
        live = self.live.get(id(t.device_mesh))
        if live is None:
            live = self.live[id(t.device_mesh)] = mesh_is_live(t.device_mesh)
        if not live:
            private.rehome(t, self.mesh)


# NOTE: [a buffer placed otherwise]
# A buffer that is a DTensor on the step's mesh was taken as placed. But eager code
# between calls computes new buffers from placed tensors, placed as those are:
# ``torch.nn.utils.prune`` between calls registers ``weight_mask`` placed like the
# weight, Shard(0) under fsdp, where the mode places buffers Replicate; the program
# read the shard as the whole mask (fsdp, 2 simulated ranks: "The size of tensor a (8)
# must match the size of tensor b (16)"; a buffer of one row a rank would have been
# read silently). Such a buffer is now redistributed to the mode's placements, as a
# plain one is placed (its value is the DTensor's: exact), and the new DTensor goes in
# every slot that held it. One on another mesh is left as before.
def _placed_otherwise(bindings: StepBindings, value: torch.Tensor, placement_of: Any, mesh: DeviceMesh) -> bool:
    """Whether buffer ``value`` is a DTensor on ``mesh`` placed other than the mode
    places it (NOTE: [a buffer placed otherwise])."""
    if not isinstance(value, DTensor) or value.device_mesh != mesh:
        return False
    ref = StateRef(Kind.BUFFER, _buffer_name(bindings, value))
    return tuple(value.placements) != tuple(placement_of(ref, TensorMeta.of(value), mesh))


def _distribute(t: torch.Tensor, mesh: DeviceMesh, placements: Placements, sim: Simulation | None) -> DTensor:
    if isinstance(t, DTensor):  # NOTE: [a buffer placed otherwise]
        if sim is None:
            return private.redistribute(t, placements)
        with sim.ranks():
            return private.redistribute(t, placements)  # type: ignore[no-any-return]
    if sim is not None:
        return sim.shard(t, mesh, placements)
    return distribute_tensor(t.detach(), mesh, list(placements))


def _group_of(opt: torch.optim.Optimizer, p: torch.Tensor) -> int:
    for gi, group in enumerate(opt.param_groups):
        if any(q is p for q in group["params"]):
            return gi
    return -1


def _buffer_name(bindings: StepBindings, value: torch.Tensor) -> str:
    for name, b in bindings.buffers.items():
        if b is value:
            return name
    raise KeyError("buffer not found")


def _find_buffer(bindings: StepBindings, name: str) -> torch.Tensor:
    for mi, mod in enumerate(bindings.modules):
        for fqn, b in mod.named_buffers(remove_duplicate=False):
            if bindings.module_buffers[mi].get(fqn) == name:
                return b
    raise KeyError(name)


def run_program(
    program: DistributedProgram,
    lowered: Executable,
    bindings: StepBindings,
    tensor_args: list[torch.Tensor],
    sim: Simulation | None,
    carry: list[torch.Tensor] | None = None,
    agreement: InputAgreement | None = None,
    hyperparams: dict[StateRef, tuple[float, torch.Tensor]] | None = None,
    feed: FeedPlan | None = None,
) -> tuple[Any, list[torch.Tensor] | None]:
    """Run one step of ``program`` on the installed state.

    With a deferred part (NOTE: [cross-iteration overlap]) the step runs the ``first``
    program when ``carry`` is None, else ``steady`` on the previous call's carry. On real
    ranks the input check's round (``agreement``) runs first, carrying the program's
    leading all-reduces (NOTE: [reductions that ride the input check]).

    ``hyperparams`` (kept by the caller across calls) holds the tensor each learning rate
    was last fed as (NOTE: [hyper-parameters without a device sync]); ``feed`` is the
    program's ``FeedPlan`` (made here when the caller keeps none).

    Returns:
        The step's result, and the carry for the next call (None without a deferred part).
    """
    captured = program.captured
    plan = program.deferred
    graph = lowered.for_call(carry is not None)
    feed = feed or FeedPlan.of(program)
    flat = _feed(program, feed, bindings, tensor_args, sim, hyperparams)
    if sim is not None:
        flat = [sim.per_rank_tensor(t) for t in flat]
    flat += carry or []
    try:
        outs = _run(graph, flat, sim, deferred=carry is not None, agreement=agreement)
    except SPMDCompileError:
        raise  # lowering on first need: not the data
    except Exception as exc:
        if not captured.checks or getattr(exc, "collective", False):  # another rank's
            raise  # failure, named: the program's checks have nothing to do with it
        raise _failed_before_its_checks(exc, captured.checks) from exc
    next_carry = None
    if plan is not None:
        outs, next_carry = outs[: len(outs) - plan.carry_count], outs[len(outs) - plan.carry_count :]
    if captured.checks:
        _verify_checks(program, outs, sim)
    # state handed back as the very tensor fed is already in place: nothing to swap
    # (a simulated rank's inputs are per-rank copies: never the same object)
    unchanged = {j for i, j in feed.passthrough if outs[j] is flat[i]}
    returned = _write_back(program, bindings, outs, sim, unchanged=unchanged)
    for kept in captured.kept:  # NOTE: [tensors the step keeps]
        kept.write(bindings, returned[kept.index])
    leaves = [
        returned[v] if kind == "tensor" else _item(returned[v]) if kind == "item"
        else int(_item(returned[v])) if kind == "int" else v
        for kind, v in captured.return_leaves
    ]
    returned_value = pytree.tree_unflatten(leaves, captured.return_spec)
    if captured.returns_containers:  # NOTE: [batch containers]
        returned_value = close_returned(returned_value)
    return returned_value, next_carry


# NOTE: [one walk over the state per call]
# Every call does host work in proportion to the training state: the program key reads
# each state tensor's shape and dtype, the install check, feeding and write-back visit
# every tensor again. Measured with the program stubbed out (``benchmarks.host_work``,
# one gloo rank, AdamW), an 8-layer GPT (125 parameters, 375 optimizer state tensors)
# spent 1.7 ms a call there, the GPU step's margin over torch's CUDA graphs. So the walks
# share their lookups: ``find_bindings`` walks the module tree once (parameters, buffers
# and the submodules whose training flags the key reads); ``static_key`` keeps each
# parameter's optimizer state dict as it reads it, and feeding and write-back index those
# dicts by (optimizer, parameter name) instead of hashing the parameter tensor again
# (``optim_state``); feeding follows a ``FeedPlan`` sorted once per program (one dict
# lookup per parameter for all its state, no per-input dispatch on the kind). The dicts
# stay valid through the call: write-back updates them in place, and the one place that
# replaces them, ``install_state`` on a first call, drops them (they are looked up afresh
# then). The walks themselves are kept while the objects they read stay (``WalkMemo``
# in ``capture/bindings.py``, since the twenty-eighth session): a call lists the module
# tree's parameter, buffer and child dicts with their keys and values, and the ids of
# the optimizers' groups and state, in one pass each, and when all are the last fresh
# walk's it takes that walk's names and the optimizers' part of the key (each state
# tensor's shape and dtype: the runtime only swaps a DTensor's local tensor, which keeps
# both, and anything else that changes the state puts new objects there), and
# ``install_state`` skips its check when it last passed on that walk. Everything else
# the key holds (training flags, hyper-parameters, each parameter's shape, gradient,
# ``requires_grad`` and hooks) is read every call. Write-back skips the state a program
# updated in place (handed back as the very tensor it was fed, ``FeedPlan.passthrough``),
# and the walks test ``isinstance(x, DTensor)`` before ``isinstance(x, torch.Tensor)``
# (105 against 13 ns for a subclass): 836 -> 603 us a call on the 8-layer GPT with the
# key's cache shortcut in ``api.py``; 636 -> 402 with ``WalkMemo``.

@dataclass(frozen=True)
class FeedPlan:
    """Where each input of a program comes from, sorted once per program (NOTE: [one walk
    over the state per call]): parameters and buffers by name, each parameter's optimizer
    state together (one dict lookup for its two or three tensors), and the rest (batch
    inputs, learning rates, gradients, scaler state) fed one by one by kind. ``padded``:
    the positions fed row-padded (NOTE: [uneven shards]), with their state's name."""

    size: int
    params: tuple[tuple[int, str], ...]
    buffers: tuple[tuple[int, str], ...]
    optim: tuple[tuple[int, str, tuple[tuple[int, str], ...]], ...]
    other: tuple[int, ...]
    padded: tuple[tuple[int, str], ...]
    # (input, output) positions of the state the program may hand back as it was fed,
    # updated in place (NOTE: [state donation]); write-back skips those it did
    passthrough: tuple[tuple[int, int], ...] = ()
    # the state DTensors the last fresh feed read, weakly, with their positions and the
    # walk they were read on (``WalkMemo``): a call on that walk reads them again
    kept: list[Any] = field(default_factory=list, compare=False, repr=False)

    @staticmethod
    def of(program: DistributedProgram) -> FeedPlan:
        params, buffers, other, padded = [], [], [], []
        optim: dict[tuple[int, str], list[tuple[int, str]]] = {}
        for pos, (ref, _) in enumerate(program.captured.inputs):
            if ref.kind is Kind.PARAM:
                params.append((pos, ref.name))
            elif ref.kind is Kind.BUFFER:
                buffers.append((pos, ref.name))
            elif ref.kind is Kind.OPTIM_STATE:
                optim.setdefault((ref.optimizer, ref.name), []).append((pos, ref.key))
            else:
                other.append(pos)
            if program.pads(ref):  # state of the padded kinds only
                padded.append((pos, ref.name))
        return FeedPlan(
            len(program.captured.inputs), tuple(params), tuple(buffers),
            tuple((oi, name, tuple(slots)) for (oi, name), slots in optim.items()),
            tuple(other), tuple(padded), donation_pairs(program),
        )


def _feed_state(
    plan: FeedPlan, bindings: StepBindings, flat: list[Any], captured: Any
) -> tuple[list[int], list[torch.Tensor]]:
    """Feed the parameters, buffers and optimizer state by name; returns the positions
    and the DTensors fed."""
    local_tensor_of = private.local_tensor_of
    positions: list[int] = []
    objects: list[torch.Tensor] = []
    params, buffers = bindings.params, bindings.buffers
    for pos, name in plan.params:
        objects.append(params[name])
        positions.append(pos)
    for pos, name in plan.buffers:
        objects.append(buffers[name])
        positions.append(pos)
    for oi, name, slots in plan.optim:
        state = bindings.optim_state(oi, name)
        for pos, key in slots:
            value = state[key]
            if not isinstance(value, DTensor) and not isinstance(value, torch.Tensor):
                raise KeyError(captured.inputs[pos][0])
            objects.append(value)
            positions.append(pos)
    for pos, value in zip(positions, objects, strict=True):
        flat[pos] = local_tensor_of(value)  # type: ignore[arg-type]
    return positions, objects


def _feed(
    program: DistributedProgram, plan: FeedPlan, bindings: StepBindings,
    tensor_args: list[torch.Tensor], sim: Simulation | None,
    hyperparams: dict[StateRef, tuple[float, torch.Tensor]] | None,
) -> list[torch.Tensor]:
    """The program's flat inputs: this rank's local tensors (per-rank tensors where
    simulated: ``run_program`` maps them)."""
    captured = program.captured
    flat: list[Any] = [None] * plan.size
    local_tensor_of = private.local_tensor_of
    for pos in plan.other:
        ref, meta = captured.inputs[pos]
        if ref.kind is Kind.HYPERPARAM:
            flat[pos] = _hyperparam_tensor(hyperparams, ref, bindings.hyperparam_value(ref), meta.device)
        elif ref.kind is Kind.INPUT:
            flat[pos] = _feed_input(
                tensor_args[ref.index], program.mesh, program.input_placements[pos],
                program.local_inputs[pos], sim,
            )
        elif ref.kind in (Kind.SCALER, Kind.GROUP_STATE):  # plain tensors, replicated
            # (NOTE: [loss scaling in the program], NOTE: [tensors held in a param group])
            flat[pos] = state_value(bindings, ref)
        else:
            flat[pos] = local_tensor_of(state_value(bindings, ref))  # type: ignore[arg-type]
    walk = bindings.walk
    kept = plan.kept
    if walk is not None and kept and kept[0] == walk:  # the same objects: no lookups
        positions, refs = kept[1], kept[2]
        for pos, local in zip(positions, private.local_tensors_of(map(operator.call, refs)), strict=True):
            flat[pos] = local
    else:
        positions, objects = _feed_state(plan, bindings, flat, captured)
        kept[:] = [walk, positions, [weakref.ref(t) for t in objects]] if walk is not None else []
    for pos, name in plan.padded:
        flat[pos] = _pad_rows(
            flat[pos], program.local_inputs[pos].shape, sim, program.padded_dims.get(name, 0)
        )
    return flat


# NOTE: [hyper-parameters without a device sync]
# A learning rate is a Python float the program reads as a 0-d float64 input. Built with
# ``torch.tensor(value, device=...)`` it was copied from host memory with a blocking copy,
# which on CUDA waits for every kernel queued before it: each call waited for the previous
# step to finish on the device before it queued anything, so the host could never run
# ahead of the GPU. Now the tensor is kept while the value stays the same (an input the
# program only reads) and made anew by a fill kernel (``torch.full``: the value travels
# as the kernel's argument, no copy) when it changes, as under a scheduler.


def _hyperparam_tensor(
    cache: dict[StateRef, tuple[float, torch.Tensor]] | None, ref: StateRef, value: float,
    device: torch.device,
) -> torch.Tensor:
    """The 0-d tensor fed for hyper-parameter ``ref`` (NOTE: [hyper-parameters without a
    device sync])."""
    kept = cache.get(ref) if cache is not None else None
    if kept is not None and kept[0] == value and kept[1].device == torch.device(device):
        return kept[1]
    t = torch.full((), value, dtype=HYPERPARAM_DTYPE, device=device)
    if cache is not None:
        cache[ref] = (value, t)
    return t


class BranchMismatch(Exception):
    """An ``if`` on a tensor's value went the other way than the program took; nothing
    was written. ``decisions``: the program's decisions up to that ``if``, then how it
    went, each with what its other branch raises ("" for a branch)."""

    def __init__(self, decisions: tuple[tuple[bool, str], ...]) -> None:
        super().__init__(f"branch {len(decisions) - 1} went the other way")
        self.decisions = decisions


def _failed_before_its_checks(exc: Exception, checks: list[ValueCheck]) -> SPMDRuntimeError:
    """A program with value checks failed while it ran, before its checks could be read
    (NOTE: [value checks]): a call where one does not hold may be why (a mask of the batch
    with a false element feeding a loss the labels it was meant to leave out)."""
    text = str(exc) if isinstance(exc, SPMDRuntimeError) else (
        f"The compiled step failed: {exception_summary(exc)}."
    )
    wheres = "; ".join(dict.fromkeys(check.where for check in checks))
    # the checks were not read: whether one failed is unknown, so both causes are told
    # (an ``if x.any():`` before a write that fails for its own reasons was blamed alone)
    return SPMDRuntimeError(
        f"{text} The program was compiled for conditions on tensor values it verifies "
        f"after it runs, at: {wheres}; it failed before it could verify them. Either this "
        "call is one where one of them does not hold, or, if they all hold, the failure "
        "is that op's own. Nothing was updated."
    )


def _verify_checks(program: DistributedProgram, outs: list[torch.Tensor], sim: Simulation | None) -> None:
    """Raise before any state is written when an ``if`` on a tensor's value came out other
    than the program assumed (NOTE: [value checks] in ``capture/value_checks.py``): a
    check raises what the step raises there, a branch asks for the other program."""
    captured = program.captured
    position = {ref.index: j for j, ref in enumerate(captured.outputs) if ref.kind is Kind.RETURN}
    for k, check in enumerate(captured.checks):
        j = position[check.output]
        value = _returned_value(
            outs[j], program.mesh, program.output_placements[j], captured.output_metas[j], sim
        )
        if bool(value.full_tensor() if isinstance(value, DTensor) else value) == check.expected:
            continue
        if not check.raised or check.raised == UNTRACED:
            # a branch, or a check decided from its bytecode whose way is traced now (NOTE:
            # [checks decided from their bytecode]): the program of the way it went
            taken = tuple((c.expected, c.raised) for c in captured.checks[:k])
            raise BranchMismatch((*taken, (not check.expected, check.raised)))
        raise check_failed(check)


def check_failed(check: ValueCheck) -> BaseException:
    """The error of a call where the check ``check`` came out the way the step raises: the
    step's own exception where that stops the run (``SystemExit``, ``KeyboardInterrupt``:
    NOTE: [a check that stops the run]), else ``SPMDRuntimeError``."""
    text = check.raised.split("\n", 1)[0]
    if text.startswith(OWN_CHECK):  # NOTE: [checks of this package decided on the spot]
        return SPMDRuntimeError(
            f"The train step at {check.where} was compiled only for calls where a condition "
            f"on a tensor's value holds, and this call's value does not: the step itself "
            f"raises nothing there (eager goes on), the compiled program cannot "
            f"({text.removeprefix(OWN_CHECK)}). Nothing was updated: the model and optimizer "
            "keep the state of the last completed step."
        )
    stop = stop_of(check.raised)
    if stop is not None:
        log.warning(
            "A check on a tensor's value at %s came out %s on this call: the step raises "
            "%s there, raised as eager does (what the step printed before it ran once, "
            "at capture). Nothing was updated.", check.where, not check.expected, text,
        )
        return stop
    if check.raised.startswith(REFUSED_WAY_TEXTS):
        # NOTE: [a way no program holds]: the step raises nothing there; the capture
        # found a use of a tensor's value in Python (``max(n.item(), 1)``, ``if
        # loss.item() > 3.0 or math.isnan(loss.item())``) whose other way no program
        # holds. Before, this opened "A check ... came out False: the step raises there",
        # of a check the user never wrote (sixty-second session).
        # what the capture met there: an ``.item()`` number compared in Python
        # (``REFUSED_ITEM``), or a branch whose other way reads a value in Python
        # (``REFUSED_READ``: a value-dependent shape such as ``x[mask]`` or
        # ``repeat_interleave`` by a tensor, another ``if``), which the message called
        # "an .item() compared or branched on" too (review of ce43f97); a step with no
        # ``if`` of its own (``randint(0, min(n.item(), M), ...)``) is told that min() /
        # max() compare too (sixty-fifth session)
        if check.raised.startswith(REFUSED_ITEM):
            opening = (f"The train step uses a tensor's value as a Python number at "
                       f"{check.where} (an .item() compared in Python: an `if` on it, or "
                       "min() / max() of it and a Python number)")
        else:
            opening = (f"The train step branches on a tensor's value at {check.where}, and "
                       "the way this call's value takes reads a tensor's value in Python (a "
                       "value-dependent shape, an .item() or an `if` on a tensor)")
        return SPMDRuntimeError(
            f"{opening}, which a compiled step cannot follow: only the way that keeps "
            "the value out of Python could be compiled, and this call goes the other way. "
            "The cause is the step's code, not this call's data: the compiled way may be "
            "one few calls take (what the capture found: "
            f"{check.raised}). Nothing was updated: the model and optimizer keep the "
            "state of the last completed step."
        )
    return SPMDRuntimeError(
        f"A check on a tensor's value at {check.where} came out "
        f"{not check.expected} on this call: the step raises there ({text}). "
        "Nothing was updated: the model and optimizer keep the state of the last "
        "completed step."
    )


def _item(value: torch.Tensor) -> Any:
    """A returned ``.item()`` (NOTE: [returned .item() values] in ``capture/traced_items.py``)."""
    return (value.full_tensor() if isinstance(value, DTensor) else value).item()


def state_value(bindings: StepBindings, ref: StateRef) -> torch.Tensor:
    """The current value of state ``ref`` (what ``bindings.state_refs()`` pairs with it),
    looked up directly: building every ref each step cost ~0.7 ms on a 65-parameter GPT."""
    if ref.kind is Kind.PARAM:
        return bindings.params[ref.name]
    if ref.kind is Kind.BUFFER:
        return bindings.buffers[ref.name]
    if ref.kind is Kind.GRAD:
        grad = bindings.params[ref.name].grad
        if grad is None:
            raise KeyError(ref)
        return grad
    if ref.kind is Kind.OPTIM_STATE:
        value = bindings.optim_state(ref.optimizer, ref.name)[ref.key]
        if not isinstance(value, torch.Tensor):
            raise KeyError(ref)
        return value  # its param group is part of the program's key (static_key)
    if ref.kind is Kind.SCALER:
        return private.read_grad_scaler_state(bindings.scalers[ref.index], ref.key)
    if ref.kind is Kind.GROUP_STATE:  # NOTE: [tensors held in a param group]
        value = bindings.optimizers[ref.optimizer].param_groups[ref.group].get(ref.key)
        if not isinstance(value, torch.Tensor):
            raise KeyError(ref)
        return value
    raise KeyError(ref)


def current_state_value(bindings: StepBindings, ref: StateRef) -> torch.Tensor:
    """``state_value``, with a parameter looked up in its module now (``bindings`` of an
    earlier call hold the parameters as that call found them) and the optimizers' state
    dicts afresh."""
    bindings.forget_state_dicts()
    if ref.kind is Kind.PARAM:
        for module, names in zip(bindings.modules, bindings.module_params, strict=True):
            for fqn, name in names.items():
                if name == ref.name:
                    return module.get_parameter(fqn)
        raise KeyError(ref)
    return state_value(bindings, ref)


def run_finish(
    program: DistributedProgram,
    lowered: Executable,
    bindings: StepBindings,
    carry: list[torch.Tensor],
    sim: Simulation | None,
    discard: bool = False,
) -> None:
    """Apply the deferred part of the last step (its ``finish`` program) to the state;
    with ``discard``, only run it (its reductions waited for) and write nothing."""
    plan = program.deferred
    finish = lowered.finish
    assert plan is not None and finish is not None, "run_finish needs a deferred part"
    outs = _run(finish, list(carry), sim, deferred=True)
    if discard:
        return
    # an earlier call's bindings: its state dicts are looked up afresh, as the optimizer
    # holds them now (NOTE: [one walk over the state per call])
    bindings.forget_state_dicts()
    _write_back(program, bindings, outs, sim, positions=plan.positions)


def _run(
    lowered: LoweredGraph, flat: list[torch.Tensor], sim: Simulation | None, deferred: bool,
    agreement: InputAgreement | None = None,
) -> list[torch.Tensor]:
    """Call a program on its flat inputs: on every simulated rank, or on this real rank,
    where a failure (usually a collective whose peer died) becomes ``SPMDRuntimeError``.
    On real ranks the input check's round (``agreement``) comes first, with what the
    program sends along and its early part computed while the round is in flight (NOTE:
    [reductions that ride the input check])."""
    if sim is not None:
        try:
            with sim.constants_per_rank(lowered.graph_module), sim.ranks():
                return lowered(flat, simulated=True)
        except (SPMDCompileError, SPMDRuntimeError):
            raise
        except Exception as exc:
            node = failing_node(exc)
            if node is None or in_a_collective(node):
                raise
            raise SPMDRuntimeError(
                f"The compiled step failed at {where(node)}: {exception_summary(exc)}. "
                f"{_state_after_failure(lowered, deferred)}"
            ) from exc
    # NOTE: [a rank whose program fails alone]: an interpreted program on several real
    # ranks exchanges its status before its first write into the state (or at its end)
    status = _Status(agreement) if agreement is not None and lowered.interprets(flat) else None
    try:
        if agreement is None:
            return lowered(flat, simulated=False)
        round_ = agreement.start(*lowered.leading(flat))
        try:
            early = lowered.early(flat)
        except Exception as in_early:
            if status is None or isinstance(in_early, (SPMDCompileError, SPMDRuntimeError)):
                raise
            round_.finish()  # a peer's failure, or a disagreement: that is the call's error
            raise _EarlyFailure(in_early) from in_early
        out = lowered(flat, simulated=False, opened=[*round_.finish(), *early], status=status)
        if status is not None:
            status.finish()
        return out
    except RanksFailed as failed:  # a peer's program failed (NOTE: [a rank whose program fails alone])
        raise SPMDRuntimeError(
            failed_everywhere(failed.failed, dist.get_rank(), _state_after_failure(lowered, deferred))
        ) from None
    except (SPMDCompileError, SPMDRuntimeError):
        raise
    except Exception as caught:
        failure = caught.cause if isinstance(caught, _EarlyFailure) else caught
        rank = dist.get_rank()
        site = failing_site(failure)
        node = site[1] if site is not None else None
        if site is not None and node is not None and not in_a_collective(node):
            past = status is not None and status.sent  # this rank said its program ran
            if status is not None and not past:
                _fail_on_every_rank(failure, caught, site, lowered, status, deferred)  # raises
            if past and status is not None and status.flying is not None:  # sent as ran: the others go on
                try:
                    status.finish()
                except RanksFailed:
                    pass  # another rank failed too: each raises its own
            # NOTE: [where a program failed]: this rank's own failure, recorded at once
            store = default_store()
            if store is not None:
                record_failure(store, rank, f"{describe_exception(failure)} at {where(node)}")
            raise SPMDRuntimeError(
                f"The compiled step failed on rank {rank} at {where(node)}: "
                f"{exception_summary(failure)}. This rank's own computation failed, not a "
                f"collective{_after_status(past)}. "
                f"{_state_after_failure(lowered, deferred)}"
            ) from failure
        # outside the program's nodes: maybe this rank's own (NOTE: [ranks that fail alike])
        own = describe_exception(failure) if site is None else None
        raise collective_failure(
            f"The compiled step failed on rank {rank}: {exception_summary(failure)}. "
            f"{attribution(rank, own=own)} {_state_after_failure(lowered, deferred)}"
        ) from failure


class _Status:
    """This call's status (NOTE: [a rank whose program fails alone]), carried as one more
    element of the program's last all-reduce (``ride``, read by ``check`` after its
    wait), else by a round of its own (``issue``, right after the program's last
    collective); ``finish`` (before the program's first state write, or after the
    program) makes sure it was exchanged. Each raises ``RanksFailed`` when a rank's
    program failed."""

    def __init__(self, agreement: InputAgreement) -> None:
        self.agreement = agreement
        self.flying: StatusRound | None = None
        self.carried = False
        self.done = False
        self.failure = ""

    @property
    def sent(self) -> bool:
        """Whether this rank has sent its status (as a rank whose program ran, unless it
        was sent by ``_fail_on_every_rank``)."""
        return self.flying is not None or self.carried or self.done

    def issue(self, failure: str = "") -> None:
        if not self.sent:
            self.failure = failure
            self.flying = self.agreement.start_status(failure)

    def ride(self, failure: str = "") -> None:
        self.carried = True
        self.failure = failure

    def check(self, summed: torch.Tensor) -> None:
        self.done = True
        if float(summed) > 0:
            self.agreement.raise_failed(self.failure)

    def finish(self) -> None:
        if self.done:
            return
        if self.carried:  # a failed rank past its drain (the peers checked in their program)
            self.done = True
            if self.failure:
                self.agreement.raise_failed(self.failure)
            return
        self.issue()
        flying, self.flying = self.flying, None
        self.done = True
        assert flying is not None
        flying.finish()


class _EarlyFailure(Exception):
    """The part of a program that runs while the input round is in flight failed on this
    rank, after the round finished: every rank runs the rest of the program."""

    def __init__(self, cause: Exception) -> None:
        super().__init__(str(cause))
        self.cause = cause


def _fail_on_every_rank(
    exc: Exception, caught: Exception, site: tuple[torch.fx.GraphModule, torch.fx.Node, dict[str, object]],
    lowered: LoweredGraph, status: _Status, deferred: bool,
) -> None:
    """This rank's program failed at its own computation before the status round: go on
    through its collectives with stand-ins, send the status marked failed, and raise
    the error every rank raises (NOTE: [a rank whose program fails alone]). Where that
    cannot be done, return: the caller raises this rank's error as before."""
    gm, node, computed = site[0], site[1], dict(site[2])
    line = f"{exception_summary(exc)} at {where(node)}"
    if isinstance(caught, _EarlyFailure):  # the program after the round: all of it
        gm, after, computed = lowered.program_after_round(), None, {}
    else:
        after = node
    try:
        drain_collectives(gm, after, computed, status.issue, status.ride, line)
        status.finish()
    except RanksFailed as failed:
        raise SPMDRuntimeError(
            failed_everywhere(failed.failed, dist.get_rank(), _state_after_failure(lowered, deferred))
        ) from exc
    except (SPMDCompileError, SPMDRuntimeError):
        raise
    except Exception:  # noqa: BLE001 - the peers' collectives break when this rank leaves
        return
    raise AssertionError("the status of a failed rank came back as run")  # pragma: no cover


def _after_status(past: bool) -> str:
    """Said of a rank's own failure told the old way: ``past`` its status, which said its
    program ran, the other ranks went on to their update (NOTE: [a rank whose program
    fails alone])."""
    if not past:
        return ""
    return (
        ", after this rank had told the others that its program ran (past its last "
        "collective): the other ranks may have completed this step (unless their data "
        "failed alike), so the ranks may no longer hold the same state; restore every "
        "rank from a checkpoint"
    )


def _state_after_failure(lowered: LoweredGraph, deferred: bool) -> str:
    """What a failed program left of the state (NOTE: [state ownership]): nothing was
    written back, the state is intact, unless the program updates it in place (NOTE:
    [state donation])."""
    pending = (
        " The update the previous call deferred (cross_iteration_overlap) was not "
        "applied either." if deferred else ""
    )
    if lowered.updates_in_place:
        return (
            "The program updates parameters and optimizer state in place and may have "
            "begun to: they may hold part of this step's update; restore them from a "
            f"checkpoint.{pending}"
        )
    return f"The model and optimizer hold the state of the last completed step.{pending}"


def _feed_input(
    arg: torch.Tensor, mesh: DeviceMesh, placements: Placements, local: TensorMeta, sim: Simulation | None
) -> torch.Tensor:
    # Programs are traced on contiguous fake inputs; a strided shard (Shard(1) of the
    # global batch, or a transposed user tensor) must be made contiguous to match.
    if sim is not None:
        placed = sim.shard(arg, mesh, placements)  # NOTE: [plain tensor subclasses simulated]
        with sim.ranks():
            return private.local_tensor_of(placed).contiguous()
    if tuple(arg.shape) != local.shape:
        raise SPMDCompileError(
            f"local input of shape {tuple(arg.shape)} does not match the compiled {local.shape}"
        )
    # detached: an argument that requires grad (one no backward reaches, NOTE: [tensor
    # arguments that require grad]) must not make the program record autograd
    return arg.detach().contiguous()


def _write_back(
    program: DistributedProgram,
    bindings: StepBindings,
    outs: list[torch.Tensor],
    sim: Simulation | None,
    positions: tuple[int, ...] | None = None,
    unchanged: set[int] | frozenset[int] = frozenset(),
) -> list[Any]:
    """Install the program's outputs (or, with ``positions``, those outputs only: the
    ``finish`` program's) as the new state; returns the step's returned tensors. The
    outputs at ``unchanged`` are state tensors the program updated in place, already the
    state's local tensors: left as they are."""
    captured = program.captured
    mesh = program.mesh
    returned: list[Any] = []
    grads_out: set[str] = set()
    if positions is None:
        positions = tuple(range(len(captured.outputs)))
        clear_grads = True
    else:
        clear_grads = False
    padded = bool(program.padded)
    set_local_tensor = private.set_local_tensor
    reshaped = captured.reshaped_state  # NOTE: [state the step gives a new shape]
    for j, value in zip(positions, outs, strict=True):
        if j in unchanged:
            continue
        ref, meta, placements = captured.outputs[j], captured.output_metas[j], program.output_placements[j]
        if padded and program.pads(ref):
            value, meta = _unpad_rows(
                value, meta, program.padded[ref.name], mesh, sim, program.padded_dims.get(ref.name, 0)
            )
        kind = ref.kind
        if kind is Kind.OPTIM_STATE:  # the most outputs: first
            entry = bindings.optim_state(ref.optimizer, ref.name)
            current = entry.get(ref.key)
            if isinstance(current, DTensor) and not (reshaped and j in reshaped and _reshaped(current, meta)):
                set_local_tensor(current, value)
            else:
                entry[ref.key] = _wrap(value, mesh, placements, meta)
        elif kind is Kind.RETURN:
            try:
                returned.append(_returned_value(value, mesh, placements, meta, sim))
            except RanksDisagree as exc:
                raise _ranks_disagree(program, ref, exc) from exc
        elif kind is Kind.PARAM:
            set_local_tensor(bindings.params[ref.name], value)  # type: ignore[arg-type]
        elif kind is Kind.BUFFER:
            buffer = bindings.buffers[ref.name]
            if reshaped and j in reshaped and _reshaped(buffer, meta):
                _replace_buffer(bindings, ref.name, buffer, _wrap(value, mesh, placements, meta))
            else:
                set_local_tensor(buffer, value)  # type: ignore[arg-type]
        elif kind is Kind.GRAD:
            grads_out.add(ref.name)
            param = bindings.params[ref.name]
            if param.grad is None:
                param.grad = _wrap(value, mesh, placements, meta)
            else:
                private.set_local_tensor(cast(DTensor, param.grad), value)
        elif kind is Kind.SCALER:
            try:
                scaler_value = _returned_value(value, mesh, placements, meta, sim)
            except RanksDisagree as exc:
                raise _ranks_disagree(program, ref, exc) from exc
            private.write_grad_scaler_state(bindings.scalers[ref.index], ref.key, scaler_value)
        elif kind is Kind.GROUP_STATE:  # NOTE: [tensors held in a param group]
            try:
                group_value = _returned_value(value, mesh, placements, meta, sim)
            except RanksDisagree as exc:
                raise _ranks_disagree(program, ref, exc) from exc
            group = bindings.optimizers[ref.optimizer].param_groups[ref.group]
            held = group.get(ref.key)
            if (isinstance(held, torch.Tensor) and not isinstance(held, DTensor)
                    and held.shape == group_value.shape and held.dtype == group_value.dtype):
                with torch.no_grad():
                    held.copy_(group_value)  # the group keeps its object, as eager's add_
            else:
                group[ref.key] = group_value.to(held.device) if isinstance(held, torch.Tensor) else group_value
    if clear_grads:
        kept = {ref.name for ref in captured.unchanged if ref.kind is Kind.GRAD}
        for name, p in bindings.params.items():
            if name not in grads_out and name not in kept:
                p.grad = None
    return returned


# NOTE: [state the step gives a new shape]
# A buffer made empty and filled on the first call (torch.ao's PerChannelMinMaxObserver:
# ``min_val = torch.tensor([])``, then ``resize_`` to the channels and ``copy_``; or
# ``self.buf = new``) leaves the step with another shape than it came in with. Write-back
# swapped the buffer DTensor's local tensor only, which kept the DTensor's global shape:
# the buffer still read (0,) (``numel() == 0``), so the program key, which holds each
# buffer's shape, never changed, and every later call ran the first call's program, which
# took the first call's branch (``new = cur``): the running max was overwritten by each
# batch's (0.40 where eager had 3.03 after three calls), losses and weights unchanged.
# Now the buffer and optimizer-state outputs whose global shape or dtype differs from
# their input's (``CapturedStep.reshaped_state``, found once per program; none in a
# steady program, so a call tests one empty set) are written back as a new DTensor of
# the output's shape, dtype and placement, put in every module slot that held the old
# one (the new object also tells ``WalkMemo`` the state changed). The next call's key
# reads the new shape and compiles again; that trace sees the filled buffer and takes
# the other branch. The placement is the mode's for the new shape, the one the next
# program is fed with, so a sharded state whose shape changes needs no refusal. A
# buffer reassigned between calls is a new plain tensor in the module: the key reads
# its shape and it is placed at that call's install, as before.


def _reshaped(state: torch.Tensor, meta: TensorMeta) -> bool:
    """Whether ``state`` (a DTensor) has another global shape or dtype than ``meta``."""
    return tuple(state.shape) != meta.shape or state.dtype != meta.dtype


def _replace_buffer(bindings: StepBindings, name: str, old: torch.Tensor, new: DTensor) -> None:
    """Put ``new`` in every module slot that holds buffer ``old`` (NOTE: [a buffer held by
    several modules]); once per new shape, so walking the modules costs nothing per call."""
    for mod in bindings.modules:
        for sub in mod.modules():
            buffers = sub._buffers
            for attr, value in buffers.items():
                if value is old:
                    buffers[attr] = new
                    intercept_data_assignment(sub, attr, name, new)
    bindings.buffers[name] = new


def _ranks_disagree(program: DistributedProgram, ref: StateRef, exc: RanksDisagree) -> SPMDRuntimeError:
    """The simulated ranks computed different values of output ``ref`` that the program
    returns replicated: a program that is wrong, most often after a pass changed it (a
    collective dropped or moved)."""
    applied = ", ".join(program.passes_applied) or "none"
    return SPMDRuntimeError(
        f"The compiled program computed different values on the simulated ranks for "
        f"{ref}, which it returns replicated ({exc}). The program is wrong: most often "
        f"a pass changed what it computes (one that drops, moves or rewrites a "
        f"collective). Passes applied: {applied}. Compile with verify_numerics=True to "
        "find the pass that changed the values, or disable_passes=... to leave one out. "
        "The model and optimizer may hold part of this step's update."
    )


def _pad_rows(
    local: torch.Tensor, shape: tuple[int, ...], sim: Simulation | None, dim: int = 0
) -> torch.Tensor:
    """This rank's rows (along ``dim``) of an unevenly sharded tensor, zero-padded to ``shape``.

    NOTE: [uneven shards] (parallel_modes/padding.py). Where the local shard is the
    leading rows of the padded result of the previous step, that result is fed as is.
    """
    def pad(t: torch.Tensor) -> torch.Tensor:
        if tuple(t.shape) == tuple(shape):
            return t
        base = t._base
        if (
            base is not None and tuple(base.shape) == tuple(shape)
            and base.data_ptr() == t.data_ptr() and base.is_contiguous()
        ):
            return base
        filler_shape = list(t.shape)
        filler_shape[dim] = shape[dim] - t.shape[dim]
        return torch.cat([t, t.new_zeros(filler_shape)], dim)

    if sim is not None and isinstance(local, private.local_tensor_type()):
        return private.make_local_tensor({r: pad(t) for r, t in private.per_rank_tensors(local).items()})
    return pad(local)


def _unpad_rows(
    value: torch.Tensor, meta: TensorMeta, rows: tuple[int, int], mesh: DeviceMesh,
    sim: Simulation | None, dim: int = 0,
) -> tuple[torch.Tensor, TensorMeta]:
    """Keep each rank's real rows (along ``dim``) of a padded result; returns (local,
    true metadata)."""
    true_rows, padded = rows
    if len(meta.shape) <= dim or meta.shape[dim] != padded:
        return value, meta
    per_rank = padded // mesh.size()
    true_shape = list(meta.shape)
    true_shape[dim] = true_rows
    true_meta = TensorMeta(tuple(true_shape), meta.dtype, meta.device)

    def keep(t: torch.Tensor, coordinate: int) -> torch.Tensor:
        return t.narrow(dim, 0, max(0, min(per_rank, true_rows - coordinate * per_rank)))

    if sim is not None and isinstance(value, private.local_tensor_type()):
        kept = {r: keep(t, r) for r, t in private.per_rank_tensors(value).items()}
        return private.make_local_tensor(kept), true_meta
    coordinate = mesh.get_coordinate()
    assert coordinate is not None, "this rank is not in the mesh"
    return keep(value, coordinate[0]), true_meta


def _wrap(local: torch.Tensor, mesh: DeviceMesh, placements: Placements, meta: TensorMeta) -> DTensor:
    return private.dtensor_of_local(local, mesh, placements, torch.Size(meta.shape), contiguous_stride(meta.shape))


def _returned_value(
    value: torch.Tensor, mesh: DeviceMesh, placements: Placements, meta: TensorMeta, sim: Simulation | None
) -> Any:
    if all(isinstance(p, Replicate) for p in placements):
        return sim.reconcile(value) if sim is not None else value
    return _wrap(value, mesh, placements, meta)

