"""NOTE: [code generated once]: a compile generates the Python code of the program it
runs, not of every graph module it traces and rewrites on the way; the program runs and
compares as before."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.fx
import torch.nn as nn

import spmd_compiler as sc
from spmd_compiler import _torch_private as private
from spmd_compiler.parallel_modes import DataParallel
from spmd_compiler.tools.demo.steps import classification_batches, classification_train_step


def _compile_and_run(monkeypatch: pytest.MonkeyPatch, lazy: bool) -> tuple[int, list[float], str]:
    """(code generations during one compile and its first call, the losses of three
    steps, the program's code) of a small MLP under ddp on 2 simulated ranks."""
    if not lazy:
        monkeypatch.setattr(private, "lazy_graph_modules", contextlib.nullcontext)
    generated = 0
    real = torch.fx.GraphModule.recompile

    def counting(self: torch.fx.GraphModule) -> object:
        nonlocal generated
        generated += 1
        return real(self)

    monkeypatch.setattr(torch.fx.GraphModule, "recompile", counting)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).double()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = sc.compile(parallel_mode=DataParallel("replicate"))(classification_train_step)
    batches = classification_batches(3, 8, 8, 4, torch.float64)
    with sc.simulate(world_size=2):
        losses = [float(step(model, optim, *batches[0]))]
        first_call = generated
        losses += [float(step(model, optim, *b)) for b in batches[1:]]
    monkeypatch.undo()
    program = step.records[0].program.graph_module
    return first_call, losses, program.code


def test_a_compile_generates_the_code_of_what_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    eager_count, eager_losses, eager_code = _compile_and_run(monkeypatch, lazy=False)
    lazy_count, lazy_losses, lazy_code = _compile_and_run(monkeypatch, lazy=True)
    # every traced or rewritten graph module generated its code before (10 on this step)
    assert eager_count >= 6, eager_count
    # now the programs run: the per-rank program, and the pieces the runtime splits off
    assert lazy_count <= 3, lazy_count
    assert lazy_code == eager_code
    assert lazy_losses == eager_losses


def test_graph_modules_made_inside_are_usable_outside() -> None:
    """A graph module traced inside runs, prints, copies and pickles after the context."""
    import pickle

    from torch.fx.experimental.proxy_tensor import make_fx

    with private.lazy_graph_modules():
        gm = make_fx(lambda x: torch.sin(x) * 2)(torch.randn(3))
        gm.recompile()  # only marks it
    x = torch.randn(3)
    assert torch.equal(gm(x), torch.sin(x) * 2)
    assert "sin" in gm.code
    assert torch.equal(copy.deepcopy(gm)(x), gm(x))
    assert torch.equal(pickle.loads(pickle.dumps(gm))(x), gm(x))
