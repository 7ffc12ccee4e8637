"""A model whose state a compiled step placed, called directly with plain tensors.

NOTE: [calling a placed model directly]
After a compiled call the model's parameters are DTensors with the mode's placements
(NOTE: [steps without an optimizer] in ``capture/trace.py`` for why they stay so). Calling
the model itself with plain tensors (``model(x)`` for a validation loss) would mix plain
tensors and DTensors, and DTensor refuses that with an error about its operators that
says nothing of the step. What such a call should mean (this rank's share of a global
batch, or a whole batch on every rank) is the mode's to decide, and a guess would be a
silent wrong result, so the call is refused with what to do: compile the evaluation as a
step without an optimizer, under the same mode. Calls with DTensor arguments (users who
place their inputs themselves) pass. The check is a forward pre-hook on each module given
to a compiled step, a module-level function, so the model still pickles.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from .._torch_private import pytree
from ..errors import SPMDCompileError


def refuse_plain_inputs(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook: refuse plain tensor arguments to a module with DTensor state."""
    leaves = pytree.tree_leaves((args, kwargs))
    if not any(isinstance(a, torch.Tensor) and not isinstance(a, DTensor) for a in leaves):
        return
    if not any(isinstance(p, DTensor) for p in module.parameters()):
        return  # its state is not (or no longer) placed: nothing to mix
    raise SPMDCompileError(
        f"{type(module).__name__} was called directly with plain tensors, but a compiled "
        "step placed its parameters as DTensors across the ranks, so one rank's call "
        "cannot tell which part of the batch it holds.",
        hint="compile the evaluation as a step of its own under the same parallel mode "
        "(a step without an optimizer is fine): "
        "`evaluate = sc.compile(parallel_mode=mode)(eval_step)`, then "
        "`evaluate(model, batch)` returns global values, like the train step's loss.",
    )


# NOTE: [loading plain tensors into a placed model]
# ``model.load_state_dict(best)`` with plain tensors (a checkpoint's weights, the
# ``"model"`` entry ``sc.checkpoint.full_state_dict`` returns: rolling back to the best
# weights) on a model a compiled step placed failed in torch's ``copy_`` ("got mixed
# torch.Tensor and DTensor"), naming neither the compiler nor what to do. A
# load-state-dict pre-hook on each module given to a compiled step (every submodule, so
# ``model.block.load_state_dict`` works too) places each plain tensor its own entries
# receive as the DTensor it replaces is placed, read as the full value: on simulated
# ranks shared out by the simulation (inside ``simulate`` or after it), on real ranks
# each rank taking its share of the full tensor it was given (every rank loads the same
# values, as with an unplaced model; no collective). Shapes that differ are left to
# torch's own size check.
def place_loaded_tensors(
    module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any
) -> None:
    """Load-state-dict pre-hook: the plain tensors for ``module``'s own DTensor state,
    placed like it (see the NOTE). Every deferred update is applied first (NOTE: [writes
    between calls while an update is pending]): the load lands on the completed step."""
    from .simulate import simulation_for
    from .step_executable import any_pending_updates, flush_pending_updates

    if any_pending_updates():
        flush_pending_updates()

    own = {**module._parameters, **module._buffers}
    targets = {
        prefix + name: current for name, current in own.items()
        if isinstance(current, DTensor) and _plain(state_dict.get(prefix + name))
        and tuple(state_dict[prefix + name].shape) == tuple(current.shape)
    }
    if not targets:
        return
    with simulation_for(targets.values()) as sim:
        for key, current in targets.items():
            full = state_dict[key].detach().to(dtype=current.dtype)
            if sim is not None:
                state_dict[key] = sim.shard(full, current.device_mesh, current.placements)
            else:
                full = full.to(current.to_local().device)
                state_dict[key] = distribute_tensor(
                    full, current.device_mesh, current.placements, src_data_rank=None
                )


def _plain(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and not isinstance(value, DTensor)


_GUARDED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
_LOADING: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def place_loaded_state(modules: list[torch.nn.Module]) -> None:
    """Install ``place_loaded_tensors`` on every submodule of ``modules``, once."""
    for mod in modules:
        for sub in mod.modules():
            if sub not in _LOADING:
                sub.register_load_state_dict_pre_hook(place_loaded_tensors)
                _LOADING.add(sub)


def flush_before_optimizer_load(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    """Optimizer load-state-dict pre-hook: apply every deferred update first (NOTE:
    [writes between calls while an update is pending])."""
    from .step_executable import any_pending_updates, flush_pending_updates

    if any_pending_updates():
        flush_pending_updates()


_FLUSHING: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


def flush_before_loads(optimizers: list[torch.optim.Optimizer]) -> None:
    """Install ``flush_before_optimizer_load`` on each optimizer, once."""
    for opt in optimizers:
        if opt not in _FLUSHING:
            opt.register_load_state_dict_pre_hook(flush_before_optimizer_load)
            _FLUSHING.add(opt)


def guard_direct_calls(modules: list[torch.nn.Module]) -> list[Callable[[], None]]:
    """Install ``refuse_plain_inputs`` on each module once; returns how to take off the
    ones this call installed (a compile that fails leaves the model as it was)."""
    undo: list[Callable[[], None]] = []
    for mod in modules:
        if mod not in _GUARDED:
            handle = mod.register_forward_pre_hook(refuse_plain_inputs, with_kwargs=True)
            _GUARDED.add(mod)
            undo.append(functools.partial(_unguard, mod, handle))
    return undo


def _unguard(mod: torch.nn.Module, handle: Any) -> None:
    handle.remove()
    _GUARDED.discard(mod)


__all__ = ["flush_before_loads", "guard_direct_calls", "place_loaded_state", "refuse_plain_inputs"]
