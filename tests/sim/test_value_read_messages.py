"""Capture-time refusals of values read in Python whose advice misled (sixty-seventh
session's probes): each refusal names what it refuses, and the form its hint suggests,
where it is code, compiles and matches eager. Float64 on 2 simulated ranks (ddp), against
eager on the global batch; every refused call leaves the user's objects as found.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.errors import SPMDCompileError
from spmd_compiler.parallel_modes import DataParallel

D, H, C, K, B, T = 12, 16, 8, 24, 8, 0.2


class Bank(nn.Module):
    """A MoCo-style memory bank: a queue of keys and a pointer into it."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, C))
        self.register_buffer("queue", F.normalize(torch.randn(C, K), dim=0))
        self.register_buffer("queue_ptr", torch.zeros(1, dtype=torch.long))
        self.ptr = 0


def _keys(model: Bank, opt: torch.optim.Optimizer, xq: torch.Tensor, xk: torch.Tensor):  # noqa: ANN202
    q = F.normalize(model.enc(xq), dim=1)
    with torch.no_grad():
        k = F.normalize(model.enc(xk), dim=1)
    logits = torch.cat([(q * k).sum(1, keepdim=True), q @ model.queue.clone()], 1) / T
    loss = F.cross_entropy(logits, torch.zeros(q.shape[0], dtype=torch.long))
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach(), k


def moco_int_step(model, opt, xq, xk):  # noqa: ANN001, ANN201 - MoCo's own queue write
    loss, k = _keys(model, opt, xq, xk)
    with torch.no_grad():
        ptr = int(model.queue_ptr)
        model.queue[:, ptr:ptr + k.shape[0]] = k.T
        model.queue_ptr[0] = (ptr + k.shape[0]) % K
    return loss


def moco_tensor_step(model, opt, xq, xk):  # noqa: ANN001, ANN201 - the int() hint's form
    loss, k = _keys(model, opt, xq, xk)
    with torch.no_grad():
        n = k.shape[0]
        model.queue.index_copy_(1, (model.queue_ptr + torch.arange(n)) % K, k.T.contiguous())
        model.queue_ptr.copy_((model.queue_ptr + n) % K)
    return loss


def moco_python_pointer_step(model, opt, xq, xk):  # noqa: ANN001, ANN201
    loss, k = _keys(model, opt, xq, xk)
    with torch.no_grad():
        model.queue[:, model.ptr:model.ptr + k.shape[0]] = k.T
        model.ptr = (model.ptr + k.shape[0]) % K
    return loss


def _bank() -> tuple[Bank, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Bank().double()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(1)
    return [(torch.randn(B, D, dtype=torch.float64), torch.randn(B, D, dtype=torch.float64)) for _ in range(n)]


def _refused(step, model, *args) -> str:  # noqa: ANN001
    before = {k: v.clone() for k, v in model.state_dict().items()}
    compiled = sc.compile(parallel_mode=DataParallel("replicate"))(step)
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError) as info:
        compiled(model, *args)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    return str(info.value)


def test_int_of_a_queue_pointer_leads_with_the_tensor_form():
    """``ptr = int(self.queue_ptr)``: the hint offered "keep the number as a plain Python
    value outside the step", which compiles one program per pointer value (6 for K/B =
    5 in the probe), and ``torch.roll``, which takes ints. It leads with index_copy_ at
    ``(ptr + arange(n)) % K`` (NOTE: [an index read with int()]) and says what a Python
    value costs; that form, over a wrap of the pointer, is eager's with one program."""
    model, opt = _bank()
    message = _refused(moco_int_step, model, opt, *_batches(1)[0])
    assert "int() of a tensor" in message and 'ptr = int(model.queue_ptr)' in message, message
    hint = message.split("what to do:")[1]
    assert hint.lstrip().startswith("keep the index a tensor"), hint
    assert "index_copy_(1, (ptr + torch.arange(n)) % K" in hint, hint
    assert "one program per distinct value" in hint and "torch.roll" not in hint, hint
    assert "plain Python value" not in message
    assert int(model.queue_ptr) == 0

    reference, ref_opt = copy.deepcopy((model, opt))
    compiled = sc.compile(parallel_mode=DataParallel("replicate"))(moco_tensor_step)
    with sc.simulate(world_size=2):
        for xq, xk in _batches(5):  # K / B = 3: the pointer wraps
            got = compiled(model, opt, xq, xk)
            want = moco_tensor_step(reference, ref_opt, xq, xk)
            assert abs(float(got) - float(want)) < 1e-12
        full = sc.checkpoint.full_state_dict(model, opt)["model"]
    # the second program is for the gradients the first call leaves (zero_grad() comes
    # before backward()); none for the pointer's three values
    assert compiled.compile_count == 2
    assert torch.equal(full["queue_ptr"], reference.queue_ptr) and int(reference.queue_ptr) == 5 * B % K
    assert (full["queue"] - reference.queue).abs().max() < 1e-12


