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
    registered (``first`` holds the first's line)."""

    def __init__(self) -> None:
        self.first: SourceLocation | None = None
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> RegistrationsWatched:
        for method in ("register_parameter", "register_buffer"):
            real = getattr(torch.nn.Module, method)
            self._stack.enter_context(mock.patch.object(torch.nn.Module, method, self._noting(real)))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    def _noting(self, real: Any) -> Any:
        def register(module: torch.nn.Module, name: str, *args: Any, **kwargs: Any) -> Any:
            if self.first is None and name not in module._parameters and name not in module._buffers:
                self.first = innermost_model_frame_of_stack()
            return real(module, name, *args, **kwargs)

        return register


def refuse_state_registered(bindings: StepBindings, watched: RegistrationsWatched, step_line: str) -> None:
    """Refuse a step that left a module given to it with other parameter or buffer
    names than the capture bound (see the NOTE)."""
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
