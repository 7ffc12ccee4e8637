"""Tensors a step stores in Python objects (NOTE: [tensors the step keeps]) and the
Python effects that run once at capture (NOTE: [Python effects at capture]).

Each kept value is compared after every call with what the undecorated step stores on
one device on the global batch (float64, within 1e-12): appended to a global list
(tensors and ``.item()`` numbers), set as a module attribute in ``forward``, written by a
forward hook into a global dict, set on an object argument, and written into a dict
argument. Refused places leave no traced tensor behind.
"""

from __future__ import annotations

import copy
import functools
import logging
import random
import threading
import time
import types

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.optim.optimizer import register_optimizer_step_pre_hook

import spmd_compiler as sc
from spmd_compiler.capture import python_effects
from spmd_compiler.errors import SPMDCompileError
from spmd_compiler.parallel_modes import make_mode

TOL = 1e-12
BATCH, FEATURES, CLASSES = 8, 8, 4


class _Stashing(nn.Module):
    """Keeps its hidden activation and an auxiliary loss as plain attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(FEATURES, 16), nn.Linear(16, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.gelu(self.a(x))
        self.last_hidden = hidden.detach()
        self.aux_loss = hidden.pow(2).mean()
        return self.b(hidden)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return _Stashing().double()


def _batches(n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(BATCH, FEATURES, generator=gen, dtype=torch.float64),
         torch.randint(0, CLASSES, (BATCH,), generator=gen))
        for _ in range(n)
    ]


def _update(model, optim, loss):  # noqa: ANN001
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


history: list = []
activations: dict = {}


def appending_step(model, optim, x, y):  # noqa: ANN001
    loss = _update(model, optim, F.cross_entropy(model(x), y))
    history.append(loss.detach())
    history.append(loss.item())
    return loss


def aux_loss_step(model, optim, x, y):  # noqa: ANN001
    logits = model(x)
    return _update(model, optim, F.cross_entropy(logits, y) + 0.1 * model.aux_loss)


class _Logger:
    def __init__(self) -> None:
        self.last = None


def logging_step(model, optim, x, y, logger, out):  # noqa: ANN001
    loss = _update(model, optim, F.cross_entropy(model(x), y))
    logger.last = loss.detach()
    out["hidden_norm"] = model.last_hidden.norm()
    return loss


def _mode(name: str):  # noqa: ANN202
    if name == "tp":  # the hidden activation is sharded on its features
        return make_mode("tp", plan={"a": ColwiseParallel(), "b": RowwiseParallel()})
    return make_mode(name)


def _pair():
    model = _model()
    reference = copy.deepcopy(model)
    return (model, torch.optim.AdamW(model.parameters(), lr=1e-2),
            reference, torch.optim.AdamW(reference.parameters(), lr=1e-2))


def _close(a, b) -> bool:  # noqa: ANN001
    if isinstance(b, torch.Tensor):
        assert type(a) is torch.Tensor, f"a {type(a).__name__}, not a plain tensor"
        return a.shape == b.shape and torch.allclose(a, b, rtol=TOL, atol=TOL)
    return type(a) is type(b) and abs(a - b) <= TOL * max(1.0, abs(b))


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_appends_to_a_global_list_every_call(mode):
    model, optim, reference, ref_optim = _pair()
    step = sc.compile(_mode(mode))(appending_step)
    history.clear()
    with sc.simulate(world_size=2):
        for x, y in _batches():
            step(model, optim, x, y)
    compiled = list(history)
    history.clear()
    for x, y in _batches():
        appending_step(reference, ref_optim, x, y)
    assert len(compiled) == len(history) == 6
    assert all(_close(a, b) for a, b in zip(compiled, history))
    assert step.compile_count == 2  # the first program and the steady state: no recompile


@pytest.mark.parametrize("mode", ["ddp", "fsdp", "tp"])
def test_module_attributes_set_in_forward_hold_each_calls_value(mode):
    model, optim, reference, ref_optim = _pair()
    step = sc.compile(_mode(mode))(aux_loss_step)
    with sc.simulate(world_size=2):
        for x, y in _batches():
            loss = step(model, optim, x, y)
            expected = aux_loss_step(reference, ref_optim, x, y)
            assert torch.allclose(loss, expected, rtol=TOL, atol=TOL)
            # the global (B, 16) activation, not a rank's share and not a fake tensor
            assert _close(model.last_hidden, reference.last_hidden)
            assert _close(model.aux_loss, reference.aux_loss.detach())
    assert step.compile_count == 2


def test_forward_hook_into_a_global_dict():
    model, optim, reference, ref_optim = _pair()
    for m in (model, reference):
        m.a.register_forward_hook(lambda mod, args, out: activations.__setitem__("a", out.detach()))
    step = sc.compile(make_mode("ddp"))(aux_loss_step)
    with sc.simulate(world_size=2):
        for x, y in _batches():
            step(model, optim, x, y)
            compiled = activations.pop("a")
            aux_loss_step(reference, ref_optim, x, y)
            assert _close(compiled, activations.pop("a"))


def test_object_and_dict_arguments():
    """An object argument's attribute and a dict argument's entry (the step sees a copy of
    the dict; the value lands in the caller's)."""
    model, optim, reference, ref_optim = _pair()
    step = sc.compile(make_mode("fsdp"))(logging_step)
    with sc.simulate(world_size=2):
        for x, y in _batches():
            logger, ref_logger, out, ref_out = _Logger(), _Logger(), {}, {}
            step(model, optim, x, y, logger, out)
            logging_step(reference, ref_optim, x, y, ref_logger, ref_out)
            assert _close(logger.last, ref_logger.last)
            assert _close(out["hidden_norm"], ref_out["hidden_norm"])


def _plain_step(model, optim, x, y):  # noqa: ANN001
    return _update(model, optim, F.cross_entropy(model(x), y))


def _reordering_step(model, optim, x, y):  # noqa: ANN001
    loss = _update(model, optim, F.cross_entropy(model(x), y))
    history.insert(0, loss.detach())
    return loss


class _TupleState(_Stashing):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.gelu(self.a(x))
        self.state = (hidden.detach(), [hidden.sum()])  # a list inside: not replayed
        return self.b(hidden)


class _Pyramid(_Stashing):
    """Containers of activations built in ``forward``: a list grown by appends and read
    back before the forward ends (as torchvision RAFT's ``corr_pyramid``), a tuple and a
    dict; the last two also as entries of a dict the module holds."""

    def __init__(self) -> None:
        super().__init__()
        self.b = nn.Linear(16 * 3, CLASSES)
        self.store: dict = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.gelu(self.a(x))
        self.pyramid = [hidden]
        for _ in range(2):
            self.pyramid.append(self.pyramid[-1] * 0.5 + 1)
        self.pair = (hidden.mean(), hidden.amax())
        self.store["maps"] = {"first": hidden.detach(), "norm": hidden.norm()}
        return self.b(torch.cat(self.pyramid, -1))


def _containers(model: nn.Module) -> list:
    return [*model.pyramid, *model.pair, *model.store["maps"].values()]


@pytest.mark.parametrize("mode", ["ddp", "fsdp", "tp"])
def test_containers_of_tensors_set_in_forward_are_remade_every_call(mode):
    torch.manual_seed(0)
    model = _Pyramid().double()
    reference = copy.deepcopy(model)
    optim, ref_optim = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference))
    step = sc.compile(_mode(mode))(_plain_step)
    lists = []
    with sc.simulate(world_size=2):
        for x, y in _batches():
            loss = step(model, optim, x, y)
            expected = _plain_step(reference, ref_optim, x, y)
            assert torch.allclose(loss, expected, rtol=TOL, atol=TOL)
            lists.append(model.pyramid)
            assert type(model.pyramid) is list and type(model.pair) is tuple
            assert list(model.store["maps"]) == ["first", "norm"]
            got, want = _containers(model), _containers(reference)
            assert len(got) == len(want) == 7
            assert all(_close(a, b.detach()) for a, b in zip(got, want))
    assert step.compile_count == 2
    assert len({id(lst) for lst in lists}) == len(lists)  # a new list each call, as the step makes


