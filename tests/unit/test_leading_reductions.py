"""split_leading_reductions (NOTE: [reductions that ride the input check]): the program cut
at the input check's round computes what the whole program computes."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx

from spmd_compiler import _torch_private as private
from spmd_compiler.ir.collectives import ALL_REDUCE, is_collective
from spmd_compiler.leading_reductions import (
    MAX_PREFIX_NODES,
    MAX_SLOTS,
    NOTHING_SENT,
    split_leading_reductions,
    world_all_reduces,
)

C10D = torch.ops._c10d_functional


@pytest.fixture
def world_of_one(tmp_path):
    """A real one-rank gloo group: the functional collectives run (a sum over one rank is
    the value itself)."""
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    yield dist.group.WORLD.group_name
    dist.destroy_process_group()


def _reduced(x: torch.Tensor, group: str) -> torch.Tensor:
    return C10D.wait_tensor(C10D.all_reduce(x, "sum", group))


def ddp_like(group: str):
    """A ddp step's shape: the target count reduced before the forward, the loss over it,
    the gradient reduced after."""

    def step(w, x, target):
        count = _reduced((target != -100).sum(dtype=torch.float32), group)
        logits = x @ w.t()
        loss = torch.nn.functional.cross_entropy(logits, target, reduction="sum") / count
        grad = _reduced(logits.t() @ x / count, group)
        return loss, w - 0.1 * grad

    return step


def inputs():
    gen = torch.Generator().manual_seed(0)
    return (
        torch.randn(4, 8, generator=gen, dtype=torch.float64),
        torch.randn(6, 8, generator=gen, dtype=torch.float64),
        torch.tensor([0, 1, -100, 3, 2, -100]),
    )


def cut(gm):
    names = world_all_reduces(gm, private.process_group_size, dist.get_world_size())
    return split_leading_reductions(gm, names, batch={1, 2})  # x and target; w is state


def run_cut(split, flat):
    sums = list(split.prefix(*flat))  # one rank: the sum is the value
    early = list(split.early(*flat)) if split.early is not None else []
    return list(split.main(*flat, *sums, *early))


def test_the_target_count_leaves_and_the_forward_runs_early(world_of_one):
    flat = inputs()
    gm = make_fx(ddp_like(world_of_one))(*flat)
    split = cut(gm)
    assert split is not None
    assert split.metas == ((torch.float32, ()),)
    assert split.signature != NOTHING_SENT
    # the count's all-reduce left the program; the gradient's stayed in main
    main_reduces = [n for n in split.main.graph.nodes if n.target is ALL_REDUCE]
    assert len(main_reduces) == 1
    assert split.early is not None
    early_ops = {str(n.target) for n in split.early.graph.nodes if n.op == "call_function"}
    assert "aten.mm.default" in early_ops and not any(
        is_collective(n) for n in split.early.graph.nodes
    )
    expected = list(gm(*flat))
    got = run_cut(split, flat)
    for e, g in zip(expected, got, strict=True):
        assert torch.equal(e, g)


def test_early_values_never_share_an_input_memory(world_of_one):
    def step(w, x, target):
        wt = w.t()
        y = x @ wt  # early
        c = _reduced(y.sum(), world_of_one) + _reduced((target != -100).sum(), world_of_one)
        return y / c, wt * c  # main reads the view wt; y.sum() reads the state w: it stays

    flat = inputs()
    gm = make_fx(step)(*flat)
    split = cut(gm)
    assert len(split.metas) == 1
    storages = {t.untyped_storage().data_ptr() for t in flat}
    for value in split.early(*flat):
        assert value.untyped_storage().data_ptr() not in storages
    # the transposed weight is a view: main computes it again instead of receiving it
    main_views = [n for n in split.main.graph.nodes if n.target is torch.ops.aten.t.default]
    assert main_views
    expected = list(gm(*flat))
    for e, g in zip(expected, run_cut(split, flat), strict=True):
        assert torch.equal(e, g)


def test_the_signature_names_the_computation_not_the_nodes(world_of_one):
    flat = inputs()
    first = cut(make_fx(ddp_like(world_of_one))(*flat))
    again = cut(make_fx(ddp_like(world_of_one))(*flat))
    assert first.signature == again.signature

    def other(w, x, target):
        count = _reduced((target != 0).sum(dtype=torch.float32), world_of_one)
        return (x @ w.t()).sum() / count

    assert cut(make_fx(other)(*flat)).signature != first.signature


def test_all_reduces_that_need_more_than_the_inputs_stay(world_of_one):
    group = world_of_one
    flat = inputs()

    def step(w, x, target):
        drawn = _reduced(torch.rand(()), group)  # a random draw: not the same value twice
        big = _reduced(x[: MAX_SLOTS + 1, 0].contiguous(), group)  # more than a round holds
        after = _reduced(_reduced(x.sum(), group) * 2, group)  # after another collective
        state = _reduced(w.sum(), group)  # from the model's state, not the batch
        return drawn + big.sum() + after + state

    split = cut(make_fx(step)(*flat))
    kept = [] if split is None else [n for n in split.main.graph.nodes if n.target is ALL_REDUCE]
    moved = 0 if split is None else len(split.metas)
    # only x.sum() (pure, from the batch, one element) moves
    assert moved == 1 and len(kept) == 4


def test_a_program_without_collectives_or_compute_is_left_whole(world_of_one):
    def views(w, x, target):
        return w.t(), x[0]

    assert cut(make_fx(views)(*inputs())) is None


def test_getitem_of_a_moved_list_stays_consistent(world_of_one):
    """A list-valued early op read element by element in main."""

    def step(w, x, target):
        a, b = torch._foreach_mul([w, x], 2.0)
        return (_reduced(a.sum() + b.sum(), world_of_one) * a,)  # w is state: nothing moves

    flat = inputs()
    gm = make_fx(step)(*flat)
    split = cut(gm)
    assert split is not None and split.early is not None
    assert split.metas == ()
    early_out = split.early.graph.output_node().args[0]
    assert [n.target for n in early_out] == [operator.getitem, torch.ops.aten.add.Tensor]
    assert torch.equal(gm(*flat)[0], run_cut(split, flat)[0])


def test_an_operand_computed_by_many_ops_stays(world_of_one):
    """A long computation (a forward) is never run twice to send its value early."""

    def step(w, x, target):
        h = x
        for _ in range(MAX_PREFIX_NODES):
            h = torch.tanh(h)
        return (_reduced(h.sum(), world_of_one),)

    split = cut(make_fx(step)(*inputs()))
    assert split is not None and split.metas == ()


def test_an_op_of_several_results_is_handed_on_by_its_elements(world_of_one):
    """The forward reads a layer norm's output; the backward reads its mean and rstd:
    those come along with it, and no tuple crosses from the early part to main (Inductor
    refuses a nested output)."""

    def step(w, x, target):
        out, mean, rstd = torch.ops.aten.native_layer_norm(x, [8], None, None, 1e-5)
        count = _reduced((out @ w.t()).sum(), world_of_one)  # reads out: the forward
        return out * count, mean * count, rstd  # main reads mean and rstd

    flat = inputs()
    gm = make_fx(step)(*flat)
    split = cut(gm)
    assert split is not None and split.early is not None
    for value in split.early.graph.output_node().args[0]:
        assert isinstance(value.meta["val"], torch.Tensor)
    for e, g in zip(gm(*flat), run_cut(split, flat), strict=True):
        assert torch.equal(e, g)
