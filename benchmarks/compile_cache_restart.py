"""A restarted job's compile against its first compile, with the persistent cache.

``python -m benchmarks.compile_cache_restart [--runs N] [--json PATH] [CASE ...]`` with
CASE as in ``benchmarks.demo_compile`` (default: ``ddp fsdp_tp:2x2``). Each run starts
two fresh processes on one new cache directory (``SPMD_COMPILER_CACHE_DIR``): the first
compiles the demo's two programs and writes them, the second is the restarted job. Both
print their compile seconds per stage in process CPU seconds (NOTE: [compile seconds on
a shared machine] in ``benchmarks/demo_compile.py``) and their losses, which must be the
same bit for bit. The target (issue 16): a restart within 10% of the first compile.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

CASES = ("ddp", "fsdp_tp:2x2")


def child(case: str) -> dict[str, Any]:
    """One process: the demo's first two steps of ``case``, compiled (or loaded)."""
    import time

    import torch

    torch.set_num_threads(1)
    time.perf_counter = time.process_time  # NOTE: [compile seconds on a shared machine]
    from benchmarks.demo_compile import _config
    from spmd_compiler.api import compile as spmd_compile
    from spmd_compiler.runtime.simulate import simulate
    from spmd_compiler.tools.demo.gpt import gpt_train_step
    from spmd_compiler.tools.demo.run import build, demo_mode

    config = _config(case)
    model, optimizer, data = build(config)
    step = spmd_compile(parallel_mode=demo_mode(config))(gpt_train_step)
    with simulate(world_size=config.world_size):
        losses = [float(step(model, optimizer, x, y)) for x, y in data]
    records, timings = step.records, step.timings
    return {
        "cache": [r.cache for r in records],
        "capture_skipped": [getattr(r, "capture_skipped", False) for r in records],
        "total": timings.compile_seconds, "capture": timings.capture_seconds,
        "expand": timings.expand_seconds, "passes": timings.pass_seconds,
        "load": timings.cache_load_seconds, "losses": losses,
    }


def run_case(case: str) -> dict[str, Any]:
    """A first compile and a restart on one new cache directory."""
    with tempfile.TemporaryDirectory(prefix="spmd-cache-") as cache:
        env = dict(os.environ, SPMD_COMPILER_CACHE_DIR=cache, SPMD_PROGRESS="0")
        out = []
        for _ in range(2):
            proc = subprocess.run(
                [sys.executable, "-m", "benchmarks.compile_cache_restart", "--child", case],
                capture_output=True, text=True, env=env, check=True,
            )
            out.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    first, restart = out
    if first["losses"] != restart["losses"]:
        raise SystemExit(f"{case}: the restarted job's losses differ: {first} {restart}")
    return {"first": first, "restart": restart, "ratio": restart["total"] / first["total"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", default=list(CASES))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", help="also write every run as JSON")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child)), flush=True)
        return
    rows: dict[str, list[dict[str, Any]]] = {}
    print(f"{'case':<12} {'run':>3} {'first (capture/expand/passes)':>32} "
          f"{'restart (capture/load)':>26} {'ratio':>6}  restart cache", flush=True)
    for case in args.cases:
        for i in range(args.runs):
            row = run_case(case)
            rows.setdefault(case, []).append(row)
            f, r = row["first"], row["restart"]
            print(f"{case:<12} {i + 1:>3} {f['total']:8.2f} ({f['capture']:.2f}/{f['expand']:.2f}/"
                  f"{f['passes']:.2f}) {r['total']:12.2f} ({r['capture']:.2f}/{r['load']:.2f}) "
                  f"{100 * row['ratio']:5.1f}%  {r['cache']} skipped={r['capture_skipped']}",
                  flush=True)
        print(f"{case:<12} median ratio {100 * statistics.median(x['ratio'] for x in rows[case]):.1f}%",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
