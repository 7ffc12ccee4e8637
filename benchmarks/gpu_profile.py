"""Where a step's time goes on the device, compiled beside torch's runs.

``python -m benchmarks.gpu_profile --device cuda --case gpt-4x256`` (one NCCL rank; ``--device
cpu``: one gloo rank). Per run (default: the single-device eager step, torch.compile of it,
compiled ddp lowered through Inductor): warm-up steps, the median wall time of ``--steps``
synchronized steps and of the same steps back to back, then the same number of steps under
``torch.profiler``, each in a ``gpu_profile.step`` range. Reports per step: kernels
launched, the device time of those kernels summed (busy; the profiler's user ranges, which
it mirrors onto the device's timeline, left out), the kernels (on CPU: the ops) that took
the most time, where a profiled step's wall time goes (``_timeline``: host work before the
first compiled graph, the graph calls, the first kernel's start, device busy and the gaps
between kernels), and the host ranges the step called directly. Writes
``benchmarks/results/profile_<device>_<case>.{json,md}`` (or ``--out``), and after each run
the runs so far to ``<out>.partial.json`` (removed at the end), so a cut-off call keeps them.

Written for the kernels issue's GPU gap (compiled ddp 1.19x torch.compile's step on
gpt-8x512, an H200, 2026-11-27): whether the extra time is in more kernels, slower kernels
or an idle device tells where to look.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

import spmd_compiler as sc

from .cpu_suite import FLOOR, build_run, pipelined_step_seconds, timed_step
from .cuda_suite import device_record
from .models import CPU_CASES, CUDA_CASES, Case, global_batches
from .report import write_json_md

RESULTS = Path(__file__).parent / "results"
DEFAULT_RUNS = (FLOOR, "torch_compile_1dev", "compiled_ddp@inductor")
TOP = 12
STEP_MARK = "gpu_profile.step"
GRAPH_MARK = "## Call CompiledFxGraph"  # Inductor's range around each compiled graph's call
TIMELINE_COLUMNS = (
    "wall_ms", "host_before_graphs_ms", "graph_calls", "graph_call_host_ms", "after_graphs_ms",
    "first_kernel_ms", "device_busy_ms", "device_gaps_ms", "device_gaps_over_20us_ms",
    "device_done_to_end_ms",
)


def _is_kernel(e: Any) -> bool:
    """A device event that is work (a kernel, a copy, a fill), not a user range the
    profiler mirrors onto the device's timeline (``record_function`` ranges, Inductor's
    graph-call ranges, ``Optimizer.step#...``), which would count a step's whole wall as
    busy."""
    return (
        getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA
        and not getattr(e, "is_user_annotation", False)
    )


def _kernel_rows(prof: Any, on_cuda: bool, steps: int) -> tuple[list[dict[str, Any]], int, float]:
    """(top rows, kernels per step, busy microseconds per step) of a profile: CUDA kernels
    on a GPU, ops with their self CPU time on CPU."""
    rows = []
    for e in prof.key_averages():
        if on_cuda:
            if not _is_kernel(e):
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


def _union_us(spans: list[tuple[float, float]]) -> tuple[float, list[float]]:
    """(time covered by ``spans``, counting overlaps once; the gaps between them)."""
    total, end, gaps = 0.0, float("-inf"), []
    for a, b in sorted(spans):
        if b > end:
            if end > float("-inf") and a > end:
                gaps.append(a - end)
            total += b - max(a, end)
            end = b
    return total, gaps


def _timeline(events: Any, on_cuda: bool) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Where a profiled step's wall time goes (medians over the profiled steps, ms), and
    the host ranges the step called directly (per step: calls, ms).

    Host: the work before the first compiled graph is called (Inductor's range), the
    calls of compiled graphs (launching their kernels), what follows the last call
    (reading the loss, waiting for the device). Device (GPU): the first kernel's start,
    the time some kernel ran, the gaps between kernels (the device waiting on the host)
    and the gaps over 20 us summed, and the time from the last kernel's end to the
    step's."""
    cpu = torch.autograd.DeviceType.CPU
    host = [e for e in events if getattr(e, "device_type", cpu) == cpu]
    steps = [e for e in host if e.name == STEP_MARK]
    graphs = sorted(
        (e.time_range.start, e.time_range.end) for e in host if e.name.startswith(GRAPH_MARK)
    )
    kernels = sorted(
        (e.time_range.start, e.time_range.end) for e in events if on_cuda and _is_kernel(e)
    )
    rows: dict[str, list[float]] = {}  # microseconds per step
    calls: list[int] = []  # compiled graphs called per step
    children: dict[str, list[float]] = {}
    for step in steps:
        s0, s1 = step.time_range.start, step.time_range.end
        gs = [g for g in graphs if s0 <= g[0] < s1]
        ks = [k for k in kernels if s0 <= k[0] < s1]
        row = {"wall": s1 - s0}
        if gs:
            row |= {
                "host_before_graphs": gs[0][0] - s0,
                "graph_call_host": sum(b - a for a, b in gs),
                "after_graphs": s1 - gs[-1][1],
            }
        if ks:
            busy, gaps = _union_us(ks)
            row |= {
                "first_kernel": ks[0][0] - s0,
                "device_busy": busy,
                "device_gaps": sum(gaps),
                "device_gaps_over_20us": sum(g for g in gaps if g > 20),
                "device_done_to_end": s1 - max(b for _, b in ks),
            }
        for k, v in row.items():
            rows.setdefault(k, []).append(v)
        calls.append(len(gs))
        for child in step.cpu_children:
            entry = children.setdefault(child.name, [0.0, 0.0])
            entry[0] += 1
            entry[1] += child.time_range.end - child.time_range.start
    timeline = {f"{k}_ms": statistics.median(vs) / 1e3 for k, vs in rows.items()}
    if calls:
        timeline["graph_calls"] = statistics.median(calls)
    n = max(1, len(steps))
    ranked = sorted(children.items(), key=lambda item: -item[1][1])
    called = [{"name": name, "calls": c / n, "ms": us / n / 1e3} for name, (c, us) in ranked]
    return timeline, called[:TOP]


