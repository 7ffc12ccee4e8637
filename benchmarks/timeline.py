"""A simulated timeline of one compiled step: a compute lane and a communication lane.

NOTE: [simulated timeline]
Nodes run in program order. A compute node starts when the compute lane is free and its
inputs are ready, and takes ``per_op_seconds + max(flops / flops_per_second, bytes /
bytes_per_second)`` (``ComputeModel``, calibrated by ``calibrate_compute`` on this
machine); views and bookkeeping ops take no time. A collective starts when its input is
ready and the communication lane is free, and takes the ``CostModel``'s ``alpha + bytes /
beta``; issuing it costs the compute lane nothing. A ``wait_tensor`` blocks the compute
lane until its collective has finished: that blocked time is *exposed* communication.
The exposed fraction is exposed time over total communication time (0: all hidden).
This is a model, not a measurement: CPU ops, gloo and the GIL interleave differently.
"""

from __future__ import annotations

import json
import operator
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.fx

from spmd_compiler.passes.checks import is_collective, is_wait
from spmd_compiler.passes.cost_model import CostModel

COMPUTE_LANE, COMM_LANE = 0, 1
LANE_NAMES = {COMPUTE_LANE: "compute", COMM_LANE: "communication"}
# Ops that only reinterpret memory (or move none): zero time in the model.
FREE_OPS = frozenset(
    {
        "view",
        "_unsafe_view",
        "reshape",
        "t",
        "transpose",
        "expand",
        "permute",
        "unsqueeze",
        "squeeze",
        "slice",
        "select",
        "alias",
        "detach",
        "as_strided",
        "split",
        "split_with_sizes",
        "unbind",
        "view_as",
        "lift_fresh_copy",
    }
)
MATMUL_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm"})


@dataclass(frozen=True)
class ComputeModel:
    """Roofline-style cost of one compute op on this machine (NOTE: [simulated timeline])."""

    flops_per_second: float = 20e9
    bytes_per_second: float = 5e9
    per_op_seconds: float = 5e-6


def _median_seconds(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def calibrate_compute(size: int = 256, reps: int = 10) -> ComputeModel:
    """Measure matmul throughput, elementwise bandwidth and per-op overhead (one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        flops = 2 * size**3 / _median_seconds(lambda: torch.mm(a, b), reps)
        x = torch.randn(2**22)  # 16 MiB: beyond cache
        bandwidth = 3 * x.numel() * 4 / _median_seconds(lambda: torch.add(x, x), reps)
        one = torch.ones(1)
        overhead = _median_seconds(lambda: torch.add(one, one), 10 * reps)
    finally:
        torch.set_num_threads(threads)
    return ComputeModel(flops, bandwidth, overhead)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _op_name(node: torch.fx.Node) -> str:
    packet = getattr(node.target, "_opname", None)
    return packet or getattr(node.target, "__name__", str(node.target))


def node_flops(node: torch.fx.Node) -> float:
    """Matmul FLOPs from shapes; other ops one FLOP per output element."""
    out = _tensors(node.meta.get("val"))
    name = _op_name(node)
    if name in MATMUL_OPS and out:
        ins = [a.meta.get("val") for a in node.args if isinstance(a, torch.fx.Node)]
        mats = [t for t in ins if isinstance(t, torch.Tensor) and t.dim() >= 2]
        if mats:
            inner = mats[-1].shape[-2]  # (.., k, n): the contracted size
            return 2.0 * out[0].numel() * inner
    return float(sum(t.numel() for t in out))


def node_bytes(node: torch.fx.Node) -> int:
    ins = [t for a in node.all_input_nodes for t in _tensors(a.meta.get("val"))]
    outs = _tensors(node.meta.get("val"))
    return sum(t.numel() * t.element_size() for t in ins + outs)


def compute_seconds(node: torch.fx.Node, model: ComputeModel) -> float:
    """Modelled time of one node on the compute lane (0 for views and bookkeeping)."""
    if node.op != "call_function" or node.target is operator.getitem:
        return 0.0
    if getattr(node.target, "namespace", None) != "aten" or _op_name(node) in FREE_OPS:
        return 0.0
    if not _tensors(node.meta.get("val")):
        return 0.0
    roof = max(node_flops(node) / model.flops_per_second, node_bytes(node) / model.bytes_per_second)
    return model.per_op_seconds + roof


def _event(name: str, lane: int, start: float, seconds: float) -> dict[str, Any]:
    return {
        "name": name,
        "ph": "X",
        "pid": 0,
        "tid": lane,
        "ts": start * 1e6,
        "dur": seconds * 1e6,
        "cat": LANE_NAMES[lane],
    }


def simulate_timeline(
    gm: torch.fx.GraphModule, cost: CostModel, compute: ComputeModel
) -> dict[str, Any]:
    """Schedule ``gm``'s nodes on two lanes (NOTE: [simulated timeline]).

    Returns:
        ``traceEvents`` (Chrome trace, microseconds) and the summary figures in seconds:
        ``step``, ``compute``, ``communication``, ``exposed`` and ``exposed_fraction``.
    """
    ready: dict[torch.fx.Node, float] = {}
    events: list[dict[str, Any]] = []
    compute_free = comm_free = 0.0
    busy_compute = busy_comm = exposed = 0.0
    for node in gm.graph.nodes:
        inputs_ready = max((ready.get(a, 0.0) for a in node.all_input_nodes), default=0.0)
        if is_collective(node):
            start = max(comm_free, inputs_ready)
            seconds = cost.collective_seconds(node)
            comm_free = ready[node] = start + seconds
            busy_comm += seconds
            events.append(_event(node.name, COMM_LANE, start, seconds))
        elif is_wait(node):
            blocked = max(0.0, inputs_ready - compute_free)
            if blocked > 0:
                events.append(_event(f"wait:{node.name}", COMPUTE_LANE, compute_free, blocked))
            compute_free = ready[node] = compute_free + blocked
            exposed += blocked
        else:
            seconds = compute_seconds(node, compute)
            start = max(compute_free, inputs_ready)
            ready[node] = start + seconds
            if seconds > 0:
                compute_free = ready[node]
                busy_compute += seconds
                events.append(_event(_op_name(node), COMPUTE_LANE, start, seconds))
    step = max(compute_free, comm_free)
    meta = [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": lane, "args": {"name": label}}
        for lane, label in LANE_NAMES.items()
    ]
    return {
        "traceEvents": meta + events,
        "step": step,
        "compute": busy_compute,
        "communication": busy_comm,
        "exposed": exposed,
        "exposed_fraction": exposed / busy_comm if busy_comm else 0.0,
    }


def export_timeline(
    gm: torch.fx.GraphModule, path: str, cost: CostModel, compute: ComputeModel
) -> dict[str, float]:
    """Write the Chrome trace of ``gm`` to ``path``; return the summary (seconds)."""
    result = simulate_timeline(gm, cost, compute)
    summary = {k: v for k, v in result.items() if k != "traceEvents"}
    trace = {
        "traceEvents": result["traceEvents"],
        "displayTimeUnit": "ms",
        "otherData": {
            "summary": summary,
            "cost_model": asdict(cost),
            "compute_model": asdict(compute),
        },
    }
    with open(path, "w") as f:
        json.dump(trace, f)
    return summary
