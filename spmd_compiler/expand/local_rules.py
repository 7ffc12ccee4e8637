"""Ops expansion computes on local tensors itself, where DTensor's propagation would hold
or move more than a rank needs.

NOTE: [local batch only]
A data-parallel rank must only ever hold its local batch. DTensor gives a value made
without a sharded input Replicate: ``expand(ones_like(loss), [64, 10])`` (the gradient of
a ``.sum()`` loss) or ``torch.ones(batch, seq)`` (a default attention mask) would hold
the GLOBAL batch on every rank, and every op after it up to the first sharded operand
would compute on the global batch. Such values are constant along the broadcast (or
filled) dimension, so sharding them there is exact: each rank makes its local slice
directly (``expand(ones_like, [16, 10])``, placement Shard(0)). Expansion does so for a
dimension whose global size is a batch size the mode shards an input on (the global
size of an input's sharded dimension, per mesh dimension); choosing the dimension by
its size never changes a result, only where the value is split.
``passes/checks.py: check_local_batch`` holds every program to this.

NOTE: [unbind along a sharded dimension]
``list(x)`` / ``x.unbind(0)`` / ``for row in x`` on a batch-sharded ``x`` gives pieces
that each lie whole on one rank, which no DTensor placement describes; DTensor's rule
refuses to redistribute inside ``unbind``. Expansion gathers that dimension first
(``Shard(d)`` -> ``Replicate``) and unbinds the gathered tensor: every rank holds every
piece, exact, at the cost of an all-gather (Llava's ``list(image_features)``; the
``cat`` after it is replicated until it meets a sharded operand).

NOTE: [fused projections]
A fused projection (one Linear making q, k and v, split after) is sharded by
``FusedColwiseParallel(chunks=3)`` as ``_StridedShard(dim, split_factor=3)``: rank r
holds block r of each of q, k and v, so each rank computes whole heads. DTensor carries
_StridedShard through the Linear but all-gathers at the ``split``; the rules here split
(and ``cat`` back, in backward) the local tensor instead when the pieces are exactly the
``split_factor`` blocks: piece i of a ``_StridedShard(d, k)`` tensor is ``Shard(d)``,
and k equal ``Shard(d)`` pieces concatenated on d are ``_StridedShard(d, k)``.

NOTE: [variances by sums]
A batch norm in training normalizes with the global batch's mean and variance: at capture
it is decomposed into a ``var_mean`` over the batch (and spatial) dimensions. DTensor's
rule for ``var_mean`` (a reduction that is not linear) gathers a sharded reduced
dimension, so every batch norm of a convolutional network all-gathered its input, the
whole activation, where ``nn.SyncBatchNorm`` exchanges a few numbers per channel. Over a
dimension split evenly by plain shards, each rank computes its part's sum and the sum of
squared deviations from its own mean (two values per channel), one all-gather brings
every rank's pair to every rank, and each rank combines them in the parallel form of
Welford's method (Chan et al.; what ``nn.SyncBatchNorm`` does with
``batch_norm_gather_stats_with_counts``): mean = (sum of the sums) / N, M2 = (sum of the
parts' M2) + n * (sum over parts of (part mean - mean)^2), variance = M2 / (N -
correction). The statistics are ready after one round trip, where a forward batch norm
waits for them; and no sum of squares of raw values is subtracted (the one-pass formula
loses the variance to cancellation when the mean is large). Until the forty-second
session it was the two-pass formula over the ranks: the mean's all-reduce, then the
squared deviations' all-reduce, two dependent round trips per batch norm; both agree with
eager's kernel within float64 rounding (``tests/sim/test_variances_by_sums.py``). Other
splits (``_StridedShard``, uneven, a Partial input) keep the two-pass sums, each a sum
DTensor reduces across ranks (an all-reduce of one value per channel). Also ``var``,
``std`` and ``std_mean``; a reduction over unsharded dimensions is DTensor's.
The backward of a batch norm multiplies the activation (sharded) by per-channel sums
(Partial): DTensor's rule gathered the activation, multiplied, and reduce-scattered the
product back; a pointwise ``mul`` / ``add`` / ``sub`` / ``div`` of a Partial operand
smaller than a sharded one now reduces the small one first (an all-reduce of a value per
channel). ``tests/sim/test_variances_by_sums.py``: a two-batch-norm convolutional step
under ddp issued 2 all-gathers and 2 reduce-scatters of an activation each plus the
forward's gathers before; only all-reduces now.

NOTE: [batch concatenation]
Views of one batch concatenated along the batch dimension and run through one model
(SimCLR's two augmented views, RAFT's ``feature_encoder(torch.cat([image1, image2]))``,
siamese networks) have no ``Shard`` placement: rank r holds its share of each view, which
is not one contiguous block of the concatenation. DTensor's ``cat`` rule therefore
moved the operands: torch 2.13 gathered them (every rank ran the encoder on every row),
torch 2.14 sharded another dimension when that was cheaper to reach, the channels of an
image batch (from 64 x 64 images on), whose convolution DTensor then ran on the local
channels as if they were all (refused by NOTE: [local shape check]). On a 1-D mesh,
inputs of one shape sharded alike on the ``cat`` dimension are concatenated locally
into ``_StridedShard(dim, k)`` (as for fused projections above): each rank's encoder
runs on its own rows, and ``chunk`` / ``split`` / ``slice`` into the k views give back
``Shard(dim)`` locally. Ops DTensor has no ``_StridedShard`` rule for redistribute it
(correct, gathered): torch 2.11's convolution rule is one of them, so there the encoder
still runs on the gathered batch. Other concatenations along a sharded dimension (views of different
sizes; a 2-D mesh) gather the operands on those mesh dimensions first, on every torch.
A dimension counts as the batch where an operand is sharded on it with a global size the
mode shards a step argument on (as in NOTE: [local batch only]); a concatenation along a
tensor-parallel dimension is left to DTensor.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from .. import _torch_private as private
from ..ir.signature import contiguous_stride

aten = torch.ops.aten

# Factories whose value is the same at every index (empty: unspecified, so any split is
# as good as another).
_FILLED_FACTORIES = {
    aten.ones.default: 0,
    aten.zeros.default: 0,
    aten.full.default: 0,
    aten.empty.memory_format: 0,
}

# The same, made from a tensor (``grad.new_zeros(size)``: the zeros a gather's or an
# index's backward scatters into): its options, the size its second argument.
_NEW_FILLED_FACTORIES = {
    aten.new_zeros.default, aten.new_ones.default, aten.new_full.default,
    aten.new_empty.default,
}


@dataclass(frozen=True)
class LocalRules:
    """What the rules need: the mesh, per mesh dimension the global batch sizes, and
    whether the program has fused projections (a _StridedShard parameter)."""

    mesh: DeviceMesh
    batch_sizes: Mapping[int, frozenset[int]] = field(default_factory=dict)
    fused_projections: bool = False

    def apply(self, target: Any, args: tuple, kwargs: dict) -> Any:
        """The op's result computed locally, or None to let DTensor propagate it."""
        if target is aten.expand.default and isinstance(args[0], DTensor):
            return self._expand(args[0], list(args[1]))
        if target in _FILLED_FACTORIES and self.batch_sizes:
            return self._filled_factory(target, args, kwargs)
        if target in _NEW_FILLED_FACTORIES and self.batch_sizes and isinstance(args[0], DTensor):
            return self._filled_factory(
                lambda shape, *rest, **kw: target(private.local_tensor_of(args[0]), shape, *rest, **kw),
                args[1:], kwargs,
            )
        if (
            target in _SHAPE_CHANGING_VIEWS and args and isinstance(args[0], DTensor)
            and any(private.is_mask_partial(p) for p in args[0].placements)
        ):
            return _mask_partial_reduced_first(target, args, kwargs)
        if target is aten.embedding.default:  # NOTE: [a mask for every lookup] (_torch_private)
            return private.lookup_with_own_masks(args, kwargs)
        if target is aten.unbind.int and isinstance(args[0], DTensor):
            return _unbind_gathered(args[0], args[1] if len(args) > 1 else kwargs.get("dim", 0))
        if target in _BINARY_POINTWISE and len(args) >= 2:
            return _partial_reduced_first(target, args, kwargs)
        if target in _MATMUL_OPERANDS:
            return _partial_matmul_operand_reduced(target, args, kwargs)
        if target in _VARIANCES and isinstance(args[0], DTensor):
            return _variance_by_sums(target, args, kwargs)
        if target is aten.cat.default and self.batch_sizes:
            return _cat_along_the_batch(args, kwargs, self.batch_sizes, strided=self.mesh.ndim == 1)
        strided_views = self.fused_projections or (self.batch_sizes and self.mesh.ndim == 1)
        if not strided_views:
            return None
        if target in (aten.split.Tensor, aten.split_with_sizes.default):
            return _split_strided(target, args, kwargs)
        if target is aten.slice.Tensor:
            return _slice_strided(args)
        if target is aten.cat.default:
            return _cat_to_strided(args, kwargs)
        return None

    # ------------------------------------------------------------------ local batch

    def _batch_shards(self, shape: Sequence[int], candidates: Sequence[int]) -> dict[int, int]:
        """mesh dim -> tensor dim to shard: a candidate dim whose size is that mesh
        dimension's global batch size (and splits evenly)."""
        chosen: dict[int, int] = {}
        for mesh_dim, sizes in self.batch_sizes.items():
            n = self.mesh.size(mesh_dim)
            for dim in candidates:
                if dim not in chosen.values() and shape[dim] in sizes and shape[dim] % n == 0:
                    chosen[mesh_dim] = dim
                    break
        return chosen

    def _placements_and_local_shape(
        self, shape: Sequence[int], chosen: dict[int, int]
    ) -> tuple[list[Placement], list[int]]:
        placements: list[Placement] = [Replicate()] * self.mesh.ndim
        local = list(shape)
        for mesh_dim, dim in chosen.items():
            placements[mesh_dim] = Shard(dim)
            local[dim] //= self.mesh.size(mesh_dim)
        return placements, local

    def _expand(self, value: DTensor, size: list[int]) -> DTensor | None:
        if not self.batch_sizes or not all(isinstance(p, Replicate) for p in value.placements):
            return None
        offset = len(size) - value.dim()
        shape = [value.shape[d - offset] if s == -1 else int(s) for d, s in enumerate(size)]
        broadcast = [
            d for d in range(len(shape))
            if d < offset or (value.shape[d - offset] == 1 and shape[d] != 1)
        ]
        chosen = self._batch_shards(shape, broadcast)
        if not chosen:
            return None
        placements, local_shape = self._placements_and_local_shape(shape, chosen)
        local = private.local_tensor_of(value).expand(local_shape)
        stride = [0 if d in broadcast else value.stride(d - offset) for d in range(len(shape))]
        return DTensor.from_local(
            local, self.mesh, placements, run_check=False,
            shape=torch.Size(shape), stride=tuple(stride),
        )

    def _filled_factory(self, target: Any, args: tuple, kwargs: dict) -> DTensor | None:
        shape = [int(s) for s in args[0]]
        chosen = self._batch_shards(shape, range(len(shape)))
        if not chosen:
            return None
        placements, local_shape = self._placements_and_local_shape(shape, chosen)
        local = target(local_shape, *args[1:], **kwargs)
        return DTensor.from_local(
            local, self.mesh, placements, run_check=False,
            shape=torch.Size(shape), stride=contiguous_stride(shape),
        )


