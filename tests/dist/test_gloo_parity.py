"""Real gloo runs on 2 processes: compiled step == single-device eager step on the global batch.

Each rank passes its half of a fixed global batch; the parent runs the undecorated step on
the whole batch and compares losses, every parameter and every optimizer-state tensor.
Worker functions live at module level so that ``spawn`` can import them in the ranks.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import spmd_compiler as sc
from spmd_compiler import _torch_private as private
from spmd_compiler.tools.demo.steps import classification_train_step
from spmd_compiler.runtime.launch import LaunchError
from spmd_compiler.tools.parity import (
    backend_under_test,
    full_state,
    launch_timeout,
    relative_difference,
)

pytestmark = pytest.mark.dist

WORLD_SIZE = 2
STEPS = 3
GLOBAL_BATCH = 8
FEATURES, HIDDEN, CLASSES = 8, 16, 4
TOLERANCE = 1e-5

OPTIMIZERS: dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01),
    "sgd_momentum": lambda m: torch.optim.SGD(m.parameters(), lr=1e-1, momentum=0.9),
}


train_step = classification_train_step


def make_model() -> nn.Module:
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


def eval_step(model, x, y):
    """An evaluation step: no optimizer (NOTE: [steps without an optimizer]); the count
    of right answers as a Python int (NOTE: [returned .item() values])."""
    with torch.no_grad():
        logits = model(x)
        return F.cross_entropy(logits, y), logits, (logits.argmax(-1) == y).sum().item()


def held_out() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(99)
    return torch.randn(GLOBAL_BATCH, FEATURES, generator=gen), torch.randint(
        0, CLASSES, (GLOBAL_BATCH,), generator=gen
    )


def compiled_worker(rank: int, world_size: int) -> dict[str, object]:
    """One rank: for each optimizer, compile the step and train on this rank's halves,
    with a compiled evaluation on a held-out batch before and after."""
    per_rank = GLOBAL_BATCH // world_size
    local = slice(rank * per_rank, (rank + 1) * per_rank)
    info = sc.init_from_env()  # launch already joined the group: this only reads it
    out: dict[str, object] = {
        "rank": rank,
        "rank_info": (info.rank, info.world_size, info.local_rank, info.backend),
    }
    for name, make_optimizer in OPTIMIZERS.items():
        model = make_model()
        optim = make_optimizer(model)
        step = sc.compile(backend=backend_under_test())(train_step)
        evaluate = sc.compile(backend=backend_under_test())(eval_step)
        xv, yv = held_out()
        evaluations = [evaluate(model, xv[local], yv[local])]
        losses, compile_counts = [], []
        for x, y in global_batches():
            losses.append(step(model, optim, x[local], y[local]).detach().clone())
            compile_counts.append(step.compile_count)
        evaluations.append(evaluate(model, xv[local], yv[local]))
        out[name] = {
            "evaluations": evaluations,
            "losses": torch.stack(losses),
            "state": full_state(model, optim, None),  # full_tensor(): a collective
            "not_dtensor": [k for k, v in model.state_dict().items() if not isinstance(v, DTensor)],
            "compile_counts": compile_counts,
        }
    return out


def eager_reference(optimizer: str) -> dict[str, object]:
    model = make_model()
    optim = OPTIMIZERS[optimizer](model)
    evaluations = [eval_step(model, *held_out())]
    losses = [train_step(model, optim, x, y).detach().clone() for x, y in global_batches()]
    evaluations.append(eval_step(model, *held_out()))
    return {
        "losses": torch.stack(losses),
        "state": full_state(model, optim, None),
        "evaluations": evaluations,
    }


@pytest.fixture(scope="module")
def rank_results() -> list[dict[str, object]]:
    """One 2-rank launch for all optimizers: spawning ranks costs seconds each time."""
    return sc.launch(compiled_worker, WORLD_SIZE, timeout_s=launch_timeout(120))


def test_results_come_back_in_rank_order(rank_results: list[dict[str, object]]) -> None:
    assert [r["rank"] for r in rank_results] == list(range(WORLD_SIZE))
    assert [r["rank_info"] for r in rank_results] == [
        (rank, WORLD_SIZE, rank, "gloo") for rank in range(WORLD_SIZE)
    ]


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_compiled_step_matches_single_device(
    rank_results: list[dict[str, object]], optimizer: str
) -> None:
    expected = eager_reference(optimizer)
    n_params = len(list(make_model().parameters()))
    assert sum(k.startswith("param.") for k in expected["state"]) == n_params
    for rank, result in enumerate(rank_results):
        got = result[optimizer]
        assert got["not_dtensor"] == [], f"rank {rank}: state_dict() holds plain tensors"
        # Step 1 creates the optimizer state (one recompile at step 2); step 3 must reuse.
        assert got["compile_counts"][-1] == got["compile_counts"][-2], f"rank {rank} recompiled"
        errors = {"losses": relative_difference(got["losses"], expected["losses"])}
        # the evaluation's loss and logits are global values on every rank
        for when, (loss, logits, right), (want_loss, want_logits, want_right) in zip(
            ("before", "after"), got["evaluations"], expected["evaluations"], strict=True
        ):
            assert type(right) is int and right == want_right, f"rank {rank}: {when} {right}"
            assert logits.shape == want_logits.shape, f"rank {rank}: {when} logits {logits.shape}"
            errors[f"evaluation {when}: loss"] = relative_difference(loss, want_loss)
            errors[f"evaluation {when}: logits"] = relative_difference(logits, want_logits)
        assert set(got["state"]) == set(expected["state"])
        for key, want in expected["state"].items():
            errors[key] = relative_difference(got["state"][key], want)
        worst = max(errors, key=errors.__getitem__)
        assert errors[worst] < TOLERANCE, f"rank {rank}: {worst} differs by {errors[worst]:.2e}"


def zero_grad_first_step(model, optim, x, y):
    optim.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    return loss


def make_uneven_model() -> nn.Module:
    """First layer's 15 rows do not divide 2 ranks: fully_shard pads them."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 15), nn.Tanh(), nn.Linear(15, CLASSES))


