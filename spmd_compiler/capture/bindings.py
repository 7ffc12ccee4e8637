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
import inspect
import operator
import weakref
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .. import _torch_private as private
from .._torch_private import pytree
from ..errors import SourceLocation, SPMDCompileError, SPMDRuntimeError
from ..ir.signature import Kind, StateRef, optim_state_dtype
from .code_names import modules_read_by_name, reachable_by_name, step_name, step_where
from .containers import open_containers
from .forwarding_optimizers import inner_optimizers
from .grad_scalers import find_scalers, scaler_key, scaler_state
from .lr_schedulers import find_schedulers
from .meta_templates import is_meta_template, template_tensors
from .plain_objects import keyed_by_class


@dataclass(frozen=True)
class ShownName:
    """A parameter's name as the user knows it: its FQN in its module and, where the step
    trains several modules, which one (the step's argument that is it, "`ema`", else its
    class). Not the internal ``"<module index>.<FQN>"`` of ``StepBindings.params``,
    which no name in the user's code matches ("parameter 1.0.weight" for an EMA
    module passed second, before the sixty-ninth session)."""

    fqn: str
    module: str = ""  # "" where the step trains one module
    argument: str = ""  # the step's argument that is the module ("" where none is)

    def __str__(self) -> str:
        return f"{self.fqn!r} of {self.module}" if self.module else repr(self.fqn)

    @property
    def holder(self) -> str:
        """How the step's code names the module (its argument; ``model`` where none is)."""
        return self.argument or "model"

    def expression(self) -> str:
        """The parameter as the step's code reaches it: ``ema.emb.weight``, or
        ``model.get_parameter('0.weight')`` where the FQN is no attribute path."""
        if all(part.isidentifier() for part in self.fqn.split(".")):
            return f"{self.holder}.{self.fqn}"
        return f"{self.holder}.get_parameter({self.fqn!r})"


# id(old parameter) -> (a weak reference to it, the DTensor parameter that replaced it);
# an entry goes when its old parameter is freed
_REPLACED: dict[int, tuple[weakref.ref, torch.nn.Parameter]] = {}
# old parameters replaced during the current call, retired when it ends, with their names
_TO_RETIRE: list[tuple[weakref.ref, ShownName | None]] = []


def record_replacement(old: torch.Tensor, new: torch.nn.Parameter, name: ShownName | None = None) -> None:
    """``new`` replaced ``old`` in its module (NOTE: [parameters replaced by DTensors])."""
    _REPLACED[id(old)] = (weakref.ref(old), new)
    weakref.finalize(old, _REPLACED.pop, id(old), None)
    if type(old) is torch.nn.Parameter:
        _TO_RETIRE.append((weakref.ref(old), name))


def parameters_held(value: Any, identities: dict[int, str], whole: bool) -> tuple[str, str] | None:
    """(what ``value`` is, the name of the parameter) where ``value`` holds one of the
    step's parameters (``identities``: ``parameter_identities``) as a set member or a
    dict key, or the id of one anywhere (NOTE: [parameters held for lookups] in
    ``capture/held_parameters.py``); with ``whole``, in what it holds too (a container
    of plain values, which the guards' walk does not go into)."""
    cls = type(value)
    if cls is int:
        name = identities.get(value)
        return None if name is None else ("the id of a parameter", name)
    if cls in _NOT_HOLDING:  # most values the walk meets: at once
        return None
    if isinstance(value, (set, frozenset)):  # read past a subclass's methods
        keys: Any = set.__iter__(value) if isinstance(value, set) else frozenset.__iter__(value)
        items: Any = ()
    elif isinstance(value, dict):
        keys, items = dict.keys(value), dict.values(value)
    elif isinstance(value, (list, tuple)):
        keys, items = (), list.__iter__(value) if isinstance(value, list) else tuple.__iter__(value)
    else:
        return None
    held = None
    for key in keys:
        if isinstance(key, torch.Tensor) and (name := identities.get(id(key))) is not None:
            return ("a dict keyed by parameters" if isinstance(value, dict) else "a set of parameters"), name
        held = held or _id_held(key, identities, whole)
    for item in items:
        held = held or _id_held(item, identities, whole)
    return held


_NOT_HOLDING = frozenset({float, bool, str, bytes, complex, type(None), torch.dtype, torch.device})


def _id_held(item: Any, identities: dict[int, str], whole: bool) -> tuple[str, str] | None:
    if type(item) is int:
        name = identities.get(item)
        return None if name is None else ("ids of parameters", name)
    if whole and type(item) not in _NOT_HOLDING and not isinstance(item, torch.Tensor):
        return parameters_held(item, identities, True)
    return None


def parameter_identities(bindings: StepBindings) -> dict[int, str]:
    """id -> name (``bindings.params``' or ``buffers``' key) of every object that is one
    of the step's parameters (or buffers) to the user: the modules' and, where a compiled
    call replaced them, the old objects code may still hold (NOTE: [parameters held for
    lookups] in ``capture/held_parameters.py``)."""
    names = {id(t): name for name, t in (*bindings.params.items(), *bindings.buffers.items())}
    for old_id, (ref, new) in list(_REPLACED.items()):
        name = names.get(id(new))
        if name is not None and ref() is not None:
            names.setdefault(old_id, name)
    return names


def forget_replacement(old: torch.Tensor) -> None:
    """``old`` is back in its module (NOTE: [a failed first call leaves the model as it
    was] in runtime/runner.py): not replaced, not placed away, not to be retired."""
    entry = _REPLACED.get(id(old))
    if entry is not None and entry[0]() is old:
        del _REPLACED[id(old)]
    placed = _PLACED_AWAY.get(id(old))
    if placed is not None and placed() is old:
        del _PLACED_AWAY[id(old)]
    _TO_RETIRE[:] = [(ref, name) for ref, name in _TO_RETIRE if ref() is not old]


