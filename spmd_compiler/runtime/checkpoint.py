"""Save and resume compiled training with ``torch.distributed.checkpoint`` (DCP).

    sc.checkpoint.save("ckpt/step100", model, optimizer)        # every rank calls it
    ...
    model, optimizer = build()                                  # fresh process
    sc.checkpoint.load("ckpt/step100", model, optimizer)        # before or after compiling
    loss = train_step(model, optimizer, x, y)                   # continues exactly

NOTE: [checkpoint layout]
The checkpoint is the state dict of ``torch.distributed.checkpoint.state_dict.
get_state_dict``: parameters and buffers by FQN, optimizer state keyed by parameter FQN
(not by position), so a checkpoint loads into any parallel mode and any world size: DCP
stores each rank's shard with its global offsets and reads back whatever shard the
loading rank holds (resharding, e.g. fully_shard -> replicate).

``load`` works in both states of a model (NOTE: [state ownership] in runtime/runner.py):

- compiled (parameters are DTensors): DCP reads each rank's shards in place.
- not yet compiled (plain tensors): every rank reads the full tensors, and the first
  compiled call installs them with the mode's placements. An optimizer that has not
  stepped yet has no state to read into; ``get_state_dict`` creates it with one step at
  ``lr=0`` on zero gradients (parameters do not change), and the checkpoint's values
  overwrite it (a checkpoint saved before the first step holds none: NOTE: [an optimizer
  saved before its first step]). Reading full tensors costs
  one full copy of the model and optimizer per rank, once; use a compiled model where
  that does not fit.

Every save also writes checksums of every stored chunk, and ``load`` verifies them before
reading anything (NOTE: [checkpoint checksums] in checkpoint_checksums.py).

Inside ``simulate`` (one process holding every simulated rank) the checkpoint holds the
full tensors, written and read without collectives (DCP's planner sees only one real
rank); it is the checkpoint of one rank holding everything, so it loads into any mode and
world size, simulated or real, and vice versa. ``save``, ``load`` and ``full_state_dict``
also work on a simulated model after its ``simulate`` block has ended (NOTE: [state after
a simulation] in simulate.py).

NOTE: [one checkpoint folder for every rank]
``save`` is one checkpoint written by all ranks into one folder. Per-rank folders
(``save(f"ckpt/rank{rank}")``, the habit of per-rank files) failed inside DCP on real
ranks with ``FileNotFoundError: .../__1_0.distcp`` (rank 0 writes the metadata that
names every rank's file into its own folder) after rank 0 had written a partial
checkpoint. Now, on real ranks, the ranks compare the SHA-256 of the absolute path (one
all-reduce of 4 words, before anything is written) and every rank raises
``CheckpointError`` when they differ, nothing written. ``load`` of a folder that does not
exist (on any rank) says so, rather than that it has no checksums.

Compiled steps keep Adam's step counter as a float64 0-d tensor; an eager optimizer keeps
float32. Counters are small integers, exact in both, and DCP copies into whatever dtype
the loading side holds, so checkpoints cross between eager and compiled training.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import re
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, Replicate

from .. import _torch_private as private
from .._torch_private import pytree
from ..capture.bindings import follow_replaced_parameters
from .checkpoint_checksums import (
    CheckpointError,
    _words,
    process_group_all_reduce,
    verify,
    write_manifest,
)
from .same_inputs import checkpoint_round
from .simulate import Simulation, simulation_for
from .state_making_step import state_making_step
from .step_executable import flush_pending_updates

__all__ = ["CheckpointError", "full_state_dict", "load", "save"]

# NOTE: [DCP's single-process warning]
# dcp.save / dcp.load warn "torch.distributed is disabled, unavailable or uninitialized,
# assuming the intent is to save in a single process" whenever they run without a process
# group, also when told so (no_dist=True). Here that is always the intent: simulated ranks
# write and read the full tensors from one process (no_dist=True), and a save without a
# process group is documented as a single-process save. So every save and load printed
# it. Filtered around our own DCP calls that have no process group, that message only.
_SINGLE_PROCESS = re.compile(
    r"torch\.distributed is (disabled, )?unavailable or uninitialized, assuming the intent "
    r"is to (save|load) in a single process"
)


@contextlib.contextmanager
def _single_process_dcp(single: bool) -> Iterator[None]:
    """Inside: DCP's single-process warning is not shown when ``single`` (NOTE: [DCP's
    single-process warning])."""
    if not single:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS.pattern, category=UserWarning)
        yield


MODEL_KEY = "model"
OPTIMIZER_KEY = "optimizer"


def _tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> list[Any]:
    """The state's tensors, for ``simulation_for`` to tell what ranks they live on (the
    optimizer first pointed at the model's placed parameters: every checkpoint function
    starts here)."""
    follow_replaced_parameters(model, optimizer)
    found: list[Any] = [*model.parameters(), *model.buffers()]
    if optimizer is not None:
        for per_param in optimizer.state.values():
            found += per_param.values()
    return found


# NOTE: [an optimizer saved before its first step]
# An optimizer that has not stepped holds no state. torch's ``get_state_dict`` makes it
# with one ``step()`` at ``lr=0`` on zero gradients, so that a load has tensors to read
# into. For a save that step stayed in the user's optimizer: AdamW's ``step`` counter at
# 1 before any training, so every later bias correction was one step off (a float64
# ``nn.Linear`` after 2 compiled steps: 1.1e-2 away from the same run without the save,
# no error), and the checkpoint held that step too. Rprop would take its step sizes from
# ``lr=0``, and the user's step hooks ran. So ``save`` and ``full_state_dict`` leave such
# an optimizer as it is (``optimizer_state_left_unmade``) and store its param groups with
# no state; ``load`` of such a checkpoint leaves the loading optimizer without state, as
# the saved one had, and takes the param groups. A checkpoint that holds state is read
# as before: into state made for it, every entry overwritten.


def _state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, make_state: bool = False
) -> dict[str, Any]:
    """The state dict to save or to read into. ``make_state``: an optimizer that has not
    stepped gets its state made to read into (NOTE: [an optimizer saved before its first
    step])."""
    flush_pending_updates()  # NOTE: [cross-iteration overlap]: state of the last step
    optimizers = [optimizer] if optimizer is not None else []
    # NOTE: [the step that makes an optimizer's state]: a step(self) works; no generator moves
    with state_making_step(optimizer) if make_state else private.optimizer_state_left_unmade():
        model_state, optim_state = get_state_dict(model, optimizers)
    state: dict[str, Any] = {MODEL_KEY: model_state}
    if optimizer is not None:
        state[OPTIMIZER_KEY] = optim_state
    return state


def _saved_keys(folder: str) -> set[str]:
    """The flattened state keys the checkpoint in ``folder`` holds."""
    return set(dcp.FileSystemReader(folder).read_metadata().state_dict_metadata)


def _holds_optimizer_state(keys: set[str]) -> bool:
    """Whether a checkpoint of these keys holds optimizer state (not only param groups)."""
    return any(key.startswith(f"{OPTIMIZER_KEY}.state.") for key in keys)


# NOTE: [parameters with no optimizer state in a checkpoint]
# An optimizer makes a parameter's state on the first step that gives it a gradient: a
# head used only from some step on, a branch a Python flag turns on, an expert no token
# reached yet. Saved before then, the checkpoint holds state for some parameters only.
# To read into it, ``load`` makes every parameter's state (NOTE: [the step that makes an
# optimizer's state]), so DCP looked for the others' entries and failed in torch's
# words ("Missing key in checkpoint state_dict: optimizer.state.aux.weight.step"). A
# parameter none of whose state entries the checkpoint holds is read as it was saved:
# with no state (the optimizer's ``load_state_dict`` replaces the made state wholesale),
# so its first step after the resume is a first step, as in the run that saved it. A
# parameter the checkpoint holds other entries for (saved by another optimizer type:
# SGD's ``momentum_buffer`` read into AdamW) still fails in DCP, naming the key.


# The other way round, a parameter the checkpoint holds state for that the optimizer
# read into holds none (it stepped before the load while that parameter was frozen or
# unused, so torch makes no state for it to read into): its saved state would not be
# read, and its next step would be a first step, silently (a review, sixty-ninth session:
# 1.3e-2 off eager after one step). Refused before anything is read, naming the
# parameters; a fresh optimizer with those parameters trainable reads them.


def _without_unsaved_parameters(state: dict[str, Any], keys: set[str], folder: str) -> None:
    """Drop from ``state``'s optimizer state the parameters the checkpoint holds no
    state entry for; refuse parameters whose saved state has nothing to be read into
    (NOTE: [parameters with no optimizer state in a checkpoint])."""
    per_param = state[OPTIMIZER_KEY]["state"]
    prefix = f"{OPTIMIZER_KEY}.state."
    # every dotted prefix of each saved key's rest: a parameter is saved when its FQN is
    # one (the same answer as a ``startswith`` of each key, in one pass over the keys)
    held: set[str] = set()
    for key in keys:
        if key.startswith(prefix):
            parts = key[len(prefix):].split(".")
            held.update(".".join(parts[:i]) for i in range(1, len(parts)))
    saved = {fqn for fqn in _parameter_names(state) if fqn in held}
    unread = sorted(saved - set(per_param))
    if unread:
        raise CheckpointError(
            f"checkpoint {folder} holds optimizer state for {', '.join(unread)}, which the "
            "optimizer it is loaded into has no state for (it stepped while they were frozen "
            "or unused), so that state could not be read. Nothing was loaded. Load into an "
            "optimizer that has not stepped yet (a fresh one), with those parameters "
            "trainable (requires_grad=True) during the load; freeze them after it."
        ) from None
    for fqn in [fqn for fqn in per_param if fqn not in saved]:
        del per_param[fqn]


def _parameter_names(state: dict[str, Any]) -> list[str]:
    """The parameter FQNs of an optimizer state dict's param groups."""
    return [fqn for group in state[OPTIMIZER_KEY]["param_groups"] for fqn in group["params"]]


