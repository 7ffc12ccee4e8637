"""Tensor arguments that require grad (NOTE: [tensor arguments that require grad] in
``capture/trace.py``).

Found by a probe on 2026-12-03: an argument passed with ``requires_grad=True`` was traced
as one that does not, so a step returning ``x.grad`` returned None (eager: the gradient)
and left the caller's ``x.grad`` unset, silently; an adversarial step reading it inside
failed with ``'NoneType' object has no attribute 'sign'``. Now such an argument is traced
as the caller's, and a step whose ``backward()`` reaches it is refused by name (eager
would write the caller's ``x.grad``, which a program does not); the advised form, a leaf
made in the step, trains as eager does.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.errors import SPMDCompileError
from spmd_compiler.parallel_modes import make_mode

WORLD = 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).double()


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(4, 6, generator=gen, dtype=torch.float64), torch.randint(0, 3, (4,), generator=gen))
        for _ in range(n)
    ]


def returns_input_gradient(model, optim, x, y):
    F.cross_entropy(model(x), y).backward()
    optim.step()
    optim.zero_grad()
    return x.grad


def adversarial_inside(model, optim, x, y):
    """FGSM as advised: the leaf is made in the step, so eager leaves the caller's x alone."""
    x = x.detach().requires_grad_()
    F.cross_entropy(model(x), y).backward()
    x_adv = (x + 0.1 * x.grad.sign()).detach()
    optim.zero_grad()
    loss = F.cross_entropy(model(x_adv), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach(), x.grad


def gradient_unused(model, optim, x, y):
    """The argument requires grad, but nothing the step differentiates reaches it."""
    with torch.no_grad():
        scale = x.abs().mean()
    loss = F.cross_entropy(model(x.detach()), y) * scale
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_backward_reaching_an_argument_is_refused_by_name(mode):
    model = _model()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    before = copy.deepcopy(model.state_dict())
    x, y = _batches(1)[0]
    x.requires_grad_()
    with sc.simulate(world_size=WORLD), pytest.raises(SPMDCompileError) as info:
        sc.compile(make_mode(mode))(returns_input_gradient)(model, optim, x, y)
    message = str(info.value)
    assert "tensor argument x, which requires grad" in message and "x.detach().requires_grad_()" in message
    assert x.grad is None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # left untouched


def test_an_argument_made_by_code_outside_the_step_is_refused():
    """A non-leaf argument: eager's backward would go on into the code that made it."""
    outside = nn.Linear(6, 6).double()
    model = _model()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _batches(1)[0]
    with sc.simulate(world_size=WORLD), pytest.raises(SPMDCompileError, match="tensor argument x"):
        sc.compile(make_mode("ddp"))(returns_input_gradient)(model, optim, outside(x), y)
    assert outside.weight.grad is None


def test_a_call_requiring_grad_after_one_that_did_not_compiles_again():
    """requires_grad is part of the program's key: the program compiled for a plain batch is
    not reused for one that requires grad."""
    model = _model()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    (x0, y0), (x1, y1) = _batches(2)
    step = sc.compile(make_mode("ddp"))(returns_input_gradient)
    with sc.simulate(world_size=WORLD):
        assert step(model, optim, x0, y0) is None  # eager returns None too: x0 has no grad
        with pytest.raises(SPMDCompileError, match="tensor argument x"):
            step(model, optim, x1.requires_grad_(), y1)


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.parametrize("step_fn", [adversarial_inside, gradient_unused], ids=["leaf_made_in_step", "unused"])
def test_arguments_requiring_grad_train_as_eager(mode, step_fn):
    model = _model()
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    reference = copy.deepcopy(model)
    reference_optim = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    step = sc.compile(make_mode(mode))(step_fn)
    with sc.simulate(world_size=WORLD):
        compiled = [step(model, optim, x.clone().requires_grad_(), y) for x, y in _batches(3)]
        state = sc.checkpoint.full_state_dict(model)["model"]
    eager_inputs = [(x.clone().requires_grad_(), y) for x, y in _batches(3)]
    eager = [step_fn(reference, reference_optim, x, y) for x, y in eager_inputs]
    for got, want in zip(compiled, eager, strict=True):
        for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,),
                        strict=True):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-14)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-12, atol=1e-14)
    assert all(x.grad is None for x, _ in eager_inputs)  # eager left the callers' x alone too


def r1_penalty(model, optim, x, y):
    """R1 regularization on the caller's batch: the step switches requires_grad on itself."""
    x.requires_grad_()
    out = model(x)
    (grad,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    loss = F.cross_entropy(out, y) + grad.pow(2).sum(1).mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


def test_an_argument_the_step_makes_require_grad_still_trains_as_eager():
    """Not refused: it compiled before, and the weights follow eager's (the caller's tensor
    is not switched to requires_grad, eager's side effect)."""
    model = _model()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    reference = copy.deepcopy(model)
    reference_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
    step = sc.compile(make_mode("ddp"))(r1_penalty)
    with sc.simulate(world_size=WORLD):
        compiled = [step(model, optim, x.clone(), y) for x, y in _batches(2)]
        state = sc.checkpoint.full_state_dict(model)["model"]
    eager = [r1_penalty(reference, reference_optim, x.clone(), y) for x, y in _batches(2)]
    for got, want in zip(compiled, eager, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-12, atol=1e-14)


def test_a_flag_the_step_set_itself_is_named_at_its_line():
    """NOTE: [requires_grad set on an argument by the step]: the batch run through the step
    eagerly first (a parity check) arrives requiring grad because the step's own
    ``x.requires_grad_()`` set it. Before the sixty-seventh session the refusal told the
    user to pass ``x`` without requires_grad, naming no line; it names that line now."""
    model = _model()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    reference = copy.deepcopy(model)
    x, y = _batches(1)[0]
    r1_penalty(reference, torch.optim.SGD(reference.parameters(), lr=0.1), x, y)
    assert x.requires_grad  # eager's side effect on the caller's tensor
    before = copy.deepcopy(model.state_dict())
    with sc.simulate(world_size=WORLD), pytest.raises(SPMDCompileError) as info:
        sc.compile(make_mode("ddp"))(r1_penalty)(model, optim, x, y)
    message = str(info.value)
    assert "because the step calls x.requires_grad_() on the caller's tensor" in message, message
    assert f':{r1_penalty.__code__.co_firstlineno + 2}: "x.requires_grad_()"' in message, message
    assert "`x = x.detach().requires_grad_()` at that line" in message, message
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
