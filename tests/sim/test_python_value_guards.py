"""Python values a compiled step read are never silently reused (issue 11, items 3 and 4).

NOTE: [guards on Python values] and NOTE: [float arguments as graph inputs]. Every test
changes a Python value between steps on the compiled model and the eager reference alike
and checks the compiled step against eager on every step; before guards, each of these
kept the first value (one compile, loss off by up to 0.7 relative).
"""

from __future__ import annotations

import collections
import copy
import itertools
import logging
import math
import os
import types
from sys import version_info

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

import spmd_compiler as sc
from spmd_compiler.capture import guards
from spmd_compiler.errors import SPMDCompileError
from spmd_compiler.ir.signature import Kind
from spmd_compiler.tools.parity import compare_models

FLOAT32_TOLERANCE = 1e-5
TEMPERATURES = [1.0, 1.0, 4.0, 4.0, 0.5]


class Tempered(nn.Module):
    """Logits divided by a plain Python attribute, with a LeakyReLU whose slope is a
    torch module's attribute and a scale read from a config object."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.act = nn.LeakyReLU(0.1)
        self.out = nn.Linear(16, 4)
        self.temperature = 1.0
        self.config = types.SimpleNamespace(scale=1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.fc(x))) * self.config.scale / self.temperature


def sgd_momentum(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)


def _set_on_both(setter):
    def before_step(i, model, reference):
        setter(i, model)
        setter(i, reference)

    return before_step


@pytest.mark.parametrize(
    "setter",
    [
        lambda i, m: setattr(m, "temperature", TEMPERATURES[i]),
        lambda i, m: setattr(m.act, "negative_slope", TEMPERATURES[i] / 10),
        lambda i, m: setattr(m.config, "scale", TEMPERATURES[i]),
    ],
    ids=["module_attribute", "torch_module_attribute", "config_object_attribute"],
)
def test_changed_module_attribute_recompiles(run_parity, classification_batches, setter, caplog):
    with caplog.at_level(logging.INFO, logger="spmd_compiler"):
        result = run_parity(
            Tempered, sgd_momentum, 2, classification_batches(len(TEMPERATURES)),
            before_step=_set_on_both(setter),
        )
    result.assert_close(FLOAT32_TOLERANCE)
    # 1.0: state-creating + steady; 4.0: new; 4.0: cached; 0.5: new.
    assert result.compile_counts == [1, 2, 3, 3, 4]
    changes = [r.getMessage() for r in caplog.records if "recompiling" in r.getMessage()]
    # the steady program after the state-creating call says why too (sixty-second session)
    assert len(changes) == 3 and "the state of optimizer[0] was not made yet" in changes[0], changes
    assert "now 4.0" in changes[1].replace("0.4", "4.0"), changes


LOSS_WEIGHT = 1.0


class AttrDict(dict):
    """The config idiom whose ``__getattr__`` raises KeyError (``copy.deepcopy`` probes
    ``__deepcopy__`` with getattr): before 2026-12-02 the guard's snapshot crashed on it."""

    __getattr__ = dict.__getitem__
    __setattr__ = dict.__setitem__


SETTINGS = AttrDict(weight=1.0)


class ConfigDict(dict):
    """addict's ``Dict`` (mmengine's ``ConfigDict``) idiom: a dict whose class reads in its
    own Python code; the guards read what it stores past that code (NOTE: [containers
    that read their own way]), and still see a change."""

    def __getattr__(self, name):  # noqa: ANN001, ANN204
        return self[name]

    def __getitem__(self, name):  # noqa: ANN001, ANN204
        return dict.__getitem__(self, name)

    def __deepcopy__(self, memo):  # noqa: ANN001, ANN204
        raise AssertionError("the guards copied a config through its class's code")


CONFIG = ConfigDict(weight=1.0)


def global_weighted_step(model, optim, x, y):
    loss = F.cross_entropy(model(x), y) * LOSS_WEIGHT * SETTINGS.weight * CONFIG.weight
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _set_loss_weight(value: float) -> None:
    global LOSS_WEIGHT
    LOSS_WEIGHT = value


@pytest.mark.parametrize(
    "set_weight",
    [_set_loss_weight, lambda v: setattr(SETTINGS, "weight", v), lambda v: dict.__setitem__(CONFIG, "weight", v)],
    ids=["global_float", "attr_dict_config", "config_reading_its_own_way"],
)
def test_changed_global_recompiles(run_parity, classification_batches, set_weight):
    try:
        result = run_parity(
            _mlp, sgd_momentum, 2, classification_batches(len(TEMPERATURES)), step=global_weighted_step,
            before_step=lambda i, model, reference: set_weight(TEMPERATURES[i]),
        )
    finally:
        set_weight(1.0)
    result.assert_close(FLOAT32_TOLERANCE)
    assert result.compile_counts == [1, 2, 3, 3, 4]


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


class _LazyRegistry(collections.OrderedDict):
    """transformers' ``_LazyAutoMapping`` idiom: stores nothing in the dict and imports
    every model class when read; a step's code that merely names one made the guards
    read it (the capture failed with the registry's error)."""

    def _load(self, *args):  # noqa: ANN001, ANN202
        raise AssertionError("the guards read a lazy registry through its class's code")

    __getitem__ = __iter__ = __len__ = items = keys = values = _load


REGISTRY = _LazyRegistry()


def registry_step(model, optim, x, y):
    if x.dim() == 0:  # never: the code only names the registry
        model = REGISTRY["mlp"]
    # a C struct sequence, which cannot be copied item by item
    loss = F.cross_entropy(model(x), y) * (2.0 if version_info.releaselevel == "never" else 1.0)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def test_containers_read_their_own_way_and_struct_sequences_are_guarded(run_parity, classification_batches):
    """NOTE: [containers that read their own way]: found by a LoRA probe (peft over
    transformers, whose code names its lazy model mappings) and a step reading
    ``sys.version_info`` (the snapshot raised ``tuple.__new__(sys.version_info) is not
    safe``)."""
    result = run_parity(_mlp, sgd_momentum, 2, classification_batches(3), step=registry_step)
    result.assert_close(FLOAT32_TOLERANCE)
    assert result.compile_counts == [1, 2, 2]  # the momentum buffers made, then steady


