"""A compiled step's timings keep a bounded history: a long run does not hold a float per
step it ever ran (``StepTimings.step_seconds``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.parallel_modes import DataParallel
from spmd_compiler.runtime import runner


def test_step_seconds_keeps_the_latest_calls(monkeypatch) -> None:
    monkeypatch.setattr(runner, "STEP_TIMES_KEPT", 3)

    @sc.compile(parallel_mode=DataParallel("replicate"))
    def step(model, optim, x, y):
        F.cross_entropy(model(x), y).backward()
        optim.step()
        optim.zero_grad()

    model = torch.nn.Linear(4, 3)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 4), torch.randint(0, 3, (4,))
    with sc.simulate(world_size=2):
        for _ in range(6):
            step(model, optim, x, y)
    times = list(step.timings.step_seconds)
    assert len(times) == 3 and all(t > 0 for t in times)
    assert step.timings.compile_seconds > 0
