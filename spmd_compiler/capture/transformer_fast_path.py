"""``nn.TransformerEncoder`` at capture: what eager's nested-tensor fast path computes.

NOTE: [nn.TransformerEncoder's nested fast path]
torch's ``nn.TransformerEncoder.forward`` runs its layers on a nested tensor in eager
when the first layer is in eval mode, ``src`` is 3-D, a ``src_key_padding_mask`` and no
``mask`` is given, autocast is off, the MHA fast path is enabled, ``use_nested_tensor``
is set, the padding mask is left-aligned (``_nested_tensor_from_mask_left_aligned``, a
read of the mask's values, asked only with ``mask_check``), no first-layer parameter or
``src`` requires grad where grad is enabled, and no argument ``has_torch_function``. The
result is padded back with ``to_padded_tensor(0.0)`` before the final norm: padded
positions come out as exactly 0 (``norm(0)`` after it). Under capture every tensor is a
fake tensor or DTensor, so ``has_torch_function`` is True and the traced program took
the regular path, whose padded positions hold computed values: a compiled eval step
returning ``h.mean(1)`` differed from eager by 1.03 (float64), and knowledge distillation
from a frozen teacher under ``no_grad`` by 0.66 relative in the loss, silently.

So, while a step is traced, each module running torch's own ``TransformerEncoder.forward``
runs ``encoder_forward`` instead (per instance, restored after the trace). It asks
torch's own ``forward`` whether eager would nest (``transformer_encoder_would_nest`` in
_torch_private.py: the trace's traits hidden, stopped right after the decision, before
any layer runs). Where it would not, torch's ``forward`` runs as before. Where it would,
the layers run on the padded batch with the padding mask torch would nest by (the
regular path, which agrees with the nested one at the real positions to rounding), and
the padded positions are set to 0 where the whole batch's mask is left-aligned, decided
in the graph (``left_aligned``: no row goes from padding back to a kept position,
torch's definition; all-kept and all-padding rows are aligned). Where it is not, eager
took the regular path too, and the values stay. Then the final norm. A module built with
``mask_check=False`` nests in eager without checking alignment, and its result for a
mask that is not aligned is not reproducible: refused. Measured in
``tests/sim/test_transformer_fast_path.py`` (float64, 2 simulated ranks): the eval step
and three knowledge-distillation steps agree with eager within 1e-12 (measured 2e-16;
before: 0.92 relative in the eval step's output, 8e-2 in the student's parameters).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from .. import _torch_private as private
from ..errors import SPMDCompileError, innermost_model_frame_of_stack
from .batch_norm import forwards_replaced

_TORCH_FORWARD = torch.nn.TransformerEncoder.forward


def left_aligned(valid: torch.Tensor) -> torch.Tensor:
    """A 0-d bool tensor: every row of the (N, L) bool ``valid`` keeps a prefix of its
    positions (``_nested_tensor_from_mask_left_aligned``'s test: the count of kept
    positions equals the index of the first dropped one), without reading a value."""
    gaps = valid[:, 1:] & valid[:, :-1].logical_not()  # kept after dropped
    return gaps.any().logical_not()


def encoder_forward(
    self: Any,
    src: torch.Tensor,
    mask: torch.Tensor | None = None,
    src_key_padding_mask: torch.Tensor | None = None,
    is_causal: bool | None = None,
) -> torch.Tensor:
    """``nn.TransformerEncoder.forward`` computing what eager computes where it takes the
    nested fast path (the NOTE); torch's own ``forward`` elsewhere."""
    nested = private.transformer_encoder_would_nest(
        self, src, mask, src_key_padding_mask, is_causal
    )
    if nested is None:
        return _TORCH_FORWARD(self, src, mask, src_key_padding_mask, is_causal)
    if not nested.alignment_checked:
        raise SPMDCompileError(
            f"{type(self).__name__} (mask_check=False) with a src_key_padding_mask in eval "
            "mode: eager runs its layers on a nested tensor without checking that the mask "
            "keeps a prefix of each row, and its result for a mask that does not cannot be "
            "reproduced in a compiled step (NOTE: [nn.TransformerEncoder's nested fast path]).",
            user_line=innermost_model_frame_of_stack(),
            hint="construct it with mask_check=True (the default), or with "
            "enable_nested_tensor=False to run the regular path in eager too.",
        )
    dropped = nested.valid.logical_not()
    output = src
    for layer in self.layers:
        output = layer(
            output, src_mask=None, is_causal=nested.is_causal, src_key_padding_mask=dropped
        )
    output = output.masked_fill(dropped[..., None] & left_aligned(nested.valid), 0.0)
    if self.norm is not None:
        output = self.norm(output)
    return output


def _patched(module: torch.nn.Module) -> bool:
    return getattr(type(module), "forward", None) is _TORCH_FORWARD and "forward" not in vars(
        module
    )


def transformer_encoders_as_eager(modules: list[torch.nn.Module]) -> contextlib.AbstractContextManager[None]:
    """Inside: the ``nn.TransformerEncoder``s of ``modules`` compute what eager's nested
    fast path computes (the NOTE); their ``forward`` is restored on the way out."""
    return forwards_replaced(modules, lambda m: encoder_forward if _patched(m) else None)


__all__ = ["encoder_forward", "left_aligned", "transformer_encoders_as_eager"]
