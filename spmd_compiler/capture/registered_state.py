"""Parameters and buffers a step registers or removes on its model, refused.

NOTE: [state registered in the step]
A compiled program's state is the parameters and buffers the model had when the step
was captured, by name. A step that registers one or takes one away
(``torch.nn.utils.prune.l1_unstructured`` inside the step: ``weight`` becomes the
parameter ``weight_orig``, the buffer ``weight_mask`` and a forward pre-hook; a
``register_buffer`` in a forward) changes that set on every call, which the program
cannot repeat. Until the sixty-third session the capture failed on a table lookup
(``KeyError: '0.weight_mask'`` naming no line of the user's, no hint) and left the
model changed although the message said nothing was applied: parameters
``0.weight_orig`` and ``0.weight``, the buffer ``0.weight_mask`` (state-dict keys
changed). While the step is traced, ``register_parameter`` and ``register_buffer`` of
``nn.Module`` note where a name new to its module was registered (the innermost line
outside torch); after the step ran, each module given to it is compared with the names
the capture bound, and a difference is refused naming the tensors and that line
(``SPMDCompileError``, with what to do). The refused call leaves each module's
parameter and buffer tables as the compile found them (``HooksAsFound`` keeps them
beside the hooks, NOTE: [hooks a refused step registered]), so the model is as found:
parameters, buffers and hooks.

NOTE: [parameters rebound in the step]
A step may keep every name and still put a new object under one: the VQ-VAE EMA
notebook's ``self._ema_w = nn.Parameter(0.9 * self._ema_w + ...)`` in ``forward``,
``register_parameter`` of a name the module has, ``del self.p`` and a new ``self.p``,
``plist[0] = nn.Parameter(...)`` of a ``ParameterList`` or ``ParameterDict``, or tying
``self.dec.weight = self.enc.weight`` in the step. Eager then trains a different object
from the next call on: the module holds the new one, an optimizer built before holds
the old one, which gets no gradient. The program updates in place the parameters the
model had at capture and runs no Python, so until the sixty-seventh session the new
object was dropped with no error (the minimal EMA step, float64, 2 simulated ranks:
losses 0.5396, 0.4864, 0.1916 against eager's 0.5396, 0.5533, 0.2335; ``ema`` left
zeros where eager's is 0.2147, ...). Following object identity call by call is not
something the program can do, so the step is refused: after it ran, each parameter a
module of the step holds must be the tensor the capture put there, and no parameter
or buffer may be hidden by an entry of the module's ``__dict__`` the step made
(``self.__dict__["ema"] = ...``, ``object.__setattr__``: eager reads the entry, the
model's state keeps the old tensor; it failed after the program ran with torch's
``TypeError``). The refusal names the parameter, its module and the line of the
``register_parameter`` call (``RegistrationsWatched.rebound``; the step's line for a
write to ``_parameters`` or ``__dict__``), with ``copy_`` under ``no_grad`` as the
in-place way. A buffer given a new tensor (``self.count = self.count + 1``) is state
the program writes back by name, as eager has it, and is not refused; assigning the
object already there (``self.ema = self.ema``, tying already tied weights) is eager's
no-op and passes.
"""

from __future__ import annotations

import contextlib
from typing import Any
from unittest import mock

import torch

from ..errors import SourceLocation, SPMDCompileError, innermost_model_frame_of_stack
from .bindings import StepBindings


class RegistrationsWatched(contextlib.AbstractContextManager):
    """While entered: where each parameter or buffer of a name new to its module was
    registered (``first`` holds the first's line), where each parameter was registered
    (``rebound``, by module and name: NOTE: [parameters rebound in the step]), and which
    entries of ``modules``' ``__dict__`` hid a parameter or buffer before."""

    def __init__(self, modules: list[torch.nn.Module] | None = None) -> None:
        self.first: SourceLocation | None = None
        self.rebound: dict[tuple[int, str], SourceLocation | None] = {}
        self.hidden_before = {(id(sub), name) for _, sub, name in _hidden_state(modules or [])}
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> RegistrationsWatched:
        for method in ("register_parameter", "register_buffer"):
            real = getattr(torch.nn.Module, method)
            self._stack.enter_context(mock.patch.object(torch.nn.Module, method, self._noting(real, method)))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    def _noting(self, real: Any, method: str) -> Any:
        def register(module: torch.nn.Module, name: str, *args: Any, **kwargs: Any) -> Any:
            new = name not in module._parameters and name not in module._buffers
            key = (id(module), name)
            if (self.first is None and new) or (method == "register_parameter" and key not in self.rebound):
                where = innermost_model_frame_of_stack()
                self.first = self.first or (where if new else None)
                if method == "register_parameter":
                    self.rebound.setdefault(key, where)
            return real(module, name, *args, **kwargs)

        return register


