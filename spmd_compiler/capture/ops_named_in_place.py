"""Ops whose name ends in ``_`` but that write nothing: traced as their ``bitwise_*``
twins, any other refused.

NOTE: [ops named like in-place ones]
DTensor tells an in-place op by its name alone (``OpSchema.is_inplace_op``: the schema
name ends in ``_``) and returns such an op's first argument instead of its result. The
ATen ops named so that write nothing are Python's bit operators: ``aten.__lshift__``,
``__rshift__``, ``__and__``, ``__or__``, ``__xor__`` (their ``Tensor`` and ``Scalar``
overloads; ``.int`` / ``.bool`` take Python numbers and never reach a graph). ``t << k``
and ``t >> k`` trace to them (``&``, ``|``, ``^`` trace to ``bitwise_*`` already), and
``h <<= k`` traces to the in-place ``__ilshift__``, which the functionalizing retrace
turns into ``__lshift__``. In a compiled step every shift gave its input back: eager's
``arange(-4, 4) << 10`` is ``[-4096, ..., 3072]``, compiled ``[-4, ..., 3]``, no error,
every mode; a hash-grid field hashing its cells with shifts trained 0.059 off eager in
3 Adam steps (probe s66).

Capture traces each as its twin with the same kernel and numbers (``__lshift__.Scalar``
as ``bitwise_left_shift.Tensor_Scalar``; in place, ``__ilshift__.Scalar`` as
``bitwise_left_shift_.Tensor_Scalar``, which functionalizes to the out-of-place twin;
``out=`` as ``out=``). The twin overload is the one whose arguments have the same types. Any other op of the
final graph named with a trailing ``_`` whose schema writes nothing (an op of a later
torch, a user's custom op) is refused naming the op and the line: DTensor would drop its
result. ``tests/sim/test_ops_named_in_place.py`` lists the ATen ops so named on the
torch that runs it, so a new one is seen.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from .. import _torch_private as private
from ..errors import node_error

aten = torch.ops.aten

_TWINS = {  # dunder: its twin; the in-place dunders map to in-place twins
    "__lshift__": "bitwise_left_shift",
    "__rshift__": "bitwise_right_shift",
    "__and__": "bitwise_and",
    "__or__": "bitwise_or",
    "__xor__": "bitwise_xor",
    "__ilshift__": "bitwise_left_shift_",
    "__irshift__": "bitwise_right_shift_",
    "__iand__": "bitwise_and_",
    "__ior__": "bitwise_or_",
    "__ixor__": "bitwise_xor_",
}


def named_in_place_without_writing(op: Any) -> bool:
    """Whether DTensor would take ``op`` for an in-place op that it is not."""
    schema = op._schema
    return schema.name.endswith("_") and not schema.is_mutable


def _argument_types(op: Any) -> tuple[str, ...]:
    return tuple(str(a.type) for a in op._schema.arguments)


def _twin_pairs() -> list[tuple[Any, Any]]:
    """(dunder overload, twin overload) for each tensor overload of ``_TWINS``."""
    pairs = []
    for dunder, twin in _TWINS.items():
        packet, twin_packet = getattr(aten, dunder), getattr(aten, twin)
        # getattr, not packet.__getattr__: that makes a new OpOverload, which replaces
        # the one DTensor keys its rules by
        twins = {_argument_types(op): op for op in (getattr(twin_packet, o) for o in twin_packet.overloads())}
        for op in (getattr(packet, o) for o in packet.overloads()):
            if _argument_types(op)[:1] == ("Tensor",):  # not the Python-number overloads
                pairs.append((op, twins[_argument_types(op)]))
    return pairs


def named_in_place_decompositions() -> dict[Any, Callable[..., Any]]:
    """The capture decompositions of the NOTE."""
    return dict(_twin_pairs())


def refuse_ops_named_in_place(gm: torch.fx.GraphModule) -> None:
    """Refuse an op the decompositions left that DTensor would read as in place."""
    for node in gm.graph.nodes:
        target = node.target
        if node.op == "call_function" and private.is_op_overload(target) and named_in_place_without_writing(target):
            raise node_error(
                f"{target} has a name ending in '_' but writes none of its arguments; "
                "DTensor takes such an op for an in-place one and gives back its first "
                "argument instead of the result, which would be silently wrong (NOTE: [ops "
                "named like in-place ones]).",
                node,
                hint="compute the value with an op whose name does not end in '_' "
                "(for a custom operator: rename it).",
            )


__all__ = [
    "named_in_place_decompositions", "named_in_place_without_writing", "refuse_ops_named_in_place",
]
