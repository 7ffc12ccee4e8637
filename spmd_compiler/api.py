"""``spmd_compiler.compile``: the decorator users put on their train step."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import re
import threading
import time
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from spmd_compiler.parallel_modes import DTensorExpandMode, ParallelMode
from spmd_compiler.parallel_modes.batch_dims import int_arguments_hint, split_arguments_hint
from spmd_compiler.parallel_modes.local_indices import global_ids, index_inputs, warn_on_local_ids
from spmd_compiler.passes import PassOptions
from spmd_compiler.passes.registry import pass_names

from . import _torch_private as private
from . import compile_cache, step_key
from .capture.appended_lists import refuse_appended_lists_read
from .capture.bindings import (
    StepBindings,
    WalkMemo,
    argument_paths,
    find_bindings,
    lr_read_in_python,
    retire_replaced_parameters,
    tensor_argument_names,
)
from .capture.code_names import step_function, step_name, step_where
from .capture.constant_bytes import warn_of_large_constants
from .capture.group_writes import module_writes_seen
from .capture.guards import (
    Guards,
    argument_labels,
    build_guards,
    unguard_written_entries,
    unguard_written_numbers,
)
from .capture.held_parameters import refuse_parameters_held_for_lookups
from .capture.hooks_as_found import HooksAsFound
from .capture.initial_state import MadeState, made_from
from .capture.kept_tensors import KeptTensor, KeptTensors, kept_container_ids
from .capture.lr_schedulers import scheduler_state, step_replayed
from .capture.optimizer_advice import attribute_counter_hint
from .capture.trace import CAPTURE_FAILED, capture_step, refuse_anomaly_checks, traces_start_from
from .capture.value_checks import MAX_BRANCH_PROGRAMS, WayRaised, too_many_ways
from .errors import (
    Change,
    SPMDCompileError,
    argument_path,
    innermost_model_frame_of_stack,
    mesh_of_another_size,
    readable_name,
)
from .expand.retrace import DistributedProgram, Placements
from .ir.collectives import collective_stats
from .ir.node_meta import traced_by_autograd
from .ir.signature import CapturedStep, Kind, StateRef, TensorMeta
from .lower import LoweringOptions
from .progress import compile_progress
from .runtime.cross_iteration import split_program
from .runtime.eager_calls import guard_direct_calls
from .runtime.one_thread import one_thread
from .runtime.runner import (
    BranchMismatch,
    StepTimings,
    check_failed,
    check_state_world,
    keep_installs,
    undo_installs,
)
from .runtime.same_inputs import (
    InputAgreement,
    checks_whole_values,
    metadata_advice,
    peer_batches,
    per_sample_path,
    step_label,
    traced_text,
    warn_on_same_shares,
)
from .runtime.simulate import Simulation, active_simulation, mesh_is_live
from .runtime.step_executable import (
    CallResult,
    StepExecutable,
    any_pending_updates,
    flush_pending_updates,
)
from .stack_room import call_with_room

log = logging.getLogger("spmd_compiler")

# A guarded Python value that forced this many recompiles is reported as a warning.
REPEATED_RECOMPILES = 3

# NOTE: [programs kept in memory]: the programs a compiled step keeps, least recently
# used dropped first.
KEPT_PROGRAMS = 32


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The random-number state a program's draws come from (CPU, and the device's)."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _way(executable: StepExecutable) -> tuple[bool, ...]:
    """How a program's `if`s on tensor values go (NOTE: [value checks])."""
    return tuple(c.expected for c in executable.program.captured.checks)


