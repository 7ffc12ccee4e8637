"""The collectives of a per-rank program: which ops they are, their kind, their waits and
the bytes they move. Every module that asks one of these questions asks it here.

NOTE: [payload bytes]
One rule for the bytes a collective moves: the payload each rank contributes or
receives per collective. all_reduce = tensor bytes; all_gather = bytes of the gathered
(full) output; reduce_scatter = bytes of the (full) input; all_to_all and broadcast =
input bytes. Coalesced variants count every tensor of the list. For the three
bucketable collectives this equals the larger of input and output bytes, which is also
what a collective holds in memory while it is in flight.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.fx

from .. import _torch_private as private
from .node_meta import is_deferred

COLLECTIVE_NAMESPACE = "_c10d_functional"

_C10D = private.functional_collective_ops()
ALL_REDUCE = _C10D.all_reduce.default
ALL_GATHER = _C10D.all_gather_into_tensor.default
REDUCE_SCATTER = _C10D.reduce_scatter_tensor.default
WAIT = _C10D.wait_tensor.default

# op name (without overload) -> (short kind, which side of the op carries the payload)
_KINDS = {
    "all_reduce": ("all_reduce", "input"),
    "all_reduce_coalesced": ("all_reduce", "input"),
    "all_gather_into_tensor": ("all_gather", "output"),
    "all_gather_into_tensor_coalesced": ("all_gather", "output"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", "input"),
    "all_to_all_single": ("all_to_all", "input"),
    "broadcast": ("broadcast", "input"),
}

# every short kind, what pass options that name kinds accept
COLLECTIVE_KINDS = frozenset(kind for kind, _ in _KINDS.values())


def check_kinds(owner: str, kinds: object, allowed: frozenset[str]) -> None:
    """Refuse a ``kinds`` option naming no collective kind of ``allowed`` (a misspelt
    ``"allreduce"`` matched nothing, which silently turned the option's effect off)."""
    import difflib

    if isinstance(kinds, str) or not isinstance(kinds, (set, frozenset, list, tuple)):
        raise ValueError(f"{owner}.kinds must be a set of collective kinds, got {kinds!r}")
    for kind in kinds:
        if kind not in allowed:
            close = difflib.get_close_matches(str(kind), sorted(allowed), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"{owner}.kinds names {kind!r}, not a collective kind it handles{hint}; "
                f"valid: {', '.join(sorted(allowed))}"
            )


def check_byte_count(owner: str, name: str, value: object, *, allow_none: bool = False) -> None:
    """Refuse a byte count that is not a positive int (``cap_bytes=-5`` was taken)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        none = " or None" if allow_none else ""
        raise ValueError(f"{owner}.{name} must be a positive int{none}, got {value!r}")


@dataclass
class CommStats:
    counts: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    @property
    def total_count(self) -> int:
        return sum(self.counts.values())


def _in_namespace(node: torch.fx.Node) -> bool:
    return (
        node.op == "call_function"
        and getattr(node.target, "namespace", None) == COLLECTIVE_NAMESPACE
    )


def is_wait(node: torch.fx.Node) -> bool:
    """A ``wait_tensor``: where a collective's result becomes usable."""
    return _in_namespace(node) and node.target._opname == "wait_tensor"  # type: ignore[union-attr]


def is_collective(node: torch.fx.Node) -> bool:
    """A functional collective (any op of the namespace but the wait)."""
    return _in_namespace(node) and not is_wait(node)


def collective_kind(node: torch.fx.Node) -> str | None:
    """Short kind (``all_reduce``...) of a collective node, None for anything else."""
    if not is_collective(node):
        return None
    entry = _KINDS.get(node.target._opname)  # type: ignore[union-attr]
    return entry[0] if entry else None


def tensor_bytes(node: torch.fx.Node) -> int:
    """Bytes of the tensor a node makes (0 for anything else)."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return 0
    return val.numel() * val.element_size()


def input_bytes(collective: torch.fx.Node) -> int:
    """Bytes of a collective's input tensor(s)."""
    first = collective.args[0] if collective.args else None
    inputs = first if isinstance(first, (list, tuple)) else [first]
    return sum(tensor_bytes(n) for n in inputs if isinstance(n, torch.fx.Node))


def payload_bytes(node: torch.fx.Node) -> int:
    """Bytes a collective moves per rank (NOTE: [payload bytes])."""
    entry = _KINDS.get(node.target._opname)  # type: ignore[union-attr]
    if entry is None:  # a collective without a table entry: what it holds in flight
        return max(input_bytes(node), tensor_bytes(node))
    if entry[1] == "output":
        vals = node.meta.get("val")
    else:
        first = node.args[0]  # the input tensor(s): a node or a list of nodes
        nodes = first if isinstance(first, (list, tuple)) else [first]
        vals = [n.meta.get("val") for n in cast(Sequence[torch.fx.Node], nodes)]
    if isinstance(vals, torch.Tensor):
        vals = [vals]
    return sum(v.numel() * v.element_size() for v in vals or [] if v is not None)


def collective_stats(gm: torch.fx.GraphModule) -> CommStats:
    stats = CommStats()
    for node in gm.graph.nodes:
        kind = collective_kind(node)
        if kind is None:
            continue
        stats.counts[kind] = stats.counts.get(kind, 0) + 1
        stats.bytes[kind] = stats.bytes.get(kind, 0) + payload_bytes(node)
    return stats


def wait_of(collective: torch.fx.Node) -> torch.fx.Node | None:
    """The one ``wait_tensor`` of ``collective``; None when it has other users."""
    users = list(collective.users)
    if len(users) == 1 and is_wait(users[0]):
        return users[0]
    return None


def deferred_part(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The nodes computed from deferred reductions' results, in graph order: their waits
    and everything downstream of them, the output aside (NOTE: [cross-iteration overlap]
    in passes/cross_iteration_overlap.py)."""
    found: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node.op == "output":
            continue
        if (is_wait(node) and is_deferred(node.args[0])) or any(  # type: ignore[arg-type]
            a in found for a in node.all_input_nodes
        ):
            found.add(node)
    return [n for n in graph.nodes if n in found]
