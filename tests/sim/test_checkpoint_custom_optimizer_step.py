"""``checkpoint.load`` into a fresh custom optimizer (NOTE: [the step that makes an
optimizer's state]).

A ``def step(self):`` with no closure (most optimizers copied from papers) failed the
load with torch's ``TypeError: Lion.step() got an unexpected keyword argument
'closure'``; an optimizer drawing noise in its step moved the user's generator during
the load.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import spmd_compiler as sc
from spmd_compiler import checkpoint
from spmd_compiler.parallel_modes import DataParallel
from spmd_compiler.tools.demo.steps import classification_batches
from spmd_compiler.tools.demo.steps import classification_train_step as _step
from spmd_compiler.tools.parity import full_state, relative_difference


class Lion(torch.optim.Optimizer):
    """Lion as papers write it: ``step(self)``, no closure."""

    def __init__(self, params, lr: float = 1e-2, betas: tuple[float, float] = (0.9, 0.99)) -> None:
        super().__init__(params, dict(lr=lr, betas=betas))

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                m = state["exp_avg"]
                p.add_((m * b1 + p.grad * (1 - b1)).sign_(), alpha=-group["lr"])
                m.mul_(b2).add_(p.grad, alpha=1 - b2)


class NoisySGD(torch.optim.Optimizer):
    """SGLD-like: draws from the global generator in ``step(self)``."""

    def __init__(self, params, lr: float = 1e-2) -> None:
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["momentum"] = torch.zeros_like(p)
                state["momentum"].mul_(0.9).add_(p.grad)
                p.add_(state["momentum"] + torch.randn_like(p) * 1e-3, alpha=-group["lr"])


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).double()


def _batches(n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return classification_batches(n, 8, 8, 4, torch.float64)

@pytest.mark.parametrize("compile_first", [False, True])
def test_load_into_a_step_without_closure_resumes_exactly(tmp_path, compile_first: bool) -> None:
    data = _batches()
    eager_model = _model()
    eager_opt = Lion(eager_model.parameters())
    for x, y in data:
        _step(eager_model, eager_opt, x, y)

    model = _model()
    opt = Lion(model.parameters())
    step = sc.compile(DataParallel("fully_shard"))(_step)
    with sc.simulate(world_size=2):
        for x, y in data[:2]:
            step(model, opt, x, y)
        checkpoint.save(str(tmp_path), model, opt)

    resumed = _model()
    resumed_opt = Lion(resumed.parameters())
    again = sc.compile(DataParallel("fully_shard"))(_step)
    with sc.simulate(world_size=4) as sim:
        if compile_first:  # compiled: the state exists already, no step is taken
            again(resumed, resumed_opt, *data[0])
        checkpoint.load(str(tmp_path), resumed, resumed_opt)
        assert "step" not in vars(resumed_opt)  # the shim is gone
        again(resumed, resumed_opt, *data[2])
        state = full_state(resumed, resumed_opt, sim)
    expected = full_state(eager_model, eager_opt, None)
    assert state.keys() == expected.keys()
    for name, value in expected.items():  # parameters and exp_avg
        assert relative_difference(state[name], value) < 1e-12, name


def test_load_leaves_the_generator_and_the_optimizer_as_found(tmp_path) -> None:
    model, data = _model(), _batches()
    opt = NoisySGD(model.parameters())
    step = sc.compile(DataParallel("fully_shard"))(_step)
    with sc.simulate(world_size=2) as sim:
        step(model, opt, *data[0])
        checkpoint.save(str(tmp_path), model, opt)
        saved = full_state(model, opt, sim)

    fresh = _model()
    fresh_opt = NoisySGD(fresh.parameters())
    torch.manual_seed(7)
    before = torch.get_rng_state()
    with sc.simulate(world_size=2):
        checkpoint.load(str(tmp_path), fresh, fresh_opt)
    assert torch.equal(torch.get_rng_state(), before)  # the lr=0 step drew nothing of ours
    assert "step" not in vars(fresh_opt)
    loaded = full_state(fresh, fresh_opt, None)
    assert loaded.keys() == saved.keys()
    for name, value in saved.items():  # the checkpoint's values, not the lr=0 step's
        assert torch.equal(loaded[name], value), name


def test_a_failing_step_leaves_no_shim(tmp_path) -> None:
    model, data = _model(), _batches()
    opt = Lion(model.parameters())
    with sc.simulate(world_size=2):
        sc.compile(DataParallel("fully_shard"))(_step)(model, opt, *data[0])
        checkpoint.save(str(tmp_path), model, opt)

    class Broken(Lion):
        def step(self) -> None:
            raise RuntimeError("broken step")

    fresh = _model()
    broken = Broken(fresh.parameters())
    with sc.simulate(world_size=2), pytest.raises(RuntimeError, match="broken step"):
        checkpoint.load(str(tmp_path), fresh, broken)
    assert "step" not in vars(broken)
