"""The hook dicts of a step's modules and optimizers, put back after a refused capture.

NOTE: [hooks a refused step registered]
A step that registers a hook (``model[0].register_forward_hook(fn)`` on every call) is
refused: the number of hooks changes every call (NOTE: [guards on Python values]). The
capture runs the step's Python, once or twice (NOTE: [a step that changes what it
reads]), on the user's modules, so before the fifty-ninth session the refused call left
the hooks it registered behind (two forward hooks on ``model[0]``, which had none) and
changed the model's eager output afterwards, though the error said nothing ran. Now
every hook dict (forward, forward-pre, backward, backward-pre, state-dict and load
hooks, and the kwargs / always-called sets of the forward ones) of the step's modules
and of the modules it reaches by name (a global or closure criterion, a module a hook
or a helper function names: every module the walk of NOTE: [tensors the step keeps]
meets), of its optimizers (step, state-dict and load hooks) and torch's global module
and optimizer hook dicts are copied (shallowly: a few dict copies per submodule; with
the walk that finds the modules, 35 ms per compile for a 385-module model, 2 ms
before) before a compile and, if the compile fails, set back to what they held, in place; so is each
module's ``_is_full_backward_hook`` flag, which ``register_full_backward_hook`` sets
(left ``True``, a later ``register_backward_hook`` raised torch's "Cannot use both
regular backward hooks and full backward hooks"). Until a review of the fifty-ninth
session only the modules passed to the step were put back: a step registering a forward
hook on a global ``crit = nn.CrossEntropyLoss()`` left 8 on it, and its eager loss went
from 1.376 to 352.3. A compile that succeeds keeps what the step registered, as eager
would. What is not put back: a Python side effect of the hook itself (a counter in a
closure dict), NOTE: [Python effects at capture]; a module reached only deeper than the
walk goes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .. import _torch_private as private
from .bindings import StepBindings
from .kept_tensors import KeptTensors

_FULL_BACKWARD = "_is_full_backward_hook"
# the items of each hook dict and each module's full-backward flag (``HooksAsFound.now``)
HookState = tuple[list[tuple[dict, list[tuple[Any, Any]]]], list[tuple[torch.nn.Module, Any]]]


def _hook_dicts(obj: Any) -> list[dict]:
    """The hook dicts an nn.Module or optimizer keeps in its ``__dict__``."""
    return [
        value for key, value in vars(obj).items()
        if "hook" in key and isinstance(value, dict)
    ]


class HooksAsFound:
    """The hook dicts the step can change, as a compile found them; ``put_back``
    after a failed one."""

    def __init__(self, func: Callable[..., Any], bindings: StepBindings) -> None:
        dicts: list[dict] = [hooks for _, hooks in private.global_hook_dicts()]
        reached = KeptTensors(func, bindings, bindings.call).reached_modules.values()
        modules: dict[int, torch.nn.Module] = {}
        for mod in (*bindings.modules, *reached):
            for sub in mod.modules():
                modules.setdefault(id(sub), sub)
        for sub in modules.values():
            dicts += _hook_dicts(sub)
        for opt in bindings.optimizers:
            dicts += _hook_dicts(opt)
        self.dicts = dicts
        self.modules = list(modules.values())
        # each module attribute holding a hook's handle (``self.h = register_...``), which
        # a step removing the hook sets to None: put back with the hooks
        self.handles = [(vars(sub), key, value) for sub in self.modules for key, value in vars(sub).items()
                        if isinstance(value, torch.utils.hooks.RemovableHandle)]
        self.found = self.now()
        self.started = self.found  # the user's hooks as the trace running started (``note_start``)
        # NOTE: [state registered in the step]: each module's parameter and buffer tables
        self.tables: list[tuple[dict[str, Any], list[tuple[str, Any]]]] = [
            (table, list(table.items()))
            for sub in self.modules for table in (vars(sub).get("_parameters"), vars(sub).get("_buffers"))
            if isinstance(table, dict)  # a TorchScript module's are torch._C mappings (refused)
        ]
        self.non_persistent = [(sub, set(names)) for sub in self.modules
                               if isinstance(names := vars(sub).get("_non_persistent_buffers_set"), set)]
        # id -> (module, its user's hooks) at its first call in the trace running
        # (``calls_noted``; NOTE: [set-ups a later trace cannot start without] in trace.py)
        self.called: dict[int, tuple[torch.nn.Module, _ModuleHooks]] = {}

    def now(self) -> HookState:
        """The user's hooks now: the items of each hook dict but the compiler's own
        (``_ours``), and each module's full-backward flag."""
        ours = self._our_keys()
        return ([(d, [(k, v) for k, v in d.items() if k not in ours]) for d in self.dicts],
                [(sub, vars(sub).get(_FULL_BACKWARD)) for sub in self.modules])

    def put_back(self, state: HookState | None = None) -> None:
        """Set the user's hooks and the flags back to ``state`` (``now``'s), by default
        to what the compile found; the compiler's own hooks registered now (the
        capture's module hooks naming scopes, NOTE: [calling a placed model directly])
        stay, after the user's."""
        found, flags = self.found if state is None else state
        ours = self._our_keys()
        for d, items in found:
            want = items + [(k, v) for k, v in d.items() if k in ours]
            if len(d) != len(want) or any(
                k not in d or d[k] is not v for k, v in want
            ) or list(d) != [k for k, _ in want]:
                d.clear()
                d.update(want)
        for sub, flag in flags:
            if vars(sub).get(_FULL_BACKWARD) is not flag:
                vars(sub)[_FULL_BACKWARD] = flag
        for d, key, handle in self.handles if state is None else ():
            if d.get(key) is not handle:
                d[key] = handle

    def put_back_tables(self) -> None:
        """Set each module's parameter and buffer tables whose names a refused step
        changed back to what the compile found (NOTE: [state registered in the step]);
        tables of the same names are left alone (a compile places no state, but a
        value swapped in them is not the step's to undo here)."""
        for table, items in self.tables:
            if list(table) != [k for k, _ in items]:
                table.clear()
                table.update(items)
        for sub, names in self.non_persistent:
            if sub._non_persistent_buffers_set != names:
                sub._non_persistent_buffers_set.clear()
                sub._non_persistent_buffers_set.update(names)

    def user_changed(self) -> bool:
        """Whether the user's hooks differ from what the compile found (a trace
        registered or removed one)."""
        return _differ(self.now(), self.found)

    def note_start(self) -> None:
        """A trace starts from the user's hooks as they are now (``changed_after_call``)."""
        self.started = self.now()

    @contextlib.contextmanager
    def calls_noted(self) -> Iterator[None]:
        """While it runs, note the user's forward / backward hooks of each module these
        hook dicts follow as it is first called in a trace (``called``, emptied by
        ``changed_after_call``): a dict lookup per module call, while tracing only."""
        followed = {id(sub) for sub in self.modules}
        called = self.called

        def note_call(module: torch.nn.Module, args: Any) -> None:
            if id(module) in followed and id(module) not in called:
                called[id(module)] = (module, _module_hooks(module))

        handle = torch.nn.modules.module.register_module_forward_pre_hook(note_call)
        try:
            yield
        finally:
            handle.remove()
            called.clear()

    def changed_after_call(self) -> tuple[torch.nn.Module, str, Any, bool] | None:
        """(module, hook dict, hook, whether registered) of a user's forward / backward
        hook that a module called in the trace that ended had not at its first call but
        has now (registered after the module ran), or had then but not now (removed);
        None if none, or if the trace ended with the hooks it started with (a hook
        registered before the forward and removed after it: the next trace starts as
        this one did). Starts the notes of the next trace."""
        try:
            if not _differ(self.now(), self.started):
                return None
            for module, then in self.called.values():
                now = _module_hooks(module)
                if now == then:
                    continue
                for (name, was), (_, is_) in zip(then, now, strict=True):
                    changed = [(hook, (key, hook) in is_) for key, hook in (*was, *is_)
                               if (key, hook) not in was or (key, hook) not in is_]
                    if changed:
                        return module, name, *changed[0]
            return None
        finally:
            self.called.clear()

    def _our_keys(self) -> set[Any]:
        """The handle ids of the compiler's own hooks in the dicts (a hook's id keys it
        in its ``with_kwargs`` / ``always_call`` dicts too)."""
        return {k for d in self.dicts for k, v in d.items() if _ours(v)}


