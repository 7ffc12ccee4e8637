"""Real gloo runs on 2 processes: compiled DataParallel == torch's own eager DDP / FSDP2.

One launch trains the same MLP (same seed, same data, same optimizer) four ways on every
rank: compiled ``DataParallel("replicate")``, eager ``DistributedDataParallel``, compiled
``DataParallel("fully_shard")`` and eager FSDP2 (``fully_shard`` on each Linear, then the
root). Each rank passes its half of a fixed global batch. The parent compares the compiled
run with torch's eager run of the same style, and each of them with the undecorated step run
eagerly on one device on the global batch.

The same launch also trains fully_shard with bf16 mixed precision (AdamW only), once per
reduce dtype, compiled (``DataParallel(mp_policy=...)``) and eager (FSDP2's
``MixedPrecisionPolicy`` on every ``fully_shard`` call). Both keep fp32 master weights and
optimizer state and compute in bf16, so they are compared with each other at bf16
tolerance; neither matches the fp32 single-device step.

Loss convention: torch's eager wrappers return each rank's LOCAL loss (mean over the local
batch); the compiled step returns the GLOBAL loss (mean over the global batch). With equal
local batch sizes the global loss is the mean of the ranks' local losses, which is what the
eager runs are compared by.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import spmd_compiler as sc
from spmd_compiler import parallel_modes
from spmd_compiler.tools.parity import (
    backend_under_test,
    full_state,
    launch_timeout,
    relative_difference,
)
from spmd_compiler.tools.demo.steps import classification_train_step

pytestmark = pytest.mark.dist

WORLD_SIZE = 2
STEPS = 3
GLOBAL_BATCH = 8
FEATURES, HIDDEN, CLASSES = 16, 32, 8
TOLERANCE = 1e-5
# bf16 keeps 8 significant bits (epsilon 2**-7 = 7.8e-3). Measured on this model: compiled vs
# eager 1.3e-7 (parameters) and 0 (losses); bf16 vs fp32 compute 3.4e-2 (parameters).
BF16_TOLERANCE = 1e-2

OPTIMIZERS: dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, eps=1e-5, weight_decay=0.01),
    "sgd_momentum": lambda m: torch.optim.SGD(m.parameters(), lr=1e-1, momentum=0.9),
}
# Per style: the compiled run and torch's eager run of the same parallelism.
STYLES = {
    "replicate": ("compiled_replicate", "eager_ddp"),
    "fully_shard": ("compiled_fully_shard", "eager_fsdp2"),
}
RUNS = [run for pair in STYLES.values() for run in pair]
# (param_dtype, reduce_dtype) of both the compiled and the eager policy.
PRECISIONS: dict[str, tuple[torch.dtype | None, torch.dtype | None]] = {
    "fp32": (None, None),
    "bf16_reduce_fp32": (torch.bfloat16, torch.float32),
    "bf16_reduce_bf16": (torch.bfloat16, None),  # None: reduce in param_dtype, as FSDP2
}
MIXED_PRECISIONS = [precision for precision in PRECISIONS if precision != "fp32"]
# Mixed precision runs: fully_shard only (FSDP2 is where torch has the policy), AdamW only.
MIXED_PRECISION_OPTIMIZER = "adamw"


train_step = classification_train_step


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(FEATURES, HIDDEN), nn.LayerNorm(HIDDEN), nn.GELU(), nn.Linear(HIDDEN, CLASSES)
    )


def global_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same fixed global batches in every process (its own generator, no global RNG)."""
    gen = torch.Generator().manual_seed(1234)
    return [
        (
            torch.randn(GLOBAL_BATCH, FEATURES, generator=gen),
            torch.randint(0, CLASSES, (GLOBAL_BATCH,), generator=gen),
        )
        for _ in range(STEPS)
    ]


class Run(NamedTuple):
    """One way of training: call ``step(wrapper, optim, x, y)``; read the state off ``model``."""

    step: Callable[..., torch.Tensor]
    wrapper: nn.Module
    model: nn.Module
    optim: torch.optim.Optimizer


def build_run(run: str, optimizer: str, precision: str = "fp32") -> Run:
    model = make_model()
    dtypes = PRECISIONS[precision]
    if run in ("compiled_replicate", "compiled_fully_shard"):
        style = run.removeprefix("compiled_")
        mode = parallel_modes.DataParallel(
            style, mp_policy=parallel_modes.MixedPrecisionPolicy(*dtypes)
        )
        step = sc.compile(parallel_mode=mode, backend=backend_under_test())(train_step)
        return Run(step, model, model, OPTIMIZERS[optimizer](model))
    if run == "eager_ddp":
        # Forward must go through the wrapper: it hooks the gradient all-reduce.
        ddp = DistributedDataParallel(model)
        return Run(train_step, ddp, model, OPTIMIZERS[optimizer](ddp))
    if run == "eager_fsdp2":
        mesh = init_device_mesh("cpu", (WORLD_SIZE,))
        policy = TorchMixedPrecisionPolicy(*dtypes)
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return Run(train_step, model, model, OPTIMIZERS[optimizer](model))
    raise ValueError(f"unknown run {run!r}")


