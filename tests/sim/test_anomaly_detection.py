"""Autograd's anomaly detection around a compiled step (NOTE: [anomaly detection at
capture]).

Its NaN check reads the value of every gradient backward computes, which one captured
graph cannot do: a step compiled or called with it on (``set_detect_anomaly(True)``, or
``detect_anomaly()`` inside the step) is refused with a message naming it, the model and
optimizer untouched; before 2026-12-06 it was refused as "reads the value of a tensor in
Python" at the backward line. A program compiled with it off is refused too when a later
call switches it on (it would run without the check); one without a backward (an
evaluation step) is not. With it off again, and with ``check_nan=False`` (which reads
no values), the step compiles and matches the undecorated step on one device on the
global batch (float64, 2 simulated ranks).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.errors import SPMDCompileError
from spmd_compiler.parallel_modes import make_mode
from spmd_compiler.tools.parity import compare_models, compare_optimizers

TOL = 1e-10


def train_step(model, optim, x, y):  # noqa: ANN001
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


def anomaly_inside_step(model, optim, x, y):  # noqa: ANN001
    with torch.autograd.detect_anomaly():
        loss = F.cross_entropy(model(x), y)
        loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


@pytest.fixture(autouse=True)
def _anomaly_restored() -> Iterator[None]:
    before = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
    try:
        yield
    finally:
        torch.autograd.set_detect_anomaly(*before)


def _setup():  # noqa: ANN202
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).double()
    reference = copy.deepcopy(model)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    reference_optim = torch.optim.Adam(reference.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 8, generator=gen, dtype=torch.float64),
                torch.randint(0, 4, (8,), generator=gen)) for _ in range(3)]
    return model, reference, optim, reference_optim, batches


def _assert_refused(error: pytest.ExceptionInfo, line: str) -> None:
    text = str(error.value)
    assert "anomaly detection" in text and "set_detect_anomaly(False)" in text, text
    assert line in text, text


def _assert_untouched(model: nn.Module, reference: nn.Module, optim: torch.optim.Optimizer) -> None:
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert type(p) is nn.Parameter and torch.equal(p, q) and p.grad is None, name
    assert not optim.state


def _train_and_compare(step, model, reference, optim, reference_optim, batches, sim) -> None:  # noqa: ANN001
    for x, y in batches:
        loss = step(model, optim, x, y)
        with torch.autograd.set_detect_anomaly(False):
            expected = train_step(reference, reference_optim, x, y)
        assert abs(float(loss) - float(expected)) < TOL
    state = {**compare_models(model, reference, sim), **compare_optimizers(optim, reference_optim, sim)}
    assert max(state.values()) < TOL, state


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_set_detect_anomaly_refused_then_compiles_when_off(mode):
    model, reference, optim, reference_optim, batches = _setup()
    step = sc.compile(make_mode(mode))(train_step)
    with sc.simulate(world_size=2) as sim:
        torch.autograd.set_detect_anomaly(True)
        with pytest.raises(SPMDCompileError) as error:
            step(model, optim, *batches[0])
        _assert_refused(error, '"loss.backward()"')
        _assert_untouched(model, reference, optim)
        torch.autograd.set_detect_anomaly(False)
        _train_and_compare(step, model, reference, optim, reference_optim, batches, sim)


def test_detect_anomaly_inside_the_step_refused_at_its_backward():
    model, reference, optim, _, batches = _setup()
    step = sc.compile(make_mode("ddp"))(anomaly_inside_step)
    with sc.simulate(world_size=2):
        with pytest.raises(SPMDCompileError) as error:
            step(model, optim, *batches[0])
    _assert_refused(error, '"loss.backward()"')
    _assert_untouched(model, reference, optim)


def evaluate(model, x, y):  # noqa: ANN001
    with torch.no_grad():
        return F.cross_entropy(model(x), y)


def test_a_compiled_program_refused_when_anomaly_detection_is_switched_on():
    model, reference, optim, reference_optim, batches = _setup()
    step = sc.compile(make_mode("ddp"))(train_step)
    compiled_evaluate = sc.compile(make_mode("ddp"))(evaluate)
    with sc.simulate(world_size=2) as sim:
        _train_and_compare(step, model, reference, optim, reference_optim, batches[:1], sim)
        compiled_evaluate(model, *batches[0])
        torch.autograd.set_detect_anomaly(True)
        with pytest.raises(SPMDCompileError) as error:
            step(model, optim, *batches[1])
        _assert_refused(error, "step(model, optim, *batches[1])")
        # no backward: nothing for the check to read
        loss = compiled_evaluate(model, *batches[1])
        assert abs(float(loss) - float(evaluate(reference, *batches[1]))) < TOL
        torch.autograd.set_detect_anomaly(False)
        _train_and_compare(step, model, reference, optim, reference_optim, batches[1:], sim)
    assert step.compile_count == 1 and compiled_evaluate.compile_count == 1


def autograd_backward_step(model, optim, x, y):  # noqa: ANN001
    loss = F.cross_entropy(model(x), y)
    torch.autograd.backward(loss)
    optim.step()
    optim.zero_grad()
    return loss.detach()


def autograd_grad_step(model, optim, x, y):  # noqa: ANN001
    loss = F.cross_entropy(model(x), y)
    params = list(model.parameters())
    for p, g in zip(params, torch.autograd.grad(loss, params), strict=True):
        p.grad = g
    optim.step()
    optim.zero_grad()
    return loss.detach()


@pytest.mark.parametrize("step_fn", [autograd_backward_step, autograd_grad_step])
def test_a_program_whose_backward_is_not_tensor_backward_is_refused_when_switched_on(step_fn):
    """A backward traced by ``torch.autograd.backward`` / ``grad`` (a gradient penalty's,
    a SAM step's) carries no ``Phase.BACKWARD``: a call made with the check on ran the
    program without it (the first review), where ``loss.backward()``'s was refused."""
    model, reference, optim, reference_optim, batches = _setup()
    step = sc.compile(make_mode("ddp"))(step_fn)
    with sc.simulate(world_size=2) as sim:
        _train_and_compare(step, model, reference, optim, reference_optim, batches[:1], sim)
        torch.autograd.set_detect_anomaly(True)
        with pytest.raises(SPMDCompileError) as error:
            step(model, optim, *batches[1])
        _assert_refused(error, "step(model, optim, *batches[1])")
        torch.autograd.set_detect_anomaly(False)
        _train_and_compare(step, model, reference, optim, reference_optim, batches[1:], sim)
    assert step.compile_count == 1


def test_anomaly_detection_without_its_nan_check_compiles():
    model, reference, optim, reference_optim, batches = _setup()
    step = sc.compile(make_mode("ddp"))(train_step)
    torch.autograd.set_detect_anomaly(True, check_nan=False)
    with sc.simulate(world_size=2) as sim:
        _train_and_compare(step, model, reference, optim, reference_optim, batches, sim)
