"""Attention in a compiled step on 2 gloo ranks: torch's CPU flash kernel (NOTE: [the CPU
flash kernel at capture]) against the math formulation the programs computed before
(scores, softmax, product; the kernel switched off at capture), beside torch DDP, in one
launch with the steps interleaved.

``python -m benchmarks.cpu_attention [--length 512] [--backend eager]`` prints, per
variant, the median step ms and the step's peak CPU allocation on rank 0
(``_torch_private.cpu_allocation_peak``: the profiler's allocation totals). The model:
two causal self-attention blocks (width 256, 8 heads), global batch 8, AdamW, float32.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler import _torch_private as private
from spmd_compiler.parallel_modes import DataParallel

WIDTH, HEADS, BATCH, STEPS = 256, 8, 8, 9


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(y.transpose(1, 2).reshape(b, n, WIDTH))


def attention_step(model, optim, x):  # noqa: ANN001
    loss = model(x).pow(2).mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(_Block(), _Block())
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _compiled(flash: bool, backend: str, x: torch.Tensor) -> Any:
    model, optim = _model()
    original = private.eager_attention_takes_cpu_flash
    if not flash:  # the math formulation, as every program computed it before
        private.eager_attention_takes_cpu_flash = lambda *args: False  # type: ignore[assignment]
    try:
        step = sc.compile(parallel_mode=DataParallel("replicate"), backend=backend)(attention_step)
        step(model, optim, x)
    finally:
        private.eager_attention_takes_cpu_flash = original  # type: ignore[assignment]
    return lambda: step(model, optim, x)


def _torch_ddp(x: torch.Tensor) -> Any:
    model, _ = _model()
    ddp = nn.parallel.DistributedDataParallel(model)
    optim = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    return lambda: attention_step(ddp, optim, x)


def worker(rank: int, world: int, length: int, backend: str) -> dict[str, tuple[float, int]]:
    x = torch.randn(BATCH, length, WIDTH, generator=torch.Generator().manual_seed(1)).chunk(world)[rank]
    runs = {
        "flash kernel": _compiled(True, backend, x),
        "math formulation": _compiled(False, backend, x),
        "torch DDP": _torch_ddp(x),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(STEPS):
        for name, run in runs.items():
            dist.barrier()
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    peaks = {}
    for name, run in runs.items():
        dist.barrier()
        peaks[name] = private.cpu_allocation_peak(run)
    return {name: (statistics.median(times[name]) * 1e3, peaks[name]) for name in runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--backend", default="eager", choices=("eager", "inductor"))
    args = parser.parse_args()
    result = sc.launch(worker, 2, args=(args.length, args.backend), timeout_s=1800)[0]
    print(f"sequence {args.length}, backend {args.backend}, 2 gloo ranks, median of {STEPS} steps:")
    for name, (ms, peak) in result.items():
        print(f"  {name:17s} {ms:8.2f} ms   step peak {peak / 2**20:8.1f} MiB")


if __name__ == "__main__":
    main()
