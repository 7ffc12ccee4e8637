"""fuse_optimizer_updates: every rule bit-identical, placement on tiny graphs, parity."""

from __future__ import annotations

import operator
from types import SimpleNamespace

import pytest
import torch
from collective_pass_harness import (
    TOL,
    DataParallelWithPasses,
    TinyGraph,
    mlp_setup,
    ops,
    train,
)

from spmd_compiler.ir.node_meta import OPTIMIZER_PHASE, PHASE
from spmd_compiler.passes import PassOptions, run_pipeline
from spmd_compiler.passes.fuse_optimizer_updates import _RULES, fuse_optimizer_updates

PASS = ("fuse_optimizer_updates",)
aten = torch.ops.aten


def _rule_inputs(pattern: tuple[str, ...], dtype: torch.dtype) -> list[tuple]:
    """Per-member argument tuples: a matrix, a vector and a 0-d tensor member; the last
    tensor argument of the matrix member is 0-d (a step-dependent factor)."""
    gen = torch.Generator().manual_seed(0)
    members = []
    for shape in [(3, 4), (5,), ()]:
        args = []
        for i, kind in enumerate(pattern):
            if kind == "S":
                args.append(0.7)
                continue
            last = i == len(pattern) - 1 and len(pattern) > 1
            s = () if last and shape == (3, 4) else shape
            args.append(torch.rand(s, generator=gen, dtype=dtype) + 0.5)
        members.append(tuple(args))
    return members


@pytest.mark.parametrize("target", list(_RULES), ids=str)
def test_every_rule_is_bit_identical_to_the_per_tensor_op(target):
    for rule in _RULES[target]:
        kwargs = {name: 0.3 for name in rule.kwargs}
        members = _rule_inputs(rule.pattern, torch.float32)
        lists = [
            [m[i] for m in members] if kind == "T" else members[0][i]
            for i, kind in enumerate(rule.pattern)
        ]
        fused = rule.target(*lists, **kwargs)
        for args, result in zip(members, fused, strict=True):
            expected = target(*args, **kwargs)
            assert result.dtype == expected.dtype and result.shape == expected.shape
            assert torch.equal(result, expected), (rule.target, args)


def _tiny_adam_like(n_params: int = 3):
    """Per-parameter chains ``v = mul(s, 0.9); a = sqrt(v); q = div(g, a); p2 = sub(p, q)``
    interleaved parameter by parameter, all marked as optimizer phase."""
    t = TinyGraph()
    outputs, inputs = [], []
    for i in range(n_params):
        p, g, s = (t.input(f"{k}{i}", 4, i + 2) for k in "pgs")
        v = t.op(f"v{i}", aten.mul.Tensor, s, 0.9)
        a = t.op(f"a{i}", aten.sqrt.default, v)
        q = t.op(f"q{i}", aten.div.Tensor, g, a)
        out = t.op(f"out{i}", aten.sub.Tensor, p, q)
        for node in (v, a, q, out):
            node.meta[PHASE] = OPTIMIZER_PHASE
        outputs += [out, v]
        inputs += [p, g, s]
    return t.program(*outputs), [n.meta["val"].shape for n in inputs]


def test_chains_become_one_foreach_op_per_level():
    program, shapes = _tiny_adam_like()
    gm = program.graph_module
    gen = torch.Generator().manual_seed(0)
    real = [torch.rand(s, generator=gen) + 0.1 for s in shapes]
    expected = gm(*real)

    run_pipeline(program, PassOptions(), pipeline=PASS)

    targets = [n.target for n in program.graph.nodes if n.op == "call_function"]
    fused = [t for t in targets if t is not operator.getitem]
    assert fused == [
        aten._foreach_mul.Scalar,
        aten._foreach_sqrt.default,
        aten._foreach_div.List,
        aten._foreach_sub.List,
    ]
    assert targets.count(operator.getitem) == 12
    assert all(n.meta.get(PHASE) == OPTIMIZER_PHASE for n in ops(program.graph, "getitem"))
    gm.recompile()
    for got, want in zip(gm(*real), expected, strict=True):
        assert torch.equal(got, want)


def test_dependent_ops_of_one_kind_are_not_fused_together():
    t = TinyGraph()
    x, y = t.input("x", 4), t.input("y", 4)
    x1 = t.op("x1", aten.mul.Tensor, x, 0.5)
    x2 = t.op("x2", aten.mul.Tensor, x1, 0.5)  # uses x1: a later level
    y1 = t.op("y1", aten.mul.Tensor, y, 0.5)
    for node in (x1, x2, y1):
        node.meta[PHASE] = OPTIMIZER_PHASE
    program = t.program(x2, y1)

    assert fuse_optimizer_updates(program, SimpleNamespace()) is True

    foreach = ops(program.graph, "_foreach_mul")
    assert len(foreach) == 1 and len(foreach[0].args[0]) == 2
    # x2 stays alone, after the fused x1 it uses
    (single,) = ops(program.graph, "aten.mul.Tensor")
    assert single.args[0].target is operator.getitem


