"""Our DTensor rules for the functional ``fill.Scalar`` / ``fill.Tensor`` (gap on every
supported torch; ``_torch_private._install_fill_strategies``): the result is the filled
tensor whatever the placements of ``self`` and of a 0-d value, Partial included."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import spmd_compiler as sc
from spmd_compiler import _torch_private as private

aten = torch.ops.aten
SELF_PLACEMENTS = [Shard(0), Shard(1), Replicate(), Partial()]


def _partial(t: torch.Tensor, mesh) -> DTensor:
    """A Partial(sum) DTensor whose parts sum to ``t``: the sum over a sharded extra dim."""
    parts = torch.stack([t / 4, 3 * t / 4])
    out = distribute_tensor(parts, mesh, [Shard(0)]).sum(0)
    assert out.placements[0].is_partial()
    return out


@pytest.fixture
def mesh():
    private.install_dtensor_gap_fills()
    with sc.simulate(2) as sim, sim.ranks():
        yield init_device_mesh("cpu", (2,))


def _self(mesh, placement) -> DTensor:
    x = torch.arange(24.0).reshape(4, 6)
    if placement.is_partial():
        return _partial(x, mesh)
    return distribute_tensor(x, mesh, [placement])


@pytest.mark.parametrize("placement", SELF_PLACEMENTS, ids=str)
def test_fill_scalar(mesh, placement):
    out = aten.fill.Scalar(_self(mesh, placement), 2.5)
    assert torch.equal(out.full_tensor(), torch.full((4, 6), 2.5))
    assert not out.placements[0].is_partial()


@pytest.mark.parametrize("value_partial", [False, True], ids=["value_replicate", "value_partial"])
@pytest.mark.parametrize("placement", SELF_PLACEMENTS, ids=str)
def test_fill_tensor(mesh, placement, value_partial):
    if value_partial:  # the sum of a sharded vector: a 0-d Partial(sum), parts -1 and -2
        value = distribute_tensor(torch.tensor([-1.0, -2.0]), mesh, [Shard(0)]).sum()
        assert value.placements[0].is_partial()
    else:
        value = distribute_tensor(torch.tensor(-3.0), mesh, [Replicate()])
    out = aten.fill.Tensor(_self(mesh, placement), value)
    assert torch.equal(out.full_tensor(), torch.full((4, 6), -3.0))


def test_fill_of_a_slice_in_a_compiled_step():
    """transformers' T5 shifts its labels right with ``ids[..., 0] = start``: a fill."""

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(8, 4)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            shifted = ids.new_zeros(ids.shape)
            shifted[..., 1:] = ids[..., :-1].clone()
            shifted[..., 0] = torch.tensor(3)
            return self.emb(shifted).sum()

    def step(model, optim, ids):
        loss = model(ids)
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    torch.manual_seed(0)
    model, reference = Net().double(), Net().double()
    reference.load_state_dict(model.state_dict())
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
    ids = torch.randint(0, 8, (4, 5), generator=torch.Generator().manual_seed(0))
    compiled = sc.compile(sc.parallel_modes.DataParallel("replicate"))(step)
    with sc.simulate(2) as sim:
        for _ in range(2):
            assert compiled(model, optim, ids).item() == pytest.approx(step(reference, ref_optim, ids).item(), rel=1e-12)
        got = sim.reconcile(model.emb.weight.to_local())
    assert torch.allclose(got, reference.emb.weight, rtol=1e-12, atol=0)


@pytest.mark.parametrize(
    "self_placement,src_placement",
    [(Shard(0), Shard(0)), (Shard(1), Replicate()), (Replicate(), Replicate()), (Partial(), Partial())],
    ids=str,
)
def test_select_scatter(mesh, self_placement, src_placement):
    """Ours on torch 2.11 (which has no rule), DTensor's own after: the same numbers."""
    x, src = torch.arange(24.0).reshape(4, 6), -torch.arange(4.0)
    expected = torch.select_scatter(x, src, 1, 2)

    def placed(t: torch.Tensor, placement):
        return _partial(t, mesh) if placement.is_partial() else distribute_tensor(t, mesh, [placement])

    out = aten.select_scatter.default(placed(x, self_placement), placed(src, src_placement), 1, 2)
    assert torch.equal(out.full_tensor(), expected)


@pytest.mark.parametrize("numerator_partial", [False, True], ids=["numerator_replicate", "numerator_partial"])
@pytest.mark.parametrize("shapes", [((), (1, 1)), ((6,), (4, 6))], ids=["0d_by_1x1", "row_by_matrix"])
def test_division_by_a_broadcast_partial_sum(mesh, shapes, numerator_partial):
    """torch 2.11 follows the argument with more dimensions, here the ``Partial``
    denominator, and then divides by each rank's part of it and sums the quotients
    (``a / b1 + a / b2``: 13.33 for 5 / 2); the fill keeps only numerator partials
    (``_install_div_numerator_partials_only``; 2.13 has no such gap)."""
    numerator_shape, denominator_shape = shapes
    x = torch.full(numerator_shape, 5.0)
    numerator = _partial(x, mesh) if numerator_partial else distribute_tensor(x, mesh, [Replicate()])
    denominator = _partial(torch.full(denominator_shape, 2.0), mesh)
    out = aten.div.Tensor(numerator, denominator)
    assert torch.allclose(out.full_tensor(), torch.full(denominator_shape, 2.5).expand(torch.broadcast_shapes(numerator_shape, denominator_shape)))
