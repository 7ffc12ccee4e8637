"""Turn the suite's numbers into targets, JSON, a markdown table and (if possible) a plot."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .cpu_suite import PAIRS, TORCH_COMPILE_DDP, compiled_name

STYLE = {"compiled_ddp": "ddp", "compiled_fsdp": "fsdp", "compiled_tp": "tp"}
# Step-time ratio (compiled / torch eager) each style aims for (issue 16's CPU targets).
TIME_TARGETS = {"ddp": 1.0, "fsdp": 0.6, "tp": 0.7}
BACKENDS = ("eager", "inductor")
COMPILE_SCALING_TARGET = 2.2


def write_json_md(stem: Path, result: dict[str, Any], md: str) -> None:
    """``<stem>.json`` (the result) and ``<stem>.md`` (its table), printed as well."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    stem.with_suffix(".md").write_text(md)
    print(md)


def minimum_bytes(style: str, param_bytes: int) -> int | None:
    """Least payload per rank and step (the collectives module's convention): DDP all-reduces every
    gradient once; FSDP gathers every parameter once and reduce-scatters every gradient
    once. TP has no simple minimum: reported as measured."""
    return {"ddp": param_bytes, "fsdp": 2 * param_bytes}.get(style)


def rows(suite: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per model, style and lowering backend that ran."""
    out = []
    for case_name, case in suite["cases"].items():
        times = case["step_seconds"]
        for (compiled, torch_run), backend in (
            (pair, b) for pair in PAIRS for b in BACKENDS if compiled_name(pair[0], b) in times
        ):
            style = STYLE[compiled]
            compiled = compiled_name(compiled, backend)
            comp = case["compiled"][compiled]
            minimum = minimum_bytes(style, case["param_bytes"])
            ratio = times[compiled] / times[torch_run]
            bytes_ratio = comp["total_bytes"] / minimum if minimum else None
            row = {
                "model": case_name,
                "style": style,
                "backend": backend,
                "torch_run": torch_run,
                "compiled_ms": 1e3 * times[compiled],
                "torch_ms": 1e3 * times[torch_run],
                "floor_ms": 1e3 * times["eager_1dev"],
                "ratio": ratio,
                "time_target": TIME_TARGETS[style],
                "time_met": ratio <= TIME_TARGETS[style],
                "collectives": comp["counts"],
                "bytes": comp["total_bytes"],
                "min_bytes": minimum,
                "bytes_ratio": bytes_ratio,
                "bytes_met": None if bytes_ratio is None else round(bytes_ratio, 2) <= 1.0,
                "state_bytes_compiled": case["memory_per_rank"][compiled]["total"],
                "state_bytes_torch": case["memory_per_rank"][torch_run]["total"],
                "compile_seconds": comp["compile_seconds"],
                "compile_count": comp["compile_count"],
            }
            if style == "tp":
                row["torch_bytes"] = case["torch_tp_collectives"]["total_bytes"]
            out.append(row)
    return out


def peer_rows(suite: dict[str, Any]) -> list[dict[str, Any]]:
    """Per model with the torch.compile peer: its step beside torch DDP and compiled ddp
    on each backend, and every run's first-step seconds (compiles included)."""
    out = []
    for case_name, case in suite["cases"].items():
        times = case["step_seconds"]
        if TORCH_COMPILE_DDP not in times:
            continue
        peer = times[TORCH_COMPILE_DDP]
        row: dict[str, Any] = {
            "model": case_name,
            "torch_ddp_ms": 1e3 * times["torch_ddp"],
            "torch_compile_ddp_ms": 1e3 * peer,
            "torch_compile_vs_ddp": peer / times["torch_ddp"],
            "torch_compile_first_step_s": case["first_step_seconds"][TORCH_COMPILE_DDP],
        }
        for backend in BACKENDS:
            name = compiled_name("compiled_ddp", backend)
            if name in times:
                row[f"compiled_ddp_{backend}_vs_torch_compile"] = times[name] / peer
        out.append(row)
    return out


def compile_rows(table: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Compile seconds per model, style and backend (every program, lowering included)."""
    return [
        {k: r[k] for k in ("model", "style", "backend", "compile_seconds", "compile_count")}
        for r in table
    ]


def _kinds(counts: dict[str, int]) -> str:
    short = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS", "all_to_all": "A2A"}
    if not counts:
        return "none"
    return " ".join(f"{n}{short.get(k, k)}" for k, n in sorted(counts.items()))


def _met(value: bool | None) -> str:
    return "n/a" if value is None else ("met" if value else "**missed**")


def cuda_rows(suite: dict[str, Any]) -> list[dict[str, Any]]:
    """``rows`` plus each run's step peak above resident bytes (None where not measured)."""
    table = rows(suite)
    for r in table:
        peaks = suite["cases"][r["model"]]["step_peak_bytes"]
        r["step_peak_compiled"] = peaks[f"compiled_{r['style']}"]
        r["step_peak_torch"] = peaks[r["torch_run"]]
    return table


def _time_cells(r: dict[str, Any], backend_column: bool = False) -> str:
    """The cells both suites' tables open with: model to bytes/step (with the lowering
    backend after the style in the CPU suite's table)."""
    backend = f" {r['backend']} |" if backend_column else ""
    return (
        f"| {r['model']} | {r['style']} vs {r['torch_run']} |{backend} {r['compiled_ms']:.2f} | "
        f"{r['torch_ms']:.2f} | {r['ratio']:.2f} (<= {r['time_target']}: "
        f"{_met(r['time_met'])}) | {r['floor_ms']:.2f} | {_kinds(r['collectives'])} | "
        f"{r['bytes']:,} |"
    )


def _mib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:.2f}"


def _device_line(device: dict[str, Any]) -> str:
    """Where the numbers come from, for the first line of the CUDA table."""
    if device["type"] == "cuda":
        return (
            f"{device['name']} (compute capability {device['capability']}, CUDA "
            f"{device['cuda']}, torch {device['torch']})"
        )
    return f"{device['name']} (CPU, {device['cpu_count']} cores, torch {device['torch']})"


def cuda_markdown(results: dict[str, Any], table: list[dict[str, Any]]) -> str:
    """The CUDA suite's tables: world-1 step times and peaks, then simulated parity."""
    suite, wall = results["suite"], results["wall_seconds"]
    lines = [
        f"CUDA suite on {_device_line(results['device'])}: world {suite['world_size']} on "
        f"{suite['backend']}, median of {results['options']['steps']} steps after "
        f"{results['options']['warmup']} warm-up, 7 runs per model alternating A/B in one "
        f"launch. Wall time {wall['device_suite']:.0f} s, simulation "
        f"{wall['simulation']:.0f} s.",
        "",
        "| model | style | compiled ms | torch ms | ratio (target) | floor ms | "
        "collectives/step | bytes/step | step peak MiB above resident (compiled / torch) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        lines.append(
            f"{_time_cells(r)} {_mib(r['step_peak_compiled'])} / {_mib(r['step_peak_torch'])} |"
        )
    lines += [
        "",
        "Simulated ranks on the device's tensors against the single-device step:",
        "",
        "| model | style | ranks x steps | param rel diff | optimizer rel diff | "
        "loss rel diff | parity | compile s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in results["simulation"]:
        lines.append(
            f"| {p['model']} | {p['style']} | {p['world_size']} x {p['steps']} | "
            f"{p['param_rel_diff']:.1e} | {p['optimizer_rel_diff']:.1e} | "
            f"{p['loss_rel_diff']:.1e} | < {p['tolerance']:g}: {_met(p['parity_ok'])} | "
            f"{p['compile_seconds']:.1f} ({p['compile_count']} programs) |"
        )
    lines += ["", "Notes:"] + [f"- {note}" for note in results["notes"]]
    return "\n".join(lines) + "\n"


def _steps_measured(results: dict[str, Any]) -> str:
    """``9 steps``, or with rounds (``--min-seconds``) the range over the models."""
    options = results["options"]
    counts = sorted(
        options["steps"] * c.get("rounds", 1) for c in results["suite"]["cases"].values()
    )
    if not counts or counts[0] == counts[-1]:
        return f"{counts[0] if counts else options['steps']} steps"
    return (
        f"{counts[0]}-{counts[-1]} steps (rounds of {options['steps']} until every run had "
        f"{options.get('min_seconds', 0):g} s of timed steps)"
    )


def markdown(results: dict[str, Any], table: list[dict[str, Any]]) -> str:
    suite = results["suite"]
    cal = suite["calibration"]
    lines = [
        f"CPU suite: {suite['world_size']} gloo ranks, 1 torch thread each, median of "
        f"{_steps_measured(results)} after {results['options']['warmup']} warm-up "
        "(a step's time is its slowest rank's), pairs alternating A/B in one launch. "
        f"Suite wall time {results['wall_seconds']['cpu_suite']:.0f} s.",
        *_load_lines(results),
        "",
        "| model | style | backend | compiled ms | torch ms | ratio (target) | 1-dev eager ms | "
        "collectives/step | bytes/step | min bytes | bytes ratio | state MiB/rank (compiled / torch) | compile s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        min_bytes = f"{r['min_bytes']:,}" if r["min_bytes"] else "n/a"
        if r["bytes_ratio"] is None:
            bytes_ratio = f"torch TP: {r['torch_bytes']:,}"
        else:
            bytes_ratio = f"{r['bytes_ratio']:.3f} ({_met(r['bytes_met'])})"
        lines.append(
            f"{_time_cells(r, backend_column=True)} {min_bytes} | {bytes_ratio} | "
            f"{r['state_bytes_compiled'] / 2**20:.2f} / {r['state_bytes_torch'] / 2**20:.2f} | "
            f"{r['compile_seconds']:.1f} ({r['compile_count']} programs) |"
        )
    lines += _peer_lines(results["suite"])
    scaling = results["compile_scaling"]
    lines += [
        "",
        f"Compile time ({scaling['mode']}, {scaling['world_size']} simulated ranks, first "
        "program: capture + expand + passes), demo GPT width 64:",
        "",
        "| layers | capture s | expand s | passes s | total s | s / layer | graph nodes |",
        "|---|---|---|---|---|---|---|",
    ]
    for n, rec in scaling["layers"].items():
        lines.append(
            f"| {n} | {rec['capture']:.2f} | {rec['expand']:.2f} | {rec['passes']:.2f} | "
            f"{rec['total']:.2f} | {rec['total'] / int(n):.2f} | {int(rec['nodes'])} |"
        )
    ratio = scaling["time_ratio"]
    deep, half = scaling["ratio_layers"]
    lines += [
        "",
        f"time({deep}) / time({half}) = {ratio:.2f} (target <= {COMPILE_SCALING_TARGET}: "
        f"{_met(ratio <= COMPILE_SCALING_TARGET)})",
        "",
        "Simulated timelines (model, not measurement: `benchmarks/timeline.py`; gloo "
        f"calibrated alpha {cal['alpha_seconds'] * 1e6:.0f} us, beta "
        f"{cal['beta_bytes_per_second'] / 1e9:.2f} GB/s; compute "
        f"{results['compute_model']['flops_per_second'] / 1e9:.1f} GFLOP/s matmul, "
        f"{results['compute_model']['bytes_per_second'] / 1e9:.1f} GB/s, "
        f"{results['compute_model']['per_op_seconds'] * 1e6:.1f} us/op):",
        "",
        "| program | modelled step ms | compute ms | comm ms | exposed comm ms | exposed fraction | trace |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, t in results["timelines"].items():
        lines.append(
            f"| {name} | {t['step'] * 1e3:.2f} | {t['compute'] * 1e3:.2f} | "
            f"{t['communication'] * 1e3:.2f} | {t['exposed'] * 1e3:.2f} | "
            f"{t['exposed_fraction']:.2f} | `{t['file']}` |"
        )
    lines += ["", "Notes:"] + [f"- {note}" for note in results["notes"]]
    return "\n".join(lines) + "\n"


def _load_lines(results: dict[str, Any]) -> list[str]:
    """How loaded the machine was (other jobs share it) and Inductor's settings."""
    load, env = results.get("load_average"), results.get("inductor_env") or {}
    lines = []
    if load:
        def fmt(avg: list[float]) -> str:
            return " / ".join(f"{v:.1f}" for v in avg)

        lines.append(
            f"Load average (1 / 5 / 15 min) on {load['cores']} cores: {fmt(load['before'])} "
            f"before the suite, {fmt(load['after'])} after it"
            + (f"; {load['note']}" if load.get("note") else "") + "."
        )
    if any(env.values()):
        lines.append("Inductor: " + ", ".join(f"{k}={v}" for k, v in env.items() if v) + ".")
    return lines


def _peer_lines(suite: dict[str, Any]) -> list[str]:
    """The torch.compile peer beside torch DDP and compiled ddp per backend."""
    peers = peer_rows(suite)
    if not peers:
        return []
    lines = [
        "",
        "torch.compile peer (`torch.compile` over the DDP-wrapped model; loss, backward() "
        "call and AdamW eager), step ms and ratios from the same launch:",
        "",
        "| model | torch DDP ms | torch.compile+DDP ms | torch.compile / DDP | "
        "compiled ddp eager / torch.compile | compiled ddp inductor / torch.compile | "
        "torch.compile first step s |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in peers:
        cells = [
            f"{p[f'compiled_ddp_{b}_vs_torch_compile']:.2f}"
            if f"compiled_ddp_{b}_vs_torch_compile" in p else "n/a"
            for b in BACKENDS
        ]
        lines.append(
            f"| {p['model']} | {p['torch_ddp_ms']:.2f} | {p['torch_compile_ddp_ms']:.2f} | "
            f"{p['torch_compile_vs_ddp']:.2f} | {' | '.join(cells)} | "
            f"{p['torch_compile_first_step_s']:.1f} |"
        )
    return lines


def plot(table: list[dict[str, Any]], path: str) -> str | None:
    """Bar plot of step times; returns why it was skipped, or None when written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no PNG plot was written (pip install -e .[bench])."
    labels = [f"{r['model']}\n{r['style']} {r.get('backend', 'eager')}" for r in table]
    xs = range(len(table))
    fig, ax = plt.subplots(figsize=(max(6, len(table)), 4))
    ax.bar([x - 0.2 for x in xs], [r["compiled_ms"] for r in table], 0.4, label="compiled")
    ax.bar([x + 0.2 for x in xs], [r["torch_ms"] for r in table], 0.4, label="torch eager")
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("median step ms")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return None


def write(results: dict[str, Any], folder: str, name: str) -> dict[str, str]:
    """``{name}.json``, ``{name}.md`` and (with matplotlib) ``{name}.png`` in ``folder``;
    ``name`` is the suite (``cpu`` or ``cuda``), which picks the tables."""
    os.makedirs(folder, exist_ok=True)
    table = (cuda_rows if name == "cuda" else rows)(results["suite"])
    why_no_plot = plot(table, os.path.join(folder, f"{name}.png"))
    if why_no_plot:
        results["notes"].append(why_no_plot)
    results["table"] = table
    if name == "cpu":
        results["torch_compile_peer"] = peer_rows(results["suite"])
    paths = {"json": os.path.join(folder, f"{name}.json"), "md": os.path.join(folder, f"{name}.md")}
    with open(paths["json"], "w") as f:
        json.dump(results, f, indent=2, default=str)
    with open(paths["md"], "w") as f:
        f.write((cuda_markdown if name == "cuda" else markdown)(results, table))
    return paths
