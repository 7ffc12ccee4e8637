"""Host work per call of a compiled step: what a call does besides running its program.

``python -m benchmarks.host_work [--cases gpt-2x64,gpt-8x64] [--calls 200]``. One gloo
rank; each case's compiled step (``--run``, default compiled ddp lowered by Inductor) is
warmed up on real steps, then its lowered graphs are replaced by a stub that hands back
the outputs of their last real run, and the median wall time of ``--calls`` calls is the
runtime around the program: finding the step's modules and state, the program key, the
guards, feeding the inputs and writing the state back (NOTE: [one walk over the state per
call] in ``spmd_compiler/runtime/runner.py``). With CUDA graphs this is what is left of a
step beside the replay. Writes ``benchmarks/results/host_work.{json,md}``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import spmd_compiler as sc
from spmd_compiler import lower

from .cpu_suite import build_run, timed_step
from .models import Case, global_batches
from .report import write_json_md

CASES = (Case("gpt-2x64", "gpt", 64, 2, 16), Case("gpt-8x64", "gpt", 64, 8, 16))
RESULTS = Path(__file__).parent / "results"


@contextmanager
def programs_stubbed() -> Iterator[None]:
    """Every lowered graph returns what it returned on its last real call, without running."""
    real = lower.LoweredGraph.__call__
    last: dict[int, list[Any]] = {}

    def stub(self: Any, flat: list[Any], simulated: bool, opened: Any = ()) -> list[Any]:
        if id(self) not in last:
            last[id(self)] = real(self, flat, simulated, opened)
        return list(last[id(self)])

    lower.LoweredGraph.__call__ = stub  # type: ignore[method-assign]
    try:
        yield
    finally:
        lower.LoweredGraph.__call__ = real  # type: ignore[method-assign]


def bench(rank: int, world: int, cases: tuple[Case, ...], run_name: str, calls: int) -> dict:
    out: dict[str, Any] = {}
    for case in cases:
        data = global_batches(case, 6)
        run = build_run(run_name, case, rank, world)
        for x, y in data:  # compiles the program(s) and reaches the steady one
            timed_step(run, x, y)
        args = run.local(*data[0])
        params = sum(1 for _ in run.model.parameters())
        state = sum(
            1 for entries in run.optim.state.values() for v in entries.values()
            if hasattr(v, "shape")
        )
        seconds = []
        with programs_stubbed():
            for _ in range(10):
                run.step(run.wrapper, run.optim, *args)
            for _ in range(calls):
                start = time.perf_counter()
                run.step(run.wrapper, run.optim, *args)
                seconds.append(time.perf_counter() - start)
        out[case.name] = {
            "host_us": 1e6 * statistics.median(seconds), "min_us": 1e6 * min(seconds),
            "parameters": params, "optimizer_state_tensors": state,
        }
        print(f"host_work: {case.name} {out[case.name]['host_us']:.0f} us a call", flush=True)
    return out


def markdown(result: dict) -> str:
    lines = [
        f"Host work per call of `{result['run']}` (one gloo rank, the lowered program "
        f"stubbed out), median of {result['calls']} calls:",
        "",
        "| model | parameters | optimizer-state tensors | us a call (median) | min |",
        "|---|---|---|---|---|",
    ]
    for name, r in result["cases"].items():
        lines.append(
            f"| {name} | {r['parameters']} | {r['optimizer_state_tensors']} | "
            f"{r['host_us']:.0f} | {r['min_us']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="", help="comma-separated (default: all): "
                        + ", ".join(c.name for c in CASES))
    parser.add_argument("--run", default="compiled_ddp@inductor",
                        help="the compiled run (benchmarks.cpu_suite.build_run's names)")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--out", type=Path, default=RESULTS / "host_work")
    args = parser.parse_args(argv)
    cases = tuple(c for c in CASES if not args.cases or c.name in args.cases.split(","))
    per_rank = sc.launch(bench, 1, backend="gloo", timeout_s=1800,
                         args=(cases, args.run, args.calls))
    result = {"run": args.run, "calls": args.calls, "cases": per_rank[0]}
    write_json_md(args.out, result, markdown(result))


if __name__ == "__main__":
    main()
