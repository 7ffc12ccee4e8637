"""Ranks that pass different input shapes or dtypes fail at once, all with one clear error.

Before the check ran on every call, a rank whose shapes changed after the first compile
entered a new compile while the others entered the cached program's collectives: both
blocked until the collective timeout and neither error mentioned shapes.
"""

from __future__ import annotations

import copy
import io
import time

import pytest
import torch
import torch.nn as nn

import spmd_compiler as sc
from spmd_compiler.parallel_modes import DataParallel
from spmd_compiler.tools.demo.steps import classification_train_step

pytestmark = pytest.mark.dist

# (rows of x on rank 0, on rank 1, dtype of x on rank 1) per call.
CALLS = [(4, 4, torch.float32), (4, 4, torch.float32), (4, 3, torch.float32),
         (3, 4, torch.float32), (4, 4, torch.float64), (4, 4, torch.float32)]


def _worker(rank: int, world_size: int) -> list[dict]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = sc.compile(DataParallel("replicate"))(classification_train_step)
    gen = torch.Generator().manual_seed(rank)
    out = []
    for rows0, rows1, dtype1 in CALLS:
        rows = rows0 if rank == 0 else rows1
        x = torch.randn(rows, 8, generator=gen).to(dtype1 if rank == 1 else torch.float32)
        y = torch.randint(0, 4, (rows,), generator=gen)
        start = time.monotonic()
        try:
            loss = step(model, optim, x, y)
            out.append({"loss": float(loss), "seconds": time.monotonic() - start})
        except sc.SPMDCompileError as exc:
            out.append({"error": str(exc), "seconds": time.monotonic() - start})
    return out


def test_mismatched_shapes_and_dtypes_fail_on_every_rank_within_seconds() -> None:
    results = sc.launch(_worker, 2, timeout_s=240, collective_timeout_s=60)
    for rank, calls in enumerate(results):
        assert [("error" in c) for c in calls] == [False, False, True, True, True, False], (
            f"rank {rank}: {calls}"
        )
        cached, uncached, dtype = calls[2], calls[3], calls[4]
        # call 2: rank 0 has a cached program for its shapes, rank 1 would compile
        assert "rank 0: (4, 8) float32, (4,) int64" in cached["error"]
        assert "rank 1: (3, 8) float32, (3,) int64" in cached["error"]
        assert "rank 0: (3, 8) float32, (3,) int64" in uncached["error"]
        assert "rank 1: (4, 8) float64, (4,) int64" in dtype["error"]
        for call in (cached, uncached, dtype):
            assert call["seconds"] < 5.0, f"rank {rank} took {call['seconds']:.1f} s"
            assert "collator" not in call["error"]  # rows differ: not a padding length
    # the ranks stayed in step: training continues after the refused calls
    assert results[0][5]["loss"] == results[1][5]["loss"]


def _padded_worker(rank: int, world_size: int) -> str:
    """Each rank pads its batch to its own longest sequence: (4, 5) and (4, 7)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 8), nn.Linear(8, 20))
    optim = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(model, optim, ids, labels):  # noqa: ANN001, ANN202
        loss = nn.functional.cross_entropy(model(ids).reshape(-1, 20), labels.reshape(-1))
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    ids = torch.randint(0, 20, (4, 5 if rank == 0 else 7))
    try:
        sc.compile(DataParallel("replicate"))(step)(model, optim, ids, ids.clone())
    except sc.SPMDCompileError as exc:
        return str(exc)
    return "ran"


def test_batches_padded_per_rank_are_refused_naming_the_collator():
    """NOTE: [batches padded per rank]: the hint said only "split the global batch
    evenly; drop or pad the last partial batch"."""
    for rank, message in enumerate(sc.launch(_padded_worker, 2, timeout_s=240, collective_timeout_s=60)):
        assert "rank 0: (4, 5) int64, (4, 5) int64" in message, (rank, message)
        assert "a collator pads each rank to its own longest sequence" in message, (rank, message)
        assert 'padding="max_length"' in message, (rank, message)


