"""Find the modules, optimizers and tensors a train step is called with.

The train step is called with the user's objects. Before anything is traced we walk its
arguments (pytree leaves; modules and optimizers are leaves) and name every piece of
training state: parameters and buffers by FQN, optimizer state by (parameter FQN, key),
learning rates by (optimizer, param group).

NOTE: [parameters replaced by DTensors]
The first compiled call replaces each parameter of the model with a DTensor
``nn.Parameter`` and points the optimizers it was given at the new ones. An optimizer
that call was not given (a compiled evaluation step before the first train step, NOTE:
[steps without an optimizer]) still holds the old parameters; the replacement is
recorded here (weakly: an old parameter nobody holds is forgotten), and a later call that
is given that optimizer points it at the new parameters, moving its state with them,
exactly as the first call would have.
"""

from __future__ import annotations

import functools
import weakref
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .. import _torch_private as private
from .._torch_private import pytree
from ..errors import SPMDCompileError
from ..ir.signature import Kind, StateRef, optim_state_dtype
from .containers import open_containers
from .grad_scalers import find_scalers, scaler_key, scaler_state
from .lr_schedulers import find_schedulers

# id(old parameter) -> (a weak reference to it, the DTensor parameter that replaced it);
# an entry goes when its old parameter is freed
_REPLACED: dict[int, tuple[weakref.ref, torch.nn.Parameter]] = {}


def record_replacement(old: torch.Tensor, new: torch.nn.Parameter) -> None:
    """``new`` replaced ``old`` in its module (NOTE: [parameters replaced by DTensors])."""
    _REPLACED[id(old)] = (weakref.ref(old), new)
    weakref.finalize(old, _REPLACED.pop, id(old), None)


# state tensors a placement replaced (parameters and buffers), weakly: a plain attribute
# that still aliases one must not be read as a constant (NOTE: [tensors read from outside
# the arguments])
_PLACED_AWAY: dict[int, weakref.ref] = {}


def record_placed_away(old: torch.Tensor) -> None:
    _PLACED_AWAY[id(old)] = weakref.ref(old)
    weakref.finalize(old, _PLACED_AWAY.pop, id(old), None)


def aliases_state(t: torch.Tensor, bindings: StepBindings) -> str | None:
    """The name of the parameter or buffer of ``bindings`` that ``t`` is, or shares
    storage with, or that a placement replaced; None when it is none of these."""
    if isinstance(t, torch.nn.Parameter):
        return "a parameter"
    placed = _PLACED_AWAY.get(id(t))
    if placed is not None and placed() is t:
        return "a parameter or buffer the compiled step placed"
    pointer = _storage(t)
    for name, state in (*bindings.params.items(), *bindings.buffers.items()):
        if state is t or (pointer and _storage(state) == pointer):
            return name
    return None


def _storage(t: torch.Tensor) -> int:
    try:
        local = private.local_tensor_of(t) if isinstance(t, DTensor) else t
        return local.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # fake, meta or simulated per-rank tensors
        return 0


def _replacement(p: torch.Tensor) -> torch.nn.Parameter | None:
    entry = _REPLACED.get(id(p))
    return entry[1] if entry is not None and entry[0]() is p else None


def _unowned(opt: torch.optim.Optimizer, owned: set[int]) -> tuple[int, torch.Tensor] | None:
    """The first (param group, parameter) of ``opt`` that the step's modules do not own."""
    for gi, group in enumerate(opt.param_groups):
        for p in group["params"]:
            if id(p) not in owned:
                return gi, p
    return None


def _follow_replacements(opt: torch.optim.Optimizer, owned: set[int]) -> None:
    """Point ``opt`` at the parameters that replaced its own, where the modules own those."""
    moved = {}
    for group in opt.param_groups:
        for i, p in enumerate(group["params"]):
            new = _replacement(p) if id(p) not in owned else None
            if new is not None and id(new) in owned:
                group["params"][i] = moved[id(p)] = new
    if moved:
        opt.state = defaultdict(
            dict, {moved.get(id(p), p): entries for p, entries in opt.state.items()}
        )


