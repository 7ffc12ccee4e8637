"""The benchmarked models: the demo GPT and a plain MLP, each at two small sizes.

Every case builds the same model, optimizer and global batches in every process (one seed),
so the compiled run and torch's eager run of a style start from identical state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from spmd_compiler.parallel_modes import ParallelMode, make_mode
from spmd_compiler.tools.demo.data import batches, markov_corpus
from spmd_compiler.tools.demo.gpt import GPT, GPTConfig, gpt_tp_plan, gpt_train_step
from spmd_compiler.tools.demo.steps import classification_train_step

# Adam eps as in the demo (NOTE: [Adam eps and parity]); timing does not depend on it.
ADAM_EPS = 1e-4


@dataclass(frozen=True)
class Case:
    """One benchmarked model size.

    Args:
        name: short label used in tables (``gpt-2x64``, ``mlp-256``).
        kind: ``gpt`` or ``mlp``.
        width: GPT embedding width / MLP input width.
        depth: GPT layers (ignored for the MLP).
        batch: global batch size (divisible by the world size).
    """

    name: str
    kind: str
    width: int
    depth: int
    batch: int


CPU_CASES = (
    Case("gpt-2x64", "gpt", 64, 2, 16),
    Case("gpt-4x128", "gpt", 128, 4, 16),
    Case("mlp-128", "mlp", 128, 0, 64),
    Case("mlp-512", "mlp", 512, 0, 64),
)

# For ``--suite cuda``: large enough that a GPU step is not all launch overhead, small
# enough that compiling (on the host) stays a minute or two per model.
CUDA_CASES = (
    Case("gpt-4x256", "gpt", 256, 4, 32),
    Case("gpt-8x512", "gpt", 512, 8, 32),
    Case("gpt-12x768", "gpt", 768, 12, 32),
    Case("mlp-1024", "mlp", 1024, 0, 256),
    Case("mlp-2048", "mlp", 2048, 0, 256),
)

SEQUENCE, VOCAB = 32, 64


mlp_train_step = classification_train_step


def gpt_config(case: Case) -> GPTConfig:
    return GPTConfig(
        vocab_size=VOCAB, block_size=SEQUENCE, n_layer=case.depth, n_head=4, n_embd=case.width
    )


def build_model(case: Case) -> nn.Module:
    torch.manual_seed(0)
    if case.kind == "gpt":
        return GPT(gpt_config(case))
    w = case.width
    return nn.Sequential(nn.Linear(w, 4 * w), nn.GELU(), nn.Linear(4 * w, w))


def build_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, eps=ADAM_EPS, weight_decay=0.01)


def train_step(case: Case) -> Callable[..., torch.Tensor]:
    return gpt_train_step if case.kind == "gpt" else mlp_train_step


def tp_plan(case: Case) -> dict:
    """The tensor-parallel plan both the compiled step and ``parallelize_module`` use."""
    if case.kind == "gpt":
        return gpt_tp_plan()
    return {"0": ColwiseParallel(), "2": RowwiseParallel()}


STYLES = ("ddp", "fsdp", "tp")


def parallel_mode(case: Case, style: str) -> ParallelMode:
    """The compiled mode of ``style`` (``ddp``, ``fsdp`` or ``tp``) for ``case``: tp needs
    the model's plan, the same one torch's ``parallelize_module`` gets."""
    return make_mode("tp", plan=tp_plan(case)) if style == "tp" else make_mode(style)


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """Submodules FSDP2 shards on their own before the root (as torchtitan does)."""
    if isinstance(model, GPT):
        return list(model.layers)
    return [m for m in model if isinstance(m, nn.Linear)]


def global_batches(case: Case, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if case.kind == "gpt":
        corpus = markov_corpus(VOCAB, 20_000, seed=0)
        return list(batches(corpus, case.batch, SEQUENCE, count, seed=1))
    gen = torch.Generator().manual_seed(1234)
    return [
        (
            torch.randn(case.batch, case.width, generator=gen),
            torch.randint(0, case.width, (case.batch,), generator=gen),
        )
        for _ in range(count)
    ]
