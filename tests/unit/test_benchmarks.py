"""The benchmarks: the timeline of a tiny compiled program (scheduled and exported as a
Chrome trace), and the CUDA suite's code path run on CPU."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from benchmarks.cpu_suite import FLOOR, PAIRS, SuiteOptions
from benchmarks.cuda_suite import PARITY_TOLERANCE
from benchmarks.models import STYLES
from benchmarks.report import write
from benchmarks.run import main, run_cuda
from benchmarks.timeline import (
    COMM_LANE,
    COMPUTE_LANE,
    ComputeModel,
    export_timeline,
    simulate_timeline,
)
from spmd_compiler.ir.collectives import collective_kind
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


@pytest.mark.dist  # starts one gloo rank
def test_cuda_suite_code_path_on_cpu(tmp_path) -> None:
    """``--suite cuda`` end to end on CPU (gloo, world 1, the quick model): the runs,
    the simulated parity, the device record and both tables."""
    # warm-up 2: a compiled step compiles on its first two calls
    # two rounds of 2 timed steps: 10 s of timed steps per run is more than 2 rounds give
    options = SuiteOptions(warmup=2, steps=2, min_seconds=10.0, max_rounds=2)
    results = run_cuda(options, quick=True, device="cpu", backend="gloo")
    paths = write(results, str(tmp_path), "cuda")
    with open(paths["json"]) as f:
        data = json.load(f)
    with open(paths["md"]) as f:
        md = f.read()
    device = data["device"]
    assert device["type"] == "cpu" and device["name"] and device["torch"] == torch.__version__
    assert device["name"] in md.splitlines()[0]
    assert data["suite"]["world_size"] == 1 and data["suite"]["backend"] == "gloo"
    runs = {FLOOR} | {name for pair in PAIRS for name in pair}
    for case in data["suite"]["cases"].values():
        assert case["rounds"] == 2
        assert set(case["step_seconds"]) == runs
        assert all(math.isfinite(t) and t > 0 for t in case["step_seconds"].values())
        # off CUDA, from the profiler's CPU allocation totals: every step allocates
        assert set(case["step_peak_bytes"]) == runs
        assert all(b > 0 for b in case["step_peak_bytes"].values()), case["step_peak_bytes"]
    assert [r["style"] for r in data["table"]] == list(STYLES)
    assert all(r["step_peak_compiled"] > 0 and r["step_peak_torch"] > 0 for r in data["table"])
    assert {(p["model"], p["style"]) for p in data["simulation"]} == {
        (model, style) for model in data["suite"]["cases"] for style in STYLES
    }
    for p in data["simulation"]:
        assert p["parity_ok"], p
        assert max(p["param_rel_diff"], p["optimizer_rel_diff"], p["loss_rel_diff"]) < 1e-4
        assert p["tolerance"] == PARITY_TOLERANCE and p["compile_seconds"] > 0
    for style in STYLES:
        assert f"| {style} vs " in md and f"| {style} | 2 x 3 |" in md
    assert "**missed**" not in md.split("Simulated ranks")[1].split("Notes:")[0]


def test_cuda_suite_refuses_without_cuda(monkeypatch, capsys, tmp_path) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["--suite", "cuda", "--quick", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "no CUDA device is visible" in err
    assert not list(tmp_path.iterdir())


def test_progress_bar_lines(capsys):
    from benchmarks import progress

    assert progress.bar(0, 4) == "[" + "." * progress.WIDTH + "]"
    assert progress.bar(2, 4) == "[" + "#" * (progress.WIDTH // 2) + "." * (progress.WIDTH // 2) + "]"
    assert progress.bar(4, 4) == "[" + "#" * progress.WIDTH + "]"
    progress.report("suite", 1, 2, "gpt done")
    assert capsys.readouterr().out == f"[bench] suite {progress.bar(1, 2)} 1/2 gpt done\n"


def test_canonical_program_ignores_node_names_only() -> None:
    from benchmarks.demo_compile import canonical_program

    def program(dead_first: bool, op) -> torch.fx.GraphModule:
        graph = torch.fx.Graph()
        x = graph.placeholder("x")
        if dead_first:  # a dead node shifts the name suffixes of what follows
            graph.call_function(op, (x, x))
        y = graph.call_function(op, (x, x))
        graph.output(graph.call_function(op, (y, x)))
        graph.eliminate_dead_code()
        return torch.fx.GraphModule(torch.nn.Module(), graph)

    plain = program(False, torch.ops.aten.add.Tensor)
    shifted = program(True, torch.ops.aten.add.Tensor)
    assert plain.code != shifted.code  # add_tensor, add_tensor_1 against _1, _2
    assert canonical_program(plain) == canonical_program(shifted)
    assert canonical_program(plain) != canonical_program(program(False, torch.ops.aten.mul.Tensor))


def test_cpu_allocation_peak_is_the_most_a_step_held_at_once() -> None:
    """``step_peak_bytes`` off CUDA: the profiler's allocation totals during the step."""
    from spmd_compiler import _torch_private as private

    def step() -> None:
        first = torch.empty(1 << 20, dtype=torch.uint8)
        second = torch.empty(2 << 20, dtype=torch.uint8)  # 3 MiB held here
        del first, second
        torch.empty(1 << 20, dtype=torch.uint8)

    peak = private.cpu_allocation_peak(step)
    assert 3 << 20 <= peak < (3 << 20) + (64 << 10), peak
    assert private.cpu_allocation_peak(lambda: None) == 0