# NOTE: [replaced parameters held outside the step]
# Code that holds the model's parameters from before the first compiled call (an
# optimizer that call was not given, stepped eagerly after a compiled backward-only step;
# a ``params = list(model.parameters())`` handed to ``clip_grad_norm_`` between a compiled
# backward and a compiled update) held parameters no program reads or writes: their
# ``.grad`` stayed None, so the eager update and the clip did nothing, silently (a
# model that did not train in 3 steps; a clip that left the update 133x too large). When
# the call that replaced them ends, such an old parameter becomes a
# ``ReplacedParameter``: reading or setting its ``.grad`` reaches its replacement's (the
# clip, and an eager ``zero_grad``, act on the gradients the program left, as eagerly),
# and any other use (an eager optimizer's update, reading its values) raises an error
# naming the parameter and what to do. Only plain ``nn.Parameter`` objects are retired.
class ReplacedParameter(torch.nn.Parameter):
    """A parameter a compiled call replaced by a DTensor parameter (see the NOTE)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        old = args[0] if args else None
        if func is torch.Tensor.__hash__:
            return id(old)
        new = _replacement(old) if isinstance(old, ReplacedParameter) else None
        on_grad = getattr(func, "__self__", None) is _GRAD  # the ``.grad`` descriptor's methods
        if new is not None and on_grad and func.__name__ == "__get__":
            return new.grad
        if new is not None and on_grad and func.__name__ == "__set__":
            new.grad = args[1]
            return None
        if func is torch.Tensor.__repr__:
            return f"ReplacedParameter({_retired_name(old) or '?'}: replaced by a DTensor parameter)"
        if reads_metadata(func):  # counting parameters, say: harmless
            return super().__torch_function__(func, types, args, kwargs)
        name = _retired_name(old) or "a parameter"
        if sets_requires_grad(func):
            # the Spinning Up freeze (``for p in q_params: p.requires_grad = False``)
            raise SPMDRuntimeError(
                f"{name} was replaced by a DTensor parameter at the first compiled call, and "
                "this code sets requires_grad on the old one, held from before that call "
                "(a list of parameters): it would freeze nothing the compiled program "
                f"trains. {freeze_hint(_RETIRED_NAMES.get(id(old)))}"
            )
        raise SPMDRuntimeError(
            f"{name} was replaced by a DTensor parameter at the first compiled call, and "
            f"this code still holds the old one ({getattr(func, '__name__', func)} on it): "
            "the compiled program neither reads nor updates it. Take the parameters from "
            "model.parameters() after the first compiled call, and give the optimizer to a "
            "compiled step (it is then pointed at the new parameters) instead of stepping "
            "it eagerly."
        )


_RETIRED_NAMES: dict[int, ShownName] = {}  # id(old parameter) -> its name in the model


def _retired_name(old: Any) -> str:
    shown = _RETIRED_NAMES.get(id(old))
    return f"parameter {shown}" if shown is not None else ""


def freeze_hint(name: ShownName | None) -> str:
    """What to write instead of setting ``requires_grad`` on a held parameter ``name``:
    the module that holds it, set in the step (NOTE: [requires_grad set in the step])."""
    where = "the module that holds it"
    if name is not None:
        owner, model = name.fqn.rpartition(".")[0], name.module or "the model"
        where += f" ({owner!r} in {model})" if owner else f" ({model} itself)"
    return (
        f"Set it through {where}, inside the step: `ac.q.requires_grad_(False)` before "
        "the loss that must not train it and `ac.q.requires_grad_(True)` after that "
        "loss's backward (for a critic ac.q; or `for p in ac.q.parameters(): "
        "p.requires_grad = False`), which compiles and computes as eager does."
    )


# what an old parameter still answers: its metadata, the same as its replacement's global
# metadata (not a setter: ``p.requires_grad = False`` on it would freeze nothing; nor
# ``data_ptr()``, which names memory that is not the program's: an old parameter's is no
# longer its module's, a stand-in has none)
_METADATA = frozenset({
    "shape", "dtype", "device", "requires_grad", "is_leaf", "ndim", "layout", "numel", "dim",
    "size", "nelement", "element_size", "is_floating_point", "is_complex", "__len__",
    # layout and kind reads, as ``shape`` (a review of the sixty-ninth session found
    # ``held[0].stride()`` refused as a use)
    "stride", "is_contiguous", "storage_offset", "names", "nbytes", "itemsize", "is_cuda",
    "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_nested", "is_signed", "get_device",
})
_GRAD: Any = torch.Tensor.grad  # the descriptor
_REQUIRES_GRAD: Any = torch.Tensor.requires_grad  # the descriptor


def reads_metadata(func: Any) -> bool:
    """``func`` (as ``__torch_function__`` gets it) reads a tensor's metadata only
    (``p.shape``, ``p.numel()``, ``p.requires_grad``)."""
    read = getattr(func, "__self__", None) if getattr(func, "__name__", None) == "__get__" else func
    return getattr(read, "__name__", None) in _METADATA


def sets_requires_grad(func: Any) -> bool:
    """``func`` is ``t.requires_grad = flag`` or ``t.requires_grad_(flag)``."""
    name = getattr(func, "__name__", None)
    return name == "requires_grad_" or (name == "__set__" and getattr(func, "__self__", None) is _REQUIRES_GRAD)


def replacement_of(p: torch.Tensor) -> torch.nn.Parameter | None:
    """The DTensor parameter that replaced ``p`` (a ``ReplacedParameter``), or None."""
    return _replacement(p) if isinstance(p, ReplacedParameter) else None


def retire_replaced_parameters() -> None:
    """Turn the old parameters replaced during this call into ``ReplacedParameter``s
    (NOTE: [replaced parameters held outside the step])."""
    while _TO_RETIRE:
        ref, name = _TO_RETIRE.pop()
        old = ref()
        if old is None or type(old) is not torch.nn.Parameter:
            continue
        if name is not None:
            _RETIRED_NAMES[id(old)] = name
            weakref.finalize(old, _RETIRED_NAMES.pop, id(old), None)
        old.__class__ = ReplacedParameter


# state tensors a placement replaced (parameters and buffers), weakly: a plain attribute
# that still aliases one must not be read as a constant (NOTE: [tensors read from outside
# the arguments])
_PLACED_AWAY: dict[int, weakref.ref] = {}


def record_placed_away(old: torch.Tensor) -> None:
    _PLACED_AWAY[id(old)] = weakref.ref(old)
    weakref.finalize(old, _PLACED_AWAY.pop, id(old), None)


def aliases_state(t: torch.Tensor, bindings: StepBindings, any_parameter: bool = True) -> str | None:
    """The name of the parameter or buffer of ``bindings`` that ``t`` is, or shares
    storage with, or that a placement replaced; None when it is none of these. With
    ``any_parameter``, every ``nn.Parameter`` counts (one read as a graph constant would
    never be trained); without, only the step's (NOTE: [outside tensors read as Python
    values]: one held apart read as a number is guarded as a tensor is)."""
    if any_parameter and isinstance(t, torch.nn.Parameter):
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


def _stray_after_replacements(opt: torch.optim.Optimizer, owned: set[int]) -> tuple[int, torch.Tensor] | None:
    """``_unowned`` once ``opt`` follows the replacements of parameters a call this
    optimizer was not given made (NOTE: [parameters replaced by DTensors])."""
    stray = _unowned(opt, owned)
    if stray is not None:
        _follow_replacements(opt, owned)
        stray = _unowned(opt, owned)
    return stray


def follow_replaced_parameters(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Point ``optimizer`` at the parameters that replaced its own in ``model`` (a
    compiled step without it placed them: an evaluation step first), as its next
    compiled call would (NOTE: [parameters replaced by DTensors]); the checkpoint
    functions read it through torch's state-dict API, which met the old parameters."""
    if optimizer is not None:
        _follow_replacements(optimizer, {id(p) for p in model.parameters()})


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
# optimizers whose step read the learning rate's value in Python: a setting of their
# programs from then on (NOTE: [a learning rate read in Python] in capture/optimizers.py)
# (each with the line that read it, where known: the recompile warning names it)
_LR_KEYED: weakref.WeakKeyDictionary[torch.optim.Optimizer, SourceLocation | None] = weakref.WeakKeyDictionary()


def lr_is_input(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt``'s learning rates are graph inputs (NOTE: [a learning rate read in
    Python] in capture/optimizers.py): unless its step read one in Python."""
    return opt not in _LR_KEYED


def lr_may_become_a_setting(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt``'s learning rates are graph inputs that may become settings: each
    a Python number (a tensor the user gave stays a tensor)."""
    return lr_is_input(opt) and all(type(g.get("lr")) in (float, int) for g in opt.param_groups)