SCALING = types.SimpleNamespace(scale=1.0)


def scaled_logits(logits, temperature=1.0, *, settings=SCALING):
    return logits * settings.scale / temperature


class DefaultsReader(nn.Module):
    """A forward calling a helper whose parameters have defaults: a float, and a config
    object reachable only as a keyword-only default."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scaled_logits(self.net(x))


@pytest.mark.parametrize(
    "change",
    [
        lambda v: setattr(scaled_logits, "__defaults__", (v,)),
        lambda v: setattr(SCALING, "scale", v),
        lambda v: setattr(scaled_logits, "__kwdefaults__", {"settings": types.SimpleNamespace(scale=v)}),
    ],
    ids=["positional_default", "default_object_attribute", "keyword_default_replaced"],
)
def test_changed_default_argument_recompiles(run_parity, classification_batches, change):
    """NOTE: [default arguments] in capture/guards.py: before 2026-12-02 each of these
    ran the first program (loss off by up to 2.3 on the sweep's repros)."""
    defaults, kwdefaults = scaled_logits.__defaults__, scaled_logits.__kwdefaults__
    try:
        result = run_parity(
            DefaultsReader, sgd_momentum, 2, classification_batches(len(TEMPERATURES)),
            before_step=lambda i, model, reference: change(TEMPERATURES[i]),
        )
    finally:
        scaled_logits.__defaults__, scaled_logits.__kwdefaults__ = defaults, kwdefaults
        SCALING.scale = 1.0
    result.assert_close(FLOAT32_TOLERANCE)
    assert result.compile_counts == [1, 2, 3, 3, 4]


class Patched(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = _mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _doubled_forward(self, x):
    return 2.0 * self.net(x)


def test_method_replaced_on_the_class_recompiles(run_parity, classification_batches):
    """A notebook's fix (``Patched.forward = other``) between calls: before 2026-12-02
    the old program ran (its code was walked, the class's entry not guarded)."""
    original = Patched.forward

    def before_step(i, model, reference):
        Patched.forward = _doubled_forward if i >= 2 else original

    try:
        result = run_parity(Patched, sgd_momentum, 2, classification_batches(4), before_step=before_step)
    finally:
        Patched.forward = original
    result.assert_close(FLOAT32_TOLERANCE)
    assert result.compile_counts == [1, 2, 3, 3]  # SGD momentum: two programs, then the patch


def _closure_step():
    weight = 1.0

    def step(model, optim, x, y):
        loss = F.cross_entropy(model(x), y) * weight
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    def set_weight(value: float) -> None:
        nonlocal weight
        weight = value

    return step, set_weight


def test_changed_closure_value_recompiles(run_parity, classification_batches):
    step, set_weight = _closure_step()
    result = run_parity(
        _mlp, sgd_momentum, 2, classification_batches(len(TEMPERATURES)), step=step,
        before_step=lambda i, model, reference: set_weight(TEMPERATURES[i]),
    )
    result.assert_close(FLOAT32_TOLERANCE)
    assert result.compile_counts == [1, 2, 3, 3, 4]


HELPER_SCALE = 1.0


class HelperScaled(nn.Module):
    """forward reads a global through a helper method."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._scaled(self.fc(x))

    def _scaled(self, h: torch.Tensor) -> torch.Tensor:
        return h * HELPER_SCALE


class Trainer:
    """The step as a bound method reading an attribute of its object."""

    def __init__(self) -> None:
        self.loss_weight = 1.0

    def step(self, model, optim, x, y):
        loss = F.cross_entropy(model(x), y) * self.loss_weight
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss


def test_global_read_by_a_forward_helper_recompiles(run_parity, classification_batches):
    def before_step(i, model, reference):
        globals()["HELPER_SCALE"] = TEMPERATURES[i]

    try:
        result = run_parity(
            HelperScaled, sgd_momentum, 2, classification_batches(len(TEMPERATURES)),
            before_step=before_step,
        )
    finally:
        globals()["HELPER_SCALE"] = 1.0
    result.assert_close(FLOAT32_TOLERANCE)
    assert result.compile_counts == [1, 2, 3, 3, 4]


def test_attribute_of_a_bound_method_step_recompiles(run_parity, classification_batches):
    trainer = Trainer()
    result = run_parity(
        _mlp, sgd_momentum, 2, classification_batches(len(TEMPERATURES)), step=trainer.step,
        before_step=lambda i, model, reference: setattr(trainer, "loss_weight", TEMPERATURES[i]),
    )
    result.assert_close(FLOAT32_TOLERANCE)
    assert result.compile_counts == [1, 2, 3, 3, 4]


# ---------------------------------------------------------------- float arguments


def scaled_step(model, optim, x, y, scale):
    loss = F.cross_entropy(model(x), y) * scale
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def branching_step(model, optim, x, y, scale):
    logits = model(x)
    if scale > 1.0:  # Python control flow on the float: it must stay a guard
        logits = logits * 2
    loss = F.cross_entropy(logits, y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _with_scales(batches, scales):
    return [(*batch, scale) for batch, scale in zip(batches, scales, strict=True)]


def test_float_argument_used_in_tensor_ops_is_a_graph_input(run_parity, classification_batches):
    scales = [1.0, 0.5, 2.0, 3.25, 0.1]
    result = run_parity(
        _mlp, sgd_momentum, 2, _with_scales(classification_batches(5), scales), step=scaled_step
    )
    result.assert_close(FLOAT32_TOLERANCE)
    assert result.compile_counts == [1, 2, 2, 2, 2]  # state-creating + steady, never again
    refs = result.compiled.last_program.captured.input_refs()
    assert [str(r) for r in refs if r.kind is Kind.HYPERPARAM and r.optimizer < 0] == [
        "float argument 4"
    ]


def test_float_argument_steering_control_flow_stays_a_guard(run_parity, classification_batches):
    scales = [0.5, 0.5, 2.0, 2.0, 0.5, 3.0]
    result = run_parity(
        _mlp, sgd_momentum, 2, _with_scales(classification_batches(6), scales), step=branching_step
    )
    result.assert_close(FLOAT32_TOLERANCE)
    # 0.5: state-creating + steady; 2.0: new; 0.5 again: cached; 3.0: new.
    assert result.compile_counts == [1, 2, 3, 3, 3, 4]
    refs = result.compiled.last_program.captured.input_refs()
    assert not [r for r in refs if r.kind is Kind.HYPERPARAM and r.optimizer < 0]


def test_float_argument_keeps_python_type_promotion(run_parity, classification_batches):
    """``int_tensor * scale`` is float32 (default dtype) with a Python float, not float64."""

    def step(model, optim, x, y, scale):
        weights = (y + 1) * scale  # int64 tensor times a Python float
        assert weights.dtype == torch.float32
        loss = (F.cross_entropy(model(x), y, reduction="none") * weights).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    result = run_parity(
        _mlp, sgd_momentum, 2, _with_scales(classification_batches(3), [0.3, 0.7, 1.9]), step=step
    )
    result.assert_close(FLOAT32_TOLERANCE)
    assert result.compile_counts == [1, 2, 2]


def test_float_argument_a_torch_function_decides_on_stays_a_guard(run_parity, classification_batches):
    """``F.smooth_l1_loss`` tests ``beta == 0.0`` in Python and passes beta on as a
    Scalar: the float is a guard, a program per value. Before, the `if` inside torch's
    function was taken for a check on a tensor value: only the ``beta == 0`` way was
    compiled, and every call with another beta was refused at run time."""

    def step(model, optim, x, y, beta):
        target = F.one_hot(y, 4).to(x.dtype)
        loss = F.smooth_l1_loss(model(x), target, beta=beta)
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    betas = [0.5, 0.5, 1.0, 0.0, 0.5]
    result = run_parity(
        _mlp, sgd_momentum, 2, _with_scales(classification_batches(5), betas), step=step
    )
    result.assert_close(FLOAT32_TOLERANCE)
    # 0.5: state-creating + steady; 1.0: new; 0.0 (the l1 way): new; 0.5 again: cached
    assert result.compile_counts == [1, 2, 3, 4, 4]


def test_a_float_a_torch_function_takes_leaves_the_others_graph_inputs(run_parity, classification_batches):
    """``label_smoothing=ls`` is a guard (``F.cross_entropy`` takes it as a Python
    number); ``scale``, used in tensor ops alone, stays a graph input: a program per value
    of ``ls``, none per value of ``scale``. Before, the first made every float argument a
    guard (a program per call)."""

    def step(model, optim, x, y, scale, ls):
        loss = F.cross_entropy(model(x), y, label_smoothing=ls) * scale
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    batches = [(*b, scale, ls) for b, scale, ls in zip(
        classification_batches(5), [1.0, 0.5, 2.0, 0.25, 3.0], [0.0, 0.0, 0.1, 0.1, 0.1], strict=True
    )]
    result = run_parity(_mlp, sgd_momentum, 2, batches, step=step)
    result.assert_close(FLOAT32_TOLERANCE)
    # ls 0.0: state-creating + steady; ls 0.1: one more; scale never
    assert result.compile_counts == [1, 2, 3, 3, 3]
    refs = result.compiled.last_program.captured.input_refs()
    assert [str(r) for r in refs if r.kind is Kind.HYPERPARAM and r.optimizer < 0] == ["float argument 4"]


def _double_mlp() -> nn.Module:
    return _mlp().double()


def _unread_step(model, optim, x, y, lr_for_logging):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _untaken_branch_step(model, optim, x, y, w, use_w=False):
    loss = F.cross_entropy(model(x), y) * (w if use_w else 1.0)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


@pytest.mark.parametrize("step", [_unread_step, _untaken_branch_step], ids=["unused", "untaken-branch"])
def test_a_float_argument_the_step_does_not_read_stays_a_guard(run_parity, classification_batches, step):
    """NOTE: [float arguments the program does not read]: a float the program never reads
    (or reads only in a branch a bool argument skips) is a guard, a program per value,
    each as eager: the capture cannot tell it from a float the step reads where it cannot
    see (after a type test; see the tests below). The recompile warning says so and what
    to do instead of that it is read in Python."""
    scales = [0.1, 0.2, 0.3, 0.4, 0.5]
    batches = _with_scales(classification_batches(5, dtype=torch.float64), scales)
    handler = _Messages()
    logger = logging.getLogger("spmd_compiler")
    logger.addHandler(handler)
    try:
        result = run_parity(_double_mlp, sgd_momentum, 2, batches, step=step)
    finally:
        logger.removeHandler(handler)
    result.assert_close(1e-12)
    assert result.compile_counts == [1, 2, 3, 4, 5]  # state-creating + steady, then one per value
    refs = result.compiled.last_program.captured.input_refs()
    assert not [r for r in refs if r.kind is Kind.HYPERPARAM and r.optimizer < 0]
    warnings = [r.getMessage() for r in handler.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "a float the program does not read, kept a guard" in warnings[0]
    assert "do not pass the step a value it does not use" in warnings[0]
    assert "reads in Python" not in warnings[0]


def test_only_the_unread_float_argument_is_a_guard(run_parity, classification_batches):
    """A float the program reads stays a graph input next to one it does not read."""

    def step(model, optim, x, y, w, lr_for_logging):
        loss = F.cross_entropy(model(x), y) * w
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    batches = [(*b, 0.5 + i / 10, 0.1) for i, b in enumerate(classification_batches(4, dtype=torch.float64))]
    result = run_parity(_double_mlp, sgd_momentum, 2, batches, step=step)
    result.assert_close(1e-12)
    assert result.compile_counts == [1, 2, 2, 2]
    refs = result.compiled.last_program.captured.input_refs()
    assert [str(r) for r in refs if r.kind is Kind.HYPERPARAM and r.optimizer < 0] == ["float argument 4"]


def _numpy_type_branch_step(model, optim, x, y, w):
    loss = F.cross_entropy(model(x), y)
    if isinstance(w, np.floating) and w > 0.5:  # a tensor stand-in is no np.floating
        loss = loss * 2
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _numpy_type_branch_read_step(model, optim, x, y, w):
    loss = F.cross_entropy(model(x), y) * w
    if isinstance(w, np.floating) and w > 0.5:
        loss = loss * 2
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


@pytest.mark.parametrize(
    "step", [scaled_step, _numpy_type_branch_step, _numpy_type_branch_read_step],
    ids=["tensor-ops", "type-branch", "type-branch-and-read"],
)
def test_a_numpy_float64_argument_stays_a_guard(run_parity, classification_batches, step):
    """A NumPy float64 is a guard, a program per value, each as eager: a step may test
    its type (``isinstance(w, np.floating)``), which a graph input's tensor stand-in
    fails. As a graph input (2026-12-06) the 0.7 and 0.9 calls silently ran 0.3's
    branch: 2 compiles, parameters 1.8e-1 off eager (2e-1 with ``loss * w``)."""
    scales = [np.float64(0.3), np.float64(0.3), np.float64(0.7), np.float64(0.9)]
    batches = _with_scales(classification_batches(4, dtype=torch.float64), scales)
    result = run_parity(_double_mlp, sgd_momentum, 2, batches, step=step)
    result.assert_close(1e-12)
    assert result.compile_counts == [1, 2, 3, 4]


def test_a_numpy_float_changing_every_call_is_told_to_pass_a_float(run_parity, classification_batches):
    """The recompile warning of a NumPy float argument says to pass ``float(value)`` (the
    float32 / float16 hint it had never matched the guard's text)."""
    scales = [np.float64(v) for v in (0.1, 0.2, 0.3, 0.4, 0.5)]
    batches = _with_scales(classification_batches(5, dtype=torch.float64), scales)
    handler = _Messages()
    logger = logging.getLogger("spmd_compiler")
    logger.addHandler(handler)
    try:
        result = run_parity(_double_mlp, sgd_momentum, 2, batches, step=scaled_step)
    finally:
        logger.removeHandler(handler)
    result.assert_close(1e-12)
    warnings = [r.getMessage() for r in handler.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "it is a NumPy scalar" in warnings[0] and "`float(value)`" in warnings[0]


def test_a_numpy_float64_returned_as_itself_stays_eagers_type():
    """A float64 argument (a guard) returned as itself comes back a float64, as eager's."""

    def step(model, optim, x, y, w):
        loss = F.cross_entropy(model(x), y) * w
        loss.backward()
        optim.step()
        optim.zero_grad()
        return {"loss": loss, "w": w}

    torch.manual_seed(0)
    model = _double_mlp()
    compiled = sc.compile()(step)
    with sc.simulate(2):
        for w in (0.5, 0.25):
            x, y = torch.randn(8, 8, dtype=torch.float64), torch.randint(0, 4, (8,))
            out = compiled(model, sgd_momentum(model), x, y, np.float64(w))
            assert type(out["w"]) is np.float64 and out["w"] == w


def test_a_numpy_float32_argument_stays_a_guard(run_parity, classification_batches):
    """A NumPy float32 is no float subclass and rounds its arithmetic to 32 bits: a
    guard, a program per value, each as eager."""
    scales = [np.float32(0.1), np.float32(0.1), np.float32(0.3)]
    batches = _with_scales(classification_batches(3, dtype=torch.float64), scales)
    result = run_parity(_double_mlp, sgd_momentum, 2, batches, step=scaled_step)
    result.assert_close(1e-12)
    assert result.compile_counts == [1, 2, 3]


def _type_tested_step(model, optim, x, y, w):
    scale = w if isinstance(w, float) else 1.0  # a stand-in tensor takes the other way
    loss = F.cross_entropy(model(x), y) * scale
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _skipped_at_one_step(model, optim, x, y, w):
    loss = F.cross_entropy(model(x), y)
    if isinstance(w, float) and w != 1.0:  # at 1.0 the same program as a tensor's way
        loss = loss * w
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _isclose_step(model, optim, x, y, w):
    loss = F.cross_entropy(model(x), y)
    if isinstance(w, float) and not math.isclose(w, 1.0):  # C code reads the value
        loss = loss * w
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _formatted_step(model, optim, x, y, w):
    loss = F.cross_entropy(model(x), y)
    if isinstance(w, float) and "%.1f" % w != "1.0":  # noqa: UP031 - C code reads the value
        loss = loss * 2
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _type_branch_step(model, optim, x, y, w):
    loss = F.cross_entropy(model(x), y)
    if type(w) is float:  # does not read the value, but eager takes this way
        loss = loss * 2
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


@pytest.mark.parametrize(
    "step", [_type_tested_step, _skipped_at_one_step, _type_branch_step, _isclose_step, _formatted_step],
    ids=["reads-after", "skipped-at-one", "type-branch", "math-isclose", "format"],
)
def test_a_float_argument_a_type_test_sends_another_way_stays_a_guard(
    run_parity, classification_batches, step
):
    """A float the trace with a tensor stand-in leaves unread because a type test sent
    that trace another way than eager's, which reads the value (in Python, or in C code
    no hook sees: ``math.isclose``, a format string) or not, stays a guard (NOTE: [float
    arguments the program does not read]) and every call matches eager. Kept an unread
    graph input where a trace with the float itself was the same program (2026-12-06),
    ``math-isclose`` and ``format`` compiled 2 programs and ran 0.5 and 2.0 as 1.0:
    parameters 5e-1 off eager, silently."""
    scales = [1.0, 1.0, 0.5, 2.0]
    batches = _with_scales(classification_batches(4, dtype=torch.float64), scales)
    result = run_parity(_double_mlp, sgd_momentum, 2, batches, step=step)
    result.assert_close(1e-12)
    assert result.compile_counts[-1] == 4  # 1.0: state-creating + steady; 0.5, 2.0: one each


# ---------------------------------------------------------------- Python side effects


class Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.fc(x) * self.calls


def test_python_counter_changed_by_the_step_is_refused(classification_batches, train_step):
    model = Counting()
    compiled = sc.compile()(train_step)
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError) as info:
        compiled(model, sgd_momentum(model), *classification_batches(1)[0])
    message = str(info.value)
    assert "module <root>.calls went from 0 to 1 on this call" in message and "register_buffer" in message


class ActNorm(nn.Module):
    """Glow's ActNorm: initialized from the first batch (a Python flag), then trained."""

    def __init__(self, features: int = 8) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(features, dtype=torch.float64))
        self.log_scale = nn.Parameter(torch.zeros(features, dtype=torch.float64))
        self.initialized = False
        self.head = nn.Linear(features, 4).double()
        self.warmup = True  # a warm-up flag the step sets off

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.initialized:
            with torch.no_grad():
                self.bias.copy_(-x.mean(0))
                self.log_scale.copy_(-torch.log(x.std(0) + 1e-6))
            self.initialized = True
        return self.head((x + self.bias) * torch.exp(self.log_scale))


def set_up_on_the_first_call(model, optim, x, y):
    loss = F.cross_entropy(model(x), y)
    if model.warmup:
        loss = loss * 0.1
        model.warmup = False
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_a_step_that_sets_itself_up_runs_the_set_up_on_its_first_call(classification_batches, mode):
    """NOTE: [a step that changes what it reads]: the first call's program is the path of
    the values it began with (before, the second trace's ran it: a loss 10x off, ActNorm
    never initialized from the data)."""
    torch.manual_seed(0)
    model = ActNorm()
    reference = copy.deepcopy(model)
    optim, ref_optim = sgd_momentum(model), sgd_momentum(reference)
    compiled = sc.compile(sc.parallel_modes.make_mode(mode))(set_up_on_the_first_call)
    with sc.simulate(world_size=2) as sim:
        for x, y in classification_batches(4, dtype=torch.float64):
            x = 3.0 * x + 1.0
            got = compiled(model, optim, x, y)
            want = set_up_on_the_first_call(reference, ref_optim, x, y)
            assert abs(float(got) - float(want)) <= 1e-12 * abs(float(want))
        worst = max(compare_models(model, reference, sim).values())
    assert worst < 1e-12
    assert compiled.compile_count == 2  # the set-up path, then the steady one
    assert not model.warmup and model.initialized


class Flagged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4).double()
        self.warmup = True
        self.seen = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def warm_up_then_skip_non_finite(model, optim, x, y):
    """A set-up flag, then an `if` on a tensor value (the capture traces it both ways)."""
    loss = F.cross_entropy(model(x), y)
    if model.warmup:
        loss = loss * 0.1
        model.warmup = False
    if torch.isfinite(loss):
        loss.backward()
        optim.step()
    optim.zero_grad()
    return loss


def warm_up_by_the_data(model, optim, x, y):
    """The set-up's scale decided by the data, the first batch the way not speculated."""
    loss = F.cross_entropy(model(x), y)
    if model.warmup:
        loss = loss * (0.1 if x.sum() > 0 else 0.5)
        model.warmup = False
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def mark_seen_by_the_data(model, optim, x, y):
    """A write inside an `if` on the data: the way that ran decides what Python holds."""
    loss = F.cross_entropy(model(x), y)
    if not model.seen:
        if x.sum() > 0:
            model.seen = True
            loss = loss * 0.1
        else:
            loss = loss * 2.0
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


@pytest.mark.parametrize(
    "case", ["warm_up_then_skip_non_finite", "warm_up_by_the_data", "mark_seen_by_the_data"]
)
def test_a_set_up_beside_an_if_on_a_tensor_matches_eager_from_the_first_call(classification_batches, case):
    """Every trace of one capture starts from the values the call found, and the values
    left are those the program's own way wrote (a value check's other way, traced later,
    left its own; the first call was 9x off; a branch program captured on the written
    values failed inside the capture)."""
    step = globals()[case]
    torch.manual_seed(0)
    model = Flagged()
    reference = copy.deepcopy(model)
    optim, ref_optim = sgd_momentum(model), sgd_momentum(reference)
    compiled = sc.compile()(step)
    batches = classification_batches(4, dtype=torch.float64)
    signs = [-1.0, 1.0, 1.0, -1.0]
    with sc.simulate(world_size=2) as sim:
        for i, ((x, y), sign) in enumerate(zip(batches, signs, strict=True)):
            x = sign * x.abs()
            if i == 2:
                model.seen = reference.seen = False  # a new epoch re-arms the flag
            got = compiled(model, optim, x, y)
            want = step(reference, ref_optim, x, y)
            assert abs(float(got) - float(want)) <= 1e-12 * abs(float(want)), (i, float(got), float(want))
            assert (model.warmup, model.seen) == (reference.warmup, reference.seen)
        assert max(compare_models(model, reference, sim).values()) < 1e-12


class Built(nn.Module):
    """A flag the forward reads and sets, whose branch computes nothing: one program
    serves both values."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.built = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.built:
            self.built = True
        return self.fc(x)


def test_a_flag_the_step_sets_and_never_branches_on_compiles_once(classification_batches, train_step):
    model = Built()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = sc.compile()(train_step)
    with sc.simulate(world_size=2):
        for x, y in classification_batches(3):
            compiled(model, optim, x, y)
    assert compiled.compile_count == 1 and model.built


def train_mode_step(model, optim, x, y):
    model.train()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def eval_mode_step(model, x, y):
    model.eval()
    with torch.no_grad():
        return F.cross_entropy(model(x), y)


def test_steps_that_set_the_models_mode_themselves_compile_once_each_way(classification_batches):
    """``model.train()`` / ``model.eval()`` inside the steps: each switch recaptured the
    step before; now each program serves the mode it found and the one it left, and a
    call served by it leaves the model in the mode eager leaves it in."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4)).double()
    reference = copy.deepcopy(model)
    optim, ref_optim = sgd_momentum(model), sgd_momentum(reference)
    train, evaluate = sc.compile()(train_mode_step), sc.compile()(eval_mode_step)
    with sc.simulate(world_size=2) as sim:
        for i, (x, y) in enumerate(classification_batches(9, dtype=torch.float64)):
            if i % 3 == 2:
                got, want = evaluate(model, x, y), eval_mode_step(reference, x, y)
            else:
                got, want = train(model, optim, x, y), train_mode_step(reference, ref_optim, x, y)
            assert abs(float(got) - float(want)) <= 1e-12 * abs(float(want))
            assert model.training == reference.training and model[1].training == reference[1].training
        assert max(compare_models(model, reference, sim).values()) < 1e-12
    # SGD momentum's first step (state made) and the step from eval mode; eval once
    assert (train.compile_count, evaluate.compile_count) == (3, 1)


class Sampler(nn.Module):
    """Logits whose batch norm reads the mode: running statistics in eval, the batch's
    (and an update of the running ones) in training."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 12, bias=False)  # a bias before the norm: a gradient of rounding
        self.norm = nn.BatchNorm1d(12)
        self.out = nn.Linear(12, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.norm(self.fc(x))))


def sample_then_train_step(model, optim, x):
    """Sample targets in eval mode, then train on them: ``torch.multinomial``'s check of
    its weights is an `if` on a tensor value, traced both ways."""
    model.eval()
    with torch.no_grad():
        picked = torch.multinomial(F.softmax(model(x), -1), 1)[:, 0]
    model.train()
    loss = F.cross_entropy(model(x), picked)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss, picked


def train_on(model, optim, x, picked):
    """The step run eagerly on the targets it drew when compiled."""
    model.eval()
    with torch.no_grad():
        model(x)
    model.train()
    loss = F.cross_entropy(model(x), picked)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _sampled_run(world: int) -> tuple[list[torch.Tensor], nn.Module, nn.Module, float, int]:
    torch.manual_seed(0)
    model = Sampler().double()
    reference = copy.deepcopy(model)
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=0.05)
    compiled = sc.compile(sc.parallel_modes.DataParallel("replicate"))(sample_then_train_step)
    data = torch.Generator().manual_seed(1)
    drawn = []
    with sc.simulate(world_size=world) as sim:
        for i in range(3):
            x = torch.randn(8, 6, dtype=torch.float64, generator=data)
            torch.manual_seed(10 + i)
            loss, picked = compiled(model, optim, x)
            assert model.training and model.norm.training  # as eager leaves it
            want = train_on(reference, ref_optim, x, picked)
            assert abs(float(loss) - float(want)) <= 1e-12 * abs(float(want))
            drawn.append(picked)
        worst = max(compare_models(model, reference, sim).values())
    return drawn, model, reference, worst, compiled.compile_count


def test_a_step_that_samples_in_eval_mode_then_trains():
    """``model.eval()``, ``torch.multinomial``, ``model.train()`` in the step: the trace of
    the check's raising way stopped in eval mode, and the capture left the model there,
    refused as "changes a Python value every time it runs: module <root>.training was
    False, now True" (NOTE: [a step that changes what it reads]). Now it compiles; the
    model left in training mode; the update, given the tokens drawn, eager's within
    1e-12 on 2 ranks (ddp); the draws those of 1 rank (one global draw, NOTE: [random
    draws shaped like a tensor]), each a category of the distribution."""
    drawn, model, reference, worst, compiles = _sampled_run(2)
    # AdamW's first step (its state traced, not predicted, in a step with a value check)
    # and the steps after it; the mode compiles nothing
    assert worst < 1e-12 and compiles == 2
    alone, *_ = _sampled_run(1)
    assert all(torch.equal(a, b) for a, b in zip(drawn, alone))
    assert all(p.shape == (8,) and p.dtype == torch.long and 0 <= int(p.min()) and int(p.max()) < 5
               for p in drawn)


def counted_step(model, optim, x, y, iteration):
    """An int argument (the iteration) that changes every call: each value is baked in."""
    loss = F.cross_entropy(model(x), y) * min(1.0, (iteration + 1) / 4)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def test_int_argument_changing_every_call_warns(classification_batches, caplog):
    """An int argument is part of the program's key: each new value compiles, silently
    before; now every recompile says which argument changed, and the third warns."""
    torch.manual_seed(0)
    model = _mlp()
    optim = sgd_momentum(model)
    compiled = sc.compile()(counted_step)
    with caplog.at_level(logging.INFO, logger="spmd_compiler"), sc.simulate(2):
        for i, (x, y) in enumerate(classification_batches(5)):
            compiled(model, optim, x, y, i)
    assert compiled.compile_count == 5
    changes = [r.getMessage() for r in caplog.records if "recompiling" in r.getMessage()]
    assert changes[0] == "recompiling counted_step: argument iteration of the step was 0, now 1"
    assert len(changes) == 4
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith(
        "argument iteration of the step changed on 3 calls of counted_step"
    ), warnings
    assert "pass the decision as a bool argument" in warnings[0]  # the accumulation way out


def clipped_step(model, optim, x, y, max_norm):  # noqa: ANN001
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # float(max_norm)
    optim.step()
    optim.zero_grad()
    return loss


def clipped_by_hand_step(model, optim, x, y, max_norm):  # noqa: ANN001
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    norm = torch.nn.utils.get_total_norm(grads)
    torch._foreach_mul_(grads, (max_norm / (norm + 1e-6)).clamp(max=1.0))
    optim.step()
    optim.zero_grad()
    return loss


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_float_read_in_python_changing_every_call_is_named_and_told_the_way_out(classification_batches):
    """torch's clip_grad_norm_ calls float(max_norm): a float argument changing every call
    compiles per value. The warning said "argument 4 of the step" and "keep it in a
    tensor", which is refused there (float() of a tensor); it names `max_norm` and the
    clip by hand its hint gives compiles once and matches eager."""
    norms = [0.3, 0.1, 0.2, 0.05, 0.15]
    handler = _Messages()
    logger = logging.getLogger("spmd_compiler")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        torch.manual_seed(0)
        model = _mlp().double()
        compiled = sc.compile()(clipped_step)
        with sc.simulate(2):
            for (x, y), max_norm in zip(classification_batches(5, dtype=torch.float64), norms, strict=True):
                compiled(model, sgd_momentum(model), x, y, max_norm)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    warnings = [r.getMessage() for r in handler.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("argument max_norm of the step changed on 3 calls")
    assert "torch._foreach_mul_(grads, (max_norm / (norm + 1e-6)).clamp(max=1.0))" in warnings[0]
    assert "in a tensor" not in warnings[0]

    torch.manual_seed(0)
    model = _mlp().double()
    reference = copy.deepcopy(model)
    optim, reference_optim = sgd_momentum(model), sgd_momentum(reference)
    compiled = sc.compile()(clipped_by_hand_step)
    with sc.simulate(2):
        for (x, y), max_norm in zip(classification_batches(5, dtype=torch.float64), norms, strict=True):
            loss = compiled(model, optim, x, y, max_norm)
            expected = clipped_step(reference, reference_optim, x, y, max_norm)
            assert abs(loss.item() - expected.item()) <= 1e-12 * expected.item()
        assert max(compare_models(model, reference, None).values()) < 1e-12
    assert compiled.compile_count <= 2  # the first call's program and the steady one


def cosine_weighted_step(model, optim, x, y, progress):  # noqa: ANN001
    loss = F.cross_entropy(model(x), y) * (0.5 * (1 + math.cos(math.pi * progress)))
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def test_a_float_read_by_math_is_named_by_its_line_without_clip_grad_norm(classification_batches, caplog):
    """NOTE: [float arguments read in Python]: the warning blamed "torch's
    clip_grad_norm_ calls float(max_norm)" for a float read by math.cos; it names the
    line that read it and gives no clipping recipe."""
    torch.manual_seed(0)
    model = _mlp().double()
    compiled = sc.compile()(cosine_weighted_step)
    with caplog.at_level(logging.WARNING, logger="spmd_compiler"), sc.simulate(2):
        for (x, y), progress in zip(classification_batches(5, dtype=torch.float64), [0.1, 0.3, 0.5, 0.7, 0.9], strict=True):
            compiled(model, sgd_momentum(model), x, y, progress)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("argument progress of the step changed on 3 calls"), warnings
    assert "clip_grad_norm_" not in warnings[0] and "_foreach_mul_" not in warnings[0], warnings[0]
    assert 'math.cos(math.pi * progress)' in warnings[0], warnings[0]


def accumulating_step(model, optim, x, y, do_step):  # noqa: ANN001
    loss = F.cross_entropy(model(x), y) / 2
    loss.backward()
    if do_step:
        optim.step()
        optim.zero_grad()
    return loss


def test_a_flag_that_alternates_does_not_warn(classification_batches, caplog):
    """Accumulate, then step: the flag's two values and the optimizer's first step make 4
    programs over 8 calls, none after; a value seen before is no reason to warn (it
    warned "changed on 3 calls ... each new value compiles a new program" before)."""
    torch.manual_seed(0)
    model = _mlp()
    optim = sgd_momentum(model)
    compiled = sc.compile()(accumulating_step)
    with caplog.at_level(logging.INFO, logger="spmd_compiler"), sc.simulate(2):
        for i, (x, y) in enumerate(classification_batches(8)):
            compiled(model, optim, x, y, i % 2 == 1)
    assert compiled.compile_count == 4
    assert not [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def env_weighted_step(model, optim, x, y):  # noqa: ANN001
    loss = F.cross_entropy(model(x), y) * float(os.environ.get("SPMD_TEST_LOSS_WEIGHT", "1"))
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def test_changed_environment_variable_recompiles(run_parity, classification_batches, monkeypatch, caplog):
    """An environment variable the step reads is a guard: it kept its capture value
    before (0.7 relative off the loss)."""
    def before_step(i, model, reference):
        monkeypatch.setenv("SPMD_TEST_LOSS_WEIGHT", str(TEMPERATURES[i]))

    with caplog.at_level(logging.INFO, logger="spmd_compiler"):
        result = run_parity(
            _mlp, sgd_momentum, 2, classification_batches(len(TEMPERATURES)),
            step=env_weighted_step, before_step=before_step,
        )
    result.assert_close(FLOAT32_TOLERANCE)
    assert result.compile_counts == [1, 2, 3, 3, 4]
    changes = [r.getMessage() for r in caplog.records if "recompiling" in r.getMessage()]
    assert any("environment variable SPMD_TEST_LOSS_WEIGHT was '1.0', now '4.0'" in c
               for c in changes), changes


WARMUP_STEPS = itertools.count(1)


def iterator_warmup_step(model, optim, x, y):  # noqa: ANN001
    """A warm-up factor from a global counter: ``next`` ran once, at capture, and the
    program kept the first factor on every call (0.5 relative off by the third step)."""
    loss = F.cross_entropy(model(x), y) * min(1.0, next(WARMUP_STEPS) / 3)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _generator_step():
    factors = (min(1.0, i / 3) for i in itertools.count(1))

    def step(model, optim, x, y):  # noqa: ANN001
        loss = F.cross_entropy(model(x), y) * next(factors)
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    return step


class _Stepper:
    def __init__(self) -> None:
        self.ticks = iter(range(100))

    def step(self, model, optim, x, y):  # noqa: ANN001
        loss = F.cross_entropy(model(x), y) * (1 + next(self.ticks))
        loss.backward()
        optim.step()
        return loss


@pytest.mark.parametrize("where", ["global", "closure", "attribute"])
def test_an_iterator_advanced_by_the_step_is_refused(classification_batches, where):
    step = {"global": lambda: iterator_warmup_step, "closure": _generator_step,
            "attribute": lambda: _Stepper().step}[where]()
    model = _mlp()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    compiled = sc.compile()(step)
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError, match="changes a Python value") as info:
        compiled(model, sgd_momentum(model), *classification_batches(1)[0])
    assert "the position of iterator" in str(info.value)
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name


def test_iterator_positions():
    counter, letters = itertools.count(5), iter([1, 2, 3])
    generator = (i for i in range(3))
    first = [guards.iterator_position(it) for it in (counter, letters, generator)]
    for it in (counter, letters, generator):
        next(it)
    assert all(a is not None for a in first)
    assert all(a != guards.iterator_position(it) for a, it in zip(first, (counter, letters, generator)))
    assert guards.iterator_position([1, 2]) is None and guards.iterator_position(torch.ones(2)) is None


class _Trainer:
    """A trainer object holding its data iterator; the loop draws from it between
    calls of the compiled bound-method step, which never names it."""

    def __init__(self, batches) -> None:  # noqa: ANN001
        self.batches = iter(batches)
        self.scale = 1.0

    def step(self, model, optim, x, y):  # noqa: ANN001
        loss = F.cross_entropy(model(x), y) * self.scale
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss


def test_an_iterator_the_step_does_not_name_is_not_a_guard(classification_batches):
    batches = classification_batches(4)
    trainer = _Trainer(batches)
    model = _mlp()
    optim = sgd_momentum(model)
    compiled = sc.compile()(trainer.step)
    with sc.simulate(world_size=2):
        for _ in range(4):
            compiled(model, optim, *next(trainer.batches))
    assert compiled.compile_count == 2  # the first step's program and the steady one


class _Monitored(nn.Module):
    """A forward that names ``monitor`` and, behind a flag, tqdm."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.monitor = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.monitor:
            tqdm.write("forward")
        return self.fc(x)


def test_a_progress_bars_state_is_not_a_guard(classification_batches, train_step, monkeypatch):
    """tqdm sets ``tqdm.monitor`` (a thread) on its first bar; the walk guarded it where
    the code names ``monitor`` and ``tqdm``, so a training loop's first bar compiled the
    step again (a peft LoRA step, 13 s). Display-only libraries are not walked."""
    monkeypatch.setattr(tqdm, "monitor", None)
    model = _Monitored()
    optim = sgd_momentum(model)
    compiled = sc.compile()(train_step)
    with sc.simulate(world_size=2):
        for i, (x, y) in enumerate(classification_batches(4)):
            compiled(model, optim, x, y)
            if i == 1:  # after the steady program's first call, as a loop's first bar does
                monkeypatch.setattr(tqdm, "monitor", types.SimpleNamespace(report=lambda: True))
    assert compiled.compile_count == 2  # the momentum buffers made, then steady


class _Ticking(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.ticks = itertools.count(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * min(1.0, next(self.ticks) / 3)


def test_an_iterator_a_forward_advances_is_refused(classification_batches, train_step):
    model = _Ticking()
    compiled = sc.compile()(train_step)
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError, match="position of iterator module <root>.ticks"):
        compiled(model, sgd_momentum(model), *classification_batches(1)[0])


def frozen_flag_step(model, optim, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    for p in model.parameters():
        if getattr(p, "no_update", False):
            p.grad = None
    optim.step()
    optim.zero_grad()
    return loss


def test_python_attributes_of_parameters_are_read_and_guarded(run_parity, classification_batches):
    """NOTE: [Python attributes of parameters] in capture/trace.py: a flag set on a
    parameter before the first call (the trace's stand-ins had none: ``getattr`` gave its
    default, the layer trained; loss 1.3537 against 1.3457 on the sweep's repro), then one
    set on another parameter between calls (its installed replacement holds the same
    attributes, which the guards watch)."""

    def before_step(i, model, reference):
        for m in (model, reference):
            if i == 0:
                m[0].weight.no_update = True
            if i == 2:
                m[2].weight.no_update = True

    result = run_parity(
        _mlp, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), 2, classification_batches(4),
        step=frozen_flag_step, before_step=before_step,
    )
    result.assert_close(FLOAT32_TOLERANCE)
    assert result.compile_counts == [1, 1, 2, 2]
    assert result.model[2].weight.no_update and hasattr(result.model[0].weight, "no_update")


class Switched(nn.Module):
    """Settings held in a set (``"tanh" in self.skip``) and in a range."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _mlp()
        self.skip: set[str] = set()
        self.rows = range(0, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        out = out if "tanh" in self.skip else torch.tanh(out)
        return out * len(self.rows) / 4


@pytest.mark.parametrize(
    "change",
    [lambda m: m.skip.add("tanh"), lambda m: setattr(m, "rows", range(0, 8))],
    ids=["set_mutated", "range_replaced"],
)
def test_changed_set_or_range_recompiles(run_parity, classification_batches, change):
    """Before 2026-12-02 sets, deques, ranges, slices and complex numbers were neither
    guarded nor walked: a change ran the old program (loss 1.07 against 0.71 on the
    sweep's repro for a set)."""

    def before_step(i, model, reference):
        if i == 2:
            change(model)
            change(reference)

    result = run_parity(
        Switched, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), 2, classification_batches(4),
        before_step=before_step,
    )
    result.assert_close(FLOAT32_TOLERANCE)
    assert result.compile_counts == [1, 1, 2, 2]


def optimizer_scaled_step(model, optim, x, y):
    loss = F.cross_entropy(model(x), y) * optim.loss_scale
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def test_attribute_set_on_a_torch_optimizer_recompiles(run_parity, classification_batches):
    """What code sets on one of torch's optimizers and the step reads (``optim.loss_scale``):
    before 2026-12-02 torch's optimizers were not walked (loss 3.15 against 0.76 on the
    sweep's repro after the scale changed)."""
    made: list[torch.optim.Optimizer] = []  # the compiled step's and the reference's

    def make_optimizer(model):
        made.append(torch.optim.SGD(model.parameters(), lr=0.1))
        made[-1].loss_scale = 1.0
        return made[-1]

    def before_step(i, model, reference):
        for optim in made:
            optim.loss_scale = 4.0 if i >= 2 else 1.0

    result = run_parity(
        _mlp, make_optimizer, 2, classification_batches(4), step=optimizer_scaled_step,
        before_step=before_step,
    )
    result.assert_close(FLOAT32_TOLERANCE)
    assert result.compile_counts == [1, 1, 2, 2]
