"""Real gloo runs on 2 processes: save, resume, reshard and export compiled training state.

The uninterrupted run trains 4 steps with ``DataParallel("fully_shard")`` and saves after
step 2. A resumed run (a fresh launch) builds the model, loads the checkpoint and trains
steps 3 and 4: with the same mode and world size its losses and final state must equal
the uninterrupted run bit for bit. Loading into ``DataParallel("replicate")`` reshards
(fully_shard rows -> full copies) and must match to float32 rounding.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

import spmd_compiler as sc
from spmd_compiler import checkpoint
from spmd_compiler.tools.demo.steps import classification_train_step
from spmd_compiler.runtime.launch import LaunchError
from spmd_compiler.parallel_modes import DataParallel
from spmd_compiler.tools.parity import full_state, relative_difference

pytestmark = pytest.mark.dist

WORLD_SIZE = 2
STEPS, SAVE_AFTER = 4, 2
GLOBAL_BATCH = 8
# 10 hidden rows: fully_shard splits the first layer's rows evenly over 2 ranks, the
# 3 output rows unevenly (2 + 1), so the checkpoint holds padded-mode shards too.
FEATURES, HIDDEN, CLASSES = 8, 10, 3


train_step = classification_train_step


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(FEATURES, HIDDEN), nn.LayerNorm(HIDDEN), nn.GELU(), nn.Linear(HIDDEN, CLASSES)
    )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def local_batches(rank: int, world_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1234)
    per_rank = GLOBAL_BATCH // world_size
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    out = []
    for _ in range(STEPS):
        x = torch.randn(GLOBAL_BATCH, FEATURES, generator=gen)
        y = torch.randint(0, CLASSES, (GLOBAL_BATCH,), generator=gen)
        out.append((x[rows], y[rows]))
    return out


def uninterrupted_worker(rank: int, world_size: int, folder: str) -> dict[str, object]:
    model, optim = build()
    step = sc.compile(DataParallel("fully_shard"))(train_step)
    losses = []
    exported: dict[str, object] = {}
    for i, (x, y) in enumerate(local_batches(rank, world_size)):
        losses.append(step(model, optim, x, y).detach().clone())
        if i + 1 == SAVE_AFTER:
            checkpoint.save(folder, model, optim)
            exported = checkpoint.full_state_dict(model, optim)
            saved = full_state(model, optim, None)
    return {
        "losses": torch.stack(losses),
        "saved": saved,
        "exported": exported,
        "state": full_state(model, optim, None),
        "dtensors": all(isinstance(v, DTensor) for v in model.state_dict().values()),
    }


def resumed_worker(
    rank: int, world_size: int, folder: str, mode: str, compile_first: bool
) -> dict[str, object]:
    """Load ``folder`` into a fresh model and train the remaining steps.

    ``compile_first``: run one compiled step on other data before loading, so that the
    checkpoint is read into DTensors (in place) rather than into plain tensors.
    """
    model, optim = build()
    step = sc.compile(DataParallel(mode))(train_step)
    batches = local_batches(rank, world_size)
    if compile_first:
        x, y = batches[0]
        step(model, optim, x.flip(0), y.flip(0))
        assert isinstance(model[0].weight, DTensor)
    checkpoint.load(folder, model, optim)
    loaded = full_state(model, optim, None)
    losses = [step(model, optim, x, y).detach().clone() for x, y in batches[SAVE_AFTER:]]
    return {
        "losses": torch.stack(losses),
        "loaded": loaded,
        "state": full_state(model, optim, None),
    }


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("ckpt") / "step2")


@pytest.fixture(scope="module")
def uninterrupted(folder: str) -> list[dict[str, object]]:
    return sc.launch(uninterrupted_worker, WORLD_SIZE, args=(folder,), timeout_s=180)


def _resume(folder: str, mode: str, compile_first: bool) -> list[dict[str, object]]:
    return sc.launch(resumed_worker, WORLD_SIZE, args=(folder, mode, compile_first), timeout_s=180)


def _assert_state_equal(got: dict, want: dict, exact: bool, what: str) -> None:
    assert set(got) == set(want), what
    for key, value in want.items():
        if exact:
            assert torch.equal(got[key].to(value.dtype), value), f"{what}: {key} differs"
        else:
            err = relative_difference(got[key], value)
            assert err < 1e-5, f"{what}: {key} differs by {err:.2e}"


def test_uninterrupted_run_trains(uninterrupted: list[dict[str, object]]) -> None:
    result = uninterrupted[0]
    assert result["dtensors"]
    assert not torch.equal(result["saved"]["param.0.weight"], result["state"]["param.0.weight"])
    assert torch.equal(uninterrupted[0]["losses"], uninterrupted[1]["losses"])


@pytest.mark.parametrize(
    "compile_first", [False, True], ids=["load_then_compile", "compile_then_load"]
)
def test_resume_same_mode_is_bitwise(
    uninterrupted: list[dict[str, object]], folder: str, compile_first: bool
) -> None:
    resumed = _resume(folder, "fully_shard", compile_first)
    for rank in range(WORLD_SIZE):
        want, got = uninterrupted[rank], resumed[rank]
        _assert_state_equal(got["loaded"], want["saved"], exact=True, what=f"rank {rank} loaded")
        assert torch.equal(got["losses"], want["losses"][SAVE_AFTER:]), (
            f"rank {rank}: resumed losses {got['losses']} != {want['losses'][SAVE_AFTER:]}"
        )
        _assert_state_equal(got["state"], want["state"], exact=True, what=f"rank {rank} final")


def test_fully_shard_checkpoint_loads_into_replicate(
    uninterrupted: list[dict[str, object]], folder: str
) -> None:
    resumed = _resume(folder, "replicate", compile_first=True)
    want = uninterrupted[0]
    _assert_state_equal(resumed[0]["loaded"], want["saved"], exact=True, what="loaded")
    err = relative_difference(resumed[0]["losses"], want["losses"][SAVE_AFTER:])
    assert err < 1e-6, f"losses differ by {err:.2e}"
    _assert_state_equal(resumed[0]["state"], want["state"], exact=False, what="final")


def test_full_state_dict_on_rank_0_only(uninterrupted: list[dict[str, object]]) -> None:
    exported, saved = uninterrupted[0]["exported"], uninterrupted[0]["saved"]
    assert uninterrupted[1]["exported"] == {}
    model_state = exported["model"]
    assert all(type(v) is torch.Tensor for v in model_state.values())
    for name, value in model_state.items():
        assert torch.equal(value, saved[f"param.{name}"]), name
    # the export loads into a plain, uncompiled model
    model, _ = build()
    model.load_state_dict(model_state)
    state = exported["optimizer"]["state"]
    assert set(state) == {name for name, _ in model.named_parameters()}
    assert torch.equal(state["3.weight"]["exp_avg"], saved["optim.g0.p4.exp_avg"])
    assert float(state["3.weight"]["step"]) == SAVE_AFTER


def test_two_rank_fully_shard_checkpoint_loads_into_one_rank_replicate(
    uninterrupted: list[dict[str, object]], folder: str
) -> None:
    """A different world size AND mode: DCP reshards 2 padded FSDP shards into 1 copy."""
    resumed = sc.launch(resumed_worker, 1, args=(folder, "replicate", True), timeout_s=180)
    want = uninterrupted[0]
    _assert_state_equal(resumed[0]["loaded"], want["saved"], exact=True, what="loaded")
    err = relative_difference(resumed[0]["losses"], want["losses"][SAVE_AFTER:])
    assert err < 1e-6, f"losses differ by {err:.2e}"
    _assert_state_equal(resumed[0]["state"], want["state"], exact=False, what="final")


def test_flipped_bytes_fail_on_every_rank_naming_the_tensor(
    uninterrupted: list[dict[str, object]], folder: str, tmp_path
) -> None:
    """Each rank verifies its share of the chunks; every rank names each damaged one."""
    import json
    import os
    import shutil

    from spmd_compiler.runtime.checkpoint_checksums import MANIFEST

    damaged = str(tmp_path / "damaged")
    shutil.copytree(folder, damaged)
    with open(os.path.join(damaged, MANIFEST)) as f:
        chunks = [c for c in json.load(f)["chunks"] if c["fqn"] == "model.0.weight"]
    assert len(chunks) == 2, "fully_shard over 2 ranks stores two chunks"
    chunk = chunks[1]  # rank 1's rows
    with open(os.path.join(damaged, chunk["file"]), "r+b") as f:
        f.seek(chunk["start"] + chunk["length"] // 2)
        f.write(b"\x00\xff\x00\xff")
    with pytest.raises(LaunchError) as info:
        _resume(damaged, "fully_shard", compile_first=False)
    for rank in range(WORLD_SIZE):
        report = info.value.failures[rank]
        assert "CheckpointError" in report, report
        assert "tensor model.0.weight differs (its chunk at offset (5, 0))" in report, report


def per_rank_folder_worker(rank: int, world_size: int, root: str) -> str:
    model, optim = build()
    step = sc.compile(DataParallel("fully_shard"))(train_step)
    step(model, optim, *local_batches(rank, world_size)[1])
    try:
        checkpoint.save(f"{root}/rank{rank}", model, optim)
    except checkpoint.CheckpointError as exc:
        return str(exc)
    return "saved"


def test_per_rank_folders_are_refused_on_every_rank_before_writing(tmp_path) -> None:
    """``save(f".../rank{rank}")`` failed inside DCP with FileNotFoundError .../__1_0.distcp
    after rank 0 wrote part of a checkpoint (NOTE: [one checkpoint folder for every rank])."""
    import os

    root = str(tmp_path / "per_rank")
    for message in sc.launch(per_rank_folder_worker, WORLD_SIZE, args=(root,), timeout_s=120):
        assert "the ranks passed different paths" in message, message
    assert not os.path.exists(root) or not any(os.scandir(root)), os.listdir(root)


class _FusedQKV(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(FEATURES, 3 * FEATURES)
        self.out = nn.Linear(FEATURES, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        return self.out(q * k + v)


def _fused_worker(rank: int, world_size: int, folder: str) -> float:
    """Save after 2 steps under TP with a fused q/k/v projection, then resume a fresh
    model (compiled first) and train the same 2 steps on: the largest difference."""
    from torch.distributed.tensor.parallel import RowwiseParallel

    from spmd_compiler.parallel_modes import FusedColwiseParallel, TensorParallel

    def run() -> tuple[nn.Module, torch.optim.Optimizer, object]:
        torch.manual_seed(0)
        model = _FusedQKV()
        mode = TensorParallel({"qkv": FusedColwiseParallel(chunks=3), "out": RowwiseParallel()})
        return model, torch.optim.AdamW(model.parameters(), lr=0.05), sc.compile(mode)(train_step)

    gen = torch.Generator().manual_seed(3)  # TP: every rank trains on the whole batch
    data = [(torch.randn(GLOBAL_BATCH, FEATURES, generator=gen),
             torch.randint(0, CLASSES, (GLOBAL_BATCH,), generator=gen)) for _ in range(STEPS)]
    model, optim, step = run()
    for x, y in data[:SAVE_AFTER]:
        step(model, optim, x, y)
    checkpoint.save(folder, model, optim)
    for x, y in data[SAVE_AFTER:]:
        step(model, optim, x, y)
    model2, optim2, step2 = run()
    step2(model2, optim2, *data[-1])  # its state is placed: the load reads into DTensors
    checkpoint.load(folder, model2, optim2)
    for x, y in data[SAVE_AFTER:]:
        step2(model2, optim2, x, y)
    want, got = full_state(model, optim, None), full_state(model2, optim2, None)
    return max(relative_difference(got[key], value) for key, value in want.items())


def test_tensor_parallel_fused_projection_resumes(tmp_path) -> None:
    """NOTE: [strided shards in a checkpoint]: a save of ``_StridedShard`` state failed in
    DCP's planner ("Failed to validate global plan"); now it resumes bit for bit."""
    results = sc.launch(_fused_worker, WORLD_SIZE, backend="gloo", args=(str(tmp_path / "tp"),))
    assert results == [0.0, 0.0]


