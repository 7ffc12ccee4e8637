"""Shard an existing DTensor again onto its parent mesh (FSDP on top of TP).

NOTE: [parent-mesh sharding]
Tensor parallelism shards first, on the tp sub-mesh; FSDP then shards each TP shard again
on dp. The result is one DTensor on the parent mesh. The caller passes only the outer
(dp) mesh and its placements, e.g. ``(Shard(0),)``; the parent mesh and the parent
placements are derived here, for any N-D mesh whose inner sub-mesh is its right-most
dimensions. When both shard the same tensor dimension the TP split is the inner one and
the FSDP split the outer one, which is "right-to-left" sharding; DTensor expresses it with
``_StridedShard(dim, split_factor=k)`` on the outer dimension, k being the number of
shards the dimensions to its right already made of that tensor dimension (this is how
torch's FSDP2 composes with TP). Any other arrangement (the already-sharded sub-mesh
not right-most, overlapping meshes, a Partial input) is not a valid global layout here
and is refused.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from .. import _torch_private as private


def parent_placements(
    root: DeviceMesh,
    inner: dict[int, Placement],
    outer: dict[int, Placement],
    ndim: int,
) -> tuple[Placement, ...]:
    """Placements on ``root`` for inner (right-most) and outer mesh dimensions.

    Args:
        root: the parent mesh.
        inner / outer: root mesh dimension -> placement of the inner (already applied)
            and outer (applied on top) sharding.
        ndim: the tensor's number of dimensions (normalizes negative Shard dims).
    """
    placements: list[Placement] = [Replicate()] * root.ndim
    for mesh_dim, p in inner.items():
        placements[mesh_dim] = _normalized(p, ndim)
    for mesh_dim in sorted(outer, reverse=True):  # right to left: inner splits first
        p = _normalized(outer[mesh_dim], ndim)
        if isinstance(p, Shard):
            split = 1
            for right in range(mesh_dim + 1, root.ndim):
                q = placements[right]
                if isinstance(q, Shard) and q.dim == p.dim or (
                    private.is_strided_shard(q) and q.dim == p.dim
                ):
                    split *= root.size(right)
            p = private.strided_shard(p.dim, split) if split > 1 else p
        placements[mesh_dim] = p
    return tuple(placements)


def shard_onto_parent(
    tensor: DTensor, outer_mesh: DeviceMesh, outer: Sequence[Placement] = (Shard(0),)
) -> DTensor:
    """``tensor`` (sharded on a sub-mesh) sharded again by ``outer`` on ``outer_mesh``.

    Returns one DTensor on the parent mesh of both, with the same global value.

    Raises:
        ValueError: the meshes do not share a parent, ``tensor``'s mesh is not the
            right-most dimensions of the parent, the meshes overlap or do not cover the
            parent, ``tensor`` is Partial, or ``outer`` holds something besides
            Shard/Replicate.
    """
    inner_mesh = tensor.device_mesh
    root = private.root_mesh(inner_mesh)
    if private.root_mesh(outer_mesh) is not root or root is inner_mesh:
        raise ValueError(
            f"{inner_mesh} and {outer_mesh} are not sub-meshes of one parent mesh; build "
            "both from one init_device_mesh(..., mesh_dim_names=...) (e.g. mesh['dp'], mesh['tp'])."
        )
    names = root.mesh_dim_names or ()
    inner_dims = [names.index(n) for n in inner_mesh.mesh_dim_names or ()]
    outer_dims = [names.index(n) for n in outer_mesh.mesh_dim_names or ()]
    if set(inner_dims) & set(outer_dims):
        raise ValueError(f"{inner_mesh} and {outer_mesh} overlap on the parent mesh {root}.")
    if sorted(inner_dims + outer_dims) != list(range(root.ndim)):
        raise ValueError(f"{inner_mesh} and {outer_mesh} do not cover the parent mesh {root}.")
    if inner_dims != list(range(root.ndim - len(inner_dims), root.ndim)):
        raise ValueError(
            f"the already-sharded mesh {inner_mesh.mesh_dim_names} must be the right-most "
            f"dimensions of the parent mesh {names}: sharding it first and the left "
            "dimensions on top is the only order that keeps a valid global layout."
        )
    if any(p.is_partial() for p in tensor.placements):
        raise ValueError("a Partial DTensor cannot be sharded onto its parent mesh; reduce it first.")
    if len(outer) != len(outer_dims) or not all(isinstance(p, (Shard, Replicate)) for p in outer):
        raise ValueError(f"outer placements {tuple(outer)} must be one Shard/Replicate per dimension of {outer_mesh}.")
    placements = parent_placements(
        root,
        dict(zip(inner_dims, tensor.placements, strict=True)),
        dict(zip(outer_dims, outer, strict=True)),
        tensor.dim(),
    )
    local = private.local_tensor_of(tensor)
    for mesh_dim in sorted(outer_dims, reverse=True):
        p = _normalized(outer[outer_dims.index(mesh_dim)], tensor.dim())
        if isinstance(p, Shard):
            local = private.chunk_at_coordinate(local, root, mesh_dim, p.dim)
    return DTensor.from_local(
        local, root, placements, run_check=False, shape=tensor.shape, stride=tensor.stride()
    )


def _normalized(p: Placement, ndim: int) -> Placement:
    if isinstance(p, Shard) and not private.is_strided_shard(p) and p.dim < 0:
        return Shard(p.dim % ndim)
    return p
