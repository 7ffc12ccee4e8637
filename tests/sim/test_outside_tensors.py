"""Tensors a step reads from outside its arguments (NOTE: [tensors read from outside the
arguments]): a plain tensor attribute set in ``__init__`` without ``register_buffer``, a
global and a closure tensor are program constants guarded where they were found.
Compared with the undecorated step on one device on the global batch (float64, within
1e-12); replacing the tensor or changing it in place between calls compiles a new
program that uses the new value. Writing such a tensor in place inside the step, one
that requires grad, and one reached where no guard can watch it are refused. A tensor
attribute of a config module or class the step names is one too, guarded there, and a
tensor found at several places is guarded at each.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import sys
import types
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.errors import SPMDCompileError
from spmd_compiler.parallel_modes import make_mode
from spmd_compiler.tools.parity import compare_models

TOL = 1e-12
FEATURES, CLASSES = 8, 4


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(FEATURES, CLASSES)
        self.scale = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)  # not a buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.scale


CLASS_WEIGHTS = torch.tensor([0.5, 1.0, 2.0, 3.0], dtype=torch.float64)


def weighted_step(model, optim, x, y):  # noqa: ANN001
    loss = F.cross_entropy(model(x), y, weight=CLASS_WEIGHTS)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


def _closure_step(offset: torch.Tensor):  # noqa: ANN202
    def step(model, optim, x, y):  # noqa: ANN001
        return weighted_step(model, optim, x + offset, y)

    return step


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, FEATURES, generator=gen, dtype=torch.float64),
         torch.randint(0, CLASSES, (8,), generator=gen))
        for _ in range(n)
    ]


def _run(step, mode: str, between=None):  # noqa: ANN001, ANN202
    torch.manual_seed(0)
    model = _Scaled().double()
    reference = copy.deepcopy(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    compiled = sc.compile(make_mode(mode))(step)
    counts = []
    with sc.simulate(world_size=2) as sim:
        for i, (x, y) in enumerate(_batches(4)):
            if between is not None:
                between(i, model, reference)
            loss, expected = compiled(model, optim, x, y), step(reference, ref_optim, x, y)
            assert torch.allclose(loss, expected, rtol=TOL, atol=0), f"step {i}"
            counts.append(compiled.compile_count)
        differences = compare_models(model, reference, sim)
    assert max(differences.values()) < TOL, differences
    return counts


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_plain_attribute_global_and_closure_tensors(mode):
    offset = torch.full((FEATURES,), 0.25, dtype=torch.float64)
    counts = _run(_closure_step(offset), mode)
    # one program: the optimizer state is made before it (NOTE: [optimizer state made
    # before the first program]; a step reading such tensors compiled two before
    # 2026-12-03), and no recompile
    assert counts == [1, 1, 1, 1]


def test_a_replaced_or_changed_tensor_compiles_a_new_program():
    global CLASS_WEIGHTS
    saved = CLASS_WEIGHTS

    def between(i, model, reference):  # noqa: ANN001
        global CLASS_WEIGHTS
        if i == 2:  # rebound: the program's constant is another object now
            CLASS_WEIGHTS = torch.tensor([3.0, 2.0, 1.0, 0.5], dtype=torch.float64)
        if i == 3:  # changed in place, on both models' shared plain attribute too
            CLASS_WEIGHTS.mul_(2.0)
            model.scale = model.scale * 2
            reference.scale = reference.scale * 2

    try:
        counts = _run(weighted_step, "ddp", between)
    finally:
        CLASS_WEIGHTS = saved
    assert counts == [1, 1, 2, 3]  # the state made first; each change one program


DEFAULT_WEIGHTS = torch.tensor([0.5, 1.0, 2.0, 3.0], dtype=torch.float64)


def default_step(model, optim, x, y, w=DEFAULT_WEIGHTS):  # noqa: ANN001
    loss = F.cross_entropy(model(x), y, weight=w)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


def _weighted(out, y, *, w=DEFAULT_WEIGHTS):  # noqa: ANN001, ANN202
    return F.cross_entropy(out, y, weight=w)


def helper_default_step(model, optim, x, y):  # noqa: ANN001
    loss = _weighted(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.parametrize("step", [default_step, helper_default_step])
def test_a_tensor_default_argument_is_a_guarded_constant(step, mode):
    """A tensor default of the step or of a helper it calls is read as a global is: it
    was refused before as from "a place the compiled step cannot watch for changes".
    Changed in place, or the defaults replaced, it compiles a new program."""
    saved = (default_step.__defaults__, _weighted.__kwdefaults__)

    def between(i, model, reference):  # noqa: ANN001
        if i == 2:  # replaced whole, as code may assign __defaults__ / __kwdefaults__
            new = torch.tensor([3.0, 2.0, 1.0, 0.5], dtype=torch.float64)
            default_step.__defaults__, _weighted.__kwdefaults__ = (new,), {"w": new}
        if i == 3:  # changed in place
            default_step.__defaults__[0].mul_(2.0)

    try:
        counts = _run(step, mode, between)
    finally:
        default_step.__defaults__, _weighted.__kwdefaults__ = saved
    assert counts == [1, 1, 2, 3]


def weights_first_step(w, model, optim, x, y, *, mask=None):  # noqa: ANN001
    out = model(x) if mask is None else model(x) * mask
    loss = F.cross_entropy(out, y, weight=w)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.parametrize("how", ["positional", "keyword", "keywords_set_whole"])
def test_a_tensor_bound_by_a_partial_is_a_guarded_constant(how, mode):
    """NOTE: [tensors bound by a partial]: ``partial(train_step, class_weights)`` and
    ``partial(step, mask=m)`` were refused as reading a tensor "from a place the
    compiled step cannot watch". Read as a global is: changed in place, or the keyword
    replaced, it compiles a new program computing with the new values. The keywords
    dict put whole by ``__setstate__`` was not seen (the dict read at capture was
    guarded: the old mask ran, parameters 0.105 off eager); ``keywords`` is read anew."""
    weights = torch.tensor([0.5, 1.0, 2.0, 3.0], dtype=torch.float64)
    mask = torch.tensor([1.0, 0.5, 2.0, 1.5], dtype=torch.float64)
    step = (functools.partial(weights_first_step, weights) if how == "positional"
            else functools.partial(weights_first_step, DEFAULT_WEIGHTS.clone(), mask=mask))

    def between(i, model, reference):  # noqa: ANN001
        if i == 2:  # changed in place (not by one factor: a weighted mean would hide it)
            (weights if how == "positional" else mask).add_(torch.tensor([1.0, 0.0, -0.25, 2.0], dtype=torch.float64))
        if i == 3 and how == "keyword":  # a keyword replaced whole
            step.keywords["mask"] = torch.tensor([2.0, 1.0, 1.0, 0.25], dtype=torch.float64)
        if i == 3 and how == "keywords_set_whole":  # the keywords dict replaced whole
            new = {"mask": torch.tensor([2.0, 1.0, 1.0, 0.25], dtype=torch.float64)}
            step.__setstate__((step.func, step.args, new, None))
        if i == 3 and how == "positional":
            weights.mul_(torch.tensor([1.0, 3.0, 1.0, 1.0], dtype=torch.float64))

    assert _run(step, mode, between) == [1, 1, 2, 3]


def _writing_step(model, optim, x, y):  # noqa: ANN001
    model.scale.add_(1.0)
    return weighted_step(model, optim, x, y)


HIDDEN = types.SimpleNamespace(
    a=types.SimpleNamespace(b=types.SimpleNamespace(c=types.SimpleNamespace(d=torch.ones(CLASSES))))
)


def _deep_step(model, optim, x, y):  # noqa: ANN001
    return weighted_step(model, optim, x * HIDDEN.a.b.c.d.sum(), y)


GRAD_WEIGHT = nn.Parameter(torch.ones(CLASSES, dtype=torch.float64))


def _grad_step(model, optim, x, y):  # noqa: ANN001
    loss = F.cross_entropy(model(x) * GRAD_WEIGHT, y)
    loss.backward()
    optim.step()
    return loss.detach()


def _data_setting_step(model, optim, x, y):  # noqa: ANN001
    loss = weighted_step(model, optim, x, y)
    model.linear.weight.data = model.linear.weight.data.clamp(-0.1, 0.1)  # never recorded
    return loss


@pytest.mark.parametrize("step,message", [
    (_writing_step, r"writes in place \(add_\)"),
    (_data_setting_step, r"sets a tensor's \.data"),  # NOTE: [data replaced inside the step]
    (_deep_step, "cannot watch for changes"),
    (_grad_step, "requires grad"),
])
def test_refused_with_the_line_and_nothing_changed(step, message):
    torch.manual_seed(0)
    model = _Scaled().double()
    scale = model.scale.clone()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = sc.compile(make_mode("ddp"))(step)
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError, match=message) as raised:
        compiled(model, optim, *_batches(1)[0])
    assert "test_outside_tensors.py" in str(raised.value)
    assert torch.equal(model.scale, scale)


def _vector_step(model, optim, x, y):  # noqa: ANN001
    """A FedAvg round's start: the weights set from a flat vector (here scaled)."""
    vec = torch.nn.utils.parameters_to_vector(model.parameters()).detach() * 0.5
    torch.nn.utils.vector_to_parameters(vec, model.parameters())
    return weighted_step(model, optim, x, y)