def refuse_state_registered(
    bindings: StepBindings, watched: RegistrationsWatched, step_line: str, params: dict[str, torch.Tensor]
) -> None:
    """Refuse a step that left a module given to it with other parameter or buffer
    names than the capture bound (see the NOTE), or with a parameter that is not the
    tensor the capture put there (``params``, by name: NOTE: [parameters rebound in the
    step])."""
    added: list[str] = []
    removed: list[str] = []
    for mi, mod in enumerate(bindings.modules):
        prefix = "" if len(bindings.modules) == 1 else f"{mi}."
        for kind, found, now in (
            ("parameter", bindings.module_params[mi], _names(mod, "_parameters")),
            ("buffer", bindings.module_buffers[mi], _names(mod, "_buffers")),
        ):
            added += [f"{kind} {prefix}{fqn}" for fqn in now if fqn not in found]
            removed += [f"{kind} {prefix}{fqn}" for fqn in found if fqn not in now]
    if not added and not removed:
        _refuse_rebound(bindings, watched, step_line, params)
        return
    changes = "; ".join(
        part for part in (
            f"registers {', '.join(added)}" if added else "",
            f"takes away {', '.join(removed)}" if removed else "",
        ) if part
    )
    raise SPMDCompileError(
        f"The train step changes which parameters and buffers the model has: it {changes} "
        "(torch.nn.utils.prune, register_buffer or register_parameter inside the step). A "
        "compiled step's program holds the parameters and buffers the model had when it was "
        "captured and runs no Python, so it cannot register them on every call. Nothing of "
        "this call was applied: the model's parameters, buffers and hooks are as the call "
        "found them (NOTE: [state registered in the step]).",
        user_line=watched.first or step_line,
        hint="prune or register before the first call or between calls, outside the compiled "
        "step (`prune.l1_unstructured(model[0], 'weight', amount=0.3)` there: its mask is a "
        "buffer the program applies on every call; pruning between calls compiles the step "
        "again), and register buffers and parameters in the module's __init__.",
    )


def _refuse_rebound(
    bindings: StepBindings, watched: RegistrationsWatched, step_line: str, params: dict[str, torch.Tensor]
) -> None:
    """NOTE: [parameters rebound in the step]: refuse a parameter the step put a new
    object under, or a parameter or buffer it hid by a ``__dict__`` entry."""
    for mi, mod in enumerate(bindings.modules):
        prefix = "" if len(bindings.modules) == 1 else f"{mi}."
        for path, sub in mod.named_modules(remove_duplicate=False):
            dot = path + "." if path else ""
            for attr, t in sub._parameters.items():
                name = bindings.module_params[mi].get(dot + attr)
                if t is not None and name is not None and t is not params[name]:
                    _refuse(
                        f"parameter {prefix}{dot}{attr}", prefix + path, sub, attr,
                        watched.rebound.get((id(sub), attr)) or step_line,
                        "puts a new object under it. Eager then trains another object from the "
                        "next call on: the module holds the new one, an optimizer built before "
                        "holds the old one, which gets no gradient",
                    )
    for path, sub, attr in _hidden_state(bindings.modules):
        if (id(sub), attr) not in watched.hidden_before:
            kind = "parameter" if attr in sub._parameters else "buffer"
            _refuse(
                f"{kind} {path}{'.' if path else ''}{attr}", path, sub, attr, step_line,
                f"hides it behind an entry of the module's __dict__ (`self.__dict__['{attr}'] = "
                f"...` or object.__setattr__). Eager then reads the entry as `self.{attr}`, while "
                f"the model's state (parameters(), state_dict()) keeps the old {kind}",
            )


def _refuse(what: str, path: str, sub: torch.nn.Module, attr: str, where: SourceLocation | str, why: str) -> None:
    ref = f"self.{attr}"
    if isinstance(sub, (torch.nn.ParameterList, torch.nn.ParameterDict)):
        held = path.rpartition(".")[2] or "params"
        ref = f"self.{held}[{attr if isinstance(sub, torch.nn.ParameterList) else repr(attr)}]"
    raise SPMDCompileError(
        f"The train step rebinds {what} (attribute {attr} of {type(sub).__name__}): it "
        f"{why}. A compiled step's program updates in place the parameters and buffers the "
        "model had when it was captured and runs no Python, so it would silently keep the "
        "old one. Nothing of this call was applied: the model's parameters, buffers and "
        "hooks are as the call found them (NOTE: [parameters rebound in the step]).",
        module_fqn=path,
        user_line=where,
        hint=f"change the tensor already there in place: `with torch.no_grad(): {ref}.copy_(new)`; "
        "a value that is not trained (an EMA) is better a buffer (register_buffer in __init__; "
        "a buffer given a new tensor in the step is kept), and weights are tied in __init__, "
        "before the first call, not inside the step.",
    )


def _hidden_state(modules: list[torch.nn.Module]) -> list[tuple[str, torch.nn.Module, str]]:
    """(FQN, submodule, name) for each entry of a submodule's ``__dict__`` named as one
    of its parameters or buffers (FQNs prefixed ``0.`` where there are several modules)."""
    return [
        (("" if len(modules) == 1 else f"{mi}.") + path, sub, name)
        for mi, mod in enumerate(modules)
        for path, sub in mod.named_modules()
        for name in sorted(vars(sub).keys() & (sub._parameters.keys() | sub._buffers.keys()))
    ]


def _names(mod: torch.nn.Module, table: str) -> dict[str, None]:
    """The FQNs of ``mod``'s parameters (``table="_parameters"``) or buffers, repeats
    included, as the capture's walk names them."""
    out: dict[str, None] = {}
    for path, sub in mod.named_modules(remove_duplicate=False):
        dot = path + "." if path else ""
        for attr, t in getattr(sub, table).items():
            if t is not None:
                out[dot + attr] = None
    return out


__all__ = ["RegistrationsWatched", "refuse_state_registered"]