def test_places_that_cannot_be_replayed_are_refused_and_left_clean():
    model, optim, _, _ = _pair()
    history[:] = ["kept"]
    step = sc.compile(make_mode("ddp"))(_reordering_step)
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError, match="global 'history'"):
        step(model, optim, *_batches(1)[0])
    assert history == ["kept"]  # no fake tensor left behind

    torch.manual_seed(0)
    model = _TupleState().double()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    step = sc.compile(make_mode("ddp"))(_plain_step)
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError, match=r"state \(a new tuple") as err:
        step(model, optim, *_batches(1)[0])
    assert "state" not in vars(model)
    assert "del <owner>.state" in str(err.value)  # the way out for a cache the forward reads back
    history.clear()


def _reseeding_step(model, optim, x, y):  # noqa: ANN001
    torch.manual_seed(123)
    return _update(model, optim, F.cross_entropy(F.dropout(model(x), 0.5), y))


def _own_generator_step(model, optim, x, y):  # noqa: ANN001
    gen = torch.Generator().manual_seed(5)
    noise = torch.randn(x.shape, generator=gen, dtype=x.dtype)
    return _update(model, optim, F.cross_entropy(model(x + 0.1 * noise), y))


@pytest.mark.parametrize(
    "step_fn,message",
    [(_reseeding_step, r"torch\.manual_seed\(\)"), (_own_generator_step, "own torch.Generator")],
)
def test_reseeding_and_own_generators_are_refused(step_fn, message):
    """Eager reseeds every call; a program would reseed once, at capture."""
    model, optim, _, _ = _pair()
    state = torch.get_rng_state()
    step = sc.compile(make_mode("ddp"))(step_fn)
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError, match=message) as raised:
        step(model, optim, *_batches(1)[0])
    assert "test_kept_tensors.py" in str(raised.value)  # the user's line
    assert torch.equal(torch.get_rng_state(), state)


def _python_random_step(model, optim, x, y):  # noqa: ANN001
    scale = random.uniform(0.5, 1.0)
    return _update(model, optim, scale * F.cross_entropy(model(x), y))


def _numpy_mixup_step(model, optim, x, y):  # noqa: ANN001
    lam = float(np.random.beta(1.0, 1.0))
    perm = torch.randperm(x.size(0))
    out = model(lam * x + (1 - lam) * x[perm])
    return _update(model, optim, lam * F.cross_entropy(out, y) + (1 - lam) * F.cross_entropy(out, y[perm]))


def _imported_draw_step(model, optim, x, y):  # noqa: ANN001
    return _update(model, optim, _draw() * F.cross_entropy(model(x), y))


_draw = random.Random.random.__get__(random._inst)  # type: ignore[attr-defined] # a reference no patch reaches


@pytest.mark.parametrize(
    "step_fn,line",
    [(_python_random_step, True), (_numpy_mixup_step, True), (_imported_draw_step, False)],
    ids=["random.uniform", "np.random.beta", "other_reference"],
)
def test_host_random_draws_are_refused(step_fn, line, monkeypatch):
    """NOTE: [host random numbers at capture]: drawn once at capture, the number would be
    reused by every call (a mixup weight, silently, before)."""
    # threads an earlier test left (an Inductor compile pool) would turn the state check
    # off; the case with another thread drawing is the next test
    monkeypatch.setattr(python_effects, "_other_threads", lambda: False)
    model, optim, _, _ = _pair()
    python_state, numpy_state = random.getstate(), np.random.get_state()
    step = sc.compile(make_mode("ddp"))(step_fn)
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError, match="random numbers? from") as raised:
        step(model, optim, *_batches(1)[0])
    assert ("test_kept_tensors.py" in str(raised.value)) == line  # the user's line where seen
    # the hint named torch.distributions.Beta(a, a).sample(), itself refused (its
    # _sample_dirichlet reads a tensor); it says to draw outside and pass a 0-d tensor
    assert "Beta" not in str(raised.value) and "0-d tensor argument" in str(raised.value)
    assert random.getstate() == python_state
    assert all(np.array_equal(a, b) for a, b in zip(np.random.get_state()[1:2], numpy_state[1:2]))


def test_host_random_draws_of_other_threads_go_through():
    """A data-loading thread drawing from Python's random module while a step compiles is
    neither refused nor rewound."""
    model, optim, _, _ = _pair()
    stop, drawn = threading.Event(), []

    def augment() -> None:
        while not stop.is_set():
            drawn.append(random.random())
            time.sleep(0.001)

    worker = threading.Thread(target=augment)
    worker.start()
    try:
        step = sc.compile(make_mode("ddp"))(_plain_step)
        with sc.simulate(world_size=2):
            step(model, optim, *_batches(1)[0])
    finally:
        stop.set()
        worker.join()
    assert len(drawn) > 0 and len(set(drawn)) == len(drawn)  # fresh numbers throughout


def _printing_step(model, optim, x, y):  # noqa: ANN001
    loss = _update(model, optim, F.cross_entropy(model(x), y))
    print("loss", loss)  # noqa: T201 - the pattern under test
    print("plain", 3)  # noqa: T201
    return loss


def test_print_of_a_traced_value_warns_once(caplog, capsys):
    model, optim, _, _ = _pair()
    step = sc.compile(make_mode("ddp"))(_printing_step)
    with caplog.at_level(logging.WARNING, logger="spmd_compiler"), sc.simulate(world_size=2):
        for x, y in _batches():
            step(model, optim, x, y)
    warnings = [r.getMessage() for r in caplog.records if "print() at" in r.getMessage()]
    traced = [w for w in warnings if "shows a tensor" in w]
    assert len(traced) == 1 and "test_kept_tensors.py" in traced[0]
    # a print of Python values prints at capture, once, and says later calls will not
    # (before the fifty-fourth session it said nothing)
    once = [w for w in warnings if "runs while the step is traced" in w]
    assert len(once) == 1 and "test_kept_tensors.py" in once[0] and 'print("plain", 3)' in once[0], warnings
    printed = capsys.readouterr().out
    assert "FakeTensor" not in printed and "plain 3" in printed


