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
            ``param_dtype`` (as in FSDP2). Each gradient is cast to it before its
            reduction and the reduced gradient to the parameter's dtype before the
            optimizer reads it (NOTE: [gradients reduced in reduce_dtype]).
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

    @classmethod
    def of(cls, policy: object) -> MixedPrecisionPolicy:
        """``policy`` as this class: itself, or torch's FSDP2 policy
        (``torch.distributed.fsdp.MixedPrecisionPolicy``, what a script ported from
        ``fully_shard`` passes) converted, where it asks for what this one does; before,
        torch's was accepted and the first call failed inside the mode."""
        if isinstance(policy, cls):
            return policy
        name = f"{type(policy).__module__}.{type(policy).__qualname__}"
        if type(policy).__name__ != "MixedPrecisionPolicy" or not hasattr(policy, "param_dtype"):
            raise TypeError(f"mp_policy must be a MixedPrecisionPolicy, got {name}")
        if getattr(policy, "output_dtype", None) is not None:
            raise ValueError(
                f"mp_policy {policy!r}: output_dtype (casting the root module's outputs) is "
                "not supported; cast the output in the step (`model(x).float()`) instead."
            )
        if getattr(policy, "cast_forward_inputs", True) is False:
            raise ValueError(
                f"mp_policy {policy!r}: cast_forward_inputs=False is not supported; the "
                "root module's floating inputs are cast to param_dtype, as FSDP2's default."
            )
        return cls(param_dtype=policy.param_dtype, reduce_dtype=getattr(policy, "reduce_dtype", None))

