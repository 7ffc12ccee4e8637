"""Which torch.optim optimizers a compiled step supports, and how their step is traced.

NOTE: [tensor hyper-parameters in Scalar arguments]
The learning rate is a graph input (a 0-dim tensor) so that schedulers never recompile.
Adagrad, RMSprop and Adadelta pass it (or ``-lr``, or Adagrad's decayed ``clr``) as the
``alpha=`` / ``value=`` Scalar argument of ``add_`` / ``addcdiv_`` / ``addcmul_``, and
Rprop as the ``fill_value`` of ``full_like``; a Scalar argument reads a tensor with
``.item()``, which a traced program cannot do. While the optimizer's ``step()`` is traced,
those calls are rewritten into the same arithmetic with the scalar as a tensor operand:

    param.addcdiv_(grad, avg, value=-lr)    ->  param.addcdiv_((-lr).to(dtype) * grad, avg)
    param.add_(delta, alpha=-lr)            ->  param.add_(delta * (-lr).to(dtype))
    torch.full_like(grad, lr)               ->  torch.full_like(grad, 0) + lr.to(dtype)

(``full_like`` is patched on the torch module for the step: its argument parser refuses a
tensor before ``__torch_function__`` runs.)

The eager kernels compute ``self + value * t1 / t2`` (and ``self + alpha * other``) with
the Scalar cast to the op's compute dtype, so the rewrite rounds the same way: the scalar
is cast to that dtype and multiplied first. Calls with Python-number scalars are left as
they are.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode

from ..errors import SPMDCompileError

# Optimizers that cannot become one program, and what the user can do instead.
UNSUPPORTED = {
    "LBFGS": (
        "it re-evaluates a closure a data-dependent number of times (line search and "
        "convergence tests read tensor values in Python), which is not one program",
        "use another optimizer (Adam, AdamW, SGD, ...) in the compiled step, or run the "
        "LBFGS step uncompiled",
    ),
    "SparseAdam": (
        "it needs sparse gradients (nn.Embedding(sparse=True)), and a compiled step "
        "computes dense gradients",
        "use torch.optim.Adam or AdamW (dense gradients) in the compiled step",
    ),
}

_ALPHA_OPS = frozenset({"add", "add_", "sub", "sub_"})
_VALUE_OPS = frozenset({"addcdiv", "addcdiv_", "addcmul", "addcmul_"})


def check_supported(optimizers: list[torch.optim.Optimizer], where: str | None) -> None:
    """Refuse optimizers a compiled step cannot run, naming them and what to do."""
    for oi, opt in enumerate(optimizers):
        for cls in type(opt).__mro__:
            reason = UNSUPPORTED.get(cls.__name__)
            if reason is not None and cls.__module__.startswith("torch.optim"):
                raise SPMDCompileError(
                    f"optimizer[{oi}] is torch.optim.{cls.__name__}, which a compiled train "
                    f"step cannot run: {reason[0]}.",
                    user_line=where,
                    hint=reason[1] + ".",
                )


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype eager kernels cast a Scalar argument to (opmath: float for 16-bit)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class _TensorScalars(TorchFunctionMode):
    """Rewrites Scalar arguments given as tensors (NOTE: [tensor hyper-parameters in
    Scalar arguments])."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        if name in _ALPHA_OPS and isinstance(kwargs.get("alpha"), torch.Tensor):
            self_, other = args[0], args[1]
            scale = kwargs.pop("alpha").to(_compute_dtype(self_.dtype))
            return func(self_, other * scale, *args[2:], **kwargs)
        if name in _VALUE_OPS and isinstance(kwargs.get("value"), torch.Tensor):
            self_, t1, t2 = args[0], args[1], args[2]
            scale = kwargs.pop("value").to(_compute_dtype(self_.dtype))
            return func(self_, scale * t1, t2, **kwargs)
        return func(*args, **kwargs)


def _full_like_accepting_tensors(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``torch.full_like`` whose fill value may be a 0-dim tensor (Rprop's initial step
    size is ``full_like(grad, lr)``; the argument parser refuses a tensor that requires
    grad before any ``__torch_function__`` could see it)."""

    def full_like(input: torch.Tensor, fill_value: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if isinstance(fill_value, torch.Tensor):
            out = original(input, 0, *args, **kwargs)
            return out + fill_value.detach().to(out.dtype)  # copy_ has no DTensor rule
        return original(input, fill_value, *args, **kwargs)

    return full_like


@contextlib.contextmanager
def tracing_optimizer_step(opt: torch.optim.Optimizer, oi: int, where: Callable[[BaseException], Any]) -> Iterator[None]:
    """Context for tracing ``opt.step()``: tensor Scalars rewritten, and a Python read of
    a tensor's value inside the optimizer refused with the optimizer's name."""
    from .traced_items import value_read_errors
    from .value_checks import Undecided

    try:
        with _TensorScalars(), mock.patch.object(
            torch, "full_like", _full_like_accepting_tensors(torch.full_like)
        ):
            yield
    except Undecided as exc:  # NOTE: [value checks]: named if it is refused
        exc.owner = f"optimizer[{oi}] ({type(opt).__module__}.{type(opt).__name__}) in its step()"
        raise
    except value_read_errors() as exc:
        raise SPMDCompileError(
            f"optimizer[{oi}] ({type(opt).__module__}.{type(opt).__name__}) reads the value "
            "of a tensor in Python inside its step() (.item() or control flow on a tensor), "
            "which cannot be captured into one program.",
            user_line=where(exc),
            hint="use another torch.optim optimizer (all but LBFGS, SparseAdam and Adafactor, "
            "whose step computes with .item() values, compile), or make this optimizer's "
            "step use tensor ops only (its capturable path).",
        ) from exc
