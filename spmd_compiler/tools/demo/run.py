"""The demo: train the small GPT with a compiled step beside the single-device reference.

``python -m spmd_compiler demo`` runs on 4 simulated ranks by default; ``--backend gloo``
spawns real CPU processes, ``--backend nccl`` one process per GPU. Every step prints the
compiled loss beside the reference loss (the undecorated step, eager, one device, global
batch); at the end every parameter and optimizer-state tensor is compared. The exit code
is non-zero when parity fails (checked with dropout off; with dropout on the two runs draw
different random masks and only the compiled losses are reported).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from spmd_compiler.api import compile as spmd_compile
from spmd_compiler.ir.collectives import collective_stats
from spmd_compiler.parallel_modes import make_mode
from spmd_compiler.runtime.simulate import simulate
from spmd_compiler.tools.parity import compare_states, full_state, relative_difference

from .data import batches, markov_corpus
from .gpt import GPT, GPTConfig, gpt_tp_plan, gpt_train_step


@dataclass(frozen=True)
class DemoConfig:
    mode: str = "dtensor_expand"
    world_size: int = 4
    backend: str = "sim"
    steps: int = 8
    batch_size: int = 16
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 8
    block_size: int = 32
    vocab_size: int = 64
    dropout: float = 0.0
    lr: float = 3e-3
    # NOTE: [Adam eps and parity] Adam divides each gradient element by its own running
    # magnitude plus eps. Elements whose gradient is ~eps turn float32 rounding noise
    # (different summation order across ranks) into updates of up to +-lr. Measured on
    # this model at world 4: eps=1e-8 gives ~1e-4 relative parameter differences,
    # eps=1e-5 ~1e-5, eps=1e-4 ~1e-6 (SGD: 5e-7). eps=1e-4 keeps the comparison about
    # the compiler, not about Adam's conditioning; float64 runs match to ~1e-13.
    eps: float = 1e-4
    weight_decay: float = 0.01
    seed: int = 0
    tolerance: float = 1e-5
    device: str = "cpu"
    mesh: tuple[int, ...] = ()  # (dp, tp) for fsdp_tp


@dataclass
class DemoReport:
    mode: str
    world_size: int
    backend: str
    steps: int
    losses: list[float]
    reference_losses: list[float]
    max_param_rel_diff: float
    max_optimizer_state_rel_diff: float
    max_loss_rel_diff: float
    collectives: dict[str, int]
    collectives_before_passes: dict[str, int]
    comm_bytes_per_step: int
    compile_seconds: float
    step_seconds: list[float]
    parity_checked: bool
    parity_ok: bool
    extra: dict[str, Any] = field(default_factory=dict)


def build(config: DemoConfig) -> tuple[torch.nn.Module, torch.optim.Optimizer, list]:
    """Model, optimizer and global batches, identical for every caller with one seed."""
    torch.manual_seed(config.seed)
    gpt_config = GPTConfig(
        vocab_size=config.vocab_size, block_size=config.block_size, n_layer=config.n_layer,
        n_head=config.n_head, n_embd=config.n_embd, dropout=config.dropout,
    )
    model = GPT(gpt_config).to(config.device)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.lr, eps=config.eps, weight_decay=config.weight_decay
    )
    corpus = markov_corpus(config.vocab_size, 20_000, seed=config.seed)
    data = [
        (x.to(config.device), y.to(config.device))
        for x, y in batches(corpus, config.batch_size, config.block_size, config.steps, seed=config.seed + 1)
    ]
    return model, optimizer, data


def run_reference(config: DemoConfig) -> tuple[list[float], dict[str, torch.Tensor]]:
    model, optimizer, data = build(config)
    losses = [float(gpt_train_step(model, optimizer, x, y).detach()) for x, y in data]
    return losses, full_state(model, optimizer, None)


def demo_mode(config: DemoConfig):
    """The parallel mode the demo runs, with the GPT's tensor-parallel plan where needed."""
    if config.mode == "tp":
        return make_mode("tp", plan=gpt_tp_plan())
    if config.mode == "fsdp_tp":
        return make_mode("fsdp_tp", plan=gpt_tp_plan(), mesh_shape=config.mesh or (2, config.world_size // 2))
    return make_mode(config.mode)


def print_step(index: int, steps: int, loss: float, seconds: float, compiled: bool) -> None:
    """One line per compiled step as it finishes (``--backend sim``: rank 0's process)."""
    note = " (includes compile)" if compiled else ""
    print(f"step {index + 1}/{steps}: loss {loss:.6f}  {seconds:.2f} s{note}", flush=True)


def _timed_steps(step, model, optimizer, data, show: bool) -> list[float]:
    losses = []
    for i, (x, y) in enumerate(data):
        start, compiles = time.perf_counter(), step.compile_count
        losses.append(float(step(model, optimizer, x, y)))
        if show:
            print_step(i, len(data), losses[-1], time.perf_counter() - start,
                       step.compile_count > compiles)
    return losses


def run_compiled_simulated(config: DemoConfig, show_steps: bool = False) -> dict[str, Any]:
    model, optimizer, data = build(config)
    step = spmd_compile(parallel_mode=demo_mode(config))(gpt_train_step)
    with simulate(world_size=config.world_size) as sim:
        losses = _timed_steps(step, model, optimizer, data, show_steps)
        state = full_state(model, optimizer, sim)
    return _result(step, losses, state)


def compiled_worker(
    rank: int, world_size: int, config: DemoConfig, show_steps: bool = False
) -> dict[str, Any]:
    """One real rank: compile, train on this rank's share of each global batch."""
    model, optimizer, data = build(config)
    mode = demo_mode(config)
    step = spmd_compile(parallel_mode=mode)(gpt_train_step)
    mesh = mode.mesh(torch.device(config.device).type)
    local = [
        (mode.local_batch(x, rank, index=0, mesh=mesh), mode.local_batch(y, rank, index=1, mesh=mesh))
        for x, y in data
    ]
    losses = _timed_steps(step, model, optimizer, local, show_steps and rank == 0)
    state = full_state(model, optimizer, None)
    return _result(step, losses, state if rank == 0 else {})


def compile_breakdown(step) -> dict[str, Any]:
    """Seconds per compile stage, summed over the step's compiles, and how the cache
    served each compile (NOTE: [persistent compile cache])."""
    t = step.timings
    return {
        "capture": t.capture_seconds, "expand": t.expand_seconds, "passes": t.pass_seconds,
        "lowering": t.lower_seconds, "cache load": t.cache_load_seconds,
        "cache": [r.cache for r in step.records],
    }


def _result(step, losses: list[float], state: dict[str, torch.Tensor]) -> dict[str, Any]:
    stats = collective_stats(step.last_program.graph_module)
    seconds = list(step.timings.step_seconds)
    steady = seconds[2:] or seconds
    return {
        "losses": losses,
        "state": state,
        "collectives": dict(stats.counts),
        "collectives_before_passes": dict(step.last_program.collectives_before_passes),
        "comm_bytes_per_step": stats.total_bytes,
        "compile_seconds": step.timings.compile_seconds,
        "compile_breakdown": compile_breakdown(step),
        "step_seconds": steady,
        "compile_count": step.compile_count,
    }


def run_demo(config: DemoConfig, show_steps: bool = False) -> DemoReport:
    """Train compiled, then the single-device reference, and compare.

    Args:
        config: the run.
        show_steps: print a line per compiled step as it finishes, and a line before the
            reference run (the command line turns it on).
    """
    if config.backend == "sim":
        compiled = run_compiled_simulated(config, show_steps)
    else:
        from spmd_compiler.runtime.launch import launch

        results = launch(
            compiled_worker, config.world_size, backend=config.backend, args=(config, show_steps)
        )
        compiled = results[0]
    if show_steps:
        print(f"reference: the same {config.steps} steps eagerly on one device...", flush=True)
    ref_losses, ref_state = run_reference(config)
    checked = config.dropout == 0.0
    diffs = compare_states(compiled["state"], ref_state)
    param_diff = max((v for k, v in diffs.items() if k.startswith("param.")), default=0.0)
    optim_diff = max((v for k, v in diffs.items() if k.startswith("optim.")), default=0.0)
    loss_diff = max(
        relative_difference(torch.tensor(a), torch.tensor(b))
        for a, b in zip(compiled["losses"], ref_losses, strict=True)
    )
    ok = (not checked) or max(param_diff, optim_diff, loss_diff) < config.tolerance
    return DemoReport(
        mode=config.mode, world_size=config.world_size, backend=config.backend,
        steps=config.steps, losses=compiled["losses"], reference_losses=ref_losses,
        max_param_rel_diff=param_diff, max_optimizer_state_rel_diff=optim_diff,
        max_loss_rel_diff=loss_diff, collectives=compiled["collectives"],
        collectives_before_passes=compiled["collectives_before_passes"],
        comm_bytes_per_step=compiled["comm_bytes_per_step"],
        compile_seconds=compiled["compile_seconds"], step_seconds=compiled["step_seconds"],
        parity_checked=checked, parity_ok=ok,
        extra={"compile_count": compiled["compile_count"], "config": asdict(config),
               "compile_breakdown": compiled["compile_breakdown"]},
    )


def print_report(report: DemoReport) -> None:
    print(f"mode={report.mode} world_size={report.world_size} backend={report.backend}")
    print(f"{'step':>4}  {'compiled loss':>14}  {'reference loss':>14}  {'rel diff':>9}")
    for i, (a, b) in enumerate(zip(report.losses, report.reference_losses, strict=True)):
        print(f"{i:>4}  {a:>14.6f}  {b:>14.6f}  {abs(a - b) / max(abs(b), 1e-30):>9.2e}")
    kinds = ", ".join(f"{k}={v}" for k, v in sorted(report.collectives.items())) or "none"
    before = ", ".join(f"{k}={v}" for k, v in sorted(report.collectives_before_passes.items()))
    print(f"collectives per step: {kinds}; {report.comm_bytes_per_step} bytes "
          f"(before passes: {before or 'none'})")
    med = statistics.median(report.step_seconds) if report.step_seconds else float("nan")
    print(f"compile {report.compile_seconds:.2f}s; step median {med * 1e3:.1f} ms")
    parts = report.extra.get("compile_breakdown")
    if parts:
        print("compile stages: " + ", ".join(
            f"{k} {v:.2f}s" for k, v in parts.items() if k != "cache"
        ) + f"; compile cache: {', '.join(parts['cache'])}")
    if report.parity_checked:
        verdict = "OK" if report.parity_ok else "FAILED"
        print(
            f"parity {verdict}: max param rel diff {report.max_param_rel_diff:.2e}, "
            f"optimizer state {report.max_optimizer_state_rel_diff:.2e}, "
            f"loss {report.max_loss_rel_diff:.2e}"
        )
    else:
        print("parity not checked: dropout is on (random masks differ from the reference)")


def write_json(report: DemoReport, path: str) -> None:
    with open(path, "w") as f:
        json.dump(asdict(report), f, indent=2)
