"""count_collectives: count the collectives of the per-rank program, per kind.

An example of a third-party pass (see docs/writing_passes.md). It reads the graph and
writes only metadata, so it returns False ("the graph did not change"): the pass manager
checks that claim. A no-op on a program without collectives, apart from recording zeros.

    before:  %all_reduce = _c10d_functional.all_reduce(%grad, 'sum', %group)
    after:   the same node, with node.meta[COLLECTIVE_INDEX] = 0, and
             graph_module.meta["count_collectives"] = {"all_reduce": {"count": 1, ...}}
"""

from __future__ import annotations

from dataclasses import dataclass

from spmd_compiler.passes import (
    PassContext,
    collective_kind,
    is_collective,
    register_pass,
)

#: graph_module.meta key of the summary: kind -> {"count", "bytes", "seconds"}.
SUMMARY_KEY = "count_collectives"
#: node.meta key: the position of a collective in the program's collective sequence.
COLLECTIVE_INDEX = "count_collectives.index"


@dataclass(frozen=True)
class CountCollectivesOptions:
    """Options of ``count_collectives``.

    Args:
        tag_nodes: also write each collective's position into ``node.meta``.
    """

    tag_nodes: bool = True


def summary_recorded(program) -> None:
    """Ensures-check: the summary exists and counts every collective of the graph."""
    summary = program.graph_module.meta.get(SUMMARY_KEY)
    if summary is None:
        raise AssertionError(f"graph_module.meta[{SUMMARY_KEY!r}] is missing")
    n = sum(1 for node in program.graph_module.graph.nodes if is_collective(node))
    counted = sum(entry["count"] for entry in summary.values())
    if counted != n:
        raise AssertionError(f"the summary counts {counted} collectives, the graph has {n}")


@register_pass(
    "count_collectives",
    "record the number, bytes and estimated time of collectives per kind",
    after="remove_dead_nodes",  # count what actually runs
    options=CountCollectivesOptions,
    ensures=summary_recorded,
)
def count_collectives(program, context: PassContext) -> bool:
    """Record the collective summary; returns False (only metadata changes)."""
    options: CountCollectivesOptions = context.options
    summary: dict[str, dict[str, float]] = {}
    index = 0
    for node in program.graph_module.graph.nodes:
        kind = collective_kind(node)
        if kind is None:
            continue
        entry = summary.setdefault(kind, {"count": 0, "bytes": 0, "seconds": 0.0})
        entry["count"] += 1
        entry["bytes"] += context.cost_model.collective_bytes(node)
        entry["seconds"] += context.cost_model.collective_seconds(node)
        if options.tag_nodes:
            node.meta[COLLECTIVE_INDEX] = index
        index += 1
    program.graph_module.meta[SUMMARY_KEY] = summary
    return False