# ------------------------------------------------------------------- variances

# op -> (returns the standard deviation, returns the mean too)
_VARIANCES = {
    aten.var.correction: (False, False), aten.var_mean.correction: (False, True),
    aten.std.correction: (True, False), aten.std_mean.correction: (True, True),
}


def _variance_by_sums(target: Any, args: tuple, kwargs: dict) -> Any:
    """A variance over a sharded dimension as two sums (NOTE: [variances by sums])."""
    x: DTensor = args[0]
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    dims = list(range(x.dim())) if not dims else [d % x.dim() for d in dims]
    if x.is_complex() or not x.is_floating_point() or not any(
        private.is_shard_like(p) and p.dim in dims
        for p in x.placements
    ):
        return None
    correction = kwargs.get("correction")
    correction = 1 if correction is None else correction
    keepdim = bool(kwargs.get("keepdim", False))
    root, with_mean = _VARIANCES[target]
    moments = _variance_by_gathered_moments(x, dims, correction, keepdim)
    if moments is not None:
        variance, mean = moments
        out = aten.sqrt.default(variance) if root else variance
        return (out, mean) if with_mean else out
    count = 1
    for d in dims:
        count *= x.shape[d]
    mean = aten.sum.dim_IntList(x, dims, True) / count
    deviation = x - mean
    variance = aten.sum.dim_IntList(deviation * deviation, dims, keepdim) / max(count - correction, 0)
    out = aten.sqrt.default(variance) if root else variance
    if not with_mean:
        return out
    return out, mean if keepdim else aten.squeeze.dims(mean, dims)


