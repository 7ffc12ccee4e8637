"""The compile cache's key before capture (NOTE: [cache key before capture], issue 16).

A second compiled step with the same code, values and settings (a restarted job) loads
its program without tracing the step, and computes exactly what the first computed and
what one device computes eagerly. Each change a capture depends on must miss that key:
then the step is captured again, and the numbers follow the change.
"""

from __future__ import annotations

import copy
import functools
import importlib
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler import _torch_private as private
from spmd_compiler.parallel_modes import DataParallel
from spmd_compiler.tools.demo.steps import classification_train_step
from spmd_compiler.tools.parity import full_state, relative_difference
from tests.sim.test_compile_cache import Tempered  # a guarded Python attribute

TOLERANCE = 1e-5
STEPS = 2


def mlp(act: type[nn.Module] = nn.ReLU) -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), act(), nn.Linear(16, 4))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 8, generator=gen), torch.randint(0, 4, (8,), generator=gen))
            for _ in range(STEPS)]


def run(
    cache_dir: Path, make_model: Callable[[], nn.Module] = mlp,
    step_fn: Callable[..., torch.Tensor] = classification_train_step, extra: tuple = (),
    prepare: Callable[[nn.Module], None] = lambda m: None,
) -> tuple[sc.CompiledTrainStep, float]:
    """Compile and run ``step_fn``; returns the step and the largest relative difference
    of its losses and final state from the same steps run eagerly on one device."""
    torch.manual_seed(0)
    model = make_model()
    prepare(model)
    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    step = sc.compile(DataParallel("replicate"), cache_dir=cache_dir)(step_fn)
    worst = 0.0
    with sc.simulate(world_size=2) as sim:
        for x, y in batches():
            loss = step(model, optimizer, x, y, *extra)
            expected = step_fn(reference, ref_optimizer, x, y, *extra)
            worst = max(worst, relative_difference(loss, expected))
        state = full_state(model, optimizer, sim)
    ref_state = full_state(reference, ref_optimizer, None)
    worst = max([worst, *(relative_difference(state[k], ref_state[k]) for k in ref_state)])
    return step, worst


def skipped(step: sc.CompiledTrainStep) -> list[bool]:
    return [r.capture_skipped for r in step.records]


def test_a_restart_skips_the_capture_and_matches_eager(tmp_path: Path) -> None:
    first, error = run(tmp_path)
    assert skipped(first) == [False] and error < TOLERANCE
    # one program (AdamW's state made first): its step entry, by the key the call has
    # with that state, and a state entry by the key it had without (NOTE: [optimizer
    # state made on a restart])
    assert len(list((tmp_path / "steps").glob("*.pt"))) == 1
    assert len(list((tmp_path / "states").glob("*.pt"))) == 1
    second, error = run(tmp_path)
    assert skipped(second) == [True]
    assert [r.cache for r in second.records] == ["hit"]
    assert second.timings.capture_seconds == 0.0 and second.timings.expand_seconds == 0.0
    assert error < TOLERANCE
    # the loaded step's single-device graph is decoded when read, and is the captured one
    loaded = second.records[0].program.captured.graph_module
    captured = first.records[0].program.captured.graph_module
    assert [n.target for n in loaded.graph.nodes] == [n.target for n in captured.graph.nodes]


