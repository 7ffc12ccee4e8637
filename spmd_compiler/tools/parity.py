"""Single-device equivalence, measured: the shared helper of tests, demo and benchmarks.

The reference is the user's own (undecorated) step run eagerly on one device with the
global batch; the compiled step runs on N ranks with each rank's share. ``full_state``
collects every parameter, buffer and optimizer-state tensor as a plain full tensor, keyed
by name, so that the two runs can be compared key by key. The relative error of a tensor
is ``max|a - b| / max|b|`` (the absolute error when ``b`` is all zeros).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate

from .. import _torch_private as private
from ..runtime.simulate import Simulation


def relative_difference(actual: torch.Tensor, expected: torch.Tensor) -> float:
    if actual.is_complex() or expected.is_complex():  # both parts, not the real one alone
        actual = torch.view_as_real(actual.detach().to(torch.complex128).resolve_conj())
        expected = torch.view_as_real(expected.detach().to(torch.complex128).resolve_conj())
    actual = actual.detach().to(torch.float64).cpu()
    expected = expected.detach().to(torch.float64).cpu()
    if actual.shape != expected.shape:
        raise AssertionError(f"shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    if not expected.numel():
        return 0.0
    diff = (actual - expected).abs().max().item()
    scale = expected.abs().max().item()
    return diff / scale if scale else diff


def full_value(t: Any, sim: Simulation | None) -> Any:
    """A plain tensor with the full value of ``t`` (DTensor, per-rank or plain).

    On real ranks this is a collective for DTensors: every rank must call it.
    """
    if not isinstance(t, torch.Tensor):
        return t
    if sim is not None:
        return sim.full_tensor(t)
    if isinstance(t, DTensor):  # through the gap fills: torch 2.11 cannot gather a _StridedShard
        return private.redistribute(t, [Replicate()] * t.device_mesh.ndim).to_local()
    return t


def full_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, sim: Simulation | None
) -> dict[str, torch.Tensor]:
    """Every parameter, buffer and optimizer-state tensor, full and on CPU, by name: copies,
    which later steps do not change.

    Optimizer state is keyed ``optim.g{group}.p{index}.{key}`` (position in the param
    groups), so that two optimizers over two copies of a model line up.
    """
    out: dict[str, torch.Tensor] = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        out[f"param.{name}"] = _snapshot(full_value(t, sim))
    if optimizer is not None:
        for gi, group in enumerate(optimizer.param_groups):
            for pi, p in enumerate(group["params"]):
                for key, value in sorted(optimizer.state.get(p, {}).items()):
                    if isinstance(value, torch.Tensor):
                        out[f"optim.g{gi}.p{pi}.{key}"] = _snapshot(full_value(value, sim))
    return out


def _snapshot(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of ``t`` that later steps leave alone: they update state in place (NOTE:
    [interpreted programs update state in place]), and ``.cpu()`` of a CPU tensor, like a
    replicated DTensor's full tensor, is the tensor itself."""
    return t.detach().to("cpu", copy=True)


def compare_states(
    actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]
) -> dict[str, float]:
    """Relative difference per key; raises if the two states hold different keys."""
    if set(actual) != set(expected):
        missing = sorted(set(expected) ^ set(actual))
        raise AssertionError(f"states differ in keys: {missing[:8]}")
    return {
        key: relative_difference(actual[key].reshape(expected[key].shape), expected[key])
        for key in expected
    }


def compare_models(model, reference, sim: Simulation | None) -> dict[str, float]:
    """Relative difference of every parameter and buffer."""
    return compare_states(full_state(model, None, sim), full_state(reference, None, None))


def run_against_eager(model, step, mode, batches, *, lr: float, world_size: int = 2):  # noqa: ANN001, ANN201
    """``step(model, SGD(lr), *batch)`` compiled under ``mode`` on ``world_size``
    simulated ranks and eagerly on a deep copy, batch by batch: ``(pairs of compiled and
    eager results, compare_models's differences, the compiled step)``."""
    import copy

    import spmd_compiler as sc

    reference = copy.deepcopy(model)
    optim = torch.optim.SGD(model.parameters(), lr=lr)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=lr)
    compiled = sc.compile(mode)(step)
    with sc.simulate(world_size=world_size) as sim:
        pairs = [(compiled(model, optim, *b), step(reference, ref_optim, *b)) for b in batches]
        differences = compare_models(model, reference, sim)
    return pairs, differences, compiled


def compare_optimizers(optimizer, reference, sim: Simulation | None) -> dict[str, float]:
    """Relative difference of every optimizer-state tensor."""
    empty = torch.nn.Module()
    return compare_states(full_state(empty, optimizer, sim), full_state(empty, reference, None))


def max_difference(*diffs: dict[str, float]) -> float:
    return max((v for d in diffs for v in d.values()), default=0.0)


# NOTE: [test backend]
# The parity tests that run on real ranks (tests/dist) compile with the lowering backend
# named by SPMD_TEST_BACKEND ("eager" when unset), so the same tests check the fx
# interpreter and the Inductor-lowered program: `SPMD_TEST_BACKEND=inductor pytest
# tests/dist`. Tests on simulated ranks (tests/sim) are backend-independent: one program
# runs for N ranks at once there and is always interpreted (NOTE: [lowering]).
TEST_BACKEND_ENV = "SPMD_TEST_BACKEND"


def backend_under_test() -> str:
    """The lowering backend the real-rank parity tests compile with (NOTE: [test backend])."""
    from ..lower import BACKENDS

    backend = os.environ.get(TEST_BACKEND_ENV, "eager")
    if backend not in BACKENDS:
        raise ValueError(
            f"{TEST_BACKEND_ENV}={backend!r} is not a lowering backend; choose one of "
            f"{', '.join(BACKENDS)}."
        )
    return backend


# Inductor compiles C++ kernels on every rank at once: minutes per launch on 2 cores.
INDUCTOR_LAUNCH_TIMEOUT_S = 1800


def launch_timeout(eager_seconds: float) -> float:
    """A parity test's launch timeout on the backend under test: ``eager_seconds`` for the
    interpreter, at least ``INDUCTOR_LAUNCH_TIMEOUT_S`` when the ranks lower with Inductor."""
    if backend_under_test() == "inductor":
        return max(eager_seconds, INDUCTOR_LAUNCH_TIMEOUT_S)
    return eager_seconds
