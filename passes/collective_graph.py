"""Reading, comparing and moving functional collectives in the per-rank graph.

Shared by ``remove_duplicate_collectives``, ``bucket_collectives`` and
``schedule_overlap``; not a pass itself.

NOTE: [collective groups]
A collective's last argument names its process group. It is either a string or an fx
node made by ``_dtensor.mesh_get_process_group(mesh, dim)`` from a ``get_attr`` of the
traced mesh: the mesh is traced on one rank and the group is looked up at run time.
Expansion makes a fresh ``get_attr`` + ``mesh_get_process_group`` pair for every
collective, so two collectives are in the same group when their group arguments are
structurally equal (``value_key``), not only when they are the same node. Such
"free" nodes (a non-tensor ``get_attr``, and pure ops over free nodes that make no
tensor) read no tensor and can be moved anywhere before their users; passes that move a
collective move its group node with it (``hoist_free``).

NOTE: [side effects in scheduling]
A node that ``is_impure()`` (other than collectives and waits) or whose schema mutates
an argument is a barrier: no pass here moves a collective or a wait across one, so
in-place updates and other side effects keep their order relative to communication.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.fx

from spmd_compiler.ir.collectives import (
    ALL_GATHER,
    ALL_REDUCE,
    REDUCE_SCATTER,
    WAIT,
    deferred_part,
    input_bytes,
    is_collective,
    is_wait,
    payload_bytes,
    tensor_bytes,
    wait_of,
)
from spmd_compiler.ir.graph_utils import computed_value
from spmd_compiler.ir.node_meta import BUCKET_MEMBERS, DEFERRED

from .manager import PassContext

OptionsT = TypeVar("OptionsT")

__all__ = [
    "ALL_GATHER",
    "ALL_REDUCE",
    "BUCKET_MEMBERS",
    "DEFERRED",
    "REDUCE_SCATTER",
    "WAIT",
    "CollectiveCall",
    "deferred_part",
    "input_bytes",
    "parse_collective",
    "payload_bytes",
    "tensor_bytes",
    "wait_of",
]


@dataclass(frozen=True)
class CollectiveCall:
    """The parts of an ``all_reduce`` / ``all_gather_into_tensor`` /
    ``reduce_scatter_tensor`` call; ``reduce_op`` / ``group_size`` are None where the op
    has none."""

    kind: str
    tensor: torch.fx.Node
    reduce_op: str | None
    group_size: int | None
    group: Any

    @property
    def ranks(self) -> int:
        """``group_size`` of an all_gather / reduce_scatter, which always has one."""
        assert self.group_size is not None, f"{self.kind} has no group size"
        return self.group_size


def parse_collective(node: torch.fx.Node) -> CollectiveCall | None:
    """The parts of one of the three bucketable collectives, None for anything else."""
    if node.kwargs or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return None
    args: tuple[Any, ...] = node.args  # schema-typed below; fx types them as Argument
    if node.target is ALL_REDUCE and len(args) == 3:
        return CollectiveCall("all_reduce", args[0], args[1], None, args[2])
    if node.target is ALL_GATHER and len(args) == 3:
        return CollectiveCall("all_gather", args[0], None, args[1], args[2])
    if node.target is REDUCE_SCATTER and len(args) == 4:
        return CollectiveCall("reduce_scatter", args[0], args[1], args[2], args[3])
    return None










def is_free(node: torch.fx.Node) -> bool:
    """A non-tensor ``get_attr`` (the mesh) or a pure op over free nodes whose result is no
    tensor (the group) (NOTE: [collective groups])."""
    if _is_tensor(node):
        return False
    if node.op == "get_attr":
        return True
    if node.op != "call_function" or is_collective(node) or is_wait(node) or node.is_impure():
        return False
    return all(is_free(a) for a in node.all_input_nodes)


def _is_tensor(node: torch.fx.Node) -> bool:
    if "val" in node.meta:
        return isinstance(node.meta["val"], torch.Tensor)
    if node.op == "get_attr":
        value: Any = node.graph.owning_module
        for part in str(node.target).split("."):
            value = getattr(value, part, None)
        return isinstance(value, torch.Tensor)
    schema = getattr(node.target, "_schema", None)
    if schema is not None:
        return any("Tensor" in str(r.type) for r in schema.returns)
    return True  # unknown: assume it may be a tensor


def value_key(value: Any) -> Any:
    """A hashable key, equal for structurally equal free nodes (NOTE: [collective groups])."""
    if isinstance(value, torch.fx.Node):
        if value.op == "get_attr":
            return ("get_attr", value.target)
        if is_free(value):
            return ("free", value.target, value_key(value.args), value_key(value.kwargs))
        return value
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(value_key(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, value_key(v)) for k, v in value.items())))
    return value


def is_barrier(node: torch.fx.Node) -> bool:
    """A side effect that collectives and waits must not cross (NOTE: [side effects in
    scheduling])."""
    if node.op != "call_function" or is_collective(node) or is_wait(node):
        return False
    schema = getattr(node.target, "_schema", None)
    return node.is_impure() or bool(schema is not None and schema.is_mutable)


def positions(graph: torch.fx.Graph) -> dict[torch.fx.Node, int]:
    return {node: i for i, node in enumerate(graph.nodes)}


def non_free_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    return [a for a in node.all_input_nodes if not is_free(a)]


def first_use(node: torch.fx.Node, position: dict[torch.fx.Node, int]) -> torch.fx.Node:
    """The earliest user of ``node``, which must have one."""
    return min(node.users, key=position.__getitem__)


def hoist_free(node: torch.fx.Node, anchor: torch.fx.Node) -> None:
    """Move free ``node`` (and free inputs it needs) before ``anchor`` when it is later."""
    position = positions(node.graph)
    _hoist(node, anchor, position)


def _hoist(node: torch.fx.Node, anchor: torch.fx.Node, position: dict[torch.fx.Node, int]) -> None:
    if not isinstance(node, torch.fx.Node) or position[node] < position[anchor]:
        return
    if node is anchor:
        raise ValueError(f"cannot move {node.name} before itself; anchor after it")
    for arg in node.all_input_nodes:
        _hoist(arg, anchor, position)
    anchor.prepend(node)
    position[node] = -1  # now before anchor; only ever compared with anchor


def erase_if_unused(nodes: Iterable[Any]) -> None:
    """Erase free nodes (and then their free inputs) that nothing uses any more."""
    for node in nodes:
        if isinstance(node, torch.fx.Node) and not node.users and is_free(node):
            inputs = node.all_input_nodes
            node.graph.erase_node(node)
            erase_if_unused(inputs)


def new_node(graph: torch.fx.Graph, target: Any, args: tuple, val: Any = None) -> torch.fx.Node:
    """``call_function`` node at the current insert point, with ``meta['val']`` computed on
    the inputs' fake values (or ``val`` where running ``target`` on them is not possible)."""
    node = graph.call_function(target, args)
    node.meta["val"] = computed_value(target, args) if val is None else val
    return node


def getitem(graph: torch.fx.Graph, node: torch.fx.Node, index: int) -> torch.fx.Node:
    return new_node(graph, operator.getitem, (node, index), node.meta["val"][index])


def options_for(context: PassContext, name: str, default: OptionsT) -> OptionsT:
    """The options of pass ``name``: the bound ``context.options`` (or
    ``context.pass_options(name)``) where it is of ``default``'s type, else ``default``."""
    lookup = getattr(context, "pass_options", None)
    for found in (getattr(context, "options", None), lookup(name) if callable(lookup) else None):
        if isinstance(found, type(default)):
            return found
    return default

