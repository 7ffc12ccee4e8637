"""Compiled Adam steps, then LBFGS on one device (a PINN's usual schedule).

NOTE: [optimizers a compiled step cannot run]: LBFGS does not compile, and run eagerly on
the model a compiled step placed its closure is refused (NOTE: [calling a placed model
directly]). Both refusals give the way that works, checked here against the same
schedule run eagerly on one device (float64): the weights gathered with
``sc.checkpoint.full_state_dict`` into a new plain model, stepped by LBFGS there.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import spmd_compiler as sc
from spmd_compiler.errors import SPMDCompileError
from spmd_compiler.parallel_modes import make_mode

TOL = 1e-12


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 1)).double()


def residual_loss(model: nn.Module, xc: torch.Tensor) -> torch.Tensor:
    """A Poisson residual -Δu = 1 (second derivatives by double backward)."""
    x = xc.detach().requires_grad_(True)
    (g,) = torch.autograd.grad(model(x).sum(), x, create_graph=True)
    lap = sum(torch.autograd.grad(g[:, i].sum(), x, create_graph=True)[0][:, i] for i in range(2))
    return ((lap + 1) ** 2).mean()


def adam_step(model: nn.Module, opt: torch.optim.Optimizer, xc: torch.Tensor) -> torch.Tensor:
    loss = residual_loss(model, xc)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach()


def lbfgs_step(model: nn.Module, opt: torch.optim.Optimizer, xc: torch.Tensor) -> torch.Tensor:
    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = residual_loss(model, xc)
        loss.backward()
        return loss

    return opt.step(closure)


def _points() -> torch.Tensor:
    return torch.rand(16, 2, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_lbfgs_on_the_gathered_weights_matches_the_eager_schedule(mode):
    xc = _points()
    reference = make_model()
    reference_adam = torch.optim.Adam(reference.parameters(), lr=1e-2)
    want = [adam_step(reference, reference_adam, xc) for _ in range(3)]
    reference_lbfgs = torch.optim.LBFGS(reference.parameters(), max_iter=5)
    want_lbfgs = [lbfgs_step(reference, reference_lbfgs, xc) for _ in range(2)]

    model = make_model()
    adam = torch.optim.Adam(model.parameters(), lr=1e-2)
    step = sc.compile(make_mode(mode))(adam_step)
    with sc.simulate(world_size=2) as sim:
        got = [sim.full_tensor(step(model, adam, xc)) for _ in range(3)]
        state = sc.checkpoint.full_state_dict(model)  # the hint's way, as it words it
    plain = make_model()
    plain.load_state_dict(state["model"])
    lbfgs = torch.optim.LBFGS(plain.parameters(), max_iter=5)
    got_lbfgs = [lbfgs_step(plain, lbfgs, xc) for _ in range(2)]

    assert max(float((g - w).abs()) for g, w in zip(got, want)) <= TOL
    assert max(float((g - w).detach().abs()) for g, w in zip(got_lbfgs, want_lbfgs)) <= TOL
    for (name, p), q in zip(plain.named_parameters(), reference.parameters()):
        assert float((p - q).detach().abs().max()) <= TOL, name
    assert float(want_lbfgs[-1]) < float(want[-1])  # LBFGS did train


def _eager_closure_refusal(make_optimizer) -> str:  # noqa: ANN001
    """The refusal of ``lbfgs_step`` run eagerly with ``make_optimizer(params)`` on a
    model one compiled Adam call placed; the model is checked to be left as found."""
    xc = _points()
    model = make_model()
    adam = torch.optim.Adam(model.parameters(), lr=1e-2)
    with sc.simulate(world_size=2):
        sc.compile(make_mode("ddp"))(adam_step)(model, adam, xc)
        before = copy.deepcopy(sc.checkpoint.full_state_dict(model)["model"])
        with pytest.raises(SPMDCompileError) as info:
            lbfgs_step(model, make_optimizer(model.parameters()), xc)
        after = sc.checkpoint.full_state_dict(model)["model"]
    assert all(torch.equal(before[k], after[k]) for k in before)
    return str(info.value)


def test_lbfgs_on_the_placed_model_is_told_the_gathered_weights_way():
    """Before: update_bn's compiled form (LBFGS.step is @torch.no_grad()-decorated)."""
    text = _eager_closure_refusal(lambda params: torch.optim.LBFGS(params, max_iter=5))
    assert "called directly with plain tensors" in text
    assert "sc.checkpoint.full_state_dict(model)" in text
    assert "plain.load_state_dict(state['model'])" in text
    assert "update_bn" not in text


def test_another_optimizers_closure_on_the_placed_model_is_told_to_compile_it():
    text = _eager_closure_refusal(lambda params: torch.optim.SGD(params, lr=0.1))
    assert "SGD's step calls the model" in text
    assert "inside a compiled step" in text


def test_compiled_lbfgs_is_refused_with_the_gathered_weights_way():
    """Before: "run the LBFGS step uncompiled", which the placed model refuses."""
    model = make_model()
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError) as info:
        sc.compile(make_mode("ddp"))(lbfgs_step)(model, torch.optim.LBFGS(model.parameters()), _points())
    text = str(info.value)
    assert "optim.LBFGS" in text
    assert "sc.checkpoint.full_state_dict(model)" in text
    assert "torch.optim.LBFGS(plain.parameters())" in text
