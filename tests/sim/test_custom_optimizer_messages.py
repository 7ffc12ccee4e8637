"""What the refusals and warnings of a custom optimizer's Python numbers say (NOTE:
[counters a custom optimizer keeps], NOTE: [transformers' Adafactor] in
capture/optimizer_advice.py; NOTE: [a learning rate read in Python]).

Before: a ``math.sqrt(group["lr"])`` recompiling every call was warned about as "only the
learning rate ... is a graph input", the opposite of what happened; ``self.t += 1`` was
told to use a module buffer, naming the train step's line; a schedule-free AdamW keeping
counters in its groups and transformers' Adafactor were told to use torch.optim's Adam.
"""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
import torch.nn as nn

import spmd_compiler as sc
from spmd_compiler import SPMDCompileError
from spmd_compiler.parallel_modes import DataParallel
from spmd_compiler.tools.demo.steps import classification_batches
from spmd_compiler.tools.demo.steps import classification_train_step as _step
from spmd_compiler.tools.parity import full_state, relative_difference


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).double()


def _batches(n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return classification_batches(n, 8, 8, 4, torch.float64)

def _compared(make_opt, calls: int, scheduled: bool = False) -> tuple[float, int]:
    """(worst relative difference of the state, programs) of ``calls`` compiled calls on 2
    simulated ranks against eager."""
    model, data = _model(), _batches(calls)
    eager_model = copy.deepcopy(model)
    opt, eager_opt = make_opt(model), make_opt(eager_model)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda i: 0.6**i) for o in (opt, eager_opt)] if scheduled else []
    step = sc.compile(DataParallel("fully_shard"))(_step)
    with sc.simulate(world_size=2) as sim:
        for x, y in data:
            step(model, opt, x, y)
            _step(eager_model, eager_opt, x, y)
            for s in schedules:
                s.step()
        state = full_state(model, opt, sim)
    expected = full_state(eager_model, eager_opt, None)
    assert state.keys() == expected.keys()
    return max(relative_difference(state[k], expected[k]) for k in expected), step.compile_count


def _refusal(make_opt) -> tuple[torch.optim.Optimizer, str]:
    """The optimizer and the text of the first compiled call's refusal."""
    model = _model()
    opt = make_opt(model.parameters())
    step = sc.compile(DataParallel("fully_shard"))(_step)
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError) as info:
        step(model, opt, *_batches(1)[0])
    return opt, str(info.value)


class _SqrtLR(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 0.1, python: bool = True) -> None:
        super().__init__(params, dict(lr=lr))
        self.python = python

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            lr = group["lr"]
            step_size = 0.3 * math.sqrt(lr) if self.python else 0.3 * lr**0.5  # the read
            for p in group["params"]:
                p.add_(p.grad, alpha=-step_size)


def test_a_learning_rate_read_in_python_is_warned_of_as_such(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="spmd_compiler"):
        _, programs = _compared(lambda m: _SqrtLR(m.parameters()), 4, scheduled=True)
    assert programs == 4
    text = " ".join(r.getMessage() for r in caplog.records if "changed on" in r.getMessage())
    assert "_SqrtLR's step() reads the learning rate as a Python number" in text, text
    assert "step_size = 0.3 * math.sqrt(lr)" in text  # the optimizer's line
    assert "`lr ** 0.5` for math.sqrt(lr)" in text
    assert "only the learning rate" not in text  # before: said it was a graph input


def test_the_tensor_form_the_warning_gives_compiles_once_and_matches_eager() -> None:
    worst, programs = _compared(lambda m: _SqrtLR(m.parameters(), python=False), 4, scheduled=True)
    assert programs == 1 and worst < 1e-12


class _AttributeCount(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-2) -> None:
        super().__init__(params, dict(lr=lr))
        self.t = 0

    @torch.no_grad()
    def step(self) -> None:
        self.t += 1
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(p.grad, alpha=-group["lr"] / self.t)


def test_a_counter_kept_on_the_optimizer_names_its_line_and_the_state() -> None:
    opt, text = _refusal(_AttributeCount)
    assert 'self.t += 1"' in text, text  # the write, not the train step's line
    assert "keep the counter in the optimizer's per-parameter state as a tensor" in text
    assert "register_buffer" not in text
    assert opt.t == 0


class _ScheduleFree(torch.optim.Optimizer):
    """Schedule-free AdamW's counters (simplified), kept as Python numbers in its groups
    or, with ``tensors``, as 0-dim float64 tensors in its first parameter's state."""

    def __init__(self, params, lr: float = 1e-2, tensors: bool = False) -> None:
        super().__init__(params, dict(lr=lr, betas=(0.9, 0.999), eps=1e-8, k=0, weight_sum=0.0, lr_max=-1.0))
        self.tensors = tensors

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            b1, b2 = group["betas"]
            lr = group["lr"]
            if self.tensors:
                s0 = self.state[group["params"][0]]
                if "k" not in s0:
                    s0["k"] = torch.zeros((), dtype=torch.float64)
                    s0["weight_sum"] = torch.zeros((), dtype=torch.float64)
                    s0["lr_max"] = torch.full((), -1.0, dtype=torch.float64)
                weight = s0["lr_max"].clamp_(min=lr) ** 2
                ckp1 = weight / s0["weight_sum"].add_(weight)
                bias_correction = 1 - b2 ** (s0["k"] + 1)
                s0["k"].add_(1)
            else:
                lr_max = group["lr_max"] = max(lr, group["lr_max"])
                weight = lr_max**2
                weight_sum = group["weight_sum"] = group["weight_sum"] + weight
                ckp1 = weight / weight_sum
                bias_correction = 1 - b2 ** (group["k"] + 1)
                group["k"] = group["k"] + 1
            for p in group["params"]:
                state = self.state[p]
                if "z" not in state:
                    state["z"] = torch.clone(p)
                    state["v"] = torch.zeros_like(p)
                z, v = state["z"], state["v"]
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                update = p.grad / (v / bias_correction).sqrt().add_(group["eps"])
                p.lerp_(z, ckp1)
                p.add_(update * (lr * (b1 * (1 - ckp1) - 1)))
                z.sub_(update, alpha=lr)


def test_counters_in_the_groups_of_a_custom_optimizer_are_told_to_go_in_its_state() -> None:
    _, text = _refusal(_ScheduleFree)
    assert "(and in 'lr_max', 'weight_sum')" in text, text
    assert "keep 'k', 'lr_max', 'weight_sum' in _ScheduleFree's state as tensors instead" in text
    assert "torch.optim's Adam, AdamW" not in text  # before: use another optimizer


def test_the_state_form_the_refusal_gives_matches_eager() -> None:
    worst, programs = _compared(lambda m: _ScheduleFree(m.parameters(), tensors=True), 3)
    assert programs <= 2 and worst < 1e-12  # the first call's, which makes the state, and one


def test_transformers_adafactor_is_told_of_torch_optim_adafactor() -> None:
    transformers = pytest.importorskip("transformers.optimization")
    _, text = _refusal(lambda params: transformers.Adafactor(
        params, lr=1e-2, relative_step=False, scale_parameter=False))
    assert "torch.optim.Adafactor keeps its step count in a tensor and compiles" in text, text
    assert "scale_parameter=False (Trainer(optim='adafactor'))" in text


def test_torch_optim_adafactor_compiled_on_two_ranks_matches_eager() -> None:
    worst, _ = _compared(lambda m: torch.optim.Adafactor(m.parameters(), lr=1e-2), 3)
    assert worst < 1e-12
