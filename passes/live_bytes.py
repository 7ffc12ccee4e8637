"""An estimate of the bytes a per-rank program holds alive at each of its nodes.

NOTE: [live bytes estimate]
The program runs its nodes in graph order and frees a value after its last use (fx's
generated code drops each name after its last reader; Inductor plans buffers the same way).
The estimate follows that order over *storages*, not nodes:

- A node that makes new tensors owns one storage per tensor it returns, sized by its
  ``meta['val']`` (a tuple result, e.g. ``native_layer_norm``, owns one storage per element,
  and ``getitem`` picks one).
- A view (a schema whose return aliases an argument: ``view``, ``t``, ``split``; also
  ``_unsafe_view``), an in-place op (``add_``, ``copy_``) and ``wait_tensor`` (it returns the
  collective's own output) own nothing: they extend the storage they alias. ``reshape``
  may view or copy: it views a contiguous input and is counted as a copy of any other
  (a bucket's column slice reshaped to a parameter is a copy).
- Placeholders, attributes and everything aliasing them belong to the caller (parameters,
  optimizer state, the batch) and are not counted: they are alive for the whole step either
  way, so they shift every point of the profile alike.
- A storage lives from the node that makes it to the last reader of any of its aliases;
  one the output returns lives to the end.

``profile[i]`` is the sum of the storages alive while node ``i`` runs. It is an estimate:
allocator rounding, workspaces and a kernel's temporaries are not modelled, and symbolic
sizes count as 0. Passes compare two schedules of one program with it (e.g. whether keeping
a value alive longer raises the peak), which those omissions affect alike.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from spmd_compiler.ir.graph_utils import ALIASING_UNANNOTATED

from .checks import is_wait

Storage = tuple[torch.fx.Node, int]  # (the node that made it, which of its results)


@dataclass
class LiveBytes:
    """Bytes alive per node position of one graph (NOTE: [live bytes estimate])."""

    position: dict[torch.fx.Node, int]
    profile: list[int]
    # storage -> (bytes, first position, last position)
    storages: dict[Storage, tuple[int, int, int]] = field(default_factory=dict)
    owner: dict[torch.fx.Node, Storage | None] = field(default_factory=dict)

    @property
    def peak(self) -> int:
        return max(self.profile, default=0)

    def storage_of(self, node: torch.fx.Node) -> Storage | None:
        """The storage ``node``'s (first) tensor lives in; None for the caller's tensors."""
        return self.owner.get(node)


def value_bytes(value: Any) -> int:
    """Bytes of a tensor value, a node's ``meta['val']`` (0 for non-tensors and symbolic
    sizes; ``ir.collectives.tensor_bytes`` takes the node and expects concrete sizes)."""
    if not isinstance(value, torch.Tensor):
        return 0
    try:
        return int(value.numel()) * value.element_size()
    except (TypeError, RuntimeError):  # a symbolic size with no concrete value
        return 0


def live_bytes(graph: torch.fx.Graph) -> LiveBytes:
    """The estimated bytes alive at each node of ``graph`` (NOTE: [live bytes estimate])."""
    nodes = list(graph.nodes)
    position = {node: i for i, node in enumerate(nodes)}
    owner: dict[torch.fx.Node, Storage | None] = {}
    sizes: dict[Storage, int] = {}
    for node in nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            owner[node] = None
            continue
        aliased = _aliased_input(node)
        if aliased is not None:
            owner[node] = _owner_of_alias(node, aliased, owner)
            continue
        value = node.meta.get("val")
        results = value if isinstance(value, (tuple, list)) else (value,)
        for index, result in enumerate(results):
            nbytes = value_bytes(result)
            if nbytes:
                sizes[(node, index)] = nbytes
        owner[node] = (node, 0) if (node, 0) in sizes else None
    end = len(nodes) - 1
    last: dict[Storage, int] = {}
    for node in nodes:
        if not node.users:
            continue
        # NOTE: [storages read once per node]: what a reader keeps alive depends on the
        # node read, not on the reader; asked once per reader it cost results x readers for
        # a foreach node (one getitem per parameter): 4.4 s of one call on a 10k-node graph
        at = max(end if reader.op == "output" else position[reader] for reader in node.users)
        for storage in _storages_read(node, owner):
            last[storage] = max(last.get(storage, -1), at)
    delta = [0] * (len(nodes) + 1)
    spans: dict[Storage, tuple[int, int, int]] = {}
    for storage, nbytes in sizes.items():
        first = position[storage[0]]
        final = max(last.get(storage, first), first)
        spans[storage] = (nbytes, first, final)
        delta[first] += nbytes
        delta[final + 1] -= nbytes
    profile, running = [], 0
    for change in delta[:-1]:
        running += change
        profile.append(running)
    return LiveBytes(position, profile, spans, owner)


def _storages_read(node: torch.fx.Node, owner: dict[torch.fx.Node, Storage | None]) -> Iterable[Storage]:
    """The storages a reader of ``node`` keeps alive: the one it aliases, or all of a
    multi-result node's (a reader of the tuple itself, other than ``getitem``)."""
    storage = owner.get(node)
    if storage is not None:
        if storage[0] is node and isinstance(node.meta.get("val"), (tuple, list)):
            return _all_results(node)
        return [storage]
    return _all_results(node)


def _all_results(node: torch.fx.Node) -> list[Storage]:
    """Every tensor result's storage of a multi-result node."""
    value = node.meta.get("val")
    if not isinstance(value, (tuple, list)):
        return []
    return [(node, i) for i in range(len(value)) if value_bytes(value[i])]


def _aliased_input(node: torch.fx.Node) -> torch.fx.Node | None:
    """The input whose storage ``node``'s result shares, if it makes none of its own."""
    if node.op != "call_function":
        return None
    if node.target is operator.getitem or is_wait(node) or node.target in ALIASING_UNANNOTATED:
        source = node.args[0]
        return source if isinstance(source, torch.fx.Node) else None
    if node.target is torch.ops.aten.reshape.default:
        source = node.args[0]
        if not isinstance(source, torch.fx.Node):
            return None
        value = source.meta.get("val")
        contiguous = not isinstance(value, torch.Tensor) or value.is_contiguous()
        return source if contiguous else None
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns:
        return None
    if not any(r.alias_info is not None for r in schema.returns):
        return None
    for argument, value in zip(schema.arguments, node.args):
        if argument.alias_info is not None and isinstance(value, torch.fx.Node):
            return value
    return None


def _owner_of_alias(
    node: torch.fx.Node, source: torch.fx.Node, owner: dict[torch.fx.Node, Storage | None]
) -> Storage | None:
    if node.target is operator.getitem:
        index = node.args[1]
        made_here = owner.get(source)
        if made_here is not None and made_here[0] is source and isinstance(index, int):
            # one result of a multi-result node: its own storage
            value = source.meta.get("val")
            if isinstance(value, (tuple, list)):
                return (source, index) if value_bytes(value[index]) else None
        return made_here  # an element of a view list (split): the base's storage
    return owner.get(source)