def test_the_foreach_op_runs_once_per_layout(monkeypatch):
    """Members of one group with 2 distinct input layouts: the fake foreach op runs on 2
    of them, and each member's own value becomes its result's (NOTE: [foreach fusion])."""
    from spmd_compiler.passes import fuse_optimizer_updates as pass_module

    t = TinyGraph()
    members = []
    for i in range(6):
        x = t.input(f"x{i}", 4, 2 + i % 2)
        members.append(t.op(f"m{i}", aten.mul.Tensor, x, 0.5))
        members[-1].meta[PHASE] = OPTIMIZER_PHASE
    program = t.program(*members)
    own = [m.meta["val"] for m in members]
    sizes = []
    run_fake = pass_module._run_fake

    def counted(rule, args, kwargs, group):
        sizes.append(len(args[0]))
        return run_fake(rule, args, kwargs, group)

    monkeypatch.setattr(pass_module, "_run_fake", counted)
    assert fuse_optimizer_updates(program, SimpleNamespace()) is True

    assert sizes == [2]
    (fused,) = ops(program.graph, "_foreach_mul")
    assert all(a is b for a, b in zip(fused.meta["val"], own, strict=True))
    results = [n.meta["val"] for n in ops(program.graph, "getitem")]
    assert all(a is b for a, b in zip(results, own, strict=True))


def test_no_optimizer_section_is_a_no_op():
    t = TinyGraph()
    x, y = t.input("x", 4), t.input("y", 4)
    program = t.program(t.op("x1", aten.mul.Tensor, x, 0.5), t.op("y1", aten.mul.Tensor, y, 0.5))
    code = program.graph_module.code

    assert fuse_optimizer_updates(program, SimpleNamespace()) is False
    assert program.graph_module.code == code


def _sgd_setup(steps: int = 2):
    model, _, batches = mlp_setup(steps)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    return model, optim, batches


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _optimizer_ops(run) -> list[torch.fx.Node]:
    return [
        n
        for n in run.graph.nodes
        if n.op == "call_function"
        and n.meta.get(PHASE) == OPTIMIZER_PHASE
        and n.target is not operator.getitem
    ]


# SGD here all-reduces inside its update: ops whose users lead into a collective stay
@pytest.mark.parametrize(
    ("setup", "max_ratio"), [(mlp_setup, 0.5), (_sgd_setup, 0.9)], ids=["adamw", "sgd"]
)
def test_parity_with_and_without_fusion(setup, max_ratio):
    off = train(DataParallelWithPasses("replicate", ()), setup)
    on = train(DataParallelWithPasses("replicate", PASS), setup)

    for run in (off, on):
        assert run.max_loss_difference <= TOL
        assert run.max_state_difference <= TOL
    assert on.losses == off.losses
    for a, b in zip(on.model.parameters(), off.model.parameters(), strict=True):
        assert torch.equal(_local(a), _local(b))
    assert ops(off.graph, "_foreach_") == []
    assert len(ops(on.graph, "_foreach_")) > 0
    assert len(_optimizer_ops(on)) < len(_optimizer_ops(off)) * max_ratio


def test_a_group_reading_only_inputs_stays_where_its_members_were():
    # a weight decay, p * c, reads graph inputs alone: fused at its inputs it would run
    # before the forward and its results be held through it (NOTE: [foreach fusion])
    t = TinyGraph()
    x, p0, p1 = t.input("x", 4, 4), t.input("p0", 4, 4), t.input("p1", 4)
    y = t.op("y", aten.mm.default, x, p0)
    d0 = t.op("d0", aten.mul.Tensor, p0, 0.9)
    d1 = t.op("d1", aten.mul.Tensor, p1, 0.9)
    for node in (d0, d1):
        node.meta[PHASE] = OPTIMIZER_PHASE
    program = t.program(y, d0, d1)

    assert fuse_optimizer_updates(program, SimpleNamespace()) is True

    order = [n.name for n in program.graph.nodes]
    (fused,) = ops(program.graph, "_foreach_mul")
    assert order.index(fused.name) > order.index("y")


def test_readers_are_rewritten_once_per_group_not_once_per_member(monkeypatch):
    """The output reads every parameter's update: replacing the members one by one made fx
    rebuild its whole argument list once per member, quadratic in the parameter count
    (NOTE: [one rewrite per reader]). Counted, not timed: the input slots fx rebuilds stay
    a small multiple of the graph's size."""
    n = 64
    program, _ = _tiny_adam_like(n)
    rebuilt = [0]
    node_type = torch.fx.Node
    replace, update = node_type._replace_input_with, node_type._update_args_kwargs

    def counted_replace(self, old, new):
        rebuilt[0] += len(self.all_input_nodes)
        return replace(self, old, new)

    def counted_update(self, args, kwargs):
        rebuilt[0] += len(self.all_input_nodes)
        return update(self, args, kwargs)

    monkeypatch.setattr(node_type, "_replace_input_with", counted_replace)
    monkeypatch.setattr(node_type, "_update_args_kwargs", counted_update)
    size = len(program.graph.nodes)
    assert fuse_optimizer_updates(program, SimpleNamespace()) is True

    assert len(ops(program.graph, "_foreach_")) == 4
    assert rebuilt[0] <= 6 * size, (rebuilt[0], size)  # 1,536 for 449 nodes; was 17,088
