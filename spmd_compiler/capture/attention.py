"""Scaled dot-product attention at capture: torch's CPU flash kernel where eager takes
it, plain ATen ops elsewhere.

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
one global draw. That is the program wherever NOTE: [the CPU flash kernel at capture]
does not apply: on CUDA, under autocast, and on CPU where eager itself takes the math
path (dropout, a mask that requires grad, 3-D inputs, a last dimension not contiguous).

NOTE: [the CPU flash kernel at capture]
On CPU, where eager's own choice (``_fused_sdp_choice``, asked on empty real tensors of
the call's shapes, strides, dtypes and ``requires_grad``) is the flash kernel, the call
is captured as ``spmd_compiler::flash_attention_cpu`` and its backward as
``spmd_compiler::flash_attention_cpu_backward``: custom ops over
``_scaled_dot_product_flash_attention_for_cpu`` and its backward, with a boolean mask
converted to an additive one as torch's own ``scaled_dot_product_attention`` converts it
before the kernel. They exist so that the mask is a positional argument: DTensor
redistributes positional tensors to the chosen strategy, but passes keyword-only ones
(the ATen op's ``attn_mask``) as they are, so a mask laid out unlike the rule would reach
the kernel as a wrong shard. Their sharding rule (``register_sharding``): everything
replicated; or q, k, v, the output and the log-sum-exp sharded alike on the batch
(dimension 0) or on the heads (dimension 1; with as many key as query heads), the mask
sharded there too where it has that dimension at full size, replicated where it
broadcasts. Grouped-query attention (fewer key than query heads) keeps the math
formulation, whose repeated key heads shard with the query's. Each (batch, head) row is computed alone by the kernel, so a rank's share
gives bit for bit the rows eager computes on the whole batch: the compiled step matches
eager on CPU exactly, where the math formulation matched it to rounding only, and holds
no (batch, heads, L, S) score matrix. Measured in ``tests/sim/test_attention.py``.
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
    if key.shape[:-2] == query.shape[:-2] and private.eager_attention_takes_cpu_flash(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa
    ):
        mask = attn_mask
        if mask is not None and mask.dtype == torch.bool:
            mask = _boolean_as_additive(mask, query)
        return torch.ops.spmd_compiler.flash_attention_cpu.default(query, key, value, mask, is_causal, scale)[0]
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
        return _boolean_as_additive(attn_mask, query)
    return attn_mask


def _boolean_as_additive(attn_mask: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """0 where attending, -inf elsewhere, in the query's dtype (as torch converts it)."""
    zero = torch.zeros((), dtype=query.dtype, device=query.device)
    minus_inf = torch.full((), float("-inf"), dtype=query.dtype, device=query.device)
    return torch.where(attn_mask, zero, minus_inf)


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


_FUSED = private.aten_nn_bindings().scaled_dot_product_attention  # torch's, if a script replaced F's


def _flash_attention_cpu(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
    is_causal: bool, scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention output and its log-sum-exp (which backward reads)."""
    out, logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(
        query, key, value, 0.0, is_causal, attn_mask=mask, scale=scale
    )
    return out, logsumexp


def _flash_attention_cpu_backward(
    grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    mask: torch.Tensor | None, out: torch.Tensor, logsumexp: torch.Tensor, is_causal: bool,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of query, key and value."""
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
        grad, query, key, value, out, logsumexp, 0.0, is_causal, attn_mask=mask, scale=scale
    )
    return grads[0], grads[1], grads[2]


# NOTE: [the CPU flash kernel at capture]; the ATen ops' meta kernels give the fake outputs
_FLASH_CPU = torch.library.custom_op(
    "spmd_compiler::flash_attention_cpu",
    _flash_attention_cpu,
    mutates_args=(),
    schema="(Tensor query, Tensor key, Tensor value, Tensor? mask, bool is_causal, float? scale) -> (Tensor, Tensor)",
)
_FLASH_CPU.register_fake(_flash_attention_cpu)
_FLASH_CPU_BACKWARD = torch.library.custom_op(
    "spmd_compiler::flash_attention_cpu_backward",
    _flash_attention_cpu_backward,
    mutates_args=(),
    schema="(Tensor grad, Tensor query, Tensor key, Tensor value, Tensor? mask, Tensor out, "
    "Tensor logsumexp, bool is_causal, float? scale) -> (Tensor, Tensor, Tensor)",
)
_FLASH_CPU_BACKWARD.register_fake(_flash_attention_cpu_backward)


def _save_for_backward(ctx: Any, inputs: tuple, output: tuple) -> None:
    query, key, value, mask, ctx.is_causal, ctx.scale = inputs
    ctx.save_for_backward(query, key, value, mask, *output)


def _attention_backward(ctx: Any, grad: torch.Tensor, grad_logsumexp: Any) -> tuple:
    query, key, value, mask, out, logsumexp = ctx.saved_tensors
    grads = torch.ops.spmd_compiler.flash_attention_cpu_backward.default(
        grad, query, key, value, mask, out, logsumexp, ctx.is_causal, ctx.scale
    )
    return (*grads, None, None, None)


_FLASH_CPU.register_autograd(_attention_backward, setup_context=_save_for_backward)


def _install_flash_attention_cpu_rules() -> None:
    """DTensor's strategies for the two ops (NOTE: [the CPU flash kernel at capture])."""
    from torch.distributed.tensor import Replicate, Shard
    replicate: Any = Replicate()
    # the batch or the heads (query, key and value have the same batch and heads: grouped
    # query attention takes the math formulation, whose repeated key heads shard alike)
    split_dims = (0, 1)

    def mask_placement(mask: Any, dim: int) -> Any:
        if mask is None:
            return None
        own = dim - (4 - len(mask.shape))  # the mask broadcasts from the right
        return replicate if own < 0 or mask.shape[own] == 1 else Shard(own)

    def forward(query: Any, key: Any, value: Any, mask: Any, *flags: Any) -> list[tuple[list, list]]:
        rest = [None, None]
        whole = None if mask is None else replicate
        rules = [([replicate] * 2, [replicate] * 3 + [whole] + rest)]
        for dim in split_dims:
            shard = Shard(dim)
            rules.append(([shard] * 2, [shard] * 3 + [mask_placement(mask, dim)] + rest))
        return rules

    def backward(grad: Any, query: Any, key: Any, value: Any, mask: Any, *rest: Any) -> list[tuple[list, list]]:
        flags = [None, None]
        whole = None if mask is None else replicate
        rules = [([replicate] * 3, [replicate] * 4 + [whole] + [replicate] * 2 + flags)]
        for dim in split_dims:
            shard = Shard(dim)
            rules.append(([shard] * 3, [shard] * 4 + [mask_placement(mask, dim)] + [shard] * 2 + flags))
        return rules

    private.register_sharding_keyed(torch.ops.spmd_compiler.flash_attention_cpu.default, forward)
    private.register_sharding_keyed(torch.ops.spmd_compiler.flash_attention_cpu_backward.default, backward)


_install_flash_attention_cpu_rules()


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
        if F.scaled_dot_product_attention is _FUSED:  # a script's replacement (a wrapper of
            # torch's) runs as eagerly, its call of torch's caught by the mode (NOTE:
            # [torch's functions replaced by the user] in _torch_private.py)
            stack.enter_context(mock.patch.object(F, "scaled_dot_product_attention", scaled_dot_product_attention))
        stack.enter_context(
            mock.patch.object(private.aten_nn_bindings(), "scaled_dot_product_attention", scaled_dot_product_attention)
        )
        stack.enter_context(_AttentionAsMath())
        yield
