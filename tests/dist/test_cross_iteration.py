"""cross_iteration_overlap on real gloo ranks: a reduction issued in one call and waited
in the next (NOTE: [cross-iteration overlap]) gives bit-identical state after flush()."""

from __future__ import annotations

import pytest
import torch

import spmd_compiler as sc
from spmd_compiler import checkpoint
from spmd_compiler.tools.demo.steps import classification_train_step
from spmd_compiler.parallel_modes import make_mode
from spmd_compiler.tools.parity import full_state

pytestmark = pytest.mark.dist

STEPS = 4


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def worker(rank: int, world_size: int, mode: str) -> dict[str, object]:
    gen = torch.Generator().manual_seed(7)
    batches = [(torch.randn(8, 8, generator=gen), torch.randint(0, 4, (8,), generator=gen)) for _ in range(STEPS)]
    local = slice(rank * 4, rank * 4 + 4)
    out: dict[str, object] = {}
    for name, extra in (("plain", ()), ("deferred", ("cross_iteration_overlap",))):
        model = _model()
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        step = sc.compile(make_mode(mode), extra_passes=extra)(classification_train_step)
        losses = [step(model, optim, x[local], y[local]).item() for x, y in batches]
        out[name] = {"losses": losses, "unflushed": full_state(model, optim, None)}
        had_pending = step.has_pending_update
        # checkpointing applies the deferred update by itself before reading the state
        exported = checkpoint.full_state_dict(model, optim)
        out[name]["flushed"] = had_pending and not step.has_pending_update and not step.flush()
        out[name]["state"] = full_state(model, optim, None)
        if rank == 0:
            out[name]["exported"] = {k: v.clone() for k, v in exported["model"].items()}
        plan = step.last_program.deferred
        out[name]["deferred_outputs"] = 0 if plan is None else len(plan.positions)
    return out


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_deferred_update_is_bit_identical_after_flush(mode):
    plain, deferred = (sc.launch(worker, 2, backend="gloo", args=(mode,))[0][k] for k in ("plain", "deferred"))
    assert deferred["deferred_outputs"] > 0 and plain["deferred_outputs"] == 0
    assert deferred["flushed"] is True and plain["flushed"] is False
    assert deferred["losses"] == plain["losses"]
    # before flush() the deferred parameters still hold the previous step's values
    assert any(
        not torch.equal(deferred["unflushed"][k], plain["state"][k]) for k in plain["state"]
    )
    for key, value in plain["state"].items():
        assert torch.equal(deferred["state"][key], value), key
    for key, value in plain["exported"].items():
        assert torch.equal(deferred["exported"][key], value), key


def flush_on_rank_0_worker(rank: int, world_size: int) -> str:
    model = _model()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = sc.compile(make_mode("ddp"), extra_passes=("cross_iteration_overlap",))(classification_train_step)
    gen = torch.Generator().manual_seed(rank)  # each rank's own share of the batch
    x, y = torch.randn(4, 8, generator=gen), torch.randint(0, 4, (4,), generator=gen)
    step(model, optim, x, y)
    if rank == 0:
        step.flush()
    try:
        step(model, optim, x, y)
    except sc.SPMDRuntimeError as exc:
        step.flush()
        return str(exc)
    return "no error"


def test_a_flush_on_one_rank_only_is_named():
    """NOTE: [a flush on some ranks only]: before, "ranks run different programs ... read
    the same Python values", pointing away from the cause."""
    for message in sc.launch(flush_on_rank_0_worker, 2, backend="gloo"):
        assert "already applied on rank(s) 0" in message and "on every rank" in message, message
