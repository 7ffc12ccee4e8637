"""The CPU suite: one gloo launch, every style compiled and eager, alternating A/B.

Each rank builds, per model, from the same seed: the single-device eager step on the
global batch (the floor), and compiled ``ddp`` / ``fsdp`` / ``tp`` beside torch's
``DistributedDataParallel`` / FSDP2 ``fully_shard`` / ``parallelize_module``; the compiled
runs once per lowering backend (``compiled_ddp`` interprets the program,
``compiled_ddp@inductor`` lowers it through Inductor), and the ddp group also holds the
torch.compile peer (``torch_compile_ddp``: ``torch.compile`` over the DDP-wrapped model).
After warm-up (the compiled AdamW step compiles one program on its first call, its
optimizer state made first; a step whose state cannot be made that way compiles a second
program on its second call), every measured step times each run once, between
barriers, with the order inside each style's group flipped every step so no run always
runs first.

The same runs serve ``--suite cuda`` (``cuda_suite``): ``device`` puts the models and
batches on a GPU, and the timing then synchronizes the device.
"""

from __future__ import annotations

import contextlib
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
from torch.profiler import record_function

import spmd_compiler as sc
from spmd_compiler import _torch_private as private
from spmd_compiler.ir.collectives import collective_stats

from . import progress
from .models import (
    Case,
    build_model,
    build_optimizer,
    fsdp_units,
    global_batches,
    parallel_mode,
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
# torch.compile's peer of compiled ddp: what ``build_run`` compiles is described there.
TORCH_COMPILE_DDP = "torch_compile_ddp"
# The kernels issue's GPU peer: the whole undecorated step under torch.compile on one
# device (forward, backward and the optimizer step compiled), on the global batch.
TORCH_COMPILE_1DEV = "torch_compile_1dev"
# a run name ending so replays its step as CUDA graphs (``cuda_graphs=True``; for
# torch.compile, mode "reduce-overhead"): CUDA only
CUDA_GRAPHS = "+cudagraphs"


def compiled_name(compiled: str, backend: str) -> str:
    """The run name of a compiled style on a lowering backend (``compiled_ddp@inductor``);
    the eager backend keeps the plain name."""
    return compiled if backend == "eager" else f"{compiled}@{backend}"


def run_groups(backends: tuple[str, ...], peer: bool) -> list[list[str]]:
    """Per style: torch's run, then the compiled run on each backend (and the
    torch.compile peer after torch DDP when ``peer``)."""
    groups = []
    for compiled, torch_run in PAIRS:
        group = [torch_run] + [compiled_name(compiled, b) for b in backends]
        if peer and torch_run == "torch_ddp":
            group.append(TORCH_COMPILE_DDP)
        groups.append(group)
    return groups


@dataclass(frozen=True)
class SuiteOptions:
    warmup: int = 3
    steps: int = 9
    # Measure in rounds of ``steps`` until every run has at least this many seconds of
    # timed steps (or ``max_rounds``): 9 steps of a 5 ms step are 45 ms of samples, and on
    # a shared 2-core machine the median of those moved mlp-128's ratios by up to 2x
    # between runs. 0: one round.
    min_seconds: float = 0.0
    max_rounds: int = 25
    backends: tuple[str, ...] = ("eager",)
    torch_compile_peer: bool = False


@dataclass
class Run:
    """``step(wrapper, optim, *local(x, y))`` trains; state lives on ``model``."""

    step: Callable[..., torch.Tensor]
    wrapper: nn.Module
    model: nn.Module
    optim: torch.optim.Optimizer
    # (global tensor, its index among the step's tensor arguments) -> this rank's share
    share: Callable[[torch.Tensor, int], torch.Tensor]

    def local(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.share(x, 0), self.share(y, 1)


def build_run(name: str, case: Case, rank: int, world: int, device: str = "cpu") -> Run:
    """Run ``name`` of ``case`` on ``device``; the model moves there before any wrapper or
    sharding sees it, so DDP, FSDP2, TP and the compiled mesh all live on ``device``."""
    model = build_model(case).to(device)
    rows = case.batch // world
    local = _rows(slice(rank * rows, (rank + 1) * rows))
    whole = _rows(slice(0, case.batch))
    if name == FLOOR:
        return Run(train_step(case), model, model, build_optimizer(model.parameters()), whole)
    base, graphs = name.removesuffix(CUDA_GRAPHS), name.endswith(CUDA_GRAPHS)
    if base == TORCH_COMPILE_1DEV:
        # Dynamo compiles the forward and loss (AOTAutograd the backward), breaks at
        # ``loss.backward()``, and compiles ``optimizer.step()`` as its own graph; with
        # CUDA graphs: mode "reduce-overhead", each of those graphs replayed as one
        step = torch.compile(train_step(case), mode="reduce-overhead" if graphs else None)
        return Run(step, model, model, build_optimizer(model.parameters()), whole)
    if base.startswith("compiled_"):
        # "compiled_ddp" interprets the program; "compiled_ddp@inductor" lowers it;
        # "compiled_ddp@inductor+cudagraphs" replays the lowered step as a CUDA graph
        mode_name, _, backend = base.removeprefix("compiled_").partition("@")
        mode = parallel_mode(case, mode_name)
        step = sc.compile(parallel_mode=mode, backend=backend or "eager", cuda_graphs=graphs)(
            train_step(case)
        )
        mode_mesh = mode.mesh(torch.device(device).type)

        def share(t: torch.Tensor, index: int) -> torch.Tensor:
            return mode.local_batch(t, rank, index=index, mesh=mode_mesh)

        return Run(step, model, model, build_optimizer(model.parameters()), share)
    mesh = init_device_mesh(torch.device(device).type, (world,))
    if name == "torch_ddp":
        ddp = DistributedDataParallel(model)  # forward through the wrapper: it hooks backward
        return Run(train_step(case), ddp, model, build_optimizer(ddp.parameters()), local)
    if name == "torch_fsdp2":
        for unit in fsdp_units(model):
            fully_shard(unit, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return Run(train_step(case), model, model, build_optimizer(model.parameters()), local)
    if name == TORCH_COMPILE_DDP:
        # torch.compile (default mode, Inductor) over the DDP-wrapped model: Dynamo traces
        # the forward, splits it at DDP's bucket boundaries (DDPOptimizer) so gradient
        # all-reduces overlap the compiled backward; AOTAutograd compiles the backward.
        # The loss (cross entropy), loss.backward() and the AdamW step run eagerly.
        ddp = DistributedDataParallel(model)
        compiled = torch.compile(ddp)
        return Run(train_step(case), compiled, model, build_optimizer(ddp.parameters()), local)
    if name == "torch_tp":
        parallelize_module(model, mesh, tp_plan(case))
        return Run(train_step(case), model, model, build_optimizer(model.parameters()), whole)
    raise ValueError(f"unknown run {name!r}")


def _rows(rows: slice) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """The share of torch's own runs: the same rows of every argument."""
    return lambda t, index: t[rows]


def synchronize(device: torch.device) -> None:
    """Wait for every queued kernel on a GPU: reading the loss waits only for the kernels
    before it, not for the optimizer update queued after it. Nothing to wait for on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_step(run: Run, x: torch.Tensor, y: torch.Tensor, mark: str | None = None) -> float:
    """Seconds of one step, from a barrier (and an idle device) to its finished update.
    ``mark``: the timed part runs in a profiler range of that name."""
    args = run.local(x, y)
    dist.barrier()
    synchronize(x.device)
    start = time.perf_counter()
    with record_function(mark) if mark is not None else contextlib.nullcontext():
        loss = run.step(run.wrapper, run.optim, *args)
        loss = loss.detach()
        float(loss.full_tensor() if isinstance(loss, DTensor) else loss)
        synchronize(x.device)
    return time.perf_counter() - start


def pipelined_step_seconds(
    run: Run, batches: list[tuple[torch.Tensor, torch.Tensor]], window: int = 5
) -> float:
    """Seconds per step of ``batches`` run back to back, as a training loop runs them: no
    sync between steps and no loss read, so the host may queue the next step while the
    device still computes the last (``timed_step`` waits for each step).

    The batches go in windows of ``window`` steps, each between a barrier with a device
    sync; the first window is a warm-up, untimed, and the median window counts. (Timed as
    one cold window, compiled ddp on gpt-8x512 on an H200 came out 28% over its
    synchronized step, 20.67 against 16.16 ms, cause not found: one window takes whatever
    stall falls into it.)"""
    shares = [run.local(x, y) for x, y in batches]
    device = batches[0][0].device
    window = max(1, min(window, len(shares)))
    per_step = []
    for first in range(0, len(shares) - window + 1, window):
        dist.barrier()
        synchronize(device)
        start = time.perf_counter()
        for args in shares[first:first + window]:
            run.step(run.wrapper, run.optim, *args)
        synchronize(device)
        per_step.append((time.perf_counter() - start) / window)
    return statistics.median(per_step[1:] or per_step)


def step_peak_bytes(run: Run, x: torch.Tensor, y: torch.Tensor) -> int | None:
    """Peak bytes allocated during one step of ``run`` above what was allocated just
    before it (every run's resident state in this process): activations, gradients,
    temporaries and buffers. On CUDA the caching allocator's peak; on CPU the profiler's
    allocation totals (``_torch_private.cpu_allocation_peak``: an upper bound where the
    step frees older memory before its peak)."""
    if x.device.type != "cuda":
        return private.cpu_allocation_peak(lambda: timed_step(run, x, y))
    synchronize(x.device)
    torch.cuda.reset_peak_memory_stats(x.device)
    before = torch.cuda.memory_allocated(x.device)
    timed_step(run, x, y)
    return torch.cuda.max_memory_allocated(x.device) - before


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


class CollectiveBytes(private.dispatch_mode_base()):  # type: ignore[misc]
    """Counts functional collectives an eager DTensor step issues (the collectives module's byte rule).
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


def bench_case(
    case: Case,
    rank: int,
    world: int,
    options: SuiteOptions,
    device: str = "cpu",
    peaks: bool = False,
) -> dict[str, Any]:
    """Time every run of ``case`` (``run_groups``); with ``peaks``, also one step's peak
    memory per run (``step_peak_bytes``), measured after the timed steps so it does not
    disturb them. ``first_step_seconds`` is each run's first call (compiles included)."""
    groups = run_groups(options.backends, options.torch_compile_peer)
    names = [FLOOR] + [name for group in groups for name in group]
    runs = {name: build_run(name, case, rank, world, device) for name in names}
    data = [
        (x.to(device), y.to(device))
        for x, y in global_batches(case, options.warmup + options.steps)
    ]
    times: dict[str, list[float]] = {name: [] for name in names}
    first: dict[str, float] = {}
    i, rounds = 0, 0
    while True:
        # later rounds take the timed batches again
        x, y = data[i if i < options.warmup else options.warmup + (i - options.warmup) % options.steps]
        order = [FLOOR] + [n for g in groups for n in (g if i % 2 == 0 else g[::-1])]
        for name in order:
            seconds = timed_step(runs[name], x, y)
            if i == 0:
                first[name] = seconds
            if i >= options.warmup:
                times[name].append(seconds)
        i += 1
        if i > options.warmup and (i - options.warmup) % options.steps == 0:
            rounds += 1
            if rounds >= options.max_rounds or _enough(times, options.min_seconds, device):
                break
    out: dict[str, Any] = {
        "times": times, "first_step_seconds": first, "memory": {}, "compiled": {},
        "rounds": rounds,
    }
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
        tp.step(tp.wrapper, tp.optim, *tp.local(x, y))
    out["torch_tp_collectives"] = {"counts": counter.counts, "total_bytes": counter.bytes}
    if peaks:
        out["step_peak_bytes"] = {name: step_peak_bytes(run, x, y) for name, run in runs.items()}
    return out


def _enough(times: dict[str, list[float]], min_seconds: float, device: str) -> bool:
    """Whether every run has ``min_seconds`` of timed steps on every rank (one all-reduce:
    the ranks stop together, so each run has the same steps on each)."""
    if min_seconds <= 0:
        return True
    mine = min(sum(t) for t in times.values()) >= min_seconds
    flag = torch.tensor([1.0 if mine else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def bench_cases(
    rank: int,
    world: int,
    cases: tuple[Case, ...],
    options: SuiteOptions,
    device: str = "cpu",
    peaks: bool = False,
) -> dict[str, Any]:
    """``bench_case`` for every case in turn, by name; progress on rank 0."""
    out = {}
    for i, case in enumerate(cases, 1):
        start = time.perf_counter()
        out[case.name] = bench_case(case, rank, world, options, device, peaks)
        if rank == 0:
            seconds = time.perf_counter() - start
            progress.report("suite", i, len(cases), f"{case.name} done in {seconds:.1f}s")
    return out


def worker(rank: int, world: int, cases: tuple[Case, ...], options: SuiteOptions) -> dict:
    """One rank of the suite: calibrate gloo, then every case."""
    calibration = calibrate_collectives()
    return {"calibration": calibration, "cases": bench_cases(rank, world, cases, options)}


def merge_ranks(per_rank: list[dict[str, Any]], cases: tuple[Case, ...]) -> dict[str, Any]:
    """One record per case from every rank's: a step's time is the slowest rank's, the
    reported figure the median step; memory and programs are rank 0's."""
    first = per_rank[0]
    merged: dict[str, Any] = {}
    for case in cases:
        mine = first["cases"][case.name]
        medians = {}
        for name in mine["times"]:
            steps = zip(*(r["cases"][case.name]["times"][name] for r in per_rank))
            medians[name] = statistics.median(max(s) for s in steps)
        merged[case.name] = {
            "case": vars(case),
            "param_bytes": param_bytes(case),
            "step_seconds": medians,
            "memory_per_rank": mine["memory"],
            "compiled": mine["compiled"],
            "first_step_seconds": mine["first_step_seconds"],
            "torch_tp_collectives": mine["torch_tp_collectives"],
            "rounds": mine.get("rounds", 1),
        }
        if "step_peak_bytes" in mine:
            merged[case.name]["step_peak_bytes"] = mine["step_peak_bytes"]
    return merged


def run_cpu_suite(cases: tuple[Case, ...], options: SuiteOptions, world: int = 2) -> dict:
    """Launch the suite on ``world`` gloo ranks (one torch thread each) and merge ranks."""
    # Inductor compiles C++ kernels on every rank at once: allow for it on 2 cores
    timeout = 900 if options.backends == ("eager",) else 5400
    per_rank = sc.launch(worker, world, backend="gloo", args=(cases, options), timeout_s=timeout)
    return {
        "calibration": per_rank[0]["calibration"],
        "world_size": world,
        "cases": merge_ranks(per_rank, cases),
    }