@pytest.mark.dist  # starts one gloo rank
def test_gpu_profile_code_path_on_cpu(tmp_path) -> None:
    """``benchmarks.gpu_profile`` on CPU (gloo): per run a wall time, the ops per step and
    the top ops; device busy time only where there is a device."""
    from benchmarks.gpu_profile import main as profile_main

    out = tmp_path / "p"
    profile_main(["--device", "cpu", "--case", "mlp-128", "--runs",
                  f"{FLOOR},no_such_run,compiled_ddp", "--warmup", "3", "--steps", "2",
                  "--out", str(out)])
    data = json.loads(out.with_suffix(".json").read_text())
    assert set(data["runs"]) == {FLOOR, "no_such_run", "compiled_ddp"}
    # a run that fails is recorded, and the runs after it still measured
    assert "unknown run" in data["runs"].pop("no_such_run")["error"]
    for r in data["runs"].values():
        assert r["wall_ms"] > 0 and r["back_to_back_ms"] > 0 and r["kernels_per_step"] > 0 and r["top"]
        assert r["busy_ms"] is None and r["idle_fraction"] is None
        assert r["timeline"]["wall_ms"] > 0 and "device_busy_ms" not in r["timeline"]
    # the interpreted program calls no compiled graph; its ops are the step's host calls
    assert data["runs"]["compiled_ddp"]["timeline"]["graph_calls"] == 0
    assert data["runs"]["compiled_ddp"]["host_calls"]
    assert "| compiled_ddp |" in out.with_suffix(".md").read_text()
    assert not out.with_suffix(".partial.json").exists()  # only while runs are left


def test_gpu_profile_union_of_kernel_spans() -> None:
    """Device busy time counts overlapping kernels once; the gaps are what lies between."""
    from benchmarks.gpu_profile import _union_us

    busy, gaps = _union_us([(10.0, 20.0), (0.0, 5.0), (15.0, 25.0), (40.0, 41.0)])
    assert busy == 5 + 15 + 1 and gaps == [5.0, 15.0]


@pytest.mark.dist  # starts two gloo ranks
@pytest.mark.inductor  # lowers compiled ddp / fsdp (a C++ compile per rank)
def test_lowering_benchmark_code_path_on_cpu(tmp_path) -> None:
    """``benchmarks.lowering`` (what ``scripts/gpu_check.sh`` runs on a GPU) end to end on
    CPU: every run timed, the ratios and peaks in the table."""
    from benchmarks.lowering import RUNS
    from benchmarks.lowering import main as lowering_main

    out = tmp_path / "l"
    lowering_main(["--device", "cpu", "--cases", "mlp-128", "--warmup", "2", "--steps", "1",
                   "--out", str(out)])
    case = json.loads(out.with_suffix(".json").read_text())["cases"]["mlp-128"]
    assert case["errors"] == {}
    assert set(case["step_ms"]) == set(RUNS) and all(ms > 0 for ms in case["step_ms"].values())
    assert set(case["pipelined_ms"]) == set(RUNS) and all(ms > 0 for ms in case["pipelined_ms"].values())
    assert all(mib is not None and mib > 0 for mib in case["peak_mib"].values())
    row = next(line for line in out.with_suffix(".md").read_text().splitlines()
               if line.startswith("| mlp-128 |"))
    assert "n/a" not in row


def test_host_work_benchmark_code_path_on_cpu(tmp_path) -> None:
    """``benchmarks.host_work`` end to end on the interpreted backend, a few calls: the
    stubbed calls are timed."""
    from benchmarks.host_work import main as host_main

    out = tmp_path / "h"
    host_main(["--cases", "gpt-2x64", "--run", "compiled_ddp", "--calls", "5", "--out", str(out)])
    case = json.loads(out.with_suffix(".json").read_text())["cases"]["gpt-2x64"]
    assert case["host_us"] > 0 and case["parameters"] > 0 and case["optimizer_state_tensors"] > 0