def test_a_wrong_shape_batch_is_one_clean_error(caplog):
    """A batch of the wrong width: before, torch's 21-line E-level log of the failed meta
    kernel came first (NOTE: [torch's log of a failed meta kernel]), and its traceback
    printing (stdlib print) was warned about as a print of the step."""
    import io
    import traceback

    def step(model, optim, x, y):  # noqa: ANN001
        traceback.print_stack(file=io.StringIO())  # the stdlib prints, not the step
        return _plain_step(model, optim, x, y)

    model, optim, _, _ = _pair()
    compiled = sc.compile(make_mode("ddp"))(step)
    (x, y), (x2, y2) = _batches(2)
    with caplog.at_level(logging.DEBUG), sc.simulate(world_size=2):
        compiled(model, optim, x, y)
        with pytest.raises(SPMDCompileError, match="Capturing the train step failed"):
            compiled(model, optim, x2[:, :3], y2)
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "failed while attempting to run meta" in m], messages
    assert not [m for m in messages if "print() at" in m], messages


class _Router(nn.Module):
    """SwitchTransformers' router: converts its classifier to its own dtype in forward."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.classifier = nn.Linear(FEATURES, CLASSES)
        self.register_buffer("scale", torch.ones(CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.classifier = self.classifier.to(self.dtype)
        return self.classifier(x.to(self.dtype)).to(x.dtype) * self.scale.double()


def test_a_module_converted_to_its_own_dtype_in_forward_trains_as_eager():
    """``module.to(dtype)`` that changes nothing does nothing (NOTE: [Python effects at
    capture]); it made the trace fail swapping the traced parameters."""
    torch.manual_seed(0)
    model = _Router(torch.float64).double()
    reference = copy.deepcopy(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference_optim = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    step = sc.compile(make_mode("ddp"))(_plain_step)
    with sc.simulate(world_size=2) as sim:
        for x, y in _batches():
            assert _close(step(model, optim, x, y), _plain_step(reference, reference_optim, x, y))
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert torch.allclose(sim.full_tensor(p), q, rtol=TOL, atol=TOL), name
        assert model.classifier.weight.dtype == torch.float64


def test_a_module_conversion_that_changes_a_dtype_is_refused():
    torch.manual_seed(0)
    model = nn.Sequential(_Router(torch.float32)).double()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    step = sc.compile(make_mode("ddp"))(_plain_step)
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError, match="converts a module") as raised:
        step(model, optim, *_batches(1)[0])
    text = str(raised.value)
    assert "Linear.weight" in text and "torch.float64" in text and "torch.float32" in text
    assert "test_kept_tensors.py" in text  # the forward's line
    assert raised.value.module_fqn == "0"  # the module whose forward converts
    for n, p in model.named_parameters():  # the model is untouched
        assert p.dtype == torch.float64 and torch.equal(p, before[n]), n


# -- what optimizer hooks, an optimizer's own step() and torch's global hooks keep -------
def _grad_norm(optim) -> torch.Tensor:  # noqa: ANN001
    return torch.stack([p.grad.norm() for g in optim.param_groups for p in g["params"]]).norm()


class _LoggingSGD(torch.optim.SGD):
    """Stores the gradient norm on itself in its own ``step``."""

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201
        self.last_norm = _grad_norm(self).detach()
        return super().step(closure)


def _logging_setup(kind: str, model: nn.Module) -> tuple[torch.optim.Optimizer, dict, list, list]:
    """An optimizer and what records the values (a dict, a list of norms); ``undo``
    holds the global hooks' handles."""
    log: dict = {}
    norms: list = []
    undo: list = []
    if kind == "custom_step":
        optim: torch.optim.Optimizer = _LoggingSGD(model.parameters(), lr=0.1)
    else:
        optim = torch.optim.SGD(model.parameters(), lr=0.1)

    def record(o, args, kwargs):  # noqa: ANN001, ANN202
        log["grad_norm"] = _grad_norm(o).detach()
        log["grad_norm_item"] = _grad_norm(o).item()
        norms.append(_grad_norm(o).item())

    if kind == "step_pre_hook":
        optim.register_step_pre_hook(record)
    elif kind == "global_step_pre_hook":
        undo.append(register_optimizer_step_pre_hook(record))
    elif kind == "global_module_hook":
        undo.append(nn.modules.module.register_module_forward_hook(
            lambda m, a, out: log.__setitem__("act_norm", out.detach().norm()) if m is model.a else None
        ))
    return optim, log, norms, undo


@pytest.mark.parametrize("kind", ["step_pre_hook", "global_step_pre_hook", "custom_step", "global_module_hook"])
def test_optimizer_hooks_own_step_and_global_hooks_keep_each_calls_value(kind):
    """Before, these held the capture's FakeTensor / TracedItem after every call (a
    module's own hooks were replayed), and a hook's ``norms.append(norm.item())`` was
    refused as 'changes a Python value every time it runs'."""
    seen = {}
    for compiled in (False, True):
        model = _model()
        optim, log, norms, undo = _logging_setup(kind, model)
        step = sc.compile(make_mode("ddp"))(aux_loss_step) if compiled else aux_loss_step
        values = []
        try:
            with sc.simulate(world_size=2):
                for x, y in _batches():
                    step(model, optim, x, y)
                    values.append(dict(log, last_norm=getattr(optim, "last_norm", None)))
        finally:
            for handle in undo:
                handle.remove()
        seen[compiled] = values, list(norms)
    (eager, eager_norms), (compiled, compiled_norms) = seen[False], seen[True]
    assert len(compiled_norms) == len(eager_norms)
    assert all(_close(a, b) for a, b in zip(compiled_norms, eager_norms))
    for got, expected in zip(compiled, eager):
        assert got.keys() == expected.keys()
        for key, value in expected.items():
            assert (value is None and got[key] is None) or _close(got[key], value), key


class _HookLogger:
    """Keeps what its hooks see on itself (``self.v = norm``)."""

    def __init__(self) -> None:
        self.v = None

    def opt_hook(self, o, args, kwargs):  # noqa: ANN001, ANN201
        self.v = _grad_norm(o).detach()

    def module_hook(self, m, args, out):  # noqa: ANN001, ANN201
        self.v = out.detach().sum()

    def __call__(self, o, args, kwargs):  # noqa: ANN001, ANN204
        self.opt_hook(o, args, kwargs)


_HOOKS_ON_OBJECTS = {
    "bound_method": lambda model, optim, log: optim.register_step_pre_hook(log.opt_hook),
    "partial": lambda model, optim, log: optim.register_step_pre_hook(
        functools.partial(_HookLogger.opt_hook, log)),
    "callable_object": lambda model, optim, log: optim.register_step_pre_hook(log),
    "module_hook_bound_method": lambda model, optim, log: model.a.register_forward_hook(log.module_hook),
}


