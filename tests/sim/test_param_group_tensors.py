"""Optimizers that keep a counter in their param groups, or force no capturable path.

- NOTE: [tensors held in a param group]: a tensor a param group holds (timm's Lamb's
  ``group['step']``, advanced by ``add_(1)`` in its step) is state of the program, read
  and written back into the same tensor after every call. Before, ``add_`` on it was
  refused as a write to "a global, a closure value or a plain attribute". One the step
  creates on its first call is refused naming the class, the key and the line, with the
  working form (create it before the first call), and leaves the optimizer as it was.
- NOTE: [counters the optimizer keeps]: a Python number the optimizer's own step()
  changes every call (Adan's ``group['step'] += 1``, AdamP's and MADGRAD's
  ``state['step']``) is refused saying that the optimizer's own code does it, with
  optimizers that work.
- NOTE: [capturable refused by the optimizer]: an optimizer whose own check refuses the
  capturable path the compiled step turns on (timm's NAdamW on CPU) is refused naming
  its class and why the flag is on.

The optimizers here copy the pattern of timm's, not its code.
"""

from __future__ import annotations

import copy
import sys
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.errors import SPMDCompileError
from spmd_compiler.parallel_modes import make_mode

TOL = 1e-12


class _GroupCountAdam(torch.optim.Optimizer):
    """Lamb's pattern: one step count per param group, a tensor made on the first call
    unless the group holds one, advanced in place; bias corrections from it."""

    def __init__(self, params, lr: float = 0.05) -> None:  # noqa: ANN001
        super().__init__(params, {"lr": lr, "betas": (0.9, 0.99)})

    @torch.no_grad()
    def step(self, closure=None) -> None:  # noqa: ANN001
        for group in self.param_groups:
            if "step" not in group:
                group["step"] = torch.tensor(0.0, dtype=torch.float64)
            group["step"].add_(1)
            beta1, beta2 = group["betas"]
            bias1, bias2 = 1 - beta1 ** group["step"], 1 - beta2 ** group["step"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["m"], state["v"] = torch.zeros_like(p), torch.zeros_like(p)
                state["m"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
                state["v"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                update = (state["m"] / bias1) / ((state["v"] / bias2).sqrt() + 1e-8)
                p.add_(update, alpha=-group["lr"])


class _GroupIntCount(torch.optim.SGD):
    """Adan's pattern: the group's step count a Python int its own step() advances."""

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201
        for group in self.param_groups:
            if "step" in group:
                group["step"] += 1
            else:
                group["step"] = 1
        return super().step(closure)


class _CudaOnlyCapturable(torch.optim.SGD):
    """timm's NAdamW's pattern: a ``capturable`` key, checked by its own step()."""

    def __init__(self, params) -> None:  # noqa: ANN001
        super().__init__(params, lr=0.1)
        for group in self.param_groups:
            group["capturable"] = False

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201
        for group in self.param_groups:
            assert not group["capturable"] or all(p.is_cuda for p in group["params"]), (
                "If capturable=True, params and state_steps must be on supported devices: ['cuda']."
            )
        return super().step(closure)


def _model() -> nn.Module:
    torch.manual_seed(0)
    # 5 output rows: fully_shard pads them over 2 ranks
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5)).double()


def _batches(n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 6, generator=gen, dtype=torch.float64), torch.randint(0, 5, (8,), generator=gen))
        for _ in range(n)
    ]


def _step(model, optim, x, y):  # noqa: ANN001
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_a_step_count_tensor_in_the_param_group_matches_eager_after_every_call(mode):
    model = _model()
    optim = _GroupCountAdam([
        {"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.02},
    ])
    for group in optim.param_groups:  # the working form the refusal gives
        group["step"] = torch.tensor(0.0, dtype=torch.float64)
    counters = [g["step"] for g in optim.param_groups]
    ref_model, ref_optim = copy.deepcopy((model, optim))
    step = sc.compile(make_mode(mode))(_step)
    with sc.simulate(world_size=2) as sim:
        for i, (x, y) in enumerate(_batches(3)):
            want = _step(ref_model, ref_optim, x, y)
            got = sim.full_tensor(step(model, optim, x, y))
            assert abs(float(got) - float(want)) < TOL
            for g, ref_g, counter in zip(optim.param_groups, ref_optim.param_groups, counters, strict=True):
                assert g["step"] is counter  # written back into the group's own tensor
                assert float(g["step"]) == float(ref_g["step"]) == i + 1
                assert g["step"].dtype == torch.float64
            for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
                assert (sim.full_tensor(p) - q).abs().max().item() < TOL
    assert step.compile_count == 1


def _refusal(model: torch.nn.Module, optim: torch.optim.Optimizer) -> str:
    """The text of the first compiled call's refusal (ddp, 2 simulated ranks)."""
    step = sc.compile(make_mode("ddp"))(_step)
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError) as err:
        step(model, optim, *_batches(1)[0])
    return str(err.value)


