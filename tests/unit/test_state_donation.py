"""State donation (NOTE: [state donation]): a lowered program writes the state it reads and
returns into its inputs; which state qualifies, and that the values do not change."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from spmd_compiler.expand.retrace import DistributedProgram
from spmd_compiler.ir.signature import Kind, StateRef
from spmd_compiler.state_donation import Donating, donate, donation_pairs, not_read_by

W = StateRef(Kind.PARAM, "w")
M = StateRef(Kind.OPTIM_STATE, "w", key="exp_avg", optimizer=0)
G = StateRef(Kind.GRAD, "w")
X = StateRef(Kind.INPUT, index=0)
LOSS = StateRef(Kind.RETURN, index=0)


def program(inputs, outputs, checks=(), deferred=None, padded=None):
    captured = SimpleNamespace(
        inputs=[(ref, None) for ref in inputs], outputs=list(outputs), checks=list(checks)
    )
    fake = SimpleNamespace(captured=captured, deferred=deferred, padded=padded or {})
    fake.pads = functools.partial(DistributedProgram.pads, fake)  # the real method
    return fake


def test_pairs_are_state_read_and_written():
    p = program([X, W, M, G], [LOSS, W, G, M])
    assert donation_pairs(p) == ((1, 1), (2, 3))  # the gradient is never donated


def test_no_pairs_with_checks_a_deferred_part_or_padding():
    assert donation_pairs(program([W], [W], checks=[object()])) == ()
    assert donation_pairs(program([W], [W], deferred=object())) == ()
    # a padded parameter is fed as a padded copy; its optimizer state too
    assert donation_pairs(program([W, M], [W, M], padded={"w": (3, 4)})) == ()


def step(x, w, m):
    m2 = m * 0.9 + (x.t() @ x).sum(0) * 0.1
    w2 = w - 0.01 * m2
    return (x @ w2).sum(), w2, m2


def traced():
    args = [torch.randn(4, 3, dtype=torch.float64), torch.randn(3, dtype=torch.float64),
            torch.randn(3, dtype=torch.float64)]
    return make_fx(step)(*args), args


def test_donated_values_land_in_the_inputs():
    gm, args = traced()
    want = gm(*[a.clone() for a in args])
    kept = donate(gm, ((1, 1), (2, 2)), args)
    assert kept == ((1, 1), (2, 2))
    copies = [n for n in gm.graph.nodes if n.target is torch.ops.aten.copy_.default]
    assert len(copies) == 2
    w, m = args[1], args[2]
    got = Donating(gm, kept, 3)(*args)
    assert got[1] is w and got[2] is m  # the inputs themselves, updated
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_inputs_sharing_memory_or_returned_as_they_were_are_not_donated():
    gm, args = traced()
    shared = [args[0], args[1], args[1]]  # the optimizer state is the parameter's memory
    assert donate(gm, ((1, 1), (2, 2)), shared) == ()

    def keeps_old(x, w):
        return w, w * 2  # the old value is returned too

    args = [torch.randn(3), torch.randn(3)]
    gm = make_fx(keeps_old)(*args)
    assert donate(gm, ((1, 1),), args) == ()

    def keeps_a_view(x, w):
        return w.view(3, 1), w * 2

    gm = make_fx(keeps_a_view)(*args)
    assert donate(gm, ((1, 1),), args) == ()


def test_a_different_shape_is_not_donated():
    def grows(x, w):
        return (w.unsqueeze(0) * x).sum(0, keepdim=True), torch.cat([w, w])

    args = [torch.randn(2, 3), torch.randn(3)]
    gm = make_fx(grows)(*args)
    assert donate(gm, ((1, 1),), args) == ()


def test_the_executable_donates_only_a_program_without_checks():
    from spmd_compiler.lower import Executable, LoweringOptions

    gm, _ = traced()
    options = LoweringOptions(backend="inductor")
    plain = program([X, W, M], [LOSS, W, M])
    plain.graph_module = gm
    assert Executable.of(plain, options).step.donations == ((1, 1), (2, 2))
    checked = program([X, W, M], [LOSS, W, M], checks=[object()])
    checked.graph_module = gm
    assert Executable.of(checked, options).step.donations == ()


def test_only_torch_2_11_keeps_inputs_read_by_called_out_kernels_from_donation(monkeypatch):
    """NOTE: [state donation]: torch 2.11's peak-memory reordering ran a weight's in-place
    update before the backward's matmul reading the old weight; there an input that a
    kernel Inductor calls out to reads is not donated (the reordering stays on)."""
    from spmd_compiler import _torch_private as private

    for release, want in (("2.11", True), ("2.13", False)):
        monkeypatch.setattr(private, "_release", lambda r=release: r)
        assert private.inductor_updates_inputs_safely()
        assert private.inductor_called_out_reads_may_follow_input_updates() is want
    monkeypatch.setattr(private, "_release", lambda: "2.12")
    assert not private.inductor_updates_inputs_safely()


def test_an_input_a_matmul_reads_is_not_donated_through_views():
    from spmd_compiler import _torch_private as private

    def matmul_step(x, w, m):
        m2 = m * 0.9 + 1.0
        return (x @ w.t()).sum(), w - 0.1 * m2, m2

    gm = make_fx(matmul_step)(torch.randn(4, 3), torch.randn(2, 3), torch.randn(2, 3))
    assert not_read_by(gm, ((1, 1), (2, 2)), private.inductor_calls_out) == ((2, 2),)
    assert not_read_by(gm, ((1, 1), (2, 2)), lambda target: False) == ((1, 1), (2, 2))

    def split_step(x, w, m):  # one piece of the split weight goes into a matmul
        top, bottom = w.split(1)
        halves = m.split(1)
        return (x @ top.t()).sum() + bottom.sum(), w * 0.9, torch.cat(halves) * 0.5

    gm = make_fx(split_step)(torch.randn(4, 3), torch.randn(2, 3), torch.randn(2, 3))
    assert not_read_by(gm, ((1, 1), (2, 2)), private.inductor_calls_out) == ((2, 2),)


def test_which_kernels_inductor_calls_out_to():
    from spmd_compiler import _torch_private as private

    aten = torch.ops.aten
    for op in (aten.mm.default, aten.addmm.default, aten.convolution.default,
               aten.native_layer_norm.default, torch.ops._c10d_functional.all_reduce.default,
               print):
        assert private.inductor_calls_out(op), op
    for op in (aten.add.Tensor, aten.mul.Tensor, aten._foreach_lerp.Scalar,
               aten._foreach_addcdiv.Scalar, aten._foreach_mul.Scalar):
        assert not private.inductor_calls_out(op), op


def test_a_program_creating_optimizer_state_runs_interpreted():
    """NOTE: [programs that run once]: the call that creates the optimizer state runs once
    per optimizer; with backend="inductor" it is interpreted instead of compiled, and the
    program that reads the state is lowered."""
    from spmd_compiler.lower import Executable, LoweringOptions

    gm, _ = traced()
    options = LoweringOptions(backend="inductor")
    creating = program([X, W], [LOSS, W, M])  # writes M without reading it
    creating.graph_module = gm
    steady = program([X, W, M], [LOSS, W, M])
    steady.graph_module = gm
    cpu = [torch.zeros(1)]
    assert Executable.of(creating, options).step._eager(cpu)
    assert not Executable.of(steady, options).step._eager(cpu)
    assert Executable.of(steady, LoweringOptions(backend="eager")).step._eager(cpu)
