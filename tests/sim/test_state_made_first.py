"""NOTE: [optimizer state made before the first program] (``capture/initial_state.py``).

An optimizer whose first ``step()`` makes its state from factory ops (Adam's zeros) gets
that state before the first program, and the steady program then serves every call: one
compile, not two. Each case runs 3 steps on 2 simulated ranks (float64) against the
undecorated step on one device and checks the compile count:

- torch optimizers that make zeros (Adam with amsgrad, AdamW, NAdam, RAdam, Adamax,
  Adadelta, centered RMSprop with momentum) under ddp and fsdp: one program;
- SGD with momentum (its buffer is the first gradient) and ASGD (its ``eta`` is the
  learning rate): two programs, as before;
- an optimizer whose first step takes another way than its later ones (zeros made
  first, then overwritten by the gradient on step 1 only): the steady trace is not the
  first one with the zeros read as inputs, so two programs, exact;
- a state dict set at once (``self.state[p] = {...}``): two programs;
- a step reading a tensor from outside its arguments (a global table): one program;
- a compile that fails after the state was made, and a first call that fails: the
  optimizer is left with no state;
- the persistent compile cache: two programs (both kept for a restart).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.api import CompiledTrainStep
from spmd_compiler.parallel_modes import DataParallel
from spmd_compiler.tools.parity import compare_states, full_state

TOL = 1e-10


@pytest.fixture(autouse=True)
def _float64_by_default():
    """Eager optimizers make their scalar state (NAdam's ``mu_product``) in the default
    dtype, compiled programs in float64 (NOTE: [float64 step counters])."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(default)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4)).double()


def _step(model, optim, x, y):  # noqa: ANN001
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


class FirstStepCopies(torch.optim.Optimizer):
    """Momentum whose buffer is made as zeros and, on the first step only, set to the
    gradient: the made zeros are not what step 1 reads."""

    def __init__(self, params, lr: float = 0.1, momentum: float = 0.9) -> None:  # noqa: ANN001
        super().__init__(params, {"lr": lr, "momentum": momentum})

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                first = len(state) == 0
                if first:
                    state["buf"] = torch.zeros_like(p)
                buf = state["buf"]
                if first:
                    buf.copy_(p.grad)
                else:
                    buf.mul_(group["momentum"]).add_(p.grad)
                p.add_(buf, alpha=-group["lr"])


class WholeDict(torch.optim.Optimizer):
    """Sets a parameter's whole state dict at once."""

    def __init__(self, params, lr: float = 0.1) -> None:  # noqa: ANN001
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201
        for group in self.param_groups:
            for p in group["params"]:
                if p not in self.state:
                    self.state[p] = {"avg": torch.zeros_like(p)}
                avg = self.state[p]["avg"]
                avg.mul_(0.5).add_(p.grad, alpha=0.5)
                p.add_(avg, alpha=-group["lr"])


OPTIMIZERS = {
    "adam_amsgrad": (lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, amsgrad=True, weight_decay=0.1), 1),
    "adamw": (lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), 1),
    "nadam": (lambda m: torch.optim.NAdam(m.parameters(), lr=1e-2), 1),
    "radam": (lambda m: torch.optim.RAdam(m.parameters(), lr=1e-2), 1),
    "adamax": (lambda m: torch.optim.Adamax(m.parameters(), lr=1e-2), 1),
    "adadelta": (lambda m: torch.optim.Adadelta(m.parameters(), lr=1.0), 1),
    "rmsprop": (lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-2, momentum=0.5, centered=True), 1),
    "sgd_momentum": (lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), 2),
    "asgd": (lambda m: torch.optim.ASGD(m.parameters(), lr=1e-2), 2),
    "first_step_copies": (lambda m: FirstStepCopies(m.parameters()), 2),
    "whole_dict": (lambda m: WholeDict(m.parameters()), 2),
}


# a table read from outside the step's arguments (diffusers' ``scheduler.add_noise``
# reads its ``alphas_cumprod`` so)
_SCALES = torch.linspace(0.5, 1.5, 8, dtype=torch.float64)


def _scaled_step(model, optim, x, y):  # noqa: ANN001
    return _step(model, optim, x * _SCALES, y)