def save(
    path: str | os.PathLike[str],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
) -> None:
    """Write ``model`` (and ``optimizer``) state to the folder ``path``; every rank calls it.

    Each rank writes its own shards (no gather), then the checksums of what was
    written. Works on compiled (DTensor) and plain state, on real and simulated ranks;
    see NOTE: [checkpoint layout].

    Args:
        path: a folder, created if missing; shared by all ranks.
        model: the model the compiled step trains.
        optimizer: its optimizer, or None to save the model only.
    """
    folder = os.fspath(path)
    with simulation_for(_tensors(model, optimizer)) as sim:
        if sim is None and dist.is_initialized():
            checkpoint_round("save")  # NOTE: [a checkpoint on some ranks only]
        if sim is None and dist.is_initialized():
            _same_folder_on_every_rank(folder)  # NOTE: [one checkpoint folder for every rank]
        state = _state(model, optimizer)
        if sim is not None:
            with _single_process_dcp(True):
                metadata = dcp.save(_full_tensors(state, sim), checkpoint_id=folder, no_dist=True)
            write_manifest(folder, _with_storage_data(metadata, folder), 0, 1, _no_collective)
            return
    with _single_process_dcp(not dist.is_initialized()):
        metadata = dcp.save(_without_strided_shards(state), checkpoint_id=folder)
    rank, world = _rank_and_world()
    write_manifest(folder, _with_storage_data(metadata, folder), rank, world, process_group_all_reduce)