def keep_lr_a_setting(opt: torch.optim.Optimizer, where: SourceLocation | None = None) -> None:
    """``opt``'s step read its learning rate in Python (at ``where``): from now on it is
    a setting of the program (a program per value)."""
    _LR_KEYED[opt] = where


def lr_read_in_python(opt: torch.optim.Optimizer) -> tuple[bool, SourceLocation | None]:
    """Whether ``opt``'s step read its learning rate in Python, and the line, where known
    (NOTE: [a learning rate read in Python] in capture/optimizers.py)."""
    return opt in _LR_KEYED, _LR_KEYED.get(opt)


def tensor_hyperparams(opt: torch.optim.Optimizer) -> tuple[str, ...]:
    """The keys of ``TENSOR_HYPERPARAMS`` that are ``opt``'s graph inputs."""
    return TENSOR_HYPERPARAMS if lr_is_input(opt) else ()
BETA1 = "beta1"

# NOTE: [Adam's beta1 as a graph input]
# ``OneCycleLR`` and ``CyclicLR`` cycle Adam's first beta with the learning rate by
# default (``cycle_momentum=True``); as a setting of the program, each new value compiled
# a new program on every call. torch's Adam and AdamW take a 0-dim tensor beta in their
# capturable single-tensor path (the one the capture runs: ``lerp_(grad, 1 - beta1)``
# and ``1 - beta1 ** step``), so for those two classes ``betas[0]`` is fed like the
# learning rate, a float64 0-dim input read from the group on every call, and only
# ``betas[1]`` stays a setting. Other optimizers with betas (NAdam, RAdam, Adamax, ...)
# keep both as settings. torch casts a tensor beta1 to the weights' dtype; the program
# keeps it a float64 number, as eager's Python float (NOTE: [hyper-parameters kept
# Python numbers] in capture/optimizers.py).
_BETA1_INPUT_CLASSES = (torch.optim.Adam, torch.optim.AdamW)


MOMENTUM = "momentum"
# SGDs whose momentum a step used other than as a graph input: a setting of their
# programs from then on (NOTE: [SGD's momentum as a graph input] in capture/optimizers.py)
_MOMENTUM_KEYED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


def momentum_is_input(opt: torch.optim.Optimizer, group: dict[str, Any]) -> bool:
    """Whether ``group``'s momentum is a graph input (NOTE: [SGD's momentum as a graph
    input] in capture/optimizers.py): torch's SGD, a momentum that is not 0."""
    momentum = group.get(MOMENTUM)
    return (
        type(opt) is torch.optim.SGD and type(momentum) in (float, int) and momentum != 0
        and not group.get("differentiable") and opt not in _MOMENTUM_KEYED
    )


def keep_momentum_a_setting(opt: torch.optim.Optimizer) -> None:
    """``opt``'s momentum was used by a step other than as a graph input: from now on it
    is a setting of the program (a program per value)."""
    _MOMENTUM_KEYED.add(opt)


# NOTE: [tensors held in a param group]
# timm's Lamb counts its steps in a tensor in each param group (``group['step'] =
# _init_scalar()`` on its first call, then ``group['step'].add_(1)``). Such a tensor was
# no input of the program: read through the traced copy of the group it was a tensor
# from outside the arguments, and its ``add_`` was refused as a write to "a global, a
# closure value or a plain attribute" (2027-01 probe), which it is not. Every tensor a
# param group holds under a string key, but the learning rate (an input of its own,
# NOTE: [a learning rate read in Python]), ``initial_lr`` and the parameters, is now
# training state of the program (``Kind.GROUP_STATE``, replicated in every mode), as
# per-parameter state is: fed from ``group[key]`` on every call and written back into
# that same tensor after the call (``copy_``, so the group keeps its object, as eager's
# ``add_`` keeps it), on every rank. A checkpoint stores it with the param groups,
# as torch's state dict does. A tensor the step puts into a group that held none is
# refused (NOTE: [param-group writes in the step]), naming the optimizer's class, the
# key and the line, with the working form: create it before the first call.


def group_tensor_keys(group: dict[str, Any]) -> list[str]:
    """The keys of the tensors ``group`` holds as state of the program (NOTE: [tensors
    held in a param group]), sorted."""
    return sorted(
        key for key, value in dict.items(group)
        if type(key) is str and key not in _NOT_GROUP_STATE and isinstance(value, torch.Tensor)
        and not isinstance(value, torch.nn.Parameter)
    )


_NOT_GROUP_STATE = frozenset({"params", "lr", "initial_lr"})


def cycled_inputs(opt: torch.optim.Optimizer, group: dict[str, Any]) -> tuple[str, ...]:
    """The hyper-parameters of ``group`` besides the learning rate fed to the program."""
    if beta1_is_input(opt, group):
        return (BETA1,)
    return (MOMENTUM,) if momentum_is_input(opt, group) else ()


