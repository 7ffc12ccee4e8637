"""Units of NOTE: [optimizers over tensors made in the call] and NOTE: [deep copies of the
step's parameters]: which optimizers count as made in the call, the foreach / fused flags
set for their step and put back after it, and a stand-in parameter deep-copied as
``Parameter.__deepcopy__`` copies."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

from spmd_compiler.capture.call_optimizers import OptimizerNotPassed, OtherOptimizers
from spmd_compiler.capture.parameter_copies import parameters_copied_as_eager


def _code() -> None:
    """Stands for the step function: no frame of it runs here."""


def test_an_optimizer_over_new_fake_tensors_steps_with_its_flags_put_back():
    with FakeTensorMode():
        stand_in = torch.zeros(3, dtype=torch.float64)
        made = torch.zeros(3, dtype=torch.float64, requires_grad=True)
        made.grad = torch.ones(3, dtype=torch.float64)
        inner = torch.optim.SGD([made], lr=0.1, momentum=0.5, foreach=True)
        seen: list[object] = []
        inner.register_step_pre_hook(lambda o, a, k: seen.append(o.param_groups[0]["foreach"]))
        with OtherOptimizers([], [stand_in], _code.__code__) as others:
            assert others.made_in_the_call(inner)
            inner.step()
        assert seen == [False]  # the single-tensor path while it stepped
        assert inner.param_groups[0]["foreach"] is True  # as the user made it
        assert len(others.traced) == 1
        assert "momentum_buffer" in inner.state[made]


def test_an_optimizer_over_a_stand_in_or_its_memory_is_refused():
    with FakeTensorMode():
        stand_in = torch.zeros(3, dtype=torch.float64)
        alias = stand_in.detach().requires_grad_()
        alias.grad = torch.ones(3, dtype=torch.float64)
        opt = torch.optim.SGD([alias], lr=0.1)
        with OtherOptimizers([], [stand_in], _code.__code__), pytest.raises(OptimizerNotPassed) as info:
            opt.step()
    assert info.value.holds_stand_ins


def test_an_optimizer_over_real_tensors_is_refused():
    p = torch.zeros(3, requires_grad=True)
    p.grad = torch.ones(3)
    opt = torch.optim.SGD([p], lr=0.1)
    with OtherOptimizers([], [], _code.__code__), pytest.raises(OptimizerNotPassed) as info:
        opt.step()
    assert not info.value.holds_stand_ins
    assert torch.equal(p, torch.zeros(3))


def test_a_given_optimizer_is_left_alone():
    p = torch.zeros(3, requires_grad=True)
    p.grad = torch.ones(3)
    opt = torch.optim.SGD([p], lr=0.1)
    with OtherOptimizers([opt], [], _code.__code__) as others:
        opt.step()
    assert others.traced == []
    assert torch.allclose(p, torch.full((3,), -0.1))


def test_a_stand_in_is_deep_copied_as_its_parameter():
    model = nn.Linear(2, 2)
    stand_in = model.weight.detach().clone().requires_grad_()
    stand_in.grad = torch.ones(2, 2)
    stand_in.no_decay = True
    swapped = nn.Linear(2, 2)
    swapped._parameters["weight"] = stand_in
    with parameters_copied_as_eager({"weight": model.weight}, {"weight": stand_in}):
        clone = copy.deepcopy(swapped)
    copied = clone._parameters["weight"]
    assert isinstance(copied, nn.Parameter) and copied.requires_grad
    assert copied.grad is None and not hasattr(copied, "no_decay")
    assert torch.equal(copied, stand_in)
    # the bias is no stand-in here: copied as before
    assert torch.equal(clone.bias, swapped.bias)
    with parameters_copied_as_eager({}, {}):
        assert copy.deepcopy(stand_in).grad is not None  # nothing to copy otherwise
