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


class TeacherForcing(nn.Module):
    """A decoder cell looped over time, fed the gold input or its own prediction on a
    coin flip per step (teacher forcing)."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.GRUCell(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, inp = torch.zeros_like(x), torch.zeros_like(x)
        for _ in range(MAX_COIN_BRANCHES + 1):
            h = self.cell(inp, h)
            inp = x if torch.rand(()) < 0.5 else h
        return self.head(h)


def test_teacher_forcing_coin_branches_are_told_of_torch_where_first() -> None:
    """A teacher-forcing `if` per time step past the limit was told of LayerDrop first
    (sixty-fourth session): LayerDrop is no cause here; torch.where comes first, and
    LayerDrop only as one example."""
    torch.manual_seed(0)
    model = TeacherForcing().double()
    compiled = sc.compile(make_mode("ddp"))(_step)
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError) as info:
        compiled(model, torch.optim.AdamW(model.parameters(), lr=1e-2), *_batch())
    message = str(info.value)
    assert f"branches on random draws alone at more than {MAX_COIN_BRANCHES} `if`s" in message
    assert "is the usual cause" not in message, message
    hint = message.split("what to do:", 1)[1]
    assert hint.strip().startswith("select with torch.where"), hint
    assert hint.index("torch.where") < hint.index("LayerDrop"), hint


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


class Adapted(nn.Module):
    """peft's LoHa / LoKr forward: each adapted layer adds its adapter unless a module
    dropout draw says not to, ``torch.rand(1) > module_dropout``, 0 by default."""

    def __init__(self, layers: int, module_dropout: float, compare: str = "gt") -> None:
        super().__init__()
        self.base = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(layers))
        self.adapters = nn.ModuleList(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers))
        self.head = nn.Linear(WIDTH, 3)
        self.module_dropout, self.compare = module_dropout, compare

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for base, adapter in zip(self.base, self.adapters, strict=True):
            out = base(x)
            draw = torch.rand(1)
            keep = draw > self.module_dropout if self.compare == "gt" else draw < self.module_dropout
            if (not self.training) or (self.training and keep):
                out = out + adapter(x)
            x = torch.tanh(out)
        return self.head(x)


@pytest.mark.parametrize(("module_dropout", "compare"), [(0.0, "gt"), (0.0, "lt"), (1.0, "lt")])
def test_a_coin_that_goes_one_way_whatever_it_draws_is_not_counted(module_dropout, compare) -> None:
    """Refused at 4 adapted layers before the fifty-fourth session ("branches on random
    draws alone"); decided the way it always goes now, one program, eager's numbers (its
    draws too: the program draws the same numbers from the same generator)."""
    import copy

    torch.manual_seed(0)
    model = Adapted(MAX_COIN_BRANCHES + 1, module_dropout, compare).double()
    reference = copy.deepcopy(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
    compiled = sc.compile(make_mode("ddp"))(_step)
    with sc.simulate(world_size=2):
        for i in range(3):
            x, y = _batch()
            torch.manual_seed(10 + i)
            got = compiled(model, optim, x, y)
            torch.manual_seed(10 + i)
            want = _step(reference, ref_optim, x, y)
            assert abs(float(got) - float(want)) < 1e-12, (i, float(got), float(want))
    assert compiled.compile_count == 1