def uneven_fully_shard_worker(rank: int, world_size: int) -> dict[str, object]:
    from spmd_compiler.parallel_modes import DataParallel

    per_rank = GLOBAL_BATCH // world_size
    local = slice(rank * per_rank, (rank + 1) * per_rank)
    sc.init_from_env()
    model = make_uneven_model()
    optim = OPTIMIZERS["adamw"](model)
    step = sc.compile(DataParallel("fully_shard"), backend=backend_under_test())(
        zero_grad_first_step
    )
    losses = [step(model, optim, x[local], y[local]).detach().clone() for x, y in global_batches()]
    grads = {f"grad.{n}": p.grad.full_tensor() for n, p in model.named_parameters()}
    return {"losses": torch.stack(losses), "state": {**full_state(model, optim, None), **grads}}


def test_fully_shard_uneven_keeps_gradients_between_steps_on_gloo() -> None:
    """zero_grad at the start of the step keeps gradients of padded parameters between
    steps (issue 11 item 6: a raw GuardOnDataDependentSymNode before)."""
    results = sc.launch(uneven_fully_shard_worker, WORLD_SIZE, timeout_s=launch_timeout(120))
    model = make_uneven_model()
    optim = OPTIMIZERS["adamw"](model)
    losses = [zero_grad_first_step(model, optim, x, y).detach().clone() for x, y in global_batches()]
    expected = {**full_state(model, optim, None), **{f"grad.{n}": p.grad for n, p in model.named_parameters()}}
    for rank, result in enumerate(results):
        assert relative_difference(result["losses"], torch.stack(losses)) < TOLERANCE
        assert set(result["state"]) == set(expected)
        errors = {k: relative_difference(result["state"][k], v) for k, v in expected.items()}
        worst = max(errors, key=errors.__getitem__)
        assert errors[worst] < TOLERANCE, f"rank {rank}: {worst} differs by {errors[worst]:.2e}"


def make_weight_normed_model() -> nn.Module:
    """A weight-normed last Linear(16, 2): each of the 2 ranks holds one row of its ``v``
    (NOTE: [bucket results stay contiguous] in passes/bucket_collectives.py)."""
    torch.manual_seed(0)
    last = torch.nn.utils.parametrizations.weight_norm(nn.Linear(HIDDEN, 2))
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), last)


