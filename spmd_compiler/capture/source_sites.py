"""What a frame's current instruction is part of in its source: the condition of a
``while`` (NOTE: [while loops on tensor values]), a call of the builtin ``max`` / ``min``
(NOTE: [max and min of an .item() value]). Found by the instruction's position
(``co_positions``, Python 3.11 on) in its file's syntax tree; None where the source
cannot be read (code made by ``exec``, Python 3.10)."""

from __future__ import annotations

import ast
import functools
import linecache
from typing import Any


@functools.lru_cache(maxsize=32)
def _parsed(source: str) -> ast.Module | None:
    try:
        return ast.parse(source)
    except (SyntaxError, ValueError):
        return None


def _position_and_tree(frame: Any) -> tuple[tuple[int, int, int, int], ast.Module] | None:
    """(line, end line, column, end column) of ``frame``'s current instruction and the
    syntax tree of its file."""
    try:
        line, end_line, column, end_column = list(frame.f_code.co_positions())[frame.f_lasti // 2]
    except (AttributeError, IndexError):  # Python 3.10 has no positions
        return None
    if line is None or end_line is None or column is None or end_column is None:
        return None
    tree = _parsed("".join(linecache.getlines(frame.f_code.co_filename, frame.f_globals)))
    return None if tree is None else ((line, end_line, column, end_column), tree)


def _within(position: tuple[int, int, int, int], node: ast.AST) -> bool:
    line, end_line, column, end_column = position
    start, end = (node.lineno, node.col_offset), (node.end_lineno, node.end_col_offset)  # type: ignore[attr-defined]
    return start <= (line, column) and (end_line, end_column) <= end  # type: ignore[operator]


def _tests(position: tuple[int, int, int, int], node: ast.While | ast.If) -> bool:
    """Whether the instruction at ``position`` evaluates or tests the condition of
    ``node``: Python 3.11 gives the condition's own instructions the condition's
    positions, and the jump that tests it the whole statement's."""
    return _within(position, node.test) or position[::2] == (node.lineno, node.col_offset)


def _breaks_of(loop: ast.While) -> list[ast.If]:
    """The ``if``s of ``loop``'s body (not of a loop or function inside it) whose body or
    ``else`` holds ``break`` itself."""
    found: list[ast.If] = []
    stack: list[ast.AST] = list(loop.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.For, ast.AsyncFor, ast.While, ast.FunctionDef, ast.AsyncFunctionDef,
                             ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(node, ast.If) and any(isinstance(s, ast.Break) for s in (*node.body, *node.orelse)):
            found.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return found


def _exits_of(loop: ast.While) -> list[ast.AST]:
    """The ``break``, ``return`` and ``raise`` statements of ``loop``'s body (not of a loop
    or function inside it: a ``break`` there ends that loop)."""
    found: list[ast.AST] = []
    stack: list[ast.AST] = list(loop.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(node, (ast.For, ast.AsyncFor, ast.While)):  # their breaks are theirs
            stack.extend(n for n in ast.walk(node) if isinstance(n, (ast.Return, ast.Raise)))
            continue
        if isinstance(node, (ast.Break, ast.Return, ast.Raise)):
            found.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return found


def _one_condition(test: ast.expr) -> bool:
    """Whether ``test`` is one condition (``x.any()``, ``not (y < tol).all()``), not a
    combination by ``and`` / ``or`` that may hold a Python bound (``k < 5 and ...``)."""
    while isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        test = test.operand
    return not isinstance(test, ast.BoolOp)


def while_of_condition(frame: Any) -> ast.While | None:
    """The ``while`` statement whose condition ``frame`` is evaluating or testing, where
    that condition alone ends the loop, or None; in a ``while True:`` loop, the condition
    of the one ``if`` that ends it by ``break`` (torch's ``trunc_normal_``: ``while True:
    ... if not mask.any(): break``) counts as its condition. A loop with another way out
    (a ``break``, ``return`` or ``raise`` besides, a condition combined with ``and`` /
    ``or``: ``while k < 5 and not done.any():``) may be bounded by Python and is none, as
    is an ``if`` in the body of another loop (a ``for``, a ``while`` on a Python value)."""
    found = _position_and_tree(frame)
    if found is None:
        return None
    position, tree = found
    for node in ast.walk(tree):
        if not isinstance(node, ast.While):
            continue
        if _tests(position, node):
            return node if _one_condition(node.test) and not _exits_of(node) else None
        if isinstance(node.test, ast.Constant) and node.test.value:
            ending = [test for test in _breaks_of(node) if _tests(position, test)]
            if ending:
                exits = _exits_of(node)
                sole = len(exits) == 1 and any(exits[0] in (*i.body, *i.orelse) for i in ending)
                return node if sole and _one_condition(ending[0].test) else None
    return None


def call_running(frame: Any) -> ast.Call | None:
    """The call expression ``frame`` is running (its current instruction's span), the
    innermost of calls ending there (``f(g)(x)``); None where that cannot be read."""
    found = _position_and_tree(frame)
    if found is None:
        return None
    (_, end_line, _, end_column), tree = found
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
             and (node.end_lineno, node.end_col_offset) == (end_line, end_column)]
    return calls[-1] if calls else None


def builtin_called(frame: Any) -> str | None:
    """``max`` or ``min`` where ``frame`` is running a call of that builtin by its name
    (``max(n, 1)``), else None."""
    call = call_running(frame)
    if call is None or not isinstance(call.func, ast.Name) or call.func.id not in ("max", "min"):
        return None
    return call.func.id