Key = tuple[str, str, str]  # (run, optimizer, precision)


def train(run: Run, local: slice) -> dict[str, torch.Tensor]:
    """Every step on this rank's share; the losses and the full state after."""
    losses = [
        run.step(run.wrapper, run.optim, x[local], y[local]).detach().clone()
        for x, y in global_batches()
    ]
    # full_tensor(): a collective, every rank gets here
    return {"losses": torch.stack(losses), **full_state(run.model, run.optim, None)}


def worker(rank: int, world_size: int) -> dict[Key, dict[str, torch.Tensor]]:
    """One rank: every (run, optimizer) in fp32, then fully_shard in each mixed precision,
    on this rank's halves of the global batches."""
    per_rank = GLOBAL_BATCH // world_size
    local = slice(rank * per_rank, (rank + 1) * per_rank)
    keys = [(run, optimizer, "fp32") for optimizer in OPTIMIZERS for run in RUNS]
    keys += [
        (run, MIXED_PRECISION_OPTIMIZER, precision)
        for precision in MIXED_PRECISIONS
        for run in STYLES["fully_shard"]
    ]
    return {key: train(build_run(*key), local) for key in keys}


def single_device_reference(optimizer: str) -> dict[str, torch.Tensor]:
    """The undecorated step, eagerly on one device, on the global batches."""
    model = make_model()
    optim = OPTIMIZERS[optimizer](model)
    losses = [train_step(model, optim, x, y).detach().clone() for x, y in global_batches()]
    return {"losses": torch.stack(losses), **full_state(model, optim, None)}


@pytest.fixture(scope="module")
def rank_results() -> list[dict[Key, dict[str, torch.Tensor]]]:
    """One 2-rank launch for all runs, optimizers and precisions: spawning ranks costs
    seconds."""
    return sc.launch(worker, WORLD_SIZE, timeout_s=launch_timeout(180))


def global_view(
    results: list[dict], run: str, optimizer: str, precision: str = "fp32"
) -> dict[str, torch.Tensor]:
    """What a run computed, as single-device numbers: the state (checked equal on every
    rank) and the global loss (eager runs: the mean of the ranks' local losses, in their
    dtype)."""
    per_rank = [r[(run, optimizer, precision)] for r in results]
    first = per_rank[0]
    for rank, other in enumerate(per_rank[1:], start=1):
        assert set(other) == set(first)
        for key, value in first.items():
            if key == "losses" and run.startswith("eager"):
                continue  # local losses: differ by design
            assert torch.equal(other[key], value), f"{run}/{optimizer}: rank {rank} {key} differs"
    view = dict(first)
    if run.startswith("eager"):
        view["losses"] = torch.stack([r["losses"] for r in per_rank]).mean(dim=0)
    return view


def max_relative_differences(
    actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]
) -> dict[str, float]:
    assert set(actual) == set(expected), sorted(set(actual) ^ set(expected))
    return {key: relative_difference(actual[key], want) for key, want in expected.items()}


def assert_close(actual: dict, expected: dict, what: str, tolerance: float = TOLERANCE) -> None:
    errors = max_relative_differences(actual, expected)
    worst = max(errors, key=errors.__getitem__)
    assert errors[worst] < tolerance, f"{what}: {worst} differs by {errors[worst]:.2e}"


def param_difference(actual: dict, expected: dict) -> float:
    """The largest relative difference over the parameters (``param.*``)."""
    errors = max_relative_differences(actual, expected)
    return max(error for key, error in errors.items() if key.startswith("param."))


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("style", sorted(STYLES))
def test_compiled_matches_torch_eager(rank_results: list, style: str, optimizer: str) -> None:
    compiled, eager = STYLES[style]
    assert_close(
        global_view(rank_results, compiled, optimizer),
        global_view(rank_results, eager, optimizer),
        f"{compiled} vs {eager} ({optimizer})",
    )


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("run", RUNS)
def test_matches_single_device(rank_results: list, run: str, optimizer: str) -> None:
    assert_close(
        global_view(rank_results, run, optimizer),
        single_device_reference(optimizer),
        f"{run} vs single device ({optimizer})",
    )


