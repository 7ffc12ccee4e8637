"""Where a step's time goes on the device, compiled beside torch's runs.

``python -m benchmarks.gpu_profile --device cuda --case gpt-4x256`` (one NCCL rank; ``--device
cpu``: one gloo rank). Per run (default: the single-device eager step, torch.compile of it,
compiled ddp lowered through Inductor): warm-up steps, the median wall time of ``--steps``
steps, then the same number of steps under ``torch.profiler``. Reports per step: kernels
launched, the device time of those kernels summed (busy), the part of the wall time the
device was idle (1 - busy / wall: launch gaps, host work of the runtime and Python), and the
kernels (on CPU: the ops) that took the most time. Writes
``benchmarks/results/profile_<device>_<case>.{json,md}`` (or ``--out``).

Written for the kernels issue's GPU gap (compiled ddp 1.10x torch.compile's step on the
GPTs, an H200, 2026-11-27): whether the extra time is in more kernels, slower kernels or an
idle device tells the next GPU session where to look.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

import spmd_compiler as sc

from .cpu_suite import FLOOR, build_run, timed_step
from .cuda_suite import device_record
from .models import CPU_CASES, CUDA_CASES, Case, global_batches
from .report import write_json_md

RESULTS = Path(__file__).parent / "results"
DEFAULT_RUNS = (FLOOR, "torch_compile_1dev", "compiled_ddp@inductor")
TOP = 12


def _kernel_rows(prof: Any, on_cuda: bool, steps: int) -> tuple[list[dict[str, Any]], int, float]:
    """(top rows, kernels per step, busy microseconds per step) of a profile: CUDA kernels
    on a GPU, ops with their self CPU time on CPU."""
    rows = []
    for e in prof.key_averages():
        if on_cuda:
            if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
                continue
            us = e.self_device_time_total
        else:
            us = e.self_cpu_time_total
        rows.append({"name": e.key, "calls": e.count / steps, "us": us / steps})
    rows.sort(key=lambda r: -r["us"])
    if on_cuda:
        count, busy = round(sum(r["calls"] for r in rows)), sum(r["us"] for r in rows)
    else:  # CPU: every op the profiler saw; "busy" is not defined apart from the wall
        count, busy = round(sum(r["calls"] for r in rows if r["name"].startswith("aten::"))), 0.0
    return rows[:TOP], count, busy


def profile_runs(
    rank: int, world: int, case: Case, runs: tuple[str, ...], device: str, warmup: int, steps: int
) -> dict[str, Any]:
    on_cuda = torch.device(device).type == "cuda"
    if on_cuda:
        torch.cuda.set_device(rank)
    data = [(x.to(device), y.to(device)) for x, y in global_batches(case, warmup + 2 * steps)]
    out: dict[str, Any] = {}
    for name in runs:
        try:
            run = build_run(name, case, rank, world, device)
            for x, y in data[:warmup]:
                timed_step(run, x, y)
            wall = statistics.median(timed_step(run, x, y) for x, y in data[warmup : warmup + steps])
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
            with profile(activities=activities) as prof:
                for x, y in data[warmup + steps :]:
                    timed_step(run, x, y)
        except Exception as exc:  # one failing run must not cost the others' figures
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            print(f"gpu_profile: {case.name} {name} failed: {out[name]['error'][:300]}", flush=True)
            continue
        top, kernels, busy_us = _kernel_rows(prof, on_cuda, steps)
        wall_ms = 1e3 * wall
        seen = on_cuda and kernels > 0  # no kernel rows: this profiler reported none
        out[name] = {
            "wall_ms": wall_ms,
            "kernels_per_step": kernels,
            "busy_ms": busy_us / 1e3 if seen else None,
            "idle_fraction": max(0.0, 1 - busy_us / 1e3 / wall_ms) if seen else None,
            "top": top,
        }
        if rank == 0:
            print(f"gpu_profile: {case.name} {name}: {wall_ms:.2f} ms, {kernels} kernels", flush=True)
    return out


def markdown(result: dict[str, Any]) -> str:
    dev = result["device"]
    lines = [
        f"Step profile of {result['case']} on {dev['name']} (torch {dev['torch']}), one rank, "
        f"median wall of {result['steps']} steps after {result['warmup']}, then "
        f"{result['steps']} steps profiled.",
        "",
        "| run | wall ms | kernels / step | device busy ms | device idle |",
        "|---|---|---|---|---|",
    ]
    for name, r in result["runs"].items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error'][:200]} | | | |")
            continue
        busy = "n/a" if r["busy_ms"] is None else f"{r['busy_ms']:.2f}"
        idle = "n/a" if r["idle_fraction"] is None else f"{100 * r['idle_fraction']:.0f}%"
        lines.append(f"| {name} | {r['wall_ms']:.2f} | {r['kernels_per_step']} | {busy} | {idle} |")
    for name, r in result["runs"].items():
        if "error" in r:
            continue
        lines += ["", f"Top of {name} (per step):", "", "| kernel | calls | us |", "|---|---|---|"]
        lines += [f"| `{t['name'][:90]}` | {t['calls']:.1f} | {t['us']:.1f} |" for t in r["top"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--case", default="", help="model name (default: the first of the device's cases)")
    parser.add_argument("--runs", default=",".join(DEFAULT_RUNS), help="comma-separated run names")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None, help="<out>.json and <out>.md")
    args = parser.parse_args(argv)
    cases = CUDA_CASES if args.device == "cuda" else CPU_CASES
    case = next((c for c in cases if c.name == args.case), None) if args.case else cases[0]
    if case is None:
        parser.error(f"unknown case {args.case!r}; one of {', '.join(c.name for c in cases)}")
    runs = tuple(r for r in args.runs.split(",") if r)
    backend = "nccl" if args.device == "cuda" else "gloo"
    per_run = sc.launch(
        profile_runs, 1, backend=backend, timeout_s=3600,
        args=(case, runs, args.device, args.warmup, args.steps),
    )[0]
    result = {
        "device": device_record(args.device), "case": case.name, "warmup": args.warmup,
        "steps": args.steps, "runs": per_run,
    }
    write_json_md(args.out or RESULTS / f"profile_{args.device}_{case.name}", result, markdown(result))


if __name__ == "__main__":
    main()
