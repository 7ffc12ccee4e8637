"""When a compiled step recompiles: new shapes and train/eval do, same shapes never do.

Every call is checked against the eager step, so a cache hit that reused the wrong
program (old batch size, old training flag) shows up as a parity failure too.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn

import spmd_compiler as sc
import spmd_compiler.api as compiled_step_api
from spmd_compiler.ir.signature import Kind
from spmd_compiler.tools.parity import compare_models, compare_optimizers, relative_difference

FLOAT32_TOLERANCE = 1e-5


class TrainEvalNet(nn.Module):
    """Forward differs deterministically between train() and eval()."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.drop = nn.Dropout(p=0.0)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(x))
        if self.training:  # a Python flag, not a tensor: fine to branch on
            h = 2 * h
        return self.out(self.drop(h))


def sgd_momentum(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)


def adamw(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(m.parameters(), lr=1e-2)


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("make_optimizer", [sgd_momentum, adamw])
def test_same_shapes_never_recompile(
    run_parity, classification_batches, make_optimizer, world_size
):
    result = run_parity(TrainEvalNet, make_optimizer, world_size, classification_batches(5))
    result.assert_close(FLOAT32_TOLERANCE)
    # SGD's momentum buffer is its first gradient: a first program and the steady one;
    # AdamW's state is made before the first (NOTE: [optimizer state made before the
    # first program])
    programs = 2 if make_optimizer is sgd_momentum else 1
    assert result.compile_counts == [1] + [programs] * 4
    assert len(result.compiled.records) == programs


def test_stateless_optimizer_compiles_once(run_parity, classification_batches):
    result = run_parity(
        TrainEvalNet,
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
        2,
        classification_batches(4),
    )
    result.assert_close(FLOAT32_TOLERANCE)
    assert result.compile_counts == [1, 1, 1, 1]


@pytest.mark.parametrize("world_size", [2, 4])
def test_new_batch_size_recompiles_and_matches(
    run_parity, classification_batches, world_size, caplog
):
    sizes = [8, 8, 16, 16, 8, 4]
    batches = [classification_batches(1, batch_size=n, seed=i)[0] for i, n in enumerate(sizes)]
    with caplog.at_level(logging.INFO, logger="spmd_compiler"):
        result = run_parity(TrainEvalNet, sgd_momentum, world_size, batches)
    result.assert_close(FLOAT32_TOLERANCE)
    # 8: state-creating + steady; 16: new; 16 again: cached; back to 8: cached; 4: new.
    assert result.compile_counts == [1, 2, 3, 3, 3, 4]
    # each new shape says why it compiles, and so does the state-creating call's
    # successor (silent before the sixty-second session)
    changes = [r.getMessage() for r in caplog.records if "recompiling" in r.getMessage()]
    assert changes == [
        "recompiling classification_train_step: the state of optimizer[0] was not made yet, now made "
        "(by the last call: this is the steady-state program)",
        "recompiling classification_train_step: the shape of tensor argument 0 was [8, 8], now [16, 8]",
        "recompiling classification_train_step: the shape of tensor argument 0 was [8, 8], now [4, 8]",
    ], changes
    shapes = [
        meta.shape
        for record in result.compiled.records
        for ref, meta in record.program.captured.inputs
        if ref.kind is Kind.INPUT and ref.index == 0
    ]
    assert shapes == [(8, 8), (8, 8), (16, 8), (4, 8)]


def test_refused_calls_do_not_count_toward_the_recompile_warning(classification_batches, caplog):
    """A call refused before it compiles (a batch the world size does not divide)
    compiles nothing, so it does not count toward "changed on 3 calls ... each new value
    compiles a new program". Before, it did: batches 8, 8, 4, 6, 5 at world size 4 (6
    and 5 refused) warned at the 5th call after one recompile."""
    torch.manual_seed(0)
    model = TrainEvalNet()
    optimizer = sgd_momentum(model)
    compiled = sc.compile()(_train_step)
    refused = 0
    with caplog.at_level(logging.INFO, logger="spmd_compiler"), sc.simulate(4):
        for i, n in enumerate([8, 8, 4, 6, 5, 10]):
            x, y = classification_batches(1, batch_size=n, seed=i)[0]
            try:
                compiled(model, optimizer, x, y)
            except sc.SPMDCompileError as exc:
                assert "is not divisible by 4" in str(exc) and "over the 4 ranks" in str(exc)
                refused += 1
    assert refused == 3
    assert compiled.compile_count == 3  # 8: state-creating + steady; 4: new
    assert not [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def _train_step(model, optimizer, x, y):
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


@pytest.mark.parametrize("world_size", [1, 2])
def test_train_eval_switch_recompiles_and_matches(run_parity, classification_batches, world_size):
    modes = [True, True, False, False, True, False]

    def set_mode(i, model, reference):
        model.train(modes[i])
        reference.train(modes[i])

    result = run_parity(
        TrainEvalNet,
        sgd_momentum,
        world_size,
        classification_batches(len(modes)),
        before_step=set_mode,
    )
    result.assert_close(FLOAT32_TOLERANCE)
    # train: 1, 2; eval: new program (3), cached; train again: cached; eval: cached.
    assert result.compile_counts == [1, 2, 3, 3, 3, 3]


def _eager_warm_up(model, optimizer, batch, train_step):
    train_step(model, optimizer, *batch)


def _load_checkpoint(model, optimizer, batch, train_step):
    """Optimizer state from a state dict saved by another (eager) optimizer."""
    donor_model = TrainEvalNet()
    donor_model.load_state_dict(model.state_dict())
    donor = adamw(donor_model)
    train_step(donor_model, donor, *batch)
    model.load_state_dict(donor_model.state_dict())
    optimizer.load_state_dict(donor.state_dict())


@pytest.mark.parametrize("prepare", [_eager_warm_up, _load_checkpoint])
def test_state_created_before_the_first_call_compiles_once(
    classification_batches, train_step, prepare
):
    """Adam's float32 ``step`` counters, made eagerly, are float64 once installed: the
    second call must find the first call's program (it compiled again before)."""
    torch.manual_seed(0)
    model = TrainEvalNet()
    optimizer = adamw(model)
    batches = classification_batches(4)
    prepare(model, optimizer, batches[0], train_step)
    reference = copy.deepcopy(model)
    reference_optimizer = adamw(reference)
    reference_optimizer.load_state_dict(optimizer.state_dict())
    assert all(s["step"].dtype == torch.float32 for s in optimizer.state.values())
    compiled = sc.compile()(train_step)
    with sc.simulate(world_size=2) as sim:
        for batch in batches[1:]:
            loss = compiled(model, optimizer, *batch)
            expected = train_step(reference, reference_optimizer, *batch)
            assert relative_difference(loss, expected) < FLOAT32_TOLERANCE
        assert compiled.compile_count == 1
        differences = compare_models(model, reference, sim)
        differences.update(compare_optimizers(optimizer, reference_optimizer, sim))
    assert max(differences.values()) < FLOAT32_TOLERANCE


def _accumulating_step(model, optim, x, y, i):  # noqa: ANN001
    """An int counter steering an `if`: each new value is a guard miss and a capture."""
    loss = nn.functional.cross_entropy(model(x), y) / 4
    loss.backward()
    if (i + 1) % 4 == 0:
        optim.step()
        optim.zero_grad()
    return loss


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_recaptured_programs_are_reused_from_memory(classification_batches, mode):
    """NOTE: [programs reused in memory]: a counter over 12 calls captures 12 times, but
    most captures meet a program the step built already, which is decoded instead of
    expanded again; every call stays exact."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 15), nn.ReLU(), nn.Linear(15, 4)).double()
    reference = copy.deepcopy(model)
    optim, ref_optim = (torch.optim.AdamW(m.parameters(), lr=0.1) for m in (model, reference))
    step = sc.compile(sc.parallel_modes.make_mode(mode))(_accumulating_step)
    batches = classification_batches(12, dtype=torch.float64)
    with sc.simulate(2) as sim:
        for i, (x, y) in enumerate(batches):
            loss = step(model, optim, x, y, i)
            expected = _accumulating_step(reference, ref_optim, x, y, i)
            assert relative_difference(loss, expected) < 1e-13
        worst = max({**compare_models(model, reference, sim),
                     **compare_optimizers(optim, ref_optim, sim)}.values())
    assert worst < 1e-13
    how = [record.cache for record in step.records]
    assert len(how) == 12 and how[0] == "off"
    assert how.count("memory") >= 6, how
    reused = [r for r in step.records if r.cache == "memory"]
    assert all(r.expand_seconds == 0.0 and r.pass_seconds == 0.0 for r in reused)


def _counted_step(model, optim, x, y, i):  # noqa: ANN001
    """An int argument the step reads: each value its own program; every call the same
    state (plain SGD, gradients zeroed), so a value's program is found again."""
    loss = nn.functional.cross_entropy(model(x), y) * (1 + i % 3)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_the_least_recently_used_programs_are_dropped(classification_batches, mode, monkeypatch, caplog):
    """NOTE: [programs kept in memory]: a step compiling on every call (an int counter
    it reads) kept every program: 1.7 MB of RSS per call for an 8-16-4 MLP, without
    bound. Now it keeps ``KEPT_PROGRAMS`` (3 here), drops the least recently used with
    one warning, and compiles a dropped one again when its value comes back; every call
    stays exact (float64)."""
    monkeypatch.setattr(compiled_step_api, "KEPT_PROGRAMS", 3)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 15), nn.ReLU(), nn.Linear(15, 4)).double()
    reference = copy.deepcopy(model)
    optim, ref_optim = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    step = sc.compile(sc.parallel_modes.make_mode(mode))(_counted_step)
    # 0 used again before 4 compiles: kept, where dropping by age would drop it (7
    # compiles); 1 and 2 dropped, 1 compiled again
    counters = [0, 1, 2, 0, 4, 0, 5, 1, 0]
    batches = classification_batches(len(counters), dtype=torch.float64)
    with caplog.at_level(logging.WARNING, logger="spmd_compiler"), sc.simulate(2) as sim:
        for i, (x, y) in zip(counters, batches, strict=True):
            loss = step(model, optim, x, y, i)
            expected = _counted_step(reference, ref_optim, x, y, i)
            assert relative_difference(loss, expected) < 1e-13
        worst = max({**compare_models(model, reference, sim),
                     **compare_optimizers(optim, ref_optim, sim)}.values())
    assert worst < 1e-13
    assert sum(len(entries) for entries in step._cache.values()) == 3
    assert step.compile_count == 6  # 0, 1, 2, 4, 5, then 1 again (dropped at 4)
    kept = [r for r in step.records if r.program is not None]
    assert len(kept) == 3 and any(r.program is step.last_program for r in kept)
    dropped = [r.getMessage() for r in caplog.records if "keeps the last 3" in r.getMessage()]
    assert len(dropped) == 1, dropped


