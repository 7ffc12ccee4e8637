"""2-D parallelism on your own model: FSDP over ``dp`` x tensor parallel over ``tp``.

    python examples/fsdp_tp.py [--steps 3]

A (dp=2, tp=2) mesh of 4 simulated ranks: each parameter is one DTensor on the parent
mesh, TP-sharded by the plan on ``tp`` and sharded again on ``dp``; the batch is split
over ``dp``. The tp split of each parameter must itself split evenly over dp.
"""

from __future__ import annotations

from _common import arguments, make, reference_losses, report, train_step
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import spmd_compiler as sc
from spmd_compiler.parallel_modes import FullyShardTensorParallel

PLAN = {"up": ColwiseParallel(), "down": RowwiseParallel()}


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    model, optim, data = make(steps=args.steps)
    mode = FullyShardTensorParallel(PLAN, mesh_shape=(2, 2))  # or mesh=init_device_mesh(...)
    step = sc.compile(parallel_mode=mode)(train_step)
    with sc.simulate(world_size=4):
        losses = [float(step(model, optim, x, y)) for x, y in data]
        print(f"up.weight placements on (dp, tp): {model.up.weight.placements}")
    report(losses, reference_losses(0, args.steps), 1e-5)


if __name__ == "__main__":
    main()
