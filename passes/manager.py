"""The pass manager: ordered passes over the per-rank program, with checks in between.

NOTE: [pass contract]
A pass is a function ``(program, context) -> bool`` (whether it changed the graph) with a
name, a one-line description and ordering constraints. Passes register with
``@register_pass``; the default pipeline is ``DEFAULT_PIPELINE`` below, one ordered list.
Any pass can be disabled by name (``PassOptions.disabled`` or the environment variable
``SPMD_DISABLE_PASSES=a,b``). With ``PassOptions.check`` (on in tests and debug runs)
the manager lints the graph after every pass and checks that every collective is waited
before its first use; a failure names the pass and the passes that ran before it. Nodes
a pass creates carry its name in ``node.meta[CREATED_BY]``.
"""

from __future__ import annotations

import logging
import operator
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.fx

from spmd_compiler.errors import CREATED_BY

if TYPE_CHECKING:
    from spmd_compiler.expand import DistributedProgram

log = logging.getLogger("spmd_compiler.passes")

PassFn = Callable[["DistributedProgram", "PassContext"], bool]


@dataclass(frozen=True)
class PassOptions:
    """Options bound when a pipeline is built.

    Args:
        disabled: names of passes to skip.
        check: lint and collective checks after every pass.
    """

    disabled: frozenset[str] = frozenset()
    check: bool = True

    def with_env(self) -> PassOptions:
        env = {n.strip() for n in os.environ.get("SPMD_DISABLE_PASSES", "").split(",") if n.strip()}
        return PassOptions(disabled=self.disabled | env, check=self.check)


@dataclass(frozen=True)
class Pass:
    name: str
    description: str
    fn: PassFn
    after: tuple[str, ...] = ()
    before: tuple[str, ...] = ()


@dataclass
class PassContext:
    options: PassOptions
    ran: list[str] = field(default_factory=list)


_REGISTRY: dict[str, Pass] = {}


def register_pass(
    name: str, description: str, *, after: tuple[str, ...] = (), before: tuple[str, ...] = ()
) -> Callable[[PassFn], PassFn]:
    """Decorator: register ``fn`` as the pass ``name``."""

    def wrap(fn: PassFn) -> PassFn:
        _REGISTRY[name] = Pass(name, description, fn, tuple(after), tuple(before))
        return fn

    return wrap


def registered_passes() -> dict[str, Pass]:
    return dict(_REGISTRY)


class PassFailure(RuntimeError):
    """A pass broke the program; names the pass and what ran before it."""


COLLECTIVE_NAMESPACE = "_c10d_functional"


def is_collective(node: torch.fx.Node) -> bool:
    return (
        node.op == "call_function"
        and getattr(node.target, "namespace", None) == COLLECTIVE_NAMESPACE
        and "wait_tensor" not in str(node.target)
    )


def is_wait(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and "wait_tensor" in str(node.target)


def check_program(gm: torch.fx.GraphModule) -> None:
    """Graph lint, and every collective's result waited before any other use."""
    gm.graph.lint()
    for node in gm.graph.nodes:
        if not is_collective(node):
            continue
        waits = [u for u in node.users if is_wait(u)]
        if len(waits) != 1:
            raise AssertionError(f"collective {node.name} has {len(waits)} waits (want 1)")
        others = [u for u in node.users if not is_wait(u) and u.target is not operator.getitem]
        if others:
            raise AssertionError(
                f"collective {node.name} is used by {others[0].name} without a wait"
            )


def run_pipeline(
    program: DistributedProgram,
    options: PassOptions,
    pipeline: tuple[str, ...] | None = None,
) -> DistributedProgram:
    """Run ``pipeline`` (default: ``DEFAULT_PIPELINE``) over ``program`` in place."""
    from . import DEFAULT_PIPELINE

    options = options.with_env()
    context = PassContext(options)
    gm = program.graph_module
    for name in pipeline if pipeline is not None else DEFAULT_PIPELINE:
        if name in options.disabled:
            log.debug("pass %s disabled", name)
            continue
        p = _REGISTRY[name]
        before_nodes = set(gm.graph.nodes)
        start = time.perf_counter()
        changed = p.fn(program, context)
        elapsed = time.perf_counter() - start
        for node in gm.graph.nodes:
            if node not in before_nodes:
                node.meta.setdefault(CREATED_BY, name)
        if options.check:
            try:
                check_program(gm)
            except Exception as exc:
                raise PassFailure(
                    f"pass {name!r} broke the program: {exc} "
                    f"(passes run before it: {context.ran or 'none'})"
                ) from exc
        context.ran.append(name)
        program.passes_applied.append(name)
        program.pass_seconds[name] = elapsed
        log.debug("pass %-28s %s %.4fs", name, "changed" if changed else "no-op", elapsed)
    gm.recompile()
    return program