STEP_COUNTER = 0  # a global the step below reads: each value a guard under one key


def _global_counter_step(model, optim, x, y):  # noqa: ANN001
    loss = nn.functional.cross_entropy(model(x), y) * (1.0 + 0.1 * (STEP_COUNTER % 5))
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def test_programs_of_a_global_the_step_reads_are_dropped_too(classification_batches, monkeypatch):
    """NOTE: [programs kept in memory], a review: a global counter read by the step adds
    a program per value under ONE key (its guards); the first version dropped whole keys
    other than the call's, so it kept all 8 programs here. Now 3, exact (float64)."""
    global STEP_COUNTER
    monkeypatch.setattr(compiled_step_api, "KEPT_PROGRAMS", 3)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 15), nn.ReLU(), nn.Linear(15, 4)).double()
    reference = copy.deepcopy(model)
    optim, ref_optim = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    step = sc.compile(sc.parallel_modes.make_mode("ddp"))(_global_counter_step)
    try:
        with sc.simulate(2):
            for STEP_COUNTER, (x, y) in enumerate(classification_batches(8, dtype=torch.float64)):  # noqa: B007
                loss = step(model, optim, x, y)
                assert relative_difference(loss, _global_counter_step(reference, ref_optim, x, y)) < 1e-13
    finally:
        STEP_COUNTER = 0
    assert len(step._cache) == 1
    assert sum(len(entries) for entries in step._cache.values()) == 3
    assert step.compile_count == 8


