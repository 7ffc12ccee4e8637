"""Registered passes: the ``@register_pass`` decorator and the entry-point plugins.

Built-in passes register when ``spmd_compiler.passes`` is imported. Installed packages
register theirs through the entry-point group ``spmd_compiler.passes``; each entry point
names a module (importing it runs its ``@register_pass`` decorators) or a registered pass
function::

    [project.entry-points."spmd_compiler.passes"]
    count_collectives = "my_package.passes"

Plugins are imported the first time a pipeline is built, and again when a pipeline names
a pass nobody registered yet (a package installed or put on ``sys.path`` later). A plugin
that fails to import is logged and skipped, so one broken package does not stop every
compile; naming one of its passes then reports the import error.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
import re
import types
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from spmd_compiler.errors import SPMDCompileError

from .checks import Check

if TYPE_CHECKING:
    from spmd_compiler.expand.retrace import DistributedProgram

    from .manager import PassContext

log = logging.getLogger("spmd_compiler.passes")

ENTRY_POINT_GROUP = "spmd_compiler.passes"

PassFn = Callable[["DistributedProgram", "PassContext"], bool]

_NAME = re.compile(r"[a-z][a-z0-9_]*\Z")


class PipelineError(SPMDCompileError):
    """The pipeline cannot be built: an unknown pass, a cycle, options of the wrong type."""


@dataclass(frozen=True)
class Pass:
    """A registered pass (see NOTE: [pass contract] in ``manager.py``)."""

    name: str
    description: str
    fn: PassFn
    after: tuple[str, ...] = ()
    before: tuple[str, ...] = ()
    requires: tuple[Check, ...] = ()
    ensures: tuple[Check, ...] = ()
    options: type | None = None
    changes_collectives: bool = False


_REGISTRY: dict[str, Pass] = {}


def register_pass(
    name: str,
    description: str,
    *,
    after: str | Sequence[str] = (),
    before: str | Sequence[str] = (),
    requires: Check | Sequence[Check] = (),
    ensures: Check | Sequence[Check] = (),
    options: type | None = None,
    changes_collectives: bool = False,
) -> Callable[[PassFn], PassFn]:
    """Decorator: register ``fn(program, context) -> bool`` as the pass ``name``.

    Args:
        name: verb_noun, lower case (``bucket_all_reduces``); used to order and disable.
        description: one line, shown in the pipeline listing.
        after / before: passes this one must run after / before when both are in the
            pipeline.
        requires / ensures: checks ``check(program)`` that raise AssertionError when unmet,
            run before / after the pass when the manager checks.
        options: a frozen dataclass with a default for every field; the bound instance
            reaches the pass as ``context.options``.
        changes_collectives: the pass may add, remove, merge or reorder collectives (the
            manager otherwise checks the collective sequence is unchanged).

    Raises:
        ValueError: a bad name, options that are not a frozen dataclass with defaults, or
            the name registered by another function.
    """
    if not _NAME.match(name):
        raise ValueError(f"pass name {name!r} must be lower-case verb_noun ([a-z][a-z0-9_]*)")
    if options is not None:
        _check_options_class(name, options)

    def wrap(fn: PassFn) -> PassFn:
        old = _REGISTRY.get(name)
        if old is not None and _origin(old.fn) != _origin(fn):
            raise ValueError(
                f"pass {name!r} is already registered by {_origin(old.fn)}; "
                f"{_origin(fn)} cannot register it again (choose another name)"
            )
        _REGISTRY[name] = Pass(
            name,
            description,
            fn,
            pass_names(after),
            pass_names(before),
            _checks(requires),
            _checks(ensures),
            options,
            changes_collectives,
        )
        return fn

    return wrap


def registered_passes() -> dict[str, Pass]:
    """Every pass registered so far, by name (plugins included once a pipeline was built)."""
    return dict(_REGISTRY)


def get_pass(name: str, needed_by: str = "the pipeline") -> Pass:
    """The registered pass ``name``, importing plugins if it is not known yet.

    Raises:
        PipelineError: no package registers ``name``.
    """
    return resolve_passes([name], needed_by)[name]


def resolve_passes(names: Iterable[str], needed_by: str = "the pipeline") -> dict[str, Pass]:
    """The registered passes ``names``; see ``get_pass``."""
    names = list(names)
    load_plugins()
    if any(n not in _REGISTRY for n in names):
        load_plugins(rescan=True)
    unknown = [n for n in names if n not in _REGISTRY]
    if unknown:
        failures = "".join(f"\n  plugin failed to load: {f}" for f in _PLUGINS.failures)
        raise PipelineError(
            f"unknown pass {unknown[0]!r} in {needed_by}; registered passes: "
            f"{', '.join(sorted(_REGISTRY)) or 'none'}{failures}",
            hint="check the spelling, or install the package that provides the pass "
            f"(it registers through the entry-point group {ENTRY_POINT_GROUP!r}).",
        )
    return {n: _REGISTRY[n] for n in names}


@dataclass
class _PluginState:
    # Process-wide like sys.modules: an entry point's module is imported once; what it
    # registers stays registered. No pass state lives here.
    scanned: bool = False
    loaded: set[str] = field(default_factory=set)
    failures: list[str] = field(default_factory=list)


_PLUGINS = _PluginState()


def load_plugins(rescan: bool = False) -> list[str]:
    """Import the pass plugins of installed packages; returns the entry points imported.

    Args:
        rescan: look for entry points again even if a pipeline was built before.
    """
    if _PLUGINS.scanned and not rescan:
        return []
    _PLUGINS.scanned = True
    imported = []
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        key = f"{ep.name} = {ep.value}"
        if key in _PLUGINS.loaded:
            continue
        _PLUGINS.loaded.add(key)
        try:
            target = ep.load()
        except Exception as exc:  # noqa: BLE001 - one broken plugin must not stop compiles
            _plugin_failed(key, ep, f"{type(exc).__name__}: {exc}")
            continue
        if not isinstance(target, types.ModuleType) and not any(
            p.fn is target for p in _REGISTRY.values()
        ):
            _plugin_failed(key, ep, f"{target!r} is neither a module nor a registered pass")
            continue
        imported.append(key)
        log.debug("loaded pass plugin %s", key)
    return imported


def _plugin_failed(key: str, ep: importlib.metadata.EntryPoint, why: str) -> None:
    dist = getattr(getattr(ep, "dist", None), "name", None) or "an installed package"
    message = f"entry point {key!r} of {dist}: {why}"
    _PLUGINS.failures.append(message)
    log.warning("pass plugin not loaded: %s", message)


def pass_names(value: str | Iterable[str]) -> tuple[str, ...]:
    """A tuple of pass names; a lone string is one name."""
    return (value,) if isinstance(value, str) else tuple(value)


def _checks(value: Check | Sequence[Check]) -> tuple[Check, ...]:
    return (value,) if callable(value) else tuple(value)  # type: ignore[arg-type]


def _origin(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _check_options_class(name: str, options: Any) -> None:
    if not (isinstance(options, type) and dataclasses.is_dataclass(options)):
        raise ValueError(f"options of pass {name!r} must be a dataclass, got {options!r}")
    if not options.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        raise ValueError(f"options of pass {name!r}: {options.__name__} must be frozen=True")
    try:
        options()
    except TypeError as exc:
        raise ValueError(
            f"options of pass {name!r}: every field of {options.__name__} needs a default ({exc})"
        ) from exc
