"""Ops that mix samples across the (sharded) batch dimension keep single-device results.

With the batch Shard(0), an op along dimension 0 needs the whole batch: expansion gathers
it, and the backward then re-shards a replicated value (Replicate -> Shard), where each
rank must take its own slice. A program traced on one rank that bakes in that rank's
slice index is wrong on every other rank; these tests catch it at world 2 and 4.
Reductions given an empty dimension list (every dimension), ``argmax`` / ``argmin`` and
``searchsorted`` over the batch are here too (silent or refused before: see each case).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

FLOAT32_TOLERANCE = 1e-5

OPS = {
    "roll_batch": lambda h: torch.roll(h, 1, 0),
    "flip_batch": lambda h: torch.flip(h, [0]),
    "cumsum_batch": lambda h: torch.cumsum(h, 0),
    "sort_batch": lambda h: torch.sort(h, 0).values,
    "cummax_batch": lambda h: torch.cummax(h, 0).values,
    "cumsum_features": lambda h: torch.cumsum(h, 1),
    # a negative scan dim over the sharded batch: DTensor scanned each shard alone
    "cumsum_batch_negative_dim": lambda h: torch.cumsum(h, -2),
    "logcumsumexp_batch_negative_dim": lambda h: torch.logcumsumexp(h, -2),
    # DTensor's bool Partial(sum) of a sharded any(), multiplied as if linear (26% off)
    "any_batch": lambda h: h * (h > 0.5).any(0),
    "all_batch": lambda h: h * (h > -0.5).all(0),
    "any_everything": lambda h: h * (h > 1.5).any(),
    "all_batch_uint8": lambda h: h * (h > -0.5).to(torch.uint8).all(0, keepdim=True),
    # an empty dim list reduces everything; DTensor read it as nothing (rank 0's partial
    # sum), also in the backward of a full amax(): the parameters became NaN
    "amax_everything": lambda h: h / h.abs().amax(),
    "sum_empty_dims": lambda h: h * h.sum(dim=(), keepdim=True) / 10,
    "mean_empty_dims": lambda h: h - h.mean(dim=(), keepdim=True),
    "logsumexp_empty_dims": lambda h: h - torch.logsumexp(h, dim=(), keepdim=True),
    # argmax / argmin over the batch: DTensor's handler could not offset local indices
    "argmax_batch": lambda h: h * h.argmax(0),
    "argmin_everything": lambda h: h * (h.argmin() % 3),
    # per-example lists of the sharded batch (Llava's list(image_features)): DTensor's
    # unbind rule refused the sharded dim (NOTE: [unbind along a sharded dimension])
    "unbind_batch": lambda h: torch.stack([row * (i + 1) for i, row in enumerate(h.unbind(0))]),
    "list_of_rows": lambda h: torch.cat([row.flip(0)[None] for row in list(h)]) + h,
    # a 0-d integer tensor as an index (NOTE: [0-d tensor indices at capture]): a value
    # read, refused at capture before; a feature chosen over the batch, a row of the
    # sharded batch chosen by the data
    "feature_by_argmax": lambda h: h * h[:, h.detach().mean(0).argmax()].unsqueeze(1),
    "row_by_argmax": lambda h: h * h[h.detach().sum(1).argmax()],
    "row_by_negative_tensor": lambda h: h + h[..., torch.tensor(-1) - h.detach().argmin() % 2, :].mean(),
    # negative dims in the backward's select / slice (NOTE: [ops without a sharding rule]
    # in capture/trace.py): DTensor moved the batch's Shard(0) to Shard(1) of
    # select_backward's result ("size of tensor a (4) must match ... b (8)" at run time)
    "select_last_dim": lambda h: h * h.select(-1, 2).unsqueeze(-1),
    "narrow_last_dim": lambda h: h * h.narrow(-1, 1, 3).sum(-1, keepdim=True),
    # no DTensor rule: ones of ours
    "unfold_batch": lambda h: h.unfold(0, 2, 2).mean(-1).repeat_interleave(2, 0),
    "searchsorted": lambda h: h * torch.searchsorted(torch.tensor([-0.5, 0.0, 0.5]), h.detach()),
    "searchsorted_sorter": lambda h: h * torch.searchsorted(
        torch.tensor([0.5, -0.5, 0.0]), h.detach(), sorter=torch.tensor([1, 2, 0])
    ),
}


class MixBatch(nn.Module):
    def __init__(self, op) -> None:
        super().__init__()
        self.op = op
        self.inp = nn.Linear(8, 8)
        self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.op(self.inp(x)))


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("op", list(OPS))
def test_batch_mixing_op_parity(run_parity, classification_batches, op, world_size):
    result = run_parity(
        lambda: MixBatch(OPS[op]),
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
        world_size,
        classification_batches(2),
    )
    result.assert_close(FLOAT32_TOLERANCE)


class _FrequencyScaledEmbedding(nn.Module):
    def __init__(self, padding_idx: int | None) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8, padding_idx=padding_idx, scale_grad_by_freq=True)
        self.head = nn.Linear(8, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens).mean(1))


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.parametrize("padding_idx", [None, 3])
def test_embedding_scale_grad_by_freq_counts_the_global_batch(run_parity, mode, padding_idx):
    """The gradient of a token is divided by how often it occurs in the whole batch, not in
    a rank's share (was 8.8e-3 relative on the embedding after 3 AdamW steps)."""
    from spmd_compiler.parallel_modes import make_mode

    gen = torch.Generator().manual_seed(2)
    batches = [
        (torch.randint(0, 20, (8, 5), generator=gen), torch.randint(0, 4, (8,), generator=gen))
        for _ in range(3)
    ]
    result = run_parity(
        lambda: _FrequencyScaledEmbedding(padding_idx).double(),
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
        2, batches, mode=make_mode(mode),
    )
    result.assert_close(1e-12)


class _SelectLast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([[0.5, 1.0, 1.5]], dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.select(x * self.w, -1, 2).sin()


def test_select_of_the_last_dim_with_one_row_per_rank(run_parity):
    """With a local batch of 1 and a size-1 dimension, select_backward's wrong Shard(1)
    broadcast instead of failing: the parameter was 4.9e-2 off after two SGD steps."""
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(2, 1, 3, dtype=torch.float64, generator=gen),
                torch.randn(2, 1, dtype=torch.float64, generator=gen)) for _ in range(2)]
    result = run_parity(
        _SelectLast, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), 2, batches, step=_mse_step,
    )
    result.assert_close(1e-12)


def _mse_step(model, optim, x, y):  # noqa: ANN001, ANN202
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss
