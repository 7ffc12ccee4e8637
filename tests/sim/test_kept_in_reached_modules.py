"""Tensors a step keeps in an nn.Module that is not one of the step's modules (NOTE:
[modules the step reaches beside its own] in ``capture/kept_tensors.py``).

A metric or loss module with a cache (no parameters, so not taken as the step's state)
reached through a closure variable, a global, a bound method's ``self``, a
``functools.partial`` argument, a plain global object or a global list: the value the
step stores there (a dict entry, an attribute, a buffer, an append) is compared after
every call with what the undecorated step stores on one device on the global batch
(float64, within 1e-12). Before, the walk stopped at any nn.Module: after every call the
place held the capture's ``FakeTensor`` (reading it raised
DataDependentOutputException), with no error.
"""

from __future__ import annotations

import functools
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.errors import SPMDCompileError
from spmd_compiler.parallel_modes import make_mode
from tests.sim.test_kept_tensors import CLASSES, FEATURES, TOL, _batches  # the same batches


class Meter(nn.Module):
    """A metric module with a cache: no parameters, so not the step's state."""

    def __init__(self) -> None:
        super().__init__()
        self.last: dict = {}
        self.history: list = []
        self.prev = None
        self.inner = _Inner()


class _BufferMeter(Meter):
    """A meter holding a buffer (state, but reached through a plain object: not taken)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("norm", torch.zeros((), dtype=torch.float64))


class _Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cache: dict = {}


def _keep(meter: Meter, logits: torch.Tensor, loss: torch.Tensor) -> None:
    meter.last["logits"] = logits.detach()
    meter.prev = logits.detach().sum(0)
    meter.history.append(loss.detach())
    meter.inner.cache["loss"] = loss.detach()


def _read(meter: Meter) -> list:
    return [meter.last["logits"], meter.prev, meter.history[-1], meter.inner.cache["loss"], len(meter.history)]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, CLASSES)).double()


def _update(model, optim, x, y):  # noqa: ANN001, ANN202
    logits = model(x)
    loss = F.cross_entropy(logits, y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return logits, loss


def _closure_step(meter: Meter):  # noqa: ANN202
    def train_step(model, optim, x, y):  # noqa: ANN001, ANN202
        logits, loss = _update(model, optim, x, y)
        _keep(meter, logits, loss)
        return loss.detach()
    return train_step


METER = Meter()
HOLDER = types.SimpleNamespace(meter=Meter())
METERS = [Meter()]


def _global_step(model, optim, x, y):  # noqa: ANN001, ANN202
    logits, loss = _update(model, optim, x, y)
    _keep(METER, logits, loss)
    return loss.detach()


def _held_step(model, optim, x, y):  # noqa: ANN001, ANN202
    logits, loss = _update(model, optim, x, y)
    _keep(HOLDER.meter, logits, loss)
    return loss.detach()


def _listed_step(model, optim, x, y):  # noqa: ANN001, ANN202
    logits, loss = _update(model, optim, x, y)
    _keep(METERS[0], logits, loss)
    return loss.detach()


def _partial_step(meter, model, optim, x, y):  # noqa: ANN001, ANN202
    logits, loss = _update(model, optim, x, y)
    _keep(meter, logits, loss)
    return loss.detach()


class _Trainer(nn.Module):
    """A trainer module holding no state, whose method is the step."""

    def __init__(self) -> None:
        super().__init__()
        self.meter = Meter()

    def step(self, model, optim, x, y):  # noqa: ANN001, ANN201
        logits, loss = _update(model, optim, x, y)
        _keep(self.meter, logits, loss)
        return loss.detach()


def _place(where: str):  # noqa: ANN202
    """A fresh meter, the step keeping into it, and a way to read the meter."""
    global METER
    if where == "closure":
        meter = Meter()
        return _closure_step(meter), lambda: meter
    if where == "global":
        METER = Meter()
        return _global_step, lambda: METER
    if where == "plain_object":
        HOLDER.meter = Meter()
        return _held_step, lambda: HOLDER.meter
    if where == "global_list":
        METERS[:] = [Meter()]
        return _listed_step, lambda: METERS[0]
    if where == "partial":
        meter = Meter()
        return functools.partial(_partial_step, meter), lambda: meter
    trainer = _Trainer()
    return trainer.step, lambda: trainer.meter


def _same(a, b) -> bool:  # noqa: ANN001
    if isinstance(b, torch.Tensor):
        assert type(a) is torch.Tensor, f"a {type(a).__name__}, not a plain tensor"
        return a.shape == b.shape and torch.allclose(a, b, rtol=TOL, atol=TOL)
    return a == b


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.parametrize("where", ["closure", "global", "plain_object", "global_list", "partial", "bound_method"])
def test_a_module_reached_beside_the_steps_keeps_each_calls_value(where, mode):
    """Before: every kept place held a FakeTensor after each compiled call."""
    seen = {}
    for compiled in (False, True):
        model = _model()
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        fn, meter = _place(where)
        step = sc.compile(make_mode(mode))(fn) if compiled else fn
        values = []
        with sc.simulate(world_size=2):
            for x, y in _batches():
                values.append([step(model, optim, x, y), *_read(meter())])
        seen[compiled] = values
    for got, expected in zip(seen[True], seen[False], strict=True):
        assert all(_same(a, b) for a, b in zip(got, expected, strict=True))


def _buffer_step(model, optim, x, y):  # noqa: ANN001, ANN202
    logits, loss = _update(model, optim, x, y)
    HOLDER.meter.norm = logits.detach().norm()  # a registered buffer: lands in _buffers
    return loss.detach()


def test_a_buffer_set_on_a_module_reached_beside_the_steps_keeps_each_calls_value():
    seen = {}
    for compiled in (False, True):
        model = _model()
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        HOLDER.meter = _BufferMeter()
        step = sc.compile(make_mode("ddp"))(_buffer_step) if compiled else _buffer_step
        with sc.simulate(world_size=2):
            seen[compiled] = [(step(model, optim, x, y), HOLDER.meter.norm) for x, y in _batches()]
    for (loss, norm), (ref_loss, ref_norm) in zip(seen[True], seen[False], strict=True):
        assert _same(loss, ref_loss) and _same(norm, ref_norm)


def _nesting_step(meter: Meter):  # noqa: ANN202
    def train_step(model, optim, x, y):  # noqa: ANN001, ANN202
        logits, loss = _update(model, optim, x, y)
        meter.last["nested"] = {"outer": {"logits": logits.detach()}}
        return loss.detach()
    return train_step


def test_a_nested_container_kept_in_a_reached_module_is_refused_and_left_clean():
    """A container of containers of traced tensors cannot be remade every call: refused,
    naming the place, and the meter keeps no fake tensor. Before, the capture left the
    dict holding a FakeTensor, silently."""
    model = _model()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    meter = Meter()
    step = sc.compile(make_mode("ddp"))(_nesting_step(meter))
    x, y = _batches(1)[0]
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError, match=r"closure value 'meter'.*\.last\['nested'\]"):
        step(model, optim, x, y)
    assert meter.last == {}


def _deep_step(log):  # noqa: ANN001, ANN202
    def train_step(model, optim, x, y):  # noqa: ANN001, ANN202
        logits, loss = _update(model, optim, x, y)
        log.a.b.c["loss"] = loss.detach()  # below the walk's depth (NOTE: [no fake tensor left behind])
        return loss.detach()
    return train_step


def test_a_tensor_kept_below_the_walks_depth_is_refused_and_taken_out():
    """Before: the unwalked dict held the capture's FakeTensor after every call, silently."""
    model = _model()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    log = types.SimpleNamespace(a=types.SimpleNamespace(b=types.SimpleNamespace(c={"old": 1.0})))
    step = sc.compile(make_mode("ddp"))(_deep_step(log))
    x, y = _batches(1)[0]
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError, match=r"closure value 'log'.*\.a\.b\.c.*deeper"):
        step(model, optim, x, y)
    assert log.a.b.c == {"old": 1.0}
