"""remove_duplicate_collectives: keep one of several identical collectives.

NOTE: [duplicate collectives]
Two collectives are duplicates when they have the same op, the same input node and equal
other arguments, the process group compared structurally (NOTE: [collective groups] in
``collective_graph.py``). Every rank computes the same result for both, so the later one
is dropped and the users of its wait read the first one's wait. One exception: a
duplicate whose result is larger than its input (an all-gather) issued after the first
result's last use is a deliberate re-gather (fully_shard's ``reshard_after_forward``
frees forward's gathered parameters and gathers them again for backward); merging it
would keep the gathered copy alive in between, so it stays.
"""

from __future__ import annotations

import torch.fx

from .collective_graph import (
    erase_if_unused,
    input_bytes,
    payload_bytes,
    positions,
    value_key,
    wait_of,
)
from .manager import PassContext, is_collective, register_pass


@register_pass(
    "remove_duplicate_collectives",
    "drop collectives identical to an earlier one and reuse its result",
    changes_collectives=True,
)
def remove_duplicate_collectives(program, context: PassContext) -> bool:
    """Redirect the uses of a duplicate collective's wait to the first one's wait.

    Why: expansion memoizes redistributions, but modes and passes that add collectives of
    their own can repeat one; each repeat costs a full collective. A no-op (returns False)
    when no two collectives are duplicates (NOTE: [duplicate collectives]).

    Before::

        a = all_reduce(g, "sum", pg_1); wa = wait_tensor(a); x = add(wa, 1)
        b = all_reduce(g, "sum", pg_2); wb = wait_tensor(b); y = mul(wb, 2)

    After (``pg_1`` and ``pg_2`` are the same group of the same mesh)::

        a = all_reduce(g, "sum", pg_1); wa = wait_tensor(a); x = add(wa, 1)
        y = mul(wa, 2)

    Args:
        program: the per-rank program; its graph is changed in place.
        context: the pass context (unused).

    Returns:
        Whether any collective was removed.
    """
    graph = program.graph_module.graph
    first: dict[object, tuple[torch.fx.Node, torch.fx.Node]] = {}
    position = positions(graph)
    changed = False
    for node in list(graph.nodes):
        wait = wait_of(node) if is_collective(node) else None
        if wait is None:
            continue
        key = (node.target, value_key(node.args), value_key(node.kwargs))
        if key not in first or _is_regather(first[key][1], node, position):
            first[key] = (node, wait)
            continue
        kept_wait = first[key][1]
        if position[kept_wait] > position[wait]:
            wait.prepend(kept_wait)  # the kept result must be ready where the duplicate was
            position = positions(graph)
        wait.replace_all_uses_with(kept_wait)
        group_args = node.all_input_nodes
        graph.erase_node(wait)
        graph.erase_node(node)
        erase_if_unused(group_args)
        changed = True
    return changed


def _is_regather(
    kept_wait: torch.fx.Node, duplicate: torch.fx.Node, position: dict[torch.fx.Node, int]
) -> bool:
    """Whether ``duplicate`` re-makes a larger-than-input result after the kept one died."""
    if payload_bytes(duplicate) <= input_bytes(duplicate):
        return False
    return all(position[user] < position[duplicate] for user in kept_wait.users)
