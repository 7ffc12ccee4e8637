"""The names a function's code reads, its nested code (comprehensions, lambdas, inner
functions) included: the globals a step can reach by name (guards, kept tensors, the
GradScalers a step uses)."""

from __future__ import annotations

import types
from collections.abc import Iterator


def names_in(code: types.CodeType) -> Iterator[str]:
    """``co_names`` of ``code`` and of every code object nested in it."""
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from names_in(const)


__all__ = ["names_in"]
