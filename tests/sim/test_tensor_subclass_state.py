"""A buffer that is a plain subclass of torch.Tensor of the user's (``__torch_function__``
only, as ``t.as_subclass(Tagged)`` makes; NOTE: [plain tensor subclasses simulated]).

Before 2026-12-06 simulated ranks crashed placing it (``Multiple dispatch failed for
'aten.detach.default'`` from LocalTensorMode), where 2 real gloo ranks train as eager
and keep the subclass in the placed DTensor's local tensor. Simulated ranks now do the
same: float64 under ddp and fsdp within 1e-10 of the undecorated step on one device on
the global batch, and the buffer's full value is still the user's class. Such a class as
a parameter, and as the batch (which crashed simulated ranks alike before 2026-12-06),
trains as eager too.

A class that defines ``__torch_function__`` or ``__torch_dispatch__`` is refused, as a
parameter, buffer or argument, naming the place and the class, the model and optimizer
untouched (NOTE: [tensor subclasses that override torch]): the program computes it as a
plain tensor. Before 2026-12-06 a ``__torch_function__`` doubling ``F.linear`` on a
weight or the batch was dropped silently (the plain model's losses), a pass-through one
on the batch crashed in LocalTensorMode, and a ``__torch_dispatch__`` wrapper parameter
compiled and then failed ("invalid python storage").
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._pytree import tree_map

import spmd_compiler as sc
from spmd_compiler import SPMDCompileError
from spmd_compiler.parallel_modes import make_mode
from spmd_compiler.tools.demo.steps import classification_train_step as train_step
from spmd_compiler.tools.parity import compare_models, compare_optimizers

TOL = 1e-10


class Tagged(torch.Tensor):
    pass


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 4)
        self.register_buffer("mask", (torch.arange(4.0) + 1).as_subclass(Tagged))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.mask


def _model() -> nn.Module:
    torch.manual_seed(0)  # a Tensor subclass without new_empty() cannot be deep-copied
    return Masked().double()


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_a_plain_tensor_subclass_buffer_trains_as_eager(mode):
    model, reference = _model(), _model()
    assert type(model.mask) is Tagged
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    reference_optim = torch.optim.Adam(reference.parameters(), lr=1e-2)
    step = sc.compile(make_mode(mode))(train_step)
    gen = torch.Generator().manual_seed(1)
    with sc.simulate(world_size=2) as sim:
        for _ in range(3):
            x = torch.randn(8, 16, generator=gen, dtype=torch.float64)
            y = torch.randint(0, 4, (8,), generator=gen)
            loss, expected = step(model, optim, x, y), train_step(reference, reference_optim, x, y)
            assert abs(float(loss) - float(expected)) < TOL
        state = {**compare_models(model, reference, sim), **compare_optimizers(optim, reference_optim, sim)}
        mask = sim.full_tensor(model.mask)
    assert max(state.values()) < TOL, state
    assert type(mask) is Tagged and torch.equal(mask.as_subclass(torch.Tensor), torch.arange(4.0).double() + 1)


class Scaled(torch.Tensor):
    """Doubles F.linear's result: eager computes otherwise than a plain tensor."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        return out * 2 if func is F.linear else out


class PassThrough(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


class Logged(torch.Tensor):
    """A __torch_dispatch__ wrapper subclass."""

    @staticmethod
    def __new__(cls, elem):
        return torch.Tensor._make_wrapper_subclass(
            cls, elem.shape, dtype=elem.dtype, requires_grad=elem.requires_grad
        )

    def __init__(self, elem):
        self.elem = elem

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def unwrap(t):
            return t.elem if isinstance(t, Logged) else t

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        return tree_map(lambda t: Logged(t) if isinstance(t, torch.Tensor) else t, out)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4)).double()


def _batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(8, 16, generator=gen, dtype=torch.float64), torch.randint(0, 4, (8,), generator=gen)


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.elem if isinstance(t, Logged) else t.detach().as_subclass(torch.Tensor)