def beta1_is_input(opt: torch.optim.Optimizer, group: dict[str, Any]) -> bool:
    """Whether ``group``'s first beta is a graph input (NOTE: [Adam's beta1 as a graph input])."""
    betas = group.get("betas")
    return (
        type(opt) in _BETA1_INPUT_CLASSES and isinstance(betas, tuple) and len(betas) == 2
        and all(type(b) is float for b in betas) and not group.get("differentiable")
    )


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
    # the ``WalkMemo`` whose walks these bindings took, and whether every object those
    # walks read was the one the memo's last fresh walk read (then ``static_key`` takes
    # the optimizers' part from it, and ``install_state`` trusts its last check)
    memo: WalkMemo | None = field(default=None, repr=False)
    unchanged: bool = field(default=False, repr=False)
    # the step called (None where the bindings were made without one)
    step: Callable[..., Any] | None = field(default=None, repr=False)
    # the wrappers the step was given or names that stand for one of ``optimizers``
    # (NOTE: [optimizers forwarding to an inner one])
    wrappers: list[torch.optim.Optimizer] = field(default_factory=list, repr=False)
    # id(tensor) -> its name, for the meta-device modules the step reads by name that are
    # not its state (NOTE: [meta templates read by name])
    templates: dict[int, str] = field(default_factory=dict, repr=False)

    @property
    def walk(self) -> tuple[int, int] | None:
        """Which fresh walk these bindings' objects are all from (the memo and its
        generation), or None when some object is another: what the runtime's checks and
        lookups on those objects are kept by (NOTE: [one walk over the state per call])."""
        memo = self.memo
        return (id(memo), memo.generation) if memo is not None and self.unchanged else None

    @functools.cached_property
    def module_fqns(self) -> dict[int, str]:
        """id(submodule) -> display FQN (computed when a compile needs it, not per step)."""
        fqns: dict[int, str] = {}
        for mi, mod in enumerate(self.modules):
            prefix = "" if len(self.modules) == 1 else f"{mi}."
            for fqn, sub in mod.named_modules():
                fqns.setdefault(id(sub), (prefix + fqn).rstrip("."))
        return fqns

    @functools.cached_property
    def _shown_names(self) -> dict[str, ShownName]:
        try:
            paths = argument_paths(self.step, self.args_spec) if self.step is not None else []
        except Exception:  # noqa: BLE001 - for messages: a structure not read names no argument
            paths = []
        shown: dict[str, ShownName] = {}
        for mi, mod in enumerate(self.modules):
            at = next((i for i, a in enumerate(self.flat_args) if a is mod), None)
            argument = paths[at] if at is not None and at < len(paths) else ""
            label = "" if len(self.modules) == 1 else (
                f"`{argument}`" if argument else f"the {type(mod).__name__} the step reaches by name"
            )
            for fqn, name in (*self.module_params[mi].items(), *self.module_buffers[mi].items()):
                shown.setdefault(name, ShownName(fqn, label, argument))
        return shown

    def shown_parameter(self, name: str) -> ShownName:
        """Parameter (or buffer) ``name`` (a key of ``params`` or ``buffers``) as the user
        knows it (``ShownName``: "'0.weight' of `ema`")."""
        return self._shown_names.get(name) or ShownName(name)

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
        for oi, opt in enumerate(self.optimizers):  # NOTE: [tensors held in a param group]
            for gi, group in enumerate(opt.param_groups):
                refs += [
                    (StateRef(Kind.GROUP_STATE, key=key, optimizer=oi, group=gi), group[key])
                    for key in group_tensor_keys(group)
                ]
        if self.scalers:
            refs += scaler_state(self.scalers, next(iter(self.params.values())).device)
        return refs

    def hyperparam_refs(self) -> list[StateRef]:
        return [
            StateRef(Kind.HYPERPARAM, key=key, optimizer=oi, group=gi)
            for oi, opt in enumerate(self.optimizers)
            for gi, group in enumerate(opt.param_groups)
            for key in tensor_hyperparams(opt) + cycled_inputs(opt, group)
        ]

    def hyperparam_value(self, ref: StateRef) -> float:
        if ref.optimizer < 0:  # a float argument of the step (capture.float_argument_ref)
            return float(self.flat_args[ref.index])
        group = self.optimizers[ref.optimizer].param_groups[ref.group]
        return float(group["betas"][0] if ref.key == BETA1 else group[ref.key])

    def optimizer_settings(self) -> dict[str, Any]:
        """The optimizer hyper-parameters that are constants of a program (all but the
        learning rate), by name: ``optimizer[0].param_groups[0]['betas']``."""
        return {
            f"optimizer[{oi}].param_groups[{gi}][{k!r}]": _hashable(v)
            for oi, opt in enumerate(self.optimizers)
            for gi, group in enumerate(opt.param_groups)
            for k, v in group.items()
            if k != "params" and k not in tensor_hyperparams(opt) and k != "initial_lr"
            and not (k == "betas" and beta1_is_input(opt, group))
            and not (k == MOMENTUM and momentum_is_input(opt, group))
        } | {  # NOTE: [Adam's beta1 as a graph input]: beta2 alone is a setting
            f"optimizer[{oi}].param_groups[{gi}]['betas'][1]": _hashable(group["betas"][1])
            for oi, opt in enumerate(self.optimizers)
            for gi, group in enumerate(opt.param_groups)
            if beta1_is_input(opt, group)
        }

    def static_key(self) -> tuple:
        """Everything besides tensor shapes that a compiled program depends on.

        Training flags, optimizer hyper-parameters other than the learning rate, the set
        and non-tensor values of optimizer state, which parameters hold a gradient, and
        the non-tensor arguments of the step. A change to any recompiles the step.
        The optimizers' part is the memo's when the walks found the same objects
        (``WalkMemo``).
        """
        key: list[Any] = [self.args_spec]
        # Float arguments: graph inputs or guards (NOTE: [guards on Python values]); an
        # unhashable one (a NumPy array) by its type, its value is a guard; a plain
        # object by its class, what it holds is guarded (``keyed_by_class``)
        key += [a if not isinstance(a, (torch.Tensor, torch.nn.Module, torch.optim.Optimizer, float))
                or type(a) is bool else type(a).__name__ for a in self.flat_args]
        for i, a in enumerate(key):
            if i and type(a) is not str and keyed_by_class(a):
                key[i] = ("an object of class", type(a))
            elif getattr(type(a), "__hash__", None) is None:
                key[i] = _unhashable_argument(a, i - 1)
        # by name, at a known place: api._key_change names the one that changed
        key.append(tuple(self.optimizer_settings().items()))
        key.append(tuple([m.training for m in self.submodules]))
        # and whether a hook sits on the parameter (refused at compile: NOTE: [hooks on
        # parameters] in ``api.py``), read at a plain tensor's cost
        with private.plain_attribute_reads():
            has_hooks = private.has_tensor_hooks
            key += [(n, tuple(p.shape), p.dtype, p.grad is not None, p.requires_grad, has_hooks(p))
                    for n, p in self.params.items()]
        key += [(n, tuple(b.shape), b.dtype) for n, b in self.buffers.items()]
        # the walk that reads the state's metadata keeps each state dict for feeding and
        # write-back (NOTE: [one walk over the state per call])
        kept = self.memo.optimizer_part(self) if self.memo is not None and self.unchanged else None
        if kept is None:
            part, self._state_dicts, memoizable = self._optimizer_part()
            if self.memo is not None and memoizable:
                self.memo.keep_optimizer_part(self, part)
        else:
            part, self._state_dicts = kept
        key += part
        if self.scalers:
            key.append(scaler_key(self.scalers))
        return tuple(key)

    def _optimizer_part(self) -> tuple[list[Any], dict[tuple[int, str], dict], bool]:
        """The optimizers' part of ``static_key``, each parameter's state dict by
        (optimizer, name), and whether the part may be kept while the same objects stay
        (every state value a tensor or an immutable scalar)."""
        part: list[Any] = []
        state_dicts: dict[tuple[int, str], dict] = {}
        memoizable = True
        for oi, opt in enumerate(self.optimizers):
            states = opt.state
            for gi, group in enumerate(opt.param_groups):
                part.append(("group", oi, gi))
                # which parameters the group holds (moving one to another group changes
                # its learning rate in the program) and the set of its state
                for p in group["params"]:
                    name = self.param_name(p)
                    state = states.get(p)
                    if not state:
                        part.append((name, ()))
                        continue
                    state_dicts[oi, name] = state
                    part.append((name, tuple([(k, _state_hashable(state[k])) for k in sorted(state)])))
                    memoizable = memoizable and all(
                        isinstance(v, torch.Tensor) or type(v) in _IMMUTABLE for v in state.values()
                    )
        return part, state_dicts, memoizable


_IMMUTABLE = (int, float, bool, str, type(None))


