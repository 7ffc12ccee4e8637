"""Cost of the per-call same-inputs check (NOTE: [same inputs on all ranks]) against the
demo's ddp step on real gloo ranks.

    python -m benchmarks.input_check_cost [--world-size 2] [--steps 30]

Calls alternate between the check on and off (every rank the same way), and each rank
times every call: the difference of the two medians is what the check adds to a step.
Inside a call the check also absorbs the ranks' skew (it is the step's first
collective), so its own time is reported too, and the check alone (200 back-to-back
calls, ranks in step).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import spmd_compiler as sc
from spmd_compiler import api
from spmd_compiler.runtime.same_inputs import check_same_inputs_on_all_ranks
from spmd_compiler.tools.demo.gpt import gpt_train_step
from spmd_compiler.tools.demo.run import DemoConfig, build, demo_mode


def _worker(rank: int, world_size: int, config: DemoConfig) -> dict[str, float]:
    model, optimizer, data = build(config)
    step = sc.compile(demo_mode(config))(gpt_train_step)
    check_seconds: list[float] = []
    checking = [True]

    def timed_check(tensor_args):
        if not checking[0]:
            return
        start = time.perf_counter()
        check_same_inputs_on_all_ranks(tensor_args)
        check_seconds.append(time.perf_counter() - start)

    api.check_same_inputs_on_all_ranks = timed_check
    share = config.batch_size // world_size
    on, off = [], []
    for i, (x, y) in enumerate(data):
        x, y = x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]
        checking[0] = i < 2 or i % 2 == 0
        start = time.perf_counter()
        step(model, optimizer, x, y)
        if i >= 2:  # the first calls compile
            (on if checking[0] else off).append(time.perf_counter() - start)
    alone = []
    for _ in range(200):
        start = time.perf_counter()
        check_same_inputs_on_all_ranks([x, y])
        alone.append(time.perf_counter() - start)
    return {
        "step_with_check_median_ms": statistics.median(on) * 1e3,
        "step_without_check_median_ms": statistics.median(off) * 1e3,
        "check_in_step_median_ms": statistics.median(check_seconds[2:]) * 1e3,
        "check_alone_median_ms": statistics.median(alone) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--mode", default="ddp")
    args = parser.parse_args()
    config = dataclasses.replace(
        DemoConfig(), mode=args.mode, world_size=args.world_size, backend="gloo",
        steps=args.steps,
    )
    results = sc.launch(_worker, args.world_size, args=(config,), timeout_s=600)
    for rank, r in enumerate(results):
        base = r["step_without_check_median_ms"]
        r["added_share_of_step"] = (r["step_with_check_median_ms"] - base) / base
        r["check_alone_share_of_step"] = r["check_alone_median_ms"] / base
        print(f"rank {rank}: " + json.dumps({k: round(v, 4) for k, v in r.items()}))


if __name__ == "__main__":
    main()
