"""A small GPT-style language model for the demo, tests and benchmarks."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 64
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = True


class CausalSelfAttention(nn.Module):
    causal_mask: torch.Tensor  # a buffer (register_buffer below)

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.head_dim = config.n_embd // config.n_head
        self.q_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        # No key bias: it adds the same q.b to every score of a row, which softmax
        # cancels, so its gradient is rounding noise that Adam would amplify to +-lr.
        self.k_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.v_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.out_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        mask = torch.tril(torch.ones(config.block_size, config.block_size, dtype=torch.bool))
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 lets the head count follow the local width when heads are sharded (TP).
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        scores = scores.masked_fill(~self.causal_mask[:t, :t], float("-inf"))
        attn = self.attn_dropout(F.softmax(scores, dim=-1))
        y = (attn @ v).transpose(1, 2).reshape(b, t, -1)
        return self.resid_dropout(self.out_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc_in = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.fc_out = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc_out(F.gelu(self.fc_in(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token + position embeddings, pre-LN transformer blocks, tied-free LM head."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        _, t = idx.shape
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.ln_f(x))


def gpt_train_step(model: nn.Module, optimizer: torch.optim.Optimizer, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The demo's train step: forward, cross entropy, backward, AdamW step."""
    logits = model(idx)
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def gpt_tp_plan(sequence_parallel: bool = False) -> dict:
    """Megatron-style tensor-parallel plan for ``GPT`` (torch's own ParallelStyles).

    Attention q/k/v and the MLP's first Linear are column-wise (heads and hidden units
    split across ranks), the output projections row-wise. With ``sequence_parallel`` the
    LayerNorms run on sequence shards and the row-wise outputs are reduce-scattered.
    """
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    seq = Shard(1) if sequence_parallel else None
    plan: dict = {}
    for proj in ("q_proj", "k_proj", "v_proj"):
        plan[f"layers.*.attn.{proj}"] = ColwiseParallel(input_layouts=seq)
    plan["layers.*.attn.out_proj"] = RowwiseParallel(output_layouts=seq)
    plan["layers.*.mlp.fc_in"] = ColwiseParallel(input_layouts=seq)
    plan["layers.*.mlp.fc_out"] = RowwiseParallel(output_layouts=seq)
    if sequence_parallel:
        plan["layers.*.ln_1"] = SequenceParallel()
        plan["layers.*.ln_2"] = SequenceParallel()
    return plan