def profile_runs(
    rank: int, world: int, case: Case, runs: tuple[str, ...], device: str, warmup: int, steps: int,
    partial: Path | None = None,
) -> dict[str, Any]:
    """Per run: its figures, or its error. ``partial``: where rank 0 writes the runs done so
    far after each one (json), so a call cut off at its time limit keeps them."""
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
            back_to_back = pipelined_step_seconds(run, data[warmup : warmup + steps])
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
            with profile(activities=activities) as prof:
                for x, y in data[warmup + steps :]:
                    timed_step(run, x, y, mark=STEP_MARK)
        except Exception as exc:  # one failing run must not cost the others' figures
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            print(f"gpu_profile: {case.name} {name} failed: {out[name]['error'][:300]}", flush=True)
            continue
        top, kernels, busy_us = _kernel_rows(prof, on_cuda, steps)
        timeline, host_calls = _timeline(prof.events(), on_cuda)
        wall_ms = 1e3 * wall
        seen = on_cuda and kernels > 0  # no kernel rows: this profiler reported none
        out[name] = {
            "wall_ms": wall_ms,
            "back_to_back_ms": 1e3 * back_to_back,
            "kernels_per_step": kernels,
            "busy_ms": busy_us / 1e3 if seen else None,
            "idle_fraction": max(0.0, 1 - busy_us / 1e3 / wall_ms) if seen else None,
            "timeline": timeline,
            "host_calls": host_calls,
            "top": top,
        }
        if rank == 0:
            print(f"gpu_profile: {case.name} {name}: {wall_ms:.2f} ms, {kernels} kernels", flush=True)
            if partial is not None:
                partial.write_text(json.dumps(out, indent=1))
    return out


def markdown(result: dict[str, Any]) -> str:
    dev = result["device"]
    lines = [
        f"Step profile of {result['case']} on {dev['name']} (torch {dev['torch']}), one rank, "
        f"median wall of {result['steps']} steps after {result['warmup']}, then "
        f"{result['steps']} steps profiled.",
        "",
        "| run | wall ms | back to back ms | kernels / step | device busy ms | device idle |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in result["runs"].items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error'][:200]} | | | |")
            continue
        busy = "n/a" if r["busy_ms"] is None else f"{r['busy_ms']:.2f}"
        idle = "n/a" if r["idle_fraction"] is None else f"{100 * r['idle_fraction']:.0f}%"
        lines.append(
            f"| {name} | {r['wall_ms']:.2f} | {r['back_to_back_ms']:.2f} | {r['kernels_per_step']} "
            f"| {busy} | {idle} |"
        )
    seen = {k for r in result["runs"].values() for k in r.get("timeline", {})}
    keys = [k for k in TIMELINE_COLUMNS if k in seen]
    if keys:
        lines += [
            "", "Where a profiled step's wall time goes (median ms; NOTE in `_timeline`):", "",
            "| run | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys),
        ]
        for name, r in result["runs"].items():
            t = r.get("timeline", {})
            cells = ["" if t.get(k) is None else f"{t[k]:.2f}" for k in keys]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for name, r in result["runs"].items():
        if "error" in r:
            continue
        lines += ["", f"Top of {name} (per step):", "", "| kernel | calls | us |", "|---|---|---|"]
        lines += [f"| `{t['name'][:90]}` | {t['calls']:.1f} | {t['us']:.1f} |" for t in r["top"]]
        lines += ["", f"Host ranges {name}'s step called (per step):", "", "| range | calls | ms |",
                  "|---|---|---|"]
        lines += [f"| `{t['name'][:90]}` | {t['calls']:.1f} | {t['ms']:.3f} |" for t in r["host_calls"]]
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
    out = args.out or RESULTS / f"profile_{args.device}_{case.name}"
    per_run = sc.launch(
        profile_runs, 1, backend=backend, timeout_s=3600,
        args=(case, runs, args.device, args.warmup, args.steps, out.with_suffix(".partial.json")),
    )[0]
    result = {
        "device": device_record(args.device), "case": case.name, "warmup": args.warmup,
        "steps": args.steps, "runs": per_run,
    }
    write_json_md(out, result, markdown(result))
    out.with_suffix(".partial.json").unlink(missing_ok=True)


if __name__ == "__main__":
    main()