def _round_worker(rank: int, world_size: int) -> dict:
    from spmd_compiler.runtime.same_inputs import InputAgreement

    agreement = InputAgreement([torch.zeros(4, 8), torch.zeros(4, dtype=torch.int64)])
    count = torch.tensor(float(rank + 3))  # float32
    pair = torch.tensor([1, 2 + rank])  # int64
    if rank == 1:  # rank 1 compiles first: rank 0's round meets its pending one, then again
        agreement.before_compile()
    sums = agreement.before_run("count and pair", [count, pair])
    out: dict = {"sums": [s.tolist() for s in sums], "dtypes": [str(s.dtype) for s in sums]}
    # an in-flight round: the rank computes, then reads the sums
    flying = agreement.start("count", [count])
    torch.randn(64, 64) @ torch.randn(64, 64)
    out["flying"] = flying.finish()[0].item()
    try:  # the programs send different things: every rank refuses, none reads garbage
        agreement.before_run("count" if rank == 0 else "another count", [count])
    except sc.SPMDRuntimeError as exc:
        out["error"] = str(exc)
    return out


def test_the_round_carries_the_programs_sums_and_waits_for_a_compiling_rank() -> None:
    """NOTE: [reductions that ride the input check]: the round's values come back summed
    in their own dtypes, a rank that compiles first is waited for, and ranks whose
    programs send different values refuse together."""
    results = sc.launch(_round_worker, 2, timeout_s=120, collective_timeout_s=30)
    for out in results:
        assert out["sums"] == [7.0, [2, 5]]
        assert out["dtypes"] == ["torch.float32", "torch.int64"]
        assert out["flying"] == 7.0
        assert "different programs" in out["error"]


class _Boom(Exception):
    pass


def _flagged_step(model: nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor):
    loss = nn.functional.cross_entropy(model(x), y) * model.loss_scale
    loss.backward()
    if model.bad:  # a rank's own check on its shard, read in Python
        raise _Boom("bad shard")
    optim.step()
    optim.zero_grad()
    return loss


def _flagged_worker(rank: int, world_size: int, calls: list[tuple[bool, float]]) -> list:
    """``calls``: (whether rank 1's step raises, rank 1's loss_scale) per call; rank 0
    never raises and reads 1.0. Returns each call's loss or error, and the eager losses
    of the calls that should complete, on the global batch (float64)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).double()
    ref = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).double()
    ref.load_state_dict(model.state_dict())
    ref.loss_scale, ref.bad = 1.0, False
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(ref.parameters(), lr=0.1)
    step = sc.compile(DataParallel("replicate"))(_flagged_step)
    gen = torch.Generator().manual_seed(0)
    out = []
    for bad, scale in calls:
        x, y = torch.randn(8, 8, generator=gen, dtype=torch.float64), torch.randint(0, 4, (8,), generator=gen)
        model.bad, model.loss_scale = (bad, scale) if rank == 1 else (False, 1.0)
        try:
            got: object = float(step(model, optim, x[4 * rank : 4 * rank + 4], y[4 * rank : 4 * rank + 4]))
        except Exception as exc:  # noqa: BLE001
            got = f"{type(exc).__name__}: {exc}"
        eager = None
        if not bad and scale == 1.0:  # a call every rank completes: eager's step too
            eager = _flagged_step(ref, ref_optim, x, y).item()
        out.append((got, eager))
    return out


def test_a_rank_that_fails_before_its_program_fails_its_peers_call_too() -> None:
    """NOTE: [a rank that fails before its program]: rank 1's step raises on call 1 (it
    recompiles for its flag and its capture raises) while rank 0 runs its cached
    program. Before, rank 0's round met rank 1's next call's: rank 0 returned a loss of
    half of call 1's batch and half of call 2's with no error, and the ranks stayed a
    call apart. Now rank 0's call 1 fails naming rank 1 and its error, and call 2 runs
    on both, as eager's second step."""
    results = sc.launch(
        _flagged_worker, 2, args=([(False, 1.0), (True, 1.0), (False, 1.0)],),
        timeout_s=240, collective_timeout_s=30,
    )
    (first0, _), (failed0, _), (last0, eager) = results[0]
    assert isinstance(first0, float) and isinstance(last0, float), results
    assert "failed on rank 1 before its program ran" in failed0, failed0
    assert "rank 1: SPMDCompileError" in failed0 and "_Boom: bad shard" in failed0, failed0
    assert "_Boom" in results[1][1][0] or "bad shard" in results[1][1][0], results[1]
    assert results[1][2][0] == last0
    assert abs(last0 - eager) <= 1e-12 * abs(eager), (last0, eager)


