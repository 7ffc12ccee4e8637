"""List arguments whose items are samples, not batch tensors.

NOTE: [a list of samples split as batch tensors]
torchvision's detection models take their targets as a list with one entry per image
(``List[Dict[str, Tensor]]``, boxes of shape ``(n_i, 4)``), and a step loops over it:
``for i, boxes in enumerate(targets): loss += f(pred[i], boxes)``. A data-parallel mode
splits each item along its own dimension 0 as if it were a batch tensor. In simulation,
where the caller passes the global list, DTensor puts the pieces back and the step
computes what eager does; on real ranks each rank passes its own images' items, the
program reads the rank's list as the whole batch, and the loop pairs its ``len(targets)``
items with the first rows of the global ``pred``: a box regressor 2x eager's loss and
its weights 0.316 off one device after 3 steps on 2 gloo ranks, no sign but a walk
warning that took the loop for an edge_index's rows (sixty-fourth session). With uneven
counts in simulation, the split of an item of one box was refused with a hint to name
that one item None.

What gives it away: a list (or tuple, at any depth of an argument) whose length is the
batch size of an argument split outside it, as the caller passes both (each rank its
share on real ranks, the global value in simulation), while the dimension 0 of one of
its items (of a tensor inside an item, a dict's ``boxes``) is not that size (the
dimension the mode splits it along: dimension 1 under ``input_batch_dim=1``; a list of
one item too, a rank's batch of one: a review found both missed). A list of
batch tensors (two views ``[x1, x2]`` of ``(B, F)``, multi-crop ``(B, C, H, W)`` of
different sizes) has items whose dimension 0 is the batch: not refused, whatever its
length. Refused, in simulation and on real ranks alike (so the two compute the same),
before anything is placed, naming the list, an item that gives it away and the line
that reads it. Naming the list in the mode (``{'targets': None}``: every rank passes
the same whole list; ``{'targets': 0}``: each item is a batch tensor) says which it is.
Not detected: a list beside no split argument outside it (``images`` and ``targets``
lists alone), and one whose items all happen to have the batch size in dimension 0.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import torch.fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement

from .. import _torch_private as private
from ..errors import SPMDCompileError, node_error
from ..ir.graph_utils import placeholders
from ..ir.node_meta import USER_LINE
from ..ir.signature import CapturedStep, Kind

# one part of an argument path as pytree's keystr writes it: ``.attr``, ``['key']``, ``[3]``
_PART = re.compile(r"\.\w+|\[(?:'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|(-?\d+)|[^\]]*)\]")


def sequences_holding(path: str) -> list[tuple[str, int]]:
    """Each sequence ``path`` lies in, as (its path, the item's index): ``targets[0]['boxes']``
    lies in item 0 of ``targets``."""
    top = re.match(r"\w+", path)
    if top is None:
        return []
    out: list[tuple[str, int]] = []
    pos = top.end()
    while pos < len(path):
        match = _PART.match(path, pos)
        if match is None:
            return out
        if match.group(1) is not None:
            out.append((path[:pos], int(match.group(1))))
        pos = match.end()
    return out


def _passed_sizes(
    shape: Sequence[int], placements: Sequence[Placement], mesh: DeviceMesh, simulated: bool
) -> dict[int, int]:
    """Each split dimension of an argument and its size as the caller passes it: the
    global size in simulation, one rank's share on real ranks."""
    ranks: dict[int, int] = {}
    for m, p in enumerate(placements):
        if private.is_shard_like(p) and mesh.size(m) > 1 and -len(shape) <= p.dim < len(shape):
            dim = p.dim % len(shape)
            ranks[dim] = ranks.get(dim, 1) * mesh.size(m)
    return {d: shape[d] if simulated else shape[d] // n for d, n in ranks.items()}


def check_listed_samples(
    captured: CapturedStep, mesh: DeviceMesh, placements: Sequence[Sequence[Placement]],
    named: Callable[[str], bool], simulated: bool, hint: str | None = None,
) -> None:
    """Refuse a list argument whose items are samples split as batch tensors (NOTE: [a
    list of samples split as batch tensors]); ``named``: whether the mode names an
    argument path's batch dimension; ``hint``: what to do, for a mode without
    ``input_batch_dim``.

    Raises:
        SPMDCompileError: naming the list, an item and the line that reads it.
    """
    split: dict[str, tuple[int, dict[int, int], tuple[int, ...]]] = {}  # path -> index, sizes, shape
    for k, ((ref, meta), pl) in enumerate(zip(captured.inputs, placements, strict=True)):
        if ref.kind is Kind.INPUT and ref.name and meta.shape:
            sizes = _passed_sizes(tuple(meta.shape), pl, mesh, simulated)
            if sizes:
                split[ref.name] = (k, sizes, tuple(meta.shape))
    lists: dict[str, set[int]] = {}
    for path in split:
        for sequence, index in sequences_holding(path):
            lists.setdefault(sequence, set()).add(index)
    for sequence, indices in lists.items():
        inside = [p for p in split if p.startswith(sequence + "[") and not named(p)]
        if named(sequence):  # a one-item list too: a rank's batch of one (a review)
            continue
        batches = {
            path: sizes for path, (_, sizes, _) in split.items()
            if not path.startswith((sequence + "[", sequence + "."))
            and len(indices) in sizes.values()
        }
        # an item split along a dimension not of the batch's size (along its dimension 1
        # under input_batch_dim=1: a review found dimension 0 alone checked)
        odd = [p for p in inside if any(size != len(indices) for size in split[p][1].values())]
        if batches and odd:
            raise _samples_error(captured, sequence, len(indices), batches, odd, split, hint)


def _samples_error(
    captured: CapturedStep, sequence: str, length: int, batches: dict[str, dict[int, int]],
    odd: list[str], split: dict[str, tuple[int, dict[int, int], tuple[int, ...]]], hint: str | None,
) -> SPMDCompileError:
    other = next(iter(batches))
    dim = next(d for d, s in batches[other].items() if s == length)
    shown = ", ".join(
        f"{p}: {size} in dimension {d}" for p in odd[:3] for d, size in split[p][1].items() if size != length
    ) + (", ..." if len(odd) > 3 else "")
    message = (
        f"The list argument {sequence!r} holds one sample per item: its {length} items are "
        f"as many as the batch of {other!r} (its dimension {dim}, as passed), while the "
        f"dimension the mode splits them along is not that batch ({shown}). The mode would "
        "split each item as if it were a batch tensor: on real ranks, where each rank "
        "passes its own samples, the program would read each rank's list as the global "
        "batch's first items, each pieced together from the ranks' items at its position, "
        "and the step would train wrong."
    )
    batch_dims = _dims_of_size(odd, split, length)
    elsewhere = (
        f"if its items are batch tensors whose batch lies in dimension {batch_dims[0]} (an "
        f"RNN's (h0, c0) of (layers, B, H)), say so: input_batch_dim={{{sequence!r}: "
        f"{batch_dims[0]}}}; if they are samples, " if batch_dims else ""
    )
    hint = hint or elsewhere + (
        "pad the per-sample tensors into one batch tensor in the collate function, with a "
        "count or validity mask (boxes (B, M, 4) padded to the most boxes M, and counts (B,) "
        f"or a mask (B, M)), and use them in the step batched or masked: its dimension 0 is "
        f"then split with the batch; or input_batch_dim={{{sequence!r}: None}} only if every "
        f"rank passes the same whole list, or {{{sequence!r}: 0}} only if each item is a "
        "batch tensor whose dimension 0 is its batch (another batch of that size beside it)."
    )
    placeholder = placeholders(captured.graph_module)[split[odd[0]][0]]
    reader = next((n for n in _readers(placeholder) if n.meta.get(USER_LINE) is not None), None)
    if reader is None:
        return SPMDCompileError(message, hint=hint)
    return node_error(message, reader, hint=hint)


def _dims_of_size(
    odd: list[str], split: dict[str, tuple[int, dict[int, int], tuple[int, ...]]], length: int
) -> list[int]:
    """The dimensions other than the split ones where every odd item's size, as passed,
    is ``length``: where the items' batch may lie instead."""
    common: set[int] | None = None
    for p in odd:
        _, sizes, shape = split[p]
        dims = {d for d, n in enumerate(shape) if d not in sizes and n == length}
        common = dims if common is None else common & dims
    return sorted(common or ())


def _readers(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes that read ``node``, then what reads those, in graph order (a user line
    is on the first op the step's code made)."""
    seen, order = {node}, [node]
    for n in order:
        for user in n.users:
            if user not in seen and len(order) < 64:
                seen.add(user)
                order.append(user)
    return order[1:]