def _vector_copied_step(model, optim, x, y):  # noqa: ANN001
    """The in-place form the refusal of ``_vector_step`` gives."""
    ps = list(model.parameters())
    vec = torch.nn.utils.parameters_to_vector(ps).detach() * 0.5
    with torch.no_grad():
        for p, v in zip(ps, torch.split(vec, [p.numel() for p in ps]), strict=True):
            p.copy_(v.view_as(p))
    return weighted_step(model, optim, x, y)


def test_vector_to_parameters_is_refused_naming_it_with_a_form_that_compiles():
    """torch's helper sets each parameter's ``.data``: the refusal named the assignment,
    which the step never wrote (sixty-sixth session); it names the helper, and the
    step's line calling it, and its hint's form compiles to eager's numbers."""
    torch.manual_seed(0)
    model = _Scaled().double()
    weight = model.linear.weight.detach().clone()
    compiled = sc.compile(make_mode("ddp"))(_vector_step)
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError) as raised:
        compiled(model, torch.optim.SGD(model.parameters(), lr=0.1), *_batches(1)[0])
    assert "calls torch's vector_to_parameters, which sets tensors' .data" in raised.value.message
    assert "vector_to_parameters(vec, model.parameters())" in str(raised.value.user_line)
    assert "p.copy_(v.view_as(p))" in str(raised.value.hint)
    assert torch.equal(model.linear.weight, weight)
    assert _run(_vector_copied_step, "ddp") == [1, 1, 1, 1]


