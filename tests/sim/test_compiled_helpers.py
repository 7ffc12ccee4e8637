"""What torch.compile and selective checkpointing leave in a model, under a compiled
step (NOTE: [compiled helpers and selective checkpointing at capture]).

A ``@torch.compile`` helper, a ``torch.compile``d submodule or model: refused before (the
helper with dynamo's "FX to symbolically trace a dynamo-optimized function"); traced as
their Python now, float64 against the plain model on one device. Selective activation
checkpointing around dropout failed at capture ("Tensor cached during selective
activation checkpoint has been mutated"); now it trains as the same block without
checkpointing (same seed, same program draws) and, without dropout, as eager.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import spmd_compiler as sc
from spmd_compiler.parallel_modes import make_mode
from spmd_compiler.tools.demo.steps import classification_train_step as step


def _act(h: torch.Tensor) -> torch.Tensor:
    return torch.tanh(h) * 2


class Net(nn.Module):
    def __init__(self, act=_act) -> None:  # noqa: ANN001
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.act(self.a(x)))


@pytest.fixture
def validation_kept():
    # torch.compile switches torch.distributions' argument validation off for the process
    validating = torch.distributions.Distribution._validate_args
    yield
    torch.distributions.Distribution.set_default_validate_args(validating)


def _batches(n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=gen, dtype=torch.float64), torch.randint(0, 4, (8,), generator=gen))
            for _ in range(n)]


def _state(model: nn.Module, sim) -> dict[str, torch.Tensor]:  # noqa: ANN001
    return {k.replace("_orig_mod.", ""): v for k, v in sc.checkpoint.full_state_dict(model)["model"].items()}


@pytest.mark.parametrize("wrapped", ["helper", "submodule", "model"])
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_torch_compiled_code_in_the_model_trains_as_the_plain_model(wrapped, mode, validation_kept):
    torch.manual_seed(0)
    reference = Net().double()
    model = copy.deepcopy(reference)
    if wrapped == "helper":
        model.act = torch.compile(_act)
    elif wrapped == "submodule":
        model.a = torch.compile(model.a)
    else:
        model = torch.compile(model)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=0.1)
    compiled = sc.compile(make_mode(mode))(step)
    with sc.simulate(world_size=2) as sim:
        for x, y in _batches():
            got, want = compiled(model, optim, x, y), step(reference, ref_optim, x, y)
            assert abs(float(got) - float(want)) < 1e-12
        state = _state(model, sim)
    want_state = reference.state_dict()
    assert state.keys() == want_state.keys()
    assert max(float((state[k] - want_state[k]).abs().max()) for k in state) < 1e-12
    assert compiled.compile_count == 1


def _save_matmuls(ctx, op, *args, **kwargs):  # noqa: ANN001, ANN202
    saved = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


class Selective(nn.Module):
    def __init__(self, p: float, how: str) -> None:
        super().__init__()
        self.a, self.mid, self.b = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.p, self.how = p, how

    def block(self, h: torch.Tensor) -> torch.Tensor:
        return F.dropout(torch.tanh(self.mid(h)), self.p, self.training) + h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.how == "plain":
            h = self.block(h)
        else:
            h = checkpoint(self.block, h, use_reentrant=False,
                           context_fn=lambda: create_selective_checkpoint_contexts(_save_matmuls))
        return self.b(h)


def _train(model: nn.Module, compiled: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    run = sc.compile(make_mode("ddp"))(step) if compiled else step
    losses = []
    with sc.simulate(world_size=2) as sim:
        for i, (x, y) in enumerate(_batches()):
            torch.manual_seed(100 + i)
            losses.append(float(run(model, optim, x, y)))
        state = _state(model, sim) if compiled else dict(model.state_dict())
    return losses, state


@pytest.mark.parametrize("p", [0.0, 0.5])
def test_selective_checkpointing_trains_as_the_plain_block(p):
    torch.manual_seed(0)
    plain = Selective(p, "plain").double()
    selective = copy.deepcopy(plain)
    selective.how = "selective"
    want = _train(copy.deepcopy(plain), compiled=True)
    got = _train(selective, compiled=True)
    assert got[0] == want[0]
    assert all(torch.equal(got[1][k], want[1][k]) for k in want[1])
    if p == 0.0:  # no draws: eager's numbers too
        eager = _train(copy.deepcopy(plain), compiled=False)
        assert max(abs(a - b) for a, b in zip(got[0], eager[0], strict=True)) < 1e-12


def test_transformers_flex_attention_is_refused_with_what_to_do(validation_kept):
    """transformers' attn_implementation="flex_attention" torch.compiles FlexAttention; its
    Python now runs under capture, and the refusal still says to use sdpa."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )
    config._attn_implementation = "flex_attention"
    model = transformers.LlamaForCausalLM(config)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(0, 64, (4, 16))

    def lm_step(model, optim, ids):  # noqa: ANN001, ANN202
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optim.step()
        return loss

    with sc.simulate(world_size=2), pytest.raises(sc.SPMDCompileError) as info:
        sc.compile(make_mode("ddp"))(lm_step)(model, optim, ids)
    assert info.value.hint is not None and "'sdpa'" in info.value.hint


