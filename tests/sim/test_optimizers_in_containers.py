"""Optimizers and LR schedulers a step reaches through a dict, list or tuple it names
(NOTE: [optimizers held in containers] in ``capture/code_names.py``): Parallel WaveGAN's
trainer keeps ``self.optimizer = {"generator": AdamW, "discriminator": AdamW}`` and a
matching ``self.scheduler`` dict. Before the sixty-ninth session such a step was refused
(with ``zero_grad()`` first: "parameter 0.weight ... through a reference held outside its
modules"); the same dict passed as an argument compiled. Each case runs a GAN-like step
(discriminator then generator, two AdamW, two ExponentialLR stepped in the step) 3 times
on 2 simulated ranks, float64, against the same code run eagerly on one device with the
global batch: returned losses, every parameter, every optimizer state and the learning
rates."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

import spmd_compiler as sc
from spmd_compiler.errors import SPMDCompileError
from spmd_compiler.parallel_modes import DataParallel
from spmd_compiler.tools.parity import full_state, relative_difference

WORLD, STEPS, TOL = 2, 3, 1e-12
MODES = ["replicate", "fully_shard"]


def _nets() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)).double()
    discriminator = nn.Sequential(nn.Linear(4, 6), nn.LeakyReLU(0.2), nn.Linear(6, 1)).double()
    return generator, discriminator


def _optimizers(generator: nn.Module, discriminator: nn.Module) -> dict[str, torch.optim.Optimizer]:
    return {
        "generator": torch.optim.AdamW(generator.parameters(), 1e-2, betas=(0.8, 0.99), weight_decay=0.1),
        "discriminator": torch.optim.AdamW(discriminator.parameters(), 2e-2, betas=(0.8, 0.99)),
    }


def _schedulers(optimizers: dict[str, torch.optim.Optimizer]) -> dict[str, Any]:
    return {k: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.5) for k, o in optimizers.items()}


def _gan_step(
    model: dict[str, nn.Module], optimizer: Any, scheduler: Any, x: torch.Tensor, z: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The step of each case, over containers indexed by "generator" / "discriminator"
    (dicts) or 0 / 1 (lists, tuples)."""
    g, d = ("generator", "discriminator") if isinstance(optimizer, dict) else (0, 1)
    fake = model["generator"](z)
    dis_loss = (model["discriminator"](x) - 1).pow(2).mean() + model["discriminator"](fake.detach()).pow(2).mean()
    optimizer[d].zero_grad()
    dis_loss.backward()
    optimizer[d].step()
    scheduler[d].step()
    gen_loss = (model["discriminator"](model["generator"](z)) - 1).pow(2).mean()
    optimizer[g].zero_grad()
    gen_loss.backward()
    optimizer[g].step()
    scheduler[g].step()
    return dis_loss.detach(), gen_loss.detach()


class Trainer:
    """Parallel WaveGAN's ``Trainer``: the modules as attributes (found as the step's
    state), and dicts of them, of the optimizers and of the schedulers."""

    def __init__(self) -> None:
        self.generator, self.discriminator = _nets()
        self.model = {"generator": self.generator, "discriminator": self.discriminator}
        self.optimizer = _optimizers(self.generator, self.discriminator)
        self.scheduler = _schedulers(self.optimizer)

    def train_step(self, x: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        loss = (self.model["discriminator"](x) - 1).pow(2).mean()
        loss = loss + self.model["discriminator"](self.model["generator"](z).detach()).pow(2).mean()
        self.optimizer["discriminator"].zero_grad()
        loss.backward()
        self.optimizer["discriminator"].step()
        self.scheduler["discriminator"].step()
        gen_loss = (self.model["discriminator"](self.model["generator"](z)) - 1).pow(2).mean()
        self.optimizer["generator"].zero_grad()
        gen_loss.backward()
        self.optimizer["generator"].step()
        self.scheduler["generator"].step()
        return loss.detach(), gen_loss.detach()


# a script's step over globals: the modules as globals, the optimizers in a global list
# and the schedulers in a global tuple
generator: nn.Module | None = None
discriminator: nn.Module | None = None
OPTIMIZERS: list[torch.optim.Optimizer] = []
SCHEDULERS: tuple[Any, ...] = ()


def script_step(x: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    assert generator is not None and discriminator is not None
    model = {"generator": generator, "discriminator": discriminator}
    return _gan_step(model, OPTIMIZERS, SCHEDULERS, x, z)


class _Run:
    """One way of holding the optimizers: the step, and the modules, optimizers and
    schedulers it trains."""

    def __init__(self, kind: str) -> None:
        self.bound: tuple[Any, ...] = ()
        if kind == "attribute dicts":
            trainer = Trainer()
            self.step: Callable[..., Any] = trainer.train_step
            self.modules = [trainer.generator, trainer.discriminator]
            self.optimizers = [trainer.optimizer["generator"], trainer.optimizer["discriminator"]]
            self.schedulers = [trainer.scheduler["generator"], trainer.scheduler["discriminator"]]
            return
        g, d = _nets()
        optimizers = _optimizers(g, d)
        schedulers = _schedulers(optimizers)
        self.modules = [g, d]
        self.optimizers = [optimizers["generator"], optimizers["discriminator"]]
        self.schedulers = [schedulers["generator"], schedulers["discriminator"]]
        if kind == "global list and tuple":
            self.bound = (g, d, self.optimizers, tuple(self.schedulers))
            self.step = script_step
        else:  # closure variables: the modules, and nested containers of the others
            held = {"optimizers": optimizers, "schedulers": [schedulers]}

            def closure_step(x: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                model = {"generator": g, "discriminator": d}
                return _gan_step(model, held["optimizers"], held["schedulers"][0], x, z)

            self.step = closure_step

    def call(self, step: Callable[..., Any], x: torch.Tensor, z: torch.Tensor) -> Any:
        """``step(x, z)`` with the script's globals set to this run's objects."""
        global generator, discriminator, OPTIMIZERS, SCHEDULERS
        if not self.bound:
            return step(x, z)
        generator, discriminator, OPTIMIZERS, SCHEDULERS = self.bound
        try:
            return step(x, z)
        finally:
            generator, discriminator, OPTIMIZERS, SCHEDULERS = None, None, [], ()

    def state(self, sim: Any) -> dict[str, torch.Tensor]:
        found: dict[str, torch.Tensor] = {}
        for i, (m, o) in enumerate(zip(self.modules, self.optimizers, strict=True)):
            found |= {f"{i}.{k}": v for k, v in full_state(m, o, sim).items()}
        return found


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 4, dtype=torch.float64, generator=gen), torch.randn(8, 4, dtype=torch.float64, generator=gen))
        for _ in range(STEPS)
    ]