def test_a_step_count_tensor_made_by_the_first_step_is_refused_with_the_working_form():
    model = _model()
    optim = _GroupCountAdam(model.parameters())
    text = _refusal(model, optim)
    assert "_GroupCountAdam's own step() creates optimizer[0].param_groups[0]['step'], a tensor" in text
    assert "for g in opt.param_groups: g['step'] = torch.tensor(0.0)" in text
    line = next(i for i, code in enumerate(open(__file__).read().splitlines(), 1)
                if code.strip() == 'group["step"] = torch.tensor(0.0, dtype=torch.float64)')
    assert f"{__file__}:{line}" in text, text
    assert all("step" not in g for g in optim.param_groups) and not optim.state


def test_a_python_step_count_of_the_optimizers_own_group_is_refused_naming_it():
    model = _model()
    optim = _GroupIntCount(model.parameters(), lr=0.1)
    text = _refusal(model, optim)
    assert "_GroupIntCount's own step() keeps a Python number in optimizer[0].param_groups[0]['step']" in text
    # the user's own class: keep the count in its state as a tensor (NOTE: [counters a
    # custom optimizer keeps]); before, it was told to use torch.optim's Adam
    assert "keep 'step' in _GroupIntCount's state as tensors instead" in text, text
    assert "torch.optim's Adam, AdamW, NAdam, RAdam" not in text
    assert all("step" not in g for g in optim.param_groups)


def test_a_python_step_count_in_the_state_of_a_librarys_optimizer_is_refused_naming_it(monkeypatch):
    """AdamP's and MADGRAD's pattern: ``state['step']`` a Python int, in an installed
    package: the hint gives optimizers that work, not a change to the package's code."""
    module = types.ModuleType("fake_optim_package")
    module.__file__ = "/x/site-packages/fake_optim_package/__init__.py"
    monkeypatch.setitem(sys.modules, module.__name__, module)

    class StateIntCount(torch.optim.SGD):
        @torch.no_grad()
        def step(self, closure=None):  # noqa: ANN001, ANN202
            for group in self.param_groups:
                for p in group["params"]:
                    self.state[p]["step"] = self.state[p].get("step", 0) + 1
            return super().step(closure)

    StateIntCount.__module__ = module.__name__
    model = _model()
    optim = StateIntCount(model.parameters(), lr=0.1)
    text = _refusal(model, optim)
    assert "StateIntCount's own step() does this, in the installed package 'fake_optim_package'" in text
    assert "torch.optim's Adam, AdamW, NAdam, RAdam" in text
    assert not optim.state


def test_an_optimizer_refusing_the_capturable_path_is_refused_saying_why_it_is_on():
    model = _model()
    optim = _CudaOnlyCapturable(model.parameters())
    text = _refusal(model, optim)
    assert "optimizer[0] (_CudaOnlyCapturable) refused its capturable path, which the compiled step turned on" in text
    assert "traces optimizers with capturable=True" in text and "If capturable=True" in text
    assert all(g["capturable"] is False for g in optim.param_groups) and not optim.state


def test_a_param_group_step_count_survives_a_checkpoint(tmp_path):
    model = _model()
    optim = _GroupCountAdam(model.parameters())
    optim.param_groups[0]["step"] = torch.tensor(0.0, dtype=torch.float64)
    step = sc.compile(make_mode("fsdp"))(_step)
    with sc.simulate(world_size=2):
        for x, y in _batches(2):
            step(model, optim, x, y)
        sc.checkpoint.save(tmp_path / "ckpt", model, optim)
    loaded_model = _model()
    loaded = _GroupCountAdam(loaded_model.parameters())
    loaded.param_groups[0]["step"] = torch.tensor(0.0, dtype=torch.float64)
    sc.checkpoint.load(tmp_path / "ckpt", loaded_model, loaded)
    assert float(loaded.param_groups[0]["step"]) == 2.0