class FromEnvironment(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * float(os.environ.get("SPMD_STEP_KEY_TEST_SCALE", "1"))


ACTIVATION: Callable[[torch.Tensor], torch.Tensor] = F.relu  # globals a config could set
ACT_MODULE: nn.Module = nn.ReLU()
LOSS = functools.partial(F.cross_entropy, label_smoothing=0.0)


class GloballyActivated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(ACT_MODULE(ACTIVATION(self.fc1(x))))


def partial_loss_step(model, optimizer, x, y):
    loss = LOSS(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _hooked(model: nn.Module) -> None:
    model.register_forward_hook(lambda mod, args, out: out * 2.0)


@pytest.mark.parametrize(
    "first, second",
    [
        ({"make_model": Tempered},
         {"make_model": Tempered, "prepare": lambda m: setattr(m, "temperature", 3.0)}),
        ({}, {"make_model": lambda: mlp(nn.Tanh)}),
        ({}, {"prepare": _hooked}),
        ({"make_model": FromEnvironment}, {"make_model": FromEnvironment, "env": "3"}),
        # NOTE: [links in the key before capture]: each loaded the first job's program
        ({"make_model": GloballyActivated},
         {"make_model": GloballyActivated, "globals": {"ACTIVATION": F.silu}}),
        ({"make_model": GloballyActivated},
         {"make_model": GloballyActivated, "globals": {"ACT_MODULE": nn.SiLU()}}),
        ({"step_fn": partial_loss_step},
         {"step_fn": partial_loss_step,
          "globals": {"LOSS": functools.partial(F.cross_entropy, label_smoothing=0.3)}}),
    ],
    ids=["guarded_value", "module_class", "forward_hook", "environment_variable",
         "global_function", "global_module", "global_partial"],
)
def test_a_change_misses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, first, second) -> None:
    monkeypatch.delenv("SPMD_STEP_KEY_TEST_SCALE", raising=False)
    step, error = run(tmp_path, **first)
    assert error < TOLERANCE
    second = dict(second)
    if "env" in second:
        monkeypatch.setenv("SPMD_STEP_KEY_TEST_SCALE", second.pop("env"))
    for name, value in second.pop("globals", {}).items():
        monkeypatch.setitem(globals(), name, value)
    step, error = run(tmp_path, **second)
    assert skipped(step) == [False]
    assert error < TOLERANCE
    step, error = run(tmp_path, **second)  # the new step's own entry
    assert skipped(step) == [True] and error < TOLERANCE


HELPER = "def scale(x):\n    return x * {}\n"
STEP = '''
import importlib

import torch.nn.functional as F


def train_step(model, optimizer, x, y):
    # the helper is imported by name inside the step: the guard walker does not reach
    # it, only the manifest of loaded modules does
    logits = importlib.import_module("step_key_test_helper").scale(model(x))
    loss = F.cross_entropy(logits, y){}
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss
'''


def write(path: Path, text: str, age: int) -> None:
    """A source file as a restarted job finds it: older than the process (a file
    modified after the process started and not what its module was loaded from is
    never hashed into a key: NOTE: [cache key before capture])."""
    path.write_text(text)
    past = time.time_ns() - age * 1_000_000_000
    os.utime(path, ns=(past, past))


# the helper's scale read from the environment when it is imported (during the capture)
CONFIGURED = 'import os\nFACTOR = float(os.environ.get("SPMD_STEP_KEY_TEST_FACTOR", "2"))\n'


@pytest.mark.parametrize("edit", ["helper", "step", "import_environment"])
def test_edited_code_misses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, edit: str) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("SPMD_STEP_KEY_TEST_FACTOR", raising=False)
    helper, source = tmp_path / "step_key_test_helper.py", tmp_path / "step_key_test_step.py"
    if edit == "import_environment":
        write(helper, CONFIGURED + HELPER.format("FACTOR"), age=7200)
    else:
        write(helper, HELPER.format("2.0"), age=7200)
    write(source, STEP.format(""), age=7200)

    def load() -> Callable[..., torch.Tensor]:
        for name in ("step_key_test_helper", "step_key_test_step"):
            sys.modules.pop(name, None)  # as in a restarted process
        importlib.invalidate_caches()
        return importlib.import_module("step_key_test_step").train_step

    cache = tmp_path / "cache"
    assert skipped(run(cache, step_fn=load())[0]) == [False]
    step, error = run(cache, step_fn=load())
    assert skipped(step) == [True] and error < TOLERANCE
    if edit == "helper":
        write(helper, HELPER.format("30.0"), age=3600)
    elif edit == "import_environment":
        monkeypatch.setenv("SPMD_STEP_KEY_TEST_FACTOR", "30")
    else:
        write(source, STEP.format(" * 0.5"), age=3600)
    step, error = run(cache, step_fn=load())
    assert skipped(step) == [False]
    assert error < TOLERANCE


SETTINGS = {"path": ""}


@functools.cache
def loaded_settings() -> dict:
    """A settings loader called once (a value no guard sees)."""
    with open(SETTINGS["path"]) as f:
        return json.load(f)