# Hyper-parameters fed to the graph as tensors each step (so schedulers never recompile).
TENSOR_HYPERPARAMS = ("lr",)


@dataclass
class StepBindings:
    """The user's objects a train step touches, and the name of every state tensor."""

    modules: list[torch.nn.Module]
    optimizers: list[torch.optim.Optimizer]
    params: dict[str, torch.nn.Parameter]
    buffers: dict[str, torch.Tensor]
    # per module: FQN within the module -> name in ``params`` / ``buffers``
    module_params: list[dict[str, str]]
    module_buffers: list[dict[str, str]]
    flat_args: list[Any]
    args_spec: pytree.TreeSpec
    # the call's own (args, kwargs): where a step's writes into a dict or list argument
    # land (NOTE: [tensors the step keeps])
    call: tuple[tuple, dict] = field(default=((), {}), repr=False)
    # the torch.amp.GradScalers the step names (NOTE: [loss scaling in the program])
    scalers: list[Any] = field(default_factory=list)
    # the LR schedulers it names (NOTE: [schedulers stepped in the step])
    schedulers: list[Any] = field(default_factory=list)
    # the batch containers pytree does not open, in pytree order (NOTE: [batch containers])
    containers: list[Any] = field(default_factory=list)
    # every submodule of ``modules``, as their walk meets them (repeats included): whose
    # training flags the program key reads
    submodules: list[torch.nn.Module] = field(default_factory=list, repr=False)
    _name_of: dict[int, str] = field(default_factory=dict, repr=False)
    # (optimizer, parameter name) -> that parameter's state dict, as the program key last
    # read it (NOTE: [one walk over the state per call])
    _state_dicts: dict[tuple[int, str], dict] = field(default_factory=dict, repr=False)

    @functools.cached_property
    def module_fqns(self) -> dict[int, str]:
        """id(submodule) -> display FQN (computed when a compile needs it, not per step)."""
        fqns: dict[int, str] = {}
        for mi, mod in enumerate(self.modules):
            prefix = "" if len(self.modules) == 1 else f"{mi}."
            for fqn, sub in mod.named_modules():
                fqns.setdefault(id(sub), (prefix + fqn).rstrip("."))
        return fqns

    def param_name(self, p: torch.Tensor) -> str:
        """The name of parameter ``p`` (by identity; O(1) per call, the table is rebuilt
        when parameters were replaced, e.g. by the runtime installing DTensors)."""
        name = self._name_of.get(id(p))
        if name is None or self.params.get(name) is not p:
            self._name_of = {id(q): n for n, q in self.params.items()}
            name = self._name_of.get(id(p))
            if name is None:
                raise KeyError("parameter not found")
        return name

    def optim_state(self, optimizer: int, name: str) -> dict[str, Any]:
        """Optimizer ``optimizer``'s state dict of parameter ``name``: the one the last
        ``static_key`` read (NOTE: [one walk over the state per call]), else looked up."""
        state = self._state_dicts.get((optimizer, name))
        if state is None:
            state = self.optimizers[optimizer].state[self.params[name]]
        return state

    def forget_state_dicts(self) -> None:
        """The optimizers' state dicts were replaced (``runtime.runner.install_state``)."""
        self._state_dicts = {}

    def tensor_args(self) -> list[tuple[int, torch.Tensor]]:
        return [(i, a) for i, a in enumerate(self.flat_args) if isinstance(a, torch.Tensor)]

    def state_refs(self) -> list[tuple[StateRef, torch.Tensor]]:
        """Every tensor of training state, in a fixed order, with its current value."""
        refs: list[tuple[StateRef, torch.Tensor]] = []
        refs += [(StateRef(Kind.PARAM, n), p) for n, p in self.params.items()]
        refs += [(StateRef(Kind.BUFFER, n), b) for n, b in self.buffers.items()]
        refs += [
            (StateRef(Kind.GRAD, n), p.grad) for n, p in self.params.items() if p.grad is not None
        ]
        for oi, opt in enumerate(self.optimizers):
            for gi, group in enumerate(opt.param_groups):
                for p in group["params"]:
                    name = self.param_name(p)
                    for key, value in sorted(opt.state.get(p, {}).items()):
                        if isinstance(value, torch.Tensor):
                            refs.append(
                                (StateRef(Kind.OPTIM_STATE, name, key, oi, gi), value)
                            )
        if self.scalers:
            refs += scaler_state(self.scalers, next(iter(self.params.values())).device)
        return refs

    def hyperparam_refs(self) -> list[StateRef]:
        return [
            StateRef(Kind.HYPERPARAM, key=key, optimizer=oi, group=gi)
            for oi, opt in enumerate(self.optimizers)
            for gi, _ in enumerate(opt.param_groups)
            for key in TENSOR_HYPERPARAMS
        ]

    def hyperparam_value(self, ref: StateRef) -> float:
        if ref.optimizer < 0:  # a float argument of the step (capture.float_argument_ref)
            return float(self.flat_args[ref.index])
        value = self.optimizers[ref.optimizer].param_groups[ref.group][ref.key]
        return float(value)

    def optimizer_settings(self) -> dict[str, Any]:
        """The optimizer hyper-parameters that are constants of a program (all but the
        learning rate), by name: ``optimizer[0].param_groups[0]['betas']``."""
        return {
            f"optimizer[{oi}].param_groups[{gi}][{k!r}]": _hashable(v)
            for oi, opt in enumerate(self.optimizers)
            for gi, group in enumerate(opt.param_groups)
            for k, v in group.items()
            if k != "params" and k not in TENSOR_HYPERPARAMS and k != "initial_lr"
        }

    def static_key(self, memo: StateKeyMemo | None = None) -> tuple:
        """Everything besides tensor shapes that a compiled program depends on.

        Training flags, optimizer hyper-parameters other than the learning rate, the set
        and non-tensor values of optimizer state, which parameters hold a gradient, and
        the non-tensor arguments of the step. A change to any recompiles the step.
        ``memo`` (kept by the caller across calls) holds each state dict's part of the
        key while the dict holds the same tensors (``StateKeyMemo``).
        """
        key: list[Any] = [self.args_spec]
        # Float arguments: graph inputs or guards (NOTE: [guards on Python values]).
        key += [a if not isinstance(a, (torch.Tensor, torch.nn.Module, torch.optim.Optimizer, float))
                or type(a) is bool else type(a).__name__ for a in self.flat_args]
        # by name, at a known place: api._key_change names the one that changed
        key.append(tuple(self.optimizer_settings().items()))
        key.append(tuple([m.training for m in self.submodules]))
        from .. import _torch_private as private

        # and whether a hook sits on the parameter (refused at compile: NOTE: [hooks on
        # parameters] in ``api.py``), read at a plain tensor's cost
        with private.plain_attribute_reads():
            has_hooks = private.has_tensor_hooks
            key += [(n, tuple(p.shape), p.dtype, p.grad is not None, p.requires_grad, has_hooks(p))
                    for n, p in self.params.items()]
        key += [(n, tuple(b.shape), b.dtype) for n, b in self.buffers.items()]
        # the walk that reads the state's metadata keeps each state dict for feeding and
        # write-back (NOTE: [one walk over the state per call])
        state_dicts = self._state_dicts = {}
        if memo is not None:
            memo.start()
        for oi, opt in enumerate(self.optimizers):
            states = opt.state
            for gi, group in enumerate(opt.param_groups):
                key.append(("group", oi, gi))
                # which parameters the group holds (moving one to another group changes
                # its learning rate in the program) and the set of its state
                for p in group["params"]:
                    name = self.param_name(p)
                    state = states.get(p)
                    if not state:
                        key.append((name, ()))
                        continue
                    state_dicts[oi, name] = state
                    part = memo.get(state) if memo is not None else None
                    if part is None:
                        part = tuple([(k, _state_hashable(state[k])) for k in sorted(state)])
                        if memo is not None:
                            memo.put(state, part)
                    key.append((name, part))
        if self.scalers:
            key.append(scaler_key(self.scalers))
        return tuple(key)


