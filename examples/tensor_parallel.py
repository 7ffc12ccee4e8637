"""Tensor parallelism on your own model with torch's own plan styles.

    python examples/tensor_parallel.py [--steps 3] [--world-size 4]

The plan maps module FQN patterns (``*`` matches one name) to torch's ParallelStyles:
``up`` column-wise (its output features split over ranks), ``down`` row-wise (its input
features split; its output all-reduced). ``head`` is not in the plan: replicated.
Every tensor-parallel rank sees the whole batch.
"""

from __future__ import annotations

from _common import arguments, make, reference_losses, report, train_step
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import spmd_compiler as sc
from spmd_compiler.parallel_modes import TensorParallel

PLAN = {"up": ColwiseParallel(), "down": RowwiseParallel()}


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    model, optim, data = make(steps=args.steps)
    step = sc.compile(parallel_mode=TensorParallel(PLAN))(train_step)
    with sc.simulate(world_size=args.world_size):
        losses = [float(step(model, optim, x, y)) for x, y in data]
        print(f"up.weight is now {type(model.up.weight).__name__} {model.up.weight.placements}")
    report(losses, reference_losses(0, args.steps), 1e-5)


if __name__ == "__main__":
    main()
