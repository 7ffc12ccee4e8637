"""Compile time of the demo GPT as it deepens: capture + expand + passes, 2 simulated ranks."""

from __future__ import annotations

from typing import Any

import torch

import spmd_compiler as sc
from spmd_compiler.parallel_modes import make_mode
from spmd_compiler.tools.demo.gpt import gpt_train_step

from . import progress
from .models import Case, build_model, build_optimizer, global_batches

LAYERS = (2, 4, 8, 16)


def compile_record(layers: int, mode: str = "ddp", world: int = 2) -> dict[str, float]:
    """Seconds of the first compilation (the step that creates optimizer state)."""
    case = Case(f"gpt-{layers}x64", "gpt", 64, layers, 2 * world)
    model = build_model(case)
    optim = build_optimizer(model.parameters())
    x, y = global_batches(case, 1)[0]
    step = sc.compile(parallel_mode=make_mode(mode))(gpt_train_step)
    with sc.simulate(world_size=world):
        step(model, optim, x, y)
    record = step.records[0]
    return {
        "capture": record.capture_seconds,
        "expand": record.expand_seconds,
        "passes": record.pass_seconds,
        "total": record.total_seconds,
        "nodes": float(len(record.program.graph_module.graph.nodes)),
    }


def compile_scaling(layers: tuple[int, ...] = LAYERS, mode: str = "ddp") -> dict[str, Any]:
    torch.set_num_threads(1)
    rows = {}
    for i, n in enumerate(layers, 1):
        rows[n] = compile_record(n, mode)
        progress.report(
            "compile scaling", i, len(layers), f"{mode} gpt {n} layers: {rows[n]['total']:.2f}s"
        )
    deepest = max(layers)
    half = rows.get(deepest // 2)
    ratio = rows[deepest]["total"] / half["total"] if half else None
    return {
        "mode": mode,
        "world_size": 2,
        "layers": rows,
        "ratio_layers": (deepest, deepest // 2),
        "time_ratio": ratio,
    }
