"""A compiled step that clips its gradients, on 2 gloo ranks: gradients settled once
(NOTE: [gradients settle after backward]) against reduced by each consumer (the settle
switched off, as before 2026-11-24), interleaved in one launch.

``python -m benchmarks.clip_gradients [--backend eager] [--styles ddp fsdp]`` prints the
median step ms of each variant (MLP 512 -> 2048 -> 512, batch 32, AdamW).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.parallel_modes import make_mode
from spmd_compiler.parallel_modes.base import ParallelMode

WIDTH, BATCH, STEPS = 512, 32, 15


def clipped_step(model, optim, x, y):  # noqa: ANN001
    loss = F.mse_loss(model(x), y)
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optim.step()
    optim.zero_grad()
    return loss


def _compiled(style: str, backend: str, settled: bool):  # noqa: ANN202
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    original = ParallelMode.gradient_placement
    if not settled:  # every consumer reduces the partial gradients it reads
        ParallelMode.gradient_placement = lambda self, captured, mesh: None  # type: ignore[method-assign]
    try:
        step = sc.compile(make_mode(style), backend=backend)(clipped_step)
        x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
        for _ in range(2):  # compile, and the program with optimizer state
            step(model, optim, x, y)
    finally:
        ParallelMode.gradient_placement = original  # type: ignore[method-assign]
    return step, model, optim, x, y


def worker(rank: int, world: int, style: str, backend: str) -> dict[str, float]:
    variants = {name: _compiled(style, backend, name == "settled") for name in ("settled", "per_consumer")}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(STEPS):
        for name, (step, model, optim, x, y) in variants.items():
            dist.barrier()
            start = time.perf_counter()
            step(model, optim, x, y)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", default="eager", choices=("eager", "inductor"))
    parser.add_argument("--styles", nargs="+", default=["ddp", "fsdp"])
    args = parser.parse_args()
    for style in args.styles:
        result = sc.launch(worker, 2, args=(style, args.backend), timeout_s=900)[0]
        print(f"{style} {args.backend}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in result.items()))


if __name__ == "__main__":
    main()