def _variance_by_gathered_moments(
    x: DTensor, dims: list[int], correction: Any, keepdim: bool
) -> tuple[DTensor, DTensor] | None:
    """The variance and mean of ``x`` over ``dims`` from each rank's count, sum and sum
    of squared deviations from its own mean, gathered in one collective and combined
    (NOTE: [variances by sums]); None where ``x`` is not split evenly by plain shards of
    reduced dimensions (the two sums then)."""
    mesh = x.device_mesh
    gathered: list[int] = []  # mesh dims whose shards of a reduced dim are gathered
    parts = dict.fromkeys(dims, 1)  # reduced dim -> how many parts the mesh splits it in
    for m, p in enumerate(x.placements):
        if isinstance(p, Replicate):
            continue
        if type(p) is not Shard:  # Partial, _StridedShard
            return None
        if p.dim in dims:
            parts[p.dim] *= mesh.size(m)
            gathered.append(m)
    if any(x.shape[d] % n for d, n in parts.items()):  # uneven: ranks count differently
        return None
    local = private.local_tensor_of(x)
    compute = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    local = local.to(compute)
    local_count = 1
    count = 1
    for d in dims:
        local_count *= local.shape[d]
        count *= x.shape[d]
    local_sum = aten.sum.dim_IntList(local, dims, True)
    deviation = local - local_sum / local_count
    squares = aten.sum.dim_IntList(deviation * deviation, dims, True)
    lead = len(gathered)
    stacked = torch.stack([local_sum, squares]).reshape((1,) * lead + (2, *local_sum.shape))
    reduced_shape = [1 if d in dims else x.shape[d] for d in range(x.dim())]
    shape = [mesh.size(m) for m in gathered] + [2, *reduced_shape]
    placements: list[Placement] = [Replicate()] * mesh.ndim
    for m, p in enumerate(x.placements):
        if m in gathered:
            placements[m] = Shard(gathered.index(m))
        elif isinstance(p, Shard):  # a kept dimension (a tensor-parallel channel split)
            placements[m] = Shard(lead + 1 + p.dim)
    spread = DTensor.from_local(
        stacked, mesh, placements, run_check=False,
        shape=torch.Size(shape), stride=contiguous_stride(shape),
    )
    kept = [Replicate() if m in gathered else p for m, p in enumerate(placements)]
    every = private.local_tensor_of(spread.redistribute(mesh, kept))
    every = every.reshape(-1, *every.shape[lead:])  # (ranks, 2, *reduced)
    sums, deviations = every[:, 0], every[:, 1]
    mean = sums.sum(0) / count
    spread_of_means = sums / local_count - mean
    m2 = deviations.sum(0) + local_count * (spread_of_means * spread_of_means).sum(0)
    variance = m2 / max(count - correction, 0)
    if not keepdim:
        variance, mean = variance.squeeze(dims), mean.squeeze(dims)
    out_shape = [s for d, s in enumerate(reduced_shape) if keepdim or d not in dims]
    out_placements: list[Placement] = []
    for p in x.placements:
        if isinstance(p, Shard) and p.dim not in dims:
            out_placements.append(Shard(p.dim if keepdim else p.dim - sum(d < p.dim for d in dims)))
        else:
            out_placements.append(Replicate())
    return tuple(  # type: ignore[return-value]
        DTensor.from_local(
            t.to(x.dtype), mesh, out_placements, run_check=False,
            shape=torch.Size(out_shape), stride=contiguous_stride(out_shape),
        )
        for t in (variance, mean)
    )