def plain_load_worker(rank: int, world_size: int) -> dict[str, object]:
    """Plain weights (every rank the same full values) loaded into a placed model: NOTE:
    [loading plain tensors into a placed model]; each rank takes its share, uneven rows
    included."""
    model, optim = build()
    step = sc.compile(DataParallel("fully_shard"))(train_step)
    step(model, optim, *local_batches(rank, world_size)[0])
    fresh, _ = build()
    model.load_state_dict(fresh.state_dict())
    return {
        "state": full_state(model, optim, None),
        "fresh": {k: v.detach().clone() for k, v in fresh.state_dict().items()},
        "dtensors": all(isinstance(p, DTensor) for p in model.parameters()),
    }


def test_plain_weights_load_into_a_placed_model() -> None:
    for result in sc.launch(plain_load_worker, WORLD_SIZE, timeout_s=180):
        assert result["dtensors"]
        for name, value in result["fresh"].items():
            assert torch.equal(result["state"][f"param.{name}"], value), name


def rank0_export_worker(rank: int, world_size: int) -> dict[str, object]:
    """Rank 0 exports under ``if rank == 0:`` (the plain-DDP habit) while rank 1 goes on
    to its next compiled call; then both export and train, as they should have."""
    import time

    model, optim = build()
    step = sc.compile(DataParallel("fully_shard"))(train_step)
    batches = local_batches(rank, world_size)
    step(model, optim, *batches[0])
    errors: dict[str, str] = {}
    start = time.perf_counter()
    try:
        if rank == 0:
            checkpoint.full_state_dict(model, optim)
        else:
            step(model, optim, *batches[1])
    except sc.SPMDRuntimeError as exc:
        errors["first"] = str(exc)
    seconds = time.perf_counter() - start
    exported = checkpoint.full_state_dict(model, optim)  # every rank: fine, and in step
    loss = step(model, optim, *batches[1]).item()
    return {"error": errors.get("first", ""), "seconds": seconds, "keys": sorted(exported), "loss": loss}