class Configured(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * loaded_settings()["scale"]


def test_a_value_read_from_a_settings_file_gets_no_key_before_capture(tmp_path: Path, monkeypatch) -> None:
    """NOTE: [values from outside Python's objects]: a restart with another scale in the
    settings file loaded the first job's program by the key before capture (silently:
    parameters 0.93 relative off eager, a probe). Such a step is captured on every
    restart; its program still comes from the cache when the value is the same."""
    path = tmp_path / "settings.json"
    monkeypatch.setitem(SETTINGS, "path", str(path))
    cache = tmp_path / "cache"
    hows = []
    for scale in (1.0, 3.0, 3.0):
        path.write_text(json.dumps({"scale": scale}))
        loaded_settings.cache_clear()  # a new process
        step, error = run(cache, make_model=Configured)
        assert skipped(step) == [False] and error < TOLERANCE
        hows.append(step.records[0].cache)
    assert hows == ["miss", "miss", "hit"]


def scaled_step(model, optimizer, x, y, scale):
    loss = F.cross_entropy(model(x), y) * scale  # a graph input: not in the key
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def branching_step(model, optimizer, x, y, scale):
    loss = F.cross_entropy(model(x), y)
    if scale > 1.0:  # read by Python: a constant of the program, in the step entry
        loss = loss * 2.0
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def test_float_arguments(tmp_path: Path) -> None:
    run(tmp_path / "a", step_fn=scaled_step, extra=(0.5,))
    step, error = run(tmp_path / "a", step_fn=scaled_step, extra=(2.0,))
    assert skipped(step) == [True] and error < TOLERANCE
    run(tmp_path / "b", step_fn=branching_step, extra=(0.5,))
    step, error = run(tmp_path / "b", step_fn=branching_step, extra=(2.0,))
    assert skipped(step) == [False] and error < TOLERANCE


def test_a_source_edited_while_running_gets_no_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The code in memory may be older than the file: no key is made from it."""
    monkeypatch.syspath_prepend(str(tmp_path))
    helper, source = tmp_path / "step_key_test_helper.py", tmp_path / "step_key_test_step.py"
    write(helper, HELPER.format("2.0"), age=7200)
    write(source, STEP.format(""), age=7200)
    for name in ("step_key_test_helper", "step_key_test_step"):
        sys.modules.pop(name, None)
    train_step = importlib.import_module("step_key_test_step").train_step
    source.write_text(STEP.format(" * 0.5"))  # edited now; the module is not reloaded
    cache = tmp_path / "cache"
    # no key: one program, its optimizer state made first (NOTE: [optimizer state made
    # before the first program])
    assert skipped(run(cache, step_fn=train_step)[0]) == [False]
    assert not list((cache / "steps").glob("*.pt"))
    step, error = run(cache, step_fn=train_step)
    assert skipped(step) == [False] and error < TOLERANCE


@pytest.mark.slow
def test_a_2d_program_reading_the_mesh_coordinate_is_cached(tmp_path: Path) -> None:
    """An fsdp_tp GPT program reads the run-time mesh coordinate (``device_mesh`` op);
    such programs were uncacheable (an operator outside torch's namespaces) and every
    2-D restart compiled again. Now the restart skips capture and expansion. (The head
    planned colwise with its logits replicated: its backward takes this rank's columns
    of the replicated logits' gradient, a slice at the coordinate.)"""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel

    from spmd_compiler.parallel_modes import FullyShardTensorParallel
    from spmd_compiler.tools.demo.gpt import gpt_tp_plan, gpt_train_step
    from spmd_compiler.tools.demo.run import DemoConfig, build

    plan = {**gpt_tp_plan(), "lm_head": ColwiseParallel(output_layouts=Replicate())}
    losses = []
    for _ in range(2):
        model, optim, data = build(DemoConfig(steps=1, n_layer=1))
        step = sc.compile(FullyShardTensorParallel(plan, mesh_shape=(2, 2)),
                          cache_dir=tmp_path)(gpt_train_step)
        with sc.simulate(4):
            losses.append(float(step(model, optim, *data[0])))
    program = step.records[0].program
    if private._coordinate_op_per_rank():  # torch 2.11's programs do not read it at run time
        assert any("coordinate_on_dim" in str(n.target) for n in program.graph_module.graph.nodes)
    assert [r.cache for r in step.records] == ["hit"] and skipped(step) == [True]
    assert losses[0] == losses[1]


def test_a_launchers_main_without_a_file_still_keys_an_imported_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker whose ``__main__`` is a launcher's with no source file (pytest-xdist's
    execnet; before: every step there got no key, so restarts captured again): the step
    and the model come from files, so the key describes them and a restart skips capture.
    A step that lives in such a ``__main__`` still gets none (its code has no file)."""
    import types

    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))
    first, _ = run(tmp_path)
    second, error = run(tmp_path)
    assert skipped(second) == [True] and error < TOLERANCE
    namespace: dict = {"__name__": "__main__", "F": F}
    exec(  # noqa: S102 - a step defined in the interactive __main__
        "def step(model, optim, x, y):\n"
        "    loss = F.cross_entropy(model(x), y)\n    loss.backward()\n"
        "    optim.step()\n    optim.zero_grad()\n    return loss\n",
        namespace,
    )
    interactive, error = run(tmp_path / "interactive", step_fn=namespace["step"])
    assert not list((tmp_path / "interactive" / "steps").glob("*.pt")) and error < TOLERANCE


class _ClassProperty:
    """transformers' ``classproperty`` (on its ``PreTrainedConfig``): a descriptor of a
    library's class holding its getter."""

    def __init__(self, fget: Callable[[type], object]) -> None:
        self.fget = fget

    def __get__(self, obj: object, owner: type) -> object:
        return self.fget(owner)


class _Settings:
    kinds = _ClassProperty(lambda cls: ("scale",))

    def __init__(self) -> None:
        self._scale = 2.0

    @property
    def scale(self) -> float:
        return self._scale


class WithSettings(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.settings = _Settings()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.settings.scale * len(self.settings.kinds)


def test_properties_and_descriptors_of_a_config_class_are_in_the_key(tmp_path: Path) -> None:
    """A config class's properties and descriptors are guarded by identity: the key
    describes them by their code (every transformers model's config class has some, and
    had no key before capture)."""
    run(tmp_path, make_model=WithSettings)
    step, error = run(tmp_path, make_model=WithSettings)
    assert skipped(step) == [True] and error < TOLERANCE


def _scaled_output(scale: float, module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
    return output * scale


def test_a_step_without_a_key_before_capture_makes_its_state_first(tmp_path: Path) -> None:
    """With no key before capture, a restart traces every program anyway: the cache keeps
    the one program of NOTE: [optimizer state made before the first program] (it compiled
    two, one only for the first call)."""
    hooked = lambda m: m.register_forward_hook(functools.partial(_scaled_output, 0.5))  # noqa: E731
    step, error = run(tmp_path, prepare=hooked)
    assert skipped(step) == [False] and [r.cache for r in step.records] == ["miss"] and error < TOLERANCE
    step, error = run(tmp_path, prepare=hooked)
    assert [r.cache for r in step.records] == ["hit"] and error < TOLERANCE


def _tiny_gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config).double()


def _language_model_step(model, optim, ids, _unused):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


def test_a_generative_models_per_process_hash_is_not_in_the_key(tmp_path: Path, monkeypatch) -> None:
    """NOTE: [values of one process]: a generative transformers model holds
    ``generation_config._original_object_hash``, a hash Python salts per process. It
    stays a guard within the process but not in the key, so another process (here the
    same value changed, as another process holds it) loads the program uncaptured."""
    gen = torch.Generator().manual_seed(5)
    ids = [torch.randint(0, 32, (4, 8), generator=gen) for _ in range(STEPS)]
    monkeypatch.setattr(sys.modules[__name__], "batches", lambda: [(i, i) for i in ids])
    first, error = run(tmp_path, make_model=_tiny_gpt2, step_fn=_language_model_step)
    assert not any(skipped(first)) and error < TOLERANCE  # its loss is float32

    def another_process(model: nn.Module) -> None:
        model.generation_config._original_object_hash += 1

    second, error = run(tmp_path, make_model=_tiny_gpt2, step_fn=_language_model_step,
                        prepare=another_process)
    assert all(skipped(second)) and error < TOLERANCE


def test_two_lambdas_a_config_picks_between_are_described_apart() -> None:
    """Functions were described by module and qualified name: ``ACTS = {"a": lambda x: x *
    2.0, "b": lambda x: x * 3.0}`` picked by a config keyed alike (found by a review)."""
    from spmd_compiler.capture.guards import _described

    acts = {"a": lambda x: x * 2.0, "b": lambda x: x * 3.0}
    assert _described(acts["a"]) != _described(acts["b"])
    assert _described(acts["a"]) == _described(acts["a"])