_BINARY_POINTWISE = {aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor, aten.div.Tensor}


def _partial_reduced_first(target: Any, args: tuple, kwargs: dict) -> Any:
    """A pointwise op of a small Partial operand and a larger sharded one (NOTE:
    [variances by sums]): the Partial one is reduced first."""
    a, b = args[0], args[1]
    if not (isinstance(a, DTensor) and isinstance(b, DTensor)):
        return None
    moved = False
    operands = [a, b]
    for i, (small, large) in enumerate(((a, b), (b, a))):
        if small.numel() >= large.numel():
            continue
        placements = list(small.placements)
        for m, p in enumerate(small.placements):
            if p.is_partial() and isinstance(large.placements[m], Shard):
                placements[m] = Replicate()
        if placements != list(small.placements):
            operands[i] = small.redistribute(small.device_mesh, placements)
            moved = True
    if not moved:
        return None
    return target(*operands, *args[2:], **kwargs)


# ------------------------------------------------------------------- matmuls of partial sums

# NOTE: [a partial operand of a matmul reduced first]
# A gradient that is a partial sum over tp (the input gradient of a colwise Linear: each
# rank's product with its rows of the weight) meets, further back, a matmul whose other
# operand is sharded on tp (a rowwise Linear's input, a weight's shard). No placement
# multiplies a Partial by a Shard on one mesh dimension, so one operand must move, and
# DTensor prices gathering the sharded one (keeping the sum pending) below reducing the
# sum: every later reader of the pending sum then gathers again, and the weight
# gradients come out partial where the weights are sharded. A decomposed RMSNorm (Llama,
# Qwen, Mistral: pow, mean, rsqrt; linear in the incoming gradient) passes the head's
# partial input gradient on unreduced, so in HF Qwen2 under tp every MLP's backward
# gathered its activation and reduce-scattered its weight gradient (2 layers, width 32, a
# 4 x 8 batch, 2 ranks: 19 collectives, 296,192 bytes per step; fsdp_tp 2x2: 33 and
# 643,856). The partial operand is reduced first instead (one all-reduce, shared by the
# value's other readers; eager Megatron-style TP reduces it at the module boundary): 10
# collectives and 132,352 bytes (fsdp_tp: 14 and 275,216, with NOTE: [a gradient
# computed whole on tp]). Exact either way; only where the sum is reduced changes.
_MATMUL_OPERANDS = {
    aten.mm.default: (0, 1), aten.bmm.default: (0, 1),
    aten.addmm.default: (1, 2), aten.baddbmm.default: (1, 2),
}