class _Aliased(_Scaled):
    """A plain attribute that is a view of a parameter: eager sees every update."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight_t + self.linear.bias


def test_an_alias_of_a_parameter_is_refused():
    torch.manual_seed(0)
    model = _Aliased().double()
    model.weight_t = model.linear.weight.detach().t()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = sc.compile(make_mode("ddp"))(weighted_step)
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError, match=r"shares memory with\) linear.weight"):
        compiled(model, optim, *_batches(1)[0])


# NOTE: [tensors of modules and classes read by name]: a tensor attribute of the user's
# config module (``cfg.WEIGHTS``) or of a class (``Cfg.WEIGHTS``) that the step names
_CONFIG_SOURCE = '''
import torch
import torch.nn.functional as F

WEIGHTS = torch.tensor([0.5, 1.0, 2.0, 3.0], dtype=torch.float64)


def weighted(out, y):
    return F.cross_entropy(out, y, weight=WEIGHTS)
'''
CFG = types.ModuleType("outside_tensors_cfg")  # the ``config`` fixture sets the module imported from its file


class Cfg:
    WEIGHTS = torch.tensor([0.5, 1.0, 2.0, 3.0], dtype=torch.float64)


def _train(model, optim, loss):  # noqa: ANN001, ANN202
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


def module_attribute_step(model, optim, x, y):  # noqa: ANN001
    return _train(model, optim, F.cross_entropy(model(x), y, weight=CFG.WEIGHTS))


def module_function_step(model, optim, x, y):  # noqa: ANN001
    return _train(model, optim, CFG.weighted(model(x), y))  # its module's global tensor


def class_attribute_step(model, optim, x, y):  # noqa: ANN001
    return _train(model, optim, F.cross_entropy(model(x), y, weight=Cfg.WEIGHTS))


@pytest.fixture
def config(tmp_path, monkeypatch):  # noqa: ANN001, ANN201
    """A config module of the user's, imported from a file; ``Cfg.WEIGHTS`` put back."""
    path = tmp_path / "outside_tensors_cfg.py"
    path.write_text(_CONFIG_SOURCE)
    spec = importlib.util.spec_from_file_location("outside_tensors_cfg", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "outside_tensors_cfg", module)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys.modules[__name__], "CFG", module, raising=False)
    monkeypatch.setattr(Cfg, "WEIGHTS", Cfg.WEIGHTS.clone())
    return module


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.parametrize("alias", [False, True], ids=["alone", "same-named-global"])
@pytest.mark.parametrize("step", [module_attribute_step, module_function_step, class_attribute_step])
def test_a_tensor_of_a_config_module_or_class_is_a_guarded_constant(step, alias, mode, config, monkeypatch):
    """Was refused as read "from a place the compiled step cannot watch"; and where the
    script also held the tensor as a global of the attribute's name (``from cfg import
    WEIGHTS``), the walk took ``cfg.WEIGHTS`` for that global and guarded it there:
    ``cfg.WEIGHTS = new`` ran the old program, silently. Replaced, then changed in
    place, it compiles anew, computing as eager."""
    holder: Any = Cfg if step is class_attribute_step else config
    if alias:  # NOTE: [globals by the bytecode]: not a global the step loads
        monkeypatch.setattr(sys.modules[__name__], "WEIGHTS", holder.WEIGHTS, raising=False)

    def between(i, model, reference):  # noqa: ANN001
        if i == 2:  # replaced
            holder.WEIGHTS = torch.tensor([3.0, 2.0, 1.0, 0.5], dtype=torch.float64)
        if i == 3:  # changed in place
            holder.WEIGHTS.add_(torch.tensor([1.0, 0.0, -0.25, 2.0], dtype=torch.float64))

    assert _run(step, mode, between) == [1, 1, 2, 3]


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_a_constant_found_at_two_places_is_guarded_at_each(mode, config):
    """NOTE: [every place a constant is read from]: ``Cfg.WEIGHTS`` the model also holds
    as a plain attribute (walked first) was guarded only there, so replacing
    ``Cfg.WEIGHTS`` ran the old program."""

    def between(i, model, reference):  # noqa: ANN001
        if i == 0:
            model.weights = reference.weights = Cfg.WEIGHTS
        if i == 2:
            Cfg.WEIGHTS = torch.tensor([3.0, 2.0, 1.0, 0.5], dtype=torch.float64)

    assert _run(class_attribute_step, mode, between) == [1, 1, 2, 2]