def _same_folder_on_every_rank(folder: str) -> None:
    """Raise ``CheckpointError`` on every rank when the ranks passed different folders
    (NOTE: [one checkpoint folder for every rank]); a collective."""
    words = _words(hashlib.sha256(os.path.abspath(folder).encode()).hexdigest())
    low, high = words.clone(), words.clone()
    process_group_all_reduce(low, dist.ReduceOp.MIN)
    process_group_all_reduce(high, dist.ReduceOp.MAX)
    if not torch.equal(low, high):
        raise CheckpointError(
            f"sc.checkpoint.save: the ranks passed different paths (rank {dist.get_rank()}: "
            f"{os.path.abspath(folder)!r}); one checkpoint is one folder that every rank "
            "writes its shards into, on a file system every rank sees. Nothing was written. "
            "Pass the same path on every rank (save(f'ckpt/step{step}'), not "
            "save(f'ckpt/rank{rank}')) (NOTE: [one checkpoint folder for every rank])."
        )


def _folder_exists(folder: str, sim: Simulation | None) -> None:
    """Raise ``CheckpointError`` (on every rank) when ``folder`` is missing (on a rank)."""
    missing = torch.tensor([0 if os.path.isdir(folder) else 1], dtype=torch.int64)
    if sim is None and dist.is_initialized():
        process_group_all_reduce(missing, dist.ReduceOp.MAX)
    if missing.item():
        where = "" if os.path.isdir(folder) else f" ({os.path.abspath(folder)!r})"
        raise CheckpointError(
            f"checkpoint {folder} does not exist{where or ' on another rank'}: nothing was "
            "loaded; the model and optimizer are unchanged. Check the path (a checkpoint "
            "is the folder sc.checkpoint.save was given)."
        )


