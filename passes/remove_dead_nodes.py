"""remove_dead_nodes: erase nodes whose values nothing uses.

Expansion can leave unused views and shape computations behind. Collectives and other
side-effecting nodes are impure and stay. A no-op when every node is used.
"""

from __future__ import annotations

from .manager import PassContext, register_pass


@register_pass("remove_dead_nodes", "erase pure nodes whose results are never used")
def remove_dead_nodes(program, context: PassContext) -> bool:
    return program.graph_module.graph.eliminate_dead_code()
