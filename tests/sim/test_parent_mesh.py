"""Parent-mesh sharding (FSDP on top of TP): exact round trips and refused layouts."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard

import spmd_compiler as sc
from spmd_compiler import _torch_private as private
from spmd_compiler.expand.parent_mesh import shard_onto_parent

SHAPES = [(8, 6), (7, 5), (3, 3), (2, 9), (1, 4)]


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{a}x{b}" for a, b in SHAPES])
@pytest.mark.parametrize("tp", [Shard(0), Shard(1), Replicate()], ids=["S0", "S1", "R"])
def test_tp_then_fsdp_round_trips_exactly_2d(shape, tp):
    x = torch.randn(shape)
    with sc.simulate(4) as sim:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        tp_tensor = sim.shard(x, mesh["tp"], [tp])
        with sim.ranks():
            parent = shard_onto_parent(tp_tensor, mesh["dp"], (Shard(0),))
        assert parent.device_mesh is mesh
        assert parent.shape == x.shape
        if tp == Shard(0):  # both shard rows: TP inner, FSDP outer
            assert private.is_strided_shard(parent.placements[0])
            assert parent.placements[1] == Shard(0)
        else:
            assert parent.placements == (Shard(0), tp)
        assert torch.equal(sim.full_tensor(parent), x)
        # rank (d, t) holds FSDP piece d of TP shard t (TP inner, FSDP outer)
        for rank, local in sim.per_rank(parent).items():
            d, t = divmod(rank, 2)
            tp_shard = x if tp == Replicate() else _piece(x, tp.dim, t)
            assert torch.equal(local, _piece(tp_shard, 0, d))


def _piece(t: torch.Tensor, dim: int, index: int) -> torch.Tensor:
    """torch.chunk(t, 2, dim)[index], empty when torch.chunk makes fewer pieces."""
    pieces = list(torch.chunk(t, 2, dim=dim))
    return pieces[index] if index < len(pieces) else t.narrow(dim, 0, 0)


def test_three_d_mesh_two_outer_dims():
    x = torch.randn(16, 4)
    with sc.simulate(8) as sim:
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
        tp_tensor = sim.shard(x, mesh["tp"], [Shard(0)])
        with sim.ranks():
            parent = shard_onto_parent(tp_tensor, mesh["pp", "dp"], (Shard(0), Shard(0)))
        assert torch.equal(sim.full_tensor(parent), x)
        with sim.ranks():
            parent = shard_onto_parent(tp_tensor, mesh["pp", "dp"], (Replicate(), Shard(1)))
        assert torch.equal(sim.full_tensor(parent), x)


def test_invalid_layouts_are_refused():
    x = torch.randn(8, 8)
    with sc.simulate(4) as sim:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        # sharded first on the LEFT dimension, then the right one on top: refused
        dp_tensor = sim.shard(x, mesh["dp"], [Shard(0)])
        with sim.ranks(), pytest.raises(ValueError, match="right-most"):
            shard_onto_parent(dp_tensor, mesh["tp"], (Shard(0),))
        tp_tensor = sim.shard(x, mesh["tp"], [Shard(0)])
        with sim.ranks(), pytest.raises(ValueError, match="overlap"):
            shard_onto_parent(tp_tensor, mesh["tp"], (Shard(0),))
        with sim.ranks(), pytest.raises(ValueError, match="Shard/Replicate"):
            shard_onto_parent(tp_tensor, mesh["dp"], (Partial(),))
        with sim.ranks(), pytest.raises(ValueError, match="Shard/Replicate"):
            shard_onto_parent(tp_tensor, mesh["dp"], (Shard(0), Shard(1)))
        other = init_device_mesh("cpu", (4,))
        one_d = sim.shard(x, other, [Shard(0)])
        with sim.ranks(), pytest.raises(ValueError, match="one parent"):
            shard_onto_parent(one_d, mesh["dp"], (Shard(0),))
        with sim.ranks():
            partial = tp_tensor.redistribute(mesh["tp"], [Replicate()])
            partial = type(partial).from_local(
                private.local_tensor_of(partial), mesh["tp"], [Partial()], run_check=False
            )
        with sim.ranks(), pytest.raises(ValueError, match="Partial"):
            shard_onto_parent(partial, mesh["dp"], (Shard(0),))
