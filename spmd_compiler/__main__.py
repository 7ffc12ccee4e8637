"""Command line: ``python -m spmd_compiler {demo,explain} [options]``; ``--help`` per command.

torch is imported only once a command runs, so ``--help`` and ``--version`` answer at
once. A bad option or a step that cannot be compiled ends in one ``error:`` line (the
compile error's details below it) and exit code 2; a parity failure in the demo is 1.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys

MODES = ("dtensor_expand", "ddp", "fsdp", "tp", "fsdp_tp")
MODE_HELP = (
    "parallel mode: dtensor_expand (replicate state, DTensor's own expansion), ddp "
    "(DataParallel replicate), fsdp (DataParallel fully_shard), tp (TensorParallel with "
    "the GPT's plan), fsdp_tp (FullyShardTensorParallel on a DPxTP mesh); default %(default)s"
)
LOG_LEVEL_ENV = "SPMD_LOG_LEVEL"


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _mesh(text: str) -> tuple[int, ...]:
    if not re.fullmatch(r"\d+x\d+", text.lower()):
        raise argparse.ArgumentTypeError(f"{text!r} is not a DPxTP mesh such as 2x2")
    mesh = tuple(int(n) for n in text.lower().split("x"))
    if min(mesh) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every mesh dimension must be at least 1")
    return mesh


def _probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"{value} is not in [0, 1)")
    return value


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", choices=MODES, default="dtensor_expand", metavar="MODE", help=MODE_HELP)
    # default None, read as 4: an explicit one that --mesh contradicts is refused
    p.add_argument("--world-size", type=_positive, default=None, metavar="N",
                   help="number of ranks (simulated or real); default 4 (DP*TP with --mesh)")
    p.add_argument("--mesh", type=_mesh, default=(), metavar="DPxTP",
                   help="mesh for fsdp_tp, e.g. 2x2; sets the world size to DP*TP "
                   "(default: 2 x world-size/2)")
    p.add_argument("--layers", type=_positive, default=2, metavar="N",
                   help="transformer layers of the demo GPT; default %(default)s")


def _demo_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo", help="train a small GPT compiled, beside the single-device run",
        description="Train the demo GPT with a compiled step on N ranks, print each step's "
        "loss beside the single-device reference, the collectives per step and parity. "
        "Exit code 1 when parity fails.",
    )
    _common(p)
    p.add_argument("--backend", choices=("sim", "gloo", "nccl"), default="sim",
                   help="sim: simulated ranks in this process; gloo/nccl: real processes "
                   "(nccl: one per GPU); default %(default)s")
    p.add_argument("--steps", type=_positive, default=8, metavar="N",
                   help="train steps; default %(default)s")
    p.add_argument("--batch-size", type=_positive, default=16, metavar="N",
                   help="global batch size (a multiple of the data-parallel ranks); "
                   "default %(default)s")
    p.add_argument("--dropout", type=_probability, default=0.0, metavar="P",
                   help="dropout probability; parity is checked only at 0 (default)")
    p.add_argument("--seed", type=int, default=0, help="model and data seed; default %(default)s")
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON")


def _explain_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "explain", help="compile the demo GPT step once (simulated) and explain it",
        description="Compile the demo GPT step once on simulated ranks and print each "
        "parameter's placement and per-rank bytes, the collectives of one step in issue "
        "order (with what each bucket carries) and the passes applied.",
    )
    _common(p)
    p.add_argument("--json", metavar="PATH", help="also write the tables as JSON")
    p.add_argument("--dump", action="store_true", help="also print the per-rank program")


def build_parser() -> argparse.ArgumentParser:
    from spmd_compiler import __version__

    parser = argparse.ArgumentParser(
        prog="python -m spmd_compiler",
        description="spmd_compiler: compile a whole PyTorch train step into one SPMD "
        "program. Environment: SPMD_PROGRESS, SPMD_LOG_LEVEL, SPMD_DEBUG, SPMD_DEBUG_DIR, "
        "SPMD_DISABLE_PASSES, SPMD_COMPILER_CACHE_DIR, SPMD_TEST_BACKEND "
        "(docs/environment.md).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo,explain}")
    _demo_parser(sub)
    _explain_parser(sub)
    return parser


def _world(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.mesh and args.mode != "fsdp_tp":
        parser.error(f"--mesh is for --mode fsdp_tp, not {args.mode}")
    if args.mesh and args.world_size is not None and args.world_size != args.mesh[0] * args.mesh[1]:
        # it ran at DP*TP ranks, the --world-size dropped without a word
        parser.error(f"--world-size {args.world_size} contradicts --mesh {args.mesh[0]}x{args.mesh[1]} "
                     f"({args.mesh[0] * args.mesh[1]} ranks); give one of the two")
    default = 4 if args.world_size is None else args.world_size
    world_size = args.mesh[0] * args.mesh[1] if args.mesh else default
    if args.mode == "fsdp_tp" and not args.mesh and world_size % 2:
        parser.error(f"--mode fsdp_tp needs an even --world-size or a --mesh (got {world_size})")
    batch = getattr(args, "batch_size", None)
    ranks = _data_parallel_ranks(args, world_size)
    if batch is not None and batch % ranks:
        parser.error(f"--batch-size {batch} does not split over {ranks} data-parallel ranks")
    if getattr(args, "backend", None) == "nccl":
        import torch

        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if found < world_size:
            parser.error(f"--backend nccl runs one rank per CUDA device: {world_size} ranks need "
                         f"{world_size} devices, found {found}; use --backend gloo (or sim) here")
    return world_size


def _data_parallel_ranks(args: argparse.Namespace, world_size: int) -> int:
    """The ranks the batch is split over: tp gives every rank the whole batch; fsdp_tp
    splits it over the dp ranks (demo_mode: 2 by default)."""
    return {"tp": 1, "fsdp_tp": args.mesh[0] if args.mesh else 2}.get(args.mode, world_size)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    world_size = _world(parser, args)
    level = os.environ.get(LOG_LEVEL_ENV, "WARNING").upper()
    if not isinstance(logging.getLevelName(level), int):
        parser.error(f"{LOG_LEVEL_ENV}={level!r} is not a logging level (DEBUG, INFO, WARNING, ...)")
    logging.basicConfig(level=level)
    from spmd_compiler.errors import SPMDCompileError

    try:
        return _run(args, world_size)
    except SPMDCompileError as exc:
        first, _, rest = str(exc).partition("\n")
        print(f"{parser.prog}: error: {first}", file=sys.stderr)
        if rest:
            print(rest, file=sys.stderr)
        return 2


def _run(args: argparse.Namespace, world_size: int) -> int:
    if args.command == "demo":
        from spmd_compiler.tools.demo.run import DemoConfig, print_report, run_demo, write_json

        config = DemoConfig(
            mode=args.mode, world_size=world_size, backend=args.backend, mesh=args.mesh,
            steps=args.steps, batch_size=args.batch_size, n_layer=args.layers,
            dropout=args.dropout, seed=args.seed,
            device="cuda" if args.backend == "nccl" else "cpu",
        )
        report = run_demo(config, show_steps=True)
        print_report(report)
        if args.json:
            write_json(report, args.json)
        return 0 if report.parity_ok else 1
    from spmd_compiler.tools.demo.run import DemoConfig
    from spmd_compiler.tools.explain import explain_demo
    from spmd_compiler.tools.explain import write_json as write_explanation_json

    # explain has no --batch-size: the demo's batch, rounded up to split over the dp ranks
    ranks = _data_parallel_ranks(args, world_size)
    batch_size = -(-DemoConfig.batch_size // ranks) * ranks
    config = DemoConfig(mode=args.mode, world_size=world_size, mesh=args.mesh, n_layer=args.layers,
                        steps=1, batch_size=batch_size)
    explanation, _ = explain_demo(config)
    print(explanation.format(dump=args.dump))
    if args.json:
        write_explanation_json(explanation, args.json, dump=args.dump)
    return 0


if __name__ == "__main__":
    sys.exit(main())
