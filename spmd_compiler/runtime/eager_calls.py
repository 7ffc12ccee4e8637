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
import inspect
import sys
import weakref
from collections.abc import Callable
from typing import Any, cast

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from .. import _torch_private as private
from .._torch_private import pytree
from ..capture.optimizers import UNSUPPORTED
from ..errors import SPMDCompileError
from .placed_pruning import prune_placed_on_full_values


def refuse_plain_inputs(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook: refuse plain tensor arguments to a module with DTensor state."""
    leaves = pytree.tree_leaves((args, kwargs))
    if not any(isinstance(a, torch.Tensor) and not isinstance(a, DTensor) for a in leaves):
        return
    if not any(isinstance(p, DTensor) for p in module.parameters()):
        return  # its state is not (or no longer) placed: nothing to mix
    hint = _direct_call_hint(_caller_on_stack())
    raise SPMDCompileError(
        f"{type(module).__name__} was called directly with plain tensors, but a compiled "
        "step placed its parameters as DTensors across the ranks, so one rank's call "
        "cannot tell which part of the batch it holds.",
        hint=hint,
    )


# NOTE: [what called a placed model directly]
# The refusal's advice depends on what ran the model. Two callers are told apart by the
# frames on the stack: ``torch.optim.swa_utils.update_bn`` (recomputing batch norm
# statistics between calls: its compiled form) and an optimizer's ``step`` (a closure
# re-evaluating the loss: LBFGS run uncompiled after compiled Adam steps, the usual PINN
# schedule). update_bn is decorated with ``@torch.no_grad()``, so its ``__code__`` is
# torch's shared ``decorate_context`` wrapper, the code of every function so decorated:
# compared with that, a user's ``@torch.no_grad() def evaluate(...)`` got update_bn's
# advice (sixty-seventh session's probe). Its own code is the unwrapped function's
# (``inspect.unwrap``). An optimizer's step is a frame named ``step`` whose ``self`` is a
# ``torch.optim.Optimizer``. LBFGS (which no compiled step runs, NOTE: [optimizers a
# compiled step cannot run] in ``capture/optimizers.py``) is told to run on one device
# on a plain model holding the gathered weights; any other optimizer to step inside a
# compiled step, as the train step does. Anything else gets the compiled evaluation.
def _caller_on_stack() -> Callable[..., Any] | torch.optim.Optimizer | None:
    """``update_bn`` or the optimizer whose ``step`` is on the stack (the innermost
    first), or None (NOTE: [what called a placed model directly])."""
    update_bn = torch.optim.swa_utils.update_bn
    update_bn_code = inspect.unwrap(update_bn).__code__
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is update_bn_code:
            return update_bn
        if frame.f_code.co_name == "step":
            owner = frame.f_locals.get("self")
            if isinstance(owner, torch.optim.Optimizer):
                return owner
        frame = frame.f_back  # type: ignore[assignment]
    return None


def _direct_call_hint(caller: Callable[..., Any] | torch.optim.Optimizer | None) -> str:
    """What to do instead of calling the placed model directly from ``caller``."""
    if caller is torch.optim.swa_utils.update_bn:
        return ("compile a step that calls it, under the same parallel mode: "
                "`def bn_step(model, loader): torch.optim.swa_utils.update_bn(loader, model)`, "
                "`sc.compile(parallel_mode=mode)(bn_step)(swa_model, loader)` (the loader a "
                "list of batches; the statistics are the global batches').")
    if isinstance(caller, torch.optim.Optimizer):
        name = type(caller).__name__
        if name in UNSUPPORTED:
            return f"{name}'s step calls the model; {UNSUPPORTED[name][1]}."
        return (f"{name}'s step calls the model (a closure): step it inside a compiled step "
                "under the same parallel mode, given the model and the optimizer, as the "
                "train step steps its optimizer.")
    return ("compile the evaluation as a step of its own under the same parallel mode "
            "(a step without an optimizer is fine): "
            "`evaluate = sc.compile(parallel_mode=mode)(eval_step)`, then "
            "`evaluate(model, batch)` returns global values, like the train step's loss.")


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
            state_dict[key] = _placed_like(state_dict[key], current, sim)


def _placed_like(full: torch.Tensor, current: DTensor, sim: Any) -> DTensor:
    """The plain tensor ``full`` (a whole value, the same on every rank) placed as
    ``current`` is: shared out by the simulation ``sim``, or each real rank's share."""
    full = full.detach().to(dtype=current.dtype)
    if sim is not None:
        return sim.shard(full, current.device_mesh, current.placements)  # type: ignore[no-any-return]
    full = full.to(current.to_local().device)
    return distribute_tensor(full, current.device_mesh, current.placements, src_data_rank=None)


# NOTE: [assigning a parametrized tensor of a placed model]
# ``module.weight = A`` on a module with a ``torch.nn.utils.parametrize`` parametrization
# (re-initialising an ``orthogonal`` one with ``torch.eye``, a symmetric one with a new
# matrix) runs the parametrizations' ``right_inverse`` and sets the result into
# ``parametrizations.weight.original``. Once a compiled step placed that original as a
# DTensor, torch's ``_maybe_set`` swapped it with the plain result and failed with
# "Cannot swap t1 and t2 if they have different slots" (2026-12-06). Each
# ``ParametrizationList`` of a module given to a compiled step gets an instance
# ``right_inverse`` (a module-level function in a ``functools.partial``: the model still
# pickles) that, where an original is placed, runs torch's own ``right_inverse`` on a
# plain stand-in of the original (its checks, and the parametrizations' own writes, as
# in eager), then copies the result into the placed original in place, placed like it
# (as ``load_state_dict`` does above): the parameter keeps its identity, so the
# optimizer and its state go on with it as in eager. Every deferred update is applied
# first (NOTE: [writes between calls while an update is pending]). A parametrization
# whose own buffers the call replaces (``orthogonal``'s ``base``) leaves plain tensors
# there, which the next compiled call places as it places any replaced buffer. A result
# of another shape than the placed original (which eager would take, resizing it) is
# refused: a placed tensor keeps its shape.
def _placed_right_inverse(plist: torch.nn.Module, value: Any) -> None:
    """``ParametrizationList.right_inverse`` for a list whose originals may be placed."""
    from .simulate import simulation_for
    from .step_executable import any_pending_updates, flush_pending_updates

    cls_inverse = type(plist).right_inverse  # type: ignore[attr-defined]
    slots: dict[str, tuple[dict[str, Any], DTensor]] = {
        name: (entries, current)
        for entries in cast("tuple[dict[str, Any], ...]", (plist._parameters, plist._buffers))
        for name, current in entries.items()
        if name.startswith("original") and isinstance(current, DTensor)
    }
    if not slots:
        cls_inverse(plist, value)
        return
    if any_pending_updates():
        flush_pending_updates()
    stand_ins: dict[str, torch.Tensor] = {}
    for name, (entries, current) in slots.items():
        plain = torch.empty(current.shape, dtype=current.dtype)
        stand_ins[name] = (
            torch.nn.Parameter(plain, requires_grad=current.requires_grad)
            if isinstance(current, torch.nn.Parameter) else plain
        )
        entries[name] = stand_ins[name]
    try:
        cls_inverse(plist, value)
    finally:
        for name, (entries, current) in slots.items():
            entries[name] = current
    with simulation_for([current for _, current in slots.values()]) as sim, torch.no_grad():
        for name, (_, current) in slots.items():
            new = stand_ins[name]
            if tuple(new.shape) != tuple(current.shape):
                raise SPMDCompileError(
                    f"The parametrization's right_inverse returned a tensor of shape "
                    f"{tuple(new.shape)} for {name} of shape {tuple(current.shape)}, which a "
                    "compiled step placed across the ranks: a placed tensor keeps its shape "
                    "(NOTE: [assigning a parametrized tensor of a placed model]).",
                    hint="return a tensor of the original's shape from right_inverse, or "
                    "register the parametrization again on a model no compiled step has "
                    "placed (rebuild it from sc.checkpoint.full_state_dict).",
                )
            current.copy_(_placed_like(new, current, sim))


# NOTE: [data replaced between calls] (the setter's side: ``_torch_private.py``)
# ``w.data = value`` on a parameter or buffer a compiled step placed sets its local
# tensor (the one the programs read) to ``value``'s values, placed as ``w`` is, where
# ``value`` says exactly what they are: a DTensor on ``w``'s mesh of ``w``'s shape and
# dtype (``w.data.clamp(-c, c)``; under fsdp ``vector_to_parameters`` gives replicated
# slices of the flat vector, redistributed here to ``w``'s placements, no arithmetic),
# or a plain tensor of that shape and dtype, read as the whole value, the same on every
# rank, as ``load_state_dict`` reads one (NOTE: [loading plain tensors into a placed
# model]). The next call trains from it as eager does (the parameter object, its
# optimizer state and ``requires_grad`` stay). The new local tensor is a copy of its
# own: a placed tensor owns its memory (NOTE: [state tensors sharing memory]), so unlike
# eager a later in-place write to ``value`` does not reach ``w``; and a value that is
# another placed parameter's or buffer's memory (``m.l2.weight.data = m.l1.weight.data``,
# tying by memory) is refused naming both, as that aliasing is at the first call: a copy
# trained apart (l1 0.082 off eager after 3 calls, silently). Anything else (another
# shape, dtype, device or mesh: a placed tensor keeps them, the programs were built for
# them) is refused at the assignment, naming the tensor, with nothing changed. A write
# while a deferred update is pending is refused at the next call, as any write then is
# (NOTE: [writes between calls while an update is pending]).
def intercept_data_assignment(module: torch.nn.Module, attr: str, name: str, placed: DTensor) -> None:
    """Send ``placed.data = value`` (``placed`` held at ``module.<attr>``, a parameter or
    buffer of FQN ``name`` in the step) to ``_assign_data``; once per placement."""
    is_param = attr in module._parameters and module._parameters[attr] is placed
    private.intercept_other_data_assignment(_assign_state_data)
    private.intercept_data_assignment(
        placed, functools.partial(_assign_data, weakref.ref(module), attr, is_param, name)
    )


def _assign_data(
    module_ref: weakref.ref[torch.nn.Module], attr: str, is_param: bool, name: str,
    current: DTensor, value: torch.Tensor,
) -> bool:
    """``current.data = value`` (see the NOTE); False where ``current`` is held by no
    module a compiled step placed a tensor in (dropped, or a stale id: NOTE: [data
    replaced under another name]): torch's setter runs."""
    if not isinstance(value, torch.Tensor):  # torch's own error for a non-tensor
        return False
    module = module_ref()
    slots = None if module is None else (module._parameters if is_param else module._buffers)
    what = f"{'parameter' if is_param else 'buffer'} {name}"
    value = value.detach()
    if slots is None or slots.get(attr) is not current:  # NOTE: [data replaced under another name]
        held = _placed_slot_of(current, module)
        if held is None:
            return False
        what = held
    problem = _unrecoverable(current, value)
    other = _placed_owner_of_memory(value, current)
    if other is not None:  # NOTE: [data replaced between calls]: old-style tying
        raise SPMDCompileError(
            f"`.data = value` on {what} between calls of a compiled step: the value is the "
            f"memory of {other}, which a compiled step placed too (`a.weight.data = "
            "b.weight.data`, tying by memory). Eagerly the two would then share one "
            "memory; placed, each keeps its own, so they would train apart (NOTE: [state "
            "tensors sharing memory]). Nothing was changed.",
            hint="tie by assigning the Parameter itself before the first call "
            "(`m.l2.weight = m.l1.weight`), then compile; to copy the values only, "
            "`with torch.no_grad(): w.copy_(other)`.",
        )
    if problem is not None:
        raise SPMDCompileError(
            f"`.data = value` on {what} between calls of a compiled step: {problem}. A "
            f"compiled step placed {what} across the ranks with that shape, dtype and "
            "device, and its programs read it so; nothing was changed (NOTE: [data "
            "replaced between calls]).",
            hint="assign a value of the same shape and dtype (a plain tensor holding the "
            "whole value, or a DTensor on the same mesh), or write in place: "
            "`with torch.no_grad(): w.copy_(new)` or `w.data.copy_(new)`. To change a "
            "dtype or device, call `model.to(...)` / `model.double()`.",
        )
    _set_local_value(current, value)
    return True


# NOTE: [data replaced under another name]
# The sibling of NOTE: [data replaced between calls]: its callback knows the module slot
# the tensor was placed in, and took a tensor no longer there for a stale id (the tensor
# died, another DTensor got its address) and handed it to torch's setter, which ignores
# the value for a DTensor. But a placed parameter moves between names and keeps its
# identity: ``torch.nn.utils.prune`` registers ``weight`` as ``weight_orig``, and
# ``prune.remove`` sets ``orig.data = (orig * mask).data`` before registering it as
# ``weight`` again; the pruning was silently dropped (ddp, 2 simulated ranks: 0 zeros
# against eager's 64, call 2's loss 1.37491 against 1.38423, the weight 0.166 off after
# 4 calls; the same on 2 gloo ranks). The tensor is now looked for by identity, at the
# assignment only: in any slot of its module, then of every module a compiled step
# placed a tensor in; found, the value is taken or refused as in the NOTE above, naming
# the tensor by its name now. A tensor held by no such module cannot be told apart from
# a stale id, and keeps torch's setter (``p = m.weight; del m.weight; p.data = v``:
# README, Limitations); a stale id that is not held anywhere either keeps it, so an
# unplaced DTensor's ``.data =`` stays torch's whatever address it got.
def _placed_slot_of(current: DTensor, module: torch.nn.Module | None) -> str | None:
    """Where ``current`` is registered now, as "parameter <name>" / "buffer <name>",
    among the slots of ``module`` and of every module holding a placed tensor; None if
    in none (NOTE: [data replaced under another name])."""
    owners: list[tuple[torch.nn.Module, str]] = []
    for on_set in private.data_assignment_callbacks():
        if isinstance(on_set, functools.partial) and on_set.func is _assign_data:
            held_by, attr, _, name = on_set.args
            owner = held_by()
            if owner is not None:
                owners.append((owner, name[: -len(attr)] if name.endswith(attr) else ""))
    owners.sort(key=lambda entry: entry[0] is not module)  # the tensor's own module first
    seen: set[int] = set()
    for owner, prefix in owners:
        if id(owner) in seen:
            continue
        seen.add(id(owner))
        for kind, slots in (("parameter", owner._parameters), ("buffer", owner._buffers)):
            for attr, held in slots.items():
                if held is current:
                    return f"{kind} {prefix}{attr}"
    return None


def _set_local_value(current: DTensor, value: torch.Tensor) -> None:
    """Make ``value`` (checked by ``_unrecoverable``) ``current``'s value, in a local
    tensor of its own: a DTensor redistributed to ``current``'s placements, a plain
    tensor read as the whole value."""
    from .simulate import simulation_for

    with simulation_for([current]) as sim:
        placed: DTensor
        if isinstance(value, DTensor):
            placed = value
            if tuple(value.placements) != tuple(current.placements):
                placed = _in_ranks(sim, lambda: value.redistribute(current.device_mesh, current.placements))
        else:
            placed = _placed_like(value, current, sim)
        local = private.local_tensor_of(placed)
        private.set_local_tensor(current, _in_ranks(sim, lambda: local.clone(memory_format=torch.contiguous_format)))


# NOTE: [data replaced on gradients and optimizer state]
# ``p.grad.data = p.grad.data * 0.5`` or ``opt.state[p]["exp_avg"].data = ...`` between
# calls (the sibling of NOTE: [data replaced between calls]): after a compiled call a
# placed parameter's ``.grad`` and its optimizer's state tensors are DTensors too, and
# torch's setter swapped the wrapper but not the local shard the programs read: the
# assignment was silently ignored (Adam, fsdp, 2 simulated ranks: losses 1.3708 /
# 0.8487 against eager's 1.1729 / 0.8145, parameters 0.25 off). A DTensor no placement
# registered is looked for, at the assignment only (nothing per call), among the
# gradients of the parameters and the state of the optimizers compiled steps placed;
# found, the value is taken as for a parameter (same shape, dtype, device and mesh,
# redistributed to the tensor's placements; a plain tensor is the whole value), or
# refused at the assignment, naming the tensor, with nothing changed; while a deferred
# update is pending, the next call refuses it as any write then (NOTE: [writes between
# calls while an update is pending]). Any other DTensor keeps torch's setter.
def _state_owner(current: DTensor) -> str | None:
    """What ``current`` is, if it is the gradient of a parameter or a state tensor of an
    optimizer a compiled step placed: "the .grad of parameter a.weight", "optimizer
    state 'exp_avg' of parameter a.weight"."""
    for opt in list(_FLUSHING):
        for gi, group in enumerate(opt.param_groups):
            for pi, p in enumerate(group["params"]):
                registered = private.data_assignment_callback(p)
                where = (
                    f"parameter {registered.args[-1]}" if isinstance(registered, functools.partial)
                    else f"param_groups[{gi}]['params'][{pi}] of {type(opt).__name__}"
                )
                if p.grad is current:
                    return f"the .grad of {where}"
                for key, value in opt.state.get(p, {}).items():
                    if value is current:
                        return f"optimizer state {key!r} of {where}"
    return None


def _assign_state_data(current: DTensor, value: torch.Tensor) -> bool:
    """``current.data = value`` where ``current`` is a gradient or optimizer state
    tensor of a placed model (NOTE: [data replaced on gradients and optimizer state]);
    False for any other DTensor (torch's setter runs)."""
    if not isinstance(value, torch.Tensor) or not _FLUSHING:
        return False
    what = _state_owner(current)
    if what is None:
        return False
    value = value.detach()
    problem = _unrecoverable(current, value)
    if problem is not None:
        raise SPMDCompileError(
            f"`.data = value` on {what} between calls of a compiled step: {problem}. A "
            "compiled step placed it across the ranks with that shape, dtype and device; "
            "nothing was changed (NOTE: [data replaced on gradients and optimizer state]).",
            hint="assign a value of the same shape and dtype, write in place "
            "(`t.data.mul_(0.5)`, `t.copy_(new)` under `torch.no_grad()`), or assign the "
            "entry itself (`p.grad = new`, `opt.state[p][key] = new`).",
        )
    _set_local_value(current, value)
    return True


def _storage_of(t: torch.Tensor) -> tuple[tuple[str, int], ...] | None:
    """Where ``t``'s local values live: (device, storage address) of its local tensor, of
    each rank's under ``sc.simulate``; None where it has no plain storage."""
    local = private.local_tensor_of(t) if isinstance(t, DTensor) else t
    locals_ = (
        list(private.per_rank_tensors(local).values())
        if isinstance(local, private.local_tensor_type()) else [local]
    )
    try:
        found = tuple((str(x.device), x.untyped_storage().data_ptr()) for x in locals_)
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):  # no plain storage
        return None
    return found if found and all(ptr for _, ptr in found) else None


