"""Optimizer group values a step reads and returns come back as eager's Python numbers
(NOTE: [optimizer settings read in the step] in ``spmd_compiler/capture/python_scalars.py``).

The learning rate (and Adam's first beta) is a float64 0-dim graph input while the step
is traced: ``{"loss": loss.item(), "lr": opt.param_groups[0]["lr"]}`` came back as
``{'loss': 1.4085, 'lr': tensor(0.0010)}`` where eager returns ``0.001``, and
``json.dumps`` of the metrics failed; ``(t * lr).item()`` of a float32 ``t`` was computed
in float64 (eager: float32), 3e-11 off. Each case below failed before.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.errors import SPMDCompileError
from spmd_compiler.parallel_modes import DataParallel

MODES = ["replicate", "fully_shard"]


def _run(mode, use, make_opt=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), calls=3):
    torch.manual_seed(0)
    model = nn.Linear(8, 4).double()
    ref = copy.deepcopy(model)
    opt, ref_opt = make_opt(model), make_opt(ref)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, 1, 0.5)

    def step(model, opt, x, y, scale):
        loss = F.cross_entropy(model(x), y) * scale
        loss.backward()
        opt.step()
        opt.zero_grad()
        return {"loss": loss.item(), "value": use(opt, loss, scale)}

    compiled = sc.compile(parallel_mode=DataParallel(mode))(step)
    x, y = torch.randn(8, 8, dtype=torch.float64), torch.randint(0, 4, (8,))
    pairs = []
    with sc.simulate(world_size=2):
        for i in range(calls):
            got = compiled(model, opt, x, y, 1.0 + i)
            want = step(ref, ref_opt, x, y, 1.0 + i)
            sched.step()
            ref_sched.step()
            pairs.append((got, want))
    return pairs, compiled


def _assert_eagers(pairs):
    for got, want in pairs:
        assert type(got["value"]) is type(want["value"]), (got, want)
        assert got["value"] == want["value"]
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-12)
        json.dumps(got)


def _lr(opt, loss, scale):
    return opt.param_groups[0]["lr"]


@pytest.mark.parametrize("mode", MODES)
def test_returned_learning_rate_is_eagers_float(mode):
    """The probe's metrics dict: ``lr`` a float (0.001, 0.0005, 0.00025 with the
    schedule), one program."""
    pairs, compiled = _run(mode, _lr)
    _assert_eagers(pairs)
    assert [got["value"] for got, _ in pairs] == [1e-3, 5e-4, 2.5e-4]
    assert compiled.compile_count == 1


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "use",
    [
        lambda opt, loss, s: opt.param_groups[0]["lr"] * 2,
        lambda opt, loss, s: 1 - opt.param_groups[0]["lr"],
        lambda opt, loss, s: -opt.param_groups[0]["lr"] / 3,
        lambda opt, loss, s: opt.param_groups[0]["lr"] > 4e-4,
        lambda opt, loss, s: (torch.full((), 1 / 3, dtype=torch.float32) * opt.param_groups[0]["lr"]).item(),
        lambda opt, loss, s: opt.param_groups[0]["betas"],
        lambda opt, loss, s: [g["lr"] for g in opt.param_groups],
    ],
    ids=["times_2", "one_minus", "negated_over_3", "compared", "float32_times_lr", "betas", "all_groups"],
)
def test_numbers_computed_from_the_learning_rate(mode, use):
    """Python arithmetic and comparisons on the group values give eager's numbers, and a
    tensor op with one computes in eager's dtype."""
    pairs, _ = _run(mode, use)
    _assert_eagers(pairs)


@pytest.mark.parametrize("mode", MODES)
def test_int_learning_rate_returned_as_int(mode):
    pairs, _ = _run(mode, _lr, make_opt=lambda m: torch.optim.SGD(m.parameters(), lr=1), calls=1)
    _assert_eagers(pairs)


