"""split_scalar_prologue (NOTE: [scalar prologue]): 0-d arithmetic on 0-d inputs runs
before the program, the program reads its results; values unchanged."""

from __future__ import annotations

import operator

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from spmd_compiler.lower import LoweredGraph, LoweringOptions
from spmd_compiler.scalar_prologue import WithScalarPrologue, scalar_nodes, split_scalar_prologue


def adam_like(p, g, m, v, lr, steps):
    """An AdamW-shaped update of two tensors: per-tensor 0-d steps (a foreach list), a 0-d
    learning rate, bias corrections built from them."""
    steps = torch._foreach_add(steps, 1)
    bc1 = [1 - torch.pow(0.9, s) for s in steps]
    bc2 = [torch.sqrt(1 - torch.pow(0.999, s)) for s in steps]
    outs = []
    for i in range(2):
        m2 = m[i] + (g[i] - m[i]) * 0.1
        v2 = v[i] * 0.999 + 0.001 * g[i] * g[i]
        size = lr / bc1[i]
        den = v2.sqrt() / (bc2[i] * -size) + (1 / -size) * 1e-4
        outs.append(p[i] * (1 - lr * 0.01) + m2 / den)
    return outs, steps


def traced(dtype=torch.float64):
    gen = torch.Generator().manual_seed(0)

    def t(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    args = (
        [t(64, 8), t(8)], [t(64, 8), t(8)], [t(64, 8), t(8)], [t(64, 8).abs(), t(8).abs()],
        torch.tensor(1e-3, dtype=torch.float64), [torch.tensor(3.0), torch.tensor(3.0)],
    )
    flat, spec = torch.utils._pytree.tree_flatten(args)

    def flat_fn(*xs):  # the per-rank programs return a flat tuple
        return tuple(torch.utils._pytree.tree_leaves(adam_like(*torch.utils._pytree.tree_unflatten(list(xs), spec))))

    gm = make_fx(flat_fn)(*flat)
    return gm, flat


def run(gm, flat):
    return [t for t in torch.utils._pytree.tree_leaves(gm(*flat))]


def test_moves_only_zero_dim_arithmetic_and_keeps_values():
    gm, flat = traced()
    split = split_scalar_prologue(gm)
    assert split is not None
    assert split.moved > 10
    for node in split.prologue.graph.nodes:
        if node.op == "call_function" and node.target is not operator.getitem:
            value = node.meta["val"]
            values = value if isinstance(value, (list, tuple)) else [value]
            assert all(v.dim() == 0 for v in values), node.format_node()
    # no pow / sqrt of a scalar is left where the big tensors are updated
    main_targets = {n.target for n in split.main.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.pow.Scalar not in main_targets
    # the prologue reads only the 0-d inputs: the lr and the two steps
    assert [flat[i].dim() for i in split.prologue_inputs] == [0, 0, 0]
    scalars = split.prologue(*(flat[i] for i in split.prologue_inputs))
    got = run(split.main, [*flat, *scalars])
    want = run(gm, flat)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_nothing_to_split_without_scalar_arithmetic():
    def f(x, w):
        return (x @ w).relu().sum()

    gm = make_fx(f)(torch.randn(4, 3), torch.randn(3, 2))
    assert split_scalar_prologue(gm) is None


def test_scalars_only_returned_are_not_split():
    def f(x, step):
        return x * 2, step + 1  # the step is never read by the tensor math

    gm = make_fx(f)(torch.randn(4), torch.tensor(1.0))
    assert split_scalar_prologue(gm) is None


def test_random_and_non_scalar_inputs_stay():
    def f(x, s):
        noise = torch.rand([])  # a draw: stays in the program, in its order
        scale = s * 2
        row_sum = x.sum()  # 0-d, but from a big tensor: stays
        return x * scale + noise + row_sum.exp()

    gm = make_fx(f)(torch.randn(16), torch.tensor(0.5))
    moved = scalar_nodes(gm)
    names = {str(n.target) for n in moved}
    assert any("mul" in name for name in names)
    assert not any("rand" in name or "sum" in name or "exp" in name for name in names)


def test_foreach_scalars_move_and_a_list_read_whole_stays():
    def f(xs, steps):
        steps = torch._foreach_add(steps, 1)
        return torch._foreach_mul(xs, steps)

    flat = [torch.randn(8), torch.randn(8), torch.tensor(1.0), torch.tensor(2.0)]
    gm = make_fx(lambda a, b, c, d: f([a, b], [c, d]))(*flat)
    add = next(n for n in gm.graph.nodes if n.target is torch.ops.aten._foreach_add.Scalar)
    mul = next(n for n in gm.graph.nodes if n.target is torch.ops.aten._foreach_mul.List)
    # make_fx hands the list over element by element: the list and its getitems move
    assert add in scalar_nodes(gm)
    split = split_scalar_prologue(gm)
    assert split is not None
    scalars = split.prologue(*(flat[i] for i in split.prologue_inputs))
    for a, b in zip(run(split.main, [*flat, *scalars]), run(gm, flat)):
        assert torch.equal(a, b)
    # a reader taking the whole list (not one element) keeps it, and its getitems, here
    mul.args = (mul.args[0], add)
    gm.recompile()
    assert not scalar_nodes(gm)


@pytest.mark.inductor
def test_lowered_with_a_prologue_matches_the_interpreter():
    gm, flat = traced(torch.float32)
    lowered = LoweredGraph(gm, LoweringOptions(backend="inductor"))
    want = run(gm, flat)
    got = lowered([t.clone() for t in flat], simulated=False)
    assert isinstance(lowered._compiled, WithScalarPrologue)
    again = lowered([t.clone() for t in flat], simulated=False)
    for a, b, c in zip(got, want, again):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        assert torch.equal(a, c)
