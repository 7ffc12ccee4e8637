"""The lowering benchmark: the per-rank program interpreted vs lowered through Inductor.

``python -m benchmarks.lowering --device cuda`` (world 1 on NCCL, the GPU machine) or
``--device cpu`` (2 gloo ranks). Per model, in one launch with runs alternating step by
step: the single-device eager step, torch.compile of that whole step (the issue's GPU
peer), torch DDP, torch.compile over DDP, compiled ddp with
the fx interpreter and with Inductor, FSDP2, compiled fsdp with Inductor. Reports median
step ms after warm-up, the ratios the kernels issue targets, compile seconds (Inductor's
lowering included) and, on CUDA, each run's step peak memory. Writes
``benchmarks/results/lowering_<device>.{json,md}``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import spmd_compiler as sc

from .cpu_suite import (
    CUDA_GRAPHS,
    FLOOR,
    build_run,
    pipelined_step_seconds,
    step_peak_bytes,
    timed_step,
)
from .cuda_suite import device_record
from .models import CPU_CASES, CUDA_CASES, Case, global_batches
from .report import write_json_md

RUNS = (
    "eager_1_device", "torch_compile_1dev", "torch_ddp", "torch_compile_ddp", "compiled_ddp",
    "compiled_ddp@inductor", "torch_fsdp2", "compiled_fsdp@inductor",
)
# on CUDA also: each lowered step replayed as a CUDA graph, beside torch.compile's
# "reduce-overhead" mode (its CUDA graphs) of the single-device step
CUDA_RUNS = RUNS + tuple(
    n + CUDA_GRAPHS
    for n in ("torch_compile_1dev", "compiled_ddp@inductor", "compiled_fsdp@inductor")
)
# a lowered run -> its torch eager peer
LOWERED = {
    "compiled_ddp@inductor": "torch_ddp",
    "compiled_fsdp@inductor": "torch_fsdp2",
    "compiled_ddp@inductor" + CUDA_GRAPHS: "torch_ddp",
    "compiled_fsdp@inductor" + CUDA_GRAPHS: "torch_fsdp2",
}
RESULTS = Path(__file__).parent / "results"


def _build(name: str, case: Case, rank: int, world: int, device: str) -> Any:
    return build_run(FLOOR if name == "eager_1_device" else name, case, rank, world, device)


def bench(
    rank: int, world: int, cases: tuple[Case, ...], device: str, warmup: int, steps: int,
    names: tuple[str, ...] = RUNS,
) -> dict:
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(rank)
    out: dict[str, Any] = {}
    for case in cases:
        runs, first_call = {}, {}
        data = [(x.to(device), y.to(device)) for x, y in global_batches(case, warmup + steps)]
        times: dict[str, list[float]] = {n: [] for n in names}
        # a run that raises is dropped and its error kept, so that one peer failing (a
        # torch.compile of this torch) does not cost a device call the others' figures
        errors: dict[str, str] = {}
        for name in names:
            runs[name] = _build(name, case, rank, world, device)
        for i, (x, y) in enumerate(data):
            order = names if i % 2 == 0 else names[::-1]
            for name in order:
                if name in errors:
                    continue
                start = time.perf_counter()
                try:
                    seconds = timed_step(runs[name], x, y)
                except Exception as exc:  # recorded in the result and printed
                    errors[name] = f"{type(exc).__name__}: {exc}"[:2000]
                    print(f"lowering: {case.name} {name} failed: {errors[name][:300]}", flush=True)
                    continue
                if i == 0:
                    first_call[name] = time.perf_counter() - start
                if i >= warmup:
                    times[name].append(seconds)
        for name in errors:
            del runs[name], times[name]
        record: dict[str, Any] = {"step_ms": {n: 1e3 * statistics.median(t) for n, t in times.items()}}
        # the same runs stepped back to back, the host free to run ahead of the device
        record["pipelined_ms"] = {
            n: 1e3 * pipelined_step_seconds(r, data[warmup:]) for n, r in runs.items()
        }
        record["errors"] = errors
        record["first_call_s"] = first_call
        record["compile_s"] = {
            n: r.step.timings.compile_seconds for n, r in runs.items()
            if isinstance(r.step, sc.CompiledTrainStep)
        }
        x, y = data[0]
        # a run replaying CUDA graphs allocates nothing in a step (its graphs' memory pool
        # was taken when they were recorded): no step peak to compare
        record["peak_mib"] = {
            n: (b / 2**20 if (b := step_peak_bytes(r, x, y)) is not None else None)
            for n, r in runs.items() if not n.endswith(CUDA_GRAPHS)
        }
        out[case.name] = record
        if rank == 0:
            print(f"lowering: {case.name} done: " + ", ".join(
                f"{n} {ms:.2f} ms" for n, ms in record["step_ms"].items()), flush=True)
    return out


def _ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or b is None else f"{a / b:.2f}"


def _ms(ms: dict[str, float], name: str) -> str:
    """A run's step ms; "n/a" for a run the result has not (written before it existed)."""
    return f"{ms[name]:.2f}" if name in ms else "n/a"