def _with_storage_data(metadata: Any, folder: str) -> Any:
    """The saved checkpoint's metadata with its storage map (chunk -> file, offset).

    torch 2.11's ``dcp.save`` can return the metadata without ``storage_data`` (None); the
    same metadata, complete, is in the folder once ``save`` returned (every rank waits for
    the coordinator's write). Feature-tested on the returned object.
    """
    if metadata.storage_data:
        return metadata
    return dcp.FileSystemReader(folder).read_metadata()


def load(
    path: str | os.PathLike[str],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    verify_checksums: bool = True,
) -> None:
    """Read the state saved by ``save`` into ``model`` (and ``optimizer``), in place.

    Why: resume training, possibly with another parallel mode or world size. Call it on
    every rank, before the first compiled call or after it (NOTE: [checkpoint layout]).
    The model's parameter objects stay the same, so a compiled step keeps its programs.

    Args:
        path: the folder ``save`` wrote.
        model: a model of the same architecture.
        optimizer: an optimizer of the same type and param groups, or None.
        verify_checksums: check every stored chunk against the checksums ``save``
            wrote before reading (reads the checkpoint once more); False loads a
            checkpoint written by other tools.

    Raises:
        CheckpointError: the checkpoint is damaged (names each tensor that differs) or
            has no checksums; the model and optimizer are then unchanged.
    """
    folder = os.fspath(path)
    with simulation_for(_tensors(model, optimizer)) as sim:
        _load(folder, model, optimizer, sim, verify_checksums)


def _load(
    folder: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    sim: Simulation | None,
    verify_checksums: bool,
) -> None:
    if sim is None and dist.is_initialized():
        checkpoint_round("load")  # NOTE: [a checkpoint on some ranks only]
    _folder_exists(folder, sim)
    if verify_checksums:
        if sim is not None:
            verify(folder, 0, 1, _no_collective)
        else:
            verify(folder, *_rank_and_world(), process_group_all_reduce)
    unstepped = optimizer is not None and not optimizer.state
    try:
        keys = _saved_keys(folder)
        with_state = optimizer is not None and _holds_optimizer_state(keys)
        state = _state(model, optimizer, make_state=with_state)
        if optimizer is not None and not with_state:  # saved before its first step
            state[OPTIMIZER_KEY] = {"state": {}, "param_groups": state[OPTIMIZER_KEY]["param_groups"]}
        if with_state:
            _without_unsaved_parameters(state, keys, folder)
        if sim is not None:
            state = _load_simulated(folder, state, sim)
        else:
            readable = _without_strided_shards(state)
            with _single_process_dcp(not dist.is_initialized()):
                dcp.load(readable, checkpoint_id=folder)
            state = pytree.tree_map(_placed_as, state, readable)
    except (pickle.UnpicklingError, EOFError) as exc:
        _state_left_unmade(optimizer, unstepped)
        raise CheckpointError(f"checkpoint {folder} could not be read: {exc}") from exc
    except dcp.CheckpointException as exc:
        _state_left_unmade(optimizer, unstepped)
        raise _not_this_state(folder, exc) from exc
    except Exception:
        _state_left_unmade(optimizer, unstepped)
        raise
    # strict=False: torch's check that every parameter with requires_grad has saved
    # state, which those without state in the checkpoint have not (NOTE: [parameters
    # with no optimizer state in a checkpoint]; every state the checkpoint holds was read
    # above); the model's keys are still all read. The optimizer first, as torch's
    # set_state_dict does: a failure there leaves the model as it was.
    try:
        with state_making_step(optimizer) if with_state else private.optimizer_state_left_unmade():
            if optimizer is not None:
                set_optimizer_state_dict(model, [optimizer], state[OPTIMIZER_KEY], options=StateDictOptions(strict=False))
            set_model_state_dict(model, state[MODEL_KEY])
    except Exception:
        _state_left_unmade(optimizer, unstepped)
        raise