def test_a_rank_whose_first_capture_fails_fails_its_peers_first_call_too() -> None:
    """NOTE: [a rank that fails before its program], on the FIRST call: rank 1's capture
    raises while rank 0's succeeds and places the model (a broadcast per parameter).
    Before, rank 1's failed round met rank 0's first broadcast: both hung until the
    collective timeout (30 s here, gloo's 30 minutes under torchrun) and the group was
    broken for call 2. Now rank 0's call fails naming rank 1 before placing anything,
    and call 2 runs on both, as eager's first step."""
    start = time.monotonic()
    results = sc.launch(
        _flagged_worker, 2, args=([(True, 1.0), (False, 1.0)],), timeout_s=240, collective_timeout_s=30,
    )
    (failed0, _), (last0, eager) = results[0]
    assert "failed on rank 1 before its program ran" in failed0, failed0
    assert "_Boom: bad shard" in failed0, failed0
    assert "_Boom" in results[1][0][0], results[1]
    assert results[1][1][0] == last0
    assert isinstance(last0, float) and abs(last0 - eager) <= 1e-12 * abs(eager), (last0, eager)
    assert time.monotonic() - start < 120


def test_python_values_the_step_reads_must_agree_across_ranks() -> None:
    """NOTE: [Python values agree across ranks]: ``model.loss_scale`` read by the step,
    1.0 on rank 0 and 2.0 on rank 1, trained both ranks on a mix of the two (loss 2.0215
    on both, which neither scale gives) with no error. Now the first call and a later
    one where rank 1 alone changes it are refused on both ranks, naming the value, and
    leave the model as eager's."""
    results = sc.launch(
        _flagged_worker, 2, args=([(False, 2.0), (False, 1.0), (False, 3.0), (False, 1.0)],),
        timeout_s=240, collective_timeout_s=30,
    )
    for rank, calls in enumerate(results):
        for k, other in ((0, "2.0"), (2, "3.0")):
            error = calls[k][0]
            assert isinstance(error, str) and "different Python values" in error, (rank, calls)
            assert f"loss_scale: rank 0: 1.0, rank 1: {other}" in error, error
        for k in (1, 3):
            loss, eager = calls[k]
            assert isinstance(loss, float) and abs(loss - eager) <= 1e-12 * abs(eager), (rank, calls)


def _tagged_step(model: nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor):
    loss = nn.functional.cross_entropy(model(x), y)
    if model.is_main:  # a per-rank flag guarding a log line: it traces no op
        print(f"{model.tag} tracing the step", file=io.StringIO())
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _noisy_step(model: nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor):
    perm = torch.randperm(x.shape[1])  # a draw of the default generator, as PPO's minibatches
    x = x[:, perm] + 0.1 * torch.randn_like(x)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _tagged_worker(rank: int, world_size: int) -> list:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).double()
    ref = copy.deepcopy(model)
    model.is_main, model.tag = rank == 0, f"[rank {rank}]"
    ref.is_main, ref.tag = False, ""
    optim, ref_optim = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    step = sc.compile(DataParallel("replicate"))(_tagged_step)
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(2):
        x, y = torch.randn(8, 8, generator=gen, dtype=torch.float64), torch.randint(0, 4, (8,), generator=gen)
        got = float(step(model, optim, x[4 * rank : 4 * rank + 4], y[4 * rank : 4 * rank + 4]))
        out.append((got, _tagged_step(ref, ref_optim, x, y).item()))
    return out


