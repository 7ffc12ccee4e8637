"""Small helpers shared by capture, expansion and passes."""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
import torch.fx

from .. import _torch_private as private
from .collectives import is_wait
from .node_meta import (
    ITEM_SNAPSHOT,
    MODULE_FQN,
    ORIGIN,
    PHASE,
    RNN_HIDDEN,
    TIME_MAJOR_INPUT,
    TIME_MAJOR_RNN,
    USER_LINE,
)

# node.meta keys that follow a value when a graph is re-traced node by node.
CARRIED_META = (MODULE_FQN, TIME_MAJOR_RNN, TIME_MAJOR_INPUT, RNN_HIDDEN, USER_LINE, PHASE, ITEM_SNAPSHOT, "stack_trace")


def new_nodes_after(mark: torch.fx.Node | None, graph: torch.fx.Graph) -> Iterator[torch.fx.Node]:
    """Nodes appended to ``graph`` after ``mark`` (all nodes when ``mark`` is None)."""
    node = mark.next if mark is not None else next(iter(graph.nodes), None)
    while node is not None and node.op != "root":
        yield node
        node = node.next


def last_node(graph: torch.fx.Graph | None) -> torch.fx.Node | None:
    if graph is None:
        return None
    return next(iter(reversed(graph.nodes)), None)


class RetracingInterpreter(torch.fx.Interpreter):
    """Runs a graph node by node inside a ``make_fx`` trace, carrying node metadata.

    Every node the trace emits while one source node runs gets the source node's
    ``CARRIED_META`` (module FQN, train-step line, stack trace) and ``ORIGIN`` = the
    source node's name. ``on_node(source, result, new_nodes)`` lets a caller record more.
    """

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        on_node: Callable[[torch.fx.Node, Any, list[torch.fx.Node]], Any] | None = None,
    ) -> None:
        super().__init__(gm)
        self.on_node = on_node

    def run_node(self, n: torch.fx.Node) -> Any:
        graph = private.current_trace_graph()
        mark = last_node(graph)
        result = super().run_node(n)
        created = list(new_nodes_after(mark, graph)) if graph is not None else []
        for new in created:
            for key in CARRIED_META:
                if key in n.meta and key not in new.meta:
                    new.meta[key] = n.meta[key]
            new.meta.setdefault(ORIGIN, n.name)
        if self.on_node is not None:
            result = self.on_node(n, result, created)
        return result


def node_arg(node: torch.fx.Node, index: int = 0) -> torch.fx.Node:
    """``node.args[index]`` where the op's schema makes it a tensor, hence a graph node
    (torch.fx types every argument as the whole ``Argument`` union). Not checked."""
    return cast(torch.fx.Node, node.args[index])


def replace_with_input(node: torch.fx.Node) -> None:
    node.replace_all_uses_with(node_arg(node))
    node.graph.erase_node(node)


PROFILER_OPS = {"profiler._record_function_enter_new", "profiler._record_function_exit"}