def dict_batch_step(model, optim, batch):  # noqa: ANN001
    loss = nn.functional.cross_entropy(model(batch["x"]), batch["y"])
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def test_per_sample_strings_warn_by_the_third_call_with_the_metadata_advice(caplog):
    """A dict batch whose file names the default collate made a list of strings, which
    the step never reads: every call compiles again (one program per name). The warning
    came at the 4th call and advised a tensor or a float argument (NOTE: [strings that
    differ per sample]); it comes at the 3rd, naming the strings as per-sample metadata
    and how to drop them. The numbers stay those of the eager step (float64)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).double()
    reference = copy.deepcopy(model)
    optim, reference_optim = sgd_momentum(model), sgd_momentum(reference)
    compiled = sc.compile()(dict_batch_step)
    gen = torch.Generator().manual_seed(1)
    with caplog.at_level(logging.INFO, logger="spmd_compiler"), sc.simulate(2):
        for call in range(3):
            batch = {
                "x": torch.randn(8, 8, generator=gen, dtype=torch.float64),
                "y": torch.randint(0, 4, (8,), generator=gen),
                "name": [f"sample_{8 * call + i}.png" for i in range(8)],
            }
            loss = compiled(model, optim, batch)
            expected = dict_batch_step(reference, reference_optim, batch)
            assert abs(loss.item() - expected.item()) <= 1e-12 * expected.item()
        assert max(compare_models(model, reference, None).values()) < 1e-12
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("argument batch['name'][0] of the step changed on 2 calls")
    assert "per-sample metadata" in warnings[0] and "`batch.pop('name')`" in warnings[0]
    assert "must be the same on every call" in warnings[0]
    notes = [r.getMessage() for r in caplog.records if "recompiling" in r.getMessage()]
    assert len(notes) == 2 and all("per-sample metadata" in note for note in notes)


def phase_step(model, optim, x, y, phase):  # noqa: ANN001
    scale = {"warmup": 0.5, "train": 1.0, "finetune": 0.25}[phase]
    loss = nn.functional.cross_entropy(model(x), y) * scale
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


def test_a_string_the_step_branches_on_is_no_metadata(caplog):
    """A ``phase`` string the step reads (a program per phase: three values, three
    programs) is not per-sample metadata: no metadata advice and no warning at its second
    new value (the second review: the first version said "must be the same on every
    call" for it); the numbers are eager's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).double()
    reference = copy.deepcopy(model)
    optim, reference_optim = sgd_momentum(model), sgd_momentum(reference)
    compiled = sc.compile()(phase_step)
    gen = torch.Generator().manual_seed(1)
    with caplog.at_level(logging.INFO, logger="spmd_compiler"), sc.simulate(2):
        for phase in ("warmup", "train", "finetune"):
            x, y = torch.randn(8, 8, generator=gen, dtype=torch.float64), torch.randint(0, 4, (8,), generator=gen)
            loss = compiled(model, optim, x, y, phase)
            expected = phase_step(reference, reference_optim, x, y, phase)
            assert abs(loss.item() - expected.item()) <= 1e-12 * expected.item()
    messages = [r.getMessage() for r in caplog.records]
    assert not any("metadata" in m for m in messages), messages
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    assert sum("recompiling phase_step: argument phase" in m for m in messages) == 2


def _checked_adam_step(model, optim, x, y):  # noqa: ANN001
    """An `if` on the loss's value: the first program is kept (NOTE: [optimizer state
    made before the first program]), and the second call compiles the steady one."""
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    if loss.detach() >= 0:
        optim.step()
    optim.zero_grad()
    return loss.detach()


def test_the_compile_after_the_call_that_made_the_optimizer_state_says_why(classification_batches, caplog):
    """Adam's state made by call 0, whose program is kept: call 1 compiles the
    steady-state program. Before the sixty-second session it showed the compile banner
    with no "recompiling <step>: ..." line (the change was one not logged); it says now
    that the optimizer's state was made. The result matches eager."""
    torch.manual_seed(0)
    model = TrainEvalNet()
    reference = copy.deepcopy(model)
    optimizer, reference_optimizer = adamw(model), adamw(reference)
    compiled = sc.compile()(_checked_adam_step)
    with caplog.at_level(logging.INFO, logger="spmd_compiler"), sc.simulate(world_size=2) as sim:
        for batch in classification_batches(3):
            loss = compiled(model, optimizer, *batch)
            assert relative_difference(loss, _checked_adam_step(reference, reference_optimizer, *batch)) < FLOAT32_TOLERANCE
        assert compiled.compile_count == 2
        differences = compare_models(model, reference, sim)
    notes = [r.getMessage() for r in caplog.records if "recompiling" in r.getMessage()]
    assert notes == ["recompiling _checked_adam_step: the state of optimizer[0] was not made yet, now made "
                     "(by the last call: this is the steady-state program)"], notes
    assert max(differences.values()) < FLOAT32_TOLERANCE


def test_a_first_program_kept_for_state_not_planned_is_logged_as_a_sentence(
    classification_batches, train_step, monkeypatch, caplog
):
    """The log of a first program kept because the optimizer state cannot be made ahead
    read "its optimizer state the state is made by spmd_compiler.gradient.default"
    (SigLIP with a queue, sixty-second session); it is a sentence now."""
    import spmd_compiler.capture.initial_state as initial_state

    def not_planned(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise initial_state.NotPlanned("the state is made by spmd_compiler.gradient.default")

    monkeypatch.setattr(initial_state, "predicted", lambda bindings: None)  # not Adam's prediction
    monkeypatch.setattr(initial_state, "plan", not_planned)
    torch.manual_seed(0)
    model = TrainEvalNet()
    compiled = sc.compile()(train_step)
    with caplog.at_level(logging.INFO, logger="spmd_compiler"), sc.simulate(world_size=2):
        compiled(model, adamw(model), *classification_batches(1)[0])
    kept = [r.getMessage() for r in caplog.records if "keeps a first program" in r.getMessage()]
    assert kept and kept[0].endswith(
        "keeps a first program, for the call that makes its optimizer state: that state cannot be "
        "made before the program (the state is made by spmd_compiler.gradient.default); the "
        "steady-state program is compiled at the next call"), kept