def test_python_values_that_differ_per_rank_but_trace_nothing_are_accepted() -> None:
    """NOTE: [Python values agree across ranks]: a per-rank flag or log prefix the step
    reads but no op depends on leaves every rank's trace the same: not refused (the first
    version of the check digested every value the guards hold and refused this step)."""
    results = sc.launch(_tagged_worker, 2, timeout_s=240, collective_timeout_s=30)
    for rank, calls in enumerate(results):
        for got, eager in calls:
            assert abs(got - eager) <= 1e-12 * abs(eager), (rank, calls)


def _seeded_worker(rank: int, world_size: int) -> dict:
    """Call 1 with each rank seeded ``seed + rank``; then every rank seeded alike once,
    and 3 calls without reseeding, against eager on the global batch (float64)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).double()
    ref = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).double()
    ref.load_state_dict(model.state_dict())
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(ref.parameters(), lr=0.1)
    step = sc.compile(DataParallel("replicate"))(_noisy_step)
    gen = torch.Generator().manual_seed(0)
    batches = [
        (torch.randn(8, 8, generator=gen, dtype=torch.float64), torch.randint(0, 4, (8,), generator=gen))
        for _ in range(3)
    ]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(10 + rank)  # per rank, as timm's random_seed(seed, rank)
    x, y = batches[0]
    try:
        step(model, optim, x[4 * rank : 4 * rank + 4], y[4 * rank : 4 * rank + 4])
        refused = ""
    except sc.SPMDCompileError as exc:
        refused = str(exc)
    after = {k: v.to_local() if hasattr(v, "to_local") else v for k, v in model.state_dict().items()}
    untouched = all(torch.equal(v, after[k]) for k, v in before.items())
    torch.manual_seed(10)  # alike: the ranks' generators then stay in step call after call
    losses = [float(step(model, optim, x[4 * rank : 4 * rank + 4], y[4 * rank : 4 * rank + 4])) for x, y in batches]
    torch.manual_seed(10)
    eager = [_noisy_step(ref, ref_optim, x, y).item() for x, y in batches]
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    worst = max((p - q).abs().max().item() for p, q in zip(local, ref.parameters(), strict=True))
    return {"refused": refused, "untouched": untouched, "losses": losses, "eager": eager, "worst": worst}


def test_ranks_seeded_apart_are_refused_when_the_step_draws() -> None:
    """NOTE: [generators agree across ranks]: ranks seeded ``seed + rank`` ran a step
    drawing ``torch.randperm`` each with its own numbers (cleanrl's PPO update on 2 gloo
    ranks: replicated weights 0.0275 apart after 3 calls, no error). Now such a call is
    refused on both ranks before anything is updated; seeded alike once, 3 calls in a
    row (no reseeding) match eager on the global batch exactly."""
    results = sc.launch(_seeded_worker, 2, timeout_s=240, collective_timeout_s=30)
    for rank, out in enumerate(results):
        assert "default random-number generators differ" in out["refused"], (rank, out)
        assert "torch.manual_seed(seed)" in out["refused"], out["refused"]
        assert out["untouched"], rank
        for loss, eager in zip(out["losses"], out["eager"], strict=True):
            assert abs(loss - eager) <= 1e-12 * abs(eager), (rank, out)
        assert out["worst"] <= 1e-12, (rank, out)
    assert results[0]["losses"] == results[1]["losses"]


def _dropout_step(model: nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor):
    loss = nn.functional.cross_entropy(nn.functional.dropout(model(x), 0.2), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _dropout_worker(rank: int, world_size: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).double()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    step = sc.compile(DataParallel("replicate"))(_dropout_step)
    torch.manual_seed(10 + rank)  # per rank, as timm's random_seed(seed, rank)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3):
        step(model, optim, torch.randn(4, 8, generator=gen, dtype=torch.float64), torch.randint(0, 4, (4,), generator=gen))
    return [p.to_local().clone() for p in model.parameters()]


def test_ranks_seeded_apart_train_a_data_parallel_step_with_dropout() -> None:
    """NOTE: [generators agree across ranks]: forward's element-wise draws on a batch split
    over every rank need no agreement (each rank keeps its slice of a draw; the ranks' own
    draws make as good a mask): timm-style per-rank seeds with dropout still train, and
    the replicated weights stay identical."""
    results = sc.launch(_dropout_worker, 2, timeout_s=240, collective_timeout_s=30)
    for p, q in zip(results[0], results[1], strict=True):
        assert torch.equal(p, q)


def _whole_draw_step(how: str):  # noqa: ANN202
    def step(model, optim, x, y):  # noqa: ANN001, ANN202
        if how == "scalar":  # a mixup weight: one number for the whole batch
            out = model(x * torch.rand(()))
        elif how == "weight":  # noise on a replicated weight
            w = model.weight + 0.1 * torch.randn_like(model.weight)
            out = nn.functional.linear(x, w, model.bias)
        else:  # LayerDrop: one coin per step
            out = model(x) * (0.0 if torch.rand(()) < 0.5 else 1.0)
        loss = nn.functional.cross_entropy(out, y)
        loss.backward()
        optim.step()
        return loss

    return step


def _whole_draw_worker(rank: int, world_size: int) -> dict:
    out = {}
    for how in ("scalar", "weight", "branch"):
        torch.manual_seed(0)
        model = nn.Linear(8, 4).double()
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        step = sc.compile(DataParallel("replicate"))(_whole_draw_step(how))
        torch.manual_seed(10 + rank)  # per rank
        x, y = torch.randn(4, 8, dtype=torch.float64), torch.randint(0, 4, (4,))
        try:
            step(model, optim, x, y)
            out[how] = "ran"
        except Exception as exc:  # noqa: BLE001 - the message is the result
            out[how] = str(exc)
    return out


def test_ranks_seeded_apart_are_refused_for_a_forward_draw_every_rank_reads_whole() -> None:
    """NOTE: [generators agree across ranks]: only draws each rank slices are left out of
    the check. A 0-d mixup weight, noise on a replicated weight and a LayerDrop coin were
    left out by op name: each rank trained with its own value (losses of no single-device
    run), and the coin was refused as a Python value that differs; now each is refused
    as generators that differ."""
    results = sc.launch(_whole_draw_worker, 2, timeout_s=240, collective_timeout_s=30)
    for rank, out in enumerate(results):
        for how, message in out.items():
            assert "default random-number generators differ" in message, (rank, how, message)


def _resend_worker(rank: int, world_size: int) -> object:
    from spmd_compiler.runtime.same_inputs import InputAgreement

    agreement = InputAgreement([torch.zeros(4, 8)])
    agreement.constants = "none | Python values read: 0123"  # as every real program's
    agreement.generators = "cpu 0123"  # NOTE: [generators agree across ranks]
    agreement.pending_update = True  # a cross_iteration_overlap step on its steady program
    if rank == 1:  # rank 1 compiles first: rank 0 sends its round again
        agreement.before_compile()
    return agreement.before_run("count", [torch.tensor(1.0)])[0].item()


def test_a_round_sent_again_sends_what_it_sent_first() -> None:
    """A rank whose round met a compiling peer's sent it again with its constants (and
    generator states, and its deferred-update flag: the second review) appended twice, so the ranks' digests differed and both raised a
    false disagreement; now the round sent again is the first one."""
    assert sc.launch(_resend_worker, 2, timeout_s=120, collective_timeout_s=30) == [2.0, 2.0]


def test_the_captured_step_text_holds_no_rank_device() -> None:
    """NOTE: [Python values agree across ranks]: each rank's own GPU (``cuda:1`` on rank 1)
    in a traced op's arguments made every multi-GPU job's ranks differ (the second
    review); a device is written by its type."""
    from spmd_compiler.runtime.same_inputs import captured_step_text

    def text(device: str) -> str:
        graph = torch.fx.Graph()
        x = graph.placeholder("x")
        made = graph.call_function(torch.ops.aten.arange.start, (0, 4), {"device": torch.device(device)})
        moved = graph.call_function(torch.ops.aten._to_copy.default, (x,), {"device": device})
        graph.output((made, moved))
        return captured_step_text(graph)

    assert text("cuda:0") == text("cuda:1") != text("cpu")


def _evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return nn.functional.cross_entropy(model(x), y)


def _dict_step(model: nn.Module, optim: torch.optim.Optimizer, batch: dict) -> torch.Tensor:
    loss = nn.functional.cross_entropy(model(batch["x"]), batch["y"])
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _steps_worker(rank: int, world_size: int) -> dict:
    """Train; rank 0 evaluates alone (the eval step's first call); both evaluate; rank 0
    evaluates alone again (both programs cached); a dict batch holding each rank's file
    names; train again."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 4)).double()
    optim = torch.optim.SGD(model.parameters(), lr=0.5)
    train = sc.compile(DataParallel("replicate"))(classification_train_step)
    evaluate = sc.compile(DataParallel("replicate"))(_evaluate)
    dict_train = sc.compile(DataParallel("replicate"))(_dict_step)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 8, generator=gen, dtype=torch.float64), torch.randint(0, 4, (8,), generator=gen))
               for _ in range(2)]
    shares = [(x[4 * rank : 4 * rank + 4], y[4 * rank : 4 * rank + 4]) for x, y in batches]
    names = [f"sample_{4 * rank + i}.png" for i in range(4)]
    calls = [
        lambda: train(model, optim, *shares[0]),
        lambda: evaluate(model, *shares[0]) if rank == 0 else train(model, optim, *shares[1]),
        lambda: evaluate(model, *shares[0]),
        lambda: evaluate(model, *shares[0]) if rank == 0 else train(model, optim, *shares[1]),
        lambda: dict_train(model, optim, {"x": shares[1][0], "y": shares[1][1], "name": names}),
        lambda: train(model, optim, *shares[1]),
    ]
    out: dict = {"calls": []}
    for call in calls:
        start = time.monotonic()
        try:
            call()
            out["calls"].append({"seconds": time.monotonic() - start})
        except (sc.SPMDCompileError, sc.SPMDRuntimeError) as exc:
            out["calls"].append({"error": str(exc), "seconds": time.monotonic() - start})
    out["state"] = sc.checkpoint.full_state_dict(model, optim).get("model")  # rank 0's
    return out