@torch.jit.script
def _scripted_branch(h: torch.Tensor) -> torch.Tensor:
    if bool(h.abs().max() > 0.9):  # a decision on a tensor's value
        return torch.tanh(h) * 2.0
    return torch.tanh(h)


_from_source = torch.jit.CompilationUnit("def act(h: Tensor) -> Tensor:\n    return torch.tanh(h) * 2.0\n").act


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_torch_jit_script_functions_run_their_python_and_decide_per_call(mode):
    """A scripted function with an ``if`` on a tensor's value failed the capture with the
    TorchScript interpreter's bare "RuntimeError:"; it runs its Python now, the ``if`` a
    value check (batches scaled to take both ways). One scripted from a string (no Python
    behind it) runs in the interpreter as before."""
    torch.manual_seed(0)
    for act, scales in ((_scripted_branch, (0.01, 10.0, 0.01, 10.0)), (_from_source, (1.0, 1.0))):
        reference = Net(lambda h, act=act: act(h)).double()  # a ScriptFunction does not deepcopy
        model = copy.deepcopy(reference)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
        compiled = sc.compile(make_mode(mode))(step)
        with sc.simulate(world_size=2) as sim:
            for (x, y), scale in zip(_batches(len(scales)), scales, strict=True):
                got, want = compiled(model, optim, x * scale, y), step(reference, ref_optim, x * scale, y)
                assert abs(float(got) - float(want)) < 1e-12, (act, scale)
            state = _state(model, sim)
        want_state = reference.state_dict()
        assert max(float((state[k] - want_state[k]).abs().max()) for k in state) < 1e-12


def _width_checked(h: torch.Tensor) -> torch.Tensor:
    if h.shape[-1] % 8 != 0:
        raise ValueError("width must be a multiple of 8")
    return torch.tanh(h)


_scripted_check = torch.jit.script(_width_checked)


def _branchy(h: torch.Tensor) -> torch.Tensor:
    if h.sum() > 0:
        return h * 2
    return h


def test_traced_functions_and_scripted_raises_keep_torchscripts_behaviour():
    """A ``torch.jit.trace``d function froze one way through its ``if``: it runs as traced,
    not as its Python (whose ``if`` would go the other way on some batches); a scripted
    function's ``raise`` reaches the step as the ``torch.jit.Error`` TorchScript raises."""
    traced = torch.jit.trace(_branchy, torch.ones(2, 16, dtype=torch.float64))

    def guarded(h: torch.Tensor) -> torch.Tensor:
        try:
            # below 0 always: the Python's `if` goes the way the trace did not freeze
            return traced(_scripted_check(h) - 2.0) if h.shape[-1] == 16 else _scripted_check(h)
        except torch.jit.Error:
            return torch.relu(h)

    torch.manual_seed(0)
    for width in (16, 12):
        reference = Net(guarded).double()
        reference.a = nn.Linear(8, width).double()
        reference.b = nn.Linear(width, 4).double()
        model = copy.deepcopy(reference)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
        compiled = sc.compile(make_mode("ddp"))(step)
        with sc.simulate(world_size=2):
            for x, y in _batches(2):
                got, want = compiled(model, optim, x, y), step(reference, ref_optim, x, y)
                assert abs(float(got) - float(want)) < 1e-12, width