def test_a_python_pointer_refusal_tells_the_calls_numbers():
    """``model.ptr = (model.ptr + bs) % K`` on an int found 0: the refusal read "module
    <root>.ptr was 8, now 16", the capture's second run, on a call that found 0 (NOTE: [a
    value changed on every run, in the user's numbers]). It says 0 to 8 on this call,
    then 8 to 16; the pointer is left 0."""
    model, opt = _bank()
    message = _refused(moco_python_pointer_step, model, opt, *_batches(1)[0])
    assert "module <root>.ptr went from 0 to 8 on this call, and from 8 to 16 when the " \
        "capture ran the step again" in message, message
    assert "was 8, now 16" not in message
    assert model.ptr == 0


class Delays(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)


def _delay_step(form: str):  # noqa: ANN202
    def step(model, opt, x):  # noqa: ANN001, ANN202 - Autoformer's delay aggregation
        h = model.lin(x)
        index = torch.topk(h.mean(0), 2)[1]
        n = h.shape[-1]
        agg = 0
        for i in range(2):
            if form == "int":
                agg = agg + torch.roll(h, -int(index[i]), -1)
            elif form == "tensor":
                agg = agg + torch.roll(h, -index[i], -1)
            else:  # the refusal's gather form, shift s = -index[i]
                agg = agg + h.index_select(-1, (torch.arange(n) + index[i]) % n)
        loss = agg.pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()
    return step


