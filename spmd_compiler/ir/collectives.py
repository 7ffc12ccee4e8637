"""Count the collectives of a per-rank program and the bytes they move.

Bytes are the payload each rank contributes or receives per collective, the convention
of the byte-count formulas in the tests: all_reduce = tensor bytes; all_gather = bytes
of the gathered (full) output; reduce_scatter = bytes of the (full) input; all_to_all =
input bytes. Coalesced variants count every tensor of the list.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx

COLLECTIVE_NAMESPACE = "_c10d_functional"

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


def collective_kind(node: torch.fx.Node) -> str | None:
    """Short kind (``all_reduce``...) of a collective node, None for anything else."""
    if node.op != "call_function" or getattr(node.target, "namespace", None) != COLLECTIVE_NAMESPACE:
        return None
    entry = _KINDS.get(node.target._opname)
    return entry[0] if entry else None


def _payload_bytes(node: torch.fx.Node) -> int:
    if _KINDS[node.target._opname][1] == "output":
        vals = node.meta.get("val")
    else:
        first = node.args[0]
        nodes = first if isinstance(first, (list, tuple)) else [first]
        vals = [n.meta.get("val") for n in nodes]
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
        stats.bytes[kind] = stats.bytes.get(kind, 0) + _payload_bytes(node)
    return stats
