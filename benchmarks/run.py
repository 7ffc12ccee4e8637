"""``python -m benchmarks.run --suite cpu``: run the CPU suite and write benchmarks/results/.

Three parts: the gloo suite (``cpu_suite``), compile-time scaling (``compile_scaling``)
and simulated timelines of the compiled programs (``timeline``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch

import spmd_compiler as sc
from spmd_compiler.parallel_modes import make_mode
from spmd_compiler.passes.cost_model import CostModel

from .compile_scaling import LAYERS, compile_scaling
from .cpu_suite import SuiteOptions, run_cpu_suite
from .models import (
    CPU_CASES,
    Case,
    build_model,
    build_optimizer,
    global_batches,
    tp_plan,
    train_step,
)
from .timeline import ComputeModel, calibrate_compute, export_timeline

RESULTS = os.path.join(os.path.dirname(__file__), "results")
NOTES = [
    "ratio = compiled / torch eager median step time; lower is better.",
    "bytes: per-rank payload per step by comm_stats' convention (all_reduce: tensor, "
    "all_gather: gathered output, reduce_scatter: full input). Minimum: ddp = gradient "
    "bytes; fsdp = params gathered once + grads reduce-scattered once. FSDP2 (reshard "
    "after forward) gathers twice, so its own minimum would be 3x params. The compiled "
    "steps also all-reduce the loss (and fsdp the loss weight): 8 bytes over the minimum.",
    "tp: no simple minimum; the torch TP column is what eager parallelize_module issued in "
    "one step (functional collectives counted with a dispatch mode).",
    "state MiB/rank: params + grads + optimizer state computed from each rank's local "
    "shapes, NOT a measured peak: activations, buffers and DDP/FSDP communication buffers "
    "are excluded (no honest per-rank peak on CPU: tracemalloc does not see torch's "
    "allocator, and RSS mixes all runs of one process).",
    "compile s: step.timings.compile_seconds on rank 0 (both programs: the first step "
    "creates optimizer state, the second is the steady state), real gloo ranks sharing "
    "2 cores with other work.",
    "1-dev eager ms: the undecorated step on the GLOBAL batch in one process with one "
    "thread (both ranks run it at once, one per core): the floor a 2-rank run should beat.",
    "fsdp bytes: the compiled program's all-gathers move ~1.5x (MLP) to ~1.94x (GPT) the "
    "parameter bytes, i.e. (inferred from the counts, not traced) it gathers again in "
    "backward the parameters backward needs, like FSDP2's reshard after forward; hence "
    "1.25-1.5x the no-regather minimum, but less than FSDP2's own 3x-params pattern.",
    "timelines: the compute model (calibrated matmul/elementwise throughput + per-op "
    "overhead) ignores the eager runtime's Python and dispatch cost per node, so modelled "
    "steps are well below measured ones; use them for the overlap picture, not for time.",
    "This machine (2 cores, shared with other jobs) is noisy: single ratios can move by "
    "~10-20% between runs.",
]


def timelines(
    cost: CostModel, compute: ComputeModel, case: Case, folder: str = RESULTS
) -> dict[str, Any]:
    """Compile ``case`` per mode on 2 simulated ranks; export each steady-state program."""
    out = {}
    for mode_name in ("ddp", "fsdp", "tp"):
        mode = make_mode("tp", plan=tp_plan(case)) if mode_name == "tp" else make_mode(mode_name)
        model = build_model(case)
        optim = build_optimizer(model.parameters())
        step = sc.compile(parallel_mode=mode)(train_step(case))
        with sc.simulate(world_size=2):
            for x, y in global_batches(case, 2):
                step(model, optim, x, y)
        path = os.path.join(folder, f"timeline_{mode_name}.json")
        summary = export_timeline(step.last_program.graph_module, path, cost, compute)
        out[f"{case.name} {mode_name}"] = {**summary, "file": os.path.relpath(path)}
        print(
            f"[bench] timeline {mode_name}: exposed {summary['exposed_fraction']:.2f}", flush=True
        )
    return out


QUICK_CASES = (Case("mlp-32", "mlp", 32, 0, 8),)


def run_cpu(options: SuiteOptions, quick: bool = False, folder: str = RESULTS) -> dict[str, Any]:
    """The whole CPU suite; ``quick`` is a smoke run (one tiny model, 1-2 layers)."""
    cases, layers = (QUICK_CASES, (1, 2)) if quick else (CPU_CASES, LAYERS)
    wall: dict[str, float] = {}
    start = time.perf_counter()
    print(f"[bench] cpu suite: {len(cases)} models x 3 styles on 2 gloo ranks", flush=True)
    suite = run_cpu_suite(cases, options)
    wall["cpu_suite"] = time.perf_counter() - start
    torch.set_num_threads(1)
    mark = time.perf_counter()
    scaling = compile_scaling(layers)
    wall["compile_scaling"] = time.perf_counter() - mark
    mark = time.perf_counter()
    compute = calibrate_compute()
    cost = CostModel(**suite["calibration"])
    os.makedirs(folder, exist_ok=True)
    lanes = timelines(cost, compute, cases[0], folder)
    wall["timelines"] = time.perf_counter() - mark
    wall["total"] = time.perf_counter() - start
    return {
        "options": vars(options),
        "suite": suite,
        "compile_scaling": scaling,
        "compute_model": vars(compute),
        "timelines": lanes,
        "wall_seconds": wall,
        "notes": list(NOTES),
        "torch": torch.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=["cpu"], default="cpu")
    parser.add_argument("--steps", type=int, default=SuiteOptions.steps)
    parser.add_argument("--warmup", type=int, default=SuiteOptions.warmup)
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument("--quick", action="store_true", help="smoke run: one tiny model")
    parser.add_argument("--from-json", help="re-render the tables from a results JSON")
    args = parser.parse_args(argv)
    if args.from_json:
        from .report import write

        with open(args.from_json) as f:
            results = json.load(f)
        results["notes"] = list(NOTES)
        print(f"[bench] re-rendered {write(results, args.out, args.suite)['md']}")
        return 0
    results = run_cpu(SuiteOptions(warmup=args.warmup, steps=args.steps), args.quick, args.out)
    from .report import write

    paths = write(results, args.out, args.suite)
    print(
        f"[bench] wrote {paths['json']} and {paths['md']} "
        f"(total {results['wall_seconds']['total']:.0f} s)",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
