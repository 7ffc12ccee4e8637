"""``F.ctc_loss`` / ``nn.CTCLoss`` as plain ops at capture (NOTE: [CTC loss at capture]).

The plain-op recursion against torch's kernel (every target form, reduction and
``zero_infinity``; the loss and the gradient for the logits through ``log_softmax``), a
speech-style step under ddp and fsdp on 2 simulated ranks against one device (float64),
and eager's length checks as value checks verified every call.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.capture.ctc_loss import ctc_loss
from spmd_compiler.errors import SPMDRuntimeError
from spmd_compiler.parallel_modes import make_mode

TOL = 1e-12
FRAMES, BATCH, FEATURES, CLASSES, LABELS = 12, 8, 5, 6, 4


def _case(form: str, impossible: bool) -> tuple:
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(FRAMES, 4, CLASSES, generator=gen, dtype=torch.float64)
    input_lengths = torch.tensor([12, 10, 3 if impossible else 8, 7])
    target_lengths = torch.tensor([4, 2, 3, 0])
    targets = torch.randint(1, CLASSES, (4, LABELS), generator=gen)
    targets[2] = torch.tensor([2, 2, 3, 1])  # a repeat: needs a blank between, 4 frames
    if form == "concatenated":
        targets = torch.cat([targets[n, : target_lengths[n]] for n in range(4)])
    if form == "unbatched":
        return logits[:, 0], targets[0, :3], torch.tensor(9), torch.tensor(3)
    return logits, targets, input_lengths, target_lengths


@pytest.mark.parametrize("form", ["padded", "concatenated", "unbatched"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("zero_infinity", [False, True])
@pytest.mark.parametrize("normalized", [True, False], ids=["log_softmax", "raw_scores"])
def test_plain_ops_match_the_kernel(form: str, reduction: str, zero_infinity: bool, normalized: bool) -> None:
    """The loss, and the gradient for the scores given to it: through ``log_softmax``, and
    for raw scores, where eager's kernel gradient is not the true one (it includes
    ``exp(log_probs)``); before 2026-12-02 the raw scores' gradient was the true one."""
    # an impossible alignment (3 frames for labels needing 4) only where it is zeroed:
    # otherwise eager's loss is inf and its gradient not finite
    logits, targets, input_lengths, target_lengths = _case(form, impossible=zero_infinity)
    results = []
    for fn in (F.ctc_loss, ctc_loss):
        x = logits.clone().requires_grad_()
        loss = fn(x.log_softmax(-1) if normalized else x, targets, input_lengths, target_lengths, blank=0,
                  reduction=reduction, zero_infinity=zero_infinity)
        (grad,) = torch.autograd.grad(loss.sum(), x)
        results.append((loss.detach(), grad))
    (want, want_grad), (got, got_grad) = results
    assert torch.equal(torch.isinf(want), torch.isinf(got))
    finite = torch.isfinite(want)
    assert torch.allclose(got[finite], want[finite], rtol=TOL, atol=0)
    assert (got_grad - want_grad).abs().max() < TOL


