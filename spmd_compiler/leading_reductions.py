"""Take the program's leading all-reduces of values read off its inputs out of the program,
so that they ride the round in which the ranks compare their inputs.

NOTE: [reductions that ride the input check]
Every call on real ranks starts with a round in which the ranks compare their inputs'
shapes (NOTE: [same inputs on all ranks]): a small all-reduce that must end before the
program issues its first collective. Most train steps then issue a second small
all-reduce before the forward: the loss's total weight, the count of non-ignored targets,
read from the targets alone (NOTE: [ops decomposed at capture]). On gloo each round trip
costs about a millisecond on a busy 2-core machine (an all-reduce of 17 doubles issued
after a barrier: 1.4 ms alone, 0.29 ms left to wait after 1.35 ms of matmuls).

So on CPU the program is cut at the round (``split_leading_reductions``):

- ``prefix``: the all-reduces that can run before the program (a sum over the world
  group of at most ``MAX_SLOTS`` elements computed by a few pure ops from the step's
  tensor arguments alone: no state, constant, random draw or collective before it) leave
  the program; ``prefix``
  computes their operands and the runtime sends them in the round (float64 slots,
  summed).
- ``early``: what the program needs before its first wait on the round or on a
  collective and can compute by pure ops from the inputs alone (on a ddp step, the
  forward) runs while the round is in flight; the rest of what is computable from the
  inputs (an optimizer's decay of its state) stays in ``main``, fused into the update
  (``_early_nodes``). Views are not handed on: the rest computes them again, so no
  value passed between the parts shares an input's memory (state donation needs that).
- ``main``: the rest, taking the inputs, then the round's sums, then ``early``'s values.

The round's sum is taken in float64 and rounded back to the operand's dtype: exact for
counts (integers below 2**53), and for floating-point operands at least as accurate as
the collective's own sum in that dtype. The ranks agree on what the slots hold before
they read them: each sends a digest of the prefix next to the digest of its inputs, and a
round whose digests differ fails on every rank (``runtime/same_inputs.py``).

Measured (MLP-128 ddp, Inductor, 2 gloo ranks, medians of 300 steps, same launches as
torch DDP): 4.7-4.8 ms against 5.3-5.4 ms before (torch DDP 3.8-3.9 ms); the round's wait
left 0.35-0.41 ms on the step, the early part 0.45 ms. Only on CPU: on CUDA the round
runs on a CPU side group and the program's collectives on NCCL, and it is not measured.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
import torch.fx

from .ir.collectives import ALL_REDUCE, WAIT, is_collective, is_wait
from .ir.graph_utils import placeholders, pure_op, returns_alias
from .ir.node_meta import is_deferred

MAX_SLOTS = 4  # elements one input-check round carries for the program
NOTHING_SENT = "nothing"  # what a program without such all-reduces sends
MAX_PREFIX_NODES = 16  # nodes (inputs included) an operand that moves may be computed by
SLOT_DTYPES = (
    torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32,
)


@dataclass
class LeadingSplit:
    """A program cut where the input check's round must have ended.

    ``prefix`` takes the program's inputs and returns the operands of its moved
    all-reduces (``metas`` says their dtypes and shapes). ``early`` (None when it would
    compute nothing) takes the same inputs and computes what needs neither those sums nor
    any collective: it runs while the round is in flight. ``main`` takes every input, then
    the sums, then ``early``'s results, and computes the rest.
    """

    prefix: torch.fx.GraphModule
    early: torch.fx.GraphModule | None
    main: torch.fx.GraphModule
    metas: tuple[tuple[torch.dtype, tuple[int, ...]], ...]
    signature: str  # what the slots hold, the same text on every rank for the same program


def world_all_reduces(
    gm: torch.fx.GraphModule, group_size: Callable[[object], int | None], world: int
) -> set[str]:
    """Names of ``gm``'s sum all-reduces over every rank. ``gm`` is folded for this rank
    (NOTE: [lowering]): its collectives name their groups; ``group_size`` answers a group
    name's size (None: unknown)."""
    names = set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not ALL_REDUCE:
            continue
        if len(node.args) >= 3 and node.args[1] == "sum" and group_size(node.args[2]) == world:
            names.add(node.name)
    return names


