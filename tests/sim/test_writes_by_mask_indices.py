"""Writes by the indices of a mask (NOTE: [writes by the indices of a mask]).

``final[torch.where(cond)] = 0``, ``final[torch.where(cond)[0]] = 0``,
``final[cond.nonzero().squeeze(1)] = 0`` and ``final.index_put_(torch.where(cond), v)``
(pytorch-metric-learning's CircleLoss zeroing the anchors without a positive) are
``final[cond] = 0``: they match the undecorated step on one device on the global batch
(float64, within 1e-12; ddp and fsdp, 2 simulated ranks, 3 calls, batches with and
without such anchors). Indices changed in value are torch's own: a call with a false
element raises, nothing is guessed.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.errors import SPMDRuntimeError
from spmd_compiler.parallel_modes import make_mode
from spmd_compiler.tools.parity import run_against_eager

TOL = 1e-12


def _zeroed(kind: str, final: torch.Tensor, cond: torch.Tensor) -> None:
    if kind == "mask":
        final[cond] = 0
    elif kind == "where":
        final[torch.where(cond)] = 0
    elif kind == "where0":
        final[torch.where(cond)[0]] = 0
    elif kind == "nonzero":
        final[cond.nonzero().squeeze(1)] = 0
    elif kind == "index_put_":
        final.index_put_(torch.where(cond), torch.zeros((), dtype=final.dtype))
    elif kind == "shifted":  # not the mask's indices
        final[(torch.where(cond)[0] + 1) % final.shape[0]] = 0
    else:
        raise ValueError(kind)


def _step(kind: str):  # noqa: ANN202
    def step(model, optim, x, y):  # noqa: ANN001
        z = F.normalize(model(x))
        sim = z @ z.T
        same = (y[:, None] == y[None]) & ~torch.eye(x.shape[0], dtype=torch.bool)
        losses = F.softplus(torch.logsumexp(sim.masked_fill(~same, -1e9), 1) - torch.logsumexp(sim, 1))
        cond = same.sum(1) == 0  # anchors without a positive
        final = torch.ones_like(losses)
        _zeroed(kind, final, cond)
        loss = (losses * final).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss.detach()

    return step


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    labels = [[0, 0, 1, 1, 2, 3, 3, 4], [0, 1, 1, 2, 2, 3, 3, 0], [5, 0, 1, 1, 2, 2, 0, 6]]
    return [(torch.randn(8, 8, generator=gen, dtype=torch.float64), torch.tensor(y)) for y in labels]


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.parametrize("kind", ["mask", "where", "where0", "nonzero", "index_put_"])
def test_a_write_by_the_indices_of_a_mask_matches_one_device(kind, mode):
    torch.manual_seed(0)
    pairs, differences, compiled = run_against_eager(
        nn.Linear(8, 6).double(), _step(kind), make_mode(mode), _batches(), lr=0.5
    )
    for i, (loss, expected) in enumerate(pairs):
        assert torch.allclose(loss, expected, rtol=TOL, atol=0), f"step {i}"
    assert max(differences.values()) < TOL, differences
    assert compiled.compile_count == 1


def test_indices_changed_in_value_are_torchs_own():
    torch.manual_seed(0)
    model = nn.Linear(8, 6).double()
    optim = torch.optim.SGD(model.parameters(), lr=0.5)
    compiled = sc.compile(make_mode("ddp"))(_step("shifted"))
    with sc.simulate(world_size=2), pytest.raises(SPMDRuntimeError, match="MaskWithFalseElements"):
        for x, y in _batches():
            compiled(model, optim, x, y)


# NOTE: [rows written by a mask that cannot fit]: the PyTorch DQN tutorial's target
def _dqn_step(form: str):  # noqa: ANN202
    def step(q, target, optim, s, a, r, non_final, next_states):  # noqa: ANN001
        chosen = q(s).gather(1, a)
        next_values = torch.zeros(s.shape[0], dtype=s.dtype)
        with torch.no_grad():
            if form == "tutorial":  # next_states: the non-final rows alone
                next_values[non_final] = target(next_states).max(1).values
            else:  # next_states: every row, selected by the same mask
                next_values[non_final] = target(next_states[non_final]).max(1).values
        loss = F.smooth_l1_loss(chosen, (next_values * 0.99 + r).unsqueeze(1))
        optim.zero_grad()
        loss.backward()
        optim.step()
        return loss

    return step


def _dqn_batches(form: str) -> list[tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(2)
    masks = [[1, 1, 0, 1, 1, 1, 0, 1], [1, 1, 1, 1, 1, 1, 1, 1], [0, 1, 1, 0, 1, 1, 1, 1]]
    out = []
    for m in masks:
        mask = torch.tensor(m, dtype=torch.bool)
        nxt = torch.randn(8, 4, generator=gen, dtype=torch.float64)
        out.append((
            torch.randn(8, 4, generator=gen, dtype=torch.float64), torch.randint(0, 2, (8, 1), generator=gen),
            torch.randn(8, generator=gen, dtype=torch.float64), mask, nxt[mask] if form == "tutorial" else nxt,
        ))
    return out


def test_rows_of_another_count_written_by_a_mask_are_refused_at_capture():
    """Was: every call with a terminal state failed at run time with torch's "value tensor
    of shape [6] cannot be broadcast to indexing result of shape [8]" and a hint about
    value conditions; now refused at capture, naming the line and the form that works."""
    torch.manual_seed(0)
    q, target = nn.Linear(4, 2).double(), nn.Linear(4, 2).double()
    optim = torch.optim.SGD(q.parameters(), lr=0.1)
    before = [p.detach().clone() for p in q.parameters()]
    compiled = sc.compile(make_mode("ddp"))(_dqn_step("tutorial"))
    with sc.simulate(world_size=2), pytest.raises(sc.SPMDCompileError) as info:
        compiled(q, target, optim, *_dqn_batches("tutorial")[0])
    message = str(info.value)
    assert "next_values[non_final] = target(next_states).max(1).values" in message
    assert "writes 6 rows" in message and "selects 8" in message
    assert "out[mask] = f(all_rows[mask])" in message
    assert all(torch.equal(p, b) for p, b in zip(q.parameters(), before))


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_the_rows_of_every_element_selected_by_the_mask_match_one_device(mode):
    """The refusal's form: every next state passed, selected by the same mask."""
    import copy

    torch.manual_seed(0)
    q, target = nn.Linear(4, 2).double(), nn.Linear(4, 2).double()
    q_ref, target_ref = copy.deepcopy(q), copy.deepcopy(target)
    optim, optim_ref = torch.optim.SGD(q.parameters(), lr=0.1), torch.optim.SGD(q_ref.parameters(), lr=0.1)
    step = _dqn_step("whole")
    compiled = sc.compile(make_mode(mode))(step)
    with sc.simulate(world_size=2) as sim:
        for batch in _dqn_batches("whole"):
            got = sim.full_tensor(compiled(q, target, optim, *batch))
            want = step(q_ref, target_ref, optim_ref, *batch)
            assert abs(got.item() - want.item()) < TOL
        full = sc.checkpoint.full_state_dict(q, optim)["model"]
    for name, value in q_ref.state_dict().items():
        assert (full[name] - value).abs().max() < TOL, name
