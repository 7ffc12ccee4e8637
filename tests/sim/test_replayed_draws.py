"""A checkpointed block's recompute draws its forward's numbers (NOTE: [draws replayed by
a restored generator]).

Eagerly ``torch.utils.checkpoint`` restores the generator before the recompute, so a
checkpointed dropout block trains exactly as the same block without checkpointing. The
compiled program's draws are not eager's (NOTE: [random numbers]), so the check is the
same property: the compiled checkpointed step against the compiled plain step, same
seed, float64, equal to the last bit. Before, the recompute drew new masks: the update was
the gradient of another forward (1.1e-2 off).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import spmd_compiler as sc
from spmd_compiler.errors import SPMDCompileError
from spmd_compiler.parallel_modes import make_mode
from spmd_compiler.tools.demo.steps import classification_train_step as step


class Block(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.inp, self.mid, self.out = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.how = how

    def body(self, h: torch.Tensor) -> torch.Tensor:
        h = F.dropout(torch.tanh(self.mid(h)), 0.5, self.training) + h
        return h + 0.1 * torch.randn_like(h)  # a second kind of draw

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(self.inp(x), 0.2, self.training)  # drawn before the block
        if self.how == "plain":
            h = self.body(h)
        else:
            h = checkpoint(self.body, h, use_reentrant=self.how == "reentrant")
        return self.out(F.dropout(h, 0.3, self.training))  # drawn after the recompute's fork


def _train(how: str, mode: str, sim_world: int = 2):  # noqa: ANN202
    torch.manual_seed(0)
    model = Block(how).double()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = sc.compile(make_mode(mode))(step)
    gen = torch.Generator().manual_seed(1)
    losses = []
    with sc.simulate(world_size=sim_world):
        for i in range(3):
            x = torch.randn(8, 8, generator=gen, dtype=torch.float64)
            y = torch.randint(0, 4, (8,), generator=gen)
            torch.manual_seed(100 + i)
            losses.append(float(compiled(model, optim, x, y)))
        state = sc.checkpoint.full_state_dict(model)["model"]
    return state, losses


@pytest.mark.parametrize("how", ["reentrant", "non_reentrant"])
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_a_checkpointed_dropout_block_trains_as_the_plain_block(how, mode):
    plain, plain_losses = _train("plain", mode)
    state, losses = _train(how, mode)
    assert losses == plain_losses
    assert plain.keys() == state.keys()
    assert all(torch.equal(state[k], plain[k]) for k in plain)


class Diverging(nn.Module):
    """A block that draws another shape when its recompute runs with gradients on."""

    def __init__(self) -> None:
        super().__init__()
        self.pre, self.lin = nn.Linear(8, 8), nn.Linear(8, 4)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        noise = torch.rand(x.shape[0], 8) if torch.is_grad_enabled() else torch.rand(x.shape[0], 1)
        return self.lin(x * noise.to(x.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.body, self.pre(x), use_reentrant=True)


def test_a_recompute_drawing_otherwise_is_refused():
    model = Diverging().double()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 8, dtype=torch.float64), torch.randint(0, 4, (8,))
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError) as info:
        sc.compile(make_mode("ddp"))(step)(model, optim, x, y)
    message = str(info.value)
    assert "not the same draw" in message and "aten.rand" in message
    assert "torch.rand(x.shape[0], 8)" in message  # the user's line


class Forked(nn.Module):
    """Draws inside ``torch.random.fork_rng()`` and again after it: eagerly the same
    numbers, so the noise cancels and the step is deterministic."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        with torch.random.fork_rng():
            first = torch.randn_like(h)
        return h + first - torch.randn_like(h)


def test_a_draw_after_fork_rng_repeats_the_draw_inside_it():
    """The program drew anew after the fork (5.14 off eager); now exactly eager's step."""
    torch.manual_seed(0)
    model = Forked().double()
    reference = Forked().double()
    reference.load_state_dict(model.state_dict())
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
    compiled = sc.compile(make_mode("ddp"))(step)
    gen = torch.Generator().manual_seed(1)
    with sc.simulate(world_size=2):
        for _ in range(2):
            x = torch.randn(8, 8, generator=gen, dtype=torch.float64)
            y = torch.randint(0, 4, (8,), generator=gen)
            got, want = float(compiled(model, optim, x, y)), float(step(reference, ref_optim, x, y))
            assert abs(got - want) < 1e-12 * abs(want)


class Peeking(nn.Module):
    """A step's own ``fork_rng`` block that peeks at a draw of another shape, then dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.random.fork_rng():
            peek = torch.rand(3)
        return F.dropout(self.lin(x), 0.5, self.training) + 0 * peek.sum().to(x.dtype)


def test_another_draw_after_a_steps_own_fork_rng_is_refused():
    """After a restore that is not checkpointing's, a draw of another shape at a drawn
    position: eager's generator then ends after the dropout alone, the program's after
    both draws (NOTE: [a step's own fork_rng]). It was drawn anew, silently; now refused."""
    model = Peeking().double()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 8, dtype=torch.float64), torch.randint(0, 4, (8,))
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError) as info:
        sc.compile(make_mode("ddp"))(step)(model, optim, x, y)
    message = str(info.value)
    assert "fork_rng" in message and "F.dropout(self.lin(x)" in message


def _noise_step(model, optim, x, y):  # noqa: ANN001, ANN202
    with torch.random.fork_rng():
        noise = torch.randn_like(x)
    loss = F.mse_loss(model(x + noise), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss, noise.sum()


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_a_fork_rng_block_draws_the_same_noise_every_call_as_eagerly(mode):
    """Every draw of the step inside ``fork_rng``: eagerly the same noise every call and
    the generator untouched by the step. The compiled step advanced the generator: new
    noise every call, and ``torch.rand(3)`` after 3 calls was not eager's. Now the runtime
    sets the generator back after every call (NOTE: [a step's own fork_rng])."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2).double()
    reference = nn.Linear(4, 2).double()
    reference.load_state_dict(model.state_dict())
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
    torch.manual_seed(1)
    eager = [[float(t) for t in _noise_step(reference, ref_optim, x, y)] for _ in range(3)]
    eager_after = torch.rand(3)
    compiled = sc.compile(make_mode(mode))(_noise_step)
    torch.manual_seed(1)
    with sc.simulate(world_size=2):
        got = [[float(t) for t in compiled(model, optim, x, y)] for _ in range(3)]
    assert torch.equal(torch.rand(3), eager_after)
    assert got[0][1] == got[1][1] == got[2][1] == eager[0][1]
    for (loss, _), (want, _) in zip(got, eager, strict=True):
        assert abs(loss - want) <= 1e-12 * abs(want)


def _drawn_before_and_inside(model, optim, x, y):  # noqa: ANN001, ANN202
    h = F.dropout(x, 0.5)
    with torch.random.fork_rng():
        noise = torch.randn_like(h)
    loss = F.mse_loss(model(h + noise), y)
    loss.backward()
    optim.step()
    return loss


def test_draws_before_a_fork_rng_block_only_are_refused():
    """Eager's generator ends after the dropout, the program's after the dropout and the
    block's noise: refused, naming fork_rng and the block's line."""
    model = nn.Linear(4, 2).double()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError) as info:
        sc.compile(make_mode("ddp"))(_drawn_before_and_inside)(model, optim, x, y)
    message = str(info.value)
    assert "fork_rng" in message and "with torch.random.fork_rng()" in message
    assert optim.state == {}
