"""FastSpeech-2's length regulator: ``repeat_interleave`` by durations with a fixed
``output_size`` (NOTE: [repeats of a fixed total at capture]).

Phoneme states repeated by their durations, padded so every row sums to the frame count:
refused at expansion before the sixty-sixth session ("aten.repeat_interleave.Tensor does
not have a sharding strategy registered"). Compiled on 2 simulated ranks against eager
on one device, float64, 3 Adam steps, ddp and fsdp: losses and every parameter and
optimizer-state tensor within 1e-12, the encoder trained through the regulator. A call
whose durations sum to another total, or hold a negative one, raises as eager does,
naming the line, with nothing updated. The refusal of repeats with no ``output_size``
gives the forms that compile.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.parallel_modes import make_mode
from spmd_compiler.tools.parity import compare_models

TOL = 1e-12
VOCAB, WIDTH, MELS, BATCH, PHONEMES = 10, 8, 3, 4, 4


class Regulated(nn.Module):
    """Embedding, encoder, duration predictor; the states repeated to frames (``form``)."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.encoder = nn.Linear(WIDTH, WIDTH)
        self.durations = nn.Linear(WIDTH, 1)
        self.mel = nn.Linear(WIDTH, MELS)

    def forward(self, phonemes: torch.Tensor, dur: torch.Tensor, frames: int) -> tuple[torch.Tensor, torch.Tensor]:
        b, p = phonemes.shape
        x = torch.tanh(self.encoder(self.embed(phonemes)))
        if self.form == "flat":
            h = torch.repeat_interleave(x.reshape(b * p, WIDTH), dur.reshape(-1), dim=0,
                                        output_size=b * frames).view(b, frames, WIDTH)
        elif self.form == "per_sample":
            h = torch.stack([torch.repeat_interleave(x[i], dur[i], dim=0, output_size=frames) for i in range(b)])
        else:  # the indices alone (no input), then a gather of the rows
            rows = torch.repeat_interleave(dur.reshape(-1), output_size=b * frames)
            h = x.reshape(b * p, WIDTH)[rows].view(b, frames, WIDTH)
        return self.mel(h), self.durations(x).squeeze(-1)


def train_step(model, optim, phonemes, dur, target, mask):
    mel, log_dur = model(phonemes, dur, target.shape[1])
    kept = mask[..., None].to(mel.dtype)
    loss = (torch.abs(mel - target) * kept).sum() / (kept.sum() * MELS)
    loss = loss + F.mse_loss(log_dur, torch.log1p(dur.to(log_dur.dtype)))
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _batches(steps: int = 3) -> list:
    """Durations with a pad phoneme taking each row's rest, so every row sums to the
    longest row's frames (the same frame count every call)."""
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(steps):
        dur = torch.randint(0, 4, (BATCH, PHONEMES), generator=generator)
        dur[:, 0] += 1
        dur[1, 1] = 0  # a phoneme of no frames
        dur[-1] = torch.tensor([3, 3, 3, 3])  # the longest row: 12 frames
        lengths = dur.sum(1)
        frames = int(lengths.max())
        dur = torch.cat([dur, (frames - lengths)[:, None]], 1)
        phonemes = torch.cat([torch.randint(1, VOCAB, (BATCH, PHONEMES), generator=generator),
                              torch.zeros(BATCH, 1, dtype=torch.long)], 1)
        mask = torch.arange(frames)[None] < lengths[:, None]
        target = torch.randn(BATCH, frames, MELS, generator=generator, dtype=torch.float64) * mask[..., None]
        batches.append((phonemes, dur, target, mask))
    return batches


def _adam(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=1e-2)


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.parametrize("form", ["flat", "per_sample", "indices"])
def test_length_regulator_matches_one_device(form, mode, run_parity):
    before = {}

    def make() -> nn.Module:
        model = Regulated(form).double()
        before.update({k: v.clone() for k, v in model.state_dict().items()})
        return model

    result = run_parity(make, _adam, 2, _batches(), step=train_step, mode=make_mode(mode))
    result.assert_close(TOL)
    assert result.compile_counts[-1] <= 2, result.compile_counts
    # the encoder learns through the regulator (its gradient is index_select's backward)
    moved = (result.reference.encoder.weight - before["encoder.weight"]).abs().max()
    assert moved > 1e-3, moved


def _run_compiled(batches: list) -> None:
    """The compiled step on ``batches``; whatever it raises, the model keeps the state
    of its last completed step."""
    torch.manual_seed(0)
    model = Regulated("flat").double()
    optim = _adam(model)
    with sc.simulate(2) as sim:
        compiled = sc.compile(make_mode("ddp"))(train_step)
        compiled(model, optim, *batches[0])
        after_first = copy.deepcopy(model)
        try:
            for batch in batches[1:]:
                compiled(model, optim, *batch)
        finally:
            assert max(compare_models(model, after_first, sim).values()) == 0.0


def _with_durations(batch: tuple, change) -> tuple:  # noqa: ANN001
    phonemes, dur, target, mask = batch
    dur = dur.clone()
    change(dur)
    model = Regulated("flat").double()
    with pytest.raises(RuntimeError):  # eager raises too
        train_step(model, _adam(model), phonemes, dur, target, mask)
    return phonemes, dur, target, mask


def test_durations_of_another_total_raise_as_eager_does():
    """Eager: "allocated size does not match required size"; the program's gather
    would have read rows past the durations (or left frames out), silently."""
    first = _batches(1)[0]
    longer = _with_durations(first, lambda dur: dur[0, 0].add_(1))
    with pytest.raises(sc.SPMDRuntimeError, match="output_size=") as info:
        _run_compiled([first, longer])
    assert re.search(r'test_repeat_interleave.py:\d+: "h = torch.repeat_interleave\(', str(info.value)), info.value


def test_a_negative_duration_raises_as_eager_does():
    first = _batches(1)[0]

    def negative(dur: torch.Tensor) -> None:  # the same total, one count below zero
        dur[0, 1] += dur[0, 0] + 1
        dur[0, 0] = -1

    bad = _with_durations(first, negative)
    assert bad[1].sum() == first[1].sum() and (bad[1] < 0).any()
    with pytest.raises(sc.SPMDRuntimeError, match="repeats can not be negative"):
        _run_compiled([first, bad])


def test_repeats_without_output_size_are_refused_with_the_forms_that_compile():
    """The hint named a Python list, which torch.repeat_interleave does not take."""

    def step(model, optim, x, dur):
        h = model(x)
        frames = nn.utils.rnn.pad_sequence([torch.repeat_interleave(h[b], dur[b], dim=0) for b in range(h.shape[0])],
                                           batch_first=True)
        loss = frames.sum()
        loss.backward()
        optim.step()
        return loss

    model = nn.Linear(WIDTH, WIDTH).double()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    x, dur = torch.randn(BATCH, PHONEMES, WIDTH, dtype=torch.float64), torch.ones(BATCH, PHONEMES, dtype=torch.long)
    with sc.simulate(2), pytest.raises(sc.SPMDCompileError, match="value-dependent shape") as info:
        sc.compile(make_mode("ddp"))(step)(model, optim, x, dur)
    message = str(info.value)
    assert "output_size=T" in message and "torch.searchsorted(ends" in message, message
    assert "Python int or list" not in message