@pytest.mark.parametrize("mode", MODES)
def test_float_argument_returned_as_itself(mode):
    """A float argument returned as it is comes back from the program as the number:
    one program for every value (before: a guarded constant, a program per value)."""
    pairs, compiled = _run(mode, lambda opt, loss, scale: scale)
    _assert_eagers(pairs)
    assert compiled.compile_count == 1


@pytest.mark.parametrize(
    "use", [lambda opt, loss, s: opt.param_groups[0]["lr"] ** 0.5,
            lambda opt, loss, s: torch.log(opt.param_groups[0]["lr"])], ids=["pow", "log"])
def test_other_numbers_from_the_learning_rate_refused(use):
    """A number Python might not compute alike is refused, naming the group value."""
    with pytest.raises(SPMDCompileError, match=r"optimizer\[0\]\.param_groups\[0\]\['lr'\]"):
        _run("replicate", use, calls=1)


# NOTE: [tensors made of optimizer settings]: Lightning's ``self.log("lr", lr)`` stores
# ``torch.tensor(lr)``; before the sixty-fourth session the step was refused as returning
# "a number computed from optimizer[0].param_groups[0]['lr'] by `tensor`".
MADE = {
    "tensor": lambda lr: torch.tensor(lr),
    "as_tensor": lambda lr: torch.as_tensor(lr),
    "tensor_float64": lambda lr: torch.tensor(lr, dtype=torch.float64),
    "tensor_of_lr_over_3": lambda lr: torch.tensor(lr / 3),
    "tensor_of_a_comparison": lambda lr: torch.tensor(lr > 4e-4),
}


def _logging_step(make):
    def step(model, opt, sched, x, y, logged):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        logged["lr"] = make(opt.param_groups[0]["lr"])
        sched.step()  # the schedule stepped in the step (NOTE: [schedulers stepped in the step])
        return loss.detach()

    return step


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("made", list(MADE))
def test_tensor_made_of_the_learning_rate_is_eagers(mode, made):
    """The logged tensor is eager's (dtype, device, value) at every call of a schedule
    stepped in the step (1e-3, 5e-4, 2.5e-4, 1.25e-4: float32 by default), one program."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4).double()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, 1, 0.5)
    step = _logging_step(MADE[made])
    compiled = sc.compile(parallel_mode=DataParallel(mode))(step)
    x, y = torch.randn(8, 8, dtype=torch.float64), torch.randint(0, 4, (8,))
    seen = []
    with sc.simulate(world_size=2):
        for _ in range(4):
            logged, ref_logged = {}, {}
            compiled(model, opt, sched, x, y, logged)
            step(ref, ref_opt, ref_sched, x, y, ref_logged)
            got, want = logged["lr"], ref_logged["lr"]
            assert type(got) is torch.Tensor
            assert (got.dtype, got.device, got.shape, got.requires_grad) == (
                want.dtype, want.device, want.shape, want.requires_grad)
            assert torch.equal(got, want), (got, want)
            seen.append(want)
    assert compiled.compile_count == 1
    if made == "tensor":
        assert [t.item() for t in seen] == [torch.tensor(v).item() for v in (1e-3, 5e-4, 2.5e-4, 1.25e-4)]
        assert seen[0].dtype == torch.float32


@pytest.mark.parametrize(
    "read", [float, lambda lr: f"{lr:.3f}"], ids=["float", "format"])
def test_learning_rate_read_in_python_refused_as_a_python_number(read, recwarn):
    """``float(lr)`` is refused saying what lr is (before: "reads the value of a tensor
    in Python ... write t.item()", with torch's warning on converting a tensor that
    requires grad); the message names the group value and the user's line."""
    with pytest.raises(SPMDCompileError) as caught:
        _run("replicate", lambda opt, loss, s: read(opt.param_groups[0]["lr"]), calls=1)
    message = str(caught.value)
    assert "optimizer[0].param_groups[0]['lr'] in Python" in message
    assert "Python number" in message and ".item()" not in message
    assert "test_returned_group_numbers.py" in message
    assert not [w for w in recwarn if "requires_grad" in str(w.message) or "copy construct" in str(w.message)]