def split_leading_reductions(
    gm: torch.fx.GraphModule, eligible: set[str], batch: set[int]
) -> LeadingSplit | None:
    """``gm`` cut at the input check's round (NOTE: [reductions that ride the input
    check]): the all-reduces named in ``eligible`` that can run before it, from the
    inputs at the positions in ``batch`` (the step's tensor arguments), move out, and what
    needs no collective runs early. None when neither gains anything. ``gm`` is left as it
    is; its nodes carry ``meta["val"]``."""
    program_inputs = placeholders(gm)
    from_batch = {p for i, p in enumerate(program_inputs) if i in batch}
    chosen = _moved_all_reduces(gm, eligible, from_batch)
    waits = [next(iter(ar.users)) for ar in chosen]
    prefix_nodes: set[torch.fx.Node] = set()
    for ar in chosen:
        prefix_nodes |= _computed_from(cast(torch.fx.Node, ar.args[0]), from_batch) or set()
    dropped = _dropped_nodes(gm, chosen, waits, prefix_nodes)
    early = _early_nodes(gm, dropped, set(waits))
    if not chosen and not any(_computes(n) for n in early):
        return None

    prefix_graph = torch.fx.Graph()
    env = _inputs_of(prefix_graph, program_inputs)
    for node in gm.graph.nodes:
        if node in prefix_nodes and node.op != "placeholder":
            env[node] = prefix_graph.node_copy(node, env.__getitem__)
    prefix_graph.output(tuple(env[ar.args[0]] for ar in chosen))  # type: ignore[index]

    main_graph = torch.fx.Graph()
    main_env = _inputs_of(main_graph, program_inputs)
    for wait in waits:
        main_env[wait] = main_graph.placeholder(f"reduced_{wait.name}")
        main_env[wait].meta.update(wait.meta)
    exported = _exported(gm, early, dropped)
    for node in exported:
        main_env[node] = main_graph.placeholder(f"early_{node.name}")
        main_env[node].meta.update(node.meta)
    early_module = None
    if exported:
        early_graph = torch.fx.Graph()
        early_env = _inputs_of(early_graph, program_inputs)
        for node in gm.graph.nodes:
            if node in early:
                early_env[node] = early_graph.node_copy(node, early_env.__getitem__)
        early_graph.output(tuple(early_env[n] for n in exported))
        early_module = torch.fx.GraphModule(gm, early_graph)

    def lookup(node: torch.fx.Node) -> torch.fx.Node:
        if node not in main_env:  # a view of an input computed early: computed again here
            main_env[node] = main_graph.node_copy(node, lookup)
        return main_env[node]

    for node in gm.graph.nodes:
        if node.op == "placeholder" or node in dropped or node in early:
            continue
        main_env[node] = main_graph.node_copy(node, lookup)
    metas = tuple(
        (ar.args[0].meta["val"].dtype, tuple(ar.args[0].meta["val"].shape))  # type: ignore[union-attr]
        for ar in chosen
    )
    return LeadingSplit(
        torch.fx.GraphModule(gm, prefix_graph),
        early_module,
        torch.fx.GraphModule(gm, main_graph),
        metas,
        _signature(prefix_graph, metas) if chosen else NOTHING_SENT,
    )


def _inputs_of(graph: torch.fx.Graph, program_inputs: list[torch.fx.Node]) -> dict[torch.fx.Node, torch.fx.Node]:
    env = {}
    for p in program_inputs:
        env[p] = graph.placeholder(p.name)
        env[p].meta.update(p.meta)
    return env


def _moved_all_reduces(
    gm: torch.fx.GraphModule, eligible: set[str], program_inputs: set[torch.fx.Node]
) -> list[torch.fx.Node]:
    chosen: list[torch.fx.Node] = []
    slots = 0
    for node in gm.graph.nodes:
        if node.name not in eligible or node.target is not ALL_REDUCE or is_deferred(node):
            continue
        operand = node.args[0]
        value = operand.meta.get("val") if isinstance(operand, torch.fx.Node) else None
        if not isinstance(value, torch.Tensor) or value.dtype not in SLOT_DTYPES:
            continue
        if slots + value.numel() > MAX_SLOTS or not _waited_once(node):
            continue
        if _computed_from(operand, program_inputs) is None:  # type: ignore[arg-type]
            continue
        chosen.append(node)
        slots += value.numel()
    return chosen


