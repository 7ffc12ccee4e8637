"""Data parallelism on your own model: DDP-style replicate, FSDP-style fully_shard, and
fully_shard with mixed precision (bf16 compute, fp32 master weights).

    python examples/data_parallel.py [--steps 3] [--world-size 4]

Runs on simulated ranks in this process (pass the GLOBAL batch); on real ranks, call the
same step under torchrun with each rank's local batch (examples/torchrun_ddp.py).
"""

from __future__ import annotations

import torch
from _common import arguments, make, reference_losses, report, train_step

import spmd_compiler as sc
from spmd_compiler.parallel_modes import DataParallel, MixedPrecisionPolicy


def run(mode, world_size: int, steps: int) -> list[float]:
    model, optim, data = make(steps=steps)
    step = sc.compile(parallel_mode=mode)(train_step)
    with sc.simulate(world_size=world_size):
        return [float(step(model, optim, x, y)) for x, y in data]


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    reference = reference_losses(0, args.steps)
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for title, mode, tolerance in [
        ("replicate (DDP)", DataParallel("replicate"), 1e-5),
        ("fully_shard (FSDP)", DataParallel("fully_shard"), 1e-5),
        # bf16 compute is not fp32 compute: compare loosely
        ("fully_shard, bf16 params, fp32 reduce", DataParallel("fully_shard", mp_policy=bf16), 3e-2),
    ]:
        print(f"== {title}")
        report(run(mode, args.world_size, args.steps), reference, tolerance)


if __name__ == "__main__":
    main()
