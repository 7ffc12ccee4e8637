"""Command line: ``python -m spmd_compiler demo [--mode ...] [--world-size N] ...``."""

from __future__ import annotations

import argparse
import logging
import os
import sys


def _demo_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="train a small GPT compiled, beside the single-device run")
    p.add_argument("--mode", default="dtensor_expand", help="parallel mode: dtensor_expand, ddp, fsdp, tp, fsdp_tp")
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--mesh", default="", help="DPxTP mesh for fsdp_tp, e.g. 2x2 (sets the world size)")
    p.add_argument("--backend", choices=("sim", "gloo", "nccl"), default="sim",
                   help="sim: simulated ranks in this process; gloo/nccl: real processes")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=16, help="global batch size")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dropout", type=float, default=0.0,
                   help="dropout probability (parity is checked only at 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the report as JSON")


def _explain_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("explain", help="compile the demo GPT step once (simulated) and explain it")
    p.add_argument("--mode", default="dtensor_expand", help="parallel mode: dtensor_expand, ddp, fsdp, tp, fsdp_tp")
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--mesh", default="", help="DPxTP mesh for fsdp_tp, e.g. 2x2 (sets the world size)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--json", metavar="PATH", help="write the tables as JSON")
    p.add_argument("--dump", action="store_true", help="also print the per-rank program")


def _mesh_and_world(args: argparse.Namespace) -> tuple[tuple[int, ...], int]:
    mesh = tuple(int(n) for n in args.mesh.lower().split("x")) if args.mesh else ()
    world_size = args.world_size
    if mesh:
        world_size = 1
        for n in mesh:
            world_size *= n
    return mesh, world_size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spmd_compiler")
    sub = parser.add_subparsers(dest="command", required=True)
    _demo_parser(sub)
    _explain_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=os.environ.get("SPMD_LOG_LEVEL", "WARNING"))
    if args.command == "demo":
        from spmd_compiler.demo.run import DemoConfig, print_report, run_demo, write_json

        mesh, world_size = _mesh_and_world(args)
        config = DemoConfig(
            mode=args.mode, world_size=world_size, backend=args.backend, mesh=mesh,
            steps=args.steps, batch_size=args.batch_size, n_layer=args.layers,
            dropout=args.dropout, seed=args.seed,
            device="cuda" if args.backend == "nccl" else "cpu",
        )
        report = run_demo(config, show_steps=True)
        print_report(report)
        if args.json:
            write_json(report, args.json)
        return 0 if report.parity_ok else 1
    if args.command == "explain":
        from spmd_compiler.demo.run import DemoConfig
        from spmd_compiler.explain import explain_demo, write_json

        mesh, world_size = _mesh_and_world(args)
        config = DemoConfig(mode=args.mode, world_size=world_size, mesh=mesh, n_layer=args.layers, steps=1)
        explanation, _ = explain_demo(config)
        print(explanation.format(dump=args.dump))
        if args.json:
            write_json(explanation, args.json, dump=args.dump)
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
