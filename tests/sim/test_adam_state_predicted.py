"""NOTE: [Adam's first state predicted] (``capture/initial_state.py``).

torch's Adam and AdamW get their first state put in before the one trace of the step,
not made by a first trace. Checked here, on 2 simulated ranks against the undecorated
step on one device:

- for each setting (amsgrad, weight decay, maximize, two parameter groups, two
  optimizers, float32 and float64, ddp / fsdp / tp): the predicted state and the
  captured program are the ones the first trace makes (the same entries and values, the
  same graph code), with one program and eager's losses and state;
- a parameter that gets no gradient, and a call that does not step (gradient
  accumulation): Adam makes them no state, and the program leaves it out;
- where the prediction would be wrong, the trace shows it and the two traces run as
  before, exact: a step that
  reads ``len(optimizer.state)`` before stepping (its first eager call takes another
  way: two programs), ``optimizer.state_dict()`` read inside the step, and a subclass of
  Adam (not predicted: its first step may differ).
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.capture import initial_state
from spmd_compiler.parallel_modes import DataParallel, TensorParallel
from spmd_compiler.tools.demo.steps import classification_train_step
from spmd_compiler.tools.parity import compare_states, full_state

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


class Net(nn.Module):
    def __init__(self, unused: bool = False) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.down = nn.Linear(16, 4)
        self.spare = nn.Linear(4, 4) if unused else None  # gets no gradient

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.norm(F.gelu(self.up(x))))


def _two_step(model, optims, x, y):  # noqa: ANN001
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    for optim in optims:
        optim.step()
        optim.zero_grad()
    return loss


def _counting_step(model, optim, x, y):  # noqa: ANN001
    """Its first eager call scales the loss: the state is empty only then."""
    loss = F.cross_entropy(model(x), y)
    if len(optim.state) == 0:
        loss = loss * 0.5
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _state_dict_step(model, optim, x, y):  # noqa: ANN001
    loss = F.cross_entropy(model(x), y) * (1.0 + 0.1 * len(optim.state_dict()["state"]))
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


class MyAdam(torch.optim.Adam):
    pass


def _groups(m):  # noqa: ANN001, ANN202
    return [
        {"params": m.up.parameters(), "lr": 1e-2, "amsgrad": True},
        {"params": [*m.norm.parameters(), *m.down.parameters()], "lr": 3e-3, "weight_decay": 0.2},
    ]


SETTINGS = {
    "adam": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2),
    "adam_amsgrad_decay": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, amsgrad=True, weight_decay=0.1),
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
    "adamw_maximize": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, maximize=True, betas=(0.8, 0.99)),
    "adamw_groups": lambda m: torch.optim.AdamW(_groups(m)),
}


def _run(make_opt, *, mode=None, dtype=torch.float64, step=classification_train_step, unused=False, steps=3):  # noqa: ANN001
    torch.manual_seed(0)
    model = Net(unused).to(dtype)
    ref = copy.deepcopy(model)
    optim, ref_optim = make_opt(model), make_opt(ref)
    batches = [(torch.randn(8, 8, dtype=dtype), torch.randint(0, 4, (8,))) for _ in range(steps)]
    want = [step(ref, ref_optim, x, y).item() for x, y in batches]
    compiled = sc.compile(parallel_mode=mode or DataParallel("replicate"))(step)
    with sc.simulate(world_size=2) as sim:
        got = [compiled(model, optim, x, y).item() for x, y in batches]
        pairs = zip(optim, ref_optim, strict=True) if isinstance(optim, list) else [(optim, ref_optim)]
        states = {
            f"{k}.{i}": v for i, (o, r) in enumerate(pairs)
            for k, v in compare_states(full_state(model, o, sim), full_state(ref, r, None)).items()
        }
    tol = TOL[dtype]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < tol
    worst = max(states.items(), key=lambda kv: kv[1])
    assert worst[1] < tol, worst
    return compiled


def _first(compiled):  # noqa: ANN001, ANN202
    return compiled.records[0].program.captured


def _traced_only(monkeypatch):  # noqa: ANN001, ANN202
    monkeypatch.setattr(initial_state, "predicted", lambda bindings: None)


MODES = {
    "ddp": lambda: DataParallel("replicate"),
    "fsdp": lambda: DataParallel("fully_shard"),
    "tp": lambda: TensorParallel({"up": "colwise", "down": "rowwise"}),
}


# float64 under every mode, float32 once
_MODE_DTYPES = [(mode, torch.float64) for mode in MODES] + [("ddp", torch.float32)]


@pytest.mark.parametrize(("mode", "dtype"), _MODE_DTYPES, ids=[f"{m}-{str(d)[6:]}" for m, d in _MODE_DTYPES])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_the_predicted_state_is_what_the_first_trace_makes(name, mode, dtype, monkeypatch):
    predicted = _run(SETTINGS[name], mode=MODES[mode](), dtype=dtype)
    assert predicted.compile_count == 1
    made = _first(predicted).made_state
    assert made is not None and made.predicted
    with monkeypatch.context() as m:
        _traced_only(m)
        traced = _run(SETTINGS[name], mode=MODES[mode](), dtype=dtype)
    assert traced.compile_count == 1
    assert not _first(traced).made_state.predicted
    want = _first(traced).made_state.entries
    assert [(oi, n, k) for oi, n, k, _ in made.entries] == [(oi, n, k) for oi, n, k, _ in want]
    for (*_, a), (*_, b) in zip(made.entries, want, strict=True):
        assert (a.shape, a.dtype, a.device) == (b.shape, b.dtype, b.device) and torch.equal(a, b)
    assert _first(predicted).graph_module.code == _first(traced).graph_module.code
    assert _first(predicted).inputs == _first(traced).inputs


def test_two_optimizers(monkeypatch):
    def make(m):  # noqa: ANN001, ANN202
        return [torch.optim.Adam(m.up.parameters(), lr=1e-2),
                torch.optim.AdamW([*m.norm.parameters(), *m.down.parameters()], lr=2e-2)]

    compiled = _run(make, step=_two_step)
    assert compiled.compile_count == 1 and _first(compiled).made_state.predicted
    with monkeypatch.context() as m:
        _traced_only(m)
        traced = _run(make, step=_two_step)
    assert _first(compiled).graph_module.code == _first(traced).graph_module.code


def test_a_parameter_without_a_gradient_gets_no_state(monkeypatch):
    """Adam makes it no state: the trace shows its predicted state unread, and the
    program leaves it out, as the first trace's does (the same program)."""
    compiled = _run(SETTINGS["adamw"], unused=True)
    assert compiled.compile_count == 1
    made = _first(compiled).made_state
    assert made is not None and made.predicted
    assert not any(name.startswith("spare") for _, name, _, _ in made.entries)
    with monkeypatch.context() as m:
        _traced_only(m)
        traced = _run(SETTINGS["adamw"], unused=True)
    assert _canonical(_first(compiled)) == _canonical(_first(traced))
    assert _first(compiled).inputs == _first(traced).inputs