def test_comparisons_can_fail(rank_results: list) -> None:
    """Training moves every parameter and the loss, and the ranks' local losses differ, so
    the comparisons above are not comparing initial weights or one rank's loss; and bf16
    training ends farther from fp32 training than the bf16 tolerance."""
    initial = {f"param.{k}": v for k, v in make_model().state_dict().items()}
    for optimizer in OPTIMIZERS:
        after = single_device_reference(optimizer)
        assert not torch.equal(after["losses"][0], after["losses"][-1])
        for key, value in initial.items():
            assert relative_difference(after[key], value) > 100 * TOLERANCE, (optimizer, key)
        for _, eager in STYLES.values():
            local = [r[(eager, optimizer, "fp32")]["losses"] for r in rank_results]
            assert relative_difference(local[0], local[1]) > 100 * TOLERANCE, (eager, optimizer)
    after = single_device_reference(MIXED_PRECISION_OPTIMIZER)
    for precision in MIXED_PRECISIONS:
        _, eager = STYLES["fully_shard"]
        local = [r[(eager, MIXED_PRECISION_OPTIMIZER, precision)]["losses"] for r in rank_results]
        assert relative_difference(local[0], local[1]) > 10 * BF16_TOLERANCE, precision
        # bf16 compute lands farther from fp32 compute than the bf16 comparisons allow
        view = global_view(rank_results, eager, MIXED_PRECISION_OPTIMIZER, precision)
        assert param_difference(view, after) > BF16_TOLERANCE, precision


# Inductor's bf16 kernels round differently from eager's, in torch.compile too. Measured
# 2026-11-27 on this model (AdamW, 3 steps, emulate_precision_casts on, as the lowering
# sets it): torch.compile of the undecorated single-device bf16 step (one process) differs
# from the same step run eagerly by 1.05e-2 (exp_avg_sq), 7.3e-3 (parameters), 6.6e-3
# (losses); with SPMD_TEST_BACKEND=inductor the compiled fully_shard run differs from
# FSDP2's bf16 run by 1.04e-2, 1.04e-2 and 6.6e-3, and from FSDP2's fp32 run by 3.4e-2.
# So on Inductor the bf16 comparison allows twice torch.compile's own deviation, and checks
# that the run is nearer to FSDP2's bf16 run than to its fp32 one.
INDUCTOR_BF16_TOLERANCE = 2e-2


def bf16_tolerance() -> float:
    return INDUCTOR_BF16_TOLERANCE if backend_under_test() == "inductor" else BF16_TOLERANCE


@pytest.mark.parametrize("precision", MIXED_PRECISIONS)
def test_compiled_matches_torch_eager_mixed_precision(rank_results: list, precision: str) -> None:
    """Compiled fully_shard == FSDP2 with the same bf16 policy, within bf16 tolerance (on
    Inductor, the one measured above), and nearer to it than to FSDP2's fp32 run; the
    compiled step returns the global loss in bf16 and keeps master state in fp32."""
    compiled, eager = STYLES["fully_shard"]
    optimizer = MIXED_PRECISION_OPTIMIZER
    actual = global_view(rank_results, compiled, optimizer, precision)
    expected = global_view(rank_results, eager, optimizer, precision)
    assert actual["losses"].dtype == expected["losses"].dtype == torch.bfloat16
    for key, value in actual.items():
        if key.startswith("param.") or key.endswith(("exp_avg", "exp_avg_sq")):
            assert value.dtype == torch.float32, (precision, key, value.dtype)
    assert_close(actual, expected, f"{compiled} vs {eager} ({precision})", bf16_tolerance())
    full_precision = global_view(rank_results, eager, optimizer, "fp32")
    assert param_difference(actual, expected) < param_difference(actual, full_precision) / 2


def test_mixed_precision_reduce_dtype_matters(rank_results: list) -> None:
    """The bf16 tolerance above cannot tell the reduce dtypes apart (they move the
    parameters by ~1e-3), so check that the compiled run of each reduce dtype is nearer
    to FSDP2's run with that reduce dtype than to FSDP2's run with the other one. Not on
    Inductor: its own bf16 rounding (1e-2, measured above) is ten times the effect; the
    program's reduce dtype is checked there by tests/sim/test_data_parallel.py
    (``test_mixed_precision_bf16``: the reduce-scatter's dtype and bytes)."""
    if backend_under_test() == "inductor":
        pytest.skip("Inductor's bf16 rounding (1e-2) is larger than the reduce dtype's effect (1e-3)")
    compiled, eager = STYLES["fully_shard"]
    optimizer = MIXED_PRECISION_OPTIMIZER
    views = {
        (run, precision): global_view(rank_results, run, optimizer, precision)
        for run in (compiled, eager)
        for precision in MIXED_PRECISIONS
    }
    for precision in MIXED_PRECISIONS:
        same = param_difference(views[(compiled, precision)], views[(eager, precision)])
        for other in MIXED_PRECISIONS:
            if other != precision:
                apart = param_difference(views[(compiled, precision)], views[(eager, other)])
                assert same < apart / 10, (precision, other, same, apart)
