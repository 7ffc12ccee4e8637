"""One progress-bar line per finished unit of work: ``[bench] part [###---] 2/4 message``.

Plain lines (no carriage returns), so the bar reads the same in a terminal, a CI log and a
file, and ranks launched as subprocesses can print it too.
"""

from __future__ import annotations

WIDTH = 20


def bar(done: int, total: int) -> str:
    """``[#####...............]`` for ``done`` of ``total`` units."""
    filled = WIDTH * done // max(total, 1)
    return "[" + "#" * filled + "." * (WIDTH - filled) + "]"


def report(part: str, done: int, total: int, message: str) -> None:
    """Print that ``done`` of ``total`` units of ``part`` are finished."""
    print(f"[bench] {part} {bar(done, total)} {done}/{total} {message}", flush=True)
