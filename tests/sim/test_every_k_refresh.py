"""A preconditioner refreshed every k steps per parameter, its step count in a tensor
(Shampoo, GaLore, SOAP: ``if state["step"] % k == 0`` inside ``for p in params``), on
simulated ranks against eager (float64); NOTE: [the guess for later ifs] in
``capture/value_checks.py``."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim import Optimizer

import spmd_compiler as sc
from spmd_compiler.errors import SPMDCompileError
from spmd_compiler.parallel_modes import make_mode
from spmd_compiler.tools.parity import compare_models, compare_optimizers, relative_difference

TOL = 1e-12


class PrecondSGD(Optimizer):
    """SGD with a diagonal preconditioner refreshed every ``k`` steps of each parameter."""

    def __init__(self, params, lr: float = 0.1, k: int = 2) -> None:  # noqa: ANN001
        super().__init__(params, {"lr": lr, "k": k})

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float64)
                    state["pre"] = torch.ones_like(p)
                if state["step"] % group["k"] == 0:  # the refresh
                    state["pre"].copy_(1.0 / (p.grad.abs() + 0.1))
                state["step"] += 1
                p.add_(p.grad * state["pre"], alpha=-group["lr"])


def _mlp(layers: int) -> nn.Module:
    torch.manual_seed(0)
    parts: list[nn.Module] = []
    for _ in range(layers - 1):
        parts += [nn.Linear(6, 6), nn.Tanh()]
    return nn.Sequential(*parts, nn.Linear(6, 4)).double()


def _step(model, optim, x, y):  # noqa: ANN001
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=gen, dtype=torch.float64), torch.randint(0, 4, (8,), generator=gen))
            for _ in range(n)]


def _run(layers: int, make_optim, calls: int) -> int:  # noqa: ANN001
    """Run ``calls`` compiled calls and eager ones, checking each loss and the final
    state; returns the programs compiled."""
    model = _mlp(layers)
    reference = copy.deepcopy(model)
    optim, reference_optim = make_optim(model), make_optim(reference)
    compiled = sc.compile(make_mode("ddp"))(_step)
    with sc.simulate(world_size=2) as sim:
        for x, y in _batches(calls):
            loss = compiled(model, optim, x, y)
            assert relative_difference(loss, _step(reference, reference_optim, x, y)) < TOL
        worst = max({**compare_models(model, reference, sim),
                     **compare_optimizers(optim, reference_optim, sim)}.values())
    assert worst < TOL
    return compiled.compile_count


def test_a_refresh_every_k_steps_per_parameter_compiles_one_program_per_way():
    """8 parameters, every one refreshed on even steps: each call's 8 `if`s all go one
    way. Before, a program guessed True for each `if` after the one it was compiled for,
    so the first all-False call compiled a program per parameter and was refused at the
    bound of 8 ("step has compiled 8 programs", compile_count 9). Now the `if`s after a
    mismatch are guessed as the same `if` went in the call: the first call's program (it made
    the optimizer's state), then all-True and all-False."""
    assert _run(4, lambda m: PrecondSGD(m.parameters(), k=2), calls=5) == 3


def test_a_wrong_guess_still_gives_eagers_numbers():
    """Two groups refreshed every 2 and every 3 steps: on steps 2 to 4 the `if`s of one
    group go against the way the guess took from the other's, and the program of the
    way the data went runs (the guess is only about cost). 1 + 5 programs (8 before)."""
    def make(model: nn.Module) -> Optimizer:
        first, second = list(model[0].parameters()), list(model[2].parameters())
        return PrecondSGD([{"params": first, "k": 2}, {"params": second, "k": 3}])

    assert _run(2, make, calls=7) == 1 + 5


def test_the_refusal_counts_the_programs_of_the_first_call(monkeypatch):
    """The refusal past the bound (1 here) said "compiled 8 programs ... no call has
    completed yet" where ``compile_count`` was 9 and the first call had completed, on a
    program of its own (made before the optimizer had its state). It now counts both,
    says that none completed on the counted ones, and hints at a Python decision."""
    import spmd_compiler.api as api

    monkeypatch.setattr(api, "MAX_BRANCH_PROGRAMS", 1)
    model = _mlp(2)
    optim = PrecondSGD(model.parameters(), k=2)
    compiled = sc.compile(make_mode("ddp"))(_step)
    first, second = _batches(2)
    with sc.simulate(world_size=2):
        compiled(model, optim, *first)
        with pytest.raises(SPMDCompileError) as info:  # all False: a second program
            compiled(model, optim, *second)
    assert compiled.compile_count == 2
    message = str(info.value)
    assert "has compiled 1 program for the ways" in message, message
    assert "(2 in all; 1 more program serves other shapes or optimizer state, and does not count" in message, message
    assert "no call has completed on it yet; this one goes through its 4 `if`s (4 at " in message, message
    assert "opt.refresh = i % k == 0" in message and "a bool argument of the step" in message, message
