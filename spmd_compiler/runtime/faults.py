"""Which rank failed first: recorded in the process group's store, named by the others.

NOTE: [fault attribution]
When one rank fails, the others learn it only as a broken or timed-out collective
("Connection closed by peer"), which names neither the rank nor the cause. So:

- a rank that raises records ``(rank, what it raised)`` in the default group's store
  before it exits (``launch``'s rank body; under torchrun the excepthook that
  ``init_from_env`` installs), and then exits at once (``os._exit``), without
  ``destroy_process_group``, which can block while a peer is gone: its sockets close
  and its peers' collectives fail within moments instead of after the timeout;
- the ``launch`` parent hosts the store, so it records a rank that exits without a
  report (``os._exit``, a signal, a crash in C++) with its exit code, and a rank whose
  function returned while others still run (they may wait for it in a collective);
- a rank whose collective fails reads the first record of another rank (waiting up to
  ``WAIT_FOR_RECORD_S`` for the parent to notice a death) and names it in its error.

Records are numbered with the store's atomic ``add``, so record 1 is the first failure.
Under torchrun, a rank killed by a signal cannot record itself and the agent does not
record it: its peers then say that no rank recorded a failure.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import types
from typing import Any

import torch.distributed as dist

from .. import _torch_private as private

COUNT_KEY = "spmd_failures/count"
RECORD_PREFIX = "spmd_failures/"
# How long a rank whose collective failed waits for the record of the rank that failed
# (the launch parent records a death a few milliseconds after the process exits).
WAIT_FOR_RECORD_S = 2.0
_POLL_S = 0.05
# What ``launch`` records for a rank whose function returned while others still ran.
RETURNED_EARLY = "returned from its function while other ranks were still running"


def record_failure(store: Any, rank: int, what: str) -> None:
    """Append ``rank``'s failure to the records in ``store``; never raises."""
    try:
        number = store.add(COUNT_KEY, 1)
        payload = {"rank": rank, "what": what, "time": time.time()}
        store.set(f"{RECORD_PREFIX}{number}", json.dumps(payload))
    except Exception:  # noqa: BLE001 - the store may be gone; the failure is reported anyway
        pass


def describe_exception(exc: BaseException) -> str:
    """``raised ValueError: first line of the message``."""
    text = str(exc).strip().splitlines()
    return f"raised {type(exc).__name__}" + (f": {text[0]}" if text else "")


def describe_exit_code(code: int | None) -> str:
    if code is not None and code < 0:
        return f"was killed by signal {-code} without reporting an error"
    return f"exited with code {code} without reporting an error"


def records(store: Any) -> list[dict[str, Any]]:
    """Every failure recorded so far, first first; [] when the store cannot be read."""
    out = []
    try:
        count = store.add(COUNT_KEY, 0)
        for number in range(1, count + 1):
            key = f"{RECORD_PREFIX}{number}"
            if store.check([key]):
                out.append(json.loads(store.get(key)))
    except Exception:  # noqa: BLE001 - a dead store master: nothing to read
        return []
    return out


def first_failure_of_another_rank(
    my_rank: int, wait_s: float = WAIT_FOR_RECORD_S
) -> dict[str, Any] | None:
    """The first recorded failure of a rank other than ``my_rank`` (waits up to
    ``wait_s`` for one), or None."""
    store = default_store()
    if store is None:
        return None
    deadline = time.monotonic() + wait_s
    while True:
        for record in records(store):
            if record["rank"] != my_rank:
                return record
        if time.monotonic() >= deadline:
            return None
        time.sleep(_POLL_S)


def attribution(my_rank: int, wait_s: float = WAIT_FOR_RECORD_S) -> str:
    """One sentence naming the rank that failed first, for a collective's error."""
    record = first_failure_of_another_rank(my_rank, wait_s)
    if record is None:
        return (
            "No other rank recorded a failure: one may be stuck elsewhere (another "
            "collective, Python code) or slower than the collective timeout, or was killed "
            "without a trace."
        )
    if record["what"] == RETURNED_EARLY:
        return (
            f"Rank {record['rank']} had already left: it {RETURNED_EARLY} (did the ranks "
            "run different numbers of steps?)."
        )
    waited = "timed out" in record["what"].lower() or "timeout" in record["what"].lower()
    return f"Rank {record['rank']} failed first: it {record['what']}." + (
        " Its own wait ran out: it was waiting elsewhere (a barrier, another collective, "
        "the next step) while this rank was in the step; did the ranks run different "
        "numbers of steps (uneven data)?" if waited else ""
    )


# The store ``launch``'s rank body connected to the parent with (the default group's
# store wraps it in a prefix the parent does not know); None under torchrun.
_LAUNCH_STORE: list[Any] = []


def use_launch_store(store: Any) -> None:
    """Record failures in ``store`` (the launch parent's, unprefixed) in this process."""
    _LAUNCH_STORE[:] = [store]


def default_store() -> Any | None:
    """The store failures are recorded in: the launch parent's, else the default group's."""
    if _LAUNCH_STORE:
        return _LAUNCH_STORE[0]
    if not dist.is_initialized() or private.is_fake_process_group():
        return None
    try:
        return private.default_store()
    except Exception:  # noqa: BLE001
        return None


def exit_after_failure(code: int = 1) -> None:
    """Leave now (see NOTE: [fault attribution]): flush the output, skip teardown."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(code)


def install_excepthook() -> None:
    """Under torchrun: record an uncaught exception in the store, print it, exit at once."""
    previous = sys.excepthook
    if getattr(previous, "_spmd_fault_hook", False):
        return

    def hook(
        kind: type[BaseException], exc: BaseException, tb: types.TracebackType | None
    ) -> None:
        store = default_store()
        if store is not None and dist.get_world_size() > 1:
            record_failure(store, dist.get_rank(), describe_exception(exc))
            try:
                previous(kind, exc, tb)
            except Exception:  # noqa: BLE001
                traceback.print_exception(kind, exc, tb)
            exit_after_failure(1)
        previous(kind, exc, tb)

    hook._spmd_fault_hook = True  # type: ignore[attr-defined]
    sys.excepthook = hook
