"""A 0-dim tensor of the step given to a Scalar argument is computed with, as eager does.

NOTE: [0-d tensors in Scalar arguments] in ``spmd_compiler/capture/scalar_arguments.py``:
a DINO-style EMA whose momentum is a 0-dim tensor read from a schedule buffer (``m =
sched.mom[sched.it]``, the counter a buffer as the refusal of ``self.global_step += 1``
advises) writes ``torch._foreach_lerp_(teacher, student, 1 - m)`` or
``t.mul_(m).add_(s, alpha=1 - m)``. Eager reads the tensor with ``.item()``; the compiled
step was refused with "reads the value of a tensor in Python ... use torch.where /
masking". Those calls are now computed with the tensor as an operand (eager's numbers,
bit for bit in float32 and float64); an uncovered Scalar argument (``full_like(x, t)``)
is refused naming the op and the argument.
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
from spmd_compiler.tools.parity import compare_models


class Schedule(nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        self.register_buffer("mom", torch.tensor([0.5, 0.7, 0.9, 0.95, 0.3], dtype=dtype))
        self.register_buffer("it", torch.zeros((), dtype=torch.long))


def _ema(form: str, teacher: nn.Module, student: nn.Module, m: torch.Tensor) -> None:
    ts, ss = list(teacher.parameters()), list(student.parameters())
    if form == "foreach_lerp":
        torch._foreach_lerp_(ts, ss, 1 - m)
    elif form == "foreach_add":
        torch._foreach_mul_(ts, m)
        torch._foreach_add_(ts, ss, alpha=1 - m)
    else:
        for t, s in zip(ts, ss, strict=True):
            if form == "alpha":
                t.mul_(m).add_(s, alpha=1 - m)
            elif form == "sub_alpha":
                t.sub_(t - s, alpha=1 - m)
            elif form == "addcdiv":
                t.mul_(m).addcdiv_(s, s.abs() + 1, value=1 - m)
            else:  # a Tensor weight in eager (lerp.Tensor): compiled before, too
                t.lerp_(s, 1 - m)


def _dino_step(form: str):
    def step(student, teacher, sched, optim, x, y):  # noqa: ANN001, ANN202
        with torch.no_grad():
            target = teacher(x)
        loss = F.mse_loss(student(x), target) + F.cross_entropy(student(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        m = sched.mom[sched.it]
        with torch.no_grad():
            _ema(form, teacher, student, m)
        sched.it += 1
        return loss.detach()

    return step


@pytest.mark.parametrize("mode", ["replicate", "fully_shard"])
@pytest.mark.parametrize("form", ["foreach_lerp", "alpha", "lerp", "foreach_add", "sub_alpha", "addcdiv"])
def test_a_momentum_tensor_in_a_scalar_argument_matches_eager(form, mode):
    torch.manual_seed(0)
    student = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4)).double()
    teacher = copy.deepcopy(student).requires_grad_(False)
    sched = Schedule()
    ref_student, ref_teacher, ref_sched = copy.deepcopy((student, teacher, sched))
    optim, ref_optim = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (student, ref_student))
    step = _dino_step(form)
    compiled = sc.compile(DataParallel(mode))(step)
    gen = torch.Generator().manual_seed(1)
    with sc.simulate(2) as sim:
        for _ in range(3):
            x = torch.randn(8, 6, generator=gen, dtype=torch.float64)
            y = torch.randint(0, 4, (8,), generator=gen)
            got = compiled(student, teacher, sched, optim, x, y)
            want = step(ref_student, ref_teacher, ref_sched, ref_optim, x, y)
            assert abs(got.item() - want.item()) <= 1e-12 * abs(want.item())
        assert max(compare_models(teacher, ref_teacher, sim).values()) < 1e-12
        assert max(compare_models(student, ref_student, sim).values()) < 1e-12
        assert sc.checkpoint.full_state_dict(sched)["model"]["it"].item() == 3
    assert compiled.compile_count == 1  # before: refused ("reads the value of a tensor")


def _run_both(step, objects: tuple, references: tuple, batches: list[torch.Tensor]):  # noqa: ANN001, ANN202
    """The compiled step on 2 simulated ranks and eager, one call each per batch."""
    compiled = sc.compile(DataParallel("replicate"))(step)
    with sc.simulate(2):
        for x in batches:
            compiled(*objects, x)
            step(*references, x)
    return compiled


def _assert_equal_states(module: nn.Module, reference: nn.Module) -> None:
    got = sc.checkpoint.full_state_dict(module)["model"]
    for name, want in reference.state_dict().items():
        assert torch.equal(got[name], want), name


@pytest.mark.parametrize(("param_dtype", "mom_dtype"), [
    (torch.float32, torch.float32), (torch.float32, torch.float64), (torch.float64, torch.float32),
])
@pytest.mark.parametrize("form", ["foreach_lerp", "alpha", "foreach_add", "addcdiv"])
def test_the_update_is_eagers_bit_for_bit(form, param_dtype, mom_dtype):
    """The EMA alone, of fixed weights: eager's kernels' numbers exactly, the momentum
    applied in the op's compute dtype (a float64 momentum rounded to float32 once, a
    float32 one widened exactly)."""

    def step(student, teacher, sched, x):  # noqa: ANN001, ANN202
        with torch.no_grad():
            _ema(form, teacher, student, sched.mom[sched.it])
        sched.it += 1
        return student(x).sum().detach()

    torch.manual_seed(0)
    student = nn.Linear(64, 32).to(param_dtype).requires_grad_(False)
    teacher = nn.Linear(64, 32).to(param_dtype).requires_grad_(False)
    sched = Schedule(mom_dtype)
    ref_student, ref_teacher, ref_sched = copy.deepcopy((student, teacher, sched))
    compiled = _run_both(step, (student, teacher, sched), (ref_student, ref_teacher, ref_sched),
                         [torch.randn(4, 64, dtype=param_dtype) for _ in range(4)])
    _assert_equal_states(teacher, ref_teacher)
    assert compiled.compile_count == 1


def test_an_integer_alpha_is_eagers():
    """An int64 0-dim tensor as ``alpha=``: eager reads an int, converted by the kernel
    (to float32 next to float32 parameters; int arithmetic next to an int buffer)."""

    class Counts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("seen", torch.zeros(3, dtype=torch.int32))
            self.register_buffer("it", torch.zeros((), dtype=torch.long))

    def step(model, counts, x):  # noqa: ANN001, ANN202
        k = counts.it * 3 + 1
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p, alpha=-k)
                p.mul_(0.25)
            counts.seen.add_(torch.ones_like(counts.seen), alpha=k)
        counts.it += 1
        return model(x).sum().detach()

    torch.manual_seed(0)
    model = nn.Linear(8, 3).requires_grad_(False)
    counts = Counts()
    ref_model, ref_counts = copy.deepcopy((model, counts))
    compiled = _run_both(step, (model, counts), (ref_model, ref_counts), [torch.randn(2, 8) for _ in range(3)])
    _assert_equal_states(model, ref_model)
    _assert_equal_states(counts, ref_counts)  # seen: 1 + 4 + 7 = 12
    assert ref_counts.seen.tolist() == [12, 12, 12]
    assert compiled.compile_count == 1


@pytest.mark.parametrize(("call", "op", "argument"), [
    (lambda p, t: p.add_(torch.full_like(p, t)), "full_like", "argument 2"),
    (lambda p, t: p.copy_(torch.addmm(p, p, torch.eye(4, dtype=p.dtype), beta=t)), "addmm", "beta="),
    (lambda p, t: p.copy_(F.dropout(p, p=t)), "torch.nn.functional.dropout", "p="),
])
def test_an_uncovered_scalar_argument_is_refused_by_name(call, op, argument):
    def step(model, sched, x):  # noqa: ANN001, ANN202
        t = sched.mom[sched.it]
        with torch.no_grad():
            call(model.weight, t)
        return model(x).sum().detach()

    model = nn.Linear(4, 2).double().requires_grad_(False)
    sched = Schedule()
    found = copy.deepcopy(model.state_dict())
    compiled = sc.compile(DataParallel("replicate"))(step)
    with sc.simulate(2), pytest.raises(SPMDCompileError) as caught:
        compiled(model, sched, torch.randn(2, 4, dtype=torch.float64))
    message = str(caught.value)
    assert f"`{op}` as {argument}" in message
    assert "reads that argument as a Python number" in message
    assert "float argument of the step" in message
    assert "torch.where" not in message and "masking" not in message  # before: the generic advice
    assert "test_tensor_scalars_in_scalar_arguments.py" in message  # the user's line
    for name, value in model.state_dict().items():
        assert torch.equal(value, found[name])


def test_a_call_eager_refuses_is_refused_with_eagers_reason():
    """A float 0-dim alpha with integer tensors: eager refuses the Python float there."""

    def step(model, sched, counts, x):  # noqa: ANN001, ANN202
        counts.add_(torch.ones_like(counts), alpha=sched.mom[0])
        return model(x).sum().detach()

    model = nn.Linear(4, 2).double()
    compiled = sc.compile(DataParallel("replicate"))(step)
    with sc.simulate(2), pytest.raises(SPMDCompileError, match="eager refuses this call") as caught:
        compiled(model, Schedule(), torch.zeros(3, dtype=torch.long), torch.randn(2, 4, dtype=torch.float64))
    assert "alpha must not be a floating point number" in str(caught.value)


def test_a_tensor_that_requires_grad_is_refused_as_eager_refuses_it():
    """Eager's argument parser refuses a 0-dim tensor that requires grad as a Number
    (a TypeError); so does the capture, the model left as found."""

    def step(model, x):  # noqa: ANN001, ANN202
        with torch.no_grad():
            model.weight.add_(model.weight, alpha=model.bias[0])
        return model(x).sum().detach()

    model = nn.Linear(4, 2).double()
    with torch.no_grad(), pytest.raises(TypeError, match="'alpha' must be Number"):
        step(copy.deepcopy(model), torch.randn(2, 4, dtype=torch.float64))
    found = copy.deepcopy(model.state_dict())
    compiled = sc.compile(DataParallel("replicate"))(step)
    with sc.simulate(2), pytest.raises(SPMDCompileError, match="'alpha' must be Number"):
        compiled(model, torch.randn(2, 4, dtype=torch.float64))
    for name, value in model.state_dict().items():
        assert torch.equal(value, found[name])


def test_a_slot_eager_gives_a_tensor_overload_is_not_rewritten():
    """``_foreach_addcmul_(a, b, c, t)`` with ``t`` 0-dim positional is the packed-scalars
    Tensor overload in eager, which refuses it; the capture must not compute it as
    ``value=t`` (NOTE: [0-d tensors in Scalar arguments]: only slots typed Scalar)."""

    def step(model, ema, mom, x):  # noqa: ANN001, ANN202
        with torch.no_grad():
            ps, es = list(model.parameters()), list(ema.parameters())
            torch._foreach_addcmul_(es, ps, ps, mom[0])
        return model(x).sum().detach()

    model = nn.Linear(4, 2).double().requires_grad_(False)
    ema = nn.Linear(4, 2).double().requires_grad_(False)
    mom = torch.tensor([0.5], dtype=torch.float64)
    with pytest.raises(RuntimeError, match="packed scalar"):
        step(model, copy.deepcopy(ema), mom, torch.randn(2, 4, dtype=torch.float64))
    found = copy.deepcopy(ema.state_dict())
    compiled = sc.compile(DataParallel("replicate"))(step)
    with sc.simulate(2), pytest.raises(SPMDCompileError, match="_foreach_addcmul_"):
        compiled(model, ema, mom, torch.randn(2, 4, dtype=torch.float64))
    for name, value in ema.state_dict().items():
        assert torch.equal(value, found[name])
