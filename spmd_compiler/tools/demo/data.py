"""A generated token corpus with learnable structure (no downloads).

Tokens follow a seeded sparse Markov chain: each token has a few likely successors, so a
model's loss falls from ln(vocab) towards the chain's entropy as it learns.
"""

from __future__ import annotations

import torch


def markov_corpus(vocab_size: int, length: int, *, successors: int = 3, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    table = torch.stack([torch.randperm(vocab_size, generator=gen)[:successors] for _ in range(vocab_size)])
    weights = torch.softmax(torch.randn(vocab_size, successors, generator=gen), dim=-1)
    tokens = torch.empty(length, dtype=torch.long)
    tokens[0] = 0
    draws = torch.rand(length, generator=gen)
    cdf = weights.cumsum(-1)
    for i in range(1, length):
        prev = int(tokens[i - 1])
        k = int(torch.searchsorted(cdf[prev], draws[i]).clamp(max=successors - 1))
        tokens[i] = table[prev, k]
    return tokens


def batches(corpus: torch.Tensor, batch_size: int, block_size: int, steps: int, *, seed: int = 1):
    """``steps`` (inputs, targets) pairs of shape (batch_size, block_size)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        starts = torch.randint(0, corpus.numel() - block_size - 1, (batch_size,), generator=gen)
        x = torch.stack([corpus[s : s + block_size] for s in starts.tolist()])
        y = torch.stack([corpus[s + 1 : s + 1 + block_size] for s in starts.tolist()])
        out.append((x, y))
    return out