def weight_norm_worker(rank: int, world_size: int) -> dict[str, object]:
    from spmd_compiler.parallel_modes import DataParallel

    per_rank = GLOBAL_BATCH // world_size
    local = slice(rank * per_rank, (rank + 1) * per_rank)
    sc.init_from_env()
    model = make_weight_normed_model()
    optim = OPTIMIZERS["adamw"](model)
    step = sc.compile(DataParallel("fully_shard"), backend=backend_under_test())(train_step)
    losses = [step(model, optim, x[local], y[local] % 2).detach().clone() for x, y in global_batches()]
    return {"losses": torch.stack(losses), "state": full_state(model, optim, None)}


def test_fully_shard_weight_norm_one_row_a_rank_on_gloo() -> None:
    """The first step failed in the weight norm's backward ("saved_v must be contiguous"):
    the bucketed gather handed it a strided view of the bucket."""
    results = sc.launch(weight_norm_worker, WORLD_SIZE, timeout_s=launch_timeout(120))
    model = make_weight_normed_model()
    optim = OPTIMIZERS["adamw"](model)
    losses = [train_step(model, optim, x, y % 2).detach().clone() for x, y in global_batches()]
    expected = full_state(model, optim, None)
    for rank, result in enumerate(results):
        errors = {"losses": relative_difference(result["losses"], torch.stack(losses))}
        errors.update({k: relative_difference(result["state"][k], v) for k, v in expected.items()})
        worst = max(errors, key=errors.__getitem__)
        assert errors[worst] < TOLERANCE, f"rank {rank}: {worst} differs by {errors[worst]:.2e}"


def failing_worker(rank: int, world_size: int) -> None:
    """Rank 1 raises; rank 0 waits in a collective that will never complete."""
    if rank == 1:
        raise ValueError("boom on purpose")
    dist.barrier()


def test_failing_rank_is_named() -> None:
    start = time.monotonic()
    with pytest.raises(LaunchError, match=r"rank 1 of 2 failed") as info:
        sc.launch(failing_worker, WORLD_SIZE, timeout_s=60)
    assert time.monotonic() - start < 30, "the surviving rank was not stopped promptly"
    assert "ValueError: boom on purpose" in info.value.failures[1]
    assert "ValueError: boom on purpose" in str(info.value)


def sleeping_worker(rank: int, world_size: int) -> int:
    """Rank 0 never finishes."""
    if rank == 0:
        time.sleep(600)
    return rank


def test_hung_rank_is_killed_at_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(LaunchError, match=r"rank 0 of 2 failed") as info:
        sc.launch(sleeping_worker, WORLD_SIZE, timeout_s=5)
    assert time.monotonic() - start < 20
    assert "did not finish within timeout_s=5 s" in info.value.failures[0]


def test_unpicklable_function_fails_before_spawning() -> None:
    with pytest.raises(TypeError, match="module level"):
        sc.launch(lambda rank, world_size: rank, WORLD_SIZE)


def test_reference_is_not_trivial() -> None:
    """The parity test could fail: training changes the parameters and the loss."""
    before = {k: v.clone() for k, v in make_model().state_dict().items()}
    after = eager_reference("adamw")
    losses = after["losses"]
    assert not torch.equal(losses[0], losses[-1])
    for name, value in before.items():
        assert relative_difference(after["state"][f"param.{name}"], value) > 1e-4, name


def finite_checked_step(model, optim, x, y):
    """A check on a tensor's value (NOTE: [value checks]): kept in the program."""
    loss = F.cross_entropy(model(x), y)
    assert torch.isfinite(loss), "the loss is not finite"
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def value_check_worker(rank: int, world_size: int) -> dict[str, object]:
    """Rank 1's half of the second batch holds a NaN: every rank must refuse that call
    (the condition is a global value) and keep the first step's state."""
    per_rank = GLOBAL_BATCH // world_size
    local = slice(rank * per_rank, (rank + 1) * per_rank)
    sc.init_from_env()
    model = make_model()
    optim = OPTIMIZERS["adamw"](model)
    step = sc.compile(backend=backend_under_test())(finite_checked_step)
    (x0, y0), (x1, y1), (x2, y2) = global_batches()
    step(model, optim, x0[local], y0[local])
    x1 = x1.clone()
    x1[-1, 0] = float("nan")  # the last row: rank 1's half
    try:
        step(model, optim, x1[local], y1[local])
        refused = ""
    except sc.SPMDRuntimeError as exc:
        refused = str(exc)
    losses = [step(model, optim, x2[local], y2[local]).detach().clone()]
    # a branch: the NaN call runs the other way's program on every rank
    skip_model = make_model()
    skip_optim = OPTIMIZERS["adamw"](skip_model)
    skip = sc.compile(backend=backend_under_test())(skipping_step)
    for x, y in ((x0, y0), (x1, y1), (x2, y2)):
        skip(skip_model, skip_optim, x[local], y[local])
    return {
        "refused": refused, "losses": torch.stack(losses),
        "state": full_state(model, optim, None),
        "skip_state": full_state(skip_model, skip_optim, None),
        "skip_programs": skip.compile_count,
    }


