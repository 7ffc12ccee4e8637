"""Interpreted programs compute temporaries in place (NOTE: [interpreted programs reuse
their temporaries]): which ops are rewritten, that results do not change, and that
nothing is written that is read again."""

from __future__ import annotations

import operator

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from spmd_compiler.reinplace import inplace_variant, reinplace
from spmd_compiler.state_donation import WRITES, Donating, donate_in_order

aten = torch.ops.aten


def _prepare(fn, shapes, pairs=()):
    gen = torch.Generator().manual_seed(0)
    args = [torch.rand(s, generator=gen, dtype=torch.float64) + 0.5 for s in shapes]
    gm = make_fx(fn)(*args)
    want = gm(*[a.clone() for a in args])
    outputs = len(want)
    kept = donate_in_order(gm, pairs, args)
    gm, count = reinplace(gm)
    got = Donating(gm, kept, outputs)(*args) if kept else list(gm(*args))
    return gm, count, args, list(want), got


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _same(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_inplace_variants():
    assert inplace_variant(aten.mul.Tensor) is aten.mul_.Tensor
    assert inplace_variant(aten._foreach_addcmul.Scalar) is aten._foreach_addcmul_.Scalar
    assert inplace_variant(aten.rsub.Scalar) is None  # no rsub_
    assert inplace_variant(operator.getitem) is None


def test_a_chain_of_temporaries_is_computed_in_one_buffer():
    def step(x, w):
        a = x * 2  # a temporary ...
        b = a + 1  # ... read once: written in place
        c = b.sqrt()
        return (c * w).sum(), w

    gm, count, _, want, got = _prepare(step, [(3, 4), (4,)])
    _same(got, want)
    assert aten.add_.Tensor in _targets(gm) and aten.sqrt_.default in _targets(gm)
    assert aten.mul.Tensor in _targets(gm)  # x * 2 writes nothing it was given
    assert count >= 2


def test_a_temporary_read_again_later_is_not_overwritten():
    def step(x):
        a = x * 2
        b = a + 1  # a is read again below: b may not take a's memory
        return (b.sum() + a.sum(),)

    gm, count, _, want, got = _prepare(step, [(3,)])
    _same(got, want)
    assert aten.add.Tensor in _targets(gm)


def test_inputs_views_and_broadcasts_are_not_written():
    def step(x, y):
        v = (x * 1).t()  # a view of a temporary: not written into
        s = v + 1
        z = x.sum(0) * 1  # a (4,) temporary broadcast against y: the result is bigger
        out = z + y
        return (s.sum() + out.sum() + x.sum(),)

    gm, _, args, want, got = _prepare(step, [(3, 4), (3, 4)])
    _same(got, want)
    targets = _targets(gm)
    assert aten.add.Tensor in targets  # s and out: neither may be written into its self


def test_state_chain_ends_in_the_state_without_a_copy():
    def step(x, w, m):
        loss = (x @ w).sum()  # the last read of the old w
        g = x.sum(0)  # a "gradient"
        m2 = m * 0.9 + g  # m is not read after: written in place, chain ends in m2
        w2 = w * 0.99 - 0.1 * m2  # the decay is written into w, then the update
        return loss, w2, m2

    gm, _, args, want, got = _prepare(step, [(4, 3), (3,), (3,)], ((1, 1), (2, 2)))
    _same(got, want)
    assert got[1] is args[1] and got[2] is args[2]
    targets = _targets(gm)
    assert aten.copy_.default not in targets  # both chains end in their state
    order = list(gm.graph.nodes)
    marker = next(n for n in order if n.op == "call_module" and n.target == WRITES)
    writes = [n for n in order if n.op == "call_function" and n.target in (aten.mul_.Tensor, aten.add_.Tensor, aten.sub_.Tensor)]
    writes_state = [n for n in writes if n.args[0].op == "placeholder"]
    assert writes_state and order.index(marker) < min(order.index(n) for n in writes_state)


def test_a_state_read_after_a_write_keeps_its_copy():
    def step(x, w):
        d = w * 0.5  # could be written into w ...
        w2 = d + x.sum()
        return w2.sum() + (w * 1).sum(), w2  # ... but the old w is read after it

    gm, _, args, want, got = _prepare(step, [(3,), (3,)], ((1, 1),))
    _same(got, want)
    assert got[1] is args[1]


def test_foreach_lists_are_written_in_place_and_read_through_their_tensors():
    def step(a, b, w0, w1):
        t = torch._foreach_mul([a, b], 2.0)  # temporaries
        u = torch._foreach_add(t, [a, b])  # written into t
        v = torch._foreach_sqrt(u)
        new = torch._foreach_sub([w0, w1], v)
        return new[0], new[1], u[0].sum()  # u is read after its sqrt

    gm, count, args, want, got = _prepare(step, [(3,), (3,), (3,), (3,)], ((2, 0), (3, 1)))
    _same(got, want)
    targets = _targets(gm)
    assert aten._foreach_add_.List in targets
    assert aten._foreach_sqrt.default in targets  # v[0] is read after the update: kept


def test_every_foreach_variant_gives_the_same_bits_in_the_dtypes_rewritten():
    from spmd_compiler.passes.fuse_optimizer_updates import _RULES
    from spmd_compiler.reinplace import FOREACH_ELEMENTWISE, REINPLACED_DTYPES

    gen = torch.Generator().manual_seed(0)
    checked = set()
    for rules in _RULES.values():
        for rule in rules:
            variant = inplace_variant(rule.target)
            if variant is None:
                continue
            for dtype in REINPLACED_DTYPES:
                lists = [
                    0.9 if kind == "S" else [
                        (torch.rand(s, generator=gen, dtype=torch.float64) + 0.5).to(dtype)
                        for s in [(37, 64), (128,), ()]
                    ]
                    for kind in rule.pattern
                ]
                kwargs = {name: 0.3 for name in rule.kwargs}
                want = rule.target(*lists, **kwargs)
                written = [t.clone() for t in lists[0]]
                variant(written, *lists[1:], **kwargs)
                for a, b in zip(written, want, strict=True):
                    assert torch.equal(a, b), (rule.target, dtype)
            checked.add(rule.target.overloadpacket.__name__)
    assert checked == FOREACH_ELEMENTWISE


def test_sixteen_bit_tensors_and_matrix_products_are_left_alone():
    def step(x, w):
        h = (x * 2).bfloat16()  # a 16-bit temporary: its in-place kernels may round
        h2 = h * 0.9  # differently (NOTE: [interpreted programs reuse their temporaries])
        a = x * 1  # a temporary both operands of addmm read: not an element-wise op
        y = torch.addmm(a, a, a)
        return (h2.float().sum() + y.sum(),)

    gm, _, _, want, got = _prepare(step, [(4, 4), (4,)])
    _same(got, want)
    targets = _targets(gm)
    assert aten.addmm.default in targets and aten.addmm_.default not in targets
    assert aten.mul_.Tensor not in [
        n.target for n in gm.graph.nodes if n.meta.get("val") is not None
        and getattr(n.meta["val"], "dtype", None) == torch.bfloat16
    ]


def test_a_collectives_input_is_not_written_before_its_wait():
    from collective_pass_harness import TinyGraph

    t = TinyGraph(world_size=2)
    a = t.input("a", 4, 3)
    x = t.op("x", aten.mul.Tensor, a, 2.0)
    gathered = t.all_gather("ag", x)  # sends x until its wait
    y = t.op("y", aten.add.Tensor, x, 1.0)  # x's last reader but the collective ...
    gathered.prepend(y)  # ... placed before the wait: y may not take x's memory
    z = t.op("z", aten.mul.Tensor, y, 3.0)  # y is free after this: z may take it
    gm = t.program(z, gathered).graph_module

    gm, _ = reinplace(gm)

    targets = {n.name: n.target for n in gm.graph.nodes}
    assert targets["y"] is aten.add.Tensor
    assert targets["z"] is aten.mul_.Tensor


def test_a_state_whose_writes_miss_its_new_value_is_retried_from_a_fresh_program():
    """``d = w * 0.5`` could be written into w (nothing reads w after it), but w's new
    value is another tensor: the rewrite is tried again without w. Given ``fresh``, the
    first try rewrites the program itself and the retry starts from a fresh one (no deep
    copy when the first try holds); without it the given program stays as it was."""

    def step(x, w):
        d = w * 0.5
        w2 = x * 2.0
        return d.sum(), w2

    gen = torch.Generator().manual_seed(0)
    args = [torch.rand(3, generator=gen, dtype=torch.float64) for _ in range(2)]
    want = make_fx(step)(*[a.clone() for a in args])(*[a.clone() for a in args])
    made = []

    def fresh():
        gm = make_fx(step)(*args)
        made.append((gm, donate_in_order(gm, ((1, 1),), args)))
        return gm

    first = fresh()
    gm, count = reinplace(first, fresh)
    assert len(made) == 2 and gm is made[-1][0]  # one retry, from the fresh program
    assert aten.mul_.Tensor not in _targets(gm) and aten.mul_.Scalar not in _targets(gm)
    got = Donating(gm, made[-1][1], 2)(*args)
    _same(got, want)
    assert got[1] is args[1]

    untouched = make_fx(step)(*args)
    donate_in_order(untouched, ((1, 1),), args)
    before = [n.target for n in untouched.graph.nodes]
    reinplace(untouched)
    assert [n.target for n in untouched.graph.nodes] == before
