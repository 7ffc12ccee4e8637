"""``python -m benchmarks.real_models``: the model zoo compiled, beside eager, as a table.

Every zoo case (``benchmarks/zoo.py``: GPT-2, Llama, BERT, ViT under dtensor_expand / ddp /
fsdp at world 4, the decoders under tp at world 2, Llama under fsdp_tp 2x2) runs on
simulated ranks in float64 and float32 next to the same step run eagerly on one device
on the global batch. Writes ``benchmarks/results/real_models.{json,md}``; the md table
is the README's "real models" section.

Needs transformers (``pip install -e .[models]``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch

from . import progress
from .zoo import TOL, ZOO_CASES, ZooRun, run_case

RESULTS = os.path.join(os.path.dirname(__file__), "results")
DTYPES = {"float64": torch.float64, "float32": torch.float32}
FLOAT32_TOL = 1e-5  # the target for losses and parameters
NOTES = [
    "parity: relative difference max|a-b|/max|b| against the undecorated step run eagerly "
    "on one device on the global batch, same seed, after the given steps (AdamW, lr 1e-3). "
    "loss: the worst step's returned loss. params: every parameter; state: every "
    "parameter and optimizer-state tensor (worst tensor named).",
    "key biases (GPT-2's c_attn.bias key third, BERT's key.bias, ViT's k_proj.bias, "
    "Llama has none) have a zero gradient in exact arithmetic (softmax ignores a "
    "per-query constant): Adam turns their rounding noise into updates of order lr, so "
    "their relative difference is noise over noise. The 'float64 check' column compares "
    "tensors whose reference never moved beyond 1e-9 in absolute terms "
    f"(benchmarks/zoo.py: state_differences), against {TOL:g}.",
    "params rel without key biases: the same, with key biases (GPT-2: the middle third "
    "of c_attn.bias) left out. SGD (check column, float32 rows above 1e-5 only): the same "
    "case again with SGD; its updates are lr x gradient, not gradient / sqrt(v), so "
    "float32 rounding noise in a gradient stays noise-sized in the parameters.",
    "Llama under tp and fsdp_tp runs with RMSNorm computing in the model's dtype "
    "(transformers' LlamaRMSNorm casts to float32 even in a float64 model).",
    "compile s: step.timings.compile_seconds (every program compiled: one since AdamW's "
    "state is made before the first program; two before, the call that created the state "
    "and the steady one). step ms: median of the compiled "
    "steps after the first, N simulated ranks in ONE process (LocalTensorMode): a "
    "checking tool, not a real-rank time. eager ms: the undecorated step on one device, "
    "same process.",
    "This machine: 2 CPU cores shared with other jobs; times move 10-20% between runs. "
    "Runs made side by side (--merge) share the cores: their compile s and step ms are "
    "several times a lone run's (gpt2 ddp float64 run alone, same command: compile "
    "23.9 s, step 1668 ms, eager 24.7 ms).",
]


def record(run: ZooRun) -> dict[str, Any]:
    params = {k: v for k, v in run.raw_differences.items() if k.startswith("param.")}
    worst_param = max(params.items(), key=lambda kv: kv[1])
    worst_state = max(run.raw_differences.items(), key=lambda kv: kv[1])
    checked = max(run.state_differences.values())
    no_key = max(run.no_key_bias_differences.items(), key=lambda kv: kv[1])
    later = run.step_seconds[1:] or run.step_seconds
    return {
        "model": run.case.kind,
        "mode": run.case.mode,
        "ranks": "2x2" if run.case.mode == "fsdp_tp" else run.case.world,
        "dtype": run.dtype,
        "steps": run.steps,
        "loss_rel": max(run.loss_differences),
        "param_rel": worst_param[1],
        "param_worst": worst_param[0],
        "param_rel_no_key_bias": no_key[1],
        "param_no_key_bias_worst": no_key[0],
        "state_rel": worst_state[1],
        "state_worst": worst_state[0],
        "checked_rel": checked,
        "compile_s": run.compile_seconds,
        "step_ms": 1e3 * statistics.median(later),
        "eager_ms": 1e3 * statistics.median(run.eager_step_seconds),
        "tied_lm_head": run.tied,
        "worst": run.worst(5),
    }


def _verdict(row: dict[str, Any]) -> str:
    if row["dtype"] == "float64":
        ok = row["checked_rel"] < TOL and row["loss_rel"] < 1e-6
        return f"{row['checked_rel']:.1e} {'met' if ok else '**missed**'}"
    if max(row["loss_rel"], row["param_rel"]) < FLOAT32_TOL:
        return "met"
    text = "**above 1e-5**"
    if "sgd_param_rel_no_key_bias" in row:
        text += f"; SGD {row['sgd_param_rel_no_key_bias']:.1e}"
    elif "sgd_param_rel" in row:  # a run from before the key-bias split: an upper bound
        text += f"; SGD <= {row['sgd_param_rel']:.1e}"
    return text


def markdown(results: dict[str, Any]) -> str:
    head = (
        "| model | mode | ranks | dtype | loss rel | params rel (worst) | params rel "
        "without key biases (worst) | check | compile s | step ms (sim) | eager ms |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in results["rows"]:
        lines.append(
            f"| {r['model']} | {r['mode']} | {r['ranks']} | {r['dtype']} | "
            f"{r['loss_rel']:.1e} | {r['param_rel']:.1e} ({_short(r['param_worst'])}) | "
            f"{r['param_rel_no_key_bias']:.1e} ({_short(r['param_no_key_bias_worst'])}) | "
            f"{_verdict(r)} | "
            f"{r['compile_s']:.1f} | {r['step_ms']:.0f} | {r['eager_ms']:.1f} |"
        )
    for failure in results["failures"]:
        lines.append(
            f"| {failure['model']} | {failure['mode']} | {failure['ranks']} | "
            f"{failure['dtype']} | failed: {failure['error'][:80]} | | | | | | |"
        )
    notes = "\n".join(f"- {n}" for n in results["notes"])
    check = (
        "check: float64, the worst state tensor (parameters and optimizer state; "
        f"never-moved key biases absolute) against {TOL:g}, and the loss within 1e-6 "
        "(transformers computes the causal LM loss from logits.float()); float32, loss "
        f"and every parameter within {FLOAT32_TOL:g} relative, and where not, the same "
        "float32 run with SGD (lr 1e-3, no Adam normalization): its worst parameter without "
        "key biases ('<=': the worst of all parameters, an upper bound)."
    )
    runs = results.get("parallel_runs", 1)
    together = f", joined from {runs} runs made side by side (`--merge`)" if runs > 1 else ""
    return (
        f"Real models on simulated ranks, torch {results['torch']}, transformers "
        f"{results['transformers']}, {results['steps']} steps, wall "
        f"{results['wall_seconds']:.0f} s{together} (`python -m benchmarks.real_models`)."
        "\n\n"
        + head + "\n".join(lines) + f"\n\n{check}\n\n{notes}\n"
    )


def _short(key: str) -> str:
    return key.replace("param.", "").replace("transformer.", "").replace("model.", "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", nargs="+", choices=sorted(DTYPES),
                        default=["float64", "float32"])
    parser.add_argument("--cases", nargs="+", metavar="NAME",
                        help="zoo case names (e.g. gpt2-ddp-4); default all")
    parser.add_argument("--steps", type=int, default=3,
                        help="train steps per case; default %(default)s")
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="write one table from the results of runs made in parallel "
                        "(e.g. one --dtype each); runs nothing")
    args = parser.parse_args(argv)
    if args.merge:
        return _write(merge(args.merge), args.out)
    import transformers

    cases = [c for c in ZOO_CASES if not args.cases or c.name in args.cases]
    if not cases:
        parser.error(f"no zoo case among {args.cases}; known: {[c.name for c in ZOO_CASES]}")
    torch.set_num_threads(1)
    start = time.perf_counter()
    rows, failures = [], []
    total = len(cases) * len(args.dtype)
    for dtype_name in args.dtype:
        for case in cases:
            try:
                row = record(run_case(case, DTYPES[dtype_name], args.steps))
                if dtype_name == "float32" and max(row["loss_rel"], row["param_rel"]) >= FLOAT32_TOL:
                    sgd = record(run_case(case, DTYPES[dtype_name], args.steps, optimizer="SGD"))
                    row["sgd_param_rel"] = sgd["param_rel"]
                    row["sgd_param_rel_no_key_bias"] = sgd["param_rel_no_key_bias"]
                    row["sgd_loss_rel"] = sgd["loss_rel"]
            except Exception as error:  # a failing case is a row, not the end of the run
                failures.append({
                    "model": case.kind, "mode": case.mode, "ranks": case.world,
                    "dtype": dtype_name, "error": f"{type(error).__name__}: {error}",
                })
                message = f"{case.name} {dtype_name}: FAILED {type(error).__name__}"
            else:
                rows.append(row)
                message = (
                    f"{case.name} {dtype_name}: loss {row['loss_rel']:.1e}, params "
                    f"{row['param_rel']:.1e}, compile {row['compile_s']:.1f} s"
                )
            progress.report("real models", len(rows) + len(failures), total, message)
    results = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "steps": args.steps,
        "rows": rows,
        "failures": failures,
        "notes": list(NOTES),
        "wall_seconds": time.perf_counter() - start,
    }
    return _write(results, args.out)


def merge(paths: list[str]) -> dict[str, Any]:
    """One result from several runs' JSON (rows in case order, float64 first; a case
    in several files keeps the row of the last)."""
    parts = []
    for path in paths:
        with open(path) as f:
            parts.append(json.load(f))
    order = {(c.kind, c.mode): i for i, c in enumerate(ZOO_CASES)}
    latest = {(r["model"], r["mode"], r["dtype"]): r for p in parts for r in p["rows"]}
    rows = list(latest.values())  # a later file's row replaces an earlier one's
    rows.sort(key=lambda r: (list(DTYPES).index(r["dtype"]), order[(r["model"], r["mode"])]))
    return {
        **parts[0],
        "rows": rows,
        "failures": [f for p in parts for f in p["failures"]],
        "notes": list(NOTES),
        "wall_seconds": max(p["wall_seconds"] for p in parts),
        "parallel_runs": len(parts),
    }


def _write(results: dict[str, Any], folder: str) -> int:
    os.makedirs(folder, exist_ok=True)
    base = os.path.join(folder, "real_models")
    with open(base + ".json", "w") as f:
        json.dump(results, f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(markdown(results))
    print(f"[bench] wrote {base}.json and {base}.md ({results['wall_seconds']:.0f} s)")
    return 1 if results["failures"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
