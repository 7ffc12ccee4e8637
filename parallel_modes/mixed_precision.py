"""Mixed precision for data parallelism (FSDP2's ``MixedPrecisionPolicy`` semantics)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Compute in a low precision while master weights and optimizer state stay fp32.

    Args:
        param_dtype: dtype of the gathered parameters and of forward/backward compute
            (the root module's floating inputs are cast too). ``None`` keeps fp32.
        reduce_dtype: dtype in which gradients are reduced across ranks; ``None`` means
            ``param_dtype`` (as in FSDP2). Reduced gradients are cast to the parameter's
            dtype before the optimizer reads them.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):
            dtype = getattr(self, name)
            if dtype is not None and not dtype.is_floating_point:
                raise ValueError(f"MixedPrecisionPolicy.{name} must be a floating dtype, got {dtype}")

    @property
    def effective_reduce_dtype(self) -> torch.dtype | None:
        return self.reduce_dtype if self.reduce_dtype is not None else self.param_dtype
