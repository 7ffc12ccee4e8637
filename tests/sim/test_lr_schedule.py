"""LR schedulers stepped between compiled calls: parity with eager, no recompilation.

The learning rate is a graph input (a HYPERPARAM placeholder) read from the param group
on every call, so a scheduler changing it between calls must neither recompile nor be
ignored. The first call compiles the program that creates optimizer state, the second
the steady-state program; after that the count must stay at 2.
"""

from __future__ import annotations

import copy
import logging
import math
import warnings

import pytest
import torch
import torch.nn as nn

import spmd_compiler as sc

FLOAT32_TOLERANCE = 1e-5
STEPS = 5


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


SCHEDULERS = {
    "lambda": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1 / (1 + epoch)),
    "cosine": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS),
}

OPTIMIZERS = {
    "sgd_momentum": lambda m: torch.optim.SGD(m.parameters(), lr=0.2, momentum=0.9),
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=2e-2, weight_decay=0.1),
}
# programs compiled after each of the STEPS calls
PROGRAMS = {"sgd_momentum": [1, 2, 2, 2, 2], "adamw": [1, 1, 1, 1, 1]}


@pytest.mark.parametrize("world_size", [1, 4])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("scheduler", list(SCHEDULERS))
def test_scheduler_between_steps(
    run_parity, classification_batches, scheduler, optimizer, world_size
):
    result = run_parity(
        mlp,
        OPTIMIZERS[optimizer],
        world_size,
        classification_batches(STEPS),
        make_scheduler=SCHEDULERS[scheduler],
    )
    result.assert_close(FLOAT32_TOLERANCE)
    # AdamW's state is made before the first program (NOTE: [optimizer state made before
    # the first program]); SGD's momentum buffer is its first gradient: two programs
    assert result.compile_counts == PROGRAMS[optimizer]
    # The schedule really changed the rate each step (same on both optimizers).
    lrs = [g["lr"] for g in result.optimizer.param_groups]
    assert lrs == [g["lr"] for g in result.reference_optimizer.param_groups]
    base = OPTIMIZERS[optimizer](mlp()).param_groups[0]["lr"]
    expected = (
        base / (1 + STEPS)
        if scheduler == "lambda"
        else base * (1 + math.cos(math.pi * STEPS / STEPS)) / 2
    )
    assert lrs[0] == pytest.approx(expected, abs=1e-12)


def test_lr_changed_by_hand_is_used_without_recompiling(run_parity, classification_batches):
    """A large lr change between calls: a baked-in lr would break parity at once."""

    class SetLR:
        def __init__(self, opt):
            self.opt, self.calls = opt, 0

        def step(self):
            self.calls += 1
            for group in self.opt.param_groups:
                group["lr"] = [0.5, 0.0, 0.05, 0.3, 0.1][self.calls % 5]

    result = run_parity(
        mlp,
        OPTIMIZERS["sgd_momentum"],
        2,
        classification_batches(STEPS),
        make_scheduler=SetLR,
    )
    result.assert_close(FLOAT32_TOLERANCE)
    assert result.compile_counts == [1, 2, 2, 2, 2]


def test_compiled_call_keeps_the_schedulers_step_wrapper(train_step, classification_batches):
    model = mlp()
    optimizer = OPTIMIZERS["adamw"](model)
    scheduler = SCHEDULERS["lambda"](optimizer)
    wrapper = vars(optimizer).get("step")
    assert getattr(wrapper, "_wrapped_by_lr_sched", False)
    compiled = sc.compile()(train_step)
    with sc.simulate(world_size=2):
        compiled(model, optimizer, *classification_batches(1)[0])
    assert vars(optimizer).get("step") is wrapper
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scheduler.step()


# --------------------------------------------------------------------------------------
# NOTE: [schedulers stepped in the step]: scheduler.step() inside the compiled step


def step_then_schedule(model, optim, scheduler, x, y):
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    scheduler.step()
    return loss


def schedule_then_step(model, optim, scheduler, x, y):
    scheduler.step()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


IN_STEP_SCHEDULERS = {
    **SCHEDULERS,
    # a warmup then a decay: a scheduler whose step() steps other schedulers
    "sequential": lambda opt: torch.optim.lr_scheduler.SequentialLR(
        opt,
        [
            torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=2),
            torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5),
        ],
        milestones=[2],
    ),
}