def _placed_owner_of_memory(value: torch.Tensor, current: DTensor) -> str | None:
    """The parameter or buffer (another than ``current``) a compiled step placed whose
    local memory ``value``'s is, as "parameter <name>" / "buffer <name>"; None if none."""
    memory = _storage_of(value)
    if memory is None or memory == _storage_of(current):
        return None
    return _placed_name_of_memory(value, current)


def _placed_name_of_memory(t: torch.Tensor, current: DTensor | None = None) -> str | None:
    """The parameter or buffer (another than ``current``) a compiled step placed whose
    local memory ``t``'s is (``t`` itself or a view of it), as "parameter <name>" /
    "buffer <name>"; None if none (NOTE: [writes into a redistributed part of a placed
    tensor])."""
    memory = _storage_of(t)
    if memory is None:
        return None
    for on_set in private.data_assignment_callbacks():
        if not isinstance(on_set, functools.partial) or on_set.func is not _assign_data:
            continue
        module_ref, attr, is_param, name = on_set.args
        module = module_ref()
        held = None if module is None else (module._parameters if is_param else module._buffers).get(attr)
        if isinstance(held, DTensor) and held is not current and _storage_of(held) == memory:
            return f"{'parameter' if is_param else 'buffer'} {name}"
    return None


def _unrecoverable(current: DTensor, value: torch.Tensor) -> str | None:
    """Why ``value`` cannot be taken as ``current``'s new value exactly, or None."""
    if tuple(value.shape) != tuple(current.shape):
        return f"the value has shape {tuple(value.shape)}, the tensor {tuple(current.shape)}"
    if value.dtype != current.dtype:
        return f"the value has dtype {value.dtype}, the tensor {current.dtype}"
    if value.device.type != current.device.type:
        return f"the value is on {value.device.type}, the tensor on {current.device.type}"
    if isinstance(value, DTensor) and value.device_mesh != current.device_mesh:
        return f"the value is a DTensor on {value.device_mesh}, the tensor on {current.device_mesh}"
    return None