KINDS = ["attribute dicts", "global list and tuple", "closure dicts"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_optimizers_and_schedulers_in_containers_match_eager(kind, mode):
    trained, reference = _Run(kind), _Run(kind)
    step = sc.compile(parallel_mode=DataParallel(mode))(trained.step)
    with sc.simulate(world_size=WORLD) as sim:
        for x, z in _batches():
            got, want = trained.call(step, x, z), reference.call(reference.step, x, z)
            for a, b in zip(got, want, strict=True):
                assert abs(float(a) - float(b)) <= TOL, (got, want)
        state = trained.state(sim)
    expected = reference.state(None)
    assert state.keys() == expected.keys() and len(expected) == 32  # 8 parameters, 3 AdamW states each
    worst = max(relative_difference(state[k], expected[k]) for k in expected)
    assert worst <= TOL, worst
    assert all(isinstance(p, DTensor) for m in trained.modules for p in m.parameters())
    for mine, theirs in zip(trained.schedulers, reference.schedulers, strict=True):
        assert mine.last_epoch == theirs.last_epoch == STEPS
    for mine, theirs in zip(trained.optimizers, reference.optimizers, strict=True):
        assert mine.param_groups[0]["lr"] == theirs.param_groups[0]["lr"]
    assert trained.optimizers[0].param_groups[0]["lr"] == 1e-2 * 0.5**STEPS
    # the schedules are replayed, not guarded: two programs, as with plain attributes (the
    # first call starts without gradients; later ones with those the generator's backward
    # left on the discriminator)
    assert len(step.records) == 2


class _OtherTrainer:
    """Its optimizer, only in a dict, also updates a module the step cannot reach."""

    def __init__(self) -> None:
        self.generator, _ = _nets()
        params = [*self.generator.parameters(), *nn.Linear(4, 4).double().parameters()]
        self.optimizer = {"generator": torch.optim.AdamW(params, 1e-2)}

    def train_step(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        loss = (self.generator(z) - x).pow(2).mean()
        self.optimizer["generator"].zero_grad()
        loss.backward()
        self.optimizer["generator"].step()
        return loss.detach()


def test_an_optimizer_in_a_dict_not_taken_is_refused_as_an_optimizer_first():
    """NOTE: [optimizers the step was not given]: with ``zero_grad()`` first the refusal
    spoke of "parameter 0.weight ... held outside its modules", not of the optimizer."""
    trainer = _OtherTrainer()
    before = [p.detach().clone() for p in trainer.optimizer["generator"].param_groups[0]["params"]]
    with sc.simulate(world_size=WORLD), pytest.raises(SPMDCompileError) as info:
        sc.compile()(trainer.train_step)(*_batches()[0])
    message = str(info.value)
    assert message.startswith(
        "The train step calls zero_grad() of a torch.optim.adamw.AdamW that is not among its optimizers"
    ), message
    assert 'self.optimizer["generator"].zero_grad()' in message, message
    assert "held outside its modules" not in message, message
    after = trainer.optimizer["generator"].param_groups[0]["params"]
    assert all(torch.equal(a, b) and not isinstance(a, DTensor) for a, b in zip(after, before, strict=True))