@pytest.mark.parametrize("scheduler", list(IN_STEP_SCHEDULERS))
def test_scheduler_stepped_inside_the_step(run_parity, classification_batches, scheduler):
    result = run_parity(
        lambda: mlp().double(),
        OPTIMIZERS["adamw"],
        2,
        classification_batches(STEPS, dtype=torch.float64),
        make_scheduler=IN_STEP_SCHEDULERS[scheduler],
        step=step_then_schedule,
        scheduler_in_step=True,
    )
    result.assert_close(1e-12)
    assert result.compile_counts == PROGRAMS["adamw"]
    lrs = [g["lr"] for g in result.optimizer.param_groups]
    assert lrs == [g["lr"] for g in result.reference_optimizer.param_groups]
    assert lrs != [OPTIMIZERS["adamw"](mlp()).param_groups[0]["lr"]]  # it did step


def test_scheduler_stepped_before_the_optimizer_changes_this_steps_rate(
    run_parity, classification_batches
):
    """Stepped before optimizer.step(), the new rate is this call's update's (as eagerly)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's warning about the order, both sides
        result = run_parity(
            lambda: mlp().double(),
            OPTIMIZERS["sgd_momentum"],
            2,
            classification_batches(STEPS, dtype=torch.float64),
            make_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.1),
            step=schedule_then_step,
            scheduler_in_step=True,
        )
    result.assert_close(1e-12)
    assert result.compile_counts == [1, 2, 2, 2, 2]
    assert result.optimizer.param_groups[0]["lr"] == pytest.approx(0.2 * 0.1**STEPS)


class Trainer:
    """A step written as a method that reaches its scheduler through ``self``."""

    def __init__(self, model, optim, scheduler):
        self.model, self.optim, self.scheduler = model, optim, scheduler

    def step(self, model, optim, x, y):
        return step_then_schedule(model, optim, self.scheduler, x, y)


def test_scheduler_of_a_bound_method_step(classification_batches):
    torch.manual_seed(0)
    model = mlp()
    reference = copy.deepcopy(model)
    optim, ref_optim = OPTIMIZERS["adamw"](model), OPTIMIZERS["adamw"](reference)
    trainer = Trainer(model, optim, SCHEDULERS["cosine"](optim))
    ref_trainer = Trainer(reference, ref_optim, SCHEDULERS["cosine"](ref_optim))
    compiled = sc.compile()(trainer.step)
    with sc.simulate(world_size=2):
        for x, y in classification_batches(3):
            loss = compiled(model, optim, x, y)
            expected = ref_trainer.step(reference, ref_optim, x, y)
            assert torch.allclose(loss, expected, rtol=FLOAT32_TOLERANCE)
    assert compiled.compile_count == 1
    assert trainer.scheduler.last_epoch == ref_trainer.scheduler.last_epoch == 3
    assert optim.param_groups[0]["lr"] == ref_optim.param_groups[0]["lr"]


def _refusal(step, train_step_args_of, classification_batches, make_scheduler=None):
    model = mlp()
    optim = OPTIMIZERS["adamw"](model)
    scheduler = (make_scheduler or SCHEDULERS["cosine"])(optim)
    compiled = sc.compile()(step)
    x, y = classification_batches(1)[0]
    with sc.simulate(world_size=2), pytest.raises(sc.SPMDCompileError) as info:
        compiled(*train_step_args_of(model, optim, scheduler), x, y)
    return str(info.value), scheduler, optim


def test_scheduler_stepped_with_a_metric_is_refused(classification_batches):
    def plateau_step(model, optim, scheduler, x, y):
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optim.step()
        scheduler.step(loss)
        return loss

    text, scheduler, optim = _refusal(
        plateau_step, lambda m, o, s: (m, o, s), classification_batches,
        lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt),
    )
    assert "ReduceLROnPlateau.step() is called with arguments" in text
    assert "scheduler.step(loss)" in text  # the user's line
    assert scheduler.last_epoch == 0 and optim.param_groups[0]["lr"] == 2e-2  # untouched


def test_reading_the_rate_after_the_scheduler_stepped_is_refused(classification_batches):
    def logged_step(model, optim, scheduler, x, y):
        loss = step_then_schedule(model, optim, scheduler, x, y)
        return loss, optim.param_groups[0]["lr"] * 1.0

    text, scheduler, _ = _refusal(logged_step, lambda m, o, s: (m, o, s), classification_batches)
    assert "reads param_group['lr'] after scheduler.step()" in text
    assert "optim.param_groups[0][\"lr\"] * 1.0" in text
    assert scheduler.last_epoch == 0


def test_returning_the_rate_after_the_scheduler_stepped_names_the_return_line(classification_batches):
    """The value is read while the outputs are gathered, after the step's frame is gone:
    before the sixty-seventh session the error's train-step line was ``<string>:1: ""``."""
    def returned_step(model, optim, scheduler, x, y):
        loss = step_then_schedule(model, optim, scheduler, x, y)
        return loss, optim.param_groups[0]["lr"]

    text, scheduler, _ = _refusal(returned_step, lambda m, o, s: (m, o, s), classification_batches)
    assert "returns param_group['lr'] after scheduler.step()" in text
    assert 'train step:  ' + __file__ in text and 'return loss, optim.param_groups[0]["lr"]"' in text, text
    assert "<string>" not in text
    assert scheduler.last_epoch == 0


