"""0-dim tensors given where torch takes an int.

NOTE: [0-d tensors in int arguments]
Autoformer's delay aggregation rolls by the top delays: ``torch.roll(v, -int(index[i]),
-1)``. ``int()`` of a traced tensor is refused (NOTE: [an index read with int()]), and
until the sixty-seventh session that refusal named ``torch.roll`` among the ways to keep
the value a tensor. But roll's ``shifts`` is an int list: torch's argument parser reads
a 0-dim integer tensor there as a Python int (``__index__``, ``.item()``), so
``torch.roll(v, -index[i], -1)`` was refused as well, with the advice for
value-dependent shapes ("use torch.where, masking"), which does not fit a roll. A 0-dim
integer tensor reaching an argument that torch's schemas type as an int (or a list of
ints) and never as a Tensor is now refused as such: the op, the argument and its name,
and what to write instead; for ``roll`` the gather it is, ``x.index_select(d,
(torch.arange(n) - s) % n)`` with the shift ``s`` a tensor (exact: a gather of the same
elements; one program for every shift). Other int arguments (sizes, dims) decide the
result's shape or layout, which a compiled step fixes: computed from shapes, or a Python
int passed in (one program per distinct value). A floating 0-dim tensor there is eager's
TypeError, left to torch.
``narrow``'s ``start`` is typed as a Tensor in one overload (``narrow.Tensor``), which
reads it with ``.item()`` all the same: a random crop ``hr[i].narrow(1, ys[i], P)`` was
refused with the advice for value-dependent shapes (sixty-eighth session). It is refused
as an int argument (``READ_AS_INT``), the hint giving the gather it is,
``x.index_select(d, s + torch.arange(n))``. Not rewritten here: that gather reads an
out-of-range start as an index error, where narrow's own check names the range.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import SPMDCompileError, innermost_model_frame_of_stack

INT_TYPES = frozenset({
    "int", "SymInt", "List[int]", "List[SymInt]", "Optional[int]", "Optional[SymInt]",
    "Optional[List[int]]", "Optional[List[SymInt]]",
})

# Tensor arguments that torch reads as a Python int all the same (``.item()``): op name ->
# the argument's position (self counted) and name (see the NOTE)
READ_AS_INT = {"narrow": (2, "start")}

# the tensor form of an op's int argument, for the refusal's hint
_GATHER_FORMS = {
    "narrow": "a narrow from a start held in a tensor is a gather: `x.narrow(d, s, n)` is "
    "`x.index_select(d, s + torch.arange(n, device=x.device))` with s the 0-dim tensor "
    "(the same elements for 0 <= s <= x.shape[d] - n; one program for every start)",
    "roll": "a roll by a shift held in a tensor is a gather: `torch.roll(x, s, d)` is "
    "`x.index_select(d, (torch.arange(x.shape[d], device=x.device) - s) % x.shape[d])` "
    "with s the 0-dim tensor (exact; one program for every shift)",
}


def torch_function_name(func: Any) -> str:
    """``torch.roll`` / ``Tensor.roll``: how a refusal names a torch function called."""
    name = getattr(func, "__name__", str(func))
    return f"torch.{name}" if getattr(torch, name, None) is func else f"Tensor.{name}"


def int_argument_refusal(func: Any, slot: str, parameter: str | None) -> SPMDCompileError:
    """The refusal of a 0-dim integer tensor given to ``func``'s int argument ``slot``
    (its schema name ``parameter``), NOTE: [0-d tensors in int arguments]."""
    name = getattr(func, "__name__", "")
    form = _GATHER_FORMS.get(name)
    called = f"{slot} ({parameter})" if parameter and not slot.endswith("=") else slot
    return SPMDCompileError(
        f"The train step gives a 0-dim tensor to `{torch_function_name(func)}` as {called}, an argument "
        + ("that torch reads with .item()" if name in READ_AS_INT else "that takes Python ints")
        + ": torch reads the tensor's value there as an int (as "
        "int(t) would), which a compiled step cannot do: the program computes the tensor "
        "at run time (NOTE: [0-d tensors in int arguments]).",
        user_line=innermost_model_frame_of_stack(),
        hint=(f"{form}." if form else "compute the int from shapes, or pass a Python int as "
              "an argument of the step (each distinct value compiles its own program); an "
              "index kept in a tensor indexes with index_select / gather / index_copy_.")
    )


__all__ = ["INT_TYPES", "READ_AS_INT", "int_argument_refusal", "torch_function_name"]