class WalkMemo:
    """What the last fresh walks of a step's objects found, kept while every object they
    read is the same one (NOTE: [one walk over the state per call] in
    ``runtime/runner.py``; one per compiled step).

    The module walk (parameters, buffers, submodules and their names) is a function of
    the ``_parameters``, ``_buffers`` and ``_modules`` dicts of the submodules it meets:
    a call lists each dict and its keys and values in one pass and tests them for
    identity with the last fresh walk's, instead of walking the tree. The optimizers'
    part of the program key is a function of their param groups and state dicts, and of
    each state tensor's shape and dtype: a call lists the ids of all of those (the
    optimizers themselves held weakly: an id is not reused while its object lives, and
    every object listed is reachable from a live optimizer) and takes the part from the
    last fresh walk when they are equal. The runtime changes state only by swapping a
    DTensor's local tensor, which keeps its shape and dtype; anything else that changes
    the state (a loaded checkpoint, a new optimizer, state created by a first step)
    puts other objects there. The module walk holds its dicts strongly until the next
    call (the guards hold them anyway); the optimizers' state is never held, so a
    dropped optimizer's state is freed at once.
    """

    def __init__(self) -> None:
        self._module_objects: list[Any] = []
        self._modules: list[weakref.ref] = []
        self._walk: tuple | None = None
        self._optimizers: list[weakref.ref] = []
        self._optimizer_ids: list[int] = []
        self._optimizer_part: list[Any] | None = None
        # (optimizer, parameter name) of each state dict, in the optimizers' state order
        self._state_names: list[tuple[int, str]] = []
        self.generation = 0  # counts the fresh optimizer walks kept

    def module_walk(self, modules: list[torch.nn.Module]) -> tuple | None:
        """The last fresh module walk if every dict it read holds the same objects."""
        walk = self._walk
        if walk is None or len(modules) != len(self._modules):
            return None
        if not all(ref() is mod for ref, mod in zip(self._modules, modules, strict=True)):
            return None
        objects = _module_objects(walk[4])
        if len(objects) != len(self._module_objects) or not all(
            map(operator.is_, objects, self._module_objects)
        ):
            return None
        return walk

    def keep_module_walk(self, modules: list[torch.nn.Module], walk: tuple) -> None:
        self._modules = [weakref.ref(m) for m in modules]
        self._walk = walk
        self._module_objects = _module_objects(walk[4])
        self._optimizer_part = None  # its names came from the walk

    def optimizers_unchanged(self, optimizers: list[torch.optim.Optimizer]) -> bool:
        if self._optimizer_part is None or len(optimizers) != len(self._optimizers):
            return False
        if not all(ref() is opt for ref, opt in zip(self._optimizers, optimizers, strict=True)):
            return False
        return _optimizer_ids(optimizers) == self._optimizer_ids

    def optimizer_part(self, bindings: StepBindings) -> tuple[list[Any], dict[tuple[int, str], dict]] | None:
        """The optimizers' key part and state dicts (``optimizers_unchanged`` held)."""
        if self._optimizer_part is None:
            return None
        dicts = [d for opt in bindings.optimizers for d in opt.state.values()]
        return self._optimizer_part, dict(zip(self._state_names, dicts, strict=True))

    def keep_optimizer_part(self, bindings: StepBindings, part: list[Any]) -> None:
        optimizers = bindings.optimizers
        by_dict = {id(d): key for key, d in bindings._state_dicts.items()}
        names = [by_dict.get(id(d)) for opt in optimizers for d in opt.state.values()]
        if any(name is None for name in names):  # state of a parameter in no group
            self._optimizer_part = None
            return
        self._optimizers = [weakref.ref(o) for o in optimizers]
        self._optimizer_ids = _optimizer_ids(optimizers)
        self._optimizer_part = part
        self._state_names = names  # type: ignore[assignment]
        self.generation += 1


def _module_objects(submodules: list[torch.nn.Module]) -> list[Any]:
    """Each submodule's parameter, buffer and child dicts, and their keys and values."""
    out: list[Any] = []
    for sub in submodules:
        for d in (sub._parameters, sub._buffers, sub._modules):
            out.append(d)
            if d:
                out += d.keys()
                out += d.values()
    return out


def _optimizer_ids(optimizers: list[torch.optim.Optimizer]) -> list[int]:
    """The ids of the optimizers' param groups, their parameters, the state dict, its
    keys (parameters), each parameter's state dict and its keys and values."""
    out: list[int] = []
    for opt in optimizers:
        groups = opt.param_groups
        out.append(id(groups))
        for group in groups:
            params = group["params"]
            out.append(id(group))
            out.append(id(params))
            out += map(id, params)
        state = opt.state
        out.append(id(state))
        out += map(id, state)
        dicts = list(state.values())
        out += map(id, dicts)
        out += [id(k) for d in dicts for k in d]
        out += [id(v) for d in dicts for v in d.values()]
    return out


def _unhashable_argument(value: Any, index: int) -> str:
    """The key's part for an argument that cannot be hashed: its type, when the guards
    hold its value (a NumPy array); else refused (nothing would tell two calls apart)."""
    if numpy_kind(value) == "array":
        return "numpy.ndarray"
    raise SPMDCompileError(
        f"argument {index} of the step is a {type(value).__name__}, which cannot be hashed: "
        "a compiled step could not tell its values in two calls apart.",
        hint="pass it as a tuple, a tensor (a batch input) or an object with attributes.",
    )


def numpy_kind(value: Any) -> str | None:
    """"array", "scalar" or None, without importing NumPy (most steps never meet it)."""
    cls = type(value)
    if cls.__module__ != "numpy":
        return None
    if cls.__name__ == "ndarray":
        return "array"
    return "scalar" if hasattr(value, "dtype") and hasattr(value, "item") else None


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


def argument_paths(func: Callable[..., Any], spec: pytree.TreeSpec, nones: bool = False) -> list[str]:
    """The path of every leaf of a call's flattened arguments (``StepBindings.flat_args``,
    whose structure ``spec`` is), as the step's code names it: the parameter's name, then
    keys and attributes inside it (``x``, ``batch['input_ids']``, ``state.h``,
    ``hidden[1]``). Arguments caught by ``*args`` are ``args[i]``; a step whose signature
    cannot be read names its positional arguments ``args[i]``. ``nones``: the paths of
    None values too (no leaf of pytree's: a ``batch['mask']`` passed as None this call).

    NOTE: [inputs by name]: what ``DataParallel(input_batch_dim={...})`` matches.
    """
    try:
        parameters = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        parameters = []
    positional = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    rest = next((p.name for p in parameters if p.kind is p.VAR_POSITIONAL), "args")
    args, kwargs = pytree.tree_unflatten([object() for _ in range(spec.num_leaves)], spec)
    named = [
        (positional[i] if i < len(positional) else f"{rest}[{i - len(positional)}]", a)
        for i, a in enumerate(args)
    ] + [(str(k), v) for k, v in kwargs.items()]
    paths = []
    for name, value in named:
        try:
            leaves = pytree.tree_flatten_with_path(value, is_leaf=(lambda v: v is None) if nones else None)[0]
            paths += [name + pytree.keystr(path) for path, _ in leaves]
        except ValueError:  # a node type registered without keys: the argument's name
            paths += [name] * len(pytree.tree_leaves(value))
    return paths


def tensor_argument_names(
    func: Callable[..., Any], bindings: StepBindings, paths: list[str] | None = None
) -> list[str]:
    """The path of each tensor argument (``argument_paths``, or ``paths`` a caller keeps
    per argument structure), in the order of ``bindings.tensor_args()``: the names of the
    step's ``Kind.INPUT`` refs."""
    if paths is None:
        paths = argument_paths(func, bindings.args_spec)
    return [paths[i] for i, _ in bindings.tensor_args()]


def argument_names(func: Callable[..., Any]) -> tuple[list[str], bool]:
    """The names of a step's parameters (``*args`` / ``**kwargs`` by their names), and
    whether it takes keyword arguments of any name; ([], True) when its signature cannot
    be read."""
    try:
        parameters = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        return [], True
    return [p.name for p in parameters], any(p.kind is p.VAR_KEYWORD for p in parameters)


def _is_leaf(x: Any) -> bool:
    return isinstance(x, (torch.nn.Module, torch.optim.Optimizer))