def test_get_last_lr_inside_the_step_is_refused(classification_batches):
    def logged_step(model, optim, scheduler, x, y):
        loss = step_then_schedule(model, optim, scheduler, x, y)
        return loss, scheduler.get_last_lr()

    text, _, _ = _refusal(logged_step, lambda m, o, s: (m, o, s), classification_batches)
    assert "CosineAnnealingLR.get_last_lr() is called inside the compiled train step" in text


def test_scheduler_between_two_steps_of_its_optimizer_is_refused(classification_batches):
    def twice(model, optim, scheduler, x, y):
        step_then_schedule(model, optim, scheduler, x, y)
        return step_then_schedule(model, optim, scheduler, x, y)

    text, _, _ = _refusal(twice, lambda m, o, s: (m, o, s), classification_batches)
    # NOTE: [a scheduler stepped between two optimizer steps]: it said the step "reads
    # param_group['lr']", which the user never wrote, with a hint to do what they do
    assert "CosineAnnealingLR.step()" in text and "runs between two step() calls of optimizer[0]" in text
    assert '"scheduler.step()"' in text and '"optim.step()"' in text
    assert "reads param_group" not in text and "call it once per minibatch" in text


class Holder:
    def __init__(self, scheduler):
        self.scheduler = scheduler


def test_scheduler_held_by_an_argument_is_stepped(classification_batches):
    """An RL agent / trainer state object given to the step holds the scheduler:
    ``agent.scheduler.step()`` is replayed as a global's is (it was refused as
    "reaches only through another object")."""

    def held(model, optim, holder, x, y):
        return step_then_schedule(model, optim, holder.scheduler, x, y)

    torch.manual_seed(0)
    model = mlp().double()
    reference = copy.deepcopy(model)
    optim, ref_optim = OPTIMIZERS["adamw"](model), OPTIMIZERS["adamw"](reference)
    holder, ref_holder = Holder(SCHEDULERS["cosine"](optim)), Holder(SCHEDULERS["cosine"](ref_optim))
    compiled = sc.compile()(held)
    with sc.simulate(world_size=2):
        for x, y in classification_batches(3, dtype=torch.float64):
            loss = compiled(model, optim, holder, x, y)
            expected = held(reference, ref_optim, ref_holder, x, y)
            assert abs(float(loss) - float(expected)) < 1e-12
    assert compiled.compile_count == 1
    assert holder.scheduler.last_epoch == ref_holder.scheduler.last_epoch == 3
    assert optim.param_groups[0]["lr"] == ref_optim.param_groups[0]["lr"]


def test_scheduler_reached_through_a_closure_objects_attribute_is_refused(classification_batches):
    outer = Holder(None)  # the step names `outer`, a closure variable; its attribute is not searched

    def held(model, optim, x, y):
        return step_then_schedule(model, optim, outer.scheduler, x, y)

    def args_of(model, optim, scheduler):
        outer.scheduler = scheduler
        return model, optim

    text, _, _ = _refusal(held, args_of, classification_batches)
    assert "reaches only through another object" in text


def test_step_reading_the_schedulers_epoch_is_refused(classification_batches):
    def warm(model, optim, scheduler, x, y):
        loss = nn.functional.cross_entropy(model(x), y)
        if scheduler.last_epoch < 2:
            loss = loss * 0.5
        loss.backward()
        optim.step()
        scheduler.step()
        return loss

    text, _, _ = _refusal(warm, lambda m, o, s: (m, o, s), classification_batches)
    assert "reads scheduler attribute(s) ['last_epoch']" in text