def _partial_matmul_operand_reduced(target: Any, args: tuple, kwargs: dict) -> Any:
    i, j = _MATMUL_OPERANDS[target]
    if len(args) <= j or not (isinstance(args[i], DTensor) and isinstance(args[j], DTensor)):
        return None
    operands = [args[i], args[j]]
    for k, (value, other) in enumerate(((args[i], args[j]), (args[j], args[i]))):
        placements = [
            Replicate() if p.is_partial() and private.is_shard_like(other.placements[m]) else p
            for m, p in enumerate(value.placements)
        ]
        if placements != list(value.placements):
            operands[k] = value.redistribute(value.device_mesh, placements)
    if operands[0] is args[i] and operands[1] is args[j]:
        return None
    moved = list(args)
    moved[i], moved[j] = operands
    return target(*moved, **kwargs)


# NOTE: [views of a masked embedding]
# A lookup in a vocabulary-sharded embedding (RowwiseParallel on nn.Embedding) leaves each
# rank's rows as ``_MaskPartial``: a pending sum that first zeroes, by a mask shaped like
# the indices, the rows whose index another rank owns. DTensor's view rules carry that
# placement through a reshape, after which the mask no longer lines up with the rows
# (``_MaskBuffer.apply_mask`` indexes the leading dimensions with it): the reduction
# raised a shape error at run time. A view that changes the shape of such a value reduces
# it first (the all-reduce the module's Replicate output would issue anyway). Capture
# writes one: an embedding looked up by a 0-d index runs as a lookup of one index and a
# reshape to the row (``capture/trace.py: _embedding_of_one_index``).
_SHAPE_CHANGING_VIEWS = frozenset({
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.squeeze.dim,
    aten.squeeze.dims, aten.squeeze.default, aten.unsqueeze.default, aten.select.int,
    aten.permute.default, aten.t.default, aten.transpose.int, aten.slice.Tensor,
    aten.flatten.using_ints,
})