def skipping_step(model, optim, x, y):
    """A branch on a value (NOTE: [value checks]): no update from a non-finite loss."""
    loss = F.cross_entropy(model(x), y)
    if torch.isfinite(loss):
        loss.backward()
        optim.step()
    optim.zero_grad()
    return loss


def test_a_failing_value_check_stops_every_rank_and_keeps_the_state() -> None:
    results = sc.launch(value_check_worker, WORLD_SIZE, timeout_s=launch_timeout(120))
    model = make_model()
    optim = OPTIMIZERS["adamw"](model)
    (x0, y0), _, (x2, y2) = global_batches()
    finite_checked_step(model, optim, x0, y0)  # the refused batch never happened
    losses = torch.stack([finite_checked_step(model, optim, x2, y2).detach().clone()])
    expected = full_state(model, optim, None)
    skip_model = make_model()
    skip_optim = OPTIMIZERS["adamw"](skip_model)
    (x0, y0), (x1, y1), _ = global_batches()
    x1 = x1.clone()
    x1[-1, 0] = float("nan")
    for x, y in ((x0, y0), (x1, y1), (x2, y2)):
        skipping_step(skip_model, skip_optim, x, y)
    skip_expected = full_state(skip_model, skip_optim, None)
    for rank, result in enumerate(results):
        skip_errors = {k: relative_difference(result["skip_state"][k], v) for k, v in skip_expected.items()}
        assert max(skip_errors.values()) < TOLERANCE, f"rank {rank}: {skip_errors}"
        assert result["skip_programs"] >= 2, "the NaN call did not run another program"
        assert "the loss is not finite" in result["refused"], f"rank {rank}: {result['refused']!r}"
        assert relative_difference(result["losses"], losses) < TOLERANCE
        errors = {k: relative_difference(result["state"][k], v) for k, v in expected.items()}
        worst = max(errors, key=errors.__getitem__)
        assert errors[worst] < TOLERANCE, f"rank {rank}: {worst} differs by {errors[worst]:.2e}"


# NOTE: [rows of one count] on real ranks: each rank reads its own half of the masks, and
# the ranks agree on the count by an all-reduce during capture
TOKENS, VISIBLE = 6, 2


class MaskedEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(FEATURES, HIDDEN)
        self.decode = nn.Linear(HIDDEN, FEATURES)

    def forward(self, x: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        visible = torch.tanh(self.embed(x[~masked].reshape(b, -1, FEATURES)))
        return F.mse_loss(self.decode(visible.mean(1, keepdim=True)).expand(b, TOKENS - VISIBLE, FEATURES),
                          x[masked].reshape(b, -1, FEATURES))


def masked_step(model, optim, x, masked):
    return _finish(model(x, masked), optim)


def _finish(loss, optim):
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def masked_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    return [
        (torch.randn(GLOBAL_BATCH, TOKENS, FEATURES, generator=gen),
         torch.stack([torch.randperm(TOKENS, generator=gen) >= VISIBLE for _ in range(GLOBAL_BATCH)]))
        for _ in range(STEPS)
    ]


def masked_worker(rank: int, world_size: int) -> dict[str, object]:
    per_rank = GLOBAL_BATCH // world_size
    local = slice(rank * per_rank, (rank + 1) * per_rank)
    sc.init_from_env()
    model = MaskedEncoder()
    optim = OPTIMIZERS["adamw"](model)
    step = sc.compile(backend=backend_under_test())(masked_step)
    losses = [step(model, optim, x[local], m[local]).detach().clone() for x, m in masked_batches()]
    return {"losses": torch.stack(losses), "state": full_state(model, optim, None),
            "counted": step.last_program.captured.counted}


def test_masks_of_one_count_on_gloo() -> None:
    results = sc.launch(masked_worker, WORLD_SIZE, timeout_s=launch_timeout(120))
    model = MaskedEncoder()
    optim = OPTIMIZERS["adamw"](model)
    losses = torch.stack([masked_step(model, optim, x, m).detach() for x, m in masked_batches()])
    expected = full_state(model, optim, None)
    for rank, got in enumerate(results):
        assert got["counted"], f"rank {rank}: the selections were not compiled for a count"
        errors = {"losses": relative_difference(got["losses"], losses)}
        errors.update({k: relative_difference(got["state"][k], w) for k, w in expected.items()})
        worst = max(errors, key=errors.__getitem__)
        assert errors[worst] < TOLERANCE, f"rank {rank}: {worst} differs by {errors[worst]:.2e}"


class StackedViewsEncoder(nn.Module):
    """A convolution over two stacked views (``torch.stack([v1, v2]).flatten(0, 1)``),
    then a BatchNorm (NOTE: [convolution operands placed first])."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.bn(self.conv(x))).mean((2, 3)))


def stacked_views_step(model, optim, x, y):
    a, b = model(torch.stack([x, x.flip(3) * 0.7]).flatten(0, 1)).chunk(2)
    return _finish(F.cross_entropy(a, y) + F.mse_loss(a, b), optim)


def image_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    return [(torch.randn(GLOBAL_BATCH, 3, 6, 6, generator=gen, dtype=torch.float64),
             torch.randint(0, CLASSES, (GLOBAL_BATCH,), generator=gen)) for _ in range(STEPS)]


def stacked_views_worker(rank: int, world_size: int) -> dict[str, object]:
    per_rank = GLOBAL_BATCH // world_size
    local = slice(rank * per_rank, (rank + 1) * per_rank)
    sc.init_from_env()
    model = StackedViewsEncoder().double()
    optim = torch.optim.SGD(model.parameters(), lr=0.5)
    step = sc.compile(backend=backend_under_test())(stacked_views_step)
    losses = [step(model, optim, x[local], y[local]).detach().clone() for x, y in image_batches()]
    return {"losses": torch.stack(losses), "state": full_state(model, optim, None)}


def test_convolution_over_stacked_views_on_gloo() -> None:
    """The weight gradient was one rank's (replicas 7e-3 apart after 3 steps)."""
    results = sc.launch(stacked_views_worker, WORLD_SIZE, timeout_s=launch_timeout(120))
    model = StackedViewsEncoder().double()
    optim = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = torch.stack([stacked_views_step(model, optim, x, y).detach() for x, y in image_batches()])
    expected = full_state(model, optim, None)
    for rank, got in enumerate(results):
        errors = {"losses": relative_difference(got["losses"], losses)}
        errors.update({k: relative_difference(got["state"][k], w) for k, w in expected.items()})
        worst = max(errors, key=errors.__getitem__)
        assert errors[worst] < 1e-10, f"rank {rank}: {worst} differs by {errors[worst]:.2e}"


# NOTE: [torch.distributed inside the step] on real ranks, where the world size is 2: a
# step ported from DDP (normalizing by the world size, all-reducing its logged loss,
# gathering predictions) computes what it computes on one device
def ported_worker(rank: int, world_size: int) -> dict[str, object]:
    from tests.sim.test_distributed_calls import _batches, _model, ported_from_ddp_step

    sc.init_from_env()
    model = _model()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = sc.compile(backend=backend_under_test())(ported_from_ddp_step)
    per_rank = GLOBAL_BATCH // world_size
    local = slice(rank * per_rank, (rank + 1) * per_rank)
    results = [step(model, optim, x[local], y[local]) for x, y in _batches()]
    return {"losses": torch.stack([loss.detach().clone() for loss, _ in results]),
            "right": [int(r) for _, r in results], "state": full_state(model, optim, None)}


def test_a_step_ported_from_ddp_on_gloo() -> None:
    from tests.sim.test_distributed_calls import _batches, _model, one_device_step

    results = sc.launch(ported_worker, WORLD_SIZE, timeout_s=launch_timeout(120))
    model = _model()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    expected = [one_device_step(model, optim, x, y) for x, y in _batches()]
    state = full_state(model, optim, None)
    for rank, got in enumerate(results):
        assert got["right"] == [int(r) for _, r in expected], f"rank {rank}"
        errors = {"losses": relative_difference(got["losses"], torch.stack([loss for loss, _ in expected]))}
        errors.update({k: relative_difference(got["state"][k], w) for k, w in state.items()})
        worst = max(errors, key=errors.__getitem__)
        assert errors[worst] < 1e-12, f"rank {rank}: {worst} differs by {errors[worst]:.2e}"



# NOTE: [names of torch.distributed's functions] on real ranks: get_world_size / all_reduce
# / get_rank imported by name read as a world of one (before: the world size 2 baked in,
# and the rank-0 branch refused at the ranks' agreement naming no line)
def named_imports_worker(rank: int, world_size: int) -> dict[str, object]:
    from tests.sim.test_distributed_calls import _batches, _model, named_imports_step

    sc.init_from_env()
    model = _model()
    optim = torch.optim.SGD(model.parameters(), lr=0.5)
    step = sc.compile(backend=backend_under_test())(named_imports_step)
    per_rank = GLOBAL_BATCH // world_size
    local = slice(rank * per_rank, (rank + 1) * per_rank)
    losses = [step(model, optim, x[local], y[local])[0].clone() for x, y in _batches()]
    return {"losses": torch.stack(losses), "state": full_state(model, optim, None)}


def test_functions_imported_by_name_on_gloo() -> None:
    from tests.sim.test_distributed_calls import _batches, _model, one_device_step

    results = sc.launch(named_imports_worker, WORLD_SIZE, timeout_s=launch_timeout(120))
    model = _model()
    optim = torch.optim.SGD(model.parameters(), lr=0.5)
    expected = torch.stack([one_device_step(model, optim, x, y)[0] for x, y in _batches()])
    state = full_state(model, optim, None)
    for rank, got in enumerate(results):
        errors = {"losses": relative_difference(got["losses"], expected)}
        errors.update({k: relative_difference(got["state"][k], w) for k, w in state.items()})
        worst = max(errors, key=errors.__getitem__)
        assert errors[worst] < 1e-12, f"rank {rank}: {worst} differs by {errors[worst]:.2e}"

# NOTE: [requires_grad set in the step] on real ranks: a layer frozen inside the step on
# call 2 stays frozen on calls 3 and 4 (before, it trained on: 6.2e-2 off eager)
def freezing_worker(rank: int, world_size: int) -> dict[str, object]:
    from tests.sim.test_requires_grad_in_step import _batches, _model, freeze_step

    sc.init_from_env()
    model = _model()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    step = sc.compile(backend=backend_under_test())(freeze_step)
    per_rank = GLOBAL_BATCH // world_size
    local = slice(rank * per_rank, (rank + 1) * per_rank)
    losses = [step(model, optim, x[local], y[local], switch).clone()
              for (x, y), switch in zip(_batches(4), [False, True, False, False], strict=True)]
    return {"losses": torch.stack(losses), "flags": [p.requires_grad for p in model.parameters()],
            "state": full_state(model, optim, None)}


def test_a_layer_frozen_in_the_step_stays_frozen_on_gloo() -> None:
    from tests.sim.test_requires_grad_in_step import _batches, _model, freeze_step

    results = sc.launch(freezing_worker, WORLD_SIZE, timeout_s=launch_timeout(120))
    model = _model()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = torch.stack([freeze_step(model, optim, x, y, switch)
                          for (x, y), switch in zip(_batches(4), [False, True, False, False], strict=True)])
    state = full_state(model, optim, None)
    for rank, got in enumerate(results):
        assert got["flags"] == [False, False, True, True], f"rank {rank}"
        errors = {"losses": relative_difference(got["losses"], losses)}
        errors.update({k: relative_difference(got["state"][k], w) for k, w in state.items()})
        worst = max(errors, key=errors.__getitem__)
        assert errors[worst] < 1e-12, f"rank {rank}: {worst} differs by {errors[worst]:.2e}"


# NOTE: [tensors the step keeps]: what an optimizer step pre-hook stores (a tensor in a
# dict, an .item() appended to a list) is the call's global value on every rank; before
# the fifty-ninth session the dict held the capture's FakeTensor after every call
def _logged_sgd() -> tuple[nn.Module, torch.optim.Optimizer, dict, list]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, CLASSES)).double()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    log: dict = {}
    norms: list = []

    def record(o, args, kwargs):  # noqa: ANN001, ANN202
        norm = torch.stack([p.grad.norm() for g in o.param_groups for p in g["params"]]).norm()
        log["grad_norm"] = norm.detach()
        norms.append(norm.item())

    optim.register_step_pre_hook(record)
    return model, optim, log, norms


