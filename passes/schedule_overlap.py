"""schedule_overlap: issue collectives early and wait late, so communication overlaps compute.

NOTE: [overlap schedule]
Expansion puts each collective and its ``wait_tensor`` where the result is first needed
(gradients: in the optimizer, after all of backward), so nothing overlaps. This pass
moves each collective up to just after its last input, with the nodes that only feed it
(its group node, NOTE: [collective groups]; a bucket's packing; a view of its input),
and each wait down to just before the first use of its result. Nothing else moves, and
no collective or wait crosses a side effect (NOTE: [side effects in scheduling]). A collective is *in flight* from its issue to its wait;
its buffers stay allocated meanwhile, so the bytes in flight (``payload_bytes``) at any
node are capped by ``OverlapOptions.max_in_flight_bytes``: a move stops where it would
exceed the cap (a move already over the cap is not made worse). Collectives are hoisted
by priority, the earliest ready first (values computed from graph inputs alone count as
ready at the start), then the earliest needed, and none passes one of higher priority:
early gradients get the budget first, and where backends run collectives in issue
order, forward's gathers go before backward's. Then waits are sunk in program order.
The relative order of collectives may change: the program is one graph for every rank,
so every rank still issues the same sequence.

NOTE: [FSDP prefetch]
Parameter shards are graph inputs, so a gather is ready at the start and would be
hoisted there: the whole model gathered at once. ``OverlapOptions.prefetch_depth`` d
bounds that the way FSDP does: number the gathers by the first use of their result
(forward's buckets, then backward's re-gathers); gather j is issued no earlier than the
first use of gather j - d, so while bucket j - d is computed at most d later buckets are
on their way (d = 1 is FSDP2's prefetch of the next layer; d = 0 issues each gather just
before its own use). Gathered parameters then live from their issue to their last use:
at most d + 1 buckets of forward parameters at a time, each under ``bucket_collectives``'s
cap, and the in-flight cap still applies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx

from spmd_compiler.ir.collectives import (
    COLLECTIVE_KINDS,
    check_byte_count,
    check_kinds,
    collective_kind,
)

from . import bucket_collectives as _ordered_after  # noqa: F401  (registers it)
from .collective_graph import (
    first_use,
    is_barrier,
    is_free,
    options_for,
    payload_bytes,
    positions,
    wait_of,
)
from .manager import PassContext, is_collective, is_wait, register_pass

_Pending = tuple[torch.fx.Node, torch.fx.Node, int]  # collective, its wait, bytes in flight


@dataclass(frozen=True)
class OverlapOptions:
    """Options of ``schedule_overlap``.

    Args:
        max_in_flight_bytes: most payload bytes of collectives issued and not yet waited,
            at any point of the program (about ten default buckets).
        kinds: the collective kinds to move (``all_reduce``, ``all_gather``,
            ``reduce_scatter``, ``all_to_all``...); None moves every kind.
        prefetch_depth: how many gathers may run ahead of the one being used (NOTE:
            [FSDP prefetch]); None: as early as their inputs and the cap allow.
        overlap_compute: False leaves every collective where expansion and bucketing
            put it (issued at its inputs or first use, waited at once): for CPU ranks
            that use every core for compute, where gloo's threads cannot progress
            beside it (on 2 cores and 2 ranks it was worth 5% on the demo GPT's ddp
            step and cost 5-10% on fsdp and on larger gradients, so it stays on).
    """

    max_in_flight_bytes: int = 256 * 2**20
    kinds: frozenset[str] | None = None
    prefetch_depth: int | None = None
    overlap_compute: bool = True

    def __post_init__(self) -> None:
        if self.prefetch_depth is not None and self.prefetch_depth < 0:
            raise ValueError(f"prefetch_depth must be >= 0 or None, got {self.prefetch_depth}")
        check_byte_count("OverlapOptions", "max_in_flight_bytes", self.max_in_flight_bytes)
        if self.kinds is not None:  # a misspelt kind moved nothing, silently
            check_kinds("OverlapOptions", self.kinds, COLLECTIVE_KINDS)


@register_pass(
    "schedule_overlap",
    "issue collectives as soon as their inputs exist and wait just before first use",
    after=("bucket_collectives",),
    options=OverlapOptions,
    changes_collectives=True,
)
def schedule_overlap(program, context: PassContext) -> bool:
    """Move collectives up to their inputs and waits down to their first use.

    Why: see NOTE: [overlap schedule]. A no-op (returns False) when every collective
    already follows its inputs (or cannot move for the cap or a side effect) and every
    wait precedes its first use, e.g. on a second run.

    Before::

        g1 = mm(a, b)                      # gradient ready
        h = mm(c, d)                       # more backward compute
        r = all_reduce(g1, "sum", pg); w = wait_tensor(r); p = sub(x, w)

    After::

        g1 = mm(a, b)
        r = all_reduce(g1, "sum", pg)      # in flight while h is computed
        h = mm(c, d)
        w = wait_tensor(r); p = sub(x, w)

    Args:
        program: the per-rank program; its graph is reordered in place.
        context: ``context.options`` is an ``OverlapOptions``.

    Returns:
        Whether any node moved.
    """
    options = options_for(context, "schedule_overlap", OverlapOptions())
    if not options.overlap_compute:
        return False
    graph = program.graph_module.graph
    order = list(graph.nodes)
    pending = [
        (node, wait, payload_bytes(node))
        for node in order
        if is_collective(node)
        and (wait := wait_of(node)) is not None
        and (options.kinds is None or collective_kind(node) in options.kinds)
    ]
    if not pending:
        return False
    before = list(order)
    after = _prefetch_limits(pending, options.prefetch_depth)
    barriers = {node for node in order if is_barrier(node)}  # moving changes no node
    _hoist_collectives(order, pending, options.max_in_flight_bytes, after, barriers)
    _sink_waits(order, pending, options.max_in_flight_bytes, barriers)
    if order == before:
        return False
    output = order[-1]
    for node in order[:-1]:
        output.prepend(node)
    return True


def _prefetch_limits(
    pending: list[_Pending], depth: int | None
) -> dict[torch.fx.Node, torch.fx.Node]:
    """Gather -> the node it must be issued after (NOTE: [FSDP prefetch]); a gather
    that may not move at all (depth 0) maps to itself."""
    if depth is None:
        return {}
    gathers = [(c, w) for c, w, _ in pending if collective_kind(c) == "all_gather" and w.users]
    if not gathers:
        return {}
    position = positions(gathers[0][0].graph)
    used = {c: first_use(w, position) for c, w in gathers}
    ordered = sorted(used, key=lambda c: position[used[c]])
    limits = {}
    for j, collective in enumerate(ordered):
        if depth == 0:
            limits[collective] = collective
        elif j >= depth:
            limits[collective] = used[ordered[j - depth]]
    return limits


def _hoist_collectives(
    order: list[torch.fx.Node],
    pending: list[_Pending],
    cap: int,
    after: dict[torch.fx.Node, torch.fx.Node],
    barriers: set[torch.fx.Node],
) -> None:
    """Move each collective (with its feeders) up to its inputs, by priority: first the
    earliest ready, then the earliest needed. A collective does not pass one of higher
    priority, so the issue order follows the priority, nor the node ``after`` names for
    it (NOTE: [FSDP prefetch]), nor a side effect of ``barriers``."""
    index = _index(order)
    prologue = _prologue(order, barriers)

    def priority(item: _Pending) -> tuple[int, int]:
        collective, wait, _ = item
        floor = _floor(collective, order, index, barriers)
        ready = -1 if floor < 0 or order[floor] in prologue else floor
        return ready, min((index[u] for u in wait.users), default=len(order))

    placed: set[torch.fx.Node] = set()
    for collective, _, nbytes in sorted(pending, key=priority):
        placed.add(collective)
        index = _index(order)
        in_flight = _in_flight(order, pending, index)
        floor = _floor(collective, order, index, barriers)
        if collective in after:
            floor = max(floor, index[after[collective]])
        start = target = index[collective]
        while (
            target - 1 > floor
            and order[target - 1] not in placed
            and in_flight[target - 1] + nbytes <= cap
        ):
            target -= 1
        if target == start:
            continue
        chain = _feeders(collective, barriers)
        moved = [n for n in order[target:start] if n in chain] + [collective]
        going = set(moved)  # a set: a bucket moves a feeder per member (span x members)
        rest = [n for n in order[target : start + 1] if n not in going]
        order[target : start + 1] = moved + rest


def _sink_waits(
    order: list[torch.fx.Node], pending: list[_Pending], cap: int, barriers: set[torch.fx.Node]
) -> None:
    """Move each wait down to just before its first use (or a side effect, or the cap)."""
    for _, wait, nbytes in list(pending):
        if not wait.users:
            continue
        index = _index(order)
        in_flight = _in_flight(order, pending, index)
        start = index[wait]
        ceiling = min(index[u] for u in wait.users)
        target = start + 1  # the wait will sit just before order[target]
        while (
            target < ceiling and order[target] not in barriers and in_flight[target] + nbytes <= cap
        ):
            target += 1
        if target > start + 1:
            order.insert(target - 1, order.pop(start))


def _floor(
    collective: torch.fx.Node, order: list[torch.fx.Node], index: dict,
    barriers: set[torch.fx.Node],
) -> int:
    """Index of the last node the collective (and its feeders) must stay after: an
    input from outside the feeders, a side effect before it, or the last placeholder."""
    chain = _feeders(collective, barriers)
    inputs = {a for n in chain | {collective} for a in n.all_input_nodes} - chain
    floor = max((index[n] for n in inputs), default=-1)
    for i in range(index[collective] - 1, floor, -1):
        if order[i] in barriers or order[i].op == "placeholder":
            return i
    return floor


def _in_flight(order: list[torch.fx.Node], pending: list[_Pending], index: dict) -> list[int]:
    """Bytes in flight while each node runs (collectives issued before it, waited after)."""
    delta = [0] * (len(order) + 1)
    for collective, wait, nbytes in pending:
        delta[index[collective] + 1] += nbytes
        delta[index[wait]] -= nbytes
    total, out = 0, []
    for d in delta[:-1]:
        total += d
        out.append(total)
    return out


def _feeders(collective: torch.fx.Node, barriers: set[torch.fx.Node]) -> set[torch.fx.Node]:
    """Nodes that move with the collective: its free group nodes and the pure nodes that
    only feed it (a bucket's packing, a view of the input)."""
    chain: set[torch.fx.Node] = set()
    stack = list(collective.all_input_nodes)
    while stack:
        n = stack.pop()
        if n in chain:
            continue
        private = (
            n.op == "call_function"
            and n not in barriers
            and not n.is_impure()
            and not is_collective(n)
            and not is_wait(n)
            and all(u is collective or u in chain for u in n.users)
        )
        if is_free(n) or private:
            chain.add(n)
            stack.extend(n.all_input_nodes)
    return chain


def _prologue(order: list[torch.fx.Node], barriers: set[torch.fx.Node]) -> set[torch.fx.Node]:
    """Nodes computed from graph inputs alone (ready at the start, wherever they sit)."""
    found: set[torch.fx.Node] = set()
    for n in order:
        if n.op in ("placeholder", "get_attr") or (
            n.op == "call_function"
            and n not in barriers
            and not is_collective(n)
            and not is_wait(n)
            and all(a in found for a in n.all_input_nodes)
        ):
            found.add(n)
    return found


def _index(order: list[torch.fx.Node]) -> dict[torch.fx.Node, int]:
    return {n: i for i, n in enumerate(order)}
