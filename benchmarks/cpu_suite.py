"""The CPU suite: one gloo launch, every style compiled and eager, alternating A/B.

Each rank builds, per model, seven runs from the same seed: the single-device eager step
on the global batch (the floor), and compiled ``ddp`` / ``fsdp`` / ``tp`` beside torch's
``DistributedDataParallel`` / FSDP2 ``fully_shard`` / ``parallelize_module``. After
warm-up (the compiled step compiles on its first two calls: optimizer state is created,
then the steady state), every measured step times each run once, between barriers, with
the order of each pair flipped every step so neither side always runs first.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode

import spmd_compiler as sc
from spmd_compiler.comm_stats import collective_stats
from spmd_compiler.parallel_modes import make_mode

from .models import (
    Case,
    build_model,
    build_optimizer,
    fsdp_units,
    global_batches,
    tp_plan,
    train_step,
)

# (compiled run, torch's eager run of the same style)
PAIRS = (
    ("compiled_ddp", "torch_ddp"),
    ("compiled_fsdp", "torch_fsdp2"),
    ("compiled_tp", "torch_tp"),
)
FLOOR = "eager_1dev"


@dataclass(frozen=True)
class SuiteOptions:
    warmup: int = 3
    steps: int = 5


@dataclass
class Run:
    """``step(wrapper, optim, x[rows], y[rows])`` trains; state lives on ``model``."""

    step: Callable[..., torch.Tensor]
    wrapper: nn.Module
    model: nn.Module
    optim: torch.optim.Optimizer
    rows: slice


def build_run(name: str, case: Case, rank: int, world: int) -> Run:
    model = build_model(case)
    share = case.batch // world
    local = slice(rank * share, (rank + 1) * share)
    whole = slice(0, case.batch)
    if name == FLOOR:
        return Run(train_step(case), model, model, build_optimizer(model.parameters()), whole)
    if name.startswith("compiled_"):
        mode_name = name.removeprefix("compiled_")
        mode = make_mode("tp", plan=tp_plan(case)) if mode_name == "tp" else make_mode(mode_name)
        step = sc.compile(parallel_mode=mode)(train_step(case))
        rows = whole if mode_name == "tp" else local  # every TP rank sees the whole batch
        return Run(step, model, model, build_optimizer(model.parameters()), rows)
    mesh = init_device_mesh("cpu", (world,))
    if name == "torch_ddp":
        ddp = DistributedDataParallel(model)  # forward through the wrapper: it hooks backward
        return Run(train_step(case), ddp, model, build_optimizer(ddp.parameters()), local)
    if name == "torch_fsdp2":
        for unit in fsdp_units(model):
            fully_shard(unit, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return Run(train_step(case), model, model, build_optimizer(model.parameters()), local)
    if name == "torch_tp":
        parallelize_module(model, mesh, tp_plan(case))
        return Run(train_step(case), model, model, build_optimizer(model.parameters()), whole)
    raise ValueError(f"unknown run {name!r}")


def timed_step(run: Run, x: torch.Tensor, y: torch.Tensor) -> float:
    dist.barrier()
    start = time.perf_counter()
    loss = run.step(run.wrapper, run.optim, x[run.rows], y[run.rows])
    loss = loss.detach()
    float(loss.full_tensor() if isinstance(loss, DTensor) else loss)
    return time.perf_counter() - start


def local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def model_state_bytes(run: Run) -> dict[str, int]:
    """Per-rank bytes of params, grads (assumed one per param, as during a step) and
    optimizer state, from the local shapes. Activations, buffers and communication
    buffers (DDP's buckets, FSDP2's gathered params) are not included."""
    params = sum(local_bytes(p) for p in run.model.parameters())
    state = sum(
        local_bytes(v)
        for per_param in run.optim.state.values()
        for v in per_param.values()
        if isinstance(v, torch.Tensor)
    )
    return {"params": params, "grads": params, "optimizer": state, "total": 2 * params + state}


COLLECTIVE_OPS = (
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather_into_tensor",
    "all_gather_into_tensor_coalesced",
    "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced",
    "all_to_all_single",
    "broadcast",
)


class CollectiveBytes(TorchDispatchMode):
    """Counts functional collectives an eager DTensor step issues (comm_stats' byte rule).
    DDP and FSDP2 call c10d directly and are not seen; used for eager TP only."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "_opname", "")
        if getattr(func, "namespace", None) == "_c10d_functional" and name in COLLECTIVE_OPS:
            tensor = out if name.startswith("all_gather") else args[0]
            self.counts[name] = self.counts.get(name, 0) + 1
            self.bytes += tensor.numel() * tensor.element_size()
        return out


def calibrate_collectives(reps: int = 10) -> dict[str, float]:
    """Alpha (latency) and beta (bandwidth) of a gloo all_reduce between these ranks."""

    def median_seconds(t: torch.Tensor, n: int) -> float:
        times = []
        for _ in range(n):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    alpha = median_seconds(torch.zeros(1), reps)
    big = torch.zeros(2**20)  # 4 MiB
    seconds = median_seconds(big, max(3, reps // 2))
    beta = big.numel() * 4 / max(seconds - alpha, 1e-9)
    return {"alpha_seconds": alpha, "beta_bytes_per_second": beta}


def param_bytes(case: Case) -> int:
    return sum(p.numel() * p.element_size() for p in build_model(case).parameters())


def bench_case(case: Case, rank: int, world: int, options: SuiteOptions) -> dict[str, Any]:
    names = [FLOOR] + [name for pair in PAIRS for name in pair]
    runs = {name: build_run(name, case, rank, world) for name in names}
    data = global_batches(case, options.warmup + options.steps)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i, (x, y) in enumerate(data):
        order = [FLOOR] + [name for pair in PAIRS for name in (pair if i % 2 == 0 else pair[::-1])]
        for name in order:
            seconds = timed_step(runs[name], x, y)
            if i >= options.warmup:
                times[name].append(seconds)
    out: dict[str, Any] = {"times": times, "memory": {}, "compiled": {}}
    for name, run in runs.items():
        out["memory"][name] = model_state_bytes(run)
        if isinstance(run.step, sc.CompiledTrainStep):
            stats = collective_stats(run.step.last_program.graph_module)
            out["compiled"][name] = {
                "counts": dict(stats.counts),
                "bytes": dict(stats.bytes),
                "total_bytes": stats.total_bytes,
                "compile_seconds": run.step.timings.compile_seconds,
                "compile_count": run.step.compile_count,
            }
    counter = CollectiveBytes()
    x, y = data[0]
    tp = runs["torch_tp"]
    with counter:
        tp.step(tp.wrapper, tp.optim, x[tp.rows], y[tp.rows])
    out["torch_tp_collectives"] = {"counts": counter.counts, "total_bytes": counter.bytes}
    return out


def worker(rank: int, world: int, cases: tuple[Case, ...], options: SuiteOptions) -> dict:
    """One rank of the suite: calibrate gloo, then every case; progress on rank 0."""
    result: dict[str, Any] = {"calibration": calibrate_collectives(), "cases": {}}
    for case in cases:
        start = time.perf_counter()
        result["cases"][case.name] = bench_case(case, rank, world, options)
        if rank == 0:
            print(f"[bench] {case.name}: done in {time.perf_counter() - start:.1f}s", flush=True)
    return result


def run_cpu_suite(cases: tuple[Case, ...], options: SuiteOptions, world: int = 2) -> dict:
    """Launch the suite on ``world`` gloo ranks (one torch thread each) and merge ranks:
    a step's time is the slowest rank's; the reported figure is the median step."""
    per_rank = sc.launch(worker, world, backend="gloo", args=(cases, options), timeout_s=900)
    first = per_rank[0]
    merged: dict[str, Any] = {"calibration": first["calibration"], "world_size": world, "cases": {}}
    for case in cases:
        mine = first["cases"][case.name]
        medians = {}
        for name in mine["times"]:
            steps = zip(*(r["cases"][case.name]["times"][name] for r in per_rank))
            medians[name] = statistics.median(max(s) for s in steps)
        merged["cases"][case.name] = {
            "case": vars(case),
            "param_bytes": param_bytes(case),
            "step_seconds": medians,
            "memory_per_rank": mine["memory"],
            "compiled": mine["compiled"],
            "torch_tp_collectives": mine["torch_tp_collectives"],
        }
    return merged
