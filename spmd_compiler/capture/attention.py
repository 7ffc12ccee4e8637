"""Scaled dot-product attention as plain ATen ops at capture.

NOTE: [attention decomposed at capture]
``F.scaled_dot_product_attention`` picks a fused kernel by device and arguments
(``_scaled_dot_product_flash_attention_for_cpu``, CUDA flash / memory-efficient /
cuDNN) below autograd, so the captured graph would hold the fused op and its backward.
DTensor on torch 2.13 has no sharding rule for the CPU kernels; for a masked call its
decomposition-based propagation tries every placement of every input, nested, and runs
for many minutes; and the fused kernels draw dropout from their own generator
(Philox seed/offset), which breaks NOTE: [random numbers]. So, during capture, a
``TorchFunctionMode`` answers every call of ``F.scaled_dot_product_attention`` (also when
reached through ``nn.MultiheadAttention`` and transformers' attention functions) with
the math formulation torch itself uses for its reference path
(``_scaled_dot_product_attention_math``): scale q and k by sqrt(scale) each, add the
(boolean-converted or causal) mask, a softmax that leaves fully masked rows at zero,
dropout, then the product with v. Every op is one DTensor shards on batch (data
parallel) and on heads (tensor parallel), and autograd derives the backward from them.
Dropout draws with ``bernoulli_`` like ``nn.Dropout``, so it takes its values from the
one global draw. On every device the program computes attention this way; the fused
kernels' speed is not used (the eager reference uses them: its numbers agree to
float32 rounding).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .. import _torch_private as private
from ..errors import SPMDCompileError


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` in plain ATen ops (same arguments)."""
    if query.is_nested or key.is_nested or value.is_nested:
        raise SPMDCompileError(
            "scaled_dot_product_attention on nested tensors cannot be captured.",
            hint="pad the sequences and pass an attention mask instead.",
        )
    head_dim = query.size(-1)
    scale_value = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    root = math.sqrt(abs(scale_value))
    q = query * (-root if scale_value < 0 else root)
    key, value = _repeat_groups(query, key, value, enable_gqa)
    scores = torch.matmul(q, key.transpose(-2, -1) * root)
    mask = _additive_mask(attn_mask, is_causal, query, key)
    if mask is not None:
        scores = scores + mask
    weights = torch.ops.aten._safe_softmax.default(scores, -1)
    if dropout_p > 0.0:
        # as nn.Dropout on CPU: a bernoulli_ keep-mask scaled by 1 / (1 - p)
        keep = torch.empty_like(weights).bernoulli_(1.0 - dropout_p)
        weights = weights * keep.div_(1.0 - dropout_p)
    return torch.matmul(weights, value)


def _additive_mask(
    attn_mask: torch.Tensor | None, is_causal: bool, query: torch.Tensor, key: torch.Tensor
) -> torch.Tensor | None:
    if is_causal:
        if attn_mask is not None:
            raise SPMDCompileError(
                "scaled_dot_product_attention was called with both attn_mask and "
                "is_causal=True, which torch refuses too.",
                hint="fold the causal mask into attn_mask or drop attn_mask.",
            )
        length, source = query.size(-2), key.size(-2)
        attn_mask = torch.ones(length, source, dtype=torch.bool, device=query.device).tril()
    if attn_mask is None:
        return None
    if attn_mask.dtype == torch.bool:
        zero = torch.zeros((), dtype=query.dtype, device=query.device)
        minus_inf = torch.full((), float("-inf"), dtype=query.dtype, device=query.device)
        return torch.where(attn_mask, zero, minus_inf)
    return attn_mask


def _repeat_groups(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, enable_gqa: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped-query attention: each key/value head serves a group of query heads."""
    if not enable_gqa or query.dim() < 3 or key.size(-3) == query.size(-3):
        return key, value
    groups = query.size(-3) // key.size(-3)

    def repeat(t: torch.Tensor) -> torch.Tensor:
        shape = list(t.shape)
        expanded = t.unsqueeze(-3).expand(*shape[:-2], groups, *shape[-2:])
        return expanded.reshape(*shape[:-3], shape[-3] * groups, *shape[-2:])

    return repeat(key), repeat(value)


_FUSED = F.scaled_dot_product_attention


class _AttentionAsMath(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is _FUSED:
            return scaled_dot_product_attention(*args, **kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def attention_as_math() -> Iterator[None]:
    """Inside: ``F.scaled_dot_product_attention`` computes with plain ops (see the NOTE).

    The function is replaced where torch and libraries look it up at call time
    (``torch.nn.functional`` and ``torch._C._nn``; ``F.multi_head_attention_forward``
    reads the former's module global), and a ``TorchFunctionMode`` catches references
    taken before (``from torch.nn.functional import scaled_dot_product_attention``).
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(F, "scaled_dot_product_attention", scaled_dot_product_attention))
        stack.enter_context(
            mock.patch.object(private.aten_nn_bindings(), "scaled_dot_product_attention", scaled_dot_product_attention)
        )
        stack.enter_context(_AttentionAsMath())
        yield
