"""What the ranks' status (NOTE: [a rank whose program fails alone] in
``spmd_compiler/runtime/rank_failures.py``) costs a call on real gloo ranks.

    python -m benchmarks.status_cost [--width 16] [--hidden 32] [--calls 400]

Three compiled ddp steps of one MLP (AdamW, float64), their calls interleaved so that a
loaded machine weighs on each alike: the status riding on the gradient bucket's
all-reduce (what runs), the status in a round of its own (the bucket ride turned off),
and no status at all. Prints each rank's median call and the median paired
differences to the step without a status.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
import spmd_compiler.state_donation as state_donation
from spmd_compiler.lower import LoweredGraph
from spmd_compiler.parallel_modes import DataParallel


def _step(model: nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _worker(rank: int, world_size: int, width: int, hidden: int, calls: int) -> dict[str, float]:
    torch.set_default_dtype(torch.float64)
    gen = torch.Generator().manual_seed(1)
    share = 4
    x = torch.randn(share * world_size, width, generator=gen)[rank * share : (rank + 1) * share]
    y = torch.randint(0, 4, (share * world_size,), generator=gen)[rank * share : (rank + 1) * share]
    rides, interprets = state_donation._rides_on, LoweredGraph.interprets
    steps = {}
    for kind in ("riding", "own round", "none"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(width, hidden), nn.Tanh(), nn.Linear(hidden, 4))
        steps[kind] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                       sc.compile(DataParallel("replicate"))(_step))

    def call(kind: str) -> float:
        model, optim, step = steps[kind]
        if kind == "own round":  # prepared on its first call: the bucket ride is off for it
            state_donation._rides_on = lambda last: None  # type: ignore[assignment]
        if kind == "none":
            LoweredGraph.interprets = lambda self, flat: False  # type: ignore[method-assign]
        try:
            start = time.perf_counter()
            step(model, optim, x, y)
            return (time.perf_counter() - start) * 1e3
        finally:
            state_donation._rides_on = rides  # type: ignore[assignment]
            LoweredGraph.interprets = interprets  # type: ignore[method-assign]

    for _ in range(5):
        for kind in steps:
            call(kind)
    times: dict[str, list[float]] = {kind: [] for kind in steps}
    for _ in range(calls):
        for kind in steps:
            times[kind].append(call(kind))
    out = {f"{kind} ms": statistics.median(ts) for kind, ts in times.items()}
    for kind in ("riding", "own round"):
        out[f"{kind} - none ms"] = statistics.median(
            [a - b for a, b in zip(times[kind], times["none"], strict=True)]
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--calls", type=int, default=400)
    args = parser.parse_args()
    results = sc.launch(_worker, 2, args=(args.width, args.hidden, args.calls), timeout_s=900)
    for rank, result in enumerate(results):
        print(f"rank {rank}: " + ", ".join(f"{k} {v:.3f}" for k, v in result.items()))


if __name__ == "__main__":
    main()
