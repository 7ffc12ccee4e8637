"""remove_dead_nodes: erase nodes whose values nothing uses.

Expansion can leave unused views and shape computations behind. Collectives and other
side-effecting nodes are impure and stay, except the dead tensor constants described in
NOTE: [traced mesh constants]. A no-op when every node is used.

    before:  %unused = aten.add(%x, 1.0)      (no users)
             %c = aten.lift_fresh_copy(%_tensor_constant0)
             aten.detach_(%c)                  (no users)
    after:   (all gone)
"""

from __future__ import annotations

import torch
import torch.fx

from .checks import no_dead_nodes
from .manager import PassContext, register_pass

_aten = torch.ops.aten

# NOTE: [traced mesh constants]
# DTensor's sharding propagation builds a DeviceMesh the first time it meets some op
# and shape (e.g. a ``view`` of a sharded parameter); later calls hit its cache and build
# nothing. Under expansion's trace that construction records
# ``lift_fresh_copy(_tensor_constant) -> detach_`` (the mesh's rank tensor), which nothing
# reads. ``detach_`` has a mutable schema, so it was kept, and as a side effect it is a
# barrier for bucketing and scheduling (NOTE: [side effects in scheduling]): the demo
# GPT's first fsdp program had 23 of them and 9 all-gathers where a program compiled
# with a warm cache had 2, so the same step gave different programs depending on what
# the process had compiled before. A ``detach_`` whose input is a fresh constant that
# nothing else reads changes nothing observable; both are erased.


def _is_dead_constant_detach(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or node.target is not _aten.detach_.default or node.users:
        return False
    source = node.args[0]
    return (
        isinstance(source, torch.fx.Node)
        and source.target is _aten.lift_fresh_copy.default
        and list(source.users) == [node]
    )


@register_pass(
    "remove_dead_nodes", "erase pure nodes whose results are never used", ensures=no_dead_nodes
)
def remove_dead_nodes(program, context: PassContext) -> bool:
    """Erase unused pure nodes (and dead constant ``detach_``); returns whether any was
    erased."""
    graph = program.graph_module.graph
    dead = [n for n in graph.nodes if _is_dead_constant_detach(n)]
    for node in dead:
        graph.erase_node(node)
    return graph.eliminate_dead_code() or bool(dead)