@pytest.mark.parametrize("kind", list(_HOOKS_ON_OBJECTS))
def test_hooks_bound_to_objects_keep_each_calls_value(kind):
    """A hook that is a bound method, a ``functools.partial`` or an object with
    ``__call__`` (NOTE: [hooks bound to objects]): before, its ``self.v`` held the
    capture's ``FakeTensor`` after every call, silently (eager: 0.638, 0.762, 0.526)."""
    seen = {}
    for compiled in (False, True):
        model = _model()
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        log = _HookLogger()
        _HOOKS_ON_OBJECTS[kind](model, optim, log)
        step = sc.compile(make_mode("ddp"))(_plain_step) if compiled else _plain_step
        values = []
        with sc.simulate(world_size=2):
            for x, y in _batches():
                step(model, optim, x, y)
                values.append(log.v)
        seen[compiled] = values
    assert all(_close(got, expected) for got, expected in zip(seen[True], seen[False], strict=True))


class _LrRecordingSGD(torch.optim.SGD):
    """Records its group's learning rate (a Python float) on itself in its ``step``."""

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201
        self.last_lr = self.param_groups[0]["lr"]
        return super().step(closure)


def _weight_recording_step(model, optim, x, y, w):  # noqa: ANN001, ANN202
    optim.last_w = w
    return _update(model, optim, w * F.cross_entropy(model(x), y))


def test_kept_python_numbers_stay_python_numbers():
    """``opt.last_w = w`` of a float argument and a custom optimizer's ``self.last_lr =
    group["lr"]`` (NOTE: [kept Python numbers]): before, each held a 0-dim float64
    tensor after every call where eager holds a float (0.3, 0.5; 0.1, 0.05)."""
    seen = {}
    for compiled in (False, True):
        model = _model()
        optim = _LrRecordingSGD(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optim, 1, gamma=0.5)
        step = sc.compile(make_mode("ddp"))(_weight_recording_step) if compiled else _weight_recording_step
        values = []
        with sc.simulate(world_size=2):
            for (x, y), w in zip(_batches(), (0.3, 0.5, 0.7), strict=True):
                step(model, optim, x, y, w)
                scheduler.step()
                values.append((optim.last_w, optim.last_lr))
        seen[compiled] = values
    for got, expected in zip(seen[True], seen[False], strict=True):
        assert all(_close(a, b) for a, b in zip(got, expected, strict=True)), (got, expected)


def test_a_hook_that_reads_back_what_it_keeps_is_refused_naming_it():
    """Clipping against the last call's norm kept in a closure dict: before, the program
    traced without ``state["prev"]`` ran on every call (parameters 1.35 relative off
    eager after 4 calls), or the call was refused naming only the step's line."""
    model, _, _, _ = _pair()
    optim = torch.optim.SGD(model.parameters(), lr=0.5)
    state: dict = {}

    def adaptive_clip(o, args, kwargs):  # noqa: ANN001, ANN202
        norm = _grad_norm(o)
        if "prev" in state:
            scale = torch.clamp(0.5 * state["prev"] / norm, max=1.0)
            for g in o.param_groups:
                for p in g["params"]:
                    p.grad.mul_(scale)
        state["prev"] = norm.detach()

    optim.register_step_pre_hook(adaptive_clip)
    step = sc.compile(make_mode("ddp"))(aux_loss_step)
    batches = _batches(2)
    with sc.simulate(world_size=2):
        step(model, optim, *batches[0])
        assert type(state["prev"]) is torch.Tensor
        with pytest.raises(SPMDCompileError, match=r"adaptive_clip .*\['prev'\] back on a later call"):
            step(model, optim, *batches[1])


def test_a_refused_capture_leaves_hooks_and_lists_as_found():
    """A step registering a hook every call is refused; before, the refused call left
    the two hooks its captures registered on ``model.a`` (its output 1.5 ** 2 times
    eager's afterwards). A hook's list of ``.item()`` values is left without the
    capture's placeholders when the step is refused for another reason."""
    model, optim, _, _ = _pair()
    x, y = _batches(1)[0]
    with torch.no_grad():
        before = model(x)

    def registering_step(model, optim, x, y):  # noqa: ANN001, ANN202
        model.a.register_forward_hook(lambda m, a, o: o * 1.5)
        return _plain_step(model, optim, x, y)

    step = sc.compile(make_mode("ddp"))(registering_step)
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError, match="forward hooks"):
        step(model, optim, x, y)
    assert len(model.a._forward_hooks) == 0
    with torch.no_grad():
        assert torch.equal(model(x), before)

    norms: list = []
    optim.register_step_pre_hook(lambda o, a, k: norms.append(_grad_norm(o).item()))
    history[:] = ["kept"]
    step = sc.compile(make_mode("ddp"))(_reordering_step)
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError, match="global 'history'"):
        step(model, optim, x, y)
    assert norms == [] and history == ["kept"]
    history.clear()


_criterion = nn.CrossEntropyLoss()


def test_a_refused_capture_leaves_a_global_modules_hooks_and_flags_as_found():
    """A step registering a forward hook on a module it reads as a global, and one
    registering a full backward hook: before, the refused call left 8 hooks on the
    global criterion (its eager loss 1.376 -> 352.3 afterwards), and
    ``_is_full_backward_hook = True`` on the module, so that a later
    ``register_backward_hook`` raised torch's "Cannot use both regular backward hooks
    and full backward hooks". The refusal says the step registers a hook every call."""
    model, optim, _, _ = _pair()
    x, y = _batches(1)[0]
    with torch.no_grad():
        before = _criterion(model(x), y)

    def criterion_hook_step(model, optim, x, y):  # noqa: ANN001, ANN202
        _criterion.register_forward_hook(lambda m, a, o: o * 2)
        return _update(model, optim, _criterion(model(x), y))

    def backward_hook_step(model, optim, x, y):  # noqa: ANN001, ANN202
        model.a.register_full_backward_hook(lambda m, gi, go: None)
        return _plain_step(model, optim, x, y)

    for fn in (criterion_hook_step, backward_hook_step):
        step = sc.compile(make_mode("ddp"))(fn)
        with sc.simulate(world_size=2), pytest.raises(
            SPMDCompileError, match="registers a hook every time it runs"
        ):
            step(model, optim, x, y)
    assert len(_criterion._forward_hooks) == 0
    with torch.no_grad():
        assert torch.equal(_criterion(model(x), y), before)
    assert len(model.a._backward_hooks) == 0 and model.a._is_full_backward_hook is None
    model.a.register_backward_hook(lambda m, gi, go: None).remove()


# NOTE: [tensors the step keeps]: attributes the step creates on one call and reads
# back on the next (``hasattr`` / ``getattr``). Each step's read-back line ends in
# ``# read back``, which the refusal names.
def _consistency_step(model, optim, x, y):  # noqa: ANN001, ANN202
    out = model(x)
    loss = F.cross_entropy(out, y)
    if hasattr(model, "prev"):
        loss = loss + (out - model.prev).pow(2).mean()  # read back
    model.prev = out.detach()
    return _update(model, optim, loss)