def logged_worker(rank: int, world_size: int) -> dict[str, object]:
    sc.init_from_env()
    model, optim, log, norms = _logged_sgd()
    step = sc.compile(backend=backend_under_test())(train_step)
    per_rank = GLOBAL_BATCH // world_size
    local = slice(rank * per_rank, (rank + 1) * per_rank)
    logged = []
    for x, y in global_batches():
        step(model, optim, x[local].double(), y[local])
        logged.append(log["grad_norm"].clone())
    return {"logged": logged, "norms": norms}


def test_an_optimizer_hooks_logged_norm_on_gloo() -> None:
    results = sc.launch(logged_worker, WORLD_SIZE, timeout_s=launch_timeout(120))
    model, optim, log, norms = _logged_sgd()
    logged = []
    for x, y in global_batches():
        train_step(model, optim, x.double(), y)
        logged.append(log["grad_norm"].clone())
    for rank, got in enumerate(results):
        assert all(type(t) is torch.Tensor for t in got["logged"]), f"rank {rank}: {got['logged']}"
        assert relative_difference(torch.stack(got["logged"]), torch.stack(logged)) < 1e-12, f"rank {rank}"
        assert got["norms"] == pytest.approx(norms, rel=1e-12), f"rank {rank}"


def _data_edits(model: nn.Module) -> None:
    """``.data =`` between calls (NOTE: [data replaced between calls]): a clip out of
    place, and ``vector_to_parameters`` (fsdp: replicated slices, redistributed)."""
    w = model[0].weight
    w.data = w.data.clamp(-0.05, 0.05)
    flat = torch.nn.utils.parameters_to_vector(model.parameters())
    torch.nn.utils.vector_to_parameters(flat * 0.5, model.parameters())


