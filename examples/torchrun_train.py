"""Train the demo GPT with a compiled step under torchrun, one process per rank, any
number of nodes; rank 0 checks the result against the single-device step.

    # one machine, 2 ranks (CPU: gloo; GPUs: nccl, one per rank)
    torchrun --nproc-per-node 2 examples/torchrun_train.py --mode ddp --steps 4

    # 2 nodes x 8 GPUs: run on every node, with the same endpoint and job id
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \
        --rdzv-endpoint HOST0:29400 --rdzv-id job42 examples/torchrun_train.py --mode fsdp

Each rank trains on its share of every global batch (``compiled_worker`` of the demo);
rank 0 then runs the undecorated step eagerly on the global batches on one device and
compares every step's loss and every parameter and optimizer-state tensor. The exit code
is 1 when they differ by more than ``--tolerance`` (relative); ``--json PATH`` writes
rank 0's report.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.distributed as dist

import spmd_compiler as sc
from spmd_compiler.tools.demo.run import DemoConfig, compiled_worker, run_reference
from spmd_compiler.tools.parity import compare_states, relative_difference


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", default="ddp", help="dtensor_expand, ddp, fsdp, tp, fsdp_tp")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16, help="global batch size")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--embd", type=int, default=64)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--tolerance", type=float, default=1e-5)
    p.add_argument("--json", metavar="PATH", help="rank 0 writes its report here")
    return p.parse_args()


def main() -> int:
    args = _parse()
    info = sc.init_from_env()
    config = DemoConfig(
        mode=args.mode, world_size=info.world_size, backend=info.backend, steps=args.steps,
        batch_size=args.batch_size, n_layer=args.layers, n_embd=args.embd,
        n_head=args.heads, block_size=args.block_size, vocab_size=args.vocab,
        tolerance=args.tolerance, device=str(info.device),
    )
    result = compiled_worker(info.rank, info.world_size, config)  # collectives inside
    ok = True
    if info.rank == 0:
        reference_losses, reference_state = run_reference(config)
        diffs = compare_states(
            {k: v.cpu() for k, v in result["state"].items()},
            {k: v.cpu() for k, v in reference_state.items()},
        )
        loss_diff = max(
            relative_difference(torch.tensor(a), torch.tensor(b))
            for a, b in zip(result["losses"], reference_losses, strict=True)
        )
        state_diff = max(diffs.values())
        ok = max(loss_diff, state_diff) < args.tolerance
        report = {
            "world_size": info.world_size, "backend": info.backend, "mode": args.mode,
            "losses": result["losses"], "reference_losses": reference_losses,
            "max_loss_rel_diff": loss_diff, "max_state_rel_diff": state_diff,
            "state_tensors_compared": len(diffs), "parity_ok": ok,
        }
        print(json.dumps(report, indent=1))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
    dist.barrier()  # every rank done (rank 0 computed the reference) before teardown
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