def _delays() -> tuple[Delays, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Delays().double()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_a_roll_by_a_tensor_shift_is_refused_with_its_gather_form():
    """``int(index[i])``'s hint named ``torch.roll`` to keep the shift a tensor; roll's
    shifts are ints, and ``torch.roll(h, -index[i], -1)`` was refused with the advice for
    value-dependent shapes (torch.where, masking). The int() hint names no roll; the
    roll is refused as a tensor given to an int argument, naming roll and shifts, with
    the gather form (NOTE: [0-d tensors in int arguments]), which compiles and is
    eager's."""
    x = torch.randn(8, 8, dtype=torch.float64)
    model, opt = _delays()
    message = _refused(_delay_step("int"), model, opt, x)
    assert "torch.roll" not in message.split("what to do:")[1], message
    message = _refused(_delay_step("tensor"), model, opt, x)
    assert "`torch.roll` as argument 2 (shifts), an argument that takes Python ints" in message, message
    assert "torch.roll(h, -index[i], -1)" in message, message
    assert "index_select(d, (torch.arange(x.shape[d], device=x.device) - s) % x.shape[d])" in message
    assert "value-dependent" not in message and "torch.where" not in message, message

    reference, ref_opt = copy.deepcopy((model, opt))
    compiled = sc.compile(parallel_mode=DataParallel("replicate"))(_delay_step("gather"))
    torch.manual_seed(2)
    with sc.simulate(world_size=2):
        for _ in range(3):
            x = torch.randn(8, 8, dtype=torch.float64)
            got = compiled(model, opt, x)
            want = _delay_step("int")(reference, ref_opt, x)  # eager's roll
            assert abs(float(got) - float(want)) < 1e-12
        full = sc.checkpoint.full_state_dict(model, opt)["model"]
    assert compiled.compile_count == 1
    assert max((full[k] - v).abs().max() for k, v in reference.state_dict().items()) < 1e-12


def _crop_step(form: str):  # noqa: ANN202
    def step(model, opt, hr):  # noqa: ANN001, ANN202
        ys = torch.randint(0, hr.shape[2] - 4 + 1, (hr.shape[0],))
        if form == "narrow":
            crops = [hr[i].narrow(1, ys[i], 4).narrow(2, ys[i], 4) for i in range(hr.shape[0])]
        else:
            crops = [hr[i].index_select(1, ys[i] + torch.arange(4)).index_select(2, ys[i] + torch.arange(4))
                     for i in range(hr.shape[0])]
        loss = model(torch.stack(crops)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return step


def test_a_narrow_from_a_tensor_start_is_refused_with_its_gather_form():
    """``hr[i].narrow(1, ys[i], P)``: narrow's Tensor overload reads the start with
    ``.item()``, and the step was refused with the advice for value-dependent shapes
    (torch.where, masking). Refused naming narrow and its start, with the index_select
    form (NOTE: [0-d tensors in int arguments]), which compiles and is eager's."""
    torch.manual_seed(0)
    model = nn.Conv2d(3, 4, 3, padding=1).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [torch.rand(8, 3, 10, 10, dtype=torch.float64) for _ in range(3)]
    message = _refused(_crop_step("narrow"), model, opt, batches[0])
    assert "`Tensor.narrow` as argument 3 (start), an argument that torch reads with .item()" in message, message
    assert "hr[i].narrow(1, ys[i], 4)" in message, message
    assert "x.index_select(d, s + torch.arange(n, device=x.device))" in message, message
    assert "value-dependent" not in message and "torch.where" not in message, message

    reference, ref_opt = copy.deepcopy((model, opt))
    torch.manual_seed(2)
    want = [float(_crop_step("narrow")(reference, ref_opt, x)) for x in batches]  # eager's narrow
    compiled = sc.compile(parallel_mode=DataParallel("replicate"))(_crop_step("gather"))
    torch.manual_seed(2)
    with sc.simulate(world_size=2):
        got = [float(compiled(model, opt, x)) for x in batches]
        full = sc.checkpoint.full_state_dict(model, opt)["model"]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-12, (got, want)
    assert max((full[k] - v).abs().max() for k, v in reference.state_dict().items()) < 1e-12


def _sobol_step(engine: torch.quasirandom.SobolEngine | None):  # noqa: ANN202
    def step(model, opt, xb, points=None):  # noqa: ANN001, ANN202 - a PINN's residual
        x = (engine.draw(16) if engine is not None else points).double()
        loss = (model(x) ** 2).mean() + (model(xb) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()
    return step


def test_a_sobol_draw_in_the_step_is_named_with_no_fake_kernel():
    """``SobolEngine.draw`` in the step was refused as "a torch function read the values
    of a tensor to decide the shape of its result ... pass the sizes as Python ints"; the
    shape is fixed: the op has no fake kernel. The refusal names
    ``torch._sobol_engine_draw`` and says to draw outside and pass the points in (NOTE:
    [kernels that read values at capture]); the engine is left untouched, and the hint's
    form is eager's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 1)).double()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    engine = torch.quasirandom.SobolEngine(2, scramble=True, seed=0)
    xb = torch.rand(8, 2, dtype=torch.float64)
    message = _refused(_sobol_step(engine), model, opt, xb)
    assert "torch._sobol_engine_draw has no kernel that runs on the trace's tensors (no fake " \
        "or meta kernel" in message, message
    assert "draw the points outside the compiled step and pass them in as an argument" in message
    assert "decide the shape" not in message and "Python ints" not in message, message
    assert engine.num_generated == 0

    reference, ref_opt = copy.deepcopy((model, opt))
    ref_engine = torch.quasirandom.SobolEngine(2, scramble=True, seed=0)
    compiled = sc.compile(parallel_mode=DataParallel("replicate"))(_sobol_step(None))
    with sc.simulate(world_size=2):
        for _ in range(3):
            got = compiled(model, opt, xb, engine.draw(16))
            want = _sobol_step(ref_engine)(reference, ref_opt, xb)
            assert abs(float(got) - float(want)) < 1e-12
    # the second program: the gradients and Adam's state the first call leaves
    assert compiled.compile_count == 2 and engine.num_generated == ref_engine.num_generated == 48


def test_a_tensor_split_by_a_tensor_keeps_the_shape_text_with_its_name():
    """``torch.tensor_split(x, idx_tensor)`` reads sizes: its refusal keeps the advice to
    pass them as Python ints, now naming the function."""
    model, opt = _delays()

    def step(model, opt, x):  # noqa: ANN001, ANN202
        parts = torch.tensor_split(model.lin(x), torch.tensor([2, 5]), dim=0)
        loss = sum(p.pow(2).sum() for p in parts)
        loss.backward()
        opt.step()
        return loss.detach()

    message = _refused(step, model, opt, torch.randn(8, 8, dtype=torch.float64))
    assert "torch.tensor_split: a torch function read the values of a tensor to decide the shape" in message, message
    assert "pass the sizes or indices as Python ints" in message