def _mask_partial_reduced_first(target: Any, args: tuple, kwargs: dict) -> Any:
    value = args[0]
    placements = [Replicate() if private.is_mask_partial(p) else p for p in value.placements]
    return target(value.redistribute(value.device_mesh, placements), *args[1:], **kwargs)


# ------------------------------------------------------------------- unbind

def _unbind_gathered(value: DTensor, dim: int) -> Any:
    """``unbind`` (``list(x)``, ``for row in x``) along a sharded dimension: each piece
    lies on one rank, which no placement states, and DTensor's rule refuses to move it
    (Llava's ``list(image_features)`` of a batch of images). So the dimension is gathered
    first (NOTE: [unbind along a sharded dimension])."""
    dim = dim % value.dim()
    sharded = {m for m, p in enumerate(value.placements) if isinstance(p, Shard) and p.dim == dim}
    if not sharded:
        return None
    return aten.unbind.int(_gathered_on(value, sharded), dim)


def _gathered_on(value: DTensor, mesh_dims: set[int]) -> DTensor:
    """``value`` replicated on ``mesh_dims``, its other placements kept."""
    placements = [Replicate() if m in mesh_dims else p for m, p in enumerate(value.placements)]
    return value.redistribute(value.device_mesh, placements)


# ------------------------------------------------------------------- fused projections


def _strided_dims(value: Any) -> list[tuple[int, Any]]:
    if not isinstance(value, DTensor):
        return []
    return [(m, p) for m, p in enumerate(value.placements) if private.is_strided_shard(p)]


def _only_strided_on(value: DTensor, dim: int) -> tuple[int, int] | None:
    """(mesh dim, split factor) when ``value`` is _StridedShard on ``dim`` on exactly one
    mesh dimension and Replicate on every other."""
    strided = _strided_dims(value)
    if len(strided) != 1:
        return None
    mesh_dim, placement = strided[0]
    if placement.dim != dim % value.dim():
        return None
    others = [p for m, p in enumerate(value.placements) if m != mesh_dim]
    if not all(isinstance(p, Replicate) for p in others):
        return None
    return mesh_dim, placement.split_factor


