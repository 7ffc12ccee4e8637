"""Interpreted programs update state in place (NOTE: [interpreted programs update state
in place]): each copy sits where the old value was last read, later readers of the new
value read the state, and the results are those of the functional program."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from spmd_compiler.state_donation import Donating, donate_in_order

copy_ = torch.ops.aten.copy_.default


def _trace(fn, *shapes):
    gen = torch.Generator().manual_seed(0)
    args = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    return make_fx(fn)(*args), args


def _run(fn, shapes, pairs):
    """(the functional results, the donating program's results, its inputs, the rewritten
    graph module, the pairs kept)."""
    gm, args = _trace(fn, *shapes)
    want = gm(*[a.clone() for a in args])
    outputs = len(want)
    kept = donate_in_order(gm, pairs, args)
    got = Donating(gm, kept, outputs)(*args)
    return want, got, args, gm, kept


def _position(gm, node):
    return list(gm.graph.nodes).index(node)


def test_each_copy_follows_the_last_read_of_the_old_value():
    def step(x, w, m):
        m2 = m * 0.9 + x.sum(0)  # the new m: m is not read again
        y = (x @ w).sum()  # reads the old w after m2
        w2 = w - 0.01 * m2
        z = (x @ w2).sum() + m2.sum()  # reads both new values
        return y + z, w2, m2

    want, got, args, gm, kept = _run(step, [(4, 3), (3,), (3,)], ((1, 1), (2, 2)))

    assert kept == ((1, 1), (2, 2))
    assert got[1] is args[1] and got[2] is args[2]
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    copies = [n for n in gm.graph.nodes if n.target is copy_]
    m_copy = next(c for c in copies if c.args[0].name.startswith("m"))
    mv = [n for n in gm.graph.nodes if n.target is torch.ops.aten.mv.default]
    # m is copied before the forward reads w: nothing reads the old m after m2
    assert _position(gm, m_copy) < _position(gm, mv[0])
    # the new values' later readers read the state itself
    for copy in copies:
        new = copy.args[1]
        assert all(_position(gm, u) <= _position(gm, copy) for u in new.users)


def test_a_view_of_the_old_value_read_late_holds_the_copy_back():
    def step(x, w):
        wt = w.t()  # a view of the old w ...
        w2 = w * 0.5
        y = x @ wt  # ... read after the new value exists
        return y.sum(), w2

    want, got, args, gm, kept = _run(step, [(2, 3), (3, 3)], ((1, 1),))

    assert kept == ((1, 1),)
    (copy,) = [n for n in gm.graph.nodes if n.target is copy_]
    (mm,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default]
    assert _position(gm, copy) > _position(gm, mm)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_a_new_value_that_is_a_view_of_an_input_is_not_donated():
    def step(x, w, m):
        return (x * w).sum(), m.view(3), m * 2

    gm, args = _trace(step, (3,), (3,), (3,))
    assert donate_in_order(gm, ((1, 1),), args) == ()
    assert not any(n.target is copy_ for n in gm.graph.nodes)


@pytest.mark.parametrize("rewrite", ["in_order", "lowered"])
def test_an_input_written_as_another_states_value_is_not_donated(rewrite):
    """``t`` takes ``w``'s old value (a hard target copy the capture would clone, NOTE:
    [state written as another state's value]); ``w`` is updated. Donating ``w`` wrote its
    update into the tensor handed back as ``t``'s value: ``t`` came out as the new ``w``."""
    from spmd_compiler.state_donation import donate

    def step(x, w, t):
        return (x * t).sum(), w - 0.1 * x, w

    gm, args = _trace(step, (3,), (3,), (3,))
    want = gm(*[a.clone() for a in args])
    kept = (donate_in_order if rewrite == "in_order" else donate)(gm, ((1, 1), (2, 2)), args)
    assert (1, 1) not in kept
    got = Donating(gm, kept, 3)(*args) if kept else gm(*args)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_a_copy_of_another_input_is_left_out_of_inductors_donation():
    from spmd_compiler.state_donation import not_copies_of_inputs

    def step(x, w, t, m):
        return (x * t).sum(), w - 0.1 * x, w.clone().view(3), m * 0.5 + w

    gm, _ = _trace(step, (3,), (3,), (3,), (3,))
    pairs = ((1, 1), (2, 2), (3, 3))
    assert not_copies_of_inputs(gm, pairs) == ((1, 1), (3, 3))


@pytest.mark.inductor
def test_inductor_gives_a_target_copy_the_old_value():
    """Donated, ``copy_(t, clone(w))`` read ``w`` after ``w``'s update (Inductor removes
    the clone as a no-op): ``t`` took the new ``w``, 1.29 off."""
    from spmd_compiler import _torch_private as private
    from spmd_compiler.state_donation import donatable, donate, not_copies_of_inputs

    def step(x, w, t):
        return (x * w).sum(), w - 0.5 * x, w.clone()

    gm, args = _trace(step, (64,), (64,), (64,))
    old_w = args[1].clone()
    pairs = not_copies_of_inputs(gm, donatable(gm, ((1, 1), (2, 2)), args))
    kept = donate(gm, pairs, args)
    compiled = private.inductor_compile(gm, [a.clone() for a in args])
    got = Donating(compiled, kept, 3)(*args)
    assert torch.equal(got[2], old_w)
    assert torch.equal(got[1], old_w - 0.5 * args[0])


def test_the_interpreter_updates_state_in_place():
    from spmd_compiler.lower import LoweredGraph, LoweringOptions

    def step(x, w):
        return (x @ w).sum(), w - 0.1 * x.t() @ x

    gm, args = _trace(step, (3, 3), (3, 3))
    want = gm(*[a.clone() for a in args])
    lowered = LoweredGraph(gm, LoweringOptions(backend="eager"), donations=((1, 1),))
    got = lowered(list(args), simulated=True)
    assert got[1] is args[1]
    assert not lowered.updates_in_place  # it finished: nothing is half-written
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    # the next call runs the prepared program again, from the updated state
    again = lowered([args[0], args[1]], simulated=True)
    assert again[1] is args[1]


def test_copies_follow_the_last_wait_and_a_failure_before_them_leaves_the_state():
    from spmd_compiler.lower import LoweredGraph, LoweringOptions
    from spmd_compiler.state_donation import WRITES

    wait_tensor = torch.ops._c10d_functional.wait_tensor.default

    def step(x, w, m):
        m2 = m * 0.9 + x.sum(0)  # nothing reads m after this: it could be copied here
        y = wait_tensor(x @ w)  # ... but a collective's wait comes later
        return y.sum(), w - 0.1 * m2, m2

    gm, args = _trace(step, (4, 3), (3,), (3,))
    lowered = LoweredGraph(gm, LoweringOptions(backend="eager"), donations=((1, 1), (2, 2)))
    before = [a.clone() for a in args]
    lowered(list(args), simulated=True)
    assert not all(torch.equal(a, b) for a, b in zip(args, before, strict=True))
    program = lowered._interpreted[(False, True)][0].inner
    order = list(program.graph.nodes)
    marker = next(n for n in order if n.op == "call_module" and n.target == WRITES)
    (wait,) = [n for n in order if n.target is wait_tensor]
    # each state is written by a copy, or in place by its update (NOTE: [interpreted
    # programs reuse their temporaries]): all of it after the wait and the marker
    writes = [
        n for n in order
        if n.op == "call_function" and n.args and getattr(n.args[0], "op", None) == "placeholder"
        and (n.target is copy_ or n.target._schema.arguments[0].alias_info is not None)
    ]
    assert {n.args[0].name for n in writes} == {"w_1", "m_1"}
    assert order.index(wait) < order.index(marker) < min(order.index(n) for n in writes)

    def peer_died(*args):
        raise RuntimeError("a peer died")

    wait.target = peer_died  # the next call fails in its "collective"
    program.recompile()
    updated = [a.clone() for a in args]
    with pytest.raises(RuntimeError, match="a peer died"):
        lowered(list(args), simulated=True)
    assert not lowered.updates_in_place
    assert all(torch.equal(a, b) for a, b in zip(args, updated, strict=True))
    # a failure after the first copy says the state may hold part of the update
    wait.target = wait_tensor
    last = max((n for n in order if n.op == "call_function"), key=order.index)
    assert order.index(last) > order.index(marker)
    last.target = peer_died
    program.recompile()
    with pytest.raises(RuntimeError, match="a peer died"):
        lowered(list(args), simulated=True)
    assert lowered.updates_in_place


def test_write_back_leaves_state_updated_in_place_alone(tmp_path, monkeypatch):
    """On a real rank the program hands each state tensor it updated in place back as the
    very tensor it was fed: write-back swaps nothing for it (the step's host work), and
    the model still trains as the eager step does."""
    import torch.distributed as dist
    import torch.nn.functional as F

    import spmd_compiler as sc
    from spmd_compiler import _torch_private as private
    from spmd_compiler.parallel_modes import DataParallel

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        def step(model, optim, x, y):
            F.cross_entropy(model(x), y).backward()
            optim.step()
            optim.zero_grad()

        compiled = sc.compile(parallel_mode=DataParallel("replicate"), backend="eager")(step)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).double()
        reference = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).double()
        reference.load_state_dict(model.state_dict())
        optim = torch.optim.AdamW(model.parameters(), lr=0.05)
        ref_optim = torch.optim.AdamW(reference.parameters(), lr=0.05)
        batches = [(torch.randn(4, 6, dtype=torch.float64), torch.randint(0, 3, (4,))) for _ in range(4)]
        swaps: list[object] = []
        real_set = private.set_local_tensor
        for k, (x, y) in enumerate(batches):
            if k == 3:  # a steady call: state installed, the program prepared
                monkeypatch.setattr(private, "set_local_tensor", lambda d, v: swaps.append(d) or real_set(d, v))
                locals_before = [private.local_tensor_of(p) for p in model.parameters()]
            compiled(model, optim, x, y)
            step(reference, ref_optim, x, y)
        assert swaps == []
        assert all(private.local_tensor_of(p) is q for p, q in zip(model.parameters(), locals_before, strict=True))
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.full_tensor(), q, rtol=1e-12, atol=1e-12)
    finally:
        dist.destroy_process_group()