class DerivedCfg(Cfg):
    pass


def inherited_attribute_step(model, optim, x, y):  # noqa: ANN001
    return _train(model, optim, F.cross_entropy(model(x), y, weight=DerivedCfg.WEIGHTS))


def test_an_inherited_class_attribute_is_refused_naming_it():
    """``DerivedCfg.WEIGHTS`` held by the base ``Cfg``: ``DerivedCfg.WEIGHTS = new``
    would shadow it where no guard watches, so it is refused, naming both classes."""
    torch.manual_seed(0)
    model = _Scaled().double()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = sc.compile(make_mode("ddp"))(inherited_attribute_step)
    message = r"attribute 'WEIGHTS' of class DerivedCfg, inherited from class Cfg"
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError, match=message) as raised:
        compiled(model, optim, *_batches(1)[0])
    assert "test_outside_tensors.py" in str(raised.value)


def base_and_inherited_step(model, optim, x, y):  # noqa: ANN001
    scale = Cfg.WEIGHTS.sum() / Cfg.WEIGHTS.sum().detach()
    return _train(model, optim, scale * F.cross_entropy(model(x), y, weight=DerivedCfg.WEIGHTS))


def test_an_inherited_class_attribute_also_read_from_its_base_is_refused():
    """``Cfg.WEIGHTS`` (guarded) and ``DerivedCfg.WEIGHTS`` (the same tensor, inherited):
    the guard on ``Cfg`` did not see ``DerivedCfg.WEIGHTS = new``, and the old program
    ran (a review: parameters 5e-2 off eager, no warning); refused as the inherited one."""
    torch.manual_seed(0)
    model = _Scaled().double()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = sc.compile(make_mode("ddp"))(base_and_inherited_step)
    message = r"attribute 'WEIGHTS' of class DerivedCfg, inherited from class Cfg"
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError, match=message):
        compiled(model, optim, *_batches(1)[0])