def _refused(model, optim, x, y, mode) -> str:
    before = {n: (type(p), _plain(p).clone()) for n, p in model.named_parameters()}
    buffers = {n: type(b) for n, b in model.named_buffers()}
    step = sc.compile(make_mode(mode))(train_step)
    with sc.simulate(world_size=2):
        with pytest.raises(SPMDCompileError) as info:
            step(model, optim, x, y)
    after = {n: (type(p), _plain(p)) for n, p in model.named_parameters()}
    assert {n: t for n, (t, _) in after.items()} == {n: t for n, (t, _) in before.items()}
    assert all(torch.equal(after[n][1], v) for n, (_, v) in before.items())
    assert {n: type(b) for n, b in model.named_buffers()} == buffers
    assert not optim.state and all(p.grad is None for p in model.parameters())
    return str(info.value)


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_a_parameter_whose_class_overrides_torch_function_is_refused(mode):
    model = _mlp()
    model[0].weight = nn.Parameter(model[0].weight.detach().as_subclass(Scaled))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    message = _refused(model, optim, *_batch(torch.Generator().manual_seed(1)), mode)
    assert "parameter 0.weight is a Scaled" in message and "__torch_function__" in message
    assert "as_subclass(torch.Tensor)" in message


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_a_wrapper_parameter_whose_class_overrides_torch_dispatch_is_refused(mode):
    model = _mlp()
    model[2].weight = nn.Parameter(Logged(model[2].weight.detach()))
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    message = _refused(model, optim, *_batch(torch.Generator().manual_seed(1)), mode)
    assert "parameter 2.weight is a Logged" in message and "__torch_dispatch__" in message


def test_a_buffer_whose_class_overrides_torch_function_is_refused():
    model = Masked().double()
    model.mask = model.mask.as_subclass(PassThrough)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    message = _refused(model, optim, *_batch(torch.Generator().manual_seed(1)), "fsdp")
    assert "buffer mask is a PassThrough" in message


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.parametrize("cls", [Scaled, PassThrough])
def test_a_batch_whose_class_overrides_torch_function_is_refused(mode, cls):
    model = _mlp()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _batch(torch.Generator().manual_seed(1))
    message = _refused(model, optim, x.as_subclass(cls), y, mode)
    assert f"argument x of the step is a {cls.__name__}" in message


def test_a_masked_tensor_batch_is_refused():
    """torch's own user-level subclasses count as the user's (it failed after its
    compile with "invalid python storage" before)."""
    model = _mlp()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _batch(torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.masked's prototype warning
        x = torch.masked.masked_tensor(x, x > 0)
    assert "argument x of the step is a MaskedTensor" in _refused(model, optim, x, y, "ddp")


def test_a_batch_whose_class_overrides_torch_function_is_refused_after_a_plain_call():
    """The program compiled for a plain batch of the same shape does not serve it."""
    model = _mlp()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    step = sc.compile(make_mode("ddp"))(train_step)
    gen = torch.Generator().manual_seed(1)
    with sc.simulate(world_size=2):
        step(model, optim, *_batch(gen))
        x, y = _batch(gen)
        with pytest.raises(SPMDCompileError, match="argument x of the step is a Scaled"):
            step(model, optim, x.as_subclass(Scaled), y)


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_a_plain_tensor_subclass_parameter_and_batch_train_as_eager(mode):
    def subclassed() -> nn.Module:
        model = _mlp()
        model[0].weight = nn.Parameter(model[0].weight.detach().as_subclass(Tagged))
        return model

    model, reference = subclassed(), subclassed()
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    reference_optim = torch.optim.Adam(reference.parameters(), lr=1e-2)
    step = sc.compile(make_mode(mode))(train_step)
    gen = torch.Generator().manual_seed(1)
    with sc.simulate(world_size=2) as sim:
        for _ in range(3):
            x, y = _batch(gen)
            x = x.as_subclass(Tagged)
            loss, expected = step(model, optim, x, y), train_step(reference, reference_optim, x, y)
            assert abs(float(loss) - float(expected)) < TOL
        state = {**compare_models(model, reference, sim), **compare_optimizers(optim, reference_optim, sim)}
        weight = sim.full_tensor(model[0].weight)
    assert max(state.values()) < TOL, state
    assert type(weight) is Tagged