class StateKeyMemo:
    """Each optimizer state dict's part of ``static_key`` (its keys, and each tensor's shape
    and dtype as the program sees them), kept from one call to the next while the dict
    holds the same tensor objects under the same keys: an 8-layer GPT has 375 state
    tensors, and reading each one's shape and dtype every call was a quarter of the
    step's host work (NOTE: [one walk over the state per call] in ``runtime/runner.py``).

    The runtime changes state only by swapping a DTensor's local tensor, which keeps its
    shape and dtype; a new tensor (a loaded checkpoint, a new optimizer) is another
    object and reads afresh. Tensors are held weakly, so the memo keeps no state alive,
    and only the dicts of the latest call are kept. A dict holding anything but tensors
    is read every call.
    """

    def __init__(self) -> None:
        # id(state dict) -> (its keys, weak references to its values, its part of the key)
        self._entries: dict[int, tuple[tuple[str, ...], tuple[weakref.ref, ...], tuple]] = {}
        self._previous: dict[int, tuple[tuple[str, ...], tuple[weakref.ref, ...], tuple]] = {}

    def start(self) -> None:
        """Begin a call's walk: what the last call kept is looked up, this call's kept."""
        self._previous, self._entries = self._entries, {}

    def get(self, state: dict[str, Any]) -> tuple | None:
        entry = self._previous.get(id(state))
        if entry is None:
            return None
        keys, refs, part = entry
        if len(state) != len(keys):
            return None
        for k, ref in zip(keys, refs):
            held = ref()
            if held is None or state.get(k) is not held:
                return None
        self._entries[id(state)] = entry
        return part

    def put(self, state: dict[str, Any], part: tuple) -> None:
        values = tuple(state.values())
        if all(isinstance(v, torch.Tensor) for v in values):
            self._entries[id(state)] = (tuple(state), tuple(weakref.ref(v) for v in values), part)