def find_bindings(
    func: Callable[..., Any], args: tuple, kwargs: dict, memo: WalkMemo | None = None
) -> StepBindings:
    """Name the modules, optimizers and state of a train-step call; ``memo`` (kept by
    the caller across calls) holds the last fresh walk (``WalkMemo``).

    Raises:
        SPMDCompileError: no module, or an optimizer parameter that no module passed
            to the step owns. A step without an optimizer (an evaluation step, or one
            that only accumulates gradients) is a program too: NOTE: [steps without an
            optimizer] in ``capture/trace.py``.
    """
    containers: list[Any] = []  # NOTE: [batch containers]
    flat_args, spec = pytree.tree_flatten(open_containers((args, kwargs), _is_leaf, containers), is_leaf=_is_leaf)
    modules, templates = _named_modules(func, _unique([a for a in flat_args if isinstance(a, torch.nn.Module)]))
    optimizers = _unique([a for a in flat_args if isinstance(a, torch.optim.Optimizer)])
    where = f"{step_where(func)} ({step_name(func)})"
    if not modules:
        raise SPMDCompileError(
            "The train step trains no nn.Module: none is among its arguments, nor among the "
            "globals and closure variables its code names or the attributes of its object "
            "(NOTE: [modules and optimizers by name]).",
            user_line=where,
            hint="pass the model to the step, e.g. train_step(model, optimizer, batch, target).",
        )
    walk = memo.module_walk(modules) if memo is not None else None
    remembered = walk is not None
    if walk is None:
        walk = _walk_modules(modules)
        _refuse_state_without_values(walk[0], walk[1], where)  # a refused walk is not kept
        _refuse_overlapping_state(walk[0], walk[1], where)
        if memo is not None:
            memo.keep_module_walk(modules, walk)
    params, buffers, module_params, module_buffers, submodules = walk
    optimizers += _named_optimizers(func, optimizers, params, flat_args)
    # NOTE: [optimizers forwarding to an inner one]
    optimizers, wrappers = inner_optimizers(optimizers, where)
    unchanged = remembered and memo is not None and memo.optimizers_unchanged(optimizers)
    if not unchanged:  # the same objects as a call that passed this check: it holds
        _check_ownership(optimizers, params, where, _argument_of(func, flat_args, spec))
    return StepBindings(
        modules, optimizers, params, buffers, module_params, module_buffers, flat_args, spec,
        (args, kwargs), _unique(find_scalers(func, flat_args)),
        _unique(find_schedulers(func, flat_args)), containers, submodules,
        memo=memo, unchanged=unchanged, step=func, wrappers=wrappers,
        templates=template_tensors(templates),
    )


# NOTE: [modules and optimizers by name]
# The modules a step trains are its module arguments. A step given none (a script's
# ``def train_step(x, y)`` over a global ``model`` and ``optimizer``, a trainer's method
# over ``self.model``, a model's own method) trains the modules its code can reach by name
# (``reachable_by_name``: the globals and closure variables its code names, the
# attributes of its bound object, and that object itself when it is a module) that hold
# state, leaving out a module inside another one found (``self.head = self.model.head``)
# and parameterless ones (a global ``criterion = nn.CrossEntropyLoss()``, which would only
# prefix the parameters' names). A step given its model takes, after it, the other
# modules its code reads by name (NOTE: [modules read by name beside the given ones]).
# Optimizers are
# the arguments' and, after them, those the given ones hold in an attribute (SAM's and
# Lookahead's inner ``base_optimizer``, stepped by the wrapper's own step(); refused as
# "not among its optimizers" before the fifty-seventh session) and those reachable by
# name (entries of a dict, list or tuple reached so too, NOTE: [optimizers held in
# containers] in ``capture/code_names.py``), each where every parameter it updates the modules own (after following DTensor replacements, NOTE: [parameters replaced by
# DTensors]); a named optimizer over other parameters is left out, and its ``step()`` in
# the trace is refused (``OptimizerNotPassed`` in ``capture/call_optimizers.py``; met first
# in ``zero_grad()``: ``capture/optimizers_not_passed.py``). Capture swaps
# state on the module objects themselves, so the step's code reaching them by name traces
# the same program as one given them. Names are found anew on each call: a global rebound
# to another model between calls trains the new one.
#
# NOTE: [modules read by name beside the given ones]
# A knowledge-distillation step is given its student and optimizer and reads a frozen
# teacher by name (a global, a closure variable, ``self.teacher`` of the trainer whose
# method is the step, or a name read by a helper function the step calls). Until the
# fifty-eighth session such a module was left out of the step's state, and its
# parameters, read by the trace as tensors from outside no walk had found, refused the
# step ("neither an argument nor part of a module or optimizer", at the teacher's first
# op, its hint for a plain tensor). Such a module is state now, after the given ones
# (``modules_read_by_name``: the globals the step's code loads, its closure variables,
# the attributes of its bound object that its code names, and the same in the user
# functions and methods it names), as if it had been passed: placed as the mode places
# state (replicated by ddp, sharded by fsdp), read by the program on every call, so a
# teacher updated in place between calls (an EMA outside the step) is seen by the next
# call, and one the step updates itself is updated as eager does. Left out: a module
# inside a given one (its state is already the step's), one holding no state, one
# sharing state with a given module without being inside it (a wrapper of the model:
# its own tensors are then refused as from outside, naming the module, NOTE: [tensors
# read from outside the arguments]), and an attribute of the bound object its code does
# not name (a trainer's ``self.ema_model`` the step never reads stays as it is). A
# module reached otherwise (an entry of a dict, an attribute of a plain object) is not
# taken: its tensors are refused naming the module and where it was found.
def _named_modules(
    func: Callable[..., Any], given: list[torch.nn.Module]
) -> tuple[list[torch.nn.Module], list[tuple[torch.nn.Module, str]]]:
    """The step's modules, and the meta-device templates it reads by name, each with
    where (NOTE: [meta templates read by name])."""
    read = modules_read_by_name(func)
    by_name = [m for m, _ in read]
    if not given:
        # a module only in a dict is refused naming it (NOTE: [optimizers held in containers])
        by_name[:0] = reachable_by_name(func, [], torch.nn.Module, containers=False)
    found = _unique(by_name)
    owner = getattr(func, "__self__", None)
    if not given and isinstance(owner, torch.nn.Module) and all(owner is not m for m in found):
        found.insert(0, owner)
    holding = [m for m in found if any(True for _ in m.parameters()) or any(True for _ in m.buffers())]
    if given and holding:
        inside = {id(sub) for g in given for sub in g.modules()}
        state = {id(t) for g in given for t in (*g.parameters(), *g.buffers())}
        holding = [
            m for m in holding if id(m) not in inside
            and not any(id(t) in state for t in (*m.parameters(), *m.buffers()))
        ]
    inner = {id(sub) for m in holding for sub in m.modules() if sub is not m}
    modules = [*given, *(m for m in holding if id(m) not in inner)]
    # NOTE: [meta templates read by name]: not state beside a given module
    if not given:
        return modules, []
    kept = [m for m in modules if any(m is g for g in given) or not is_meta_template(m)]
    where = {id(m): w for m, w in reversed(read)}  # the first place each is read
    templates = [(m, where.get(id(m), "the step reads")) for m in modules if not any(m is k for k in kept)]
    return kept, templates


