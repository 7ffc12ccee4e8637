"""Packed sequences into nn.LSTM / nn.GRU / nn.RNN (NOTE: [packed sequences at capture]).

A tagger packs its padded batch (``pack_padded_sequence``), runs a recurrent layer and
unpacks (``pad_packed_sequence``); the loss reads the unpacked output and the final
hidden state. Compiled on 2 simulated ranks against the undecorated step on one device
(torch's packed kernels), float64, 3 AdamW steps: every parameter and optimizer-state
tensor within 1e-12. Eager's checks are verified every call, and packed data used any
other way is refused with the line.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import spmd_compiler as sc
from spmd_compiler.parallel_modes import make_mode
from spmd_compiler.tools.parity import compare_models

TOL = 1e-12
BATCH, FRAMES, VOCAB, CLASSES = 8, 6, 20, 4


class Tagger(nn.Module):
    def __init__(self, rnn: str = "LSTM", enforce_sorted: bool = True, total_length: bool = False,
                 initial_state: bool = False, time_major: bool = False, **options: object) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8, padding_idx=0)
        self.time_major = time_major  # (frames, batch, features) through the layer
        self.rnn = getattr(nn, rnn)(8, 6, batch_first=not time_major, **options)
        directions = 2 if options.get("bidirectional") else 1
        width = int(options.get("proj_size", 0)) or 6  # type: ignore[call-overload]
        self.head = nn.Linear(width * directions, CLASSES)
        self.enforce_sorted, self.total_length = enforce_sorted, total_length
        layers = int(options.get("num_layers", 1)) * directions  # type: ignore[call-overload]
        self.h0 = nn.Parameter(torch.randn(layers, 1, width) * 0.1) if initial_state else None
        self.c0 = nn.Parameter(torch.randn(layers, 1, 6) * 0.1) if initial_state else None

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        embedded = self.embed(tokens).transpose(0, 1) if self.time_major else self.embed(tokens)
        packed = pack_padded_sequence(
            embedded, lengths, batch_first=not self.time_major, enforce_sorted=self.enforce_sorted
        )
        hx = None
        if self.h0 is not None:
            h0 = self.h0.expand(-1, tokens.shape[0], -1).contiguous()
            c0 = self.c0.expand(-1, tokens.shape[0], -1).contiguous()
            hx = (h0, c0) if isinstance(self.rnn, nn.LSTM) else h0
        out, hidden = self.rnn(packed, hx)
        total = tokens.shape[1] if self.total_length else None
        padded, _ = pad_packed_sequence(out, batch_first=not self.time_major, total_length=total)
        padded = padded.transpose(0, 1) if self.time_major else padded
        last = (hidden[0] if isinstance(hidden, tuple) else hidden)[-1]
        mean = self.head(padded).sum(1) / lengths[:, None].to(padded.dtype)
        return mean + last.sum(-1, keepdim=True)


def train_step(model, optim, tokens, lengths, labels):
    loss = F.cross_entropy(model(tokens, lengths), labels)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _batches(sort: bool = True, longest: int = FRAMES, steps: int = 3, seed: int = 1) -> list:
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        lengths = torch.randint(1, longest + 1, (BATCH,), generator=generator)
        lengths[BATCH // 2] = longest  # the longest sequence on the second rank's shard
        if sort:
            lengths = lengths.sort(descending=True).values
        tokens = torch.randint(1, VOCAB, (BATCH, FRAMES), generator=generator)
        tokens = tokens * (torch.arange(FRAMES)[None] < lengths[:, None])
        batches.append((tokens, lengths, torch.randint(0, CLASSES, (BATCH,), generator=generator)))
    return batches


CASES = {
    "lstm": ({}, True),
    "gru": ({"rnn": "GRU"}, True),
    "rnn_relu": ({"rnn": "RNN", "nonlinearity": "relu"}, True),
    "lstm_2_layers_bidirectional": ({"num_layers": 2, "bidirectional": True}, True),
    "lstm_proj_size": ({"proj_size": 3}, True),
    "gru_unsorted_bidirectional": ({"rnn": "GRU", "enforce_sorted": False, "bidirectional": True}, False),
    "lstm_initial_state_unsorted": ({"initial_state": True, "enforce_sorted": False}, False),
    "gru_initial_state": ({"rnn": "GRU", "initial_state": True}, True),
    # pad_packed_sequence unsorts on dimension 1: on torch 2.11 its backward needs
    # capture's index_put on a leading dimension (_index_put_on_a_leading_dim)
    "gru_time_major_unsorted": ({"rnn": "GRU", "time_major": True, "enforce_sorted": False}, False),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_packed_recurrence_matches_one_device(name, run_parity):
    options, sort = CASES[name]
    result = run_parity(lambda: Tagger(**options).double(), _adamw, 2, _batches(sort),
                        step=train_step, mode=make_mode("ddp"))
    result.assert_close(TOL)


def test_packed_recurrence_under_fsdp(run_parity):
    result = run_parity(lambda: Tagger(num_layers=2, bidirectional=True).double(), _adamw, 2,
                        _batches(), step=train_step, mode=make_mode("fsdp"))
    result.assert_close(TOL)


def test_total_length_lets_the_batch_be_padded_past_its_longest(run_parity):
    """Padded to FRAMES, longest sequence 4: eager's pad_packed_sequence returns
    total_length frames, which the program computes too."""
    result = run_parity(lambda: Tagger(total_length=True).double(), _adamw, 2,
                        _batches(longest=4), step=train_step, mode=make_mode("ddp"))
    result.assert_close(TOL)


def _run_compiled(model: nn.Module, batches: list) -> None:
    """Run the compiled step; whatever it raises, the model keeps its state."""
    optim, before = _adamw(model), copy.deepcopy(model)
    with sc.simulate(2) as sim:
        compiled = sc.compile(make_mode("ddp"))(train_step)
        try:
            for batch in batches:
                compiled(model, optim, *batch)
        finally:
            assert max(compare_models(model, before, sim).values()) == 0.0


def test_a_batch_shorter_than_its_padding_is_refused_without_total_length():
    """Eager's output would have max(lengths) frames, a size the data decides."""
    torch.manual_seed(0)
    model = Tagger().double()
    with pytest.raises(sc.SPMDRuntimeError, match="pass total_length=6"):
        _run_compiled(model, _batches(longest=4, steps=1))


def test_unsorted_lengths_are_refused_as_eager_refuses_them():
    torch.manual_seed(0)
    model = Tagger().double()  # enforce_sorted=True
    with pytest.raises(sc.SPMDRuntimeError, match="must be sorted in decreasing order"):
        _run_compiled(model, _batches(sort=False, steps=1))


def test_a_loss_on_the_packed_data_is_refused_with_the_line():
    """packed.data has sum(lengths) rows in eager: the padded stand-in cannot be it."""

    class OnPackedData(Tagger):
        def forward(self, tokens, lengths):  # noqa: ANN001
            packed = pack_padded_sequence(self.embed(tokens), lengths, batch_first=True)
            out, _ = self.rnn(packed)
            return self.head(out.data).mean(0, keepdim=True).expand(tokens.shape[0], -1)

    torch.manual_seed(0)
    model = OnPackedData().double()
    with pytest.raises(sc.SPMDCompileError, match="PackedSequence.data is read") as info:
        _run_compiled(model, _batches(steps=1))
    assert "test_packed_sequences.py" in str(info.value)
