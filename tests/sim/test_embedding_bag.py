"""``nn.EmbeddingBag`` (NOTE: [embedding bags at capture]) and ``nn.Embedding(max_norm=...)``
under ddp and fsdp on 2 simulated ranks against the undecorated step on one device
(float64, every tensor within 1e-10), and the forms that are refused with the user's line
named."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.parallel_modes import make_mode

TOL = 1e-10
BATCH, LENGTH, VOCAB, CLASSES = 8, 6, 20, 4


class _Bags(nn.Module):
    def __init__(
        self, mode: str, padding_idx: int | None, weighted: bool = False, max_norm: float | None = None
    ) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(VOCAB, 8, mode=mode, padding_idx=padding_idx, max_norm=max_norm)
        self.gate = nn.Linear(8, 1) if weighted else None
        self.head = nn.Linear(8, CLASSES)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.gate is None:
            return self.head(self.bag(ids))
        weights = torch.sigmoid(self.gate(F.embedding(ids, self.bag.weight))).squeeze(-1)
        return self.head(self.bag(ids, per_sample_weights=weights))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Token bags; bag 0 is all index 0 (empty once 0 is padding), bag 1 half padding."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(3):
        ids = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=gen)
        ids[0], ids[1, :3] = 0, 0
        out.append((ids, torch.randint(0, CLASSES, (BATCH,), generator=gen)))
    return out


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


CASES = {  # name: (mode, padding_idx, per-sample weights, max_norm)
    "sum": ("sum", None, False, None),
    "sum_weighted": ("sum", None, True, None),
    "mean_padded": ("mean", 0, False, None),
    "max_padded": ("max", 0, False, None),
    # rows start with norms near sqrt(8): max_norm 1 renormalizes every row used
    "mean_max_norm": ("mean", None, False, 1.0),
}


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_embedding_bag_matches_one_device(name, mode, run_parity):
    bag_mode, padding_idx, weighted, max_norm = CASES[name]
    result = run_parity(
        lambda: _Bags(bag_mode, padding_idx, weighted, max_norm).double(), _adamw, 2, _batches(),
        mode=make_mode(mode),
    )
    result.assert_close(TOL)


class _RenormedLookup(nn.Module):
    """``nn.Embedding(max_norm=1)``: the rows the batch uses are renormalized in place
    before the lookup (the global batch's rows, on every rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8, max_norm=1.0)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids).mean(1))


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_embedding_max_norm_matches_one_device(mode, run_parity):
    result = run_parity(lambda: _RenormedLookup().double(), _adamw, 2, _batches(), mode=make_mode(mode))
    result.assert_close(TOL)


class _Refused(nn.Module):
    def __init__(self, **options: object) -> None:
        super().__init__()
        self.flat = options.pop("flat", False)
        self.lookup = options.pop("lookup", False)  # nn.Embedding, mean over the tokens
        table = nn.Embedding if self.lookup else nn.EmbeddingBag
        self.bag = table(VOCAB, 8, **options)  # type: ignore[arg-type]
        self.head = nn.Linear(8, CLASSES)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.lookup:
            return self.head(self.bag(ids).mean(1))
        if self.flat:
            return self.head(self.bag(ids.flatten(), torch.arange(0, ids.numel(), LENGTH)))
        return self.head(self.bag(ids))


@pytest.mark.parametrize(
    "options,words",
    [
        ({"flat": True}, "1-D input and offsets"),
        ({"sparse": True}, "sparse=True"),
        ({"scale_grad_by_freq": True}, "scale_grad_by_freq=True"),
        ({"lookup": True, "sparse": True}, "nn.Embedding with sparse=True"),
    ],
    ids=["offsets", "sparse", "scale_grad_by_freq", "embedding_sparse"],
)
def test_forms_that_cannot_be_compiled_are_refused(options, words):
    model = _Refused(**options).double()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(model, optim, ids, y):  # noqa: ANN001
        loss = F.cross_entropy(model(ids), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids, y = _batches()[0]
    with sc.simulate(2), pytest.raises(sc.SPMDCompileError) as info:
        sc.compile(make_mode("ddp"))(step)(model, optim, ids, y)
    message = str(info.value)
    assert words in message and "test_embedding_bag.py" in message
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