def _norm_scaled_step(model, optim, x, y):  # noqa: ANN001, ANN202
    loss = F.cross_entropy(model(x), y)
    prev = getattr(optim, "prev_norm", None)
    if prev is not None:
        loss = loss * prev  # read back
    _update(model, optim, loss)
    optim.prev_norm = torch.stack([p.detach().norm() for p in model.parameters()]).norm()
    return loss


class _Trainer:
    """Keeps an EMA of the loss on itself, created on the first call."""

    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim = model, optim

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(self.model(x), y)
        ema = getattr(self, "ema", None)
        self.ema = loss.detach() if ema is None else 0.9 * ema + 0.1 * loss.detach()
        return _update(self.model, self.optim, loss * self.ema)


def _trainer_step(trainer, model, optim, x, y):  # noqa: ANN001, ANN202
    return trainer.step(x, y)  # read back


class _Box:
    """A global object a step keeps its last output on."""


_last_output = _Box()


def _global_object_step(model, optim, x, y):  # noqa: ANN001, ANN202
    out = model(x)
    loss = F.cross_entropy(out, y)
    if hasattr(_last_output, "prev"):
        loss = loss + (out - _last_output.prev).pow(2).mean()  # read back
    _last_output.prev = out.detach()
    return _update(model, optim, loss)


def _dict_entry_step(model, optim, x, y):  # noqa: ANN001, ANN202
    out = model(x)
    loss = F.cross_entropy(out, y)
    if "prev" in model.store:
        loss = loss + (out - model.store["prev"]).pow(2).mean()  # read back
    model.store["prev"] = out.detach()
    return _update(model, optim, loss)


_READ_BACKS = {  # the step, where it keeps the value
    "module_hasattr": (_consistency_step, r"module <root> \(_Stashing\)\.prev"),
    "optimizer_getattr": (_norm_scaled_step, r"optimizer\[0\] \(SGD\)\.prev_norm"),
    "trainer_getattr": (_trainer_step, r"argument 0 of the step \(_Trainer\)\.ema"),
    "global_object": (_global_object_step, r"global '_last_output' .*\.prev"),
    "module_dict_entry": (_dict_entry_step, r"module <root> \(_Stashing\)\.store\['prev'\]"),
}


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.parametrize("kind", list(_READ_BACKS))
def test_an_attribute_the_step_creates_and_reads_back_is_refused_naming_it(kind, mode):
    """``if hasattr(model, "prev"): ... model.prev`` then ``model.prev = out.detach()``,
    ``getattr(opt, "prev_norm", None)``, a trainer's ``getattr(self, "ema", None)``, a
    global object's ``.prev``, a module's dict entry ``model.store["prev"]``: the first
    call's program is traced without the attribute, and until the sixtieth session the
    attribute held a meta placeholder when the guards were made, so the later calls ran
    that program, silently (parameters up to 0.012, 0.036, 0.0019, 0.012 and 0.012 off
    eager after 4 calls). Now the second call is traced again, sees the read and refuses
    it, naming the place and the line, with the first call's training kept."""
    fn, where = _READ_BACKS[kind]
    models = []
    for compiled in (False, True):
        model = _model()
        model.store = {}
        vars(_last_output).clear()
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        args = (_Trainer(model, optim),) if fn is _trainer_step else ()
        step = sc.compile(_mode(mode))(fn) if compiled else fn
        first, second = _batches(2)
        with sc.simulate(world_size=2) as sim:
            step(*args, model, optim, *first)
            if compiled:
                with pytest.raises(SPMDCompileError, match=where + r" back on a later call") as err:
                    step(*args, model, optim, *second)
                assert "# read back" in str(err.value)  # the step's line of the read
            models.append([sim.full_tensor(p).clone() for p in model.parameters()])
    assert all(torch.allclose(a, b, rtol=TOL, atol=TOL) for a, b in zip(*models, strict=True))


def test_a_forward_cache_read_back_is_refused_naming_it():
    """``self.cache = h.detach()`` in ``forward`` and ``if self.cache is not None`` on the
    next call (refused before too: the attribute existed, as None)."""

    class _Caching(_Stashing):
        def __init__(self) -> None:
            super().__init__()
            self.cache = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = F.gelu(self.a(x))
            if self.cache is not None:
                h = h + 0.5 * self.cache
            self.cache = h.detach()
            return self.b(h)

    torch.manual_seed(0)
    model = _Caching().double()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    step = sc.compile(make_mode("ddp"))(_plain_step)
    first, second = _batches(2)
    with sc.simulate(world_size=2):
        step(model, optim, *first)
        with pytest.raises(SPMDCompileError, match=r"_Caching\)\.cache back on a later call"):
            step(model, optim, *second)


def _item_scaled_step(model, optim, x, y):  # noqa: ANN001, ANN202
    loss = F.cross_entropy(model(x), y)
    if hasattr(model, "last"):
        loss = loss * model.last
    model.last = loss.item()
    return _update(model, optim, loss)


def _weight_scaled_step(model, optim, x, y, w):  # noqa: ANN001, ANN202
    loss = F.cross_entropy(model(x), y)
    if hasattr(model, "last_w"):
        loss = loss * model.last_w
    model.last_w = w
    return _update(model, optim, loss)


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.parametrize("fn", [_item_scaled_step, _weight_scaled_step])
def test_a_python_number_the_step_creates_and_reads_back_trains_as_eager(fn, mode):
    """``model.last = loss.item()`` / ``model.last_w = w`` (a float argument) read back
    with ``hasattr`` on the next call: until the sixtieth session the later calls ran the
    first call's program, traced without it (losses 2.61 and 0.97 off eager, silently).
    Now the number is a Python value the guards read, as eager reads it: each new value
    compiles (and warns that it does), and each stays a float."""
    seen = {}
    for compiled in (False, True):
        model = _model()
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        step = sc.compile(_mode(mode))(fn) if compiled else fn
        values = []
        with sc.simulate(world_size=2) as sim:
            for i, (x, y) in enumerate(_batches(4)):
                extra = (0.3 + 0.1 * i,) if fn is _weight_scaled_step else ()
                loss = step(model, optim, x, y, *extra)
                kept = model.last if fn is _item_scaled_step else model.last_w
                values.append((loss.detach().clone(), kept))
            params = [sim.full_tensor(p).clone() for p in model.parameters()]
        seen[compiled] = values, params
    (eager, eager_params), (got, got_params) = seen[False], seen[True]
    for (loss, kept), (want_loss, want_kept) in zip(got, eager, strict=True):
        assert _close(loss, want_loss) and _close(kept, want_kept)
    assert all(torch.allclose(a, b, rtol=TOL, atol=TOL) for a, b in zip(got_params, eager_params, strict=True))