def test_full_state_dict_on_rank_0_only_fails_fast_on_every_rank() -> None:
    """NOTE: [a checkpoint on some ranks only]: before, rank 0 waited in the gathers and
    rank 1's next compiled call met them, until the launch timeout (here 60 s)."""
    results = sc.launch(rank0_export_worker, WORLD_SIZE, timeout_s=60, collective_timeout_s=30)
    for rank, result in enumerate(results):
        error = result["error"]
        assert "sc.checkpoint.full_state_dict was called on rank 0 " in error, (rank, error)
        assert "every rank must call it" in error and "if rank == 0: torch.save(state, path)" in error
        assert "rank 1: train" in error or "rank 1: classification_train_step" in error, error
        assert result["seconds"] < 15, result["seconds"]
    assert results[0]["keys"] == ["model", "optimizer"] and results[1]["keys"] == []
    assert results[0]["loss"] == results[1]["loss"]


def export_before_training_worker(rank: int, world_size: int) -> dict[str, object]:
    """``full_state_dict`` of a model and optimizer before the first step (the initial
    weights exported), then the same training as the uninterrupted run."""
    model, optim = build()
    step = sc.compile(DataParallel("fully_shard"))(train_step)
    exported = checkpoint.full_state_dict(model, optim)
    left = {"state": len(optim.state), "optimizer": exported.get("optimizer", {})}
    losses = [step(model, optim, x, y).detach().clone() for x, y in local_batches(rank, world_size)]
    return {"left": left, "losses": torch.stack(losses), "state": full_state(model, optim, None)}


def test_export_before_the_first_step_leaves_the_optimizer_unstepped(
    uninterrupted: list[dict[str, object]],
) -> None:
    """NOTE: [an optimizer saved before its first step]: on real ranks ``full_state_dict``
    made AdamW's state with torch's ``lr=0`` step, so every later bias correction was one
    step off (a float64 ``nn.Linear`` after 3 ddp steps: 4.5e-3 away from eager, no
    error)."""
    results = sc.launch(export_before_training_worker, WORLD_SIZE, timeout_s=180)
    for rank, (got, want) in enumerate(zip(results, uninterrupted)):
        assert got["left"]["state"] == 0, rank
        if rank == 0:
            assert got["left"]["optimizer"]["state"] == {}
        assert torch.equal(got["losses"], want["losses"]), rank
        _assert_state_equal(got["state"], want["state"], True, f"rank {rank}")
