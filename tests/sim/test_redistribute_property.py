"""N-D redistribution, property-based: random shapes and placement lists on 1-D to 3-D
meshes, nested sharding of one tensor dimension and uneven shards included; the full
value after redistribution is exact, eagerly and in traced per-rank programs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import spmd_compiler as sc
from spmd_compiler import _torch_private as private
from spmd_compiler.expand.redistribute import redistribute, traced_redistribution

MESHES = [(4,), (2, 2), (2, 2, 2)]


@st.composite
def cases(draw, mesh_shape):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=ndim, max_size=ndim)))
    placement = st.one_of(st.just(Replicate()), st.integers(0, ndim - 1).map(Shard))
    source = tuple(draw(st.lists(placement, min_size=len(mesh_shape), max_size=len(mesh_shape))))
    target = tuple(draw(st.lists(placement, min_size=len(mesh_shape), max_size=len(mesh_shape))))
    return shape, source, target


def _even(shape, placements, mesh_shape) -> bool:
    for dim, size in enumerate(shape):
        ways = math.prod(n for n, p in zip(mesh_shape, placements) if p == Shard(dim))
        if size % ways:
            return False
    return True


def _local_shape(shape, placements, mesh_shape):
    local = list(shape)
    for n, p in zip(mesh_shape, placements):
        if isinstance(p, Shard):
            local[p.dim] //= n
    return local


PROFILE = settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_eager_redistribution_is_exact(mesh_shape):
    @PROFILE
    @given(case=cases(mesh_shape))
    def check(case):
        shape, source, target = case
        x = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
        with sc.simulate(math.prod(mesh_shape)) as sim:
            mesh = init_device_mesh("cpu", mesh_shape)
            dt = sim.shard(x, mesh, source)
            with sim.ranks():
                out = redistribute(dt, target)
            assert tuple(out.placements) == target
            _assert_same_shares(sim, out, sim.shard(x, mesh, target))

    check()


def _assert_same_shares(sim: sc.Simulation, out: DTensor, expected: DTensor) -> None:
    """Every rank holds the share torch's distribute_tensor gives it (compared rank by
    rank: torch 2.13's full_tensor fails on some uneven nested layouts, e.g. a (1, 5)
    tensor placed (Shard(0), Shard(1), Shard(1)) on 2x2x2, "narrow unexpectedly changed
    concrete size", even for its own redistribute's result)."""
    got, want = (private.per_rank_tensors(sim.per_rank_tensor(private.local_tensor_of(t)))
                 for t in (out, expected))
    assert got.keys() == want.keys()
    for rank, value in want.items():
        assert got[rank].shape == value.shape and torch.equal(got[rank], value), f"rank {rank}"


@pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_traced_redistribution_is_exact(mesh_shape):
    """The code path of compiled programs: one traced program, run on every rank."""

    @PROFILE
    @given(case=cases(mesh_shape))
    def check(case):
        shape, source, target = case
        assume(_even(shape, source, mesh_shape) and _even(shape, target, mesh_shape))
        x = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
        with sc.simulate(math.prod(mesh_shape)) as sim:
            mesh = init_device_mesh("cpu", mesh_shape)
            program = traced_redistribution(
                mesh, shape, x.dtype, source, target, _local_shape(shape, source, mesh_shape)
            )
            local = sim.per_rank_tensor(private.local_tensor_of(sim.shard(x, mesh, source)))
            with sim.ranks():
                out_local = program(local)
                out = DTensor.from_local(
                    out_local, mesh, target, run_check=False, shape=torch.Size(shape), stride=x.stride()
                )
            assert torch.equal(sim.full_tensor(out), x)

    check()
