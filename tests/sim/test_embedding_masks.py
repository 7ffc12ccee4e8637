"""Vocabulary-sharded embeddings looked up more than once in a step.

An embedding over a vocabulary-sharded table gives DTensor's masked partial sum, whose
mask (which ids each rank does not hold) lives in the placement object. DTensor's cached
sharding decision hands every lookup of the same shapes one such object, so a second
lookup (the same ids again: a model called twice, a teacher and a student; or a second
table of the same shape) shared the first one's mask: the first reduction released it
and the second failed, or one lookup's mask was applied to another's ids. Each lookup now
masks with its own (NOTE: [a mask for every lookup] in ``spmd_compiler/_torch_private.py``).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import spmd_compiler as sc
from spmd_compiler.parallel_modes import FullyShardTensorParallel, TensorParallel
from spmd_compiler.tools.parity import compare_states, full_state

VOCAB, WIDTH = 64, 32
PLAN = {
    "emb": RowwiseParallel(input_layouts=Replicate()),
    "emb2": RowwiseParallel(input_layouts=Replicate()),
    "head": ColwiseParallel(output_layouts=Replicate()),
}


class _Net(nn.Module):
    def __init__(self, tables: int = 1) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH, dtype=torch.float64)
        self.emb2 = nn.Embedding(VOCAB, WIDTH, dtype=torch.float64) if tables == 2 else None
        self.norm = nn.RMSNorm(WIDTH, dtype=torch.float64)
        self.head = nn.Linear(WIDTH, VOCAB, dtype=torch.float64)

    def forward(self, idx: torch.Tensor, idx2: torch.Tensor | None = None) -> torch.Tensor:
        x = self.emb(idx)
        if self.emb2 is not None:
            x = x + self.emb2(idx if idx2 is None else idx2)
        return self.head(self.norm(x))


def _twice(model, optim, idx, idx2, tgt):  # noqa: ANN001, ANN202
    """The model called twice on the same ids (a consistency loss)."""
    a = model(idx)
    b = model(idx)
    loss = F.cross_entropy(b.reshape(-1, VOCAB), tgt.reshape(-1)) + F.mse_loss(a, b.detach() * 0.9)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


def _distill(model, teacher, optim, idx, idx2, tgt):  # noqa: ANN001, ANN202
    """A frozen teacher and a student with the same plan, the same ids."""
    with torch.no_grad():
        t = teacher(idx)
    s = model(idx)
    loss = F.mse_loss(s, t) + F.cross_entropy(s.reshape(-1, VOCAB), tgt.reshape(-1))
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


def _two_tables(model, optim, idx, idx2, tgt):  # noqa: ANN001, ANN202
    """Two tables of one shape summed (token + type ids), over the same or other ids."""
    loss = F.cross_entropy(model(idx, idx2).reshape(-1, VOCAB), tgt.reshape(-1))
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


CASES = {
    "same_ids_twice": (_twice, 1, True),
    "teacher_and_student": (_distill, 1, True),
    "two_tables_same_ids": (_two_tables, 2, True),
    "two_tables_other_ids": (_two_tables, 2, False),
}
MODES = {
    "tp": (lambda: TensorParallel(PLAN), 2),
    "fsdp_tp": (lambda: FullyShardTensorParallel(PLAN, mesh_shape=(2, 2)), 4),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", list(CASES))
def test_each_lookup_masks_with_its_own_mask(case: str, mode: str) -> None:
    step_fn, tables, same_ids = CASES[case]
    make_mode, world = MODES[mode]
    torch.manual_seed(0)
    model = _Net(tables)
    reference = copy.deepcopy(model)
    extra, ref_extra = (), ()
    if step_fn is _distill:
        teacher = _Net(tables).requires_grad_(False)
        extra, ref_extra = (teacher,), (copy.deepcopy(teacher),)
    optim = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    step = sc.compile(parallel_mode=make_mode())(step_fn)
    gen = torch.Generator().manual_seed(1)
    with sc.simulate(world) as sim:
        for _ in range(3):
            idx = torch.randint(0, VOCAB, (4, 8), generator=gen)
            idx2 = idx if same_ids else torch.randint(0, VOCAB, (4, 8), generator=gen)
            tgt = torch.randint(0, VOCAB, (4, 8), generator=gen)
            loss = step(model, *extra, optim, idx, idx2, tgt)
            expected = step_fn(reference, *ref_extra, ref_optim, idx, idx2, tgt)
            assert torch.allclose(loss, expected, rtol=1e-12, atol=0)
        diffs = compare_states(full_state(model, optim, sim), full_state(reference, ref_optim, None))
    assert max(diffs.values()) < 1e-10, max(diffs.items(), key=lambda kv: kv[1])