def _early_nodes(
    gm: torch.fx.GraphModule, dropped: set[torch.fx.Node], sums: set[torch.fx.Node]
) -> set[torch.fx.Node]:
    """What runs while the round is in flight: the nodes computed by pure ops from the
    program's inputs alone (no collective, no sum from the round, no constant, no random
    draw, no mutation) that the program needs before its first wait on the round or on a
    collective: those a collective or a reader of the round's ``sums`` is computed from
    (a forward). Not the rest: an optimizer's decay of its state is computable from the
    inputs too, but computed early it would be written out in full and read back instead
    of fused into the update (measured, MLP-512 with every computable node early: ddp
    0.81-0.83 -> 0.94-1.08x torch DDP, tp 0.53-0.57 -> 0.71-0.72x eager TP; with this
    rule 0.74-0.78x and 0.49-0.50x)."""
    computable: set[torch.fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or node in dropped:
            continue
        if is_collective(node) or is_wait(node):
            continue
        if not (pure_op(node) or node.target is operator.getitem):
            continue
        if all(a.op == "placeholder" or a in computable for a in node.all_input_nodes):
            computable.add(node)
    frontier = [
        n for n in gm.graph.nodes
        if n not in dropped and n not in computable and n.op == "call_function"
        and (is_collective(n) or any(a in sums for a in n.all_input_nodes))
    ]
    early: set[torch.fx.Node] = set()
    stack = [a for n in frontier for a in n.all_input_nodes if a in computable]
    while stack:
        node = stack.pop()
        if node not in early:
            early.add(node)
            stack.extend(a for a in node.all_input_nodes if a in computable)
    # an op of several results hands on its elements, never itself: its other getitems
    # (a layer norm's mean and rstd, read by the backward) come along
    early |= {u for n in early for u in n.users if u.target is operator.getitem and u in computable}
    return early


def _exported(
    gm: torch.fx.GraphModule, early: set[torch.fx.Node], dropped: set[torch.fx.Node]
) -> list[torch.fx.Node]:
    """The early values ``main`` reads, directly or through views it computes again."""
    needed = {
        a for n in gm.graph.nodes if n not in early and n not in dropped
        for a in n.all_input_nodes if a in early
    }
    stack = [n for n in needed if _aliases(n)]
    while stack:
        for a in stack.pop().all_input_nodes:
            if a in early and a not in needed:
                needed.add(a)
                if _aliases(a):
                    stack.append(a)
    return [n for n in gm.graph.nodes if n in needed and not _aliases(n)]


def _aliases(node: torch.fx.Node) -> bool:
    """A view (or ``getitem``): recomputed where it is read instead of passed along, so
    that no value handed from ``early`` to ``main`` shares an input's memory."""
    if node.target is operator.getitem:
        return isinstance(node.args[0], torch.fx.Node) and _aliases(node.args[0])
    return returns_alias(node)


def _computes(node: torch.fx.Node) -> bool:
    return node.target is not operator.getitem and not _aliases(node)


def _waited_once(collective: torch.fx.Node) -> bool:
    users = list(collective.users)
    return len(users) == 1 and users[0].target is WAIT


def _computed_from(
    operand: torch.fx.Node, allowed_inputs: set[torch.fx.Node]
) -> set[torch.fx.Node] | None:
    """The nodes ``operand`` is computed from, when they are at most ``MAX_PREFIX_NODES``
    pure ops on ``allowed_inputs`` only (None otherwise): a count over the targets, never
    a forward, which would then run twice."""
    seen: set[torch.fx.Node] = set()
    stack = [operand]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if len(seen) > MAX_PREFIX_NODES:
            return None
        if node.op == "placeholder":
            if node not in allowed_inputs:
                return None
            continue
        if node.op != "call_function" or is_collective(node) or is_wait(node):
            return None
        if not (pure_op(node) or node.target is operator.getitem):
            return None
        stack.extend(node.all_input_nodes)
    return seen


def _dropped_nodes(
    gm: torch.fx.GraphModule,
    chosen: list[torch.fx.Node],
    waits: list[torch.fx.Node],
    prefix_nodes: set[torch.fx.Node],
) -> set[torch.fx.Node]:
    """The moved all-reduces and their waits, and the nodes only they read: their operands'
    computations and their groups' lookups."""
    dropped = set(chosen) | set(waits)
    candidates = set(prefix_nodes)
    stack = [a for ar in chosen for a in ar.all_input_nodes]
    while stack:
        node = stack.pop()
        if node.op != "placeholder" and node not in candidates:
            candidates.add(node)
            stack.extend(node.all_input_nodes)
    for node in reversed(list(gm.graph.nodes)):
        if node in candidates and node.op != "placeholder" and node.users:
            if all(u in dropped for u in node.users):
                dropped.add(node)
    return dropped


def _signature(prefix: torch.fx.Graph, metas: tuple[tuple[torch.dtype, tuple[int, ...]], ...]) -> str:
    """The prefix's computation by position, not by node names: the same program gives
    the same text on every rank, however it was loaded."""
    position: dict[torch.fx.Node, str] = {}
    lines = []
    for k, node in enumerate(prefix.nodes):
        if node.op == "placeholder":
            position[node] = f"input{k}"
            continue
        position[node] = f"v{k}"
        args = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: position[a])  # type: ignore[arg-type]
        lines.append(f"v{k} = {node.target}{args}")
    lines.append(" ".join(f"{dtype}{list(shape)}" for dtype, shape in metas))
    return "; ".join(lines)
