"""The torch-version gap fills of ``_torch_private`` (NOTE: [DTensor gap fills]) give
single-device numbers on every supported torch: on a torch that has the rule natively the
same assertions check torch's own rule."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

import spmd_compiler as sc
from spmd_compiler import _torch_private as private

PLACEMENTS_2D = [(Shard(0), Shard(1)), (Replicate(), Shard(1)), (Shard(1), Replicate())]


@pytest.fixture
def mesh_2x2():
    private.install_dtensor_gap_fills()
    with sc.simulate(4) as sim, sim.ranks():
        yield init_device_mesh("cpu", (2, 2))


@pytest.mark.parametrize("placements", PLACEMENTS_2D, ids=str)
@pytest.mark.parametrize("shape", [(24, 3, 5), (360,)], ids=str)
def test_view_flattening_a_sharded_dim_and_back(mesh_2x2, placements, shape):
    """Attention heads: ``[b, h, t, d] -> [b*h, t, d]`` with ``h`` sharded, and back."""
    x = torch.randn(4, 6, 3, 5)
    with private.memoized_redistribution():
        flat = distribute_tensor(x, mesh_2x2, placements).view(*shape)
        assert torch.equal(flat.full_tensor(), x.view(*shape))
        back = flat.view(4, 6, 3, 5)
        assert tuple(back.placements) == placements
        assert torch.equal(back.full_tensor(), x)


# (length, batch, width) with the batch sharded by both mesh dims, flattened to
# (length*batch, width): _StridedShard(0, sf=6) on dp and on tp (sequence-first attention
# under FSDP x TP, NOTE: [nested strided unflatten]); the views split it back.
UNFLATTENS = [(6, 8, 16), (6, 8, 4, 4), (6, 2, 4, 16), (3, 2, 8, 16), (12, 4, 16), (3, 16, 16)]


@pytest.mark.parametrize("shape", UNFLATTENS, ids=str)
def test_view_unflattening_a_dim_strided_on_both_mesh_dims(mesh_2x2, shape):
    """Each view either gives the single-device values or raises; never a wrong layout.
    (6, 8, 4, 4) and (6, 8, 16) raised in torch 2.13 ("Cannot unflatten tensor with
    _StridedShard placement") before the fill and now resolve to Shard(1) on both."""
    fills = private.view_fills()
    if "nested_unflatten" not in fills or "strided_view" in fills:
        # 2.11's flatten fill refuses the (dim 1 on both mesh dims) flatten that makes these
        pytest.skip("torch 2.11 / 2.12: their own view fills answer these views (README)")
    x = torch.randn(6, 8, 16, dtype=torch.float64)
    with private.memoized_redistribution():
        flat = distribute_tensor(x, mesh_2x2, (Shard(1), Shard(1))).view(48, 16)
        assert all(private.is_strided_shard(p) for p in flat.placements), flat.placements
        try:
            back = flat.view(*shape)
        except RuntimeError as exc:
            assert shape not in [(6, 8, 16), (6, 8, 4, 4)], exc
            assert "_StridedShard" in str(exc) or "redistribute" in str(exc), exc
            return
        assert torch.equal(back.full_tensor(), x.view(*shape))
        if shape[:2] == (6, 8):
            assert tuple(back.placements) == (Shard(1), Shard(1))
            assert back.to_local().shape == (6, 2, *shape[2:])


# (shape, placements, view): a flatten-then-split whose non-first flattened dim is sharded
# (NOTE: [head-local regroup]): q.view(L, B*H, hd) of nn.MultiheadAttention with heads on
# tp, the way back from (L, B*H, hd), and other regroupings. Each either keeps the shard
# (what torch 2.13 gathered) or is left to torch; the numbers are checked either way.
REGROUPS = [
    ((6, 8, 16), (Replicate(), Shard(2)), (6, 32, 4)),
    ((6, 8, 16), (Replicate(), Shard(2)), (6, 16, 8)),
    ((6, 8, 16), (Replicate(), Shard(2)), (6, 2, 64)),
    ((6, 8, 16), (Replicate(), Shard(2)), (3, 256)),
    ((6, 8, 16), (Shard(2), Replicate()), (6, 4, 32)),
    ((6, 8, 16), (Shard(1), Shard(2)), (6, 32, 4)),  # FSDP x TP: batch on dp, heads on tp
    ((6, 8, 16), (Shard(1), Shard(2)), (6, 4, 32)),
    ((6, 8, 16), (Shard(1), Shard(2)), (3, 256)),
    ((6, 8, 16), (Shard(2), Shard(1)), (6, 32, 4)),
    ((4, 6, 4), (Shard(0), Shard(2)), (2, 2, 3, 8)),
    ((6, 8, 16), (Replicate(), Shard(1)), (24, 32)),
    ((4, 6, 4), (Replicate(), Shard(1)), (8, 12)),
    ((4, 6, 4), (Replicate(), Shard(1)), (2, 2, 3, 8)),
    ((2, 4, 3), (Replicate(), Shard(2)), (6, 4)),
    ((6, 32, 4), (Replicate(), "S(1, 8)"), (48, 16)),
    ((6, 32, 4), (Replicate(), "S(1, 8)"), (12, 64)),
    ((6, 32, 4), (Replicate(), "S(1, 2)"), (12, 64)),
]


@pytest.mark.parametrize("shape,placements,view", REGROUPS, ids=str)
def test_view_regrouping_a_sharded_non_first_dim(mesh_2x2, shape, placements, view):
    """Single-device values or an error, never a wrong layout; the heads split of
    (6, 8, 16) -> (6, 32, 4) with E sharded stays sharded (_StridedShard(1, sf=8))."""
    if "regroup" not in private.view_fills():
        pytest.skip("torch 2.11 / 2.12: their own view fills answer these views (README)")
    placements = tuple(
        private.strided_shard(1, int(p[5])) if isinstance(p, str) else p for p in placements
    )
    x = torch.randn(*shape, dtype=torch.float64)
    with private.memoized_redistribution():
        source = distribute_tensor(x, mesh_2x2, placements)
        assert torch.equal(source.full_tensor(), x)
        try:
            out = source.view(*view)
        except RuntimeError as exc:
            assert "unevenly" in str(exc), exc
            return
        assert torch.equal(out.full_tensor(), x.view(*view))
        assert torch.equal(out.view(*shape).full_tensor(), x)  # and back
    if (shape, view) == ((6, 8, 16), (6, 32, 4)) and placements[0] == Replicate():
        assert out.placements == (Replicate(), private.strided_shard(1, 8))
        assert out.to_local().shape == (6, 16, 4)
    if (shape, view) == ((6, 8, 16), (6, 32, 4)) and placements[0] == Shard(1):
        assert out.placements == (Shard(1), private.strided_shard(1, 4))
        assert out.to_local().shape == (6, 8, 4)


def test_a_view_the_rule_raises_on_gathers_the_strided_mesh_dim(mesh_2x2):
    """NOTE: [view rule that raises]: ``[48, 16] -> [6, 32, 4]`` with ``(_S(0, 6), S(1))``
    (the batch of (6, 8, 16) on dp flattened away, the heads on tp) raised KeyError in
    torch 2.13 / 2.14's view rule; torch 2.14 reaches it in the backward of
    nn.MultiheadAttention under FSDP x TP. dp is gathered, tp keeps its heads."""
    if "gather_fallback" not in private.view_fills():
        pytest.skip("this torch's view rule answers the case itself (or refuses it: 2.11)")
    x = torch.randn(6, 8, 16, dtype=torch.float64)
    with private.memoized_redistribution():
        flat = distribute_tensor(x, mesh_2x2, (Shard(1), Shard(2))).view(48, 16)
        assert flat.placements == (private.strided_shard(0, 6), Shard(1))
        out = flat.view(6, 32, 4)
        assert torch.equal(out.full_tensor(), x.view(6, 32, 4))
        assert out.placements == (Replicate(), private.strided_shard(1, 8))
        assert torch.equal(out.view(48, 16).full_tensor(), x.view(48, 16))


def test_an_op_on_two_readings_of_a_strided_shard_matches_one_device(mesh_2x2):
    """NOTE: [conflicting strided readings]: an activation made by a view (a plain strided
    split) times a weight made from placements (a shard order): torch 2.12 raised
    "Conflicting use_strided_shard_as_shard_order"; every torch gives the numbers."""
    if "strided_view" in private.view_fills():
        pytest.skip("torch 2.11: matmul rules do not read a _StridedShard (settle_strided_shards)")
    x = torch.randn(6, 8, 16, dtype=torch.float64)
    w = torch.randn(16, 48, dtype=torch.float64)
    with private.memoized_redistribution():
        flat = distribute_tensor(x, mesh_2x2, (Shard(1), Replicate())).view(48, 16)
        assert private.is_strided_shard(flat.placements[0])
        weight = distribute_tensor(w, mesh_2x2, (Replicate(), private.strided_shard(1, 3)))
        out = torch.mm(flat, weight)
        assert torch.allclose(out.full_tensor(), x.view(48, 16) @ w, rtol=1e-12, atol=1e-12)


def test_strided_shard_is_gathered_before_an_op_that_does_not_know_it(mesh_2x2):
    """``[5, b, 8] -> [5*b, 8]`` with ``b`` sharded, then ``t`` and ``mm`` (the weight
    gradient of a Linear on a 3-D input whose batch is dim 1)."""
    x = torch.randn(5, 4, 8)
    with private.memoized_redistribution():
        flat = distribute_tensor(x, mesh_2x2, (Replicate(), Shard(1))).view(20, 8)
        (flat_t,), _ = private.settle_strided_shards(torch.ops.aten.t.default, (flat,), {})
        got = torch.mm(flat_t.t(), flat_t)
        assert torch.allclose(got.full_tensor(), x.view(20, 8).t() @ x.view(20, 8))


OPS = {
    "flip": lambda t: torch.flip(t, [0, 2]),
    "roll": lambda t: torch.roll(t, 1, 0),
    "roll_flat": lambda t: torch.roll(t, 3),
    "cummax_values": lambda t: torch.cummax(t, 1).values,
    "cummax_indices": lambda t: torch.cummax(t, 0).indices,
    "var": lambda t: torch.var_mean(t, dim=1, correction=1)[0],
    "mean_keepdim": lambda t: torch.var_mean(t, dim=[0, 2], keepdim=True)[1],
    "var_all": lambda t: torch.var_mean(t)[0],
    "squeeze_dims": lambda t: torch.squeeze(t.sum(dim=1, keepdim=True), (0, 1)) * 2,
}


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("placements", [(Shard(0), Shard(1)), (Shard(2), Replicate())], ids=str)
def test_dim_ops_sharded_along_and_across_their_dims(mesh_2x2, op, placements):
    x = torch.randn(4, 6, 8)
    got = OPS[op](distribute_tensor(x, mesh_2x2, placements))
    assert torch.allclose(got.full_tensor(), OPS[op](x))


def test_run_time_coordinate_is_per_simulated_rank():
    """compile_on_one_rank programs read the mesh coordinate at run time; simulated ranks
    must each get their own (torch 2.11's LocalTensorMode gave all of them rank 0's)."""
    import torch.distributed._ops.device_mesh  # noqa: F401  (defines the op)

    with sc.simulate(4):
        mode = private.local_tensor_mode(4)
        mesh_tensor = torch.arange(4, dtype=torch.int).view(1, 2, 2)
        with mode:
            rows = torch.ops.device_mesh._runtime_compute_coordinate_on_dim.default(mesh_tensor, 0)
            cols = torch.ops.device_mesh._runtime_compute_coordinate_on_dim.default(mesh_tensor, 1)
            per_rank = private.make_local_tensor({r: torch.zeros(()) for r in range(4)})
            coords = per_rank + rows * 10 + cols
        assert {r: int(v) for r, v in private.per_rank_tensors(coords).items()} == {
            0: 0, 1: 1, 2: 10, 3: 11,
        }


def test_compile_on_one_rank_is_set_where_torch_reads_it_without_a_deprecation_warning():
    """torch 2.14 moved the flag to ``torch.compiler.config`` (the ``torch.distributed``
    name warns there); 2.11 to 2.13 have only ``torch.distributed.config``'s."""
    import warnings

    import torch.compiler.config as compiler_config
    import torch.distributed.config as distributed_config

    owner = private.compile_on_one_rank_config()
    new_home = hasattr(compiler_config, "compile_on_one_rank")
    assert owner is (compiler_config if new_home else distributed_config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert owner.compile_on_one_rank is False
        with private.compile_on_one_rank():
            assert owner.compile_on_one_rank is True
        assert owner.compile_on_one_rank is False


def test_sharding_through_a_decomposition_under_the_propagation_budget(mesh_2x2):
    """DTensor shards hardswish (no rule of its own) through its decomposition while
    ``bounded_decomposition_propagation`` watches the clock; DecompShardingStrategy's
    method signatures differ in 2.11, 2.12-2.13 and 2.14 (a wrapper that took one of them
    made every decomposed op fail as "no sharding strategy" on the others)."""
    x = torch.randn(4, 6)
    with private.bounded_decomposition_propagation(600.0):
        got = torch.nn.functional.hardswish(distribute_tensor(x, mesh_2x2, (Shard(0), Shard(1))))
    assert torch.allclose(got.full_tensor(), torch.nn.functional.hardswish(x))
    with private.bounded_decomposition_propagation(0.0), pytest.raises(Exception) as info:
        torch.nn.functional.hardswish(distribute_tensor(x, mesh_2x2, (Shard(1), Shard(0))))
    exceeded = private.budget_exceeded_in(info.value)
    assert exceeded is not None and exceeded.op is torch.ops.aten.hardswish.default


def _price_specs(mesh, placements, shapes_dtypes):
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    def spec(shape, dtype, places):
        stride = torch.empty(shape).stride()
        return DTensorSpec(mesh, places, tensor_meta=TensorMeta(torch.Size(shape), stride, dtype))

    return [(spec(s, d, placements[0]), spec(s, d, placements[1])) for s, d in shapes_dtypes]


@pytest.mark.parametrize("min_cost_planner", [False, True], ids=["greedy", "graph"])
def test_prices_of_the_same_placements_share_one_greedy_plan(mesh_2x2, min_cost_planner):
    """NOTE: [compile work bounds]: torch 2.14 prices every placement combination of a
    single-mesh-dim strategy, mostly the same placements on tensors of other shapes. The
    cost memo plans those once where the greedy planner planned (its steps come from the
    placements alone); each pair is still priced with its own bytes, as DTensor does.
    The graph planner weighs steps by bytes: its plans are not shared."""
    import torch.distributed.tensor._collective_utils as collective_utils
    import torch.distributed.tensor._ops.utils as op_utils
    import torch.distributed.tensor._redistribute as redistribute_module

    pairs = _price_specs(
        mesh_2x2,
        ((Shard(0), Shard(1)), (Replicate(), Shard(0))),
        [((8, 4), torch.float32), ((16, 8), torch.float32), ((4, 12), torch.float64)],
    )
    with redistribute_module.use_min_cost_redistribution_plan(min_cost_planner):
        redistribute_module._gen_transform_infos.cache_clear()
        expected = [collective_utils.redistribute_cost(a, b) for a, b in pairs]
        redistribute_module._gen_transform_infos.cache_clear()
        with private.count_redistribution_planning() as counts, private.memoized_redistribute_cost():
            got = [op_utils.redistribute_cost(a, b) for a, b in pairs]
    assert got == expected and len(set(expected)) == 3  # priced by each pair's bytes
    assert counts["plans"] == (3 if min_cost_planner else 1)


@pytest.mark.parametrize("source", [Replicate(), Shard(0)], ids=str)
def test_redistribution_to_a_strided_shard(source):
    """A fused qkv weight's ``_StridedShard(0, sf=3)`` on a 1-D mesh: rank r holds piece r
    of each of the 3 blocks (torch 2.11's planner cannot read it as a shard order)."""
    private.install_dtensor_gap_fills()
    x = torch.arange(24.0).view(12, 2)
    target = private.strided_shard(0, 3)
    with sc.simulate(2) as sim:
        with sim.ranks(), private.memoized_redistribution():
            mesh = init_device_mesh("cpu", (2,))
            got = distribute_tensor(x, mesh, (source,)).redistribute(mesh, (target,))
            back = got.redistribute(mesh, (Replicate(),))
        for rank, local in sim.per_rank(got).items():
            assert torch.equal(local, x.unflatten(0, (3, 2, 2))[:, rank].flatten(0, 1))
        assert all(torch.equal(t, x) for t in sim.per_rank(back).values())


@pytest.mark.parametrize("shape", [(6, 32, 4), (6, 128), (3, 16, 16)], ids=str)
def test_view_flattening_a_sharded_dim_into_a_split(shape):
    """``nn.MultiheadAttention``'s backward: ``[48, 16] -> [6, 32, 4]`` with the 16
    sharded (torch 2.11's rule raised "Attempted to flatten multiple dimensions")."""
    private.install_dtensor_gap_fills()
    x = torch.randn(48, 16)
    with sc.simulate(2) as sim, sim.ranks(), private.memoized_redistribution():
        mesh = init_device_mesh("cpu", (2,))
        got = distribute_tensor(x, mesh, (Shard(1),)).view(*shape)
        assert torch.equal(got.full_tensor(), x.view(*shape))
        back = got.view(48, 16)
        assert torch.equal(back.full_tensor(), x)