def _canonical(captured) -> str:  # noqa: ANN001
    """The program's code with its inputs named by position (an input taken out leaves
    a gap in the names)."""
    names: dict[str, str] = {}
    return re.sub(r"\barg\d+_\d+\b", lambda m: names.setdefault(m.group(), f"input{len(names)}"),
                  captured.graph_module.code)


def _accumulating_step(model, optim, x, y, last):  # noqa: ANN001
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    if last:
        optim.step()
        optim.zero_grad()
    return loss


def test_a_call_that_does_not_step_makes_no_state(monkeypatch):
    """Gradient accumulation: the calls that only accumulate make no optimizer state
    (eager's do not), those that step make it; each program is traced once. Three
    programs: accumulating before any state, stepping, accumulating beside the state."""
    from spmd_compiler.capture import trace

    traces = []
    original = trace._trace_first
    monkeypatch.setattr(trace, "_trace_first", lambda *a, **k: traces.append(1) or original(*a, **k))
    torch.manual_seed(0)
    model = Net().double()
    ref = copy.deepcopy(model)
    optim, ref_optim = SETTINGS["adamw"](model), SETTINGS["adamw"](ref)
    compiled = sc.compile(parallel_mode=DataParallel("replicate"))(_accumulating_step)
    with sc.simulate(world_size=2) as sim:
        for call in range(4):
            x, y = torch.randn(8, 8, dtype=torch.float64), torch.randint(0, 4, (8,))
            last = call % 2 == 1
            got = compiled(model, optim, x, y, last).item()
            want = _accumulating_step(ref, ref_optim, x, y, last).item()
            assert abs(got - want) < 1e-10
            if call == 0:
                assert len(optim.state) == 0 and compiled.records[0].program.captured.made_state is None
        states = compare_states(full_state(model, optim, sim), full_state(ref, ref_optim, None))
    assert max(states.values()) < 1e-10
    assert compiled.compile_count == 3 and len(traces) == 3
    assert compiled.records[1].program.captured.made_state.predicted


def test_a_step_that_reads_the_state_count_is_traced():
    """Predicted, its first program would not scale the loss; traced, the first and the
    steady programs differ: two programs, each exact."""
    compiled = _run(SETTINGS["adam"], step=_counting_step)
    assert compiled.compile_count == 2
    assert _first(compiled).made_state is None


def test_a_step_that_reads_the_state_dict_is_traced():
    compiled = _run(SETTINGS["adamw"], step=_state_dict_step)
    assert compiled.compile_count == 2


def test_a_subclass_of_adam_is_traced():
    compiled = _run(lambda m: MyAdam(m.parameters(), lr=1e-2))
    assert compiled.compile_count == 1
    assert not _first(compiled).made_state.predicted


def test_an_empty_state_dict_read_before_the_first_call_is_no_state():
    """``optimizer.state[p]`` read before training makes an empty dict (a defaultdict):
    Adam's first step still makes the state, and so does the prediction."""
    def make(m):  # noqa: ANN001, ANN202
        optim = torch.optim.AdamW(m.parameters(), lr=1e-2)
        assert len(optim.state[m.up.weight]) == 0
        return optim

    compiled = _run(make)
    assert compiled.compile_count == 1 and _first(compiled).made_state.predicted
