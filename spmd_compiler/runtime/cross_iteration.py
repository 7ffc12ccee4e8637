"""Cut a program with deferred reductions into the three programs the runtime runs.

NOTE: [cross-iteration overlap] (``passes/cross_iteration_overlap.py``) says what is
deferred and why. Here the marked program P (inputs I, outputs O) becomes:

- ``first``:  I -> O', C. P without the deferred part D. Each output D produced (a new
  parameter or optimizer state) is the unchanged input instead, and C (the *carry*) lists
  every value D reads that it does not compute (the un-waited reductions, the old state,
  the learning rate, intermediate values), in graph order.
- ``finish``: C -> the outputs D produces. D alone.
- ``steady``: I, C_prev -> O, C. D on the previous call's carry, then P without D, where
  every read of a state input D updates reads D's new value. D's nodes are then moved
  down to just before their first use, so the wait and each parameter's update happen
  where the forward first needs that parameter.

Running ``first``, then ``steady`` on every later call, then ``finish`` computes exactly
what running P on every call computes: each step's D runs on that step's own values.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch.fx

from ..errors import SPMDCompileError
from ..ir.collectives import deferred_part
from ..ir.graph_utils import output_args, placeholders


@dataclass
class DeferredPlan:
    """The programs of a step with a deferred part (see the module docstring).

    ``positions`` are the indices in the step's outputs that ``finish`` produces (in that
    order); ``carry_count`` is how many values ``first`` and ``steady`` append to the
    step's outputs and ``steady`` and ``finish`` read after the step's inputs."""

    first: torch.fx.GraphModule
    steady: torch.fx.GraphModule
    finish: torch.fx.GraphModule
    positions: tuple[int, ...]
    carry_count: int
    deferred_nodes: int


def split_program(program: Any) -> DeferredPlan | None:
    """The three programs of ``program`` (a ``DistributedProgram``), or None when no
    reduction is marked deferred."""
    gm = program.graph_module
    graph = gm.graph
    part = deferred_part(graph)
    if not part:
        return None
    if program.captured.checks:
        raise SPMDCompileError(
            "cross_iteration_overlap defers part of each step's update into the next call, "
            "but this step has checks on tensor values (NOTE: [value checks]): a check that "
            f"fails (at {program.captured.checks[0].where}) must leave the state of the last "
            "completed step, and part of that step's update would be in the failed call.",
            hint="drop cross_iteration_overlap for this step, or the check.",
        )
    in_part = set(part)
    carried = _carried_values(graph, in_part)
    outs = output_args(gm)
    positions = tuple(j for j, v in enumerate(outs) if v in in_part)
    input_of = dict(zip([ref for ref, _ in program.captured.inputs], placeholders(gm), strict=True))
    replaced_input = {}
    for j in positions:
        ref = program.captured.outputs[j]
        if ref not in input_of:
            raise SPMDCompileError(
                f"cross_iteration_overlap deferred output {ref}, which is not an input of "
                "the step; this is a bug in the pass."
            )
        replaced_input[j] = input_of[ref]

    first = torch.fx.Graph()
    env = _copy_nodes(graph, first, skip=in_part)
    first.output(tuple(
        [env[replaced_input[j]] if j in replaced_input else _mapped(v, env) for j, v in enumerate(outs)]
        + [env[c] for c in carried]
    ))

    finish = torch.fx.Graph()
    env = {c: _placeholder_like(finish, c, f"carry_{k}") for k, c in enumerate(carried)}
    _copy_part(part, finish, env)
    finish.output(tuple(env[outs[j]] for j in positions))

    steady = torch.fx.Graph()
    env = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            env[node] = steady.node_copy(node, lambda a: env[a])
    part_env = {c: _placeholder_like(steady, c, f"carry_{k}") for k, c in enumerate(carried)}
    part_nodes = _copy_part(part, steady, part_env)
    for j, placeholder in replaced_input.items():
        env[placeholder] = part_env[outs[j]]
    _copy_nodes(graph, steady, skip=in_part, env=env)
    steady.output(tuple(
        [part_env[v] if j in replaced_input else _mapped(v, env) for j, v in enumerate(outs)]
        + [env[c] for c in carried]
    ))
    _sink_to_first_use(steady, part_nodes)

    modules = []
    for g in (first, steady, finish):
        g.lint()
        modules.append(torch.fx.GraphModule(gm, g))
    first_gm, steady_gm, finish_gm = modules
    return DeferredPlan(first_gm, steady_gm, finish_gm, positions, len(carried), len(part))


def _carried_values(graph: torch.fx.Graph, in_part: set[torch.fx.Node]) -> list[torch.fx.Node]:
    needed = {a for n in in_part for a in n.all_input_nodes if a not in in_part}
    return [n for n in graph.nodes if n in needed]


def _mapped(value: Any, env: dict) -> Any:
    return env[value] if isinstance(value, torch.fx.Node) else value


def _copy_nodes(
    source: torch.fx.Graph, target: torch.fx.Graph, skip: set, env: dict | None = None
) -> dict:
    env = {} if env is None else env
    for node in source.nodes:
        if node in skip or node.op == "output" or node in env:
            continue
        env[node] = target.node_copy(node, lambda a: env[a])
    return env


def _copy_part(part: list[torch.fx.Node], target: torch.fx.Graph, env: dict) -> list[torch.fx.Node]:
    copies = []
    for node in part:
        env[node] = target.node_copy(node, lambda a: env[a])
        copies.append(env[node])
    return copies


def _placeholder_like(graph: torch.fx.Graph, node: torch.fx.Node, name: str) -> torch.fx.Node:
    placeholder = graph.placeholder(name)
    if "val" in node.meta:
        placeholder.meta["val"] = node.meta["val"]
    return placeholder


def _sink_to_first_use(graph: torch.fx.Graph, nodes: list[torch.fx.Node]) -> None:
    """Move each node (last first) to just before its earliest user: a deferred update
    runs where the step first reads its result, not at the start."""
    position = {n: Fraction(i) for i, n in enumerate(graph.nodes)}
    for node in reversed(nodes):
        first = min(node.users, key=position.__getitem__, default=None)
        if first is None or first is node.next:
            continue
        first.prepend(node)
        position[node] = (position[node.prev] + position[first]) / 2
