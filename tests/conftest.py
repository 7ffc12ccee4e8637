"""Shared fixtures: the standard train step and the simulated-rank parity harness.

The parity harness is the one from docs/design.md ("Tests"): the undecorated step runs eagerly
on a ``copy.deepcopy`` of the model with a fresh identical optimizer on the global batch;
the compiled step runs on N simulated ranks with the same global batch (each rank gets its
share). It records the returned-loss difference of every step and, at the end, the
relative difference of every parameter, buffer and optimizer-state tensor
(``spmd_compiler.tools.parity``).
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import spmd_compiler as sc
from spmd_compiler.tools.demo.steps import classification_train_step
from spmd_compiler.tools.parity import compare_models, compare_optimizers, relative_difference

Batch = tuple[torch.Tensor, ...]


standard_train_step = classification_train_step


@dataclass
class ParityResult:
    """What one compiled-vs-eager run measured."""

    compiled: sc.CompiledTrainStep
    model: nn.Module
    optimizer: torch.optim.Optimizer
    reference: nn.Module
    reference_optimizer: torch.optim.Optimizer
    loss_differences: list[float] = field(default_factory=list)
    compile_counts: list[int] = field(default_factory=list)
    state_differences: dict[str, float] = field(default_factory=dict)

    def worst(self, n: int = 5) -> list[tuple[str, float]]:
        return sorted(self.state_differences.items(), key=lambda kv: -kv[1])[:n]

    def assert_close(self, tolerance: float) -> None:
        """Every step's loss and every state tensor within ``tolerance`` (relative)."""
        assert self.state_differences, "nothing was compared"
        assert max(self.loss_differences) < tolerance, (
            f"returned loss differs from eager: per-step relative differences "
            f"{self.loss_differences}"
        )
        assert max(self.state_differences.values()) < tolerance, (
            f"state differs from eager; worst tensors: {self.worst()}"
        )


def _run_parity(
    make_model: Callable[[], nn.Module],
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    world_size: int,
    batches: Sequence[Batch],
    *,
    step: Callable[..., Any] = standard_train_step,
    make_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
    before_step: Callable[[int, nn.Module, nn.Module], None] | None = None,
    check_simulation: Callable[[Any, ParityResult], None] | None = None,
    mode: Any = None,
    scheduler_in_step: bool = False,
) -> ParityResult:
    """Run ``step`` compiled on ``world_size`` simulated ranks and eagerly; compare.

    Args:
        make_model / make_optimizer: build the model (seeded before the call) and its
            optimizer; the reference is a deepcopy of the model with a fresh optimizer.
        batches: the global batches, one per step (tensor arguments after model, optim).
        make_scheduler: an LR scheduler per optimizer, stepped after every call, outside
            the compiled step; with ``scheduler_in_step`` it is the step's third argument
            instead (``step(model, optimizer, scheduler, *batch)``), stepped by the step.
        before_step: ``before_step(i, model, reference)`` runs before step ``i`` (e.g. to
            switch train/eval on both).
        check_simulation: called inside the simulation after the last step.
        mode: the parallel mode (default ``DTensorExpandMode()``).
    """
    torch.manual_seed(0)
    model = make_model()
    reference = copy.deepcopy(model)
    optimizer, reference_optimizer = make_optimizer(model), make_optimizer(reference)
    schedulers = (
        [make_scheduler(optimizer), make_scheduler(reference_optimizer)]
        if make_scheduler is not None
        else []
    )
    compiled = sc.compile(mode)(step)
    result = ParityResult(compiled, model, optimizer, reference, reference_optimizer)
    with sc.simulate(world_size=world_size) as sim:
        for i, batch in enumerate(batches):
            if before_step is not None:
                before_step(i, model, reference)
            if scheduler_in_step:
                loss = compiled(model, optimizer, schedulers[0], *batch)
                expected = step(reference, reference_optimizer, schedulers[1], *batch)
            else:
                loss = compiled(model, optimizer, *batch)
                expected = step(reference, reference_optimizer, *batch)
            assert isinstance(loss, torch.Tensor) and not isinstance(
                loss, torch.distributed.tensor.DTensor
            ), f"step {i}: the returned loss is a {type(loss).__name__}, not a plain tensor"
            result.loss_differences.append(relative_difference(loss, expected))
            result.compile_counts.append(compiled.compile_count)
            for scheduler in schedulers if not scheduler_in_step else []:
                scheduler.step()
        result.state_differences.update(compare_models(model, reference, sim))
        result.state_differences.update(compare_optimizers(optimizer, reference_optimizer, sim))
        if check_simulation is not None:
            check_simulation(sim, result)
    return result


def _classification_batches(
    steps: int,
    batch_size: int = 8,
    features: int = 8,
    classes: int = 4,
    dtype: torch.dtype = torch.float32,
    seed: int = 1234,
) -> list[Batch]:
    """Fixed global ``(x, y)`` batches from their own generator."""
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(batch_size, features, generator=gen, dtype=dtype),
            torch.randint(0, classes, (batch_size,), generator=gen),
        )
        for _ in range(steps)
    ]


@pytest.fixture
def run_parity() -> Callable[..., ParityResult]:
    """The parity harness (see ``_run_parity``)."""
    return _run_parity


@pytest.fixture
def classification_batches() -> Callable[..., list[Batch]]:
    return _classification_batches


@pytest.fixture
def train_step() -> Callable[..., Any]:
    """forward, cross entropy, backward, optimizer step, zero_grad; returns the loss."""
    return standard_train_step


@pytest.fixture(autouse=True)
def _forget_test_modules(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Modules tests wrote under pytest's temporary directory (steps, modes, pass plugins)
    are forgotten before and after each test, after its monkeypatches are undone (this
    fixture is set up first). The compile cache's key lists every loaded module's source
    (NOTE: [cache key before capture]) and refuses one whose file is newer than what was
    loaded: one such module left behind (``test_pass_plugins``' ``broken_passes_plugin``,
    restored by monkeypatch after another test had replaced it) left every later step of
    that pytest worker without a key before capture, and a cache test failed depending on
    the order the workers drew the tests in."""
    base = str(tmp_path_factory.getbasetemp())

    def forget() -> None:
        for name, module in list(sys.modules.items()):
            if str(getattr(module, "__file__", None) or "").startswith(base):
                del sys.modules[name]

    forget()
    yield
    forget()


@pytest.fixture(autouse=True)
def _seed_and_clean_simulation():
    """Seed torch; never let a simulated (fake) process group leak into the next test."""
    torch.manual_seed(0)
    yield
    if dist.is_initialized() and dist.get_backend() == "fake":
        dist.destroy_process_group()
