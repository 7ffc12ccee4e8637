"""``python -m benchmarks.run --suite cpu|cuda``: run a suite and write benchmarks/results/.

``cpu`` has three parts: the gloo suite (``cpu_suite``), compile-time scaling
(``compile_scaling``) and simulated timelines of the compiled programs (``timeline``).
``cuda`` (``cuda_suite``) needs a visible GPU: every style at world 1 on NCCL, and
simulated ranks on CUDA tensors checked against the single-device step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch

import spmd_compiler as sc
from spmd_compiler.passes.cost_model import CostModel

from . import progress
from .compile_scaling import LAYERS, compile_scaling
from .cpu_suite import SuiteOptions, run_cpu_suite
from .cuda_suite import (
    PARITY_TOLERANCE,
    SIMULATED_STEPS,
    SIMULATED_WORLD,
    device_record,
    run_device_suite,
    simulation_parity,
)
from .models import (
    CPU_CASES,
    CUDA_CASES,
    STYLES,
    Case,
    build_model,
    build_optimizer,
    global_batches,
    parallel_mode,
    train_step,
)
from .timeline import ComputeModel, calibrate_compute, export_timeline

RESULTS = os.path.join(os.path.dirname(__file__), "results")
RATIO_NOTE = "ratio = compiled / torch eager median step time; lower is better."
BYTES_NOTE = (
    "bytes: per-rank payload per step by the collectives module's convention (all_reduce: tensor, "
    "all_gather: gathered output, reduce_scatter: full input). Minimum: ddp = gradient "
    "bytes; fsdp = params gathered once + grads reduce-scattered once. FSDP2 (reshard "
    "after forward) gathers twice, so its own minimum would be 3x params. The compiled "
    "steps also all-reduce the loss's partial sum (inside the gradient bucket under ddp) "
    "and its total weight (for an exact global mean): 8 bytes over the minimum. Counts are "
    "the program's collectives: on these real CPU ranks the total weight's all-reduce "
    "rides the per-call input check's round instead (NOTE: [reductions that ride the "
    "input check]), which is not counted."
)
NOTES = [
    RATIO_NOTE,
    BYTES_NOTE,
    "tp: no simple minimum; the torch TP column is what eager parallelize_module issued in "
    "one step (functional collectives counted with a dispatch mode).",
    "state MiB/rank: params + grads + optimizer state computed from each rank's local "
    "shapes, NOT a measured peak: activations, buffers and DDP/FSDP communication buffers "
    "are excluded (no honest per-rank peak on CPU: tracemalloc does not see torch's "
    "allocator, and RSS mixes all runs of one process).",
    "compile s: step.timings.compile_seconds on rank 0 (every program, counted beside the "
    "seconds: AdamW's state is made before the first program, so one; with backend "
    "inductor it includes Inductor's lowering to C++ kernels), real gloo ranks "
    "sharing 2 cores with other work. Run with an empty TORCHINDUCTOR_CACHE_DIR (cold "
    "Inductor compiles, also for the torch.compile peer) and TORCHINDUCTOR_COMPILE_THREADS=1 "
    "(no compile worker pool per rank on 2 cores); the header says what was set.",
    "backend: eager = the per-rank fx program interpreted op by op; inductor = the same "
    "program lowered by Inductor to C++ kernels (spmd_compiler/lower.py).",
    "torch.compile peer: torch.compile(DistributedDataParallel(model)) in default mode "
    "(Inductor): Dynamo captures the forward, DDPOptimizer splits it at DDP's bucket "
    "boundaries, AOTAutograd compiles forward and backward; cross entropy, the "
    "loss.backward() call and AdamW.step() run eagerly (no compiled_autograd, no compiled "
    "optimizer). first step s: the wall time of its first call (compiles included).",
    "1-dev eager ms: the undecorated step on the GLOBAL batch in one process with one "
    "thread (both ranks run it at once, one per core): the floor a 2-rank run should beat.",
    "fsdp bytes: the GPTs' programs gather again in backward the parameters backward "
    "needs (reshard after forward: ~1.94x the parameter bytes in all-gathers, 1.47-1.49x "
    "the no-regather minimum, less than FSDP2's own 3x-params pattern); the MLPs' move the "
    "minimum: merge_regathers dropped their re-gather, which lowered no estimated peak "
    "(NOTE: [re-gathers that save nothing]).",
    "timelines: the compute model (calibrated matmul/elementwise throughput + per-op "
    "overhead) ignores the eager runtime's Python and dispatch cost per node, so modelled "
    "steps are well below measured ones; use them for the overlap picture, not for time.",
    "This machine (2 cores, shared with other jobs) is noisy: single ratios can move by "
    "~10-20% between runs.",
]


CUDA_NOTES = [
    RATIO_NOTE,
    "world 1: nothing crosses devices, so the times compare the compiled program with "
    "torch's DDP / FSDP2 / TP wrappers on one device and say nothing about scaling. "
    "collectives/step and bytes/step are the compiled world-1 program's (none when this "
    "code path ran on CPU: a one-rank program needs no communication).",
    "timing: each step starts after a barrier and torch.cuda.synchronize(), and ends after "
    "reading the loss and torch.cuda.synchronize() (the optimizer's kernels included).",
    "floor ms: the undecorated step on the global batch in the same process.",
    "step peak MiB above resident: for each run separately, after the timed steps, one more "
    "step between torch.cuda.reset_peak_memory_stats() and max_memory_allocated(), minus "
    "memory_allocated() just before it. It counts what the caching allocator hands out "
    "during a step (activations, gradients, temporaries, communication buffers it "
    "allocates); the resident parameters and optimizer state of all seven runs in the "
    "process are excluded, and NCCL's own buffers are not seen. n/a on CPU.",
    f"simulation: the compiled step on {SIMULATED_WORLD} simulated ranks (sc.simulate, "
    f"tensors on the device) for {SIMULATED_STEPS} steps beside the undecorated step on "
    "one device on the global batch, same seed; relative difference max|a-b|/max|b| over "
    "every parameter, buffer and optimizer-state tensor, and over the returned losses; "
    f"parity means below {PARITY_TOLERANCE:g}. compile s: step.timings.compile_seconds.",
]


def timelines(
    cost: CostModel, compute: ComputeModel, case: Case, folder: str = RESULTS
) -> dict[str, Any]:
    """Compile ``case`` per mode on 2 simulated ranks; export each steady-state program."""
    out = {}
    for i, mode_name in enumerate(STYLES, 1):
        model = build_model(case)
        optim = build_optimizer(model.parameters())
        step = sc.compile(parallel_mode=parallel_mode(case, mode_name))(train_step(case))
        with sc.simulate(world_size=2):
            for x, y in global_batches(case, 2):
                step(model, optim, x, y)
        path = os.path.join(folder, f"timeline_{mode_name}.json")
        summary = export_timeline(step.last_program.graph_module, path, cost, compute)
        out[f"{case.name} {mode_name}"] = {**summary, "file": os.path.relpath(path)}
        progress.report(
            "timelines", i, len(STYLES),
            f"{mode_name}: exposed {summary['exposed_fraction']:.2f}",
        )
    return out


QUICK_CASES = (Case("mlp-32", "mlp", 32, 0, 8),)


def run_cpu(
    options: SuiteOptions,
    quick: bool = False,
    folder: str = RESULTS,
    names: tuple[str, ...] = (),
) -> dict[str, Any]:
    """The whole CPU suite; ``quick`` is a smoke run (one tiny model, 1-2 layers);
    ``names`` picks models of the suite by name (all when empty)."""
    cases, layers = (QUICK_CASES, (1, 2)) if quick else (CPU_CASES, LAYERS)
    if names:
        unknown = set(names) - {c.name for c in cases}
        if unknown:
            raise SystemExit(f"[bench] unknown model(s) {sorted(unknown)}; "
                             f"choose from {[c.name for c in cases]}")
        cases = tuple(c for c in cases if c.name in names)
    wall: dict[str, float] = {}
    start = time.perf_counter()
    print(f"[bench] cpu suite: {len(cases)} models x 3 styles on 2 gloo ranks", flush=True)
    load = {"cores": os.cpu_count(), "before": os.getloadavg()}
    suite = run_cpu_suite(cases, options)
    load["after"] = os.getloadavg()
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
        "load_average": load,
        "inductor_env": {
            k: os.environ.get(k)
            for k in ("TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_COMPILE_THREADS")
        },
        "notes": list(NOTES),
        "torch": torch.__version__,
    }


def run_cuda(
    options: SuiteOptions, quick: bool = False, device: str = "cuda", backend: str = "nccl"
) -> dict[str, Any]:
    """The whole CUDA suite; ``device="cpu"``, ``backend="gloo"`` runs the same code on
    CPU (the unit test does). ``quick`` is a smoke run (one tiny model)."""
    cases = QUICK_CASES if quick else CUDA_CASES
    record = device_record(device)
    wall: dict[str, float] = {}
    start = time.perf_counter()
    print(
        f"[bench] cuda suite on {record['name']}: {len(cases)} models x 7 runs at world 1 "
        f"on {backend}, then {SIMULATED_WORLD} simulated ranks on {device} tensors",
        flush=True,
    )
    suite = run_device_suite(cases, options, device, backend)
    wall["device_suite"] = time.perf_counter() - start
    mark = time.perf_counter()
    parity = simulation_parity(cases, device)
    wall["simulation"] = time.perf_counter() - mark
    wall["total"] = time.perf_counter() - start
    return {
        "device": record,
        "options": vars(options),
        "suite": suite,
        "simulation": parity,
        "wall_seconds": wall,
        "notes": list(CUDA_NOTES),
        "torch": torch.__version__,
    }


# --steps / --warmup when not given: GPU steps take milliseconds, so the CUDA suite can
# afford more of them (and needs them: a few slow steps skew a short median).
# The CPU suite runs every compiled style on both lowering backends beside the
# torch.compile peer; the CUDA suite keeps its seven runs (the lowering benchmark,
# ``benchmarks.lowering``, times Inductor there).
DEFAULT_OPTIONS = {
    "cpu": SuiteOptions(backends=("eager", "inductor"), torch_compile_peer=True, min_seconds=1.0),
    "cuda": SuiteOptions(warmup=5, steps=20),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--steps", type=int, help="measured steps (cpu 9, cuda 20)")
    parser.add_argument(
        "--warmup",
        type=int,
        help="warm-up steps (cpu 3, cuda 5); at least 2: a compiled step may compile on "
        "its first two calls (SGD momentum: the call that makes its state, then the steady "
        "one)",
    )
    parser.add_argument(
        "--backends",
        help="comma-separated lowering backends of the compiled runs (cpu: eager,inductor; "
        "cuda: eager)",
    )
    parser.add_argument(
        "--no-torch-compile", action="store_true", help="leave out the torch.compile peer"
    )
    parser.add_argument("--cases", default="", help="comma-separated models (cpu; default all)")
    parser.add_argument(
        "--min-seconds",
        type=float,
        help="measure in rounds of --steps until every run has this many seconds of timed "
        "steps (cpu 1.0, cuda 0: one round)",
    )
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument("--quick", action="store_true", help="smoke run: one tiny model")
    parser.add_argument(
        "--from-json", help="re-render the tables from a results JSON of --suite's kind"
    )
    args = parser.parse_args(argv)
    from .report import write

    if args.from_json:
        with open(args.from_json) as f:
            results = json.load(f)
        results["notes"] = list(CUDA_NOTES if args.suite == "cuda" else NOTES)
        print(f"[bench] re-rendered {write(results, args.out, args.suite)['md']}")
        return 0
    default = DEFAULT_OPTIONS[args.suite]
    options = SuiteOptions(
        warmup=default.warmup if args.warmup is None else args.warmup,
        steps=default.steps if args.steps is None else args.steps,
        backends=tuple(args.backends.split(",")) if args.backends else default.backends,
        torch_compile_peer=default.torch_compile_peer and not args.no_torch_compile,
        min_seconds=default.min_seconds if args.min_seconds is None else args.min_seconds,
    )
    if args.suite == "cuda":
        if not torch.cuda.is_available():
            print(
                "[bench] --suite cuda: no CUDA device is visible (torch.cuda.is_available() "
                "is False); run it on a machine with a GPU and a CUDA build of torch, or use "
                "--suite cpu.",
                file=sys.stderr,
            )
            return 2
        results = run_cuda(options, args.quick)
    else:
        names = tuple(n for n in args.cases.split(",") if n)
        results = run_cpu(options, args.quick, args.out, names)
    paths = write(results, args.out, args.suite)
    print(
        f"[bench] wrote {paths['json']} and {paths['md']} "
        f"(total {results['wall_seconds']['total']:.0f} s)",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