# NOTE: [kept numbers only written]: a Python number the step stores and never reads
class _Plain(nn.Module):
    """Keeps nothing itself (``_Stashing`` makes tensor attributes: a second compile)."""

    def __init__(self, made_in_init: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(FEATURES, 16, dtype=torch.float64), nn.Linear(16, CLASSES, dtype=torch.float64)
        if made_in_init:
            self.last = 0.0  # made before the first call: it recompiled every call before

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


LOG = types.SimpleNamespace()


def _stores_on_model(model, optim, x, y):  # noqa: ANN001, ANN202
    loss = F.cross_entropy(model(x), y)
    model.last = loss.item()
    return _update(model, optim, loss)


def _stores_on_optimizer(model, optim, x, y):  # noqa: ANN001, ANN202
    loss = F.cross_entropy(model(x), y)
    optim.last = loss.item()
    return _update(model, optim, loss)


def _stores_on_a_global_object(model, optim, x, y):  # noqa: ANN001, ANN202
    loss = F.cross_entropy(model(x), y)
    LOG.last = loss.item()
    return _update(model, optim, loss)


@pytest.mark.parametrize("place", ["model", "model_made_in_init", "torch_module", "torch_module_made_before",
                                   "optimizer", "global_object"])
def test_a_python_number_the_step_only_stores_compiles_once(place):
    """``model.last = loss.item()`` (or on the optimizer, or a global object) that no code
    reads: on a module of torch's class (``nn.Sequential``, every attribute guarded) the
    guards checked it, and each call stored a new value, so every call compiled anew (5
    calls, 5 captures, also when made before the first call; from the fourth a warning
    to keep it in a tensor); on the user's module, made by the first call, the number of
    attributes changed (2 captures). Now neither is a guard: one compile over 5 calls,
    and after each call the attribute holds eager's float."""
    fn = {"optimizer": _stores_on_optimizer, "global_object": _stores_on_a_global_object}.get(place, _stores_on_model)
    seen = {}
    for compiled in (False, True):
        LOG.__dict__.clear()
        model = _Plain(made_in_init=place == "model_made_in_init")
        if place.startswith("torch_module"):
            model = nn.Sequential(model.a, nn.Tanh(), model.b)
            if place == "torch_module_made_before":
                model.last = 0.0
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        holder = {"optimizer": optim, "global_object": LOG}.get(place, model)
        step = sc.compile(make_mode("ddp"))(fn) if compiled else fn
        values = []
        with sc.simulate(world_size=2) as sim:
            for x, y in _batches(5):
                loss = step(model, optim, x, y)
                values.append((loss.detach().clone(), holder.last))
            params = [sim.full_tensor(p).clone() for p in model.parameters()]
        if compiled:
            assert step.compile_count == 1
        seen[compiled] = values, params
    (eager, eager_params), (got, got_params) = seen[False], seen[True]
    for (loss, kept), (want_loss, want_kept) in zip(got, eager, strict=True):
        assert _close(loss, want_loss) and _close(kept, want_kept)
    assert all(torch.allclose(a, b, rtol=TOL, atol=TOL) for a, b in zip(got_params, eager_params, strict=True))


def _reads_with_a_default(model, optim, x, y):  # noqa: ANN001, ANN202
    loss = F.cross_entropy(model(x), y) * getattr(model, "last", 1.0)
    model.last = loss.item()
    return _update(model, optim, loss)


def _reads_the_optimizers(model, optim, x, y):  # noqa: ANN001, ANN202
    loss = F.cross_entropy(model(x), y)
    if "last" in vars(optim):
        loss = loss * optim.last
    optim.last = loss.item()
    return _update(model, optim, loss)


def _reads_in_a_format(model, optim, x, y):  # noqa: ANN001, ANN202
    loss = F.cross_entropy(model(x), y)
    if len(f"{getattr(LOG, 'last', 10.0):.2f}") > 4:  # 10.00 the first call, 1.xx later
        loss = loss * 2.0
    LOG.last = loss.item()
    return _update(model, optim, loss)


@pytest.mark.parametrize("fn", [_reads_with_a_default, _reads_the_optimizers, _reads_in_a_format])
def test_a_python_number_read_before_it_is_stored_stays_guarded(fn):
    """A number the step reads before storing (``getattr`` with a default, ``in
    vars(...)``, a format) stays a guard: each new value compiles, and the step
    computes as eager (NOTE: [kept numbers only written])."""
    seen = {}
    for compiled in (False, True):
        LOG.__dict__.clear()
        model = _Plain()
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        step = sc.compile(make_mode("ddp"))(fn) if compiled else fn
        with sc.simulate(world_size=2) as sim:
            losses = [step(model, optim, x, y).detach().clone() for x, y in _batches(4)]
            params = [sim.full_tensor(p).clone() for p in model.parameters()]
        if compiled:
            assert step.compile_count > 1
        seen[compiled] = losses, params
    (eager, eager_params), (got, got_params) = seen[False], seen[True]
    assert all(_close(a, b) for a, b in zip(got, eager, strict=True))
    assert all(torch.allclose(a, b, rtol=TOL, atol=TOL) for a, b in zip(got_params, eager_params, strict=True))


# NOTE: [kept numbers only written]: a dict entry the step only writes (``WRITTEN``: held
# by nothing else, as the rule asks) and one it reads too (``METRICS``, held by ``HOLDER`` too)
WRITTEN: dict = {}
METRICS: dict = {}
HOLDER = types.SimpleNamespace(stats=METRICS)  # the same dict by a second name


def _writes_a_global_dict(model, optim, x, y):  # noqa: ANN001, ANN202
    loss = F.cross_entropy(model(x), y)
    WRITTEN["loss"] = loss.item()
    return _update(model, optim, loss)


def _closure_step(stats: dict, reads: bool = False):  # noqa: ANN202
    """A step made by a factory, keeping its numbers in the factory's dict (a closure
    variable); with ``reads``, it also reads the dict back."""

    def writes(model, optim, x, y):  # noqa: ANN001, ANN202
        loss = F.cross_entropy(model(x), y)
        stats["loss"] = loss.item()
        return _update(model, optim, loss)

    def reads_back(model, optim, x, y):  # noqa: ANN001, ANN202
        loss = F.cross_entropy(model(x), y) * stats.get("loss", 1.0)
        stats["loss"] = loss.item()
        return _update(model, optim, loss)

    return reads_back if reads else writes


class _DictTrainer:
    """A trainer keeping its numbers in dicts: ``self.stats`` in its step, ``self.log``
    in a function nested in it."""

    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim = model, optim
        self.stats: dict = {}
        self.log: dict = {"epoch": 0}

    def train_step(self, x, y):  # noqa: ANN001, ANN201
        loss = F.cross_entropy(self.model(x), y)
        self.stats["loss"] = loss.item()
        return _update(self.model, self.optim, loss)

    def nested_step(self, x, y):  # noqa: ANN001, ANN201
        loss = F.cross_entropy(self.model(x), y)

        def record() -> None:
            self.log["a"] = loss.item()
            self.log["b"] = (2 * loss).item()

        record()
        return _update(self.model, self.optim, loss)


@pytest.mark.parametrize("place", ["global_dict", "trainer_stats", "nested_log", "closure_dict"])
def test_a_python_number_the_step_only_stores_in_a_dict_compiles_once(place, caplog):
    """``METRICS["loss"] = loss.item()`` of a global dict, ``self.stats["loss"] = ...`` in
    a trainer's method, ``self.log["a"] = ...`` in a function nested in it, a factory's
    dict the step holds as a closure variable, where no code reads the dict: the guards held the dict's contents, each call stored a new number,
    and every call compiled anew (5 calls, 5 captures, 0.33 s a call on a small model, and
    from the fourth a warning to keep the value in a tensor). Now the dict is guarded by
    identity only: one compile over 5 calls, no warning, and after each call the dict
    holds eager's floats."""
    seen = {}
    for compiled in (False, True):
        WRITTEN.clear()
        model = _Plain()
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        trainer = _DictTrainer(model, optim)
        if place == "global_dict":
            fn, args, held = _writes_a_global_dict, (model, optim), WRITTEN
        elif place == "closure_dict":
            held = {}
            fn, args = _closure_step(held), (model, optim)
        else:
            fn = trainer.train_step if place == "trainer_stats" else trainer.nested_step
            args, held = (), trainer.stats if place == "trainer_stats" else trainer.log
        step = sc.compile(make_mode("ddp"))(fn) if compiled else fn
        values = []
        with caplog.at_level(logging.WARNING, logger="spmd_compiler"), sc.simulate(world_size=2) as sim:
            for x, y in _batches(5):
                loss = step(*args, x, y)
                values.append((loss.detach().clone(), dict(held)))
            params = [sim.full_tensor(p).clone() for p in model.parameters()]
        if compiled:
            assert step.compile_count == 1
            assert not [r for r in caplog.records if "changed on" in r.getMessage()]
        seen[compiled] = values, params
    (eager, eager_params), (got, got_params) = seen[False], seen[True]
    for (loss, kept), (want_loss, want_kept) in zip(got, eager, strict=True):
        assert _close(loss, want_loss) and kept.keys() == want_kept.keys()
        assert all(_close(kept[k], want_kept[k]) for k in kept)
    assert all(torch.allclose(a, b, rtol=TOL, atol=TOL) for a, b in zip(got_params, eager_params, strict=True))


def _reads_with_get(model, optim, x, y):  # noqa: ANN001, ANN202
    loss = F.cross_entropy(model(x), y) * METRICS.get("loss", 1.0)
    METRICS["loss"] = loss.item()
    return _update(model, optim, loss)


def _reads_its_truth(model, optim, x, y):  # noqa: ANN001, ANN202
    loss = F.cross_entropy(model(x), y)
    if METRICS:  # empty on the first call only
        loss = loss * 2.0
    METRICS["loss"] = loss.item()
    return _update(model, optim, loss)


def _scaled_by(loss, metrics):  # noqa: ANN001, ANN202
    return loss * metrics.get("loss", 1.0)


def _reads_in_a_helper(model, optim, x, y):  # noqa: ANN001, ANN202
    loss = _scaled_by(F.cross_entropy(model(x), y), METRICS)
    METRICS["loss"] = loss.item()
    return _update(model, optim, loss)


def _reads_by_another_name(model, optim, x, y):  # noqa: ANN001, ANN202
    loss = F.cross_entropy(model(x), y) * HOLDER.stats.get("loss", 1.0)
    METRICS["loss"] = loss.item()  # the same dict
    return _update(model, optim, loss)


@pytest.mark.parametrize("fn", [_reads_with_get, _reads_its_truth, _reads_in_a_helper, _reads_by_another_name,
                                _closure_step(METRICS, reads=True)])
def test_a_dict_the_step_reads_stays_guarded(fn):
    """A dict the step reads as well as writes (``.get``, its truth, a helper handed it,
    the same dict by another name, a closure dict read with ``.get``) stays guarded: each new value
    compiles, and the step computes as eager, the dict holding eager's values after
    each call (NOTE: [kept numbers only written])."""
    seen = {}
    for compiled in (False, True):
        METRICS.clear()
        model = _Plain()
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        step = sc.compile(make_mode("ddp"))(fn) if compiled else fn
        values = []
        with sc.simulate(world_size=2) as sim:
            for x, y in _batches(4):
                loss = step(model, optim, x, y)
                values.append((loss.detach().clone(), dict(METRICS)))
            params = [sim.full_tensor(p).clone() for p in model.parameters()]
        seen[compiled] = values, params
    (eager, eager_params), (got, got_params) = seen[False], seen[True]
    for (loss, kept), (want_loss, want_kept) in zip(got, eager, strict=True):
        assert _close(loss, want_loss) and kept.keys() == want_kept.keys()
        assert all(_close(kept[k], want_kept[k]) for k in kept)
    assert all(torch.allclose(a, b, rtol=TOL, atol=TOL) for a, b in zip(got_params, eager_params, strict=True))
    assert step.compile_count > 1


def _scale_from(d: dict) -> float:
    return d.get("loss", 1.0)


class _Meter:
    def __init__(self, d: dict) -> None:
        self.d = d

    def scale(self) -> float:
        return self.d.get("loss", 1.0)


READ_LATER: dict = {}  # read through a global partial and a global bound method below
_SCALE_LATER = functools.partial(_scale_from, READ_LATER)
_METER_LATER = _Meter(READ_LATER).scale


def _reader_step(how: str):  # noqa: ANN202
    """A step writing ``stats["loss"] = loss.item()`` and reading the previous loss back
    only through a path no guard holds: a partial's positional argument (``d.get``), a
    bound method's object (``self.d.get``), that method kept in a dict; a global dict read
    through a global partial or bound method. Returns (step, the dict)."""
    if how.startswith("global"):
        READ_LATER.clear()
        stats, scale = READ_LATER, _SCALE_LATER if how == "global_partial" else _METER_LATER
    else:
        stats = {}
        scale = functools.partial(_scale_from, stats) if how == "partial" else _Meter(stats).scale
    fns = {"scale": scale}

    def step(model, optim, x, y):  # noqa: ANN001, ANN202
        factor = fns["scale"]() if how == "bound_method_in_a_dict" else scale()
        loss = F.cross_entropy(model(x), y) * factor
        stats["loss"] = loss.item()
        return _update(model, optim, loss)

    return step, stats


@pytest.mark.parametrize("how", ["partial", "bound_method", "bound_method_in_a_dict", "global_partial",
                                 "global_bound_method"])
def test_a_dict_read_through_a_partial_or_a_bound_method_stays_guarded(how):
    """A dict the step writes (``stats["loss"] = loss.item()``) and reads back through a
    ``functools.partial`` of it or a bound method of an object holding it, none of which
    the code names by a holder's name: the write-only rule took it for a dict no code
    reads and guarded it by identity, and the program of the first call ran on (1
    compile, losses [1.027, 1.230, 1.228, 1.157] against eager's [1.027, 1.263, 1.553,
    1.778], parameters 0.057 off, a probe). Now the dict is held by more than its
    holders, so its contents stay guarded: each new value compiles, as eager
    (NOTE: [kept numbers only written])."""
    seen = {}
    for compiled in (False, True):
        model = _Plain()
        optim = torch.optim.SGD(model.parameters(), lr=0.5)
        fn, stats = _reader_step(how)
        step = sc.compile(make_mode("ddp"))(fn) if compiled else fn
        values = []
        with sc.simulate(world_size=2) as sim:
            for x, y in _batches(4):
                loss = step(model, optim, x, y)
                values.append((loss.detach().clone(), dict(stats)))
            params = [sim.full_tensor(p).clone() for p in model.parameters()]
        seen[compiled] = values, params
    (eager, eager_params), (got, got_params) = seen[False], seen[True]
    for (loss, kept), (want_loss, want_kept) in zip(got, eager, strict=True):
        assert _close(loss, want_loss) and kept.keys() == want_kept.keys()
        assert all(_close(kept[k], want_kept[k]) for k in kept)
    assert all(torch.allclose(a, b, rtol=TOL, atol=TOL) for a, b in zip(got_params, eager_params, strict=True))
    assert step.compile_count == 4


def test_a_written_dict_rebound_between_calls_gets_the_number():
    """The dict the step only writes is guarded by identity: a global rebound to a new
    dict between calls compiles again, and the number goes to the new dict, as eager's."""
    global WRITTEN
    old = WRITTEN
    try:
        model = _Plain()
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        step = sc.compile(make_mode("ddp"))(_writes_a_global_dict)
        with sc.simulate(world_size=2):
            for i, (x, y) in enumerate(_batches(3)):
                if i == 2:
                    WRITTEN = {}
                loss = step(model, optim, x, y)
                assert _close(WRITTEN["loss"], loss.item())
        assert step.compile_count == 2
    finally:
        WRITTEN = old


# NOTE: [autograd.Function bodies]: values read only inside a user's autograd.Function
SCALE = 1.0


class _ScaleByMetrics(torch.autograd.Function):
    """Reads the global dict the step writes, in ``forward`` only."""

    @staticmethod
    def forward(ctx, x):  # noqa: ANN001, ANN205
        ctx.s = METRICS.get("loss", 1.0)
        return x * ctx.s

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001, ANN205
        return g * ctx.s


class _ScaleByGlobal(torch.autograd.Function):
    """Reads a global float in ``forward`` only."""

    @staticmethod
    def forward(ctx, x):  # noqa: ANN001, ANN205
        ctx.s = SCALE
        return x * SCALE

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001, ANN205
        return g * ctx.s


def _reads_in_a_function_forward(model, optim, x, y):  # noqa: ANN001, ANN202
    loss = _ScaleByMetrics.apply(F.cross_entropy(model(x), y))
    METRICS["loss"] = loss.item()
    return _update(model, optim, loss)


def _scaled_by_a_function(model, optim, x, y):  # noqa: ANN001, ANN202
    return _update(model, optim, _ScaleByGlobal.apply(F.cross_entropy(model(x), y)))


@pytest.mark.parametrize("fn", [_reads_in_a_function_forward, _scaled_by_a_function])
def test_values_read_only_in_an_autograd_functions_body_are_guarded(fn):
    """The step names only ``Scale.apply`` (torch's code); ``Scale.forward`` /
    ``backward`` read a global dict the step writes (``METRICS.get``) or a global float
    changed between calls. Their code was not walked: the float had no guard, and the
    dict lost its guard to NOTE: [kept numbers only written] (1 compile; losses [1.276,
    1.508, 1.461, 1.416] for eager's [1.276, 1.923, 2.804, 4.014], float 4.4 off). Now
    each new value compiles and every call matches eager (NOTE: [autograd.Function
    bodies])."""
    global SCALE
    seen = {}
    try:
        for compiled in (False, True):
            METRICS.clear()
            model = _Plain()
            optim = torch.optim.SGD(model.parameters(), lr=0.1)
            step = sc.compile(make_mode("ddp"))(fn) if compiled else fn
            values = []
            with sc.simulate(world_size=2) as sim:
                for i, (x, y) in enumerate(_batches(4)):
                    SCALE = 1.0 + i
                    loss = step(model, optim, x, y)
                    values.append((loss.detach().clone(), dict(METRICS)))
                params = [sim.full_tensor(p).clone() for p in model.parameters()]
            if compiled:
                assert step.compile_count == 4
            seen[compiled] = values, params
    finally:
        SCALE = 1.0
    (eager, eager_params), (got, got_params) = seen[False], seen[True]
    for (loss, kept), (want_loss, want_kept) in zip(got, eager, strict=True):
        assert _close(loss, want_loss) and kept.keys() == want_kept.keys()
        assert all(_close(kept[k], want_kept[k]) for k in kept)
    assert all(torch.allclose(a, b, rtol=TOL, atol=TOL) for a, b in zip(got_params, eager_params, strict=True))


# NOTE: [kept distributions]
DIST_HOLDER = types.SimpleNamespace()


def _keeps_a_distribution_on_the_model(model, optim, x, y):  # noqa: ANN001, ANN202
    out = model(x)
    model.last_dist = torch.distributions.Categorical(logits=out.detach())
    return _update(model, optim, F.cross_entropy(out, y))


def _keeps_a_distribution_on_a_global_object(model, optim, x, y):  # noqa: ANN001, ANN202
    out = model(x)
    DIST_HOLDER.d = torch.distributions.Normal(out.detach(), 1.0)
    return _update(model, optim, F.cross_entropy(out, y))


def _keeps_distributions_in_a_tuple(model, optim, x, y):  # noqa: ANN001, ANN202
    out = model(x)
    model.dists = (torch.distributions.Categorical(logits=out.detach()),)
    return _update(model, optim, F.cross_entropy(out, y))


@pytest.mark.parametrize("fn, where", [
    (_keeps_a_distribution_on_the_model, "module <root> (_Plain).last_dist"),
    (_keeps_a_distribution_on_a_global_object, "global 'DIST_HOLDER'"),
    (_keeps_distributions_in_a_tuple, "module <root> (_Plain).dists"),
])
def test_a_kept_distribution_of_traced_values_is_refused_naming_it(fn, where):
    """``model.last_dist = Categorical(logits=out.detach())`` (or on a global object, or
    in a tuple): the walk of kept values skipped torch's objects, so after every
    compiled call the attribute held the capture's distribution (``d.logits`` and
    ``d.entropy()`` FakeTensors, no error). Refused now, as a returned distribution is,
    naming the place and saying to keep the tensors; the model is left without it."""
    DIST_HOLDER.__dict__.clear()
    model = _Plain()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    step = sc.compile(make_mode("ddp"))(fn)
    x, y = _batches(1)[0]
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError) as info:
        step(model, optim, x, y)
    message = str(info.value)
    assert where in message and "torch.distributions" in message and "NOTE: [kept distributions]" in message
    assert "build the distribution from them outside" in message
    assert "last_dist" not in vars(model) and "dists" not in vars(model) and not vars(DIST_HOLDER)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))