# NOTE: [a checkpoint that does not fit]
# A checkpoint of another model (other parameter names) or another optimizer (SGD's
# ``momentum_buffer`` read into AdamW) fails in DCP's planner with a
# ``CheckpointException``, which derives from ``BaseException``: a user's ``except
# Exception`` did not catch it, and its text was DCP's traceback of each rank. It is
# raised as a ``CheckpointError`` naming the first missing key and what it means. The
# state made to read into (NOTE: [the step that makes an optimizer's state]) is taken
# away again from an optimizer that had none: it was left with AdamW's step counter at 1,
# so training on after the failed load was one bias correction off.


def _state_left_unmade(optimizer: torch.optim.Optimizer | None, unstepped: bool) -> None:
    """An optimizer that had no state before a failed load has none after it (NOTE: [a
    checkpoint that does not fit])."""
    if optimizer is not None and unstepped:
        optimizer.state.clear()


def _not_this_state(folder: str, exc: BaseException) -> CheckpointError:
    """The ``CheckpointError`` of a DCP load that failed (NOTE: [a checkpoint that does
    not fit])."""
    failures = getattr(exc, "failures", {}) or {}
    first = next(iter(failures.values()), exc)
    if isinstance(first, tuple):  # DCP keeps (exception, its stack) per rank
        first = first[0]
    what = str(first).strip().splitlines()[-1] if str(first).strip() else type(first).__name__
    return CheckpointError(
        f"checkpoint {folder} does not fit the model and optimizer it is loaded into: {what} "
        "(keys and sizes are matched before any tensor is read)."
        + (
            " A missing 'optimizer.state.<parameter>.<entry>' key means the checkpoint was "
            "saved by an optimizer of another type or settings (SGD's momentum_buffer is not "
            "AdamW's exp_avg); a missing 'model.<name>' key, a model with other parameter names."
            if "Missing key" in what else ""
        )
    )


# NOTE: [strided shards in a checkpoint]
# Tensor parallel's fused projections (``FusedColwiseParallel``: q, k and v in one
# weight) shard their state as ``_StridedShard``: each rank holds rows from every chunk,
# which is no one block of the global tensor. DCP describes a rank's shard by one offset
# and size, so saving such state on real ranks failed in DCP's planner ("overlapping
# chunks", then ``Failed to validate global plan``: GPT-2 under the zoo's TP plan). Those
# tensors are written and read whole on the strided mesh dimensions (replicated there:
# DCP stores a replicated chunk once) and placed back as the state holds them after a
# load. The checkpoint is then the one any mode writes for that tensor, so it loads
# into other modes and world sizes as well. Simulated ranks write full tensors anyway.


