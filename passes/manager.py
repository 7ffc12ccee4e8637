"""The pass manager: ordered passes over the per-rank program, with checks in between.

NOTE: [pass contract]
A pass is a function ``(program, context) -> bool`` (whether it changed the graph),
registered with ``@register_pass(name, description, after=..., before=..., requires=...,
ensures=..., options=..., changes_collectives=...)``. Packages register passes through the
entry-point group ``spmd_compiler.passes`` (see ``registry.py``).

- Order: the pipeline is ``DEFAULT_PIPELINE`` (``passes/__init__.py``, one ordered list)
  plus the user's ``extra_passes``, minus disabled passes (``PassOptions.disabled``,
  ``SPMD_DISABLE_PASSES=a,b``), sorted topologically by every pass's ``after``/``before``
  (constraints on passes that are not in the pipeline are ignored): of the passes whose
  constraints are met, the earliest in the list runs next.
  A cycle or an unknown name is a ``PipelineError``.
- Options: a pass may declare a frozen dataclass of options; ``PassOptions.pass_options``
  maps pass names to instances (or dicts of fields). They are bound when the pipeline is
  built and reach the pass as ``context.options``; nothing is kept between compiles.
- Checks (``PassOptions.check``; always with ``SPMD_DEBUG``), after every pass: the returned
  flag is a bool and "no change" means the graph is untouched; graph lint; every op node
  the pass made has its value in ``meta["val"]`` (one it did not set is computed from its
  inputs' values: ``checks.record_values``); every collective
  waited before its first use; the collective sequence (op, group, payload shapes) is
  unchanged unless the pass declares ``changes_collectives=True``; the pass's ``ensures``.
  Its ``requires`` run before it. With ``PassOptions.verify_numerics`` in a simulation the
  program's outputs on fixed random inputs must stay the same. A failure is a
  ``PassFailure`` naming the pass and the passes that ran before it.
- Nodes a pass creates carry its name in ``node.meta[CREATED_BY]``.
- Debugging: ``SPMD_DEBUG=1|2|3`` (see ``debug.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch.fx

from spmd_compiler import progress
from spmd_compiler.errors import SPMDCompileError
from spmd_compiler.ir.node_meta import CREATED_BY, PLACEMENT

from .checks import (
    CheckFailed,
    PassGuard,
    check_program,
    graph_fingerprint,
    is_collective,
    is_wait,
    record_values,
)
from .cost_model import CostModel
from .debug import DebugSession, PassRecord
from .registry import (
    ENTRY_POINT_GROUP,
    Pass,
    PassFn,
    PipelineError,
    get_pass,
    load_plugins,
    pass_names,
    register_pass,
    registered_passes,
    resolve_passes,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from spmd_compiler.expand.retrace import DistributedProgram

__all__ = [
    "ENTRY_POINT_GROUP",
    "BoundPass",
    "Pass",
    "PassContext",
    "PassFailure",
    "PassFn",
    "PassOptions",
    "PipelineError",
    "build_pipeline",
    "check_program",
    "describe_pipeline",
    "is_collective",
    "is_wait",
    "load_plugins",
    "register_pass",
    "registered_passes",
    "run_pipeline",
]

log = logging.getLogger("spmd_compiler.passes")

DISABLE_ENV = "SPMD_DISABLE_PASSES"


@dataclass(frozen=True)
class PassOptions:
    """Options bound when a pipeline is built.

    Args:
        disabled: names of passes to skip (``SPMD_DISABLE_PASSES=a,b`` adds to them).
        check: lint, collective and declared checks after every pass.
        verify_numerics: in a simulation, run the program on fixed random inputs before
            and after every pass and compare the outputs (slow; for tests and debugging).
        extra_passes: registered passes to add to the default pipeline (third-party passes
            run only when named here); they are placed by their ``after``/``before``.
        pass_options: pass name -> that pass's options (an instance of the frozen dataclass
            the pass declares, or a dict of its fields).
        cost_model: what passes use to estimate the time of collectives.
    """

    disabled: frozenset[str] = frozenset()
    check: bool = True
    verify_numerics: bool = False
    extra_passes: tuple[str, ...] = ()
    pass_options: Mapping[str, Any] = field(default_factory=dict, hash=False)
    cost_model: CostModel = field(default_factory=CostModel)

    def __post_init__(self) -> None:
        # Frozen means frozen: a caller's dict must not change the options afterwards. A
        # lone name (extra_passes="my_pass") is one name, not a sequence of letters.
        object.__setattr__(self, "disabled", frozenset(pass_names(self.disabled)))
        object.__setattr__(self, "extra_passes", pass_names(self.extra_passes))
        object.__setattr__(self, "pass_options", MappingProxyType(dict(self.pass_options)))

    def with_env(self) -> PassOptions:
        """These options plus the passes disabled by ``SPMD_DISABLE_PASSES``."""
        env = {n.strip() for n in os.environ.get(DISABLE_ENV, "").split(",") if n.strip()}
        return dataclasses.replace(self, disabled=self.disabled | env)


@dataclass(frozen=True)
class PassContext:
    """What a pass gets besides the program.

    Attributes:
        program: the per-rank program (``program.graph_module``, ``program.mesh``).
        name: the running pass's name.
        options: the pass's own options (an instance of its declared dataclass), or None.
        cost_model: alpha-beta estimates of collective times.
        ran: the passes that ran before this one, in order.
        pipeline_options: the options of the whole pipeline.
        bound_options: pass name -> bound options, for every pass of this pipeline.
    """

    program: DistributedProgram
    name: str
    options: Any
    cost_model: CostModel
    ran: tuple[str, ...]
    pipeline_options: PassOptions
    bound_options: Mapping[str, Any] = field(default_factory=dict)

    def pass_options(self, name: str | None = None) -> Any:
        """The bound options of pass ``name`` in this pipeline (default: this pass)."""
        return self.bound_options.get(name or self.name)

    @property
    def mesh(self) -> DeviceMesh:
        return self.program.mesh

    @property
    def world_size(self) -> int:
        return self.program.mesh.size()

    def placement(self, node: torch.fx.Node) -> Any:
        """The placements of the value ``node`` computes (None where unknown)."""
        return node.meta.get(PLACEMENT)


@dataclass(frozen=True)
class BoundPass:
    """A pass in a built pipeline, with its options bound."""

    spec: Pass
    options: Any

    @property
    def name(self) -> str:
        return self.spec.name


class PassFailure(SPMDCompileError):
    """A pass broke the program; names the pass, the failed check and what ran before it."""

    def __init__(self, pass_name: str, ran_before: Sequence[str], check: str, problem: str) -> None:
        self.pass_name, self.ran_before, self.check = pass_name, tuple(ran_before), check
        before = ", ".join(ran_before) if ran_before else "none"
        spec = registered_passes().get(pass_name)
        where = f" (defined in {spec.fn.__module__})" if spec is not None else ""
        super().__init__(
            f"pass {pass_name!r} broke the program (passes run before it: {before})\n"
            f"  check:       {check}\n  problem:     {problem}",
            hint=f"disable the pass (disable_passes=({pass_name!r},) or "
            f"{DISABLE_ENV}={pass_name}) and report it to its author{where}; "
            "SPMD_DEBUG=3 dumps the graph before and after every pass.",
        )


# ------------------------------------------------------------------------------ building


def build_pipeline(
    options: PassOptions | None = None, pipeline: Sequence[str] | None = None
) -> list[BoundPass]:
    """The passes to run, in order, with their options bound.

    Args:
        options: disabled and extra passes, per-pass options (``SPMD_DISABLE_PASSES`` is
            not applied here; ``run_pipeline`` applies it).
        pipeline: the list to start from instead of ``DEFAULT_PIPELINE``.

    Raises:
        PipelineError: an unknown pass name, an ordering cycle, options of the wrong type.
    """
    from . import DEFAULT_PIPELINE

    options = options or PassOptions()
    base = tuple(pipeline) if pipeline is not None else DEFAULT_PIPELINE
    names = list(dict.fromkeys([*base, *options.extra_passes]))
    known = resolve_passes(names)
    resolve_passes(options.pass_options, needed_by="pass_options")
    # a misspelt name to disable only logged a warning and the pass ran, while misspelt
    # extra_passes / pass_options names were errors: an error too since 2026-12-06
    resolve_passes(sorted(options.disabled), needed_by="disable_passes (or SPMD_DISABLE_PASSES)")
    enabled = [known[n] for n in names if n not in options.disabled]
    ordered = order_passes(enabled)
    for name in set(options.pass_options) - {p.name for p in ordered} - options.disabled:
        log.warning(
            "options were given for pass %r, which is not in the pipeline; add it with "
            "extra_passes=(%r,) to run it",
            name,
            name,
        )
    return [BoundPass(p, _bind_options(p, options.pass_options.get(p.name))) for p in ordered]


def order_passes(passes: Sequence[Pass]) -> list[Pass]:
    """Topological order by ``after``/``before``; the given order breaks ties.

    Raises:
        PipelineError: a constraint names an unregistered pass, or the constraints cycle.
    """
    position = {p.name: i for i, p in enumerate(passes)}
    preds: dict[str, set[str]] = {p.name: set() for p in passes}
    for p in passes:
        for other in (*p.after, *p.before):
            get_pass(other, needed_by=f"the ordering constraints of pass {p.name!r}")
        preds[p.name].update(a for a in p.after if a in position)
        for b in p.before:
            if b in position:
                preds[b].add(p.name)
    ordered: list[Pass] = []
    done: set[str] = set()
    while len(ordered) < len(passes):
        ready = [p for p in passes if p.name not in done and preds[p.name] <= done]
        if not ready:
            raise PipelineError(
                "the ordering constraints of the passes form a cycle: "
                + " -> ".join(_find_cycle(preds, done))
                + " (each must run before the next); change their after=/before= or "
                "disable one of them."
            )
        first = min(ready, key=lambda p: position[p.name])
        ordered.append(first)
        done.add(first.name)
    return ordered


def _find_cycle(preds: dict[str, set[str]], done: set[str]) -> list[str]:
    path: list[str] = [next(n for n in preds if n not in done)]
    while path.count(path[-1]) < 2:
        path.append(min(preds[path[-1]] - done))
    start = path.index(path[-1])
    return list(reversed(path[start:]))


def _bind_options(spec: Pass, given: Any) -> Any:
    cls = spec.options
    if cls is None:
        if given is not None:
            raise PipelineError(f"pass {spec.name!r} takes no options, but {given!r} was given.")
        return None
    if given is None or isinstance(given, cls):
        return cls() if given is None else given
    if isinstance(given, Mapping):
        _check_field_types(spec.name, cls, given)
        try:
            return cls(**given)
        except (TypeError, ValueError) as exc:  # the options class's own checks, too
            raise PipelineError(f"options for pass {spec.name!r}: {exc}") from exc
    raise PipelineError(
        f"options for pass {spec.name!r} must be a {cls.__name__} (or a dict of its "
        f"fields), got {type(given).__name__}: {given!r}"
    )


# Field types checked on a dict of options: a dict's "no" for a bool is truthy, and "2"
# for a float fails deep inside the pass. Numbers stay interchangeable (cap_bytes=25e6);
# other annotations are left to the class.
_PLAIN_FIELD_TYPES: dict[type, tuple[type, ...]] = {
    bool: (bool,), int: (int, float), float: (int, float), str: (str,),
}


def _check_field_types(name: str, cls: type, given: Mapping[str, Any]) -> None:
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - an annotation we cannot resolve is not checked
        return
    for key, value in given.items():
        accepted = _PLAIN_FIELD_TYPES.get(hints.get(key))  # type: ignore[arg-type]
        if accepted is None:
            continue
        if not isinstance(value, accepted) or (isinstance(value, bool) and hints[key] is not bool):
            raise PipelineError(
                f"options for pass {name!r}: {key} must be of type {hints[key].__name__}, "
                f"got {type(value).__name__}: {value!r}"
            )


def describe_pipeline(options: PassOptions | None = None) -> str:
    """The pipeline as a table of contents: order, name, description."""
    bound = build_pipeline((options or PassOptions()).with_env())
    return "\n".join(f"{i:2d}. {b.name:<30} {b.spec.description}" for i, b in enumerate(bound, 1))


# ------------------------------------------------------------------------------- running


def run_pipeline(
    program: DistributedProgram,
    options: PassOptions | None = None,
    pipeline: Sequence[str] | None = None,
) -> DistributedProgram:
    """Run the pipeline (default: ``DEFAULT_PIPELINE`` + extras) over ``program`` in place.

    Args:
        program: the per-rank program; ``passes_applied`` and ``pass_seconds`` are
            appended to.
        options: see ``PassOptions``; ``SPMD_DISABLE_PASSES`` is added to ``disabled``.
        pipeline: the list to start from instead of ``DEFAULT_PIPELINE``.

    Raises:
        PipelineError: the pipeline cannot be built (see ``build_pipeline``).
        PassFailure: a pass raised, or broke a check.
    """
    options = (options or PassOptions()).with_env()
    passes = build_pipeline(options, pipeline)
    debug = DebugSession.from_env()
    if debug.level >= 1 and not options.check:  # debug runs always check
        options = dataclasses.replace(options, check=True)
    guard = _start_guard(program, options)
    bound_options = MappingProxyType({b.name: b.options for b in passes})
    ran: list[str] = []
    for index, bound in enumerate(passes, 1):
        progress.current().detail(bound.name)
        record = _run_pass(program, bound, index, ran, guard, debug, options, bound_options)
        debug.records.append(record)
        ran.append(bound.name)
    for name in sorted(options.disabled & set(registered_passes())):
        debug.records.append(PassRecord(name, registered_passes()[name].description))
    program.graph_module.recompile()
    debug.summary()
    return program


def _run_pass(
    program: DistributedProgram,
    bound: BoundPass,
    index: int,
    ran: list[str],
    guard: PassGuard,
    debug: DebugSession,
    options: PassOptions,
    bound_options: Mapping[str, Any],
) -> PassRecord:
    spec, gm = bound.spec, program.graph_module
    context = PassContext(
        program, spec.name, bound.options, options.cost_model, tuple(ran), options, bound_options
    )
    # a pass's seconds include the bookkeeping around it (the metadata of the nodes it
    # made, the checks): the sum is what the progress line's "passes" stage shows (the
    # pass alone left 3 of 11 s of a 16-layer fsdp compile unaccounted for)
    start = time.perf_counter()
    _guarded(spec, ran, guard.before, spec)
    existing = set(gm.graph.nodes)
    counts = debug.before(index, spec.name, gm)
    fingerprint = graph_fingerprint(gm) if guard.active else None
    try:
        changed = spec.fn(program, context)
    except SPMDCompileError:
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised naming the pass
        raise PassFailure(spec.name, ran, "the pass ran", f"{type(exc).__name__}: {exc}") from exc
    made = [node for node in gm.graph.nodes if node not in existing]
    for node in made:
        node.meta.setdefault(CREATED_BY, spec.name)
    try:
        record_values(made)
    except AssertionError as exc:
        if guard.active:
            raise PassFailure(spec.name, ran, "new nodes carry meta['val']", str(exc)) from exc
    debug.after(index, spec.name, gm, counts)
    _guarded(spec, ran, guard.after, spec, changed, fingerprint)
    elapsed = time.perf_counter() - start
    program.passes_applied.append(spec.name)
    program.pass_seconds[spec.name] = elapsed
    log.debug("pass %-28s %s %.4fs", spec.name, "changed" if changed else "no-op", elapsed)
    return PassRecord(spec.name, spec.description, elapsed, bool(changed))


def _start_guard(program: DistributedProgram, options: PassOptions) -> PassGuard:
    sim = None
    if options.verify_numerics:
        from spmd_compiler.runtime.simulate import active_simulation

        sim = active_simulation()
        if sim is None:
            log.warning("verify_numerics needs simulated ranks (spmd_compiler.simulate); skipped")
    try:
        return PassGuard(program, check=options.check or options.verify_numerics, simulation=sim)
    except CheckFailed as exc:
        raise PipelineError(f"the program fails a check before any pass ran: {exc}") from exc


def _guarded(spec: Pass, ran: list[str], check: Any, *args: Any) -> None:
    try:
        check(*args)
    except CheckFailed as exc:
        raise PassFailure(spec.name, ran, exc.check, exc.problem) from exc.__cause__