def _in_ranks(sim: Any, fn: Callable[[], Any]) -> Any:
    if sim is None:
        return fn()
    with sim.ranks():
        return fn()


def _is_parametrization_list(module: torch.nn.Module) -> bool:
    from torch.nn.utils.parametrize import ParametrizationList

    return isinstance(module, ParametrizationList)


def _plain(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and not isinstance(value, DTensor)


# NOTE: [writes into a redistributed part of a placed tensor]: installed at import, before
# any DTensor op ran: torch's C++ dispatch keeps the Python functions it calls back from
# their first use, so a later install would not be seen
private.refuse_writes_into_redistributed_parts(_placed_name_of_memory)
prune_placed_on_full_values()  # NOTE: [pruning placed parameters]


_GUARDED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
_LOADING: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def place_loaded_state(modules: list[torch.nn.Module]) -> None:
    """Install ``place_loaded_tensors`` on every submodule of ``modules``, and
    ``_placed_right_inverse`` on each parametrization list among them, once."""
    for mod in modules:
        for sub in mod.modules():
            if sub not in _LOADING:
                sub.register_load_state_dict_pre_hook(place_loaded_tensors)
                if _is_parametrization_list(sub):
                    # NOTE: [assigning a parametrized tensor of a placed model]
                    object.__setattr__(sub, "right_inverse", functools.partial(_placed_right_inverse, sub))
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


__all__ = [
    "flush_before_loads",
    "guard_direct_calls",
    "intercept_data_assignment",
    "place_loaded_state",
    "refuse_plain_inputs",
]