def is_profiler_node(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and any(str(node.target).startswith(p) for p in PROFILER_OPS)


def remove_profiler_and_detach(gm: torch.fx.GraphModule) -> None:
    """Drop record_function markers (side-effecting, meaningless here), detach/alias ops,
    and functional copies that are plain renames."""
    graph = gm.graph
    for node in reversed(list(graph.nodes)):
        if is_profiler_node(node):
            for user in list(node.users):
                if is_profiler_node(user):
                    graph.erase_node(user)
            if not node.users:
                graph.erase_node(node)
        elif node.op == "call_function" and node.target in (
            torch.ops.aten.detach.default,
            torch.ops.aten.alias.default,
        ):
            replace_with_input(node)
        elif node.op == "call_function" and node.target is torch.ops.aten.copy.default:
            _replace_functional_copy(node)


def _replace_functional_copy(node: torch.fx.Node) -> None:
    """``aten.copy(dst, src)`` (functionalized ``dst.copy_(src)``) is ``src`` when the
    shapes and dtypes agree; DTensor has no rule for it, so it is replaced."""
    dst, src = node_arg(node, 0), node_arg(node, 1)
    dst_val, src_val = dst.meta.get("val"), src.meta.get("val")
    if (
        isinstance(dst_val, torch.Tensor)
        and isinstance(src_val, torch.Tensor)
        and dst_val.shape == src_val.shape
        and dst_val.dtype == src_val.dtype
        and dst_val.device == src_val.device
    ):
        node.replace_all_uses_with(src)
        node.graph.erase_node(node)


def pure_op(node: torch.fx.Node) -> bool:
    """An ATen-style op that neither mutates its inputs nor draws random numbers: its value
    depends on its inputs only, so it may be evaluated ahead of time or moved."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or schema.is_mutable:
        return False
    return torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ())


# ops whose result shares their first argument's memory though their schema does not say
# so: ``_unsafe_view`` is a view of a tensor its caller promises nothing else reads
ALIASING_UNANNOTATED = frozenset({torch.ops.aten._unsafe_view.default})


def returns_alias(node: torch.fx.Node) -> bool:
    """Whether ``node``'s result may share memory with its first argument: an op whose
    schema marks its result as an alias of it (a view, ``reshape``, ``contiguous``, the
    pieces of a ``split``), or ``_unsafe_view``. ``getitem`` is not one (a piece of a
    multi-output op: callers that follow pieces handle it)."""
    if node.op != "call_function" or not node.args:
        return False
    if node.target in ALIASING_UNANNOTATED:
        return True
    schema = getattr(node.target, "_schema", None)
    returns = list(schema.returns) if schema is not None else []
    return bool(returns) and returns[0].alias_info is not None


def may_return_alias(node: torch.fx.Node) -> bool:
    """Whether ``node``'s result may share memory with one of its arguments: its schema
    says a result aliases an argument (views, ops that write in place), ``_unsafe_view``,
    a ``getitem``, or a collective's ``wait_tensor`` (which hands back its input)."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem or returns_alias(node) or is_wait(node):
        return True
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def aliases_of(root: torch.fx.Node) -> set[torch.fx.Node]:
    """``root`` and every node that may share its memory: those ``may_return_alias`` says
    do, of ``root`` or of one of them, transitively."""
    seen = {root}
    todo = [root]
    while todo:
        for user in todo.pop().users:
            if user not in seen and may_return_alias(user):
                seen.add(user)
                todo.append(user)
    return seen


def ancestors(
    node: torch.fx.Node, not_read: Callable[[torch.fx.Node], torch.fx.Node | None] | None = None
) -> set[torch.fx.Node]:
    """``node`` and every node it is computed from, through any chain of nodes; past a
    node ``n``, not through ``not_read(n)`` (an input it does not read the values of)."""
    seen: set[torch.fx.Node] = set()
    todo = [node]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            skipped = not_read(n) if not_read is not None else None
            todo.extend(a for a in n.all_input_nodes if a is not skipped)
    return seen


def placeholders_read_by(node: torch.fx.Node) -> set[torch.fx.Node]:
    """The graph inputs ``node`` is computed from, through any chain of nodes."""
    return {n for n in ancestors(node) if n.op == "placeholder"}


def computed_value(target: Any, args: tuple, kwargs: dict[str, Any] | None = None) -> Any:
    """``target`` run on its node arguments' ``meta["val"]`` (FakeTensors): the value a
    new node's ``meta["val"]`` holds. Raises what the op raises on those values."""
    fake_args, fake_kwargs = torch.fx.node.map_arg((args, kwargs or {}), lambda n: n.meta["val"])
    return target(*fake_args, **fake_kwargs)


def placeholders(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def output_values(output: torch.fx.Node) -> list[Any]:
    """The values an ``output`` node returns: its one argument, a sequence."""
    return list(cast(Sequence[Any], output.args[0]))


def output_args(gm: torch.fx.GraphModule) -> list[Any]:
    return output_values(gm.graph.output_node())


def set_outputs(gm: torch.fx.GraphModule, values: list[Any]) -> None:
    out = gm.graph.output_node()
    out.args = (tuple(values),)


def op_counts(gm: torch.fx.GraphModule) -> dict[str, int]:
    counts: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function":
            name = str(n.target)
            counts[name] = counts.get(name, 0) + 1
    return counts