def _per_run_table(cases: dict, runs: list[str], key: str) -> list[str]:
    """A markdown table of each case's ``key`` figure (ms) per run."""
    return [
        "| model | " + " | ".join(runs) + " |",
        "|---|" + "---|" * len(runs),
        *(f"| {name} | " + " | ".join(_ms(r.get(key, {}), n) for n in runs) + " |"
          for name, r in cases.items()),
    ]


def markdown(result: dict) -> str:
    dev, cases = result["device"], result["cases"]
    present = [n for n in CUDA_RUNS if any(n in r["step_ms"] for r in cases.values())]
    lines = [
        f"Lowering benchmark on {dev['name']} (torch {dev['torch']}), world {result['world']}, "
        f"median of {result['steps']} steps after {result['warmup']}. Step ms:",
        "",
        *_per_run_table(cases, present, "step_ms"),
    ]
    if any("pipelined_ms" in r for r in cases.values()):
        lines += [
            "",
            "The same runs stepped back to back (no sync between steps: the host may queue "
            "a step while the device computes the last), ms per step:",
            "",
            *_per_run_table(cases, present, "pipelined_ms"),
        ]
    lines += [
        "",
        "Targets, per lowered run: step against its torch peer (DDP or FSDP2), against "
        "torch.compile of the single-device step (default mode, and with CUDA graphs), "
        "against torch.compile over DDP; the step's peak memory against the peer's; "
        "compile seconds. A run replaying CUDA graphs has no step peak (its graphs' memory "
        "was taken when they were recorded).",
        "",
        "| model | run | / torch peer | / torch.compile 1 dev | / torch.compile 1 dev "
        "(CUDA graphs) | / torch.compile+DDP | peak MiB (run / peer) | compile s |",
        "|" + "---|" * 8,
    ]
    for name, r in cases.items():
        ms, pk, cs = r["step_ms"], r["peak_mib"], r["compile_s"]
        for run, peer in LOWERED.items():
            if run not in ms:
                continue
            peak = (f"{pk[run]:.0f} / {pk[peer]:.0f}"
                    if pk.get(run) is not None and pk.get(peer) is not None else "n/a")
            lines.append(
                f"| {name} | {run} | {_ratio(ms[run], ms.get(peer))} | "
                f"{_ratio(ms[run], ms.get('torch_compile_1dev'))} | "
                f"{_ratio(ms[run], ms.get('torch_compile_1dev' + CUDA_GRAPHS))} | "
                f"{_ratio(ms[run], ms.get('torch_compile_ddp'))} | {peak} | "
                + (f"{cs[run]:.1f}" if run in cs else "n/a") + " |"
            )
    for name, r in cases.items():
        for run, error in r.get("errors", {}).items():
            lines.append(f"\n{name} {run} failed: {error[:300]}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per run")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run")
    parser.add_argument("--cases", default="", help="comma-separated model names (default: all)")
    parser.add_argument(
        "--runs", default="",
        help="comma-separated runs (default: all; on CUDA the CUDA-graph runs too): "
        + ", ".join(CUDA_RUNS),
    )
    parser.add_argument(
        "--out", type=Path, default=None,
        help="where to write <out>.json and <out>.md (default: benchmarks/results/lowering_<device>)",
    )
    args = parser.parse_args(argv)
    cases = CUDA_CASES if args.device == "cuda" else CPU_CASES
    if args.cases:
        cases = tuple(c for c in cases if c.name in args.cases.split(","))
    names = CUDA_RUNS if args.device == "cuda" else RUNS
    if args.runs:
        names = tuple(n for n in CUDA_RUNS if n in args.runs.split(","))
    world, backend = (1, "nccl") if args.device == "cuda" else (2, "gloo")
    per_rank = sc.launch(
        bench, world, backend=backend, timeout_s=3600,
        args=(cases, args.device, args.warmup, args.steps, names),
    )
    # a step's time is its slowest rank's median; compile and memory from rank 0
    merged = per_rank[0]
    for other in per_rank[1:]:
        for case, rec in other.items():
            for key in ("step_ms", "pipelined_ms"):
                mine = merged[case][key]
                for n in list(mine):  # a run that failed on some rank is dropped
                    if n in rec[key]:
                        mine[n] = max(mine[n], rec[key][n])
                    else:
                        del mine[n]
    result = {
        "device": device_record(args.device), "world": world, "warmup": args.warmup,
        "steps": args.steps, "cases": merged,
    }
    write_json_md(args.out or RESULTS / f"lowering_{args.device}", result, markdown(result))


if __name__ == "__main__":
    main()
