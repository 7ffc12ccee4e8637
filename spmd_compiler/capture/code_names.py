"""The names a function's code reads, its nested code (comprehensions, lambdas, inner
functions) included: the globals a step can reach by name (guards, kept tensors, the
GradScalers and LR schedulers a step uses)."""

from __future__ import annotations

import contextlib
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


__all__ = ["names_in", "reachable_by_name", "strings_in"]
