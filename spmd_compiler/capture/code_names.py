"""The names a function's code reads, its nested code (comprehensions, lambdas, inner
functions) included: the globals a step can reach by name (guards, kept tensors, the
GradScalers and LR schedulers a step uses)."""

from __future__ import annotations

import contextlib
import dis
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any


def names_in(code: types.CodeType) -> Iterator[str]:
    """``co_names`` of ``code`` and of every code object nested in it."""
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from names_in(const)


def strings_in(code: types.CodeType) -> Iterator[str]:
    """The string constants of ``code`` and its nested code that are identifiers: the
    attribute names a ``getattr(obj, "name")`` and the keys a ``d["name"]`` read."""
    for const in code.co_consts:
        if isinstance(const, str) and const.isidentifier():
            yield const
        elif isinstance(const, types.CodeType):
            yield from strings_in(const)


_METHOD_LOADS = frozenset({"LOAD_METHOD"})
_STORES = frozenset({"STORE_ATTR", "DELETE_ATTR", "STORE_GLOBAL", "DELETE_GLOBAL", "STORE_NAME", "DELETE_NAME"})
_VALUE_NAMES: dict[types.CodeType, frozenset[str]] = {}


def value_names_in(code: types.CodeType) -> frozenset[str]:
    """The names of ``code`` (and its nested code) read as values: not those only stored
    (``self.seen = 0``) or named as a method called at once (``optim.step()``: a counter
    ``trainer.step`` is no such method, calling it would raise). Cached per code
    object."""
    found = _VALUE_NAMES.get(code)
    if found is None:
        names: set[str] = set()
        for instruction in dis.get_instructions(code):
            if not isinstance(instruction.argval, str) or instruction.opname == "LOAD_CONST":
                continue
            if instruction.opname in _STORES:  # ``self.seen = 0`` reads nothing
                continue
            if instruction.opname in _METHOD_LOADS or (  # 3.12+: LOAD_ATTR, low bit set
                sys.version_info >= (3, 12) and instruction.opname == "LOAD_ATTR" and (instruction.arg or 0) & 1
            ):
                continue
            names.add(instruction.argval)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                names |= value_names_in(const)
        found = _VALUE_NAMES[code] = frozenset(names)
    return found


def reachable_by_name(func: Callable[..., Any], flat_args: list[Any], kind: type | tuple[type, ...]) -> list[Any]:
    """The objects of ``kind`` a step can reach by name: its arguments, the globals its
    code names, its closure variables and, for a bound method, the attributes of its
    ``self`` (``self.scheduler`` of a trainer object), in that order; an object met twice
    is listed twice."""
    found = [a for a in flat_args if isinstance(a, kind)]
    owner = getattr(func, "__self__", None)
    func = getattr(func, "__func__", func)
    code = getattr(func, "__code__", None)
    if code is not None:
        namespace = getattr(func, "__globals__", {})
        names = dict.fromkeys(names_in(code))  # nested code too (a lambda, a comprehension)
        found += [namespace[n] for n in names if isinstance(namespace.get(n), kind)]
        for cell in getattr(func, "__closure__", None) or ():
            with contextlib.suppress(ValueError):  # an empty cell
                if isinstance(cell.cell_contents, kind):
                    found.append(cell.cell_contents)
    if owner is not None and hasattr(owner, "__dict__"):
        found += [v for v in vars(owner).values() if isinstance(v, kind)]
    return found


__all__ = ["names_in", "reachable_by_name", "strings_in", "value_names_in"]
