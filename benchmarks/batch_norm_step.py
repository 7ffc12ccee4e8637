"""Step time of a batch-norm convolutional network: compiled ddp (interpreted) against
torch DDP, 2 gloo ranks, medians of interleaved steps.

    python -m benchmarks.batch_norm_step [--size 32] [--local-batch 16] [--steps 9]

torch DDP normalizes with each rank's own batch statistics (``nn.SyncBatchNorm``, the
same computation as the compiled step's global statistics, refuses CPU tensors), so the
peer does less communication than the compiled step. NOTE: [variances by sums].
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import spmd_compiler as sc
from spmd_compiler.parallel_modes import DataParallel
from spmd_compiler.tools.demo.steps import classification_train_step as _step


def _net() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    channels = 3
    for width in (16, 32, 32, 64):
        layers += [nn.Conv2d(channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
        channels = width
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 10))


def _rank(rank: int, world: int, size: int, local: int, steps: int) -> tuple[float, float, float]:
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(local, 3, size, size, generator=gen)
    y = torch.randint(0, 10, (local,), generator=gen)
    model = _net()
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    compiled = sc.compile(DataParallel("replicate"))(_step)
    peer = nn.parallel.DistributedDataParallel(_net())
    peer_optim = torch.optim.SGD(peer.parameters(), lr=0.01)
    start = time.perf_counter()
    compiled(model, optim, x, y)
    compiled(model, optim, x, y)
    compile_s = time.perf_counter() - start
    _step(peer, peer_optim, x, y)
    ours, theirs = [], []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        compiled(model, optim, x, y)
        ours.append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        _step(peer, peer_optim, x, y)
        theirs.append(time.perf_counter() - start)
    return statistics.median(ours) * 1e3, statistics.median(theirs) * 1e3, compile_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--local-batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=9)
    a = parser.parse_args()
    ours, theirs, compile_s = sc.launch(
        _rank, 2, args=(a.size, a.local_batch, a.steps), timeout_s=1200
    )[0]
    print(
        f"{a.size} x {a.size} images, local batch {a.local_batch}: compiled ddp {ours:.1f} ms, "
        f"torch DDP {theirs:.1f} ms ({ours / theirs:.2f}x), compile {compile_s:.1f} s"
    )


if __name__ == "__main__":
    main()