def _state_hashable(v: Any) -> Any:
    """Optimizer state as the program sees it: a float32 step counter created eagerly
    (warm-up step, loaded checkpoint) is float64 once installed, the same program
    (``state_dtype``; this runs for every state tensor on every call, so no TensorMeta)."""
    if isinstance(v, torch.Tensor):
        shape = tuple(v.shape)  # a tuple: the compile cache's key describes tuples
        return ("tensor", shape, optim_state_dtype(shape, v.dtype))
    return _hashable(v)


def _hashable(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return ("tensor", tuple(v.shape), v.dtype)
    if isinstance(v, (list, tuple)):
        return tuple(_hashable(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((k, _hashable(x)) for k, x in v.items()))
    return v


def _is_leaf(x: Any) -> bool:
    return isinstance(x, (torch.nn.Module, torch.optim.Optimizer))


def find_bindings(func: Callable[..., Any], args: tuple, kwargs: dict) -> StepBindings:
    """Name the modules, optimizers and state of a train-step call.

    Raises:
        SPMDCompileError: no module, or an optimizer parameter that no module passed
            to the step owns. A step without an optimizer (an evaluation step, or one
            that only accumulates gradients) is a program too: NOTE: [steps without an
            optimizer] in ``capture/trace.py``.
    """
    containers: list[Any] = []  # NOTE: [batch containers]
    flat_args, spec = pytree.tree_flatten(open_containers((args, kwargs), _is_leaf, containers), is_leaf=_is_leaf)
    modules = _unique([a for a in flat_args if isinstance(a, torch.nn.Module)])
    optimizers = _unique([a for a in flat_args if isinstance(a, torch.optim.Optimizer)])
    where = f"{func.__code__.co_filename}:{func.__code__.co_firstlineno} ({func.__name__})"
    if not modules:
        raise SPMDCompileError(
            "The train step was called without an nn.Module argument.",
            user_line=where,
            hint="pass the model to the step, e.g. train_step(model, optimizer, batch, target).",
        )
    params: dict[str, torch.nn.Parameter] = {}
    buffers: dict[str, torch.Tensor] = {}
    module_params: list[dict[str, str]] = []
    module_buffers: list[dict[str, str]] = []
    seen: dict[int, str] = {}
    submodules: list[torch.nn.Module] = []
    for mi, mod in enumerate(modules):
        prefix = "" if len(modules) == 1 else f"{mi}."
        mp: dict[str, str] = {}
        mb: dict[str, str] = {}
        # one walk for parameters, buffers and (in static_key) training flags, in the
        # order named_parameters / named_buffers(remove_duplicate=False) give
        for path, sub in mod.named_modules(remove_duplicate=False):
            submodules.append(sub)
            dot = path + "." if path else ""
            for attr, p in sub._parameters.items():
                if p is not None:
                    name = seen.setdefault(id(p), prefix + dot + attr)
                    params[name] = p
                    mp[dot + attr] = name
            for attr, b in sub._buffers.items():
                if b is not None:
                    mb[dot + attr] = name = seen.setdefault(id(b), prefix + dot + attr)
                    buffers[name] = b
        module_params.append(mp)
        module_buffers.append(mb)
    owned = {id(p) for p in params.values()}
    for oi, opt in enumerate(optimizers):
        stray = _unowned(opt, owned)
        if stray is not None:  # replaced by a call this optimizer was not given?
            _follow_replacements(opt, owned)
            stray = _unowned(opt, owned)
        if stray is not None:
            gi, p = stray
            raise SPMDCompileError(
                f"optimizer[{oi}].param_groups[{gi}] holds a parameter of shape "
                f"{tuple(p.shape)} that no module passed to the step owns.",
                user_line=where,
                hint="pass every module whose parameters the optimizer updates.",
            )
    return StepBindings(
        modules, optimizers, params, buffers, module_params, module_buffers, flat_args, spec,
        (args, kwargs), _unique(find_scalers(func, flat_args)),
        _unique(find_schedulers(func, flat_args)), containers, submodules,
    )


def check_plain_modules(modules: list[torch.nn.Module], where: str) -> None:
    """Refuse a module torch's FSDP already shards or torch.compile compiles: a traced
    step fails inside their hooks or dynamo frames with errors about their internals.
    (A ``DistributedDataParallel`` wrapper traces as its module: its reducer's hooks sit
    on the real parameters, which the trace swaps out; measured exact on 2 gloo ranks.)"""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    from .. import _torch_private as private

    wrappers = [
        ((FSDPModule, FullyShardedDataParallel), "sharded by torch's fully_shard / FSDP "
         "({cls})", "pass the model before fully_shard; DataParallel('fully_shard') "
         "shards it"),
        ((private.compiled_module_type(),), "compiled with torch.compile ({cls})",
         "pass the module before torch.compile (`model._orig_mod`); "
         "sc.compile(..., backend=\"inductor\") lowers the whole step to kernels"),
    ]
    for mi, mod in enumerate(modules):
        for fqn, sub in mod.named_modules():
            for classes, what, hint in wrappers:
                if isinstance(sub, classes):
                    name = f"module[{mi}]" + (f".{fqn}" if fqn else "")
                    raise SPMDCompileError(
                        f"{name} is {what.format(cls=type(sub).__name__)}; a compiled step "
                        "takes plain modules and places their state itself.",
                        user_line=where,
                        hint=hint + ".",
                    )


def _unique(objs: list[Any]) -> list[Any]:
    out: list[Any] = []
    for o in objs:
        if all(o is not x for x in out):
            out.append(o)
    return out