def _without_strided_shards(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with every DTensor sharded as ``_StridedShard`` replicated on those mesh
    dimensions (NOTE: [strided shards in a checkpoint])."""

    def plain(value: Any) -> Any:
        if isinstance(value, DTensor) and any(map(private.is_strided_shard, value.placements)):
            placements = [Replicate() if private.is_strided_shard(p) else p for p in value.placements]
            return private.redistribute(value, placements)
        return value

    return pytree.tree_map(plain, state)


def _placed_as(current: Any, loaded: Any) -> Any:
    """A value read by DCP, placed as the state holds it (a DTensor read whole on strided
    dimensions goes back to them); DCP replaced a Python value in the dict it read into."""
    if isinstance(current, DTensor) and loaded is not current:
        return private.redistribute(loaded, current.placements)
    return loaded


def _rank_and_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _no_collective(tensor: torch.Tensor, op: Any) -> None:
    """One process holds every (simulated) rank: nothing to combine."""


def _full_tensors(state: dict[str, Any], sim: Simulation) -> dict[str, Any]:
    """``state`` with every DTensor (and simulated tensor) as its full plain value."""
    return pytree.tree_map(
        lambda v: sim.full_tensor(v) if isinstance(v, torch.Tensor) else v, state
    )


def _load_simulated(folder: str, state: dict[str, Any], sim: Simulation) -> dict[str, Any]:
    """Read the full tensors (no collectives), then shard each DTensor's value as the
    state holds it; returns the state to install."""
    full = pytree.tree_map(
        lambda v: torch.empty(v.shape, dtype=v.dtype, device=v.device)
        if isinstance(v, DTensor) else v,
        state,
    )
    with _single_process_dcp(True):
        dcp.load(full, checkpoint_id=folder, no_dist=True)

    def reshard(current: Any, loaded: Any) -> Any:
        if isinstance(current, DTensor):
            return sim.shard(loaded, current.device_mesh, current.placements)
        # a plain tensor was read in place; a Python value (a param group's lr,
        # momentum) was replaced in ``full``, and the state must take it from there
        return loaded

    return pytree.tree_map(reshard, state, full)


def _copied(state: Any) -> Any:
    return pytree.tree_map(
        lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v, state
    )


def full_state_dict(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, Any]:
    """The unsharded state as plain CPU tensors on rank 0 (``{}`` on other ranks), for export:
    copies, which later steps do not change.

    A collective: every rank must call it (not under ``if rank == 0:``; a rank that
    calls it while another is in a compiled call or another checkpoint function gets an
    error at once: NOTE: [a checkpoint on some ranks only]). To write one file:
    ``state = sc.checkpoint.full_state_dict(model, optim)`` on every rank, then
    ``if rank == 0: torch.save(state, path)``. The result is ``{"model": ..., "optimizer":
    ...}`` with the layout of NOTE: [checkpoint layout]; ``torch.save`` it, or load its
    ``"model"`` entry into an uncompiled model with ``load_state_dict``. On simulated
    ranks it works inside ``simulate`` and after the block has ended (NOTE: [state after
    a simulation]): the way to take a model trained there out of it.
    """
    # gathering a 2-D mesh's (dp, tp) shards logs DTensor's sequential-collective
    # warning, whose advice is not the user's to follow (NOTE: [DTensor's
    # sequential-collective warning] in _torch_private.py)
    with private.quiet_sequential_collective_warning():
        with simulation_for(tensors := _tensors(model, optimizer)) as sim:
            if sim is not None:  # one process holds every rank: gathered without collectives
                return _copied(_full_tensors(_state(model, optimizer), sim))
        if dist.is_initialized() and any(isinstance(t, DTensor) for t in tensors):
            # every rank gathers: NOTE: [a checkpoint on some ranks only] (plain state,
            # not placed yet, is each rank's own and gathers nothing)
            checkpoint_round("full_state_dict")
        flush_pending_updates()
        optimizers = [optimizer] if optimizer is not None else []
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        # NOTE: [an optimizer saved before its first step]: an export before training
        # leaves the optimizer as it is (was: AdamW's step counter at 1, 4.5e-3 off)
        with private.optimizer_state_left_unmade():
            model_state, optim_state = get_state_dict(model, optimizers, options=options)
    if dist.is_initialized() and dist.get_rank() != 0:
        return {}
    # copies: a replicated tensor's full value on CPU is the live state itself, which the
    # next step updates in place (NOTE: [state donation])
    out: dict[str, Any] = {MODEL_KEY: _copied(model_state)}
    if optimizer is not None:
        out[OPTIMIZER_KEY] = _copied(optim_state)
    return out
