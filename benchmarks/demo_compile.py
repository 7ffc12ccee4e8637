"""Compile time of the demo GPT per stage and mode, and the per-rank programs it made.

``python -m benchmarks.demo_compile [--dump DIR] [CASE ...]`` with CASE one of ``ddp``,
``fsdp``, ``tp``, ``fsdp_tp:2x2``, ``fsdp_tp:2x4`` (default: all). Each case runs the
demo's first two steps on simulated ranks (one compile since AdamW's state is made
before the first program, NOTE: [optimizer state made before the first program]; two
before: the call that created the state, then the steady one) and prints, summed over
the compiles, the
seconds of capture / expand / passes / lowering and the whole compile. ``--dump`` writes
each program's generated code (one file per case and compile) so that two runs, e.g.
before and after a compile-time change, can be compared text for text.

NOTE: [compile seconds on a shared machine]
By default the stages are timed in process CPU seconds (``--clock cpu``): the pipeline's
own stage clocks (``time.perf_counter``) read ``time.process_time`` for the run, with
one torch thread. On a machine shared with other jobs, wall seconds measure the load
(a run of 58 CPU seconds took 470 wall seconds at load 11 on 2 cores); CPU seconds
measure the compile. ``--clock wall`` keeps wall seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

CASES = ("ddp", "fsdp", "tp", "fsdp_tp:2x2", "fsdp_tp:2x4")


def _config(case: str) -> Any:
    from spmd_compiler.tools.demo.run import DemoConfig

    mode, _, mesh = case.partition(":")
    shape = tuple(int(n) for n in mesh.split("x")) if mesh else ()
    world = shape[0] * shape[1] if shape else 4
    return DemoConfig(mode=mode, world_size=world, mesh=shape, steps=2)


def compile_case(case: str, dump: str | None = None) -> dict[str, Any]:
    """Stage seconds of the demo's compiles for ``case`` (summed over its compiles)."""
    from spmd_compiler.api import compile as spmd_compile
    from spmd_compiler.runtime.simulate import simulate
    from spmd_compiler.tools.demo.gpt import gpt_train_step
    from spmd_compiler.tools.demo.run import build, demo_mode

    config = _config(case)
    model, optimizer, data = build(config)
    step = spmd_compile(parallel_mode=demo_mode(config))(gpt_train_step)
    with simulate(world_size=config.world_size):
        for x, y in data:
            step(model, optimizer, x, y)
    row = {"capture": 0.0, "expand": 0.0, "passes": 0.0, "other": 0.0, "nodes": 0}
    for i, record in enumerate(step.records):
        row["capture"] += record.capture_seconds
        row["expand"] += record.expand_seconds
        row["passes"] += record.pass_seconds
        row["other"] += record.total_seconds - (
            record.capture_seconds + record.expand_seconds + record.pass_seconds
        )
        row["nodes"] += len(record.program.graph_module.graph.nodes)
        if dump:
            os.makedirs(dump, exist_ok=True)
            stem = os.path.join(dump, f"{case.replace(':', '_')}.{i}")
            with open(stem + ".py", "w") as f:
                f.write(record.program.graph_module.code)
            with open(stem + ".canon", "w") as f:
                f.write(canonical_program(record.program.graph_module))
    row["lowering"] = step.timings.compile_seconds - sum(r.total_seconds for r in step.records)
    row["total"] = step.timings.compile_seconds
    row["compiles"] = len(step.records)
    return row


def canonical_program(gm: Any) -> str:
    """The program with every node named by its position: two programs that differ only
    in the numeric suffixes fx gives node and constant names (which depend on how many
    nodes, dead ones included, the trace created before) print the same."""
    import torch

    from spmd_compiler.ir.node_meta import PLACEMENT

    index = {node: f"%{i}" for i, node in enumerate(gm.graph.nodes)}

    def show(value: Any) -> str:
        if isinstance(value, torch.fx.Node):
            return index[value]
        if isinstance(value, (list, tuple)):
            inner = ", ".join(show(v) for v in value)
            return f"[{inner}]" if isinstance(value, list) else f"({inner})"
        if isinstance(value, dict):
            return "{" + ", ".join(f"{k}: {show(v)}" for k, v in value.items()) + "}"
        return repr(value)

    lines = []
    for node in gm.graph.nodes:
        target = node.target
        if node.op == "get_attr":
            value = getattr(gm, node.target)
            target = (f"tensor{tuple(value.shape)} {value.dtype} "
                      f"{value.tolist() if value.numel() <= 64 else '...'}"
                      if isinstance(value, torch.Tensor) else type(value).__name__)
        placement = node.meta.get(PLACEMENT)
        lines.append(f"{index[node]} = {node.op} {target} {show(node.args)} "
                     f"{show(node.kwargs)} {placement}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", default=list(CASES))
    parser.add_argument("--dump", help="directory for the generated code of every program")
    parser.add_argument("--json", help="also write the rows as JSON")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="stage seconds in process CPU time (default) or wall time")
    args = parser.parse_args(argv)
    os.environ.setdefault("SPMD_PROGRESS", "0")
    if args.clock == "cpu":
        import torch

        torch.set_num_threads(1)
        time.perf_counter = time.process_time  # NOTE: [compile seconds on a shared machine]
    rows = {}
    print(f"{'case':<12} {'capture':>8} {'expand':>8} {'passes':>8} {'other':>7} "
          f"{'lowering':>8} {'total':>8}  nodes", flush=True)
    for case in args.cases:
        start = time.perf_counter()
        row = compile_case(case, args.dump)
        row["wall"] = time.perf_counter() - start
        rows[case] = row
        print(f"{case:<12} {row['capture']:8.2f} {row['expand']:8.2f} {row['passes']:8.2f} "
              f"{row['other']:7.2f} {row['lowering']:8.2f} {row['total']:8.2f}  {row['nodes']}",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