def test_ranks_calling_different_compiled_steps_are_refused_on_every_rank() -> None:
    """NOTE: [every rank in the same step's round]: ``if rank == 0: evaluate(...)`` with a
    compiled eval step put the eval step's first round against the train step's: gloo
    aborted rank 1 (SIGABRT, "op.preamble.length <= op.nbytes"), with no Python error.
    Once both steps were compiled, the error blamed the Python values the steps read.
    Now every rank raises one error naming each rank's step, nothing is updated, and the
    ranks go on in step. NOTE: [strings that differ per sample]: each rank's file names
    in a dict batch are refused as per-sample metadata, with how to drop them."""
    results = sc.launch(_steps_worker, 2, timeout_s=240, collective_timeout_s=30)
    for rank, result in enumerate(results):
        calls = result["calls"]
        assert [("error" in c) for c in calls] == [False, True, False, True, True, False], (rank, calls)
        for call in (calls[1], calls[3]):
            assert "The ranks called different compiled steps" in call["error"]
            assert "rank 0: _evaluate (" in call["error"] and "rank 1: classification_train_step (" in call["error"]
            assert call["seconds"] < 10.0
        assert "its first call" in calls[1]["error"]  # the eval step's first call on rank 0
        assert "per-sample metadata" in calls[4]["error"] and "`batch.pop('name')`" in calls[4]["error"]
        assert "batch['name'][0]: rank 0: 'sample_0.png', rank 1: 'sample_4.png'" in calls[4]["error"]
    # two updates, on the two global batches, as eagerly
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 4)).double()
    reference_optim = torch.optim.SGD(reference.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        x, y = torch.randn(8, 8, generator=gen, dtype=torch.float64), torch.randint(0, 4, (8,), generator=gen)
        classification_train_step(reference, reference_optim, x, y)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(results[0]["state"][name], value, rtol=1e-12, atol=1e-12)
