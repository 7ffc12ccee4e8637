"""``Partial("avg")`` to ``Partial("sum")`` and back inside the expander's redistribution
(``_torch_private._between_sum_and_avg_partials``): torch's own redistribution refuses
the change, and torch 2.11's pointwise rule asks for it when a loss adds a mean over the
batch to a sum (``F.cross_entropy(out, y) + 0.01 * out.pow(2).mean()``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.tensor._redistribute as redistribute_module
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec

import spmd_compiler as sc
from spmd_compiler import _torch_private as private


@pytest.fixture
def mesh():
    with sc.simulate(2) as sim, sim.ranks():
        yield init_device_mesh("cpu", (2,))


@pytest.mark.parametrize("source,target", [("avg", "sum"), ("sum", "avg")])
def test_partial_kind_changes_keep_the_value(mesh, source, target):
    x = torch.arange(12.0, dtype=torch.float64).reshape(4, 3)
    sharded = distribute_tensor(x, mesh, [Shard(0)])
    value = sharded.mean(0) if source == "avg" else sharded.sum(0)
    assert value.placements == (Partial(source),)
    spec = DTensorSpec(mesh, (Partial(target),), tensor_meta=value._spec.tensor_meta)
    with private.memoized_redistribution():  # as the dispatcher calls it while expanding
        local = redistribute_module.redistribute_local_tensor(value.to_local(), value._spec, spec)
    moved = DTensor.from_local(local, mesh, [Partial(target)])
    expected = x.mean(0) if source == "avg" else x.sum(0)
    assert torch.equal(moved.full_tensor(), expected)


def test_partial_maxima_beside_sums_are_reduced_first(mesh):
    """torch 2.11's pointwise rule plans ``P(max) -> P(sum)`` for ``x.amax() + x.sum()``,
    which its redistribute refuses: the maximum is reduced to ``Replicate`` first
    (``_reduce_mixed_partials``; installed on 2.11 only, checked here on any torch)."""
    x = torch.arange(12.0, dtype=torch.float64).reshape(4, 3)
    sharded = distribute_tensor(x, mesh, [Shard(0)])
    total, top = sharded.sum(), sharded.amax()
    assert (total.placements, top.placements) == ((Partial("sum"),), (Partial("max"),))
    (kept, reduced), _ = private._reduce_mixed_partials((total, top), {})
    assert kept is total and reduced.placements[0].is_replicate()
    assert torch.equal(reduced.full_tensor(), x.amax())
    (alone,), _ = private._reduce_mixed_partials((top,), {})
    assert alone is top  # nothing to mix with
