"""Batch dimensions the step iterates over, found while expanding.

NOTE: [a batch dimension iterated over]
A data-parallel mode splits each tensor argument along its batch dimension, 0 unless
``input_batch_dim`` names another. A time-major argument (an RNN's ``(T, B, F)`` input,
the ``(S, B)`` tokens of torch's own language-model tutorial) passed without naming its
batch dimension is split along time instead. In simulation, where the caller passes the
global value, DTensor puts the pieces back together and the step computes what eager
does; on real ranks each rank passes its own share, ``(T, B / world, F)``, which the
program reads as one rank's share of a sequence ``world`` times longer: shapes agree,
nothing fails, and the step trains wrong (a GRU 4.9e-2 off one device after 3 steps on
2 gloo ranks, fifty-third session).

What gives it away is the step iterating over that dimension: ``unbind``, or ``select``
of two or more indices, along a dimension that is the split dimension of a value
computed from a split argument (torch's own recurrent layers unbind time steps; a
hand-written ``for t in range(T): x[t]``). A batch dimension is rarely walked that way
(a per-sample loop), a time axis always; one sample picked (``x[0]``) is not a walk. Expansion records each such op (``BatchIterations``); the data-parallel modes
then refuse the program on real ranks unless ``input_batch_dim`` names every argument
concerned (``{'x': 1}`` for time-major, ``{'x': 0}`` to confirm a per-sample loop), and
warn once in simulation, where the result is right either way but the same step would
be refused on real ranks. Before the fifty-fourth session this trained wrong silently.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch.distributed.tensor import DTensor

from .. import _torch_private as private
from ..errors import node_error

# op -> the position of its dimension argument (and the default where it has one)
_ITERATIONS: dict[Any, tuple[int, int | None]] = {
    torch.ops.aten.unbind.int: (1, 0),
    torch.ops.aten.select.int: (1, None),
}


@dataclass(frozen=True)
class IteratedBatch:
    """``node`` (of the captured graph) iterates over dimension ``dim`` of a value whose
    split dimension comes from the step arguments ``arguments``."""

    node: torch.fx.Node
    arguments: tuple[str, ...]
    dim: int


class BatchIterations:
    """Collects ``IteratedBatch`` records while the expanding interpreter runs: told of
    each split argument as its placeholder is read and of each op before it runs."""

    def __init__(self, graph: torch.fx.Graph) -> None:
        self._graph = graph
        self._split: dict[torch.fx.Node, str] = {}  # placeholder -> argument name
        self._mesh_dims: set[int] = set()  # mesh dimensions that split an argument
        self._reach: dict[torch.fx.Node, frozenset[str]] | None = None
        self._seen: set[tuple[str, ...]] = set()
        # (the selected value's node, dimension) -> the indices selected from it
        self._selected: dict[tuple[Any, int], set[Any]] = {}
        self.found: list[IteratedBatch] = []

    def argument(self, node: torch.fx.Node, name: str, value: Any) -> None:
        """Placeholder ``node`` holds step argument ``name`` as ``value``."""
        if not isinstance(value, DTensor):
            return
        dims = {m for m, p in enumerate(value.placements) if private.is_shard_like(p)}
        if dims:
            self._split[node] = name
            self._mesh_dims |= dims

    def op(self, node: torch.fx.Node, target: Any, args: tuple, kwargs: dict) -> None:
        """Record ``node`` if it iterates over the split dimension of its input."""
        if target not in _ITERATIONS or not self._split or not args or not isinstance(args[0], DTensor):
            return
        position, default = _ITERATIONS[target]
        dim = args[position] if len(args) > position else kwargs.get("dim", default)
        value = args[0]
        if not isinstance(dim, int) or not value.ndim:
            return
        dim %= value.ndim
        if not any(
            private.is_shard_like(p) and p.dim == dim
            for m, p in enumerate(value.placements) if m in self._mesh_dims
        ):
            return
        if target is torch.ops.aten.select.int:
            # one sample picked (``x[0]``: a penalty on the first sample) is no iteration;
            # a second index of the same value and dimension is
            index = args[2] if len(args) > 2 else None
            picked = self._selected.setdefault((node.args[0], dim), set())
            picked.add(index)
            if len(picked) < 2:
                return
        arguments = tuple(sorted(self._reaching(node)))
        if arguments and arguments not in self._seen:
            self._seen.add(arguments)
            self.found.append(IteratedBatch(node, arguments, dim))

    def _reaching(self, node: torch.fx.Node) -> frozenset[str]:
        """The split arguments ``node`` is computed from (one pass over the graph, the
        first time it is asked)."""
        if self._reach is None:
            self._reach = {}
            for n in self._graph.nodes:
                names = {self._split[n]} if n in self._split else set()
                for source in n.all_input_nodes:
                    names |= self._reach.get(source, frozenset())
                self._reach[n] = frozenset(names)
        return self._reach.get(node, frozenset())


def check_iterated_batches(
    found: list[IteratedBatch], named: Callable[[str], bool], split: dict[str, tuple[int, tuple[int, ...]]],
    simulated: bool,
) -> None:
    """Refuse (real ranks) or warn once (simulation) for each record whose arguments
    ``input_batch_dim`` does not all name: NOTE: [a batch dimension iterated over].
    ``split``: each split argument's split dimension and global shape, to suggest the
    arguments laid out alike (labels ``(T, B)`` beside a ``(T, B, F)`` input: naming
    the input alone would leave them cut along time).

    Raises:
        SPMDCompileError: on real ranks.
    """
    for record in found:
        unnamed = [a for a in record.arguments if not named(a)]
        if not unnamed:
            continue
        listed = ", ".join(repr(a) for a in unnamed)
        first = unnamed[0]
        sizes = {split[a][1][split[a][0]] for a in unnamed if a in split}
        alike = [a for a, (d, shape) in split.items()
                 if a in unnamed or (not named(a) and len(shape) > 1 and shape[d] in sizes)]
        time_major = ", ".join(f"{a!r}: 1" for a in alike) or f"{first!r}: 1"
        message = (
            f"This op iterates over dimension {record.dim} of a value computed from the "
            f"step argument(s) {listed}, the dimension the mode splits as the batch "
            f"(input_batch_dim does not name {'it' if len(unnamed) == 1 else 'them'}). A "
            f"time-major argument ((T, B, ...): an RNN's input) is split along time this way: "
            "on real ranks each rank's share would be read as its part of a sequence as many "
            "times longer as there are ranks, and the step would train wrong."
        )
        others = [a for a in alike if a not in unnamed]
        also = (
            f" ({', '.join(repr(a) for a in others)} {'has' if len(others) == 1 else 'have'} a "
            f"dimension 0 of the same size: name every argument laid out this way)" if others else ""
        )
        hint = (
            f"name the batch dimension in the mode: input_batch_dim={{{time_major}}} for "
            f"time-major (T, B, ...) arguments{also}, or input_batch_dim={{{first!r}: 0}} if "
            f"dimension 0 is the batch and the step loops over samples."
        )
        error = node_error(message, record.node, hint=hint)
        if not simulated:
            raise error
        warnings.warn(
            f"{error} (refused on real ranks; simulated ranks are passed the global value, "
            "which is split right either way)",
            stacklevel=2,
        )
