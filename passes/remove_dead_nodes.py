"""remove_dead_nodes: erase nodes whose values nothing uses.

Expansion can leave unused views and shape computations behind. Collectives and other
side-effecting nodes are impure and stay. A no-op when every node is used.

    before:  %unused = aten.add(%x, 1.0)      (no users)
    after:   (gone)
"""

from __future__ import annotations

from .checks import no_dead_nodes
from .manager import PassContext, register_pass


@register_pass(
    "remove_dead_nodes", "erase pure nodes whose results are never used", ensures=no_dead_nodes
)
def remove_dead_nodes(program, context: PassContext) -> bool:
    """Erase unused pure nodes; returns whether any was erased."""
    return program.graph_module.graph.eliminate_dead_code()