def test_restarted_step_with_a_scheduler_inside_still_steps_it(tmp_path, classification_batches):
    """A cached program must not lose the replays: the second compiled step (a restarted
    job) captures again (no entry before capture) and loads the program."""
    lrs = []
    for _ in range(2):
        torch.manual_seed(0)
        model = mlp()
        optim = OPTIMIZERS["adamw"](model)
        scheduler = SCHEDULERS["lambda"](optim)
        compiled = sc.compile(cache_dir=tmp_path)(step_then_schedule)
        with sc.simulate(world_size=2):
            for x, y in classification_batches(3):
                compiled(model, optim, scheduler, x, y)
        lrs.append(optim.param_groups[0]["lr"])
        assert scheduler.last_epoch == 3
    # one program, its optimizer state made first: a step with no key before capture
    # (NOTE: [optimizer state made before the first program]; two before 2026-12-03)
    assert [r.cache for r in compiled.records] == ["hit"]
    assert lrs[0] == lrs[1] == pytest.approx(2e-2 / 4)


ONE_CYCLE = {
    "adamw": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-2, total_steps=10),
    "sgd_momentum": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.2, total_steps=10),
}


@pytest.mark.parametrize("mode", ["replicate", "fully_shard"])
@pytest.mark.parametrize("in_step", [True, False], ids=["in_step", "between_calls"])
def test_one_cycle_cycling_adams_beta1_compiles_once(run_parity, classification_batches, mode, in_step):
    """NOTE: [Adam's beta1 as a graph input] in capture/bindings.py: OneCycleLR's default
    ``cycle_momentum`` changes AdamW's ``betas[0]`` every step; it is read as an input like
    the learning rate, so one program serves every call (before: one program per call)
    and the updates are eager's."""
    from spmd_compiler.parallel_modes import DataParallel

    result = run_parity(
        lambda: mlp().double(),
        OPTIMIZERS["adamw"],
        2,
        classification_batches(STEPS, dtype=torch.float64),
        make_scheduler=ONE_CYCLE["adamw"],
        mode=DataParallel(mode),
        **({"step": step_then_schedule, "scheduler_in_step": True} if in_step else {}),
    )
    result.assert_close(1e-12)
    assert result.compile_counts == [1] * STEPS
    betas = result.optimizer.param_groups[0]["betas"]
    assert betas == result.reference_optimizer.param_groups[0]["betas"] and betas[0] != 0.95


SGDS = {
    "momentum": {"momentum": 0.9},
    "nesterov": {"momentum": 0.9, "nesterov": True},
    "dampening_decay_maximize": {"momentum": 0.9, "dampening": 0.1, "weight_decay": 0.05,
                                 "maximize": True},
}


@pytest.mark.parametrize("mode", ["replicate", "fully_shard"])
@pytest.mark.parametrize("sgd", list(SGDS))
@pytest.mark.parametrize("in_step", [True, False], ids=["in_step", "between_calls"])
def test_one_cycle_cycling_sgd_momentum_compiles_twice(run_parity, classification_batches, mode, sgd, in_step):
    """NOTE: [SGD's momentum as a graph input] in capture/optimizers.py: OneCycleLR's
    default ``cycle_momentum`` (torch's own example: SGD, momentum 0.9) changes SGD's
    momentum every step; it is an input, so the two programs of SGD with momentum (the
    first makes the buffer) serve every call (before: one per call), and the updates
    are eager's."""
    from spmd_compiler.parallel_modes import DataParallel

    result = run_parity(
        lambda: mlp().double(),
        lambda m: torch.optim.SGD(m.parameters(), lr=0.2, **SGDS[sgd]),
        2,
        classification_batches(STEPS, dtype=torch.float64),
        make_scheduler=ONE_CYCLE["sgd_momentum"],
        mode=DataParallel(mode),
        **({"step": step_then_schedule, "scheduler_in_step": True} if in_step else {}),
    )
    result.assert_close(1e-12)
    assert result.compile_counts == PROGRAMS["sgd_momentum"]
    momentum = result.optimizer.param_groups[0]["momentum"]
    assert momentum == result.reference_optimizer.param_groups[0]["momentum"] != 0.9


def _logs_momentum(model, optim, scheduler, x, y):
    loss = nn.functional.cross_entropy(model(x), y)
    scaled = loss.detach() * optim.param_groups[0]["momentum"]
    loss.backward()
    optim.step()
    optim.zero_grad()
    scheduler.step()
    return loss, scaled


