"""What the per-call input check's round (NOTE: [same inputs on all ranks]) leaves on the
demo's step on real gloo ranks.

    python -m benchmarks.input_check_cost [--world-size 2] [--steps 60] [--backend eager]

The round is issued before the program, carries the program's leading all-reduces and
is in flight while the program's early part runs (NOTE: [reductions that ride the input
check]). Each rank times, per call: issuing the round (with the prefix that computes what
it carries), the early part, and the wait left for the round after it; then the round
alone (200 back-to-back rounds, ranks in step).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import spmd_compiler as sc
from spmd_compiler.lower import LoweredGraph
from spmd_compiler.runtime.same_inputs import InputAgreement, Round
from spmd_compiler.tools.demo.gpt import gpt_train_step
from spmd_compiler.tools.demo.run import DemoConfig, build, demo_mode


def _timed(owner: Any, name: str, into: list[float]) -> Callable[[], None]:
    """Time every call of ``owner.name`` into ``into``; returns what restores it."""
    original = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = original(*args, **kwargs)
        into.append(time.perf_counter() - start)
        return out

    setattr(owner, name, timed)
    return lambda: setattr(owner, name, original)


def _worker(rank: int, world_size: int, config: DemoConfig, backend: str) -> dict[str, float]:
    model, optimizer, data = build(config)
    step = sc.compile(demo_mode(config), backend=backend)(gpt_train_step)
    share = config.batch_size // world_size
    issue: list[float] = []
    prefix: list[float] = []
    early: list[float] = []
    wait: list[float] = []
    steps: list[float] = []
    restore = [
        _timed(InputAgreement, "start", issue), _timed(LoweredGraph, "leading", prefix),
        _timed(LoweredGraph, "early", early), _timed(Round, "finish", wait),
    ]
    try:
        for x, y in data:
            x, y = x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]
            start = time.perf_counter()
            step(model, optimizer, x, y)
            steps.append(time.perf_counter() - start)
    finally:
        for undo in restore:
            undo()
    alone = []
    agreement = InputAgreement([x, y])
    for _ in range(200):
        start = time.perf_counter()
        agreement.before_run("nothing", [])
        alone.append(time.perf_counter() - start)

    def median_ms(values: list[float]) -> float:
        return statistics.median(values[4:]) * 1e3  # the first calls compile

    return {
        "step_median_ms": median_ms(steps),
        "issue_round_median_ms": median_ms(issue),
        "prefix_median_ms": median_ms(prefix),
        "early_part_median_ms": median_ms(early) if early else 0.0,
        "round_wait_left_median_ms": median_ms(wait),
        "round_alone_median_ms": statistics.median(alone) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--mode", default="ddp")
    parser.add_argument("--backend", default="eager", choices=("eager", "inductor"))
    args = parser.parse_args()
    config = dataclasses.replace(
        DemoConfig(), mode=args.mode, world_size=args.world_size, backend="gloo",
        steps=args.steps,
    )
    results = sc.launch(_worker, args.world_size, args=(config, args.backend), timeout_s=900)
    for rank, r in enumerate(results):
        r["round_share_of_step"] = (
            r["issue_round_median_ms"] + r["round_wait_left_median_ms"]
        ) / r["step_median_ms"]
        print(f"rank {rank}: " + json.dumps({k: round(v, 4) for k, v in r.items()}))


if __name__ == "__main__":
    main()
