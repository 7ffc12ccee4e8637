"""A float argument of the step given to a Scalar argument stays a graph input.

NOTE: [float arguments in Scalar arguments] in ``spmd_compiler/capture/python_scalars.py``:
the EMA the README shows, ``e.mul_(d).add_(p, alpha=1 - d)`` with a decay ``d`` that
changes every call (an EMA warm-up), compiled a program per call (0.9-0.98 s each where
``add_(p * (1 - d))`` took 0.17-0.21 s), and the warning blamed ``float()`` / math / an
``if``. ``alpha=`` of add / sub, ``value=`` of addcmul / addcdiv, lerp's weight and their
foreach forms now take the float as a graph input, computing eager's numbers; an op that
cannot (``full_like``) keeps it a guard, and the warning names the op and the argument.
A call eager refuses with a Python float there (NOTE: [Scalar arguments eager refuses]:
float alpha with integer tensors, lerp of mixed dtypes) keeps the float a guard, and the
step raises eager's error, as it did before the rewrite.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.parallel_modes import DataParallel
from spmd_compiler.tools.parity import compare_models

DECAYS = [0.5, 0.9, 0.95, 0.99, 0.3]


def _update(form: str, ema: nn.Module, model: nn.Module, d: float) -> None:
    es, ps = list(ema.parameters()), list(model.parameters())
    if form == "foreach_add":
        torch._foreach_mul_(es, d)
        torch._foreach_add_(es, ps, alpha=1 - d)
    elif form == "foreach_lerp":
        torch._foreach_lerp_(es, ps, 1 - d)
    else:
        for e, p in zip(es, ps, strict=True):
            if form == "add_alpha":
                e.mul_(d).add_(p, alpha=1 - d)
            elif form == "torch_add":
                e.copy_(torch.add(e * d, p, alpha=1 - d))
            elif form == "sub_alpha":
                e.sub_(e - p, alpha=1 - d)
            elif form == "addcmul":
                e.mul_(d).addcmul_(p, p, value=1 - d)
            elif form == "addcdiv":
                e.mul_(d).addcdiv_(p, p.abs() + 1, value=1 - d)
            else:
                e.lerp_(p, 1 - d)


def _ema_step(form: str):
    def step(model, ema, optim, x, y, d):  # noqa: ANN001, ANN202
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        with torch.no_grad():
            _update(form, ema, model, d)
        return loss.detach()

    return step


FORMS = ["add_alpha", "torch_add", "sub_alpha", "addcmul", "addcdiv", "lerp", "foreach_add", "foreach_lerp"]


@pytest.mark.parametrize("mode", ["replicate", "fully_shard"])
@pytest.mark.parametrize("form", FORMS)
def test_a_decay_in_a_scalar_argument_compiles_once_and_matches_eager(form, mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4)).double()
    ema = copy.deepcopy(model).requires_grad_(False)
    reference, reference_ema = copy.deepcopy(model), copy.deepcopy(ema)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    reference_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
    step = _ema_step(form)
    compiled = sc.compile(DataParallel(mode))(step)
    gen = torch.Generator().manual_seed(1)
    with sc.simulate(2) as sim:
        for d in DECAYS:
            x = torch.randn(8, 16, generator=gen, dtype=torch.float64)
            y = torch.randn(8, 4, generator=gen, dtype=torch.float64)
            got, want = compiled(model, ema, optim, x, y, d), step(reference, reference_ema, reference_optim, x, y, d)
            assert abs(got.item() - want.item()) <= 1e-12 * abs(want.item())
        assert max(compare_models(ema, reference_ema, sim).values()) < 1e-12
    assert compiled.compile_count == 1  # before: one per decay (5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("form", ["add_alpha", "addcdiv", "lerp", "foreach_add"])
def test_the_update_is_eagers_bit_for_bit(form, dtype):
    """The EMA alone, of fixed weights: eager's kernels' numbers exactly."""

    def step(model, ema, x, d):  # noqa: ANN001, ANN202
        with torch.no_grad():
            _update(form, ema, model, d)
        return model(x).sum().detach()

    torch.manual_seed(0)
    model = nn.Linear(64, 32).to(dtype).requires_grad_(False)
    ema = nn.Linear(64, 32).to(dtype).requires_grad_(False)
    reference, reference_ema = copy.deepcopy(model), copy.deepcopy(ema)
    compiled = sc.compile(DataParallel("replicate"))(step)
    with sc.simulate(2):
        for d in DECAYS:
            x = torch.randn(4, 64, dtype=dtype)
            compiled(model, ema, x, d)
            step(reference, reference_ema, x, d)
        got = sc.checkpoint.full_state_dict(ema)["model"]
    for name, want in reference_ema.state_dict().items():
        assert torch.equal(got[name], want), name
    assert compiled.compile_count == 1


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_scalar_argument_that_cannot_take_it_is_named_in_the_warning():
    """``full_like(p, d)`` reads ``d`` as a number: a program per value, correct, and
    the warning names ``full_like`` and its argument, not float() / math / an `if`."""

    def step(model, ema, x, d):  # noqa: ANN001, ANN202
        with torch.no_grad():
            for e, p in zip(ema.parameters(), model.parameters(), strict=True):
                e.add_(torch.full_like(p, d))
        return model(x).sum().detach()

    torch.manual_seed(0)
    model = nn.Linear(4, 2).double().requires_grad_(False)
    ema = copy.deepcopy(model)
    reference_ema = copy.deepcopy(ema)
    handler = _Messages()
    logger = logging.getLogger("spmd_compiler")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        compiled = sc.compile(DataParallel("replicate"))(step)
        with sc.simulate(2) as sim:
            for d in DECAYS:
                compiled(model, ema, torch.randn(2, 4, dtype=torch.float64), d)
                for e in reference_ema.parameters():
                    e.data.add_(d)
            assert max(compare_models(ema, reference_ema, sim).values()) == 0
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert compiled.compile_count == len(DECAYS)
    warnings = [r.getMessage() for r in handler.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("argument d of the step changed on 3 calls")
    assert "`full_like` as argument 2" in warnings[0]
    assert "float()" not in warnings[0]


# NOTE: [Scalar arguments eager refuses]: each of these computed a result with the float
# a graph input (alpha truncated to 0, the int tensor unchanged, 0.5s) where eager raises
EAGER_REFUSES = {
    "int_add_int": lambda w: torch.arange(6).add(torch.arange(6), alpha=w),
    "int_add_in_place_float": lambda w: torch.arange(4).add_(torch.full((4,), 2.0), alpha=w),
    "foreach_add_int_lists": lambda w: torch._foreach_add([torch.arange(4)], [torch.arange(4)], alpha=w)[0],
    "sub_float_bool": lambda w: torch.sub(torch.ones(4), torch.ones(4) > 0, alpha=w),
    "lerp_f32_f64": lambda w: torch.lerp(torch.zeros(4), torch.ones(4, dtype=torch.float64), w),
}


def _step_with(body):  # noqa: ANN001, ANN202
    def step(model, optim, x, w):  # noqa: ANN001, ANN202
        loss = model(x).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        with torch.no_grad():
            return loss.detach(), body(w)

    return step


@pytest.mark.parametrize("case", list(EAGER_REFUSES))
def test_a_call_eager_refuses_with_a_python_float_is_refused_too(case):
    body = EAGER_REFUSES[case]
    with pytest.raises(Exception) as eager:  # noqa: PT011 - whatever eager raises
        body(0.5)
    torch.manual_seed(0)
    model = nn.Linear(4, 2).double()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    before = copy.deepcopy(model.state_dict())
    compiled = sc.compile(DataParallel("replicate"))(_step_with(body))
    with sc.simulate(2), pytest.raises(type(eager.value)):
        compiled(model, optim, torch.randn(4, 4, dtype=torch.float64), 0.5)
    for name, want in before.items():  # the refused step left the model untouched
        assert torch.equal(model.state_dict()[name], want), name


EAGER_ACCEPTS = {  # mixed dtypes eager computes with a Python float: still one program, eager's numbers
    "float_add_int": lambda w: torch.ones(4).add(torch.arange(4), alpha=w),
    "float_add_bool": lambda w: torch.ones(4).add(torch.arange(4) > 1, alpha=w),
    "int_add_float": lambda w: torch.arange(4).add(torch.full((4,), 2.0), alpha=w),
    "f32_add_in_place_f64": lambda w: torch.ones(4).add_(torch.full((4,), 0.1, dtype=torch.float64), alpha=w),
    "float_addcmul_int": lambda w: torch.addcmul(torch.ones(4), torch.arange(4), torch.arange(4), value=w),
    "complex_lerp": lambda w: torch.lerp(torch.zeros(4, dtype=torch.complex64), torch.ones(4, dtype=torch.complex64), w),
}


@pytest.mark.parametrize("case", list(EAGER_ACCEPTS))
def test_mixed_dtypes_eager_accepts_keep_the_float_a_graph_input(case):
    body = EAGER_ACCEPTS[case]
    torch.manual_seed(0)
    model = nn.Linear(4, 2).double()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = sc.compile(DataParallel("replicate"))(_step_with(body))
    with sc.simulate(2):
        for d in DECAYS:
            _, got = compiled(model, optim, torch.randn(4, 4, dtype=torch.float64), d)
            assert torch.equal(got, body(d)), d
    assert compiled.compile_count == 1
