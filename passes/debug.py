"""Leveled debug output of the pass pipeline, chosen by ``SPMD_DEBUG``.

- ``SPMD_DEBUG=1``: the pass list, each pass's time and whether it changed the graph, at
  INFO on the logger ``spmd_compiler.passes``.
- ``SPMD_DEBUG=2``: also, per pass, how the count of each op changed (``+2 aten.cat``).
- ``SPMD_DEBUG=3``: also a readable dump of the graph before and after every pass, in the
  folder ``SPMD_DEBUG_DIR`` (default ``./spmd_debug``), named ``NN_<pass>_before.txt`` /
  ``NN_<pass>_after.txt``. A later compile in the same process writes over them.

Any level turns on the checks between passes (``PassOptions.check``).

Each dump line is one node: its name, the shape and dtype of its value, its placement in
short form (``[S(0)]``, ``[R]``, ``[P(sum)]``), the op and its arguments, and the pass
that created it.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx

from spmd_compiler.expand.retrace import format_placements
from spmd_compiler.ir.node_meta import CREATED_BY, PLACEMENT

from .checks import is_collective, short_op_name

log = logging.getLogger("spmd_compiler.passes")

DEBUG_ENV = "SPMD_DEBUG"
DEBUG_DIR_ENV = "SPMD_DEBUG_DIR"
DEFAULT_DEBUG_DIR = "spmd_debug"


def debug_level() -> int:
    """The level in ``SPMD_DEBUG`` (0 when unset; 1 for a value that is not a number)."""
    raw = os.environ.get(DEBUG_ENV, "").strip()
    if not raw:
        return 0
    try:
        return max(int(raw), 0)
    except ValueError:
        log.warning("%s=%r is not a level (0-3); using 1", DEBUG_ENV, raw)
        return 1


@dataclass
class PassRecord:
    """What one pass did, for the summary table."""

    name: str
    description: str
    seconds: float = 0.0
    changed: bool | None = None  # None: disabled


@dataclass
class DebugSession:
    """Debug output of one pipeline run."""

    level: int
    folder: Path
    records: list[PassRecord] = field(default_factory=list)

    @classmethod
    def from_env(cls) -> DebugSession:
        level = debug_level()
        folder = Path(os.environ.get(DEBUG_DIR_ENV) or DEFAULT_DEBUG_DIR)
        session = cls(level, folder)
        if level >= 1:
            _make_visible(log)
        if level >= 3:
            folder.mkdir(parents=True, exist_ok=True)
            log.info("pass dumps go to %s", folder.resolve())
        return session

    def before(self, index: int, name: str, gm: torch.fx.GraphModule) -> Counter[str] | None:
        """Dump the graph before pass number ``index``; the op counts for ``after``."""
        if self.level >= 3:
            self._dump(index, name, "before", gm)
        return op_counts(gm) if self.level >= 2 else None

    def after(
        self, index: int, name: str, gm: torch.fx.GraphModule, counts: Counter[str] | None
    ) -> None:
        if self.level >= 3:
            self._dump(index, name, "after", gm)
        if counts is not None:
            log.info("pass %s: %s", name, format_count_diff(counts, op_counts(gm)))

    def summary(self) -> None:
        """The pass list with each pass's time, at INFO (``SPMD_DEBUG>=1``)."""
        if self.level < 1:
            return
        ran = [r for r in self.records if r.changed is not None]
        total = sum(r.seconds for r in ran)
        lines = [f"pass pipeline: {len(ran)} pass(es) in {total * 1e3:.1f} ms"]
        for i, r in enumerate(self.records, 1):
            state = "disabled" if r.changed is None else "changed" if r.changed else "no-op"
            lines.append(
                f"  {i:2d}. {r.name:<30} {r.seconds * 1e3:8.2f} ms  {state:<8}  {r.description}"
            )
        log.info("\n".join(lines))

    def _dump(self, index: int, name: str, when: str, gm: torch.fx.GraphModule) -> None:
        path = self.folder / f"{index:02d}_{name}_{when}.txt"
        path.write_text(format_graph(gm, f"{index:02d} {name}: {when}"))


class _FallbackHandler(logging.StreamHandler):
    """Prints to stderr only while logging is not configured (the root logger has no
    handler); once the application configures logging (``basicConfig``, before or after
    us), records go through its handlers alone, so nothing prints twice."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


def _make_visible(logger: logging.Logger) -> None:
    """``SPMD_DEBUG`` asks for output: show INFO even where logging is not configured.
    One handler per logger at most, however many compiles ask."""
    if not logger.isEnabledFor(logging.INFO):
        logger.setLevel(logging.INFO)
    if not any(isinstance(h, _FallbackHandler) for h in logger.handlers):
        logger.addHandler(_FallbackHandler())


def op_counts(gm: torch.fx.GraphModule) -> Counter[str]:
    return Counter(short_op_name(n) for n in gm.graph.nodes if n.op == "call_function")


def format_count_diff(before: Counter[str], after: Counter[str]) -> str:
    """``+2 aten.cat, -3 _c10d_functional.all_reduce`` (or ``no op-count change``)."""
    parts = []
    for op in sorted(set(before) | set(after)):
        delta = after[op] - before[op]
        if delta:
            parts.append(f"{delta:+d} {op}")
    return ", ".join(parts) if parts else "no op-count change"


def format_graph(gm: torch.fx.GraphModule, title: str) -> str:
    """A readable listing of ``gm``: one node per line, with value, placement and creator."""
    nodes = list(gm.graph.nodes)
    collectives = sum(1 for n in nodes if is_collective(n))
    lines = [f"# {title} ({len(nodes)} nodes, {collectives} collectives)"]
    for node in nodes:
        lines.append(format_node(node))
    return "\n".join(lines) + "\n"


def format_node(node: torch.fx.Node) -> str:
    value = _format_value(node.meta.get("val"))
    placement = node.meta.get(PLACEMENT)
    where = format_placements(placement) if placement is not None else ""
    if node.op == "call_function":
        args = ", ".join(_format_arg(a) for a in node.args)
        kwargs = "".join(f", {k}={_format_arg(v)}" for k, v in node.kwargs.items())
        op = f"{short_op_name(node)}({args}{kwargs})"
    elif node.op == "output":
        op = f"output({_format_arg(node.args[0])})"
    else:
        op = f"{node.op} {node.target}"
    creator = f"  # by {node.meta[CREATED_BY]}" if CREATED_BY in node.meta else ""
    return f"{node.name:<24} {value:<18} {where:<10} = {op}{creator}"


def _format_value(val: Any) -> str:
    if isinstance(val, torch.Tensor):
        dtype = str(val.dtype).removeprefix("torch.")
        return f"{dtype}{list(val.shape)}"
    if isinstance(val, (list, tuple)):
        return "(" + ", ".join(_format_value(v) for v in val) + ")"
    return "" if val is None else type(val).__name__


def _format_arg(arg: Any) -> str:
    if isinstance(arg, torch.fx.Node):
        return f"%{arg.name}"
    if isinstance(arg, (list, tuple)):
        inner = ", ".join(_format_arg(a) for a in arg)
        return f"[{inner}]" if isinstance(arg, list) else f"({inner})"
    return repr(arg)
