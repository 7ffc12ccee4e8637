"""The benchmark timeline: a tiny compiled program, scheduled and exported as a Chrome trace."""

from __future__ import annotations

import json

import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from benchmarks.timeline import (
    COMM_LANE,
    COMPUTE_LANE,
    ComputeModel,
    export_timeline,
    simulate_timeline,
)
from spmd_compiler.comm_stats import collective_kind
from spmd_compiler.parallel_modes import make_mode
from spmd_compiler.passes.cost_model import CostModel


def train_step(model, optim, x, y) -> torch.Tensor:
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def tiny_program() -> torch.fx.GraphModule:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    step = sc.compile(parallel_mode=make_mode("ddp"))(train_step)
    with sc.simulate(world_size=2):
        step(model, optim, torch.randn(4, 8), torch.randint(0, 4, (4,)))
    return step.last_program.graph_module


def test_timeline_exports_well_formed_trace(tmp_path) -> None:
    gm = tiny_program()
    path = tmp_path / "timeline.json"
    # Slow communication: every collective is longer than the compute after it.
    cost = CostModel(alpha_seconds=1e-3, beta_bytes_per_second=1e6)
    summary = export_timeline(gm, str(path), cost, ComputeModel())
    with open(path) as f:
        trace = json.load(f)
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["tid"] for e in events} == {COMPUTE_LANE, COMM_LANE}
    for e in events:
        assert isinstance(e["name"], str) and e["name"]
        assert e["pid"] == 0 and e["ts"] >= 0 and e["dur"] > 0
    for lane in (COMPUTE_LANE, COMM_LANE):
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["tid"] == lane)
        for (_, end), (start, _) in zip(spans, spans[1:]):
            assert start >= end - 1e-6, (lane, end, start)
    comm = [e for e in events if e["tid"] == COMM_LANE]
    collectives = sum(1 for n in gm.graph.nodes if collective_kind(n))
    assert len(comm) == collectives > 0
    assert abs(sum(e["dur"] for e in comm) * 1e-6 - summary["communication"]) < 1e-9
    # ddp waits for every gradient before the optimizer: slow comm must be exposed.
    assert 0.5 < summary["exposed_fraction"] <= 1.0
    last_end = max(e["ts"] + e["dur"] for e in events) * 1e-6
    assert abs(last_end - summary["step"]) < 1e-9


def test_exposed_fraction_follows_communication_speed() -> None:
    gm = tiny_program()
    compute = ComputeModel()
    slow = simulate_timeline(gm, CostModel(1e-3, 1e6), compute)
    fast = simulate_timeline(gm, CostModel(1e-9, 1e15), compute)
    assert slow["exposed"] > fast["exposed"] >= 0.0
    assert slow["step"] > fast["step"] >= fast["compute"] > 0.0
