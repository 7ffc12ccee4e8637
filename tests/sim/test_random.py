"""Dropout in compiled steps: one global draw per seed, whatever the mode and world size
(NOTE: [random numbers] in capture/random_draws.py)."""

from __future__ import annotations

import pytest
import torch

import spmd_compiler as sc
from spmd_compiler.tools.demo.gpt import gpt_train_step
from spmd_compiler.tools.demo.run import DemoConfig, build, demo_mode


def _losses(mode: str, world_size: int, *, seed: int = 123, steps: int = 2, mesh=()) -> list[float]:
    config = DemoConfig(steps=steps, n_layer=1, dropout=0.2, mode=mode, world_size=world_size, mesh=mesh)
    model, optim, data = build(config)
    step = sc.compile(demo_mode(config))(gpt_train_step)
    torch.manual_seed(seed)
    with sc.simulate(world_size):
        return [step(model, optim, x, y).item() for x, y in data]


@pytest.fixture(scope="module")
def single_device() -> list[float]:
    return _losses("ddp", 1)


def test_same_seed_same_run(single_device):
    assert _losses("ddp", 1) == single_device


def test_other_seed_other_masks(single_device):
    assert _losses("ddp", 1, seed=7) != single_device


@pytest.mark.parametrize(
    "mode,world_size",
    [("ddp", 4), ("fsdp", 4), ("tp", 2), ("tp", 4)],
)
def test_shards_take_their_slice_of_one_global_draw(mode, world_size, single_device):
    """Batch shards (ddp/fsdp) and replicas (tp) see the world-1 masks: same losses."""
    got = _losses(mode, world_size)
    assert got == pytest.approx(single_device, rel=1e-5)


def test_two_d_mode_draws_the_same_masks(single_device):
    got = _losses("fsdp_tp", 4, steps=1, mesh=(2, 2))
    assert got == pytest.approx(single_device[:1], rel=1e-5)


def _reseeding_step(model, optim, x):  # noqa: ANN001
    torch.manual_seed(0)  # a reseed in the step's own code
    loss = model(x).square().mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _reseed_refusal(model: torch.nn.Module, step) -> sc.SPMDCompileError:  # noqa: ANN001
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    with sc.simulate(world_size=2), pytest.raises(sc.SPMDCompileError) as info:
        sc.compile()(step)(model, optim, torch.randn(4, 3))
    return info.value


def test_a_reseed_in_the_step_is_refused_with_the_seed_once_advice():
    error = _reseed_refusal(torch.nn.Linear(3, 2), _reseeding_step)
    assert "calls torch.manual_seed()" in str(error) and "torch.manual_seed(0)  # a reseed" in str(error)
    assert "seed once before the first call" in str(error)
    assert "installed package" not in str(error)


def _model_step(model, optim, x):  # noqa: ANN001
    loss = model(x).square().mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def test_a_reseed_in_a_librarys_model_says_no_setting_of_the_step_reaches_it(tmp_path, monkeypatch):
    """transformers' Reformer reseeds in its reversible layers whenever it trains (no
    setting turns it off): the hint said to seed once outside, and the note to change the
    package's configuration; neither could be followed (hfarch angle, sixty-sixth session)."""
    library = tmp_path / "site-packages"
    library.mkdir()
    (library / "reseeding_library.py").write_text(
        "import sys\n\nimport torch\n\n\nclass Reversible(torch.nn.Linear):\n"
        "    def forward(self, x):\n"
        "        self.seed = int(torch.seed() % sys.maxsize)\n"
        "        return super().forward(x)\n"
    )
    monkeypatch.syspath_prepend(str(library))
    import reseeding_library

    error = _reseed_refusal(reseeding_library.Reversible(3, 2), _model_step)
    assert "calls torch.seed()" in str(error) and "torch.seed() % sys.maxsize" in str(error), error
    assert "the code of the installed package 'reseeding_library'" in str(error) and "Reformer" in str(error), error
    assert "seed once before the first call" not in str(error)
    assert "the package's configuration" not in str(error)