def _differ(state: HookState, other: HookState) -> bool:
    """Whether two ``HooksAsFound.now`` of the same dicts hold other user's hooks."""
    return any(len(a) != len(b) or any(ka != kb or va is not vb for (ka, va), (kb, vb) in zip(a, b, strict=True))
               for (_, a), (_, b) in zip(state[0], other[0], strict=True))


_FORWARD_BACKWARD = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
# each forward / backward hook dict's name and its user's (key, hook) items
_ModuleHooks = tuple[tuple[str, tuple[tuple[Any, Any], ...]], ...]


def _module_hooks(module: torch.nn.Module) -> _ModuleHooks:
    d = vars(module)
    return tuple((name, tuple((k, v) for k, v in hooks.items() if not _ours(v)))
                 for name in _FORWARD_BACKWARD if isinstance(hooks := d.get(name), dict))


def _ours(hook: Any) -> bool:
    """Whether ``hook`` is the compiler's own function (not the user's)."""
    fn = getattr(hook, "func", hook)  # a functools.partial
    module = getattr(fn, "__module__", None)
    return isinstance(module, str) and module.split(".")[0] in _OUR_PACKAGES


_OUR_PACKAGES = frozenset({"spmd_compiler", "parallel_modes", "passes"})


__all__ = ["HookState", "HooksAsFound"]
