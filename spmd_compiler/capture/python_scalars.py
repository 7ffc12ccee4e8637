"""Python float arguments of the step as graph inputs.

NOTE: [float arguments as graph inputs]
A Python ``float`` argument of the train step (a loss weight, a temperature, a
schedule value) that changes every call would compile a new program every call if it
were a guard. Capture first tries it as a graph input: a 0-dim float64 tensor in place
of the float. The rule that keeps this exact:
- Only ``float`` arguments (``type(a) is float``). ``int`` and ``bool`` arguments stay
  guards: they usually steer shapes, indices, loop counts and branches.
- The float must be used numerically only, in tensor ops. Anything Python does with
  the value itself (``if scale > 0``, ``float(scale)``, ``math.exp(scale)``, ``range``,
  a Scalar argument such as ``F.dropout(x, p)`` or ``full_like(x, scale)``, returning
  it, storing it) fails the tensor trace, and the step is captured again with the float
  as a guard (a new value recompiles, which is then exact by construction). A float the
  traced program does not read at all (used only through a type test, say) is a guard
  too.
- Type promotion and rounding are the ones a Python number gets: where the tensor
  stand-in meets other tensors in an op, it is cast first to the dtype the op computes
  in with a Python scalar (the other floating operands' dtype, float32 opmath for
  16-bit floats next to a non-scalar operand, the default dtype next to integer
  tensors). Arithmetic among stand-ins alone stays in float64, as Python's does.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from .._torch_private import pytree

_REDUCED = (torch.float16, torch.bfloat16)


class FloatArgumentUsedInPython(Exception):
    """The trace used a float argument other than in tensor ops; capture it as a guard.
    ``indices``: the positions of the arguments concerned, where known (the others stay
    graph inputs); None: every float argument becomes a guard."""

    def __init__(self, message: str, indices: frozenset[int] | None = None) -> None:
        super().__init__(message)
        self.indices = indices


class FloatArgumentMode(TorchFunctionMode):
    """Tracks the stand-ins of float arguments (and scalars computed only from them)
    and casts them where they meet other tensors (see the NOTE)."""

    def __init__(self, stand_ins: list[torch.Tensor], indices: list[int] | None = None) -> None:
        super().__init__()
        self.scalars: dict[int, torch.Tensor] = {id(t): t for t in stand_ins}
        # id(stand-in) -> the position of its float in the step's flat arguments
        self.index_of: dict[int, int] = {id(t): i for t, i in zip(stand_ins, indices or [], strict=False)}
        # 0-dim bools computed only from stand-ins (``scale > 1``): an ``if`` on one is
        # Python's decision, which keeps the float a guard (NOTE: [value checks])
        self.flags: dict[int, torch.Tensor] = {}

    def is_stand_in(self, value: Any) -> bool:
        return isinstance(value, torch.Tensor) and id(value) in self.scalars

    def is_python_value(self, value: Any) -> bool:
        """A stand-in, or a 0-dim result computed only from stand-ins."""
        return self.is_stand_in(value) or (isinstance(value, torch.Tensor) and id(value) in self.flags)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        leaves = pytree.tree_leaves((args, kwargs))
        ours = [t for t in leaves if self.is_stand_in(t)]
        if not ours:
            return func(*args, **kwargs)
        if inspect.isfunction(func) and getattr(func, "__module__", "") != "torch._tensor":
            # a torch function written in Python (F.smooth_l1_loss tests ``beta == 0.0``
            # and passes beta on as a Scalar): its Python would decide on the value where
            # this mode cannot see it (its ops run with the mode off), and a decision on
            # a stand-in was taken for a check on a tensor's value, one way compiled and
            # every call of another value refused at run time. The float stays a guard.
            # (Running the function under this mode instead re-entered it through its
            # own ``handle_torch_function``: a RecursionError on ``F.cross_entropy``.)
            # ``torch._tensor``'s operators (``1 - scale``) are tensor ops.
            known = [self.index_of.get(id(t)) for t in ours]
            raise FloatArgumentUsedInPython(
                f"a float argument is passed to {func.__module__}.{func.__qualname__}",
                None if None in known else frozenset(i for i in known if i is not None),
            )
        others = [t for t in leaves if isinstance(t, torch.Tensor) and not self.is_stand_in(t)]
        if not others:
            out = func(*args, **kwargs)
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.dim() == 0 and t.is_floating_point():
                    self.scalars[id(t)] = t
                elif isinstance(t, torch.Tensor) and t.dim() == 0 and t.dtype == torch.bool:
                    self.flags[id(t)] = t
            return out
        dtype = _python_scalar_dtype(others)

        def cast(x: Any) -> Any:
            return x.to(dtype) if self.is_stand_in(x) else x

        args, kwargs = pytree.tree_map(cast, (args, kwargs))
        return func(*args, **kwargs)


def _python_scalar_dtype(others: list[torch.Tensor]) -> torch.dtype:
    """The dtype an op computes a Python float operand in, next to ``others``."""
    floating = [t for t in others if t.is_floating_point() or t.is_complex()]
    if not floating:
        return torch.get_default_dtype()
    dims = any(t.dim() > 0 for t in floating)
    candidates = [t for t in floating if t.dim() > 0] if dims else floating
    dtype = candidates[0].dtype
    for t in candidates[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    if dtype.is_complex:
        dtype = torch.float64 if dtype == torch.complex128 else torch.float32
    if dtype in _REDUCED and dims:
        return torch.float32  # opmath: the scalar is not rounded to 16 bits
    return dtype
