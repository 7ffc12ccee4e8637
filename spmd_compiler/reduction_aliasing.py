"""Whether a program reads a bucket's part after Inductor would reduce the bucket in place.

NOTE: [buckets reduced in place by Inductor]
Inductor lowers a functional ``all_reduce(bucket)`` as ``all_reduce_`` on a copy of the
bucket, and drops the copy by reusing the bucket's buffer when nothing reads the bucket
afterwards. It also computes each input of a ``cat`` straight into its slice of the
``cat``'s buffer. Together they break when an input of the bucket's ``cat`` is also read
by another node: that reader may get a view into the buffer the reduction overwrote, the
reduced value instead of the local one (torch 2.13, CPU, whole-program lowering; its
no-op removal drops a ``clone`` put in between, so a copy of ours cannot prevent it).

Measured: a ddp step with ``scaler.unscale_(optimizer)`` and ``clip_grad_norm_`` on 2 gloo
ranks (float64), whose partial gradients were reduced three times (the inf check, the
norm, the update): the bias gradients, views of a ``sum`` that went into the buckets
unchanged, came out twice their value from the whole-program lowering, while the
interpreter and Inductor's compute regions (which run every collective outside the
compiled code, NOTE: [compute regions]) were exact.

So a program in which any input of a ``cat`` feeding an ``all_reduce`` is read by a node
other than that ``cat`` is lowered by compute regions instead of as one graph. The usual
gradient bucket, whose parts only the ``cat`` reads, keeps the one graph; so does a part
whose other readers read only its shape and dtype (``ones_like`` of the loss, the seed of
backward, when the loss rides in the bucket).
"""

from __future__ import annotations

import torch
import torch.fx

from .ir.collectives import collective_kind
from .ir.graph_utils import returns_alias

aten = torch.ops.aten

# ops that read their input's shape, dtype and device only, never its values: the loss
# (a bucket part when it is all-reduced for the step's result) also seeds backward as
# ``ones_like(loss)``. Counting such a reader sent every ddp program of the benchmarks to
# compute regions on CPU (mlp-512, 2 gloo ranks: 16.4-17.6 ms a step as one graph,
# 19.3-20.3 ms by regions, torch DDP 19.5-21.4; three launches each, 2026-11-27).
_READS_METADATA_ONLY = {
    aten.ones_like.default, aten.zeros_like.default, aten.empty_like.default,
    aten.full_like.default, aten.new_ones.default, aten.new_zeros.default,
    aten.new_empty.default, aten.new_full.default, aten.sym_size.int, aten.sym_stride.int,
    aten.sym_numel.default,
}


def _read_elsewhere(node: torch.fx.Node, cat: torch.fx.Node) -> bool:
    """Whether the memory ``node`` (an input of ``cat``) may live in is read by anything
    but ``cat``: any user, along the chain of aliasing ops it came from, off that chain."""
    chain = [node]
    while returns_alias(chain[-1]) and isinstance(chain[-1].args[0], torch.fx.Node):
        chain.append(chain[-1].args[0])
    if chain[-1].op == "placeholder":  # a program input: the cat copies it anyway
        return False
    on_chain = {*chain, cat}
    return any(
        user not in on_chain and user.target not in _READS_METADATA_ONLY
        for n in chain for user in n.users
    )


def bucket_part_read_elsewhere(gm: torch.fx.GraphModule) -> torch.fx.Node | None:
    """The first ``all_reduce`` whose bucket has a part another node reads (see the
    NOTE), or None."""
    for node in gm.graph.nodes:
        if collective_kind(node) != "all_reduce":
            continue
        cat = node.args[0]
        while isinstance(cat, torch.fx.Node) and returns_alias(cat) and isinstance(cat.args[0], torch.fx.Node):
            cat = cat.args[0]
        if not isinstance(cat, torch.fx.Node) or cat.target is not aten.cat.default:
            continue
        parts = cat.args[0]
        if any(isinstance(p, torch.fx.Node) and _read_elsewhere(p, cat) for p in parts):  # type: ignore[union-attr]
            return node
    return None


__all__ = ["bucket_part_read_elsewhere"]
