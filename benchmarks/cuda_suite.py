"""The CUDA suite: the CPU suite's seven runs at world 1 on NCCL, plus simulated parity.

Part A (``run_device_suite``) launches one NCCL rank and times, per model, the same runs
as the CPU suite (``cpu_suite.bench_case``: the single-device floor, compiled ``ddp`` /
``fsdp`` / ``tp`` beside torch's DDP / FSDP2 / TP, pairs alternating A/B) on the GPU, and
measures each run's peak memory during one extra step. At world 1 no data crosses devices:
this is the compiled program's cost on a GPU against torch's wrappers, not scaling.

Part B (``simulation_parity``) runs in this process, without a process group: each style
trains a few steps on 2 simulated ranks (``sc.simulate``) holding device tensors, beside
the undecorated step on one device on the global batch, and records how far the two end
apart. Both parts take ``device`` and ``backend`` so that the same code runs on CPU with
gloo (the unit test does).
"""

from __future__ import annotations

import os
import platform
from typing import Any

import torch

import spmd_compiler as sc
from spmd_compiler.tools.parity import (
    compare_models,
    compare_optimizers,
    max_difference,
    relative_difference,
)

from . import progress
from .cpu_suite import SuiteOptions, bench_cases, merge_ranks
from .models import (
    STYLES,
    Case,
    build_model,
    build_optimizer,
    global_batches,
    parallel_mode,
    train_step,
)

SIMULATED_WORLD = 2
SIMULATED_STEPS = 3
# Largest relative difference (state and loss) counted as parity; ADAM_EPS keeps float32
# reduction-order noise around 1e-6 (NOTE: [Adam eps and parity] in spmd_compiler.tools.demo.run).
PARITY_TOLERANCE = 1e-4
LAUNCH_TIMEOUT_S = 1800


def device_record(device: str) -> dict[str, Any]:
    """What the numbers were measured on, stored beside them: a GPU's name, compute
    capability and CUDA version, or the host processor for a CPU run."""
    kind = torch.device(device).type
    record: dict[str, Any] = {"type": kind, "torch": torch.__version__}
    if kind == "cuda":
        index = torch.device(device).index or 0
        record.update(
            name=torch.cuda.get_device_name(index),
            capability=".".join(map(str, torch.cuda.get_device_capability(index))),
            cuda=torch.version.cuda,
            device_count=torch.cuda.device_count(),
        )
    else:
        record.update(
            name=platform.processor() or platform.machine() or "cpu",
            capability=None,
            cuda=None,
            cpu_count=os.cpu_count(),
        )
    return record


def device_worker(
    rank: int, world: int, cases: tuple[Case, ...], options: SuiteOptions, device: str
) -> dict[str, Any]:
    """One rank of part A: pin this rank's GPU (every ``.to("cuda")`` then lands there),
    then time every case with per-run step peaks."""
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(rank)
    return {"cases": bench_cases(rank, world, cases, options, device, peaks=True)}


def run_device_suite(
    cases: tuple[Case, ...],
    options: SuiteOptions,
    device: str = "cuda",
    backend: str = "nccl",
    world: int = 1,
) -> dict[str, Any]:
    """Part A: launch ``world`` ranks on ``backend`` and merge them as the CPU suite does."""
    per_rank = sc.launch(
        device_worker,
        world,
        backend=backend,
        args=(cases, options, device),
        timeout_s=LAUNCH_TIMEOUT_S,
    )
    return {
        "world_size": world,
        "backend": backend,
        "device": device,
        "cases": merge_ranks(per_rank, cases),
    }


def simulated_parity(case: Case, style: str, device: str) -> dict[str, Any]:
    """Part B for one style: the compiled step on ``SIMULATED_WORLD`` simulated ranks and
    the undecorated step on one device, both from the same seed and global batches on
    ``device``; relative differences by ``spmd_compiler.tools.parity``'s rule."""
    model = build_model(case).to(device)
    optim = build_optimizer(model.parameters())
    reference = build_model(case).to(device)
    ref_optim = build_optimizer(reference.parameters())
    step_fn = train_step(case)
    step = sc.compile(parallel_mode=parallel_mode(case, style))(step_fn)
    loss_diffs = []
    with sc.simulate(SIMULATED_WORLD) as sim:
        for x, y in global_batches(case, SIMULATED_STEPS):
            x, y = x.to(device), y.to(device)
            loss = step(model, optim, x, y).detach()
            expected = step_fn(reference, ref_optim, x, y).detach()
            loss_diffs.append(relative_difference(loss, expected))
        step.flush()  # a deferred update (cross_iteration_overlap) must land before comparing
        params = max_difference(compare_models(model, reference, sim))
        optimizer = max_difference(compare_optimizers(optim, ref_optim, sim))
    worst = max(params, optimizer, *loss_diffs)
    return {
        "model": case.name,
        "style": style,
        "world_size": SIMULATED_WORLD,
        "steps": SIMULATED_STEPS,
        "param_rel_diff": params,
        "optimizer_rel_diff": optimizer,
        "loss_rel_diff": max(loss_diffs),
        "tolerance": PARITY_TOLERANCE,
        "parity_ok": worst < PARITY_TOLERANCE,
        "compile_seconds": step.timings.compile_seconds,
        "compile_count": step.compile_count,
    }


def simulation_parity(cases: tuple[Case, ...], device: str = "cuda") -> list[dict[str, Any]]:
    """Part B for every case and style; must run where no process group is initialized
    (``sc.simulate`` makes its own), i.e. here in the parent, not in a launched rank."""
    out = []
    total = len(cases) * len(STYLES)
    for case in cases:
        for style in STYLES:
            record = simulated_parity(case, style, device)
            worst = max(record["param_rel_diff"], record["optimizer_rel_diff"])
            out.append(record)
            progress.report(
                "simulated parity", len(out), total,
                f"{case.name} {style}: state rel diff {worst:.1e}, "
                f"loss rel diff {record['loss_rel_diff']:.1e}",
            )
    return out
