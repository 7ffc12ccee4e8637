"""``if``s on random draws alone (LayerDrop): a few compile a program per way, more are
refused on the first call (NOTE: [ifs on random draws alone] in
``capture/value_checks.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import spmd_compiler as sc
from spmd_compiler.capture.value_checks import MAX_COIN_BRANCHES, drawn_alone
from spmd_compiler.errors import SPMDCompileError
from spmd_compiler.parallel_modes import make_mode
from spmd_compiler.tools.demo.steps import classification_train_step as _step

BATCH, WIDTH = 8, 6


class LayerDropStack(nn.Module):
    """Layers skipped at random in training, as transformers' LayerDrop does."""

    def __init__(self, layers: int, layerdrop: float) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(layers))
        self.head = nn.Linear(WIDTH, 3)
        self.layerdrop = layerdrop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.training and self.layerdrop > 0.0:
                dropout_probability = torch.rand([])
                if dropout_probability < self.layerdrop:  # skip this layer
                    continue
            x = torch.tanh(layer(x))
        return self.head(x)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(BATCH, WIDTH, dtype=torch.float64), torch.randint(0, 3, (BATCH,))


def _model(layers: int, layerdrop: float) -> nn.Module:
    torch.manual_seed(0)
    return LayerDropStack(layers, layerdrop).double()


def test_more_coin_branches_than_programs_are_refused_on_the_first_call() -> None:
    model = _model(MAX_COIN_BRANCHES + 1, layerdrop=0.1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    compiled = sc.compile(make_mode("ddp"))(_step)
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError) as info:
        compiled(model, optim, *_batch())
    message = str(info.value)
    assert f"branches on random draws alone at more than {MAX_COIN_BRANCHES} `if`s" in message
    assert "if dropout_probability < self.layerdrop:" in message
    assert "layerdrop to 0" in message
    assert compiled.compile_count == 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not optim.state


def test_no_layerdrop_compiles_once() -> None:
    """The refusal's advice: with ``layerdrop=0`` the step draws nothing to branch on."""
    model = _model(MAX_COIN_BRANCHES + 1, layerdrop=0.0)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = sc.compile(make_mode("ddp"))(_step)
    with sc.simulate(world_size=2):
        for _ in range(3):
            compiled(model, optim, *_batch())
    assert compiled.compile_count == 1


def test_a_few_coin_branches_run_a_program_per_way() -> None:
    model = _model(2, layerdrop=0.5)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = sc.compile(make_mode("ddp"))(_step)
    torch.manual_seed(3)
    with sc.simulate(world_size=2):
        losses = [compiled(model, optim, *_batch()) for _ in range(6)]
    assert all(torch.isfinite(torch.as_tensor(loss)) for loss in losses)
    assert 1 <= compiled.compile_count <= 2 ** 2


def test_drawn_alone_tells_a_coin_from_a_value_a_draw_touches() -> None:
    seen: dict[str, bool] = {}

    def traced(x: torch.Tensor) -> torch.Tensor:
        seen["coin"] = drawn_alone(torch.rand([]) < 0.5)
        seen["scaled coin"] = drawn_alone(torch.rand([]) * 2 < torch.ones(()))
        seen["dropout then data"] = drawn_alone(F.dropout(x, 0.5).sum() > 0)
        seen["data"] = drawn_alone(x.sum() > 0)
        seen["constant"] = drawn_alone(torch.ones(()) > 0)
        return x

    make_fx(traced, tracing_mode="fake")(torch.randn(4))
    assert seen == {
        "coin": True, "scaled coin": True, "dropout then data": False, "data": False,
        "constant": False,
    }