def data_assigned_worker(rank: int, world_size: int) -> dict[str, object]:
    from spmd_compiler.parallel_modes import DataParallel

    sc.init_from_env()
    model = make_model().double()
    optim = OPTIMIZERS["sgd_momentum"](model)
    step = sc.compile(DataParallel("fully_shard"), backend=backend_under_test())(train_step)
    per_rank = GLOBAL_BATCH // world_size
    local = slice(rank * per_rank, (rank + 1) * per_rank)
    losses = []
    for i, (x, y) in enumerate(global_batches()):
        if i == 1:
            _data_edits(model)
        losses.append(step(model, optim, x[local].double(), y[local]).detach().clone())
    return {"losses": torch.stack(losses), "state": full_state(model, optim, None)}


def test_data_assigned_between_calls_on_gloo() -> None:
    """``w.data = w.data.clamp(...)`` and ``vector_to_parameters`` between calls were
    silently ignored on real ranks (the local shard the program reads was kept)."""
    results = sc.launch(data_assigned_worker, WORLD_SIZE, timeout_s=launch_timeout(120))
    model = make_model().double()
    optim = OPTIMIZERS["sgd_momentum"](model)
    losses = []
    for i, (x, y) in enumerate(global_batches()):
        if i == 1:
            _data_edits(model)
        losses.append(train_step(model, optim, x.double(), y).detach().clone())
    expected = full_state(model, optim, None)
    for rank, result in enumerate(results):
        errors = {"losses": relative_difference(result["losses"], torch.stack(losses))}
        errors.update({k: relative_difference(result["state"][k], v) for k, v in expected.items()})
        worst = max(errors, key=errors.__getitem__)
        assert errors[worst] < 1e-12, f"rank {rank}: {worst} differs by {errors[worst]:.2e}"
