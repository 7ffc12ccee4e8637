"""The same compiled step on real ranks, started by torchrun (gloo on CPU, NCCL on GPU).

    torchrun --nproc-per-node 2 examples/torchrun_ddp.py [--steps 3]

Each rank builds the same model (same seed), joins the process group from torchrun's
environment (``sc.init_from_env()``) and passes ITS OWN share of every global batch.
Rank 0 prints the losses beside the single-device reference on the global batch, then
the validation loss of a compiled evaluation step (a step without an optimizer) beside
the single-device one: both are global values.
Without torchrun, ``sc.launch(fn, world_size)`` spawns the ranks itself.
"""

from __future__ import annotations

import argparse

import torch.distributed as dist
from _common import (
    eval_step,
    held_out,
    make,
    reference_losses,
    reference_validation,
    report,
    train_step,
)

import spmd_compiler as sc
from spmd_compiler.parallel_modes import DataParallel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="train steps (default 3)")
    args = parser.parse_args()
    info = sc.init_from_env()  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from torchrun
    rank = info.rank
    model, optim, data = make(steps=args.steps)
    model.to(info.device)  # cuda:LOCAL_RANK under NCCL (parameters moved in place)
    data = [(x.to(info.device), y.to(info.device)) for x, y in data]
    mode = DataParallel("replicate")
    step = sc.compile(parallel_mode=mode)(train_step)
    losses = []
    for x, y in data:  # this rank's share of the global batch, as the mode splits it
        local_x, local_y = mode.local_batch(x, rank, index=0), mode.local_batch(y, rank, index=1)
        losses.append(float(step(model, optim, local_x, local_y)))
    evaluate = sc.compile(parallel_mode=mode)(eval_step)  # no optimizer: a validation step
    x, y = (t.to(info.device) for t in held_out())
    validation, accuracy = evaluate(model, mode.local_batch(x, rank, index=0),
                                    mode.local_batch(y, rank, index=1))
    if rank == 0:
        report(losses, reference_losses(0, args.steps), 1e-5)
        expected = reference_validation(0, args.steps)
        print(f"validation: compiled {float(validation):.6f} (accuracy {float(accuracy):.3f})"
              f"  single device {expected:.6f}")
        if abs(float(validation) - expected) > 1e-5 * abs(expected):
            raise SystemExit(1)
    dist.barrier()  # every rank done (rank 0 computed the reference) before teardown
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
