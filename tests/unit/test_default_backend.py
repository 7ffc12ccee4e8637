"""backend="auto" (the default) resolves by device (NOTE: [default backend]), and the test
backend comes from SPMD_TEST_BACKEND (NOTE: [test backend])."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import spmd_compiler as sc
from spmd_compiler.errors import SPMDCompileError
from spmd_compiler.lower import LoweringOptions, resolve_backend
from spmd_compiler.tools.demo.steps import classification_train_step
from spmd_compiler.tools.parity import TEST_BACKEND_ENV, backend_under_test


def test_auto_is_inductor_on_cuda_and_eager_on_cpu() -> None:
    assert LoweringOptions().backend == "auto"
    assert LoweringOptions().for_device("cuda").backend == "inductor"
    assert LoweringOptions().for_device("cpu").backend == "eager"
    assert resolve_backend("inductor", "cpu") == "inductor"
    assert resolve_backend("eager", "cuda") == "eager"


def test_default_compile_resolves_auto_for_the_model_device() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    step = sc.compile()(classification_train_step)
    with sc.simulate(world_size=2):
        step(model, optim, torch.randn(4, 4), torch.randint(0, 2, (4,)))
    assert step.lowering.backend == "auto"
    assert step.last_program.executable.step.options.backend == "eager"


def test_cuda_graphs_refused_only_with_eager() -> None:
    with pytest.raises(SPMDCompileError, match="cuda_graphs=True needs backend='inductor'"):
        sc.compile(backend="eager", cuda_graphs=True)
    assert LoweringOptions("auto", cuda_graphs=True).for_device("cuda").backend == "inductor"


def test_backend_under_test_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TEST_BACKEND_ENV, raising=False)
    assert backend_under_test() == "eager"
    monkeypatch.setenv(TEST_BACKEND_ENV, "inductor")
    assert backend_under_test() == "inductor"
    monkeypatch.setenv(TEST_BACKEND_ENV, "tvm")
    with pytest.raises(ValueError, match="SPMD_TEST_BACKEND='tvm'"):
        backend_under_test()


def test_inductor_under_simulation_says_it_interprets(caplog: pytest.LogCaptureFixture) -> None:
    """Simulated ranks run the interpreter whatever the backend (NOTE: [lowering]); a
    parity check there does not run Inductor's kernels, and the log now says so."""
    from spmd_compiler.lower import _say_simulation_interprets

    _say_simulation_interprets.cache_clear()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    step = sc.compile(backend="inductor")(classification_train_step)
    with caplog.at_level("WARNING", logger="spmd_compiler.lower"), sc.simulate(world_size=2):
        for _ in range(2):
            step(model, optim, torch.randn(4, 4), torch.randint(0, 2, (4,)))
    said = [r for r in caplog.records if "simulated ranks run the program in the interpreter" in r.getMessage()]
    assert len(said) == 1