def _named_optimizers(
    func: Callable[..., Any], given: list[torch.optim.Optimizer], params: dict[str, torch.nn.Parameter],
    flat_args: list[Any],
) -> list[torch.optim.Optimizer]:
    owned = {id(p) for p in params.values()}
    found: list[torch.optim.Optimizer] = []
    # an optimizer a given one holds (SAM's / Lookahead's inner optimizer, which the
    # wrapper's own step() steps): NOTE: [modules and optimizers by name]
    held = [v for g in given for v in vars(g).values() if isinstance(v, torch.optim.Optimizer)]
    for opt in _unique([*held, *reachable_by_name(func, [], torch.optim.Optimizer, holders=flat_args)]):
        if any(opt is g for g in given) or any(opt is f for f in found):
            continue
        if _stray_after_replacements(opt, owned) is None:
            found.append(opt)
    return found


def _refuse_state_without_values(
    params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], where: str
) -> None:
    """State a compiled step cannot place: a tensor on the meta device (NOTE: [state on
    the meta device]) or of a lazy module that has not run (``nn.LazyLinear``, ...: no
    shape before its first forward; torch raised "Can't access the shape of an
    uninitialized parameter" from the program key)."""
    for kind, tensors in (("parameter", params), ("buffer", buffers)):
        for name, t in tensors.items():
            if torch.nn.parameter.is_lazy(t):
                raise SPMDCompileError(
                    f"{kind} {name} belongs to a lazy module that has not run yet, so it has "
                    "no shape; a compiled step places the model's state as it is before the "
                    "first call.",
                    user_line=where,
                    hint="run the model once on a batch before the first compiled call (a dry "
                    "run, as torch's lazy modules need before an optimizer is made: "
                    "`with torch.no_grad(): model(batch)`), or give the module its sizes.",
                )
            if t.device.type == "meta":
                raise SPMDCompileError(
                    f"{kind} {name} is on the meta device, so it has no values; a compiled "
                    "step places the model's state from the values it holds "
                    "(NOTE: [state on the meta device]).",
                    user_line=where,
                    hint="materialize the model before the first call: "
                    "model.to_empty(device=...) and then initialize it (each module's "
                    "reset_parameters(), or your own init), or build it on the device.",
                )


# NOTE: [state tensors sharing memory]
# A parameter made as a view of another's storage (``v = nn.Parameter(w.data[:, :3])``)
# is one memory in eager: an update of ``w`` moves ``v``. A compiled step places each
# state tensor as its own DTensor, so the two drifted apart silently (``w`` 9.9e-2 off
# after 3 SGD steps, ddp and fsdp alike). State tensors whose memory overlaps without
# being the same object are refused when the step's modules are walked, before anything
# is placed, naming both. The same tensor registered twice (tied parameters, a buffer
# held by two modules) is one entry of the walk and goes on working. The test is on the
# byte ranges each tensor can reach in its storage (public ``untyped_storage``,
# ``data_ptr``, sizes and strides), so two strided views that interleave without sharing
# an element (``w[:, ::2]`` and ``w[:, 1::2]``) are refused too: a refusal, never a
# wrong result. Only plain dense tensors are looked at (a placed DTensor, a meta or
# sparse tensor has no plain storage of its own to share).
def _refuse_overlapping_state(
    params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], where: str
) -> None:
    """Refuse two state tensors over one memory (NOTE: [state tensors sharing memory])."""
    spans: dict[tuple[str, int], list[tuple[int, int, str]]] = {}
    for kind, tensors in (("parameter", params), ("buffer", buffers)):
        for name, t in tensors.items():
            if isinstance(t, DTensor) or t.layout != torch.strided or t.device.type == "meta" or t.numel() == 0:
                continue
            try:
                base = t.untyped_storage().data_ptr()
            except (RuntimeError, NotImplementedError):  # a tensor subclass without storage
                continue
            if base == 0:
                continue
            start = t.data_ptr()
            reach = 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))
            key = (str(t.device), base)
            spans.setdefault(key, []).append((start, start + reach * t.element_size(), f"{kind} {name}"))
    for entries in spans.values():
        if len(entries) < 2:
            continue
        entries.sort()
        end, holder = entries[0][1], entries[0][2]
        for start, stop, name in entries[1:]:
            if start < end:
                raise SPMDCompileError(
                    f"{holder} and {name} share memory (one is a view of the other's storage, "
                    "e.g. `nn.Parameter(w.data[:, :3])`): eager updates of one move the other, "
                    "but a compiled step places each state tensor on its own, so they would "
                    "train apart. Nothing was placed.",
                    user_line=where,
                    hint="give the second its own memory (`nn.Parameter(w.data[:, :3].clone())`), "
                    "or keep one parameter and take the view in forward (`self.w[:, :3]`); "
                    "the same tensor registered in two modules (tied weights) is fine.",
                )
            if stop > end:
                end, holder = stop, name


# NOTE: [state on the meta device]
# A model built under ``torch.device("meta")`` (FSDP2's deferred initialization) has
# shapes but no values. A compiled step places the state from the values the model holds
# (each rank keeps its share of them), so meta state is refused when the step's modules
# are walked, naming the first such tensor; capture would otherwise fail on the first op
# that meets the batch ("found at least two devices, cpu and meta"). Sharded
# initialization of a meta model (each rank making only its share) is not offered: it
# cannot reproduce the values one device's construction draws, which the single-device
# equivalence rests on.


def _walk_modules(modules: list[torch.nn.Module]) -> tuple:
    """Parameters and buffers by name, each module's FQN -> name tables, and every
    submodule as the walk meets it (repeats included)."""
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
    return params, buffers, module_params, module_buffers, submodules


def _argument_of(func: Callable[..., Any], flat_args: list, spec: pytree.TreeSpec) -> Callable[[Any], str | None]:
    """The path (``argument_paths``) of the step's argument that is ``value`` itself, or
    None; the paths are read only when asked (a refusal's message)."""
    def find(value: Any) -> str | None:
        index = next((i for i, a in enumerate(flat_args) if a is value), None)
        if index is None:
            return None
        paths = argument_paths(func, spec)
        return paths[index] if index < len(paths) else None
    return find


def _bare_tensor_fix(name: str = "log_alpha") -> str:
    """How a learnable tensor of its own becomes state: NOTE: [a learnable tensor passed
    on its own]."""
    name = name if name.isidentifier() else "value"
    return (f"hold it in an nn.Module and pass that module to the step (`holder = "
            f"nn.Module(); holder.{name} = nn.Parameter(...)`, the optimizer built over "
            f"holder.parameters(), the step reading holder.{name})")


def _check_ownership(
    optimizers: list[torch.optim.Optimizer],
    params: dict[str, torch.nn.Parameter],
    where: str,
    argument_of: Callable[[Any], str | None] = lambda value: None,
) -> None:
    owned = {id(p) for p in params.values()}
    for oi, opt in enumerate(optimizers):
        stray = _stray_after_replacements(opt, owned)
        if stray is None:
            continue
        gi, p = stray
        head = (f"optimizer[{oi}].param_groups[{gi}] holds a parameter of shape "
                f"{tuple(p.shape)} that no module passed to the step owns")
        argument = argument_of(p)
        if argument is not None:  # NOTE: [a learnable tensor passed on its own]
            raise SPMDCompileError(
                f"{head}: it is the step's tensor argument `{argument}`. A tensor passed on "
                "its own is an input of the program, which the step reads and does not "
                "update; state that an optimizer updates is a module's.",
                user_line=where,
                hint=_bare_tensor_fix(argument) + ".",
            )
        raise SPMDCompileError(
            head + _stray_cause(p, params, optimizers),
            user_line=where,
            hint="pass every module whose parameters the optimizer updates; for a learnable "
            f"tensor of its own (SAC's log_alpha), {_bare_tensor_fix()}; where the module was "
            "passed, build the optimizer after the model's parameters are final "
            "(after to_empty / reset_parameters, a replaced layer, a tie), or point it "
            "at the new ones (add_param_group, or a new optimizer with the old one's "
            "load_state_dict).",
        )