def test_momentum_the_step_reads_itself_is_a_setting(classification_batches):
    """NOTE: [SGD's momentum as a graph input]: a step that uses the momentum itself
    (here: scales a returned value by it) would keep the value it was traced with in a
    program fed the momentum; such a momentum is a setting of the program instead, a
    program per value, and every value returned is eager's."""
    torch.manual_seed(0)
    model = mlp().double()
    reference = copy.deepcopy(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    reference_optim = torch.optim.SGD(reference.parameters(), lr=0.2, momentum=0.9)
    scheduler = ONE_CYCLE["sgd_momentum"](optim)
    reference_scheduler = ONE_CYCLE["sgd_momentum"](reference_optim)
    compiled = sc.compile()(_logs_momentum)
    with sc.simulate(world_size=2):
        for x, y in classification_batches(4, dtype=torch.float64):
            loss, scaled = compiled(model, optim, scheduler, x, y)
            expected_loss, expected_scaled = _logs_momentum(reference, reference_optim, reference_scheduler, x, y)
            assert torch.allclose(loss, expected_loss, rtol=1e-12, atol=0)
            assert torch.allclose(scaled, expected_scaled, rtol=1e-12, atol=0)
    assert compiled.compile_count == 4
    state = sc.checkpoint.full_state_dict(model, optim)
    for name, value in reference.state_dict().items():
        assert torch.allclose(state["model"][name], value, rtol=1e-12, atol=1e-15), name


def test_reading_the_momentum_after_the_scheduler_stepped_is_refused(classification_batches):
    """Eager reads the momentum OneCycleLR just set; the program would read the one from
    before the scheduler's step, which the runtime replays after the call."""
    def logged_step(model, optim, scheduler, x, y):
        loss = step_then_schedule(model, optim, scheduler, x, y)
        return loss, loss.detach() * optim.param_groups[0]["momentum"]

    model = mlp()
    optim = OPTIMIZERS["sgd_momentum"](model)
    scheduler = ONE_CYCLE["sgd_momentum"](optim)
    with sc.simulate(world_size=2), pytest.raises(sc.SPMDCompileError) as refused:
        sc.compile()(logged_step)(model, optim, scheduler, *classification_batches(1)[0])
    text = str(refused.value)
    assert "reads param_group['momentum'] after scheduler.step()" in text
    assert 'optim.param_groups[0]["momentum"]' in text
    assert scheduler.last_epoch == 0


def test_momentum_set_from_zero_compiles_its_program(classification_batches, train_step):
    """Momentum is an input only while it is not 0 (``if momentum != 0`` in torch's SGD
    decides whether there is a buffer at all): 0 -> 0.5 -> 0.7 by hand compiles for the
    first change, not the second, and matches eager."""
    torch.manual_seed(0)
    model = mlp().double()
    reference = copy.deepcopy(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    reference_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
    step = train_step
    compiled = sc.compile()(step)
    counts = []
    with sc.simulate(world_size=2):
        for i, (x, y) in enumerate(classification_batches(5, dtype=torch.float64)):
            for opt in (optim, reference_optim):
                opt.param_groups[0]["momentum"] = [0.0, 0.5, 0.5, 0.7, 0.7][i]
            loss = compiled(model, optim, x, y)
            assert torch.allclose(loss, step(reference, reference_optim, x, y), rtol=1e-12, atol=0)
            counts.append(compiled.compile_count)
    # 0: one program; 0.5: the buffer's first program, then the steady one; 0.7: no new one
    assert counts == [1, 2, 3, 3, 3]
    state = sc.checkpoint.full_state_dict(model, optim)
    for name, value in reference.state_dict().items():
        assert torch.allclose(state["model"][name], value, rtol=1e-12, atol=1e-15), name


def test_a_schedule_cycling_momentum_names_the_setting_it_recompiles_for(
    classification_batches, caplog
):
    """Of the momentum settings, only Adam's and AdamW's first beta and SGD's momentum are
    graph inputs: OneCycleLR cycling NAdam's first beta compiles a program per call.
    That must not be silent: each recompile names the setting, and the third says what
    to do."""
    model = mlp()
    optim = torch.optim.NAdam(model.parameters(), lr=1e-2)
    scheduler = ONE_CYCLE["adamw"](optim)
    compiled = sc.compile()(step_then_schedule)
    with caplog.at_level(logging.INFO, logger="spmd_compiler"), sc.simulate(world_size=2):
        for x, y in classification_batches(5):
            compiled(model, optim, scheduler, x, y)
    assert compiled.compile_count == 5
    messages = [r.getMessage() for r in caplog.records]
    assert any("recompiling step_then_schedule: optimizer[0].param_groups[0]['betas'] was" in m
               for m in messages)
    assert any("changed on 3 calls" in m and "cycle_momentum=False" in m for m in messages)


def _twins(optimizer: str) -> tuple:
    """A float64 MLP and its eager copy, each with its optimizer and LambdaLR schedule."""
    torch.manual_seed(0)
    model = mlp().double()
    reference = copy.deepcopy(model)
    optim, reference_optim = OPTIMIZERS[optimizer](model), OPTIMIZERS[optimizer](reference)
    scheduler, reference_scheduler = (SCHEDULERS["lambda"](o) for o in (optim, reference_optim))
    return model, reference, optim, reference_optim, scheduler, reference_scheduler


def _same_loss(compiled, step, twins: tuple, x: torch.Tensor, y: torch.Tensor) -> None:
    """One call of ``compiled`` on the model of ``_twins`` and of ``step`` on its eager copy."""
    model, reference, optim, reference_optim, scheduler, reference_scheduler = twins
    loss = compiled(model, optim, scheduler, x, y)
    assert torch.allclose(loss, step(reference, reference_optim, reference_scheduler, x, y), rtol=1e-12, atol=0)


@pytest.mark.parametrize("mode", ["replicate", "fully_shard"])
@pytest.mark.parametrize("before", [False, True], ids=["after_step", "before_step"])
def test_a_scheduler_in_a_branch_the_call_skipped_is_not_stepped(classification_batches, mode, before):
    """The replay follows the way the call took: a non-finite batch skips the update and
    its scheduler step, as eagerly. Before, the first program's scheduler steps were
    replayed whichever way the `if` went (one epoch ahead per skipped batch, parameters
    3e-2 off after 6 calls, silently); a scheduler stepped before the update is set back
    when its program turns out to be the wrong way."""
    from spmd_compiler.parallel_modes import DataParallel

    def step(model, optim, scheduler, x, y):
        loss = nn.functional.cross_entropy(model(x), y)
        if torch.isfinite(loss):
            if before:
                scheduler.step()
            loss.backward()
            optim.step()
            if not before:
                scheduler.step()
            optim.zero_grad()
        return loss

    model, reference, optim, reference_optim, scheduler, reference_scheduler = _twins("adamw")
    batches = classification_batches(6, dtype=torch.float64)
    batches[2] = (torch.full_like(batches[2][0], float("nan")), batches[2][1])
    compiled = sc.compile(parallel_mode=DataParallel(mode))(step)
    with sc.simulate(world_size=2):
        for x, y in batches:
            compiled(model, optim, scheduler, x, y)
            step(reference, reference_optim, reference_scheduler, x, y)
            assert scheduler.last_epoch == reference_scheduler.last_epoch  # after every call
        state = sc.checkpoint.full_state_dict(model, optim)
    assert scheduler.last_epoch == 5
    assert optim.param_groups[0]["lr"] == reference_optim.param_groups[0]["lr"]
    for name, value in reference.state_dict().items():
        assert torch.allclose(state["model"][name], value, rtol=1e-12, atol=1e-15), name


def test_a_scheduler_stepped_only_by_the_updating_way_compiles_no_more(classification_batches):
    """Gradient accumulation with the scheduler in the branch that updates: the program of
    the accumulating way does not step it, and guarded its ``last_epoch`` as a value,
    which the other way changes every update: a program per update. Now such a scheduler
    is guarded by the names the code reads: 4 programs (each way before and after the
    first update made the momentum buffer), none after the fourth call; parity with
    eager."""
    def step(model, optim, scheduler, x, y, update):
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if update:
            optim.step()
            scheduler.step()
            optim.zero_grad()
        return loss

    model, reference, optim, reference_optim, scheduler, reference_scheduler = _twins("sgd_momentum")
    compiled = sc.compile()(step)
    counts = []
    with sc.simulate(world_size=2):
        for i, (x, y) in enumerate(classification_batches(10, dtype=torch.float64)):
            update = i % 2 == 1
            compiled(model, optim, scheduler, x, y, update)
            step(reference, reference_optim, reference_scheduler, x, y, update)
            counts.append(compiled.compile_count)
        state = sc.checkpoint.full_state_dict(model, optim)
    assert counts == [1, 2, 3, 4, 4, 4, 4, 4, 4, 4]  # before: one more per update
    assert scheduler.last_epoch == reference_scheduler.last_epoch == 5
    for name, value in reference.state_dict().items():
        assert torch.allclose(state["model"][name], value, rtol=1e-12, atol=1e-15), name


def test_a_scheduler_attribute_the_step_reads_is_still_guarded(classification_batches):
    """A scheduler the step does not step but whose ``last_epoch`` it reads (stepped
    between calls): a new value is a new program, as before."""
    def step(model, optim, scheduler, x, y):
        loss = nn.functional.cross_entropy(model(x), y) / (1 + scheduler.last_epoch)
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    model, reference, optim, reference_optim, scheduler, reference_scheduler = twins = _twins("adamw")
    compiled = sc.compile()(step)
    with sc.simulate(world_size=2):
        for x, y in classification_batches(3, dtype=torch.float64):
            _same_loss(compiled, step, twins, x, y)
            scheduler.step()
            reference_scheduler.step()
    assert compiled.compile_count == 3


def test_a_scheduler_stepped_twice_in_the_step_is_replayed_twice(classification_batches):
    """Refused before, with a message about the learning rate changing inside the step:
    the second step wrapped the first's stand-in of the rate again."""
    def step(model, optim, scheduler, x, y):
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optim.step()
        scheduler.step()
        scheduler.step()
        optim.zero_grad()
        return loss

    model, reference, optim, reference_optim, scheduler, reference_scheduler = twins = _twins("adamw")
    compiled = sc.compile()(step)
    with sc.simulate(world_size=2):
        for x, y in classification_batches(3, dtype=torch.float64):
            _same_loss(compiled, step, twins, x, y)
    assert scheduler.last_epoch == reference_scheduler.last_epoch == 6
    assert optim.param_groups[0]["lr"] == reference_optim.param_groups[0]["lr"]
    assert compiled.compile_count == 1


class _SqrtLR(torch.optim.Optimizer):
    """A custom optimizer doing Python arithmetic on its learning rate."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            step_size = math.sqrt(group["lr"]) * 0.3
            for p in group["params"]:
                p.add_(p.grad, alpha=-step_size)


def test_learning_rate_a_custom_optimizer_reads_in_python_is_a_setting(run_parity, classification_batches):
    """NOTE: [a learning rate read in Python] in capture/optimizers.py: the learning rate
    is a graph input, so `math.sqrt(group["lr"])` read a tensor and the step was refused
    ("reads the value of a tensor in Python inside its step()"); the optimizer's learning
    rates are settings of its programs instead, a program per value, each eager's."""
    result = run_parity(
        lambda: mlp().double(), lambda m: _SqrtLR(m.parameters()), 2,
        classification_batches(STEPS, dtype=torch.float64), make_scheduler=SCHEDULERS["lambda"],
    )
    result.assert_close(1e-13)
    assert result.compile_counts == [1, 2, 3, 4, 5]  # each new learning rate: its program


@pytest.mark.parametrize(
    "make_optimizer, make_scheduler, named",
    [
        (lambda m: _SqrtLR(m.parameters()), SCHEDULERS["lambda"], "learning rate"),
        (
            lambda m: torch.optim.RMSprop(m.parameters(), lr=0.01, momentum=0.9),
            lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=20),
            "momentum",
        ),
    ],
    ids=["lr_read_in_python", "rmsprop_cycled_momentum"],
)
def test_a_scheduler_before_the_step_of_a_setting_it_changes_is_refused(
    run_parity, classification_batches, make_optimizer, make_scheduler, named
):
    """A scheduler stepped before its optimizer's step is recorded, not run, while the
    step is traced: where the value it sets is a setting of the program (a learning rate
    the optimizer reads in Python; RMSprop's momentum, cycled by OneCycleLR), the program
    held the value from before its step, and every call updated with the previous
    call's (the review measured 0.157 relative off with the LambdaLR, 0.22 with
    RMSprop's momentum, silently). Refused, naming the setting; after the optimizer's
    step the same schedule matches eager."""
    model = mlp().double()
    optim = make_optimizer(model)
    scheduler = make_scheduler(optim)
    before = copy.deepcopy(model.state_dict()), optim.param_groups[0]["lr"]
    x, y = classification_batches(1, dtype=torch.float64)[0]
    compiled = sc.compile()(schedule_then_step)
    with sc.simulate(world_size=2), pytest.raises(sc.SPMDCompileError) as info:
        compiled(model, optim, scheduler, x, y)
    text = str(info.value)
    assert f"optimizer[0]'s {named} is a setting of the program" in text
    assert "runs before optimizer[0].step()" in text and "scheduler.step()" in text
    assert scheduler.last_epoch == 0 and optim.param_groups[0]["lr"] == before[1] and not optim.state
    assert all(torch.equal(v, before[0][k]) for k, v in model.state_dict().items())
    run_parity(
        lambda: mlp().double(), make_optimizer, 2, classification_batches(STEPS, dtype=torch.float64),
        step=step_then_schedule, make_scheduler=make_scheduler, scheduler_in_step=True,
    ).assert_close(1e-13)


class _ForeachMomentum(torch.optim.Optimizer):
    """A custom optimizer giving its learning rate to foreach ops' Scalar arguments."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            params = list(group["params"])
            for p in params:
                if not self.state[p]:
                    self.state[p]["m"] = torch.zeros_like(p)
                    self.state[p]["v"] = torch.ones_like(p)
            ms = [self.state[p]["m"] for p in params]
            vs = [self.state[p]["v"] for p in params]
            grads = [p.grad for p in params]
            torch._foreach_lerp_(ms, grads, group["lr"])
            torch._foreach_addcmul_(vs, grads, grads, value=group["lr"])
            torch._foreach_addcdiv_(params, ms, vs, value=-group["lr"])
            torch._foreach_add_(params, grads, alpha=-group["lr"])


def test_foreach_ops_given_the_learning_rate_keep_it_an_input(run_parity, classification_batches):
    """`torch._foreach_add_(params, updates, alpha=-group["lr"])` (and addcmul / addcdiv's
    value) read the learning rate's tensor as a Scalar and were refused;
    they compute per tensor with the learning rate a graph input (NOTE: [a learning rate
    read in Python]): one program through the schedule, eager's numbers."""
    result = run_parity(
        lambda: mlp().double(), lambda m: _ForeachMomentum(m.parameters()), 2,
        classification_batches(STEPS, dtype=torch.float64), make_scheduler=SCHEDULERS["lambda"],
    )
    result.assert_close(1e-13)
    assert result.compile_counts[-1] == 1


class _RenormLR(_ForeachMomentum):
    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                update = p.grad.renorm(2, 0, group["lr"]) if p.ndim == 2 else p.grad  # a Scalar maxnorm
                p.sub_(update)


def test_an_op_taking_the_learning_rate_as_a_scalar_makes_it_a_setting(run_parity, classification_batches):
    """torch's argument parser refuses the learning rate's traced tensor for `renorm`'s
    Scalar maxnorm (a TypeError before any rule sees the call; without grad, a read of
    its value): the learning rates become settings (NOTE: [a learning rate read in
    Python]), a program per value, eager's numbers."""
    result = run_parity(
        lambda: mlp().double(), lambda m: _RenormLR(m.parameters(), lr=0.01), 2,
        classification_batches(3, dtype=torch.float64), make_scheduler=SCHEDULERS["lambda"],
    )
    result.assert_close(1e-13)
    assert result.compile_counts == [1, 2, 3]


class _DecayingWeightDecay(torch.optim.lr_scheduler.LRScheduler):
    """A user's schedule that sets the weight decay beside the learning rate."""

    def get_lr(self) -> list[float]:
        for group in self.optimizer.param_groups:
            group["weight_decay"] = 0.1 * (1 + self.last_epoch)
        return [group["initial_lr"] / (1 + self.last_epoch) for group in self.optimizer.param_groups]


def test_a_user_scheduler_before_the_step_changing_a_setting_is_refused(run_parity, classification_batches):
    """NOTE: [settings a scheduler changes before the update]: a user's LRScheduler that
    sets the weight decay, stepped before the optimizer's step, trained with the weight
    decay of the call before (6e-3 relative off after 4 AdamW calls, no sign). Refused at
    the call, naming the setting, the schedule and model as they were; stepped after the
    optimizer's step it matches eager (a program per weight decay)."""
    model = mlp().double()
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = _DecayingWeightDecay(optim)
    before = copy.deepcopy(model.state_dict())
    x, y = classification_batches(1, dtype=torch.float64)[0]
    compiled = sc.compile()(schedule_then_step)
    with sc.simulate(world_size=2), pytest.raises(sc.SPMDCompileError) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "lr_scheduler.step() before optimizer.step()"
        compiled(model, optim, scheduler, x, y)
    text = str(info.value)
    assert "_DecayingWeightDecay.step()" in text and "ran before the optimizer's step" in text
    assert "changed optimizer[0].param_groups[0]['weight_decay'] from 0.1 to 0.2" in text
    assert scheduler.last_epoch == 0 and optim.param_groups[0]["weight_decay"] == 0.1 and not optim.state
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    run_parity(
        lambda: mlp().double(), lambda m: torch.optim.AdamW(m.parameters(), lr=0.05), 2,
        classification_batches(3, dtype=torch.float64), step=step_then_schedule,
        make_scheduler=_DecayingWeightDecay, scheduler_in_step=True,
    ).assert_close(1e-13)