def _set_rng_state(device: torch.device, state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


@dataclass
class CompileRecord:
    """What one compilation produced and how long each stage took."""

    key: tuple
    # None once the step dropped the program (NOTE: [programs kept in memory])
    program: DistributedProgram | None
    capture_seconds: float
    expand_seconds: float
    pass_seconds: float
    total_seconds: float
    # NOTE: [persistent compile cache]: "off", "uncacheable", "miss" (compiled here and
    # written), "hit" (loaded from disk) or "shared" (compiled by another rank); "memory":
    # an earlier program of this step decoded again (NOTE: [programs reused in memory])
    cache: str = "off"
    cache_load_seconds: float = 0.0
    # a hit found by the key before capture: the step was not traced (NOTE: [cache key
    # before capture] in step_key.py)
    capture_skipped: bool = False


def _key_change(old: tuple, new: tuple, n_args: int, names: Callable[[], list[str]] | None = None) -> Change | None:
    """What differs between two calls' program keys (``(input metas, static_key,
    (simulated, world size), grad mode, torch settings, default dtype, autocast)``) in the step's arguments, in the
    words the guards use: "<what> was <old>, now <new>"; None when only the rest differs.
    ``names()``: the step's name for each flattened argument (``argument_paths``), read
    only for a change."""
    old_metas, old_static, new_metas, new_static = old[0], old[1], new[0], new[1]
    if old[2][1] != new[2][1]:
        return Change("the world size", str(old[2][1]), str(new[2][1]))
    if old[3] != new[3]:  # NOTE: [grad mode around the step]
        return Change("the grad mode around the call", *(("no_grad", "enabled")[g] for g in (old[3], new[3])))
    if old[-1] != new[-1]:  # NOTE: [autocast around the step]
        return Change("the autocast regions around the call", str(old[-1]), str(new[-1]), verb="were")
    if old[-2] != new[-2]:
        return Change("torch's default dtype", str(old[-2]), str(new[-2]))
    for k, (was, now) in enumerate(zip(old[4], new[4])):  # NOTE: [torch settings in the program key]
        if was != now:
            return Change(private.CALL_SETTINGS[k], *(private.call_setting_text(k, v) for v in (was, now)))
    if len(old_metas) != len(new_metas):
        return Change("the number of tensor arguments", str(len(old_metas)), str(len(new_metas)))
    for k, (a, b) in enumerate(zip(old_metas, new_metas)):
        if (a.shape, a.dtype, a.device) != (b.shape, b.dtype, b.device):
            was, now = (
                (list(a.shape), list(b.shape)) if a.shape != b.shape
                else (f"{a.dtype} on {a.device}", f"{b.dtype} on {b.device}")
            )
            what = "the shape" if a.shape != b.shape else "the dtype / device"
            return Change(f"{what} of tensor argument {k}", str(was), str(now))
    if old_static[0] != new_static[0]:
        return Change("the structure of the step's arguments", "one", "another")
    for i in range(1, min(n_args + 1, len(old_static), len(new_static))):
        if old_static[i] != new_static[i]:
            paths = names() if names is not None else []
            label = paths[i - 1] if len(paths) == n_args else i - 1
            return Change(f"argument {label} of the step", repr(old_static[i]), repr(new_static[i]))
    # the optimizer settings but the learning rate (a graph input), by name
    if min(len(old_static), len(new_static)) > n_args + 1:
        old_settings = dict(old_static[n_args + 1])
        for name, value in new_static[n_args + 1]:
            if name in old_settings and old_settings[name] != value:
                return Change(name, repr(old_settings[name]), repr(value))
    # a buffer the step gives a new shape (NOTE: [state the step gives a new shape] in
    # runtime/runner.py): named, so one that grows every call is warned about
    old_buffers, new_buffers = _buffer_metas(old_static), _buffer_metas(new_static)
    for name, (shape, dtype) in new_buffers.items():
        before = old_buffers.get(name)
        if before is not None and before[0] != shape:
            return Change(f"the shape of buffer {name}", str(list(before[0])), str(list(shape)))
        if before is not None and before[1] != dtype:
            return Change(f"the dtype of buffer {name}", str(before[1]), str(dtype))
    # optimizer state the last call made (Adam's exp_avg on its first step): the
    # steady-state program. Until the sixty-second session this was not logged, and the
    # compile of call 1 showed no reason
    old_states, new_states = _optimizer_states(old_static), _optimizer_states(new_static)
    for (oi, name), state in new_states.items():
        before = old_states.get((oi, name))
        if before == () and state:
            return Change(f"the state of optimizer[{oi}]", "not made yet",
                          "made (by the last call: this is the steady-state program)", verb="was")
    # the rest: train/eval flags, which parameters hold gradients: expected changes, not
    # logged
    return None


def _optimizer_states(static: tuple) -> dict[tuple[int, str], tuple]:
    """Each parameter's state entries, by (optimizer, parameter name), in a
    ``static_key``'s optimizer part (``StepBindings._optimizer_part``: a ``("group", oi,
    gi)`` marker, then one ``(name, entries)`` per parameter); only read when a call
    compiles again."""
    states: dict[tuple[int, str], tuple] = {}
    optimizer = None
    for part in static:
        if type(part) is tuple and len(part) == 3 and part[0] == "group" and type(part[1]) is int:
            optimizer = part[1]
        elif (optimizer is not None and type(part) is tuple and len(part) == 2
              and type(part[0]) is str and type(part[1]) is tuple):
            states[optimizer, part[0]] = part[1]
    return states


def _buffer_metas(static: tuple) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The buffers' ``(name, shape, dtype)`` entries of a ``static_key`` (only read when a
    call compiles again)."""
    return {
        part[0]: (part[1], part[2]) for part in static
        if type(part) is tuple and len(part) == 3 and type(part[0]) is str
        and type(part[1]) is tuple and isinstance(part[2], torch.dtype)
    }


def _is_float_repr(text: str | None) -> bool:
    """Whether a guard's value text is a Python float's repr (``0.3``, ``1e-05``, ``inf``)."""
    if text is None:
        return False
    try:
        float(text)
    except ValueError:
        return False
    return not text.lstrip("-").isdigit()


def _plain_input_meta(index: int, t: torch.Tensor) -> TensorMeta:
    if isinstance(t, DTensor):
        raise SPMDCompileError(
            f"tensor argument {index} of the train step is a DTensor; pass plain "
            "tensors (each rank's local batch, or the global batch in simulation)."
        )
    # requires_grad in the key: NOTE: [tensor arguments that require grad] in capture/trace.py
    return TensorMeta(tuple(t.shape), t.dtype, t.device, t.requires_grad)


def _split_arguments(
    names: list[str], tensor_args: list[torch.Tensor], placements: list[Placements]
) -> list[tuple[str, torch.Tensor, int]]:
    """``(label, tensor, dimension)`` of each tensor argument the mode splits along one
    dimension of its data: NOTE: [the same share on every rank] (once per step: a CUDA
    argument's checksum waits for the GPU)."""
    out = []
    for k, (name, t, pl) in enumerate(zip(names, tensor_args, placements, strict=True)):
        dims = {p.dim for p in pl if isinstance(p, Shard)}
        if t.shape and len(dims) == 1:
            out.append((f"{name} (input[{k}])", t, dims.pop()))
    return out


_RUNNING = threading.local()  # NOTE: [a compiled step inside another]: the step running


class CompiledTrainStep:
    """A train step compiled on first call (and again for new shapes or settings).

    Call it exactly like the original function. ``records`` lists every compilation;
    ``last_program`` is the per-rank program of the latest call. With the
    ``cross_iteration_overlap`` pass, call ``flush()`` after the last step (or before
    reading or writing the model between steps): it applies the update the last call
    deferred. Any compiled call, checkpointing and ``load_state_dict`` of the model or
    optimizer flush by themselves; another write while an update is pending is refused
    at the next call or flush (NOTE: [writes between calls while an update is pending]).
    """

    def __init__(
        self, func: Callable[..., Any], mode: ParallelMode, options: PassOptions,
        lowering: LoweringOptions | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.func = func
        self.mode = mode
        self.options = options
        self.lowering = lowering or LoweringOptions()
        self._cache_dir = cache_dir  # as given: a step per object gets it too
        # NOTE: [a compiled step written on a method]: the class it was written in
        self._owner: type | None = None
        self._attribute = getattr(func, "__name__", "")
        root = compile_cache.resolve_cache_dir(cache_dir)
        if root is not None and root.exists() and not root.is_dir():
            raise SPMDCompileError(
                f"The compile cache directory {str(root)!r} is an existing file"
                + (f" (from {compile_cache.CACHE_ENV})" if cache_dir is None else "") + ".",
                hint="pass a directory (it is made if missing) as cache_dir, or None for no cache",
            )
        self.disk_cache = compile_cache.ProgramCache(root) if root is not None else None
        self.records: list[CompileRecord] = []
        # NOTE: [programs reused in memory]: program key -> the program built for it
        self._built_programs: dict[str, DistributedProgram | None] = {}
        self._cache: dict[tuple, list[tuple[Guards, StepExecutable]]] = {}
        self._record_of: dict[int, CompileRecord] = {}  # id(program) -> its record, while kept
        self._dropped = 0  # programs dropped (NOTE: [programs kept in memory])
        self._uses = 0  # calls that ran a program, numbering ``StepExecutable.last_used``
        self._meshes: dict[str, DeviceMesh] = {}
        self.timings = StepTimings()
        self._last: StepExecutable | None = None  # what the latest call ran
        self._guard_misses: dict[str, int] = {}  # guarded value -> recompiles its new values caused
        self._guard_values: dict[str, set[str | None]] = {}  # guarded value -> the values it had
        # the change this call recompiles for, counted once it compiled (_count_recompile)
        self._recompiling: tuple[Change, bool] | None = None
        # a float argument's guard -> the op that read it (CapturedStep.floats_read)
        self._floats_read: dict[str, str] = {}
        # the float arguments' guards kept because the program does not read them
        # (CapturedStep.floats_unread)
        self._floats_unread: set[str] = set()
        # a float argument's guard -> what read it in Python (CapturedStep.floats_in_python)
        self._floats_in_python: dict[str, str] = {}
        # an outside tensor's guard -> the line the step read it as a Python value, None
        # where only its ops read it (OutsideTensor.read_at): the recompile warning's advice
        self._outside_tensors: dict[str, Any] = {}
        # the large outside constants warned of (constant_bytes.warn_of_large_constants)
        self._large_constants: set[str] = set()
        self._last_key: tuple | None = None  # the program key of the latest call
        # the cache's entries for ``_last_key`` as its call found them (None: none then)
        self._last_entries: list[tuple[Guards, StepExecutable]] | None = None
        # this call's (NOTE: [a step that changes what it reads]): the program served from
        # the cache with the guards whose writes it makes once it completes; the values
        # the call found, as guards, once a compile in it has traced the step
        self._served: tuple[StepExecutable, Guards] | None = None
        self._found: Guards | None = None
        self._hooks_found: HooksAsFound | None = None  # the compile's (NOTE: [hooks each trace starts from])
        self._walk_memo = WalkMemo()  # NOTE: [one walk over the state per call]
        # the arguments' names per argument structure (NOTE: [inputs by name])
        self._input_names: dict[Any, list[str]] = {}
        self._shares_compared = False  # NOTE: [the same share on every rank]
        self._mesh_checked_in: Simulation | None = None  # NOTE: [state after a simulation]
        # the mesh the state was last found placed for (NOTE: [state placed for another world size])
        self._state_checked_on: DeviceMesh | None = None
        if step_function(func) is None:
            raise SPMDCompileError(
                f"The train step {func!r} runs no Python function: a compiled step traces "
                "the code of a function, a method, a functools.partial of one or an object "
                "whose class defines __call__ in Python.",
                hint="wrap it: @spmd_compiler.compile(...) def train_step(...): return step(...)",
            )
        self._where, self._name = step_where(func), step_name(func)  # for errors and logs
        # a function's name and docstring; a callable object's attributes are its own
        functools.update_wrapper(self, func, updated=("__dict__",) if isinstance(func, types.FunctionType) else ())

    def __set_name__(self, owner: type, name: str) -> None:
        self._owner, self._attribute = owner, name

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        """NOTE: [a compiled step written on a method]: ``obj.step`` is the step of ``obj``."""
        if obj is None or not isinstance(self.func, types.FunctionType):
            return self  # on the class; or a bound method / partial / object: binds nothing
        return self._of(obj)

    def _of(self, obj: Any) -> CompiledTrainStep:
        """The step compiled for ``obj``'s bound method, made on first need and kept on
        ``obj`` (NOTE: [a compiled step written on a method])."""
        held = vars(obj).get(_STEPS_OF_AN_OBJECT) if hasattr(obj, "__dict__") else None
        step = held.get(self) if isinstance(held, _StepsOfAnObject) else None
        if step is not None and step.func.__self__ is obj:
            return step
        if not isinstance(held, _StepsOfAnObject) or any(s.func.__self__ is not obj for s in held.values()):
            held = _StepsOfAnObject()  # none yet, or a shallow copy's: the original's stay its own
            try:
                if isinstance(obj, type):
                    type.__setattr__(obj, _STEPS_OF_AN_OBJECT, held)
                else:
                    object.__setattr__(obj, _STEPS_OF_AN_OBJECT, held)
            except (AttributeError, TypeError) as exc:
                raise SPMDCompileError(
                    f"{self._name} is compiled per object, and kept on it; a "
                    f"{type(obj).__qualname__} object cannot hold it ({exc}): a class with "
                    "__slots__ and no __dict__.",
                    user_line=self._where,
                    hint="add '__dict__' to __slots__, or compile the bound method in "
                    f"__init__: self.{self._attribute} = spmd_compiler.compile(...)"
                    f"(self.{self._attribute}).",
                ) from None
        step = held[self] = CompiledTrainStep(
            types.MethodType(self.func, obj), self.mode, self.options, self.lowering, self._cache_dir,
        )
        return step

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with one_thread(f"{self._name} is called"):  # NOTE: [one thread at a time]
            return self._call_here(args, kwargs)

    def _call_here(self, args: tuple, kwargs: dict) -> Any:
        if self._owner is not None and args and isinstance(args[0], self._owner):
            # ``Trainer.step(trainer, x)``: the call ``trainer.step(x)`` is
            return self._of(args[0])(*args[1:], **kwargs)
        if _called_as_a_method(self.func, args, kwargs):
            # ``sc.compile(...)(Trainer.step)(trainer, x)``: ``trainer.step`` compiled
            return self._of(args[0])(*args[1:], **kwargs)
        if not dist.is_initialized():
            raise self._no_process_group()
        if torch.is_inference_mode_enabled():  # NOTE: [grad mode around the step]
            with torch.inference_mode(False), torch.no_grad():
                return self._call_with(args, kwargs)
        return self._call_with(args, kwargs)

    def _call_with(self, args: tuple, kwargs: dict) -> Any:
        # NOTE: [a compiled step inside another]
        # A compiled step called while another compiled step runs (from its traced code,
        # ``def outer(...): return inner(...)`` with both compiled) would capture on the
        # outer trace's stand-in tensors: it failed deep in a parallel mode ("rows a mask
        # selects") with torch's FakeTensor data-pointer warning. Refused on entry, naming
        # both steps, before it reads anything.
        running = getattr(_RUNNING, "step", None)
        if running is not None:
            raise SPMDCompileError(
                f"The compiled step {self._name} is called inside the compiled step "
                f"{running._name}: a compiled step traces the plain code it runs, and cannot "
                "run inside another's trace.",
                user_line=innermost_model_frame_of_stack() or running._where,
                hint=f"call the plain function there ({self._name}.func(...)), or compile "
                "only the outer step.",
            )
        _RUNNING.step = self
        try:
            return self._call_with_running(args, kwargs)
        finally:
            _RUNNING.step = None

    def _call_with_running(self, args: tuple, kwargs: dict) -> Any:
        sim = active_simulation()
        self._served = self._found = self._hooks_found = None
        bindings = find_bindings(self.func, args, kwargs, self._walk_memo)
        if any_pending_updates():  # NOTE: [another step flushes first]
            flush_pending_updates(keep=self._last, sharing=bindings)
        # NOTE: [calling a placed model directly]: its hook goes on the modules before the
        # guards, which count module hooks, are read (a second model instance gets it
        # here too); a call that fails before placing the state takes it off again
        undo = guard_direct_calls(bindings.modules)
        if not undo:
            return self._call(bindings, sim)
        try:
            return self._call(bindings, sim)
        except BaseException:
            if not any(isinstance(p, DTensor) for m in bindings.modules for p in m.parameters()):
                for take_off in undo:
                    take_off()
            raise

    def _no_process_group(self) -> SPMDCompileError:
        """A call with no process group. Under torchrun (``RANK`` and ``WORLD_SIZE`` set)
        the script forgot to join its ranks: said so, rather than "run under torchrun"
        to a script that does."""
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            return SPMDCompileError(
                f"No process group, though this process is rank {os.environ['RANK']} of "
                f"{os.environ['WORLD_SIZE']} (RANK and WORLD_SIZE are set: torchrun or a "
                "launcher like it): the ranks have not joined their process group.",
                user_line=self._where,
                hint="call `spmd_compiler.init_from_env()` once on every rank before the first "
                "compiled call (after torchrun starts the script), or "
                "`torch.distributed.init_process_group(...)` yourself.",
            )
        return SPMDCompileError(
            "No process group: run under torchrun / spmd_compiler.launch (real ranks) "
            "or inside `with spmd_compiler.simulate(world_size=N):` (simulated ranks).",
            user_line=self._where,
            hint="under torchrun, call `spmd_compiler.init_from_env()` first.",
        )

    def _call(self, bindings: StepBindings, sim: Simulation | None) -> Any:
        ambient = private.ambient_autocast()  # NOTE: [autocast around the step]
        try:
            if not ambient:
                return self._call_in(bindings, sim, ambient)
            with private.autocast_regions(ambient, enabled=False):
                return self._call_in(bindings, sim, ambient)
        except BaseException:  # NOTE: [a failed first call leaves the model as it was]
            undo_installs()
            raise
        finally:  # NOTE: [replaced parameters held outside the step]
            keep_installs()
            retire_replaced_parameters()

    def _call_in(self, bindings: StepBindings, sim: Simulation | None, ambient: tuple) -> Any:
        mesh = self._mesh(bindings, sim)
        if mesh is not self._state_checked_on:  # NOTE: [state placed for another world size]
            check_state_world(bindings, mesh.size(), sim)
            self._state_checked_on = mesh
        tensor_args = [t for _, t in bindings.tensor_args()]
        for t in tensor_args:  # NOTE: [tensor subclasses that override torch]
            if type(t) is not torch.Tensor:
                names = self._tensor_argument_names(bindings)
                _refuse_overriding_subclasses(zip(names, tensor_args), "argument", self.func)
                break
        agreement = None
        if sim is None:
            names = self._tensor_argument_names(bindings)
            placed = [
                self._global_input_meta(k, name, t, mesh) for k, (name, t) in enumerate(zip(names, tensor_args))
            ]
            input_metas = [meta for meta, _ in placed]
            index_of = self.mode.local_index_inputs()
            if index_of:  # NOTE: [indices into the global batch]: this rank's ids moved
                entries = index_inputs(index_of, names, tensor_args, [pl for _, pl in placed], self._where)
                tensor_args = global_ids(entries, tensor_args, mesh)
            if dist.get_world_size() > 1:
                # every call on real ranks, cached program or not: NOTE: [same inputs on
                # all ranks]; with the values of the arguments every rank passes whole
                first = not self._shares_compared
                whole = [all(isinstance(p, Replicate) for p in pl) for _, pl in placed]
                batch_split = not all(whole)
                passed_whole = [
                    (f"{names[k]} (input[{k}])", t)
                    for k, (w, t) in enumerate(zip(whole, tensor_args))
                    if w and checks_whole_values(t, first, batch_split)
                ]
                step = step_label(self._name, self._where)
                if first:  # NOTE: [the same share on every rank]
                    placements = [pl for _, pl in placed]  # NOTE: [tp peers pass one batch slice]
                    warn_on_same_shares(
                        _split_arguments(names, tensor_args, placements),
                        peer_batches(names, tensor_args, placements, mesh), step,
                    )
                    # after the round: one that met another step's round (NOTE: [every rank
                    # in the same step's round]) is made again on the next call
                    self._shares_compared = True
                paths = self._argument_paths(bindings)
                scalars = [(paths[i], a) for i, a in enumerate(bindings.flat_args)
                           if type(a) in (bool, int, float, str)]
                agreement = InputAgreement(tensor_args, passed_whole, scalars, step)
        else:
            input_metas = [_plain_input_meta(k, t) for k, t in enumerate(tensor_args)]
            index_of = self.mode.local_index_inputs()
            if index_of:  # checked as on real ranks; the global batch's ids are global already
                names = self._tensor_argument_names(bindings)
                index_inputs(index_of, names, tensor_args, [
                    self.mode.placement_of(StateRef(Kind.INPUT, name=name, index=k), meta, mesh)
                    for k, (name, meta) in enumerate(zip(names, input_metas))
                ], self._where)
        if agreement is None:
            return self._call_program(bindings, sim, ambient, mesh, tensor_args, input_metas, agreement)
        try:
            return self._call_program(bindings, sim, ambient, mesh, tensor_args, input_metas, agreement)
        except Exception as exc:  # NOTE: [a rank that fails before its program]
            agreement.fail(exc)
            raise

    def _call_program(
        self, bindings: StepBindings, sim: Simulation | None, ambient: tuple, mesh: DeviceMesh,
        tensor_args: list[torch.Tensor], input_metas: list[TensorMeta],
        agreement: InputAgreement | None,
    ) -> Any:
        """The call's program, compiled on first need, run on ``bindings``."""
        # the default dtype: a step's factories (torch.tensor([0.1] * n)) make tensors of it
        # and the world size: a program is sharded for its ranks (NOTE: [state placed for
        # another world size])
        # and the grad mode: a step captured under no_grad holds no backward (NOTE: [grad
        # mode around the step]), and torch's other settings the capture reads (NOTE:
        # [torch settings in the program key])
        key = (
            tuple(input_metas), bindings.static_key(), (sim is not None, mesh.size()), torch.is_grad_enabled(),
            private.call_settings(), torch.get_default_dtype(), ambient,
        )
        self._recompiling = None  # a refused call's, never counted
        executable = self._cached_executable(key, bindings)
        if executable is not None and torch.is_anomaly_enabled():  # NOTE: [anomaly detection at capture]
            graph = executable.program.captured.graph_module.graph
            if any(traced_by_autograd(node) for node in graph.nodes):
                refuse_anomaly_checks(innermost_model_frame_of_stack())
        if executable is None and key not in self._cache and self._last_key is not None:
            change = _key_change(
                self._last_key, key, len(bindings.flat_args),
                lambda: self._argument_paths(bindings),
            )
            if change is not None:
                self._note_recompile(change)
        self._last_key = key
        made = None  # NOTE: [optimizer state made before the first program]
        if executable is None:
            if agreement is not None:
                agreement.before_compile()
            executable, key = self._compile(key, bindings, input_metas, mesh)
            if agreement is not None:  # NOTE: [ids that look numbered from 0 on each rank]
                paths = self._argument_paths(bindings)  # NOTE: [counts passed as Python ints]
                counts = [(paths[i], a) for i, a in enumerate(bindings.flat_args) if type(a) is int]
                warn_on_local_ids(executable.program, tensor_args, self.mode.local_index_inputs(), counts)
            self._count_recompile(bindings)
            self._last_key = key
            made = executable.program.captured.made_state
        if self._last is not None and self._last is not executable:
            self._last.flush()  # another program runs now: finish the old one's update
        self._last = executable
        self._uses += 1  # NOTE: [programs kept in memory]: used now, before a branch compiles
        executable.last_used = self._uses
        # NOTE: [schedulers stepped in the step]
        try:
            call, ran = self._run_branches(executable, key, bindings, tensor_args, input_metas, mesh, sim, agreement)
            ran.last_used = self._uses
        except BaseException:
            if made is not None:  # no program completed: the optimizer is left as the call found it
                undo_installs()  # first: the made entries are in the state dicts it puts back
                made.remove(bindings)
            raise
        if self._served is not None and self._served[0] is ran:  # NOTE: [a step that changes what it reads]
            self._served[1].replay_writes()
        if ran.program.captured.requires_grad_after:  # NOTE: [requires_grad set in the step]
            params = bindings.params
            for name, flag in ran.program.captured.requires_grad_after:
                params[name].requires_grad_(flag)
        # the program completed and its install is kept: a scheduler stepped after the
        # update raising (one at its end, as eagerly) leaves the update, as eager's error does
        step_replayed(ran.program.captured.scheduler_steps, bindings.schedulers, before=False)
        if call.lower_seconds > 0:  # this call lowered a graph (NOTE: [lowering])
            self.timings.compile_seconds += call.lower_seconds
            self.timings.lower_seconds += call.lower_seconds
        else:
            self.timings.step_seconds.append(call.run_seconds)
        return call.value

    def _run_branches(
        self, executable: StepExecutable, key: tuple, bindings: StepBindings,
        tensor_args: list[torch.Tensor], input_metas: list[TensorMeta], mesh: DeviceMesh,
        sim: Simulation | None, agreement: InputAgreement | None,
    ) -> tuple[CallResult, StepExecutable]:
        """Run the step; when an ``if`` on a tensor's value went the other way than the
        program took, nothing was written: run the program of that way, compiled on
        first need, on the same inputs and random-number state (NOTE: [value checks]).
        Returns the call and the program that completed it, whose schedulers stepped
        after the update the caller replays (NOTE: [schedulers stepped in the step]);
        those a program steps before its update are replayed here, and set back when
        it does not complete (a mismatched way, an error)."""
        if not executable.program.captured.checks:  # no `if` on a value: nothing to redo
            return self._run_once(executable, bindings, tensor_args, sim, agreement), executable
        device = next(iter(bindings.params.values())).device
        for _ in range(MAX_BRANCH_PROGRAMS):
            rng = _rng_state(device)
            try:
                call = self._run_once(executable, bindings, tensor_args, sim, agreement)
            except BranchMismatch as mismatch:
                _set_rng_state(device, rng)
                try:
                    branch = self._branch_program(key, bindings, input_metas, mesh, mismatch.decisions)
                except WayRaised as raised:  # NOTE: [checks decided from their bytecode]
                    raise self._learned_check(executable, len(mismatch.decisions) - 1, raised.text) from None
                executable = self._last = branch
                continue
            self._prefer(key, executable)
            executable.completed = True  # NOTE: [programs for the ways of ifs]
            return call, executable
        self._values_as_found()
        raise self._too_many_ways(key, bindings, executable)

    @staticmethod
    def _run_once(
        executable: StepExecutable, bindings: StepBindings, tensor_args: list[torch.Tensor],
        sim: Simulation | None, agreement: InputAgreement | None,
    ) -> CallResult:
        """One program, with the scheduler steps it replays before its update; once it
        completed, the call's state install is kept (NOTE: [a failed first call leaves
        the model as it was])."""
        steps = executable.program.captured.scheduler_steps
        restore = None
        if any(s.before for s in steps):
            restore = scheduler_state(bindings.schedulers, bindings.optimizers)
        try:
            # NOTE: [settings a scheduler changes before the update]
            step_replayed(steps, bindings.schedulers, before=True,
                          settings=bindings.optimizer_settings if restore is not None else None)
            call = executable.run(bindings, tensor_args, sim, agreement)
        except BaseException:
            if restore is not None:  # nothing was updated: the schedule is set back too
                restore()
            raise
        keep_installs()
        return call

    def _too_many_ways(
        self, key: tuple, bindings: StepBindings, executable: StepExecutable
    ) -> SPMDCompileError:
        """The refusal of a call needing a program past ``MAX_BRANCH_PROGRAMS`` for
        ``key`` at the Python values the call found; ``executable``: one of its programs
        (NOTE: [programs for the ways of ifs])."""
        held, other = self._programs_held(key, bindings)
        # the `if`s of the way that reached most of them (a loop that breaks on a value)
        deepest = max([executable, *held], key=lambda e: len(e.program.captured.checks))
        message, hint = too_many_ways(
            self._name, len(held), len({_way(e) for e in held if e.completed}),
            deepest.program.captured.checks, len(other), str(other[0][1]) if other else "",
            sum(len(entries) for k, entries in self._cache.items() if k != key),
        )
        return SPMDCompileError(message + ".", user_line=self._where, hint=hint)

    def _programs_held(
        self, key: tuple, bindings: StepBindings
    ) -> tuple[list[StepExecutable], list[tuple[StepExecutable, Change]]]:
        """The programs of ``key`` whose guards hold for this call, and the others with
        the first guarded value that changed (NOTE: [programs for the ways of ifs])."""
        held: dict[int, StepExecutable] = {}
        other: dict[int, tuple[StepExecutable, Change]] = {}
        entries = self._cache.get(key, [])
        for i, (guards, executable) in enumerate(entries):
            guards, change = guards.for_call(bindings)  # NOTE: [guards follow the call's objects]
            entries[i] = (guards, executable)
            if change is None:
                held[id(executable)] = executable
            else:
                other.setdefault(id(executable), (executable, change))
        return list(held.values()), [o for i, o in other.items() if i not in held]

    def _values_as_found(self) -> None:
        """Put back the Python values and hooks a trace in this call changed, as the call
        found them (NOTE: [hooks each trace starts from])."""
        whole = self._hooks_found is None or not self._hooks_found.user_changed()
        if self._found is not None:  # a compile in this call traced the step
            self._found.unwrite(made=whole)
        if self._hooks_found is not None and whole:
            self._hooks_found.put_back()

    def _branch_program(
        self, key: tuple, bindings: StepBindings, input_metas: list[TensorMeta],
        mesh: DeviceMesh, decisions: tuple[tuple[bool, str], ...],
    ) -> StepExecutable:
        """The program whose first ``if``s go as ``decisions`` (compiled on first need).
        Its guards are read on the values the call found, not on those a trace of this
        call wrote; only the programs of those values count toward
        ``MAX_BRANCH_PROGRAMS`` (NOTE: [programs for the ways of ifs])."""
        self._values_as_found()
        entries = self._cache.get(key, [])
        for i, (guards, executable) in enumerate(entries):
            # the ways alone: a check decided from its bytecode is a branch in the program
            # of its other way (NOTE: [checks decided from their bytecode])
            taken = _way(executable)
            if taken[: len(decisions)] != tuple(way for way, _ in decisions):
                continue
            held, change = guards.for_call(bindings)  # NOTE: [guards follow the call's objects]
            entries[i] = (held, executable)
            if change is None:
                self._served = (executable, held)  # NOTE: [a step that changes what it reads]
                return executable
        if len(self._programs_held(key, bindings)[0]) >= MAX_BRANCH_PROGRAMS:
            raise self._too_many_ways(key, bindings, entries[0][1])
        log.info("compiling %s for an `if` on a tensor value that went the other way",
                 self._name)
        return self._compile(key, bindings, input_metas, mesh, decisions)[0]

    @staticmethod
    def _learned_check(executable: StepExecutable, k: int, text: str) -> BaseException:
        """The step raised ``text`` on the way not taken of check ``k`` of ``executable``,
        decided from its bytecode and traced now (NOTE: [checks decided from their
        bytecode]): the check holds what it raised from now on, so that a later call
        going that way raises without tracing it again; the error of this call."""
        captured = executable.program.captured
        captured.checks[k] = dataclasses.replace(captured.checks[k], raised=text)
        return check_failed(captured.checks[k])

    def _prefer(self, key: tuple, executable: StepExecutable) -> None:
        """Try ``executable`` first next call: the way the data went last time."""
        entries = self._cache.get(key, [])
        for i, (_, e) in enumerate(entries):
            if e is executable and i > 0:
                entries.insert(0, entries.pop(i))
                return

    @property
    def has_pending_update(self) -> bool:
        """Whether the latest call deferred an update that ``flush()`` would apply."""
        return self._last is not None and self._last.has_pending_update

    @property
    def last_program(self) -> DistributedProgram | None:
        """The per-rank program of the latest call."""
        return self._last.program if self._last is not None else None

    def _cached_executable(self, key: tuple, bindings: StepBindings) -> StepExecutable | None:
        """The program for ``key`` whose guards hold (NOTE: [guards on Python values]);
        a changed guarded value is logged."""
        # the latest call's key again (the steady state): its entries without hashing the
        # key (a tuple's hash is not kept; ~300 parts on an 8-layer GPT, 13-28 us), after
        # an equality test whose parts are mostly the very objects (``WalkMemo``)
        entries: list[tuple[Guards, StepExecutable]] | None
        if self._last_entries is not None and key == self._last_key:
            entries = self._last_entries
        else:
            entries = self._last_entries = self._cache.get(key)
        if not entries:
            return None
        change = None
        for i, (guards, executable) in enumerate(entries):
            held, change = guards.for_call(bindings)  # NOTE: [guards follow the call's objects]
            if held is not guards:
                entries[i] = (held, executable)
            if change is None:
                self._served = (executable, held)  # NOTE: [a step that changes what it reads]
                return executable
        if change is not None:  # every entry's guards found one
            self._note_recompile(change)
        return None

    def _note_recompile(self, change: Change) -> None:
        """Log why this call compiles again (``_count_recompile`` counts it once it did)."""
        what, was, now = change.what, change.was, change.now
        # NOTE: [strings that differ per sample]: a string argument that changes (a file
        # name of the batch) is warned about at its second new value, with the advice
        path = argument_path(what)
        strings = (path is not None and all((v or "")[:1] in ("'", '"') for v in (was, now))
                   and per_sample_path(path))
        log.info("recompiling %s: %s%s", self._name, change, " (a string that changes from call to "
                 "call looks like per-sample metadata: pass the step only what it reads)" if strings else "")
        # counted once the call compiled: a refused call (a batch the world size does not
        # divide) compiles nothing; before, it counted toward the warning
        self._recompiling = (change, bool(strings))

    def _count_recompile(self, bindings: StepBindings) -> None:
        """Count the change the call compiled for; warn when one value keeps causing it."""
        if self._recompiling is None:
            return
        (change, strings), self._recompiling = self._recompiling, None
        what, was, now = change.what, change.was, change.now
        # only a value not seen before counts: a flag that alternates (accumulate, then
        # step) compiles a program per value and the optimizer's first step, not per call
        seen = self._guard_values.setdefault(what, {was})
        if now in seen:
            return
        seen.add(now)
        self._guard_misses[what] = self._guard_misses.get(what, 0) + 1
        if self._guard_misses[what] == (2 if strings else REPEATED_RECOMPILES):
            if strings:
                hint = metadata_advice([argument_path(what) or what], "every call")
            elif what == private.CALL_SETTINGS[3]:  # NOTE: [saved-tensor hooks made every call]
                hint = ("a hook made anew every call (a function closing over a fresh object "
                        "or over the loop index, a functools.partial binding one) is a setting "
                        "of the program, as what it holds may change what it computes (each "
                        "program is kept, up to 32); make the hooks once, outside the loop, and enter "
                        "`saved_tensors_hooks(pack, unpack)` with the same functions every step")
            elif what.startswith(("the shape of buffer", "the dtype of buffer")):
                hint = ("make the buffer at its final shape (a buffer that grows every call "
                        "compiles a program per shape)")
            elif what.startswith("the shape"):
                hint = ("give the step batches of one shape (pad them, or drop the last "
                        "partial batch)")
            elif (read := _lr_read_in_python(what, bindings)) is not None:
                hint = read
            elif what.startswith("optimizer["):
                hint = ("only the learning rate (and Adam's / AdamW's first beta, SGD's "
                        "momentum where the step reads it only in optimizer.step()) is a graph "
                        "input; keep the other optimizer settings fixed (a scheduler cycling "
                        "momentum or betas: OneCycleLR / CyclicLR(cycle_momentum=False))")
            elif what.startswith("argument ") and all(v.startswith("('numpy', 'float") for v in (was or "", now or "")):
                # NOTE: [float arguments as graph inputs]: NumPy scalars are guards (their
                # guard's text: capture/guards.py's ``_frozen``)
                hint = ("it is a NumPy scalar, which is a setting of the program (its type may "
                        "steer the step, `isinstance(w, np.floating)`, which a graph input's "
                        "stand-in would not pass, and float32 rounds to its own precision); pass "
                        "`float(value)` (a float the step uses only in tensor ops is a graph input "
                        "and compiles once)")
            elif what in self._floats_unread:  # NOTE: [float arguments the program does not read]
                hint = ("it is a float the program does not read, kept a guard because the step "
                        "may read its value in Python where the capture cannot see it (after a "
                        "type test such as `isinstance(w, float)`, which the graph input's tensor "
                        "stand-in fails); do not pass the step a value it does not use (log it "
                        "outside the step), or use it in tensor ops (`loss * w`), where a float "
                        "argument is a graph input and compiles once")
            elif what in self._floats_read:  # NOTE: [float arguments in Scalar arguments]
                hint = (f"{self._floats_read[what]}, so each value is a setting of the program; "
                        "compute with the float in tensor ops instead (`x * w` as an operand; "
                        "add / sub `alpha=`, addcmul / addcdiv `value=`, lerp's weight and "
                        "their foreach forms take it as a graph input), or keep the value fixed")
            elif what.startswith("argument ") and _is_float_repr(was) and _is_float_repr(now):
                # a float argument is a graph input unless the step reads it in Python
                # (NOTE: [float arguments as graph inputs]): a tensor there is read too
                # NOTE: [float arguments read in Python] in capture/trace.py
                reader = self._floats_in_python.get(what) or "float(), math, min / round, an `if`"
                clipping = reader.startswith("torch's clip_grad_norm_")
                hint = (f"it is a float the step reads in Python ({reader}), so each value is a "
                        "setting of the program, and a tensor there would be read the same "
                        "way (refused); a float the step uses only in tensor ops is a graph "
                        "input and compiles once: "
                        + ("clip by a changing max_norm by hand, "
                           "`norm = torch.nn.utils.get_total_norm(grads)` then "
                           "`torch._foreach_mul_(grads, (max_norm / (norm + 1e-6)).clamp(max=1.0))`"
                           if clipping else
                           "compute with it in tensor ops (`torch.cos(math.pi * torch.tensor(f))`, "
                           "`torch.clamp(...)`, or pass the computed factor as the float)")
                        + ", or keep the value fixed")
            elif what in self._outside_tensors:  # NOTE: [tensors read from outside the arguments]
                hint = _outside_tensor_hint(what, self._outside_tensors[what])
            else:
                hint = ("keep a value that changes every step in a tensor (a buffer or a "
                        "tensor argument), or pass it as a float argument used in tensor ops; "
                        "where a counter only decides an `if` (gradient accumulation: "
                        "`(step + 1) % accum == 0`), pass the decision as a bool argument "
                        "instead (two values, two programs)")
            log.warning(
                "%s changed on %d calls of %s, and each new value compiles a new program; "
                "%s.",
                what, self._guard_misses[what], self._name, hint.rstrip("."),
            )

    def flush(self) -> bool:
        """Apply the update the last call deferred (``cross_iteration_overlap``): after
        it, the model and optimizer hold exactly the state of the last completed step.
        Returns whether there was one; calling it again does nothing."""
        return self._last.flush() if self._last is not None else False

    @property
    def compile_count(self) -> int:
        return len(self.records)

    def explain(self) -> Any:
        """The tables of the latest program (``spmd_compiler.tools.explain.explain``): each
        parameter's placement and per-rank bytes, the collectives of one step, the passes;
        ``print(step.explain().format())``, ``to_dict()`` for JSON. Call the step first."""
        from .tools.explain import explain

        return explain(self)

    def _mesh(self, bindings: StepBindings, sim: Simulation | None) -> DeviceMesh:
        device_type = next(iter(bindings.params.values())).device.type
        world = dist.get_world_size()
        key = f"{device_type}:{world}"
        if sim is not None and sim is not self._mesh_checked_in:
            # NOTE: [state after a simulation]: a mesh of an ended simulation has lost
            # its groups, and the programs name them: make both again
            if key in self._meshes and not mesh_is_live(self._meshes[key]):
                self._forget_programs()
            self._mesh_checked_in = sim
        if key not in self._meshes:
            mesh = self.mode.mesh(device_type)
            if mesh.size() != world:
                raise mesh_of_another_size(type(self.mode).__name__, mesh.size(), world)
            if sim is not None and not mesh_is_live(mesh):
                raise SPMDCompileError(
                    f"{self.mode!r} was given a mesh made in a simulation that has ended: its "
                    "process groups ended with it.",
                    hint="make the mesh inside the `with spmd_compiler.simulate(...)` block "
                    "that runs the step, or leave it to the mode (mesh_shape=...).",
                    user_line=self._where,
                )
            self._meshes[key] = mesh
        return self._meshes[key]

    def _drop_old_programs(self, kept: StepExecutable) -> None:
        """Drop the least recently used programs while more than ``KEPT_PROGRAMS`` are
        kept, never ``kept`` (NOTE: [programs kept in memory])."""
        programs = {id(e): e for entries in self._cache.values() for _, e in entries}
        excess = len(programs) - KEPT_PROGRAMS
        if excess > 0:
            older = sorted((e for e in programs.values() if e is not kept), key=lambda e: e.last_used)
            dropped = older[:excess]
            gone = {id(e) for e in dropped}
            for key in list(self._cache):
                entries = self._cache[key]
                left = [(g, e) for g, e in entries if id(e) not in gone]
                if len(left) < len(entries):
                    entries[:] = left  # the same list: ``_last_entries`` may hold it
                    if not left:
                        del self._cache[key]
                        if entries is self._last_entries:
                            self._last_entries = None
            for executable in dropped:
                if executable is self._last:
                    executable.flush()  # its deferred update first (cross_iteration_overlap)
                    self._last = None
                record = self._record_of.pop(id(executable.program), None)
                if record is not None:
                    record.program = None
            if self._dropped == 0:
                log.warning(
                    "%s has compiled %d programs and keeps the last %d used in memory: the "
                    "least recently used are dropped (compiled again if needed). A step that "
                    "compiles on most calls reads a value that changes every call: see the "
                    "recompile messages above.", self._name, len(self.records), KEPT_PROGRAMS,
                )
            self._dropped += len(dropped)
        # the programs built once per program key, kept for reuse: as many, oldest first
        while len(self._built_programs) > KEPT_PROGRAMS:
            del self._built_programs[next(iter(self._built_programs))]

    def _forget_programs(self) -> None:
        """Drop every program and mesh, so the next call makes and compiles them again."""
        self._cache.clear()
        self._meshes.clear()
        self._last = None
        self._last_key = None
        self._last_entries = None

    def _argument_paths(self, bindings: StepBindings) -> list[str]:
        """Every argument leaf's name (``argument_paths``), per argument structure."""
        paths = self._input_names.get(bindings.args_spec)
        if paths is None:
            paths = self._input_names[bindings.args_spec] = argument_paths(self.func, bindings.args_spec)
        return paths

    def _tensor_argument_names(self, bindings: StepBindings) -> list[str]:
        return tensor_argument_names(self.func, bindings, self._argument_paths(bindings))

    def _global_input_meta(
        self, index: int, name: str, t: torch.Tensor, mesh: DeviceMesh
    ) -> tuple[TensorMeta, Placements]:
        """The global meta of this rank's tensor argument ``t`` on real ranks (its shape
        times the mesh size along each dimension the mode shards it on), and its
        placements."""
        meta = _plain_input_meta(index, t)
        placements = self.mode.placement_of(StateRef(Kind.INPUT, name=name, index=index), meta, mesh)
        shape = list(meta.shape)
        for mesh_dim, p in enumerate(placements):
            if isinstance(p, Shard) and p.dim < len(shape):
                shape[p.dim] *= mesh.size(mesh_dim)
        return TensorMeta(tuple(shape), meta.dtype, meta.device, meta.requires_grad), placements

    def _compile(
        self, key: tuple, bindings: StepBindings, input_metas: list[TensorMeta], mesh: DeviceMesh,
        decisions: tuple[tuple[bool, str], ...] = (),
    ) -> tuple[StepExecutable, tuple]:
        # NOTE: [room on the Python stack]: no frame-stack chunk edge under the compile;
        # NOTE: [code generated once]
        hooks = HooksAsFound(self.func, bindings)  # NOTE: [hooks a refused step registered]
        self._hooks_found = hooks  # every trace starts from them (NOTE: [hooks each trace starts from])
        try:
            with private.lazy_graph_modules():
                return call_with_room(self._compile_here, key, bindings, input_metas, mesh, decisions)
        except BaseException:
            hooks.put_back()
            hooks.put_back_tables()  # NOTE: [state registered in the step]
            raise

    def _compile_here(
        self, key: tuple, bindings: StepBindings, input_metas: list[TensorMeta], mesh: DeviceMesh,
        decisions: tuple[tuple[bool, str], ...],
    ) -> tuple[StepExecutable, tuple]:
        """Compile the step for ``key``; ``decisions``: how its first ``if``s on tensor
        values go (a branch's other program, NOTE: [value checks]; such a program is not
        looked up or written by the key before capture, which names the step, not the
        way). The key's last part is the autocast regions the call is in, which the
        capture enters again (NOTE: [autocast around the step]). Returns the program
        and its key: another one where the capture made the optimizer state (NOTE:
        [optimizer state made before the first program])."""
        start = time.perf_counter()
        device_type = next(iter(bindings.params.values())).device.type
        if self.lowering.cuda_graphs and device_type != "cuda":
            raise SPMDCompileError(
                f"cuda_graphs=True needs the model on CUDA; its parameters are on {device_type}.",
                hint="drop cuda_graphs on CPU, or move the model and batch to CUDA.",
            )
        _refuse_parameter_hooks(bindings, self.func)
        _refuse_overriding_subclasses(bindings.params.items(), "parameter", self.func)
        _refuse_overriding_subclasses(bindings.buffers.items(), "buffer", self.func)
        title = f"{self._name} for {type(self.mode).__name__}"
        with compile_progress(title) as progress:
            self.mode.prepare(bindings)
            pre_key, key_guards = (
                ("", Guards()) if decisions else self._step_key(bindings, input_metas, mesh, key[-1])
            )
            loaded = self._load_uncaptured(pre_key, bindings, input_metas, mesh, key[-1], progress)
            skipped = loaded is not None
            also: list[Guards] = []  # more values the program serves (NOTE: [a step that changes what it reads])
            if loaded is not None:
                program, guards, load_seconds = loaded
                how, capture_seconds = "hit", 0.0
                if program.captured.made_state is not None:  # the key of the state it made
                    key = (key[0], bindings.static_key(), *key[2:])
            else:
                settings = bindings.optimizer_settings()
                with progress.stage("capture"), step_key.record_environment() as environment:
                    with private.autocast_regions(key[-1], enabled=True):
                        try:
                            captured, guards, also = self._capture_guarded(bindings, input_metas, decisions)
                        except SPMDCompileError as exc:
                            hinted = self._split_arguments_hinted(exc, bindings, input_metas, mesh)
                            if hinted is None:
                                raise
                            raise hinted.with_traceback(exc.__traceback__) from exc.__cause__
                for g in (guards, *also):
                    g.add_environment(environment)
                capture_seconds = captured.capture_seconds
                labels = argument_labels(self.func, bindings)
                for i, why in captured.floats_read.items():  # NOTE: [float arguments in Scalar arguments]
                    self._floats_read[labels[i]] = why
                self._floats_unread.update(labels[i] for i in captured.floats_unread)
                self._floats_in_python.update((labels[i], why) for i, why in captured.floats_in_python.items())
                # NOTE: [SGD's momentum as a graph input]: a momentum the step used in
                # Python became a setting; the key and the pre-capture key name it then
                rekeyed = bindings.optimizer_settings() != settings
                if captured.made_state is not None or rekeyed:  # the key of the state it made
                    key = (key[0], bindings.static_key(), *key[2:])
                try:
                    program, how, load_seconds, program_key = self._cached_or_built(
                        captured, mesh, progress
                    )
                except BaseException:
                    if captured.made_state is not None:
                        captured.made_state.remove(bindings)
                    raise
                if pre_key and program_key and not rekeyed and key_guards.first_change(bindings) is None:
                    self._write_step_entries(
                        pre_key, program_key, captured, bindings, input_metas, mesh, key[-1],
                        environment,
                    )
            inductor_dir = self.disk_cache.inductor_dir if self.disk_cache else None
            executable = StepExecutable(
                program, self.mode.placements, self.lowering.for_device(device_type),
                inductor_dir,
            )
            executable.guards = guards  # NOTE: [Python values agree across ranks]
        total = time.perf_counter() - start
        built = how in ("off", "uncacheable", "miss")
        record = CompileRecord(
            key, program, capture_seconds, program.expand_seconds if built else 0.0,
            sum(program.pass_seconds.values()) if built else 0.0, total, how, load_seconds,
            skipped,
        )
        self.records.append(record)
        self._record_of[id(program)] = record
        self._cache.setdefault(key, []).extend((g, executable) for g in (guards, *also) if not g.once)
        executable.last_used = self._uses
        self._drop_old_programs(executable)
        timings = self.timings
        timings.compile_seconds += total
        timings.capture_seconds += record.capture_seconds
        timings.expand_seconds += record.expand_seconds
        timings.pass_seconds += record.pass_seconds
        timings.cache_load_seconds += load_seconds
        log.info(
            "compiled %s with %r in %.2fs (capture %.2fs, expand %.2fs, passes %.2fs, "
            "cache %s, load %.2fs)",
            self._name, self.mode, total, record.capture_seconds,
            record.expand_seconds, record.pass_seconds, how, load_seconds,
        )
        return executable, key

    def _build(self, captured: CapturedStep, mesh: DeviceMesh, progress: Any) -> DistributedProgram:
        """Expand, run the passes, split: the program of ``captured`` (no cache)."""
        if active_simulation() is None and dist.is_initialized() and dist.get_world_size() > 1:
            # where the ranks compare it, before the pipeline rewrites the graph (0.12 s
            # of 27 for the demo GPT of 6 layers): NOTE: [the traced step as captured]
            traced_text(captured)
        with progress.stage("expand"):  # expand() sets the node total and counts
            program = self.mode.partition(captured, mesh)
        program.collectives_before_passes = dict(
            collective_stats(program.graph_module).counts
        )
        with progress.stage("passes"):
            program = self.mode.transform_and_compile(program, self.options)
        with progress.stage("split"):
            program.deferred = split_program(program)
        return program

    def _cached_or_built(
        self, captured: CapturedStep, mesh: DeviceMesh, progress: Any
    ) -> tuple[DistributedProgram, str, float, str]:
        """The program of ``captured``: from the persistent cache, from the rank that
        compiled it, or built here (NOTE: [persistent compile cache]). Returns it, how
        it was obtained (``CompileRecord.cache``), the seconds spent loading and its key
        when the cache holds it ("" otherwise)."""
        cache = self.disk_cache
        if cache is None:
            return self._reused_or_built(captured, mesh, progress)
        sim = active_simulation()
        try:
            key = compile_cache.program_key(
                captured, self.mode, mesh, self.options, self.lowering, sim is not None
            )
        except compile_cache.Uncacheable as exc:
            log.info("%s is not cached: its key would need %s", self._name, exc)
            return self._build(captured, mesh, progress), "uncacheable", 0.0, ""
        except Exception as exc:  # noqa: BLE001 - the cache must never fail a compile
            log.warning("%s is not cached: its key failed (%s: %s)",
                        self._name, type(exc).__name__, exc)
            return self._build(captured, mesh, progress), "uncacheable", 0.0, ""
        start = time.perf_counter()
        with progress.stage("load"):
            program = cache.load(key, captured, mesh)
        if program is not None:
            return program, "hit", time.perf_counter() - start, key
        share = compile_cache.RankShare(key) if sim is None else None
        if share is not None and not share.claim():
            with progress.stage("wait"):
                data = share.receive()
                program = (
                    compile_cache.decode_or_warn(data, key, captured, mesh, "sent by another rank")
                    if data else None
                )
            if program:
                compile_cache.write_or_warn(cache, key, data)
                return program, "shared", time.perf_counter() - start, key
            share = None
        data = b""
        try:
            program = self._build(captured, mesh, progress)
            data = compile_cache.entry_or_none(key, program)
            compile_cache.write_or_warn(cache, key, data)
        finally:
            if share is not None:
                share.publish(data)
        return program, "miss", 0.0, key if data else ""

    # NOTE: [programs kept in memory]
    # A step that compiles on most calls (an int step counter it reads, a sequence length
    # per call) kept every program it compiled, in its cache and its ``records``: 1.7 MB of
    # RSS per call for an 8-16-4 MLP (41 calls, 2 simulated ranks), without bound, where a
    # long run only warned. So a compiled step keeps ``KEPT_PROGRAMS`` programs: each
    # holds the number of the call that last ran it (one attribute set per call), and
    # after a compile the least recently used ones are dropped, under whatever key (a
    # global counter the step reads adds programs under one key, as guards), with one
    # warning; a dropped program's record keeps its figures with ``program`` None, and
    # it compiles again when its value comes back. The
    # programs kept for reuse by program key are as many, oldest dropped. Measured: 100
    # calls of that step grew RSS 1.7 MB per call before, 0.3 after the first 32
    # (437.7 MB against 522.1 at call 100; what remains is the allocator's and the
    # records').
    # NOTE: [programs reused in memory]
    # A recompile often captures a program this step already compiled: an int argument
    # that steers an `if` (a gradient-accumulation counter, `if (i + 1) % accum == 0`)
    # is a guard, so each new value captures again, and most values take the same way
    # through the step. Without a cache directory, a compiled step keeps in memory the
    # programs it built after its first (the first is usually the one that makes the
    # optimizer state) under the persistent cache's key (NOTE: [persistent compile
    # cache]: the captured graph, constants, signature, mode, mesh, options and
    # compiler; 0.04 s for the demo GPT's 4.8 s second compile), and a capture with the
    # same key encodes that program's entry and decodes it for its own signature instead
    # of expanding and running the passes again: the same code path, and so the same
    # program, as a disk-cache hit. A step the key cannot describe builds as before.
    def _reused_or_built(
        self, captured: CapturedStep, mesh: DeviceMesh, progress: Any
    ) -> tuple[DistributedProgram, str, float, str]:
        if not self.records:
            return self._build(captured, mesh, progress), "off", 0.0, ""
        try:
            key = compile_cache.program_key(
                captured, self.mode, mesh, self.options, self.lowering,
                active_simulation() is not None,
            )
        except Exception as exc:  # noqa: BLE001 - Uncacheable, or any failure: build
            log.debug("%s: no key to reuse a program by (%s)", self._name, exc)
            return self._build(captured, mesh, progress), "off", 0.0, ""
        built = self._built_programs.get(key)
        if built is not None:
            start = time.perf_counter()
            with progress.stage("load"):
                data = compile_cache.entry_or_none(key, built)
                program = (
                    compile_cache.decode_or_warn(data, key, captured, mesh, "kept in memory")
                    if data else None
                )
            if program is not None:
                return program, "memory", time.perf_counter() - start, ""
        program = self._build(captured, mesh, progress)
        # a program that failed to encode stays None: not tried (nor warned of) again
        self._built_programs[key] = program if key not in self._built_programs else None
        return program, "off", 0.0, ""

    def _step_key(
        self, bindings: StepBindings, input_metas: list[TensorMeta], mesh: DeviceMesh,
        ambient: tuple = (),
    ) -> tuple[str, Guards]:
        """The key before capture and the guards it holds ("" when the cache is off or
        the key cannot describe the step; NOTE: [cache key before capture]); ``ambient``:
        the autocast regions around the call (NOTE: [autocast around the step])."""
        guards = Guards()
        if self.disk_cache is None:
            return "", guards
        try:
            guards = build_guards(self.func, bindings, step_key.float_positions(bindings.flat_args))
            default_device, flush, attention, hooks = private.call_settings()  # NOTE: [torch settings in the program key]
            if hooks is not None:  # functions: no text names them across processes
                raise compile_cache.Uncacheable("no saved-tensor hooks around the call")
            settings = compile_cache.settings_parts(
                self.mode, mesh, self.options, self.lowering, active_simulation() is not None
            ) + [["autocast", [[device, str(dtype)] for device, dtype in ambient]],
                 ["settings", default_device, flush, list(attention)]]
            return step_key.step_key(self.func, bindings, input_metas, guards, settings), guards
        except compile_cache.Uncacheable as exc:
            log.info("%s has no key before capture: it would need %s", self._name, exc)
        except Exception as exc:  # noqa: BLE001 - the cache must never fail a compile
            log.warning("%s has no key before capture (%s: %s)",
                        self._name, type(exc).__name__, exc)
        return "", guards

    def _load_uncaptured(
        self, pre_key: str, bindings: StepBindings, input_metas: list[TensorMeta],
        mesh: DeviceMesh, ambient: tuple, progress: Any,
    ) -> tuple[DistributedProgram, Guards, float] | None:
        """The program found by the key before capture, its guards and the seconds spent
        loading; None when there is none (NOTE: [cache key before capture]). Where the
        first job made the optimizer state before its program, the state is made again
        and the program found by the key the call has with it (NOTE: [optimizer state
        made on a restart]); it is taken out again if no program is found."""
        if not pre_key or self.disk_cache is None:
            return None
        start = time.perf_counter()
        made = None
        with progress.stage("load"):
            recipe = step_key.load_state_recipe(self.disk_cache, pre_key, bindings)
            if recipe is not None:
                made = self._made_from(recipe, bindings)
            if made is not None:
                made.install(bindings)
                pre_key, _ = self._step_key(bindings, input_metas, mesh, ambient)
            found = self._program_by_step_key(pre_key, bindings, mesh)
        if found is None:
            if made is not None:
                made.remove(bindings)
            return None
        program, graph_args = found
        program.captured.made_state = made
        return program, step_guards(self.func, bindings, graph_args), time.perf_counter() - start

    def _made_from(self, recipe: list[list[Any]], bindings: StepBindings) -> MadeState | None:
        named = {oi for _, oi, *_ in recipe if oi < len(bindings.optimizers)}
        if any(bindings.optimizers[oi].state for oi in named):
            return None  # the entry makes state its optimizers do not hold yet
        try:
            return made_from(recipe, bindings)
        except Exception as exc:  # noqa: BLE001 - a broken entry is ignored, never used
            log.warning("%s: ignoring a state entry (%s: %s)", self._name, type(exc).__name__, exc)
            return None

    def _program_by_step_key(
        self, pre_key: str, bindings: StepBindings, mesh: DeviceMesh
    ) -> tuple[DistributedProgram, frozenset[int]] | None:
        assert self.disk_cache is not None
        found = step_key.load(self.disk_cache, pre_key, self.func, bindings) if pre_key else None
        if found is None:
            return None
        program_key, captured, graph_args = found
        program = self.disk_cache.load(program_key, captured, mesh)
        return None if program is None else (program, graph_args)

    def _write_step_entries(
        self, pre_key: str, program_key: str, captured: CapturedStep, bindings: StepBindings,
        input_metas: list[TensorMeta], mesh: DeviceMesh, ambient: tuple,
        environment: dict[str, str | None],
    ) -> None:
        """The step entry of ``pre_key``; where the capture made the optimizer state, the
        step entry of the key the call has with that state and a state entry under
        ``pre_key`` (NOTE: [optimizer state made on a restart])."""
        assert self.disk_cache is not None
        try:
            made = captured.made_state
            if made is not None:
                recipe = made.recipe(bindings)
                pre_key, state_key = self._step_key(bindings, input_metas, mesh, ambient)[0], pre_key
                if not pre_key:
                    return
            data = step_key.entry_bytes(pre_key, program_key, captured, bindings, environment)
            self.disk_cache.write_step(pre_key, data)
            if made is not None:
                self.disk_cache.write_state(
                    state_key, step_key.state_entry_bytes(state_key, recipe, captured, bindings, environment)
                )
        except (compile_cache.Uncacheable, ValueError) as exc:
            log.info("%s has no step entry: it would need %s", self._name, exc)
        except Exception as exc:  # noqa: BLE001 - a compiled program must not fail on it
            log.warning("%s: the step entry could not be written (%s: %s)",
                        self._name, type(exc).__name__, exc)

    def _split_arguments_hinted(
        self, exc: SPMDCompileError, bindings: StepBindings, input_metas: list[TensorMeta],
        mesh: DeviceMesh,
    ) -> SPMDCompileError | None:
        """``exc`` with the hint of NOTE: [capture failures of split arguments] in
        ``parallel_modes/batch_dims.py``: a capture failure with no hint of its own, on
        real ranks, that quotes the captured size of a split dimension; None otherwise."""
        if exc.hint is not None or not exc.message.startswith(CAPTURE_FAILED) or active_simulation() is not None:
            return None
        splits = []
        names = self._tensor_argument_names(bindings)
        for k, (name, meta) in enumerate(zip(names, input_metas, strict=True)):
            placements = self.mode.placement_of(StateRef(Kind.INPUT, name=name, index=k), meta, mesh)
            dims = [p.dim for m, p in enumerate(placements) if isinstance(p, Shard) and mesh.size(m) > 1]
            local = private.even_local_shape(meta.shape, mesh, placements) if dims else None
            if local is not None:  # the captured shapes are each rank's share times the ranks
                splits.append((name, local, tuple(meta.shape), dims[0]))
        hint = split_arguments_hint(splits, exc.message, _module_state(bindings))
        if hint is None:
            return None
        paths = self._argument_paths(bindings)  # NOTE: [counts passed as Python ints]
        ints = [(paths[i], a) for i, a in enumerate(bindings.flat_args) if type(a) is int]
        counted = int_arguments_hint(splits, ints, exc.message)
        return exc.with_hint(hint if counted is None else f"{hint} {counted}")

    def _capture_guarded(
        self, bindings: StepBindings, input_metas: list[TensorMeta],
        decisions: tuple[tuple[bool, str], ...] = (),
    ) -> tuple[CapturedStep, Guards, list[Guards]]:
        """Capture the step and guard the Python values it read, as the call found them;
        a step whose trace changes a guarded value is traced once more, on the changed
        values, to refuse a value changed on every run; where that trace is the same
        program, the guards of the changed values too (NOTE: [a step that changes what
        it reads])."""
        # NOTE: [optimizer state made before the first program]; with the persistent
        # cache a restart makes it again (NOTE: [optimizer state made on a restart])
        before = build_guards(self.func, bindings, frozenset())
        refuse_parameters_held_for_lookups(before, bindings)  # NOTE: [parameters held for lookups]
        if self._found is None:
            self._found = before
        # every trace of a capture (a value check's ways, a float argument's retry) starts
        # from the values the call found, not from what an earlier trace of it left
        try:
            with traces_start_from(before, self._hooks_found):
                captured = capture_step(
                    self.func, bindings, input_metas, self.mode.capture_options(), decisions,
                    make_state=not decisions,
                )
        except BaseException:
            before.put_back()  # a refused capture leaves the Python values it wrote as found
            raise
        change = before.first_change(bindings)
        if change is not None:
            after = build_guards(self.func, bindings, frozenset())
            try:
                with (
                    traces_start_from(after),  # its own ways: the changed values may skip the `if`s
                    # NOTE: [the probe starts from the buffers left], NOTE: [the probe
                    # starts from the tensors kept]
                    _probe_starts_as_left(captured, bindings),
                    # NOTE: [lines of param-group writes]
                    module_writes_seen(change, bindings.optimizers) as writes,
                ):
                    probe = capture_step(
                        self.func, bindings, input_metas, self.mode.capture_options(), (),
                        make_state=False,
                    )
                again = after.first_change(bindings)
                if again is not None and again.registered:
                    raise SPMDCompileError(
                        "The train step registers a hook every time it runs: "
                        f"{again} (a capture runs the step more than once). A compiled "
                        "step runs no Python, so it cannot register one more on each call "
                        "(NOTE: [hooks a refused step registered]: the hooks the refused "
                        "call registered are removed).",
                        user_line=self._where,
                        hint="register the hook once, before the first call, outside the "
                        "compiled step; a hook registered or removed between calls "
                        "recompiles the step.",
                    )
                if again is not None and (way := _way_that_wrote(captured, probe)) is not None:
                    raise _written_by_the_way_of_an_if(change, again, way, self._where)
                if again is not None:
                    raise SPMDCompileError(
                        f"The train step changes a Python value every time it runs: {_changed_twice(change, again)}. "
                        "A compiled step runs no Python, so it cannot repeat that change.",
                        user_line=writes[-1] if writes and writes[-1] and again.what == change.what
                        else self._where,
                        hint=_counter_hint(change, bindings),
                    )
            except BaseException:
                before.put_back()  # the refused call leaves the values as it found them
                if captured.made_state is not None:
                    captured.made_state.remove(bindings)
                raise
        graph_args = frozenset(
            ref.index for ref in captured.input_refs()
            if ref.kind is Kind.HYPERPARAM and ref.optimizer < 0
        )
        try:
            guards = step_guards(self.func, bindings, graph_args, captured)
            also = []
            if change is not None:  # NOTE: [a step that changes what it reads]
                if compile_cache.same_program(captured, probe):
                    also.append(step_guards(self.func, bindings, graph_args, captured))
                if not guards.as_found(before):
                    guards.once = True  # a write no call can repeat: this call's program only
        except BaseException:
            if captured.made_state is not None:
                captured.made_state.remove(bindings)
            raise
        _warn_of_constants_in_arguments(captured.outside)
        for outside in captured.outside:
            self._outside_tensors[outside.label] = outside.read_at
        first_places = {id(o.tensor): (o.label, o.tensor) for o in reversed(captured.outside)}
        warn_of_large_constants(list(first_places.values()), self._large_constants)
        return captured, guards, also


def _stand_in(meta: TensorMeta) -> torch.Tensor:
    """A tensor of ``meta``'s shape and dtype that holds no memory (a 0-dim tensor
    expanded): the probe reads metadata only."""
    return torch.empty((), dtype=meta.dtype, device=meta.device).expand(meta.shape)


@contextlib.contextmanager
def _probe_starts_as_left(captured: CapturedStep, bindings: StepBindings) -> Iterator[None]:
    """The places the first trace left that the probe of NOTE: [a step that changes what
    it reads] starts from, each a stand-in of what the first trace left there (a
    reshaped buffer, a kept tensor), put back after, in reverse order."""
    undo: list[Callable[[], None]] = []
    try:
        _buffers_as_left(captured, bindings, undo)
        _kept_as_left(captured, bindings, undo)
        yield
    finally:
        for put_back in reversed(undo):
            put_back()


def _buffers_as_left(captured: CapturedStep, bindings: StepBindings, undo: list[Callable[[], None]]) -> None:
    """NOTE: [the probe starts from the buffers left]
    The trace that tells a counter from a set-up (NOTE: [a step that changes what it
    reads]) starts from the Python values the first trace left, and from the buffers it
    left: each buffer the first trace gave a new shape or dtype (``self.cos = <longer
    table>`` of a rotary cache grown in forward, ``CapturedStep.reshaped_state``) is, in
    ``bindings.buffers`` while the probe traces, a stand-in of its new shape and dtype (a
    0-dim tensor expanded: no memory; the trace reads metadata only), put back after.
    Before the sixty-fifth session the probe read the buffer as the call found it: a
    cache grown under ``if self.cos.shape[0] < T:`` beside a counter of its rebuilds
    (``self.rebuilds += 1``) took the rebuild again in the probe (``rebuilds`` 1 -> 2)
    and was refused on its first call as a step that "changes a Python value every time
    it runs", which eager does only when the sequence grows. A counter bumped on every
    call is still refused: it changes in the probe whatever the buffers hold. The
    optimizers' state is the call's as found (the probe makes none)."""
    found = bindings.buffers
    for j in captured.reshaped_state:
        ref, meta = captured.outputs[j], captured.output_metas[j]
        if ref.kind is Kind.BUFFER and ref.name in found:
            undo.append(functools.partial(found.__setitem__, ref.name, found[ref.name]))
            found[ref.name] = _stand_in(meta)


_ABSENT = object()


_MODULE_TABLES = ("_buffers", "_parameters", "_modules")
_IN_MODULE_TABLES = frozenset(("attr", table) for table in _MODULE_TABLES)


def _kept_as_left(captured: CapturedStep, bindings: StepBindings, undo: list[Callable[[], None]]) -> None:
    """NOTE: [the probe starts from the tensors kept]
    The probe of NOTE: [a step that changes what it reads] starts from the Python values
    the first trace left; it starts too from the tensors that trace keeps (NOTE: [tensors
    the step keeps]) as the program leaves them after the call: each attribute or dict
    entry set to a tensor is, while the probe traces, a stand-in of the kept tensor's
    shape and dtype (a 0-dim tensor expanded), and the place is put back after. Before
    the sixty-fifth session the probe read the place as the call found it, while the
    Python values beside it were the trace's: open_clip's ``ClipLoss`` label cache
    (``self.labels[device] = arange(n)`` beside ``self.prev_num_logits = n``) found its
    count at the last batch's 6 with the 8 labels of the calls before, and the call of a
    smaller last batch was refused ("Expected input batch_size (6) to match target
    batch_size (8)") where eager computes 3.9289605445. Appends and kept numbers
    (``.item()``) are left as found: nothing reads an appended list back (NOTE: [lists
    the step appends to and reads]), and a number is a guarded Python value."""
    out_index = {ref.index: j for j, ref in enumerate(captured.outputs) if ref.kind is Kind.RETURN}
    for k in captured.kept:
        j = out_index.get(k.index)
        # a part of a tuple / dict the step builds (``self.last = (loss.item(), t)``)
        # is stored with its container's other parts, some of them numbers: left as
        # found, as a number is (a review: storing the tensor part alone raised
        # AttributeError, "no attribute 'last'")
        if k.how == "append" or k.as_item or k.as_int or j is None or k.part is not None:
            continue
        try:
            target = k.container(bindings)
        except (AttributeError, KeyError, IndexError, TypeError):
            continue
        if (k.how == "attr" and isinstance(target, torch.nn.Module)
                and any(k.key in getattr(target, table, {}) for table in _MODULE_TABLES)) or (
                k.path and tuple(k.path[-1]) in _IN_MODULE_TABLES):
            # a registered buffer set by the step (``self.labels = arange(n)`` on a
            # ``register_buffer("labels", None)``) is read as module state, not as a
            # kept tensor: a stand-in there would be refused as an outside module's
            # buffer (a review), and vars() does not hold it to put back
            continue
        if k.how == "attr":
            old = vars(target).get(k.key, _ABSENT) if hasattr(target, "__dict__") else getattr(target, k.key, _ABSENT)
        else:
            old = target.get(k.key, _ABSENT) if isinstance(target, dict) else target[k.key]
        undo.append(functools.partial(_put_back, target, k.how, k.key, old))
        k.store(bindings, _stand_in(captured.output_metas[j]))


def _put_back(target: Any, how: str, key: Any, old: Any) -> None:
    """Set ``target``'s attribute or entry ``key`` back to ``old`` (absent: removed)."""
    if how == "attr":
        if old is _ABSENT:
            delattr(target, key)
        else:
            setattr(target, key, old)
    elif old is _ABSENT:
        del target[key]
    else:
        target[key] = old


# NOTE: [a compiled step written on a method]
# ``@spmd_compiler.compile(...)`` written on a method in a class body compiles the step of
# each object apart, as ``self.step = spmd_compiler.compile(...)(self.step)`` in
# ``__init__`` does: the compiled step is a descriptor, and ``trainer.step`` is a
# ``CompiledTrainStep`` of the bound method ``trainer``'s (its programs, guards, records,
# ``compile_count``, ``last_program``, ``flush()``, what ``explain`` reads), made on its
# first access and kept on the object, so ``trainer.step is trainer.step``;
# ``Trainer.step(trainer, x)`` calls it too, and ``Trainer.step`` is the decorator's
# object, which compiles nothing itself. Two trainers over two models share no program
# or guard. The steps are kept in a ``_StepsOfAnObject`` under one attribute: a copy of
# the object (``copy.deepcopy``, pickling) gets none, so it compiles its own on its first
# call, and a shallow copy that shares the original's gets its own on first access (the
# original's, bound to the original, would train the original's model). Before, the
# compiled step was no descriptor: ``trainer.step(x, y)`` called the plain function
# without ``self`` and was refused ("The train step trains no nn.Module").
# The function itself compiled, ``sc.compile(...)(Trainer.step)`` called as
# ``cstep(trainer, x)`` with the model and optimizer on the object, was refused the same
# way until the sixty-seventh session; it is now the step of ``trainer`` too
# (``_called_as_a_method``: the function is the method of that name on the first
# argument's class, which is no nn.Module, and no other argument is one), so that
# ``cstep.compile_count`` stays 0 and the object's step keeps the records. A step that
# is given its model as an argument keeps compiling as the function it is.
_STEPS_OF_AN_OBJECT = "_spmd_compiled_steps"


def _called_as_a_method(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether a compiled plain function is called as the method it is with its object
    first, holding the model (NOTE: [a compiled step written on a method])."""
    if not isinstance(func, types.FunctionType) or not args or isinstance(args[0], type):
        return False
    if any(isinstance(a, torch.nn.Module) for a in (*args, *kwargs.values())):
        return False
    return any(vars(cls).get(func.__name__) is func for cls in type(args[0]).__mro__)


class _StepsOfAnObject(dict):  # type: ignore[type-arg]
    """The compiled steps of one object, by the class's compiled step; copied empty."""

    def __deepcopy__(self, memo: dict[int, Any]) -> _StepsOfAnObject:
        return _StepsOfAnObject()

    def __reduce__(self) -> tuple[Any, ...]:
        return (_StepsOfAnObject, ())


def step_guards(
    func: Callable[..., Any], bindings: StepBindings, graph_args: frozenset[int],
    captured: CapturedStep | None = None, again: bool = False,
) -> Guards:
    """The guards of a program compiled from ``func`` (``captured``: the capture that
    made it, whose kept containers and stepped schedulers are not guarded and whose
    outside tensors are), able to derive themselves on another call's objects (NOTE:
    [guards follow the call's objects]); ``again``: derived on such a call, whose
    outside tensors are found afresh where the capture found its own."""
    skipped: frozenset[int] = frozenset()
    if captured is not None:
        # NOTE: [tensors the step keeps]; NOTE: [schedulers stepped in the step]: their
        # containers and state change every call by design
        skipped = kept_container_ids(captured.kept, bindings) | {
            id(bindings.schedulers[s.index]) for s in captured.scheduler_steps
        }
    guards = build_guards(func, bindings, graph_args, skipped)
    refuse_appended_lists_read(guards)  # NOTE: [lists the step appends to and reads]
    if captured is not None:  # NOTE: [kept numbers only written]
        dropped = unguard_written_numbers(guards, _kept_number_places(captured.kept, bindings))
        dropped += unguard_written_entries(guards, _kept_number_places(captured.kept, bindings, "key"))
        if dropped:
            log.debug("guards: not guarding %s (a number the step only stores)", ", ".join(dropped))
    if captured is not None and captured.outside:  # NOTE: [tensors read from outside the arguments]
        found = {
            f.label: f for places in KeptTensors(func, bindings, bindings.call).outside.values() for f in places
        } if again else {}
        for outside in captured.outside:
            place = found.get(outside.label)
            if not again:
                guards.add_tensor(outside.container, outside.key, outside.tensor, outside.version, outside.label,
                                  outside.captured)
            elif place is None:  # the call's objects hold no tensor there: a change
                guards.add_absent_tensor(outside.label)
            elif place.tensor is outside.tensor:  # compared with the bytes the program holds
                guards.add_tensor(place.container, place.key, place.tensor, outside.version, outside.label,
                                  outside.captured)
            else:  # another tensor there differs from the program's constant (its id)
                guards.add_tensor(place.container, place.key, place.tensor, place.tensor._version, outside.label)
    guards.rebuild = functools.partial(step_guards, func, graph_args=graph_args, captured=captured, again=True)
    return guards


def _kept_number_places(kept: list[KeptTensor], bindings: StepBindings, how: str = "attr") -> list[tuple[Any, Any]]:
    """(object, attribute) of each Python number the step keeps as an attribute, or
    with ``how="key"`` (dict, key) of each kept as a dict entry (NOTE: [kept numbers only
    written]); one whose object this call's do not hold is left out (it stays guarded)."""
    places = []
    for k in kept:
        if not k.as_item or k.how != how or k.part is not None or not isinstance(k.key, (str, int)):
            continue
        if how == "attr" and not isinstance(k.key, str):
            continue
        try:
            places.append((k.container(bindings), k.key))
        except (AttributeError, KeyError, IndexError, TypeError):
            continue
    return places


# NOTE: [hooks on parameters]
# A hook registered on a parameter tensor (``p.register_hook(fn)``,
# ``register_post_accumulate_grad_hook``) is refused. Its parameter is replaced by a
# DTensor when the state is installed, which does not carry the hook, so a program
# compiled after the first call lacked it; one registered after the compile was never
# run. Both were silent (measured: a gradient scaled by 10 in a hook trained as if
# unscaled from the second step). The program key holds whether each parameter has a
# hook, so one registered later recompiles, and the compile refuses it. Module hooks
# (``register_forward_hook`` and the rest) stay on their modules and are traced; one
# registered or removed later is a change the guards see (NOTE: [guards on Python
# values]). A hook the step itself registers on a parameter and removes before it ends
# is traced like any tensor hook; one it leaves registered (registered on the first call
# only, behind a flag, or every call without ``remove()``) keeps running in eager on
# later steps, and piles up, while the program holds the hooks of its own capture: the
# capture refuses it (``trace._refuse_hooks_left_on_parameters``; before the fifty-fifth
# session a hook registered once behind a flag scaled the first step's gradient only:
# weights 9.1e-2 off eager after 3 steps, silently).
def _refuse_parameter_hooks(bindings: StepBindings, func: Callable[..., Any]) -> None:
    for name, p in bindings.params.items():
        if private.has_tensor_hooks(p):
            raise SPMDCompileError(
                f"parameter {name} has a hook registered on it (Tensor.register_hook or "
                "register_post_accumulate_grad_hook); a compiled step does not run hooks "
                "on parameters (NOTE: [hooks on parameters]).",
                user_line=step_where(func),
                hint="remove the hook and change the gradient in the step instead, between "
                "loss.backward() and optimizer.step() (p.grad.clamp_(-1, 1)); an optimizer "
                "stepped from register_post_accumulate_grad_hook (optimizer in backward): "
                "call optimizer.step() and zero_grad() in the step after loss.backward().",
            )


# NOTE: [tensor subclasses that override torch]
# A parameter, buffer or tensor argument of a torch.Tensor subclass of the user's that
# defines ``__torch_function__`` or ``__torch_dispatch__`` is refused, on every call for
# the arguments (a loop over their types: a program compiled for plain tensors serves a
# later call of the same shapes) and at capture for the state, before anything of the
# model changes. The capture traces plain stand-ins of every tensor, so the override
# never runs in the program: it computed as a plain tensor, silently (2026-12-06: a
# weight ``as_subclass(Scaled)`` whose ``__torch_function__`` doubles ``F.linear``, eager
# losses [1.19936, 1.83566, 1.67294], compiled [1.27552, 1.50781, 1.46070], the plain
# model's; parameters 7.0e-2 off on 2 gloo ranks; the same for a batch of it). A
# pass-through ``__torch_function__`` cannot be told from one that changes results and
# is refused alike (a batch of it crashed simulated ranks in LocalTensorMode); a
# ``__torch_dispatch__`` wrapper subclass compiled and then failed reading its storage
# ("invalid python storage" from state donation; on gloo "No other rank recorded a
# failure"). torch's user-level subclasses count as the user's (a ``torch.masked``
# MaskedTensor batch failed after its compile with "invalid python storage"). Kept:
# torch's own machinery (nn.Parameter, DTensor, the trace's fake and functional tensors,
# LocalTensor), a subclass that overrides nothing (``class Tagged(torch.Tensor): pass``,
# which computes as eager: tests/sim/test_tensor_subclass_state.py, NOTE: [plain tensor
# subclasses simulated]) and one that sets torch's disabled implementations
# (``private.tensor_overrides``). Not looked at: tensors in optimizer state, tensors the
# step reads from outside its arguments (program constants), a DTensor's local tensor.
def _refuse_overriding_subclasses(
    tensors: Iterable[tuple[str, Any]], kind: str, func: Callable[..., Any]
) -> None:
    for name, t in tensors:
        if type(t) is torch.Tensor:
            continue
        hooks = private.tensor_overrides(type(t))
        if not hooks:
            continue
        cls = type(t).__qualname__
        where = f"argument {name} of the step" if kind == "argument" else f"{kind} {name}"
        plain = (
            f"module.{name.rsplit('.', 1)[-1]} = nn.Parameter(p.detach().as_subclass(torch.Tensor))"
            if kind == "parameter" else "t.as_subclass(torch.Tensor)"
        )
        raise SPMDCompileError(
            f"{readable_name(where)} is a {cls}, a torch.Tensor subclass that defines "
            f"{' and '.join(hooks)}; its override would not run in the compiled step: the "
            f"program is traced on plain tensors and computes it as a plain torch.Tensor, "
            f"where eager runs {cls}.{hooks[0]} (one that only passes each op on is refused "
            "too: it cannot be told from one that changes results; NOTE: [tensor subclasses "
            "that override torch]).",
            user_line=step_where(func),
            hint=f"pass a plain tensor ({plain}; a wrapper subclass: the tensor it wraps) "
            "and do what the override does in the model's code: in an nn.Module's forward, "
            "or in a custom op (torch.library.custom_op).",
        )


# NOTE: [grad mode around the step]
# A step called under ``torch.no_grad()`` is captured under it, as eagerly: a loss that
# does not require grad (``if loss.requires_grad: loss.backward(); opt.step()``, one step
# for training and evaluation) takes no backward and no update, and a step that calls
# ``backward`` fails as eager's does. The grad mode is part of the program key, so a call
# in the other mode compiles its own program and both stay cached. Before, the key
# ignored it: the program captured by the first call served every later one, so an
# evaluation call first left the model untrained (weight 0.375 relative off after three
# training calls, simulated and real ranks) and a training call first trained on the
# evaluation batches (0.227 off). ``torch.inference_mode`` is left for ``no_grad`` around
# the whole call (capture, state placement, the program, a pending update's flush): the
# tensors the runtime makes (placed parameters, optimizer state) would be inference
# tensors, which a later training call cannot update in place (a first call under it
# failed the next training call under fully_shard). Its program is the no_grad one, and
# its outputs are plain tensors that do not require grad (eager's are inference tensors).
# (The key before capture, ``step_key.py``, holds ``torch.is_grad_enabled()`` too.)


# NOTE: [autocast around the step]
# A step called inside ``with torch.autocast(...)`` is captured inside it, so the program
# holds the casts autocast made (as for autocast inside the step: tests/sim/
# test_autocast.py), and is run, expanded and lowered outside it: autocast applied again
# to a program's ops would cast what the program keeps in float32 (the optimizer update,
# an ``autocast(enabled=False)`` region). The regions are part of the program key. Before,
# the key ignored them: a program traced without autocast ran under the caller's autocast,
# its matmuls cast at run time (a loss 3e-3 off the eager autocast step's), and one traced
# under it ran in float32 calls alike. (``private.autocast_regions``: left in ``_call``,
# entered again around the capture in ``_compile``.)


# NOTE: [torch settings in the program key]
# Besides the grad mode, autocast and the default dtype (above), four of torch's settings
# around a call change what its capture traces, so the program key holds them
# (``private.call_settings``, read on every call: 1.1 us on this 2-core machine while
# others used it) and a call with another value compiles its own program, logging
# "recompiling <step>: <setting> was <old>, now <new>". Each ran the first call's
# program silently before (2026-12-06, float64 ddp MLP against the eager step):
# - ``torch.set_default_device("meta")`` (or ``with torch.device(...)``): eager fails on
#   the step's ``torch.zeros(4)``, the program kept its CPU constant and trained on;
# - ``torch.set_flush_denormal(True)`` at capture: it flushes Python's floats and the
#   scalars traced, and the program kept them flushed on a later call without it (1.8e-11
#   off eager in a step that scales by 1e-310); torch has no getter, so the key reads
#   whether a Python float denormal flushes (a call under it at run time was right: the
#   program's kernels run in the caller's thread);
# - ``torch.nn.attention.sdpa_kernel(...)``: the capture picks the CPU flash kernel or the
#   math formulation as eager would under the enabled backends (NOTE: [the CPU flash
#   kernel at capture]); a backend set eager cannot run on ("No viable backend") ran the
#   old program instead of failing;
# - saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``, ``save_on_cpu``):
#   the capture runs them, so the program holds what they did; a pack / unpack pair that
#   changes values (an unpack that doubles) was baked into the program for later calls
#   without it (loss 0.23 off), and ignored by a program traced without it (0.25 off). A
#   hook is keyed by its code and the plain values it closes over (``save_on_cpu`` and a
#   lambda written in the loop make new functions on every entry: one program), any other
#   by itself; a global its code reads is not in the key. With hooks the step has no key
#   before capture (``step_key.py``; its program key, which hashes the graph, holds).
# Not keyed, checked: ``torch.use_deterministic_algorithms`` (no CPU op of these steps
# changes; in the compile cache's key), ``torch.set_float32_matmul_precision`` and
# ``torch.backends.mkldnn`` flags (read by the kernels at run time: the program under them
# matched eager under them), ``torch.manual_seed`` (the program draws from the generator's
# state: NOTE: [random numbers]), anomaly mode (checked on every call: NOTE: [anomaly
# detection at capture]).


# NOTE: [a value changed on every run, in the user's numbers]
# A step that changes a Python value is traced once more from what its first trace left
# (NOTE: [a step that changes what it reads]); where that trace changes it again, the
# refusal named only the second change: MoCo's ``model.ptr = (model.ptr + bs) % K``,
# found 0, read "module <root>.ptr was 8, now 16" on the first call, numbers of the
# capture's own runs the user never saw. It says what the call did to the value (0 to 8)
# and what running the step again from there did (8 to 16).
def _lr_read_in_python(what: str, bindings: StepBindings) -> str | None:
    """The hint for a learning rate that recompiles because the optimizer's step reads it
    as a Python number (NOTE: [a learning rate read in Python]), or None for another
    change."""
    found = re.fullmatch(r"optimizer\[(\d+)\]\.param_groups\[\d+\]\['lr'\]", what)
    if found is None or int(found[1]) >= len(bindings.optimizers):
        return None
    opt = bindings.optimizers[int(found[1])]
    read, where = lr_read_in_python(opt)
    if not read:
        return None
    at = f" ({where})" if where is not None else ""
    return (
        f"{type(opt).__name__}'s step() reads the learning rate as a Python number{at} "
        "(math.sqrt / math.* of it, float(), min / max, a comparison or an `if`), so each "
        "value is a setting of the program; compute with group['lr'] by Python operators "
        "and tensor ops only (`lr ** 0.5` for math.sqrt(lr); `+ - * / **`, and the result "
        "given to torch where it takes a number, `p.add_(update, alpha=-step_size)`, or "
        "multiplying a tensor), which keeps it a graph input, one program for every value, "
        "as torch.optim's optimizers do"
    )


def _counter_hint(change: Change, bindings: StepBindings) -> str:
    """What to do about a Python value the step changes on every call: for an attribute
    of an optimizer (``self.t += 1`` in its step()), its per-parameter state (NOTE:
    [counters a custom optimizer keeps]); otherwise a buffer or an argument."""
    container, key = change.place or (None, None)
    if container is not None and any(vars(o) is container for o in bindings.optimizers):
        return attribute_counter_hint(str(key))
    return (
        "keep the counter in a tensor the step updates in place (a buffer made before the "
        "first call: self.register_buffer('calls', torch.zeros((), dtype=torch.long)); "
        "self.calls += 1), or count outside the compiled step and pass what the step "
        "decides on as an argument (`step(model, opt, x, y, do_step=(i + 1) % accum == 0)`: "
        "a bool argument compiles one program per value, docs/porting.md); the refused call "
        "left the value as it found it."
    )


def _changed_twice(change: Change, again: Change) -> str:
    """What the first trace and the probe changed, in the call's numbers first."""
    if change.was is None or again.was is None:
        return f"{change} on this call, and {again} when the capture ran the step again"
    then = "" if again.what == change.what else f"{again.what} "
    return (
        f"{change.what} went from {change.was} to {change.now} on this call, and {then}from "
        f"{again.was} to {again.now} when the capture ran the step again from there"
    )


def _way_that_wrote(captured: CapturedStep, probe: CapturedStep) -> str | None:
    """The line of an ``if`` on a tensor value that the two traces of a capture took
    different ways (NOTE: [Python values written by the way of an if]), or None."""
    ways = {check.where: check.expected for check in captured.checks}
    return next(
        (check.where for check in probe.checks if ways.get(check.where, check.expected) != check.expected),
        None,
    )


def _written_by_the_way_of_an_if(change: Change, again: Change, where_if: str, where: str) -> SPMDCompileError:
    """NOTE: [Python values written by the way of an if]: ``change`` is what the first
    trace changed, ``again`` what the probe, traced the other way, changed after it."""
    first = f"from {change.was} to {change.now} traced one way and " if change.what == again.what else ""
    return SPMDCompileError(
        f"The train step writes a Python value in the branches of an `if` on a tensor value "
        f"({where_if}): {again.what} went {first}from {again.was} to {again.now} traced the "
        "other way. Its value depends on the tensor's, and a compiled step runs no Python, "
        "so it cannot write it.",
        user_line=where,
        hint="do the bookkeeping outside the compiled step on what it returns (`loss = "
        "step(x, y)`, then `if loss.item() < best: best = loss.item()` in the loop), or keep "
        "the value in a tensor the step updates without an `if` (a buffer made before the "
        "first call, updated with torch.where); the refused call left the value as it found it.",
    )


# NOTE: [Python values written by the way of an if]
# A step that writes a Python value inside an ``if`` on a tensor value (best-loss
# tracking: ``if loss.item() < self.best: self.best = ...; self.bad = 0 else: self.bad
# += 1``) is traced one way, and the probe of NOTE: [a step that changes what it reads]
# traces it from what that trace left, the other way: the two writes disagree and the
# step was refused as one that "changes a Python value every time it runs: Trainer.bad
# was 1, now 0": the call had found 0, the 1 was what its own first trace had written,
# and no run of the step sets 1 to 0 every time. Where the two traces took different ways of an ``if``, the refusal
# says the value is written in the branches of that ``if`` (its line) and what each way
# did to it, and to keep such bookkeeping outside the step or in a tensor.


def _outside_tensor_hint(what: str, read_at: Any) -> str:
    """The advice for a tensor read from outside the step's arguments whose value changes
    every call (a global step counter): it is a tensor already, but the program holds it
    as a constant, each value compiled in (NOTE: [tensors read from outside the
    arguments]); before the sixty-ninth session the advice was to keep it in a tensor."""
    name = what.split("'")[1] if what.count("'") >= 2 else "the tensor"
    where = f" ({read_at})" if read_at is not None else ""
    read = (
        f"; the step reads it as a Python number{where}, and computing with the same "
        "tensor in tensor ops would keep it a constant"
        if read_at is not None else ""
    )
    return (
        f"it is a tensor from outside the step's arguments, which the program holds as a "
        f"constant{read}: pass it to the step as a tensor argument (or keep it in a buffer "
        f"of a module passed to the step), which the program reads live, and compute with "
        f"it in tensor ops instead of float() / .item() (`torch.clamp(({name} + 1) / 10, "
        f"max=1.0)` for `min(1.0, (float({name}) + 1) / 10)`); where a counter only decides "
        "an `if` (gradient accumulation), pass the decision as a bool argument instead "
        "(two values, two programs)"
    )


def _warn_of_constants_in_arguments(outside: list[Any]) -> None:
    """A tensor read from an argument object the step's arguments do not open is a
    constant of the program, the same on every rank: right for a config's tensor, wrong
    for a batch, which real ranks then refuse (NOTE: [constants agree across ranks]).
    Said at capture, so that a step developed on simulated ranks (where the constant is
    the global batch and the numbers match) learns it before it meets real ones."""
    labels = [o.label for o in outside if o.in_argument]
    if labels:
        log.warning(
            "%s: read as a constant of the program, the same on every rank (NOTE: [tensors "
            "read from outside the arguments]). If it is part of the batch, each real rank "
            "holds its own and the call is refused there; pass such tensors as arguments "
            "or in a @dataclass, dict, UserDict or SimpleNamespace (NOTE: [batch "
            "containers]; a subclass of dict, list or tuple with attributes set on the "
            "object is not opened: NOTE: [subclasses of dict, list and tuple]).",
            ", ".join(labels),
        )


def _check_compile_options(
    parallel_mode: Any, check_passes: Any, verify_numerics: Any, backend: str, inductor_regions: Any,
) -> None:
    """Refuse at ``sc.compile`` the options that would only fail (or do nothing) later."""
    if isinstance(parallel_mode, (types.FunctionType, types.MethodType, functools.partial, CompiledTrainStep)):
        # ``@sc.compile`` written without its call: the step itself came as the mode
        raise SPMDCompileError(
            f"sc.compile was given the function {getattr(parallel_mode, '__name__', parallel_mode)!r} "
            "as its parallel mode: spmd_compiler.compile takes the options first and "
            "returns the decorator.",
            hint="write @spmd_compiler.compile(mode) (with its parentheses, e.g. "
            '@sc.compile(DataParallel("replicate"))), or sc.compile(mode)(train_step).',
        )
    # by what it is, not by class: ``parallel_modes`` is importable under two names (the
    # package and ``spmd_compiler.parallel_modes``), whose classes differ
    if parallel_mode is not None and (
        isinstance(parallel_mode, (str, type)) or not callable(getattr(parallel_mode, "capture_options", None))
    ):
        given = (f"the class {parallel_mode.__name__}" if isinstance(parallel_mode, type)
                 else f"{parallel_mode!r} ({type(parallel_mode).__name__})")
        raise SPMDCompileError(
            f"parallel_mode must be an instance of spmd_compiler.parallel_modes.ParallelMode; "
            f"got {given}.",
            hint='pass an instance, e.g. parallel_mode=DataParallel("replicate"), '
            'DataParallel("fully_shard") or TensorParallel(...) from spmd_compiler.parallel_modes',
        )
    for name, value in (("check_passes", check_passes), ("verify_numerics", verify_numerics)):
        if not isinstance(value, bool):
            raise SPMDCompileError(f"{name} must be True or False; got {value!r}.")
    if inductor_regions is not None and not isinstance(inductor_regions, bool):
        raise SPMDCompileError(f"inductor_regions must be True, False or None; got {inductor_regions!r}.")
    if inductor_regions and backend == "eager":
        raise SPMDCompileError(
            "inductor_regions=True splits the program Inductor compiles into compute regions; "
            "backend='eager' runs no Inductor, so it would have no effect.",
            hint="use backend='inductor' (or 'auto') with inductor_regions, or drop it.",
        )


def compile(  # noqa: A001 - the public name mirrors torch.compile
    parallel_mode: ParallelMode | None = None,
    *,
    disable_passes: str | tuple[str, ...] = (),
    check_passes: bool = True,
    extra_passes: tuple[str, ...] = (),
    pass_options: dict[str, Any] | None = None,
    verify_numerics: bool = False,
    backend: str = "auto",
    cuda_graphs: bool = False,
    cache_dir: str | os.PathLike[str] | None = None,
    inductor_regions: bool | None = None,
) -> Callable[[Callable[..., Any]], CompiledTrainStep]:
    """Compile a whole train step (forward, loss, backward, optimizer) for N ranks.

    Args:
        parallel_mode: how to spread the step (default ``DTensorExpandMode()``).
        disable_passes: names of passes to skip, or one name (also ``SPMD_DISABLE_PASSES``).
        check_passes: lint and collective checks after every pass.
        extra_passes: registered passes to run besides the default pipeline (passes of
            installed plugins run only when named here).
        pass_options: pass name -> that pass's options dataclass (or a dict of its fields).
        verify_numerics: in simulation, compare the program's outputs before and after
            every pass on fixed random inputs (slow; for tests and debugging).
        backend: how the per-rank program runs on real ranks: "eager" (the fx
            interpreter, op by op), "inductor" (compiled to C++ / Triton kernels on its
            first call, collectives kept in the order the passes chose; see
            ``inductor_regions``) or "auto" (the
            default: inductor for a model on CUDA, eager on CPU; NOTE: [default backend]
            in ``spmd_compiler/lower.py``). Simulated ranks always interpret
            (NOTE: [lowering]).
        cuda_graphs: with backend "inductor" (or "auto") on CUDA, record the step once
            and replay it as a CUDA graph (static shapes; refused on CPU). State is
            updated in place, returned values are copies; ``param.grad`` lives in the
            graphs' memory, which the next step reuses: reading a gradient kept from an
            earlier step raises, so clone one you keep (NOTE: [CUDA graphs and the
            program's outputs]).
        inductor_regions: with backend "inductor", compile each stretch of compute
            between collectives as its own graph, so every collective runs exactly where
            the passes put it (True), or the whole program as one graph (False); None: by
            device (NOTE: [compute regions] in ``spmd_compiler/lower.py``).
        cache_dir: a directory for the persistent compile cache (default: the
            ``SPMD_COMPILER_CACHE_DIR`` environment variable; unset: no cache). A
            restarted job loads its compiled program from there instead of expanding
            and optimizing it again. See NOTE: [persistent compile cache] in
            ``spmd_compiler/compile_cache.py``.
    """
    _check_compile_options(parallel_mode, check_passes, verify_numerics, backend, inductor_regions)
    mode = parallel_mode if parallel_mode is not None else DTensorExpandMode()
    options = PassOptions(
        disabled=frozenset(pass_names(disable_passes)), check=check_passes,
        verify_numerics=verify_numerics, extra_passes=extra_passes, pass_options=pass_options or {},
    )

    lowering = LoweringOptions(backend, cuda_graphs, inductor_regions)  # type: ignore[arg-type]

    def decorate(func: Callable[..., Any]) -> CompiledTrainStep:
        if isinstance(func, CompiledTrainStep):  # NOTE: [a compiled step inside another]
            raise SPMDCompileError(
                f"{func._name} is already a compiled step: compiling it again would trace "
                "the compiled step inside another.",
                user_line=func._where,
                hint=f"compile the plain function once: sc.compile(mode)({func._name}); "
                f"for another mode or options compile its .func again.",
            )
        return CompiledTrainStep(func, mode, options, lowering, cache_dir)

    return decorate


def _module_state(bindings: StepBindings) -> list[tuple[str, tuple[int, ...]]]:
    """``(what, shape)`` of the modules' buffers, parameters and plain tensor attributes,
    for the hint of NOTE: [batch-sized module state] in ``parallel_modes/batch_dims.py``."""
    state = [(f"module buffer {n!r}", tuple(t.shape)) for n, t in bindings.buffers.items()]
    state += [(f"parameter {n!r}", tuple(t.shape)) for n, t in bindings.params.items()]
    for module in bindings.modules:
        for fqn, sub in module.named_modules():
            for attr, value in vars(sub).items():
                if isinstance(value, torch.Tensor) and not attr.startswith("_"):
                    state.append((f"module attribute {(fqn + '.' if fqn else '') + attr!r}", tuple(value.shape)))
    return state
