"""Compiled steps and simulations from several threads (NOTE: [one thread at a time]).

Two threads inside compiled steps or simulate() blocks at once broke each other with
internal errors and could leave the capture's patches (``builtins.print``) installed; the
second is now refused before it touches anything, the first goes on as eager, and one
thread after another works as before.
"""

from __future__ import annotations

import builtins
import copy
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.errors import SPMDCompileError
from spmd_compiler.parallel_modes import make_mode
from spmd_compiler.tools.parity import compare_models, relative_difference

TOL = 1e-12


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 6)).double()


def _batches(n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(8, 6, generator=gen, dtype=torch.float64) for _ in range(n)]


def step(model, optim, x):  # noqa: ANN001
    loss = F.mse_loss(model(x), x)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


@pytest.mark.parametrize("second", ["simulate", "call"])
def test_a_second_thread_is_refused_while_one_is_inside(second):
    """Thread A is inside its simulation (mid-capture, held there by an event); thread B
    entering a simulation, or calling a compiled step, is refused; A finishes as eager
    would, and nothing is left patched."""
    inside, go_on = threading.Event(), threading.Event()
    real_print = builtins.print

    def held_step(model, optim, x):  # noqa: ANN001
        inside.set()  # runs while the step is traced
        assert go_on.wait(60)
        return step(model, optim, x)

    model, optim = _model(), None
    reference = copy.deepcopy(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference_optim = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    compiled = sc.compile(make_mode("ddp"))(held_step)
    other = sc.compile(make_mode("ddp"))(step)
    outcome: dict[str, object] = {}
    # made before: while a thread captures, its patches (Module._apply) reach all threads
    other_model = _model()
    other_optim = torch.optim.SGD(other_model.parameters(), lr=0.1)

    def worker() -> None:
        try:
            with sc.simulate(world_size=2) as sim:
                losses = [compiled(model, optim, x) for x in _batches(2)]
                outcome["losses"] = losses
                outcome["diff"] = max(compare_models(model, reference, sim).values())
        except BaseException as exc:  # noqa: BLE001
            outcome["error"] = exc

    thread = threading.Thread(target=worker, name="first")
    thread.start()
    assert inside.wait(60)
    try:
        with pytest.raises(SPMDCompileError, match="compiled steps are not thread-safe") as info:
            if second == "simulate":
                with sc.simulate(world_size=2):
                    pass
            else:
                other(other_model, other_optim, _batches(1)[0])
        assert "'first'" in str(info.value)
    finally:
        go_on.set()
        thread.join(120)
    eager = [step(reference, reference_optim, x) for x in _batches(2)]
    assert "error" not in outcome, outcome.get("error")
    assert all(relative_difference(a, b) < TOL for a, b in zip(outcome["losses"], eager))
    assert builtins.print is real_print
    # afterwards this thread compiles and runs as usual
    model = _model()
    fresh = sc.compile(make_mode("ddp"))(step)
    with sc.simulate(world_size=2):
        fresh(model, torch.optim.SGD(model.parameters(), lr=0.1), _batches(1)[0])


def test_threads_one_after_another_work():
    results = []

    def worker() -> None:
        model = _model()
        with sc.simulate(world_size=2):
            compiled = sc.compile(make_mode("ddp"))(step)
            results.append(compiled(model, torch.optim.SGD(model.parameters(), lr=0.1), _batches(1)[0]))

    for _ in range(2):
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join(120)
    assert len(results) == 2 and torch.equal(results[0], results[1])