def _run(make_opt, mode: str = "replicate", cache_dir=None, step=_step):  # noqa: ANN001
    model, batches = _model(), [(torch.randn(8, 8).double(), torch.randint(0, 4, (8,))) for _ in range(3)]
    ref = copy.deepcopy(model)
    optim, ref_optim = make_opt(model), make_opt(ref)
    want = [step(ref, ref_optim, x, y).item() for x, y in batches]
    compiled = sc.compile(parallel_mode=DataParallel(mode), cache_dir=cache_dir)(step)
    with sc.simulate(world_size=2) as sim:
        got = [compiled(model, optim, x, y).item() for x, y in batches]
        states = compare_states(full_state(model, optim, sim), full_state(ref, ref_optim, None))
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < TOL
    worst = max(states.items(), key=lambda kv: kv[1])
    assert worst[1] < TOL, worst
    return compiled


@pytest.mark.parametrize("mode", ["replicate", "fully_shard"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_programs_per_optimizer(name, mode):
    make_opt, programs = OPTIMIZERS[name]
    compiled = _run(make_opt, mode)
    assert compiled.compile_count == programs
    made = [r.program.captured.made_state for r in compiled.records]
    assert (made[0] is not None) == (programs == 1)


@pytest.mark.parametrize("mode", ["replicate", "fully_shard"])
def test_a_step_reading_a_tensor_from_outside_its_arguments(mode):
    """Its two traces read the same outside tensor (compared by identity and version):
    one program, where it compiled two before."""
    compiled = _run(OPTIMIZERS["adamw"][0], mode, step=_scaled_step)
    assert compiled.compile_count == 1
    assert compiled.records[0].program.captured.made_state is not None


@pytest.mark.parametrize("name", ["adamw", "adam_amsgrad", "adadelta", "rmsprop", "sgd_momentum"])
def test_a_restart_makes_the_state_the_first_job_made(tmp_path, name):
    """NOTE: [optimizer state made on a restart]: with the persistent cache the first job
    compiles the one program of a step whose state is made first (it compiled two before,
    one only for the first call), and a restart makes that state from the state entry and
    loads the program without tracing. An optimizer whose state is not made first (SGD's
    momentum is the first gradient) keeps two programs, both loaded on a restart."""
    make_opt, programs = OPTIMIZERS[name]
    first = _run(make_opt, cache_dir=tmp_path)
    assert first.compile_count == programs
    assert [r.cache for r in first.records] == ["miss"] * programs
    assert len(list((tmp_path / "states").glob("*.pt"))) == (programs == 1)
    restart = _run(make_opt, cache_dir=tmp_path)
    assert [r.cache for r in restart.records] == ["hit"] * programs
    assert all(r.capture_skipped for r in restart.records)
    assert (restart.records[0].program.captured.made_state is not None) == (programs == 1)


def test_a_state_entry_without_its_program_makes_no_state(tmp_path):
    """The program a state entry leads to is gone: the state made from the entry is
    taken out again and the step captures as a first job does (parity in ``_run``)."""
    _run(OPTIMIZERS["adamw"][0], cache_dir=tmp_path)
    for path in (tmp_path / "programs").glob("*.pt"):
        path.unlink()
    restart = _run(OPTIMIZERS["adamw"][0], cache_dir=tmp_path)
    assert [r.cache for r in restart.records] == ["miss"]
    assert not restart.records[0].capture_skipped
    assert restart.records[0].program.captured.made_state is not None


def test_a_compile_that_fails_leaves_no_state(monkeypatch):
    def fail(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise RuntimeError("expansion failed")

    monkeypatch.setattr(CompiledTrainStep, "_build", fail)
    model = _model()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    compiled = sc.compile(parallel_mode=DataParallel("replicate"))(_step)
    with sc.simulate(world_size=2), pytest.raises(RuntimeError, match="expansion failed"):
        compiled(model, optim, torch.randn(8, 8).double(), torch.randint(0, 4, (8,)))
    assert len(optim.state) == 0


def test_a_first_call_that_fails_leaves_no_state(monkeypatch):
    from spmd_compiler.runtime.step_executable import StepExecutable

    def fail(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise RuntimeError("the run failed")

    monkeypatch.setattr(StepExecutable, "run", fail)
    model = _model()
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    compiled = sc.compile(parallel_mode=DataParallel("replicate"))(_step)
    with sc.simulate(world_size=2), pytest.raises(RuntimeError, match="the run failed"):
        compiled(model, optim, torch.randn(8, 8).double(), torch.randint(0, 4, (8,)))
    assert compiled.records[0].program.captured.made_state is not None
    assert all(len(entries) == 0 for entries in optim.state.values())