class Recognizer(nn.Module):
    """Frames of features to per-frame class scores (a speech model's head)."""

    def __init__(self) -> None:
        super().__init__()
        self.encode = nn.Linear(FEATURES, 16)
        self.classify = nn.Linear(16, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classify(torch.tanh(self.encode(x)))


def ctc_step(model, optim, features, targets, input_lengths, target_lengths):  # noqa: ANN001, ANN201
    log_probs = model(features).log_softmax(-1).transpose(0, 1)  # (T, N, C)
    loss = nn.CTCLoss(blank=0, zero_infinity=True)(log_probs, targets, input_lengths, target_lengths)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def raw_scores_ctc_step(model, optim, features, targets, input_lengths, target_lengths):  # noqa: ANN001, ANN201
    scores = model(features).transpose(0, 1)  # not normalized: eager's gradient is its kernel's
    loss = F.ctc_loss(scores, targets, input_lengths, target_lengths, zero_infinity=True)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _batches(steps: int, long_input: bool = False) -> list[tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(5)
    out = []
    for _ in range(steps):
        input_lengths = torch.randint(FRAMES // 2, FRAMES + 1, (BATCH,), generator=gen)
        if long_input:
            input_lengths[3] = FRAMES + 1
        out.append((
            torch.randn(BATCH, FRAMES, FEATURES, generator=gen, dtype=torch.float64),
            torch.randint(1, CLASSES, (BATCH, LABELS), generator=gen),
            input_lengths,
            torch.randint(1, LABELS + 1, (BATCH,), generator=gen),
        ))
    return out


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


@pytest.mark.parametrize("step", [ctc_step, raw_scores_ctc_step], ids=["log_softmax", "raw_scores"])
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_ctc_step_matches_one_device(run_parity, mode: str, step) -> None:  # noqa: ANN001
    result = run_parity(lambda: Recognizer().double(), _adamw, 2, _batches(3), step=step,
                        mode=make_mode(mode))
    result.assert_close(TOL)


def test_an_input_length_past_the_frames_is_refused_every_call() -> None:
    """Eager raises for an input length beyond T; the program checks it before writing."""
    torch.manual_seed(0)
    model = Recognizer().double()
    optim = _adamw(model)
    compiled = sc.compile(make_mode("ddp"))(ctc_step)
    with sc.simulate(world_size=2):
        compiled(model, optim, *_batches(1)[0])
        before = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
        with pytest.raises(SPMDRuntimeError, match="input_lengths must be at most"):
            compiled(model, optim, *_batches(1, long_input=True)[0])
        after = {k: v.full_tensor() for k, v in model.state_dict().items()}
    assert all(torch.equal(before[k], after[k]) for k in before)


IGNORE = -1


def _padded_targets_step(model, optim, x, ys_pad, per_row):  # noqa: ANN001, ANN201
    log_probs = model(x).log_softmax(-1).transpose(0, 1)
    ys_lens = (ys_pad != IGNORE).sum(1)
    if per_row:  # ESPnet's CTC.forward
        targets = torch.cat([y[y != IGNORE] for y in ys_pad])
    else:
        targets = ys_pad[ys_pad != IGNORE]
    frames = torch.full((x.shape[0],), x.shape[1])
    loss = F.ctc_loss(log_probs, targets, frames, ys_lens, reduction="sum") / x.shape[0]
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


def _padded_targets() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 10, 6, dtype=torch.float64, generator=gen)
    ys = torch.randint(1, 5, (4, 3), generator=gen)
    ys[0, 2:] = IGNORE
    ys[2, 1:] = IGNORE
    return x, ys


def test_targets_selected_row_by_row_are_refused_naming_the_whole_batch_selection() -> None:
    """NOTE: [selections concatenated row by row]: the refusal advised masked_fill /
    torch.where / ignore_index, none of which applies to CTC targets; it names the
    whole-batch selection, which compiles and matches eager."""
    torch.manual_seed(0)
    model = nn.Linear(6, 5).double()
    with sc.simulate(world_size=2), pytest.raises(SPMDRuntimeError) as info:
        sc.compile(make_mode("ddp"))(_padded_targets_step)(model, torch.optim.SGD(model.parameters(), lr=0.1), *_padded_targets(), True)
    assert "`ys_pad[ys_pad != ignore]`" in str(info.value), str(info.value)
    assert "padded 2-D targets" in str(info.value), str(info.value)

    torch.manual_seed(0)
    model, reference = nn.Linear(6, 5).double(), nn.Linear(6, 5).double()
    reference.load_state_dict(model.state_dict())
    expected = _padded_targets_step(reference, torch.optim.SGD(reference.parameters(), lr=0.1), *_padded_targets(), True)
    with sc.simulate(world_size=2):
        got = sc.compile(make_mode("ddp"))(_padded_targets_step)(model, torch.optim.SGD(model.parameters(), lr=0.1), *_padded_targets(), False)
        weight = model.weight.full_tensor()
    assert abs(got.item() - expected.item()) <= 1e-12 * abs(expected.item())
    assert torch.allclose(weight, reference.weight, rtol=0, atol=1e-12)