# NOTE: [a learnable tensor passed on its own]
# SAC's temperature ``log_alpha = nn.Parameter(torch.zeros(()))`` (or a requires_grad
# tensor) is commonly passed to the step beside the modules, with its own optimizer. A
# tensor argument is an input of the program (read fresh each call, placed as a batch or
# replicated value), not state the program updates and keeps placed, so the optimizer's
# step over it is refused as before; the refusal names the argument and gives the fix
# that works: hold the tensor in an nn.Module passed to the step (SAC then matched eager
# to 1.1e-15 in the sixty-third session's probe). Until then it said only "pass every
# module whose parameters the optimizer updates", which a user without a module for it
# could not act on.


def _stray_cause(
    p: torch.Tensor, params: dict[str, torch.nn.Parameter], optimizers: list[torch.optim.Optimizer]
) -> str:
    """Why an optimizer may hold a parameter no module owns, read off the parameter (a
    meta tensor: built before ``to_empty``) and the modules (one owning a parameter of
    that shape and dtype: a module not passed, or one replaced after the optimizer was
    built, which the modules cannot tell apart); NOTE: [stray optimizer parameters]."""
    if p.device.type == "meta":
        return (". It is on the meta device: the optimizer was built before the model's "
                "parameters were materialized (to_empty), which made new parameters.")
    held = {id(q) for opt in optimizers for group in opt.param_groups for q in group["params"]}
    alike = [name for name, q in params.items() if q.shape == p.shape and q.dtype == p.dtype]
    if not alike:
        return "."
    # a replaced layer's new parameter is in no optimizer (a tie's is): named first
    alike.sort(key=lambda name: id(params[name]) in held)
    unheld = id(params[alike[0]]) not in held
    return (". Either a module the optimizer updates was not passed to the step, or the "
            "optimizer was built before the step's modules replaced that parameter: they "
            f"own another of that shape and dtype ({alike[0]}"
            + (", which no optimizer holds" if unheld else "")
            + ") (a layer swapped, `head.weight = emb.weight`).")


# NOTE: [stray optimizer parameters]
# An optimizer holding a parameter no module passed to the step owns is refused (its
# update could not be placed). The common causes are orders of set-up, not a missing
# module: FSDP2's deferred init done with the optimizer built on the meta model (before
# ``to_empty``), or a layer replaced / tied between calls while the old optimizer is
# kept. The message said only "pass every module", which the user had done; it now reads
# the cause off the parameter (meta) or the modules (a parameter of that shape and dtype
# they own instead) and says to build the optimizer after the change. A shape and dtype
# are no proof of a replacement: an optimizer over a Linear(3, 3) that was not passed,
# beside a model with its own 3x3 layer, was told "the optimizer may have been built
# before it replaced ..." (review of f11b842), so a parameter of that shape is named as
# one of two causes, a module not passed being the other (parameters carry no creation
# order to tell them apart).


def check_plain_modules(modules: list[torch.nn.Module], where: str) -> None:
    """Refuse a module torch's FSDP already shards: a traced step fails inside its hooks
    with errors about their internals.

    NOTE: [TorchScript modules]
    A ``torch.jit.script`` / ``torch.jit.trace`` submodule crashed the first call with a
    raw ``TypeError: contains(): incompatible function arguments`` (its ``_parameters``
    is TorchScript's ``OrderedDictWrapper``, which has no ``__iter__``; ``_module_objects``
    now reads its keys). Past that, the capture traces it, but installing the placed
    state fails half-way (TorchScript modules take no state-dict hooks and their dicts
    cannot be cleared), and the module hooks that name nodes and guard direct calls do
    not run inside TorchScript; so it is refused here, naming it, before anything is
    placed. A ``@torch.jit.script`` function called in forward is traced as its ops. (A ``torch.compile``d module traces as its Python:
    NOTE: [compiled helpers and selective checkpointing at capture].)
    (A ``DistributedDataParallel`` wrapper traces as its module: its reducer's hooks sit
    on the real parameters, which the trace swaps out; measured exact on 2 gloo ranks.)"""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    wrappers = [
        ((FSDPModule, FullyShardedDataParallel), "sharded by torch's fully_shard / FSDP "
         "({cls})", "pass the model before fully_shard; DataParallel('fully_shard') "
         "shards it"),
    ]
    from torch.ao.quantization import FakeQuantizeBase

    for mi, mod in enumerate(modules):
        for fqn, sub in mod.named_modules():
            name = f"module[{mi}]" + (f".{fqn}" if fqn else "")
            if isinstance(sub, FakeQuantizeBase):  # before: refused deep in torch's observers
                raise SPMDCompileError(
                    f"{name} is {type(sub).__name__}, a fake-quantization module of "
                    "quantization-aware training (torch.ao.quantization.prepare_qat), which a "
                    "compiled step does not support: its observers decide in Python, on tensor "
                    "values, whether to update and quantize (more than 16 such `if`s per "
                    "step), and the fused observer op has no DTensor sharding rule.",
                    user_line=where,
                    hint="compile the step of the float model (before prepare_qat), and run "
                    "the quantization-aware fine-tuning steps uncompiled.",
                )
            if isinstance(sub, torch.jit.ScriptModule):  # NOTE: [TorchScript modules]
                made = "torch.jit.trace" if isinstance(sub, torch.jit.TopLevelTracedModule) else "torch.jit.script"
                raise SPMDCompileError(
                    f"{name} is a TorchScript module ({type(sub).__name__}, made by "
                    f"{made} or loaded by torch.jit.load), which a compiled step does not "
                    "support: its forward runs in TorchScript's interpreter, out of reach "
                    "of the module hooks that name the graph's nodes, and its parameters "
                    "live in TorchScript's own slots, where the sharded state cannot be "
                    "installed. Nothing was applied.",
                    module_fqn=name,
                    user_line=where,
                    hint="pass the plain nn.Module (the one given to torch.jit.script / "
                    "torch.jit.trace); `@torch.jit.script` functions called in forward work "
                    "as they are.",
                )
            for classes, what, hint in wrappers:
                if isinstance(sub, classes):
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


def mark_parameters(bindings: StepBindings) -> None:
    """A DTensor parameter is an ``nn.Parameter`` by the ``_is_param`` mark torch sets in
    its ``__dict__``, which ``_install`` replaces with the plain parameter's: put there
    before the guards count that dict's entries (``build_guards``, for every call whose
    objects are walked: another model with the same settings reuses the program; a
    plain parameter ignores the mark). Without
    it ``isinstance(p, nn.Parameter)`` was False after the first call, and assigning an
    installed parameter to a module (``head.weight = emb.weight``) raised TypeError."""
    for p in bindings.params.values():
        if not isinstance(p, DTensor):  # a DTensor parameter holds its own
            p.__dict__.setdefault("_is_param", True)