def _split_strided(target: Any, args: tuple, kwargs: dict) -> list[DTensor] | None:
    value = args[0]
    if not isinstance(value, DTensor):
        return None
    dim = (args[2] if len(args) > 2 else kwargs.get("dim", 0)) % max(value.dim(), 1)
    found = _only_strided_on(value, dim)
    if found is None:
        return None
    mesh_dim, factor = found
    block = value.shape[dim] // factor
    if target is aten.split.Tensor:
        sizes = [args[1]] * -(-value.shape[dim] // args[1])
    else:
        sizes = list(args[1])
    if value.shape[dim] % factor or sizes != [block] * factor:
        return None
    mesh = value.device_mesh
    pieces = private.local_tensor_of(value).chunk(factor, dim)
    placements = list(value.placements)
    placements[mesh_dim] = Shard(dim)
    shape = list(value.shape)
    shape[dim] = block
    return [
        DTensor.from_local(
            piece, mesh, placements, run_check=False,
            shape=torch.Size(shape), stride=contiguous_stride(shape),
        )
        for piece in pieces
    ]


def _slice_strided(args: tuple) -> DTensor | None:
    value = args[0]
    if not isinstance(value, DTensor):
        return None
    dim = (args[1] if len(args) > 1 else 0) % max(value.dim(), 1)
    start = args[2] if len(args) > 2 else None
    end = args[3] if len(args) > 3 else None
    step = args[4] if len(args) > 4 else 1
    found = _only_strided_on(value, dim)
    if found is None or step != 1 or start is None or end is None:
        return None
    mesh_dim, factor = found
    size = value.shape[dim]
    block = size // factor
    end = min(end, size)
    if size % factor or start % block or end - start != block:
        return None
    piece = private.local_tensor_of(value).chunk(factor, dim)[start // block]
    placements = list(value.placements)
    placements[mesh_dim] = Shard(dim)
    shape = list(value.shape)
    shape[dim] = block
    return DTensor.from_local(
        piece, value.device_mesh, placements, run_check=False,
        shape=torch.Size(shape), stride=contiguous_stride(shape),
    )


def _cat_to_strided(args: tuple, kwargs: dict) -> DTensor | None:
    tensors = list(args[0])
    if len(tensors) < 2 or not all(isinstance(t, DTensor) for t in tensors):
        return None
    first = tensors[0]
    dim = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % max(first.dim(), 1)
    shards = [m for m, p in enumerate(first.placements) if type(p) is Shard and p.dim == dim]
    if len(shards) != 1:
        return None
    mesh_dim = shards[0]
    same = all(
        t.shape == first.shape and tuple(t.placements) == tuple(first.placements)
        and t.dtype == first.dtype
        for t in tensors
    )
    others = [p for m, p in enumerate(first.placements) if m != mesh_dim]
    if not same or not all(isinstance(p, Replicate) for p in others):
        return None
    if first.shape[dim] % first.device_mesh.size(mesh_dim):
        return None
    local = torch.cat([private.local_tensor_of(t) for t in tensors], dim)
    placements = list(first.placements)
    placements[mesh_dim] = private.strided_shard(dim, len(tensors))
    shape = list(first.shape)
    shape[dim] *= len(tensors)
    return DTensor.from_local(
        local, first.device_mesh, placements, run_check=False,
        shape=torch.Size(shape), stride=contiguous_stride(shape),
    )


# ------------------------------------------------------------------- batch concatenation


def _cat_along_the_batch(
    args: tuple, kwargs: dict, batch_sizes: Mapping[int, frozenset[int]], strided: bool
) -> DTensor | None:
    """``cat`` along a dimension some input holds sharded as a batch: a global batch
    size of the mesh dimension it is sharded on (NOTE: [batch concatenation])."""
    tensors = [t for t in args[0] if isinstance(t, DTensor)]
    if not tensors:
        return None
    dim = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % max(tensors[0].dim(), 1)
    sharded = {
        m for t in tensors for m, p in enumerate(t.placements)
        if type(p) is Shard and p.dim == dim and t.shape[dim] in batch_sizes.get(m, ())
    }
    if not sharded:
        return None
    if strided:
        kept = _cat_to_strided(args, kwargs)
        if kept is not None:
            return kept
    gathered = [_gathered_on(t, sharded) if isinstance(t, DTensor) else t for t in args[0]]
    return aten.cat.default(gathered, dim)
