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


def record_failure(store: Any, rank: int, what: str, uncertain: bool = False) -> None:
    """Append ``rank``'s failure to the records in ``store``; never raises. ``uncertain``:
    a failure that may be a peer's (NOTE: [ranks that fail alike])."""
    try:
        number = store.add(COUNT_KEY, 1)
        payload = {"rank": rank, "what": what, "time": time.time(), "uncertain": uncertain}
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
    ``wait_s`` for one), or None; an uncertain record (NOTE: [ranks that fail alike])
    only where no other comes within ``wait_s``."""
    store = default_store()
    if store is None:
        return None
    deadline = time.monotonic() + wait_s
    while True:
        others = [record for record in records(store) if record["rank"] != my_rank]
        for record in others:
            if not record.get("uncertain"):
                return record
        if time.monotonic() >= deadline:
            return others[0] if others else None
        time.sleep(_POLL_S)


# NOTE: [ranks that fail alike]
# A rank whose call fails outside the program's fx nodes (in the library's own code
# around it, or in a program Inductor lowered) cannot tell its own failure from a peer's
# broken collective, so it records nothing and waits for a peer's record. Where every
# rank fails there alike (a parameter subclass the state writes cannot handle: both of 2
# gloo ranks, sixty-first session), none records, and each said "No other rank recorded a
# failure: one may be stuck elsewhere", though the other had failed too. Such a rank now
# records its failure as uncertain before it waits: peers name it ("Rank 1 failed too,
# also outside its program's collectives") where no certain record comes, and one that
# finds none says its failure may be its own. A certain record (a rank that raised in
# its own computation, or died) is still named first.


def attribution(my_rank: int, wait_s: float = WAIT_FOR_RECORD_S, own: str | None = None) -> str:
    """One sentence naming the rank that failed first, for a collective's error. ``own``:
    this rank's failure where it may be its own, not a collective's (recorded as
    uncertain first: NOTE: [ranks that fail alike])."""
    store = default_store() if own is not None else None
    if store is not None and own is not None:
        record_failure(store, my_rank, own, uncertain=True)
    record = first_failure_of_another_rank(my_rank, wait_s)
    return attribution_of(record, wait_s, own is not None)


def attribution_of(record: dict[str, Any] | None, wait_s: float, own_possible: bool) -> str:
    """The sentence of ``attribution`` for ``record`` (the first failure of another rank,
    or None); ``own_possible``: this rank failed outside its program's collectives."""
    if record is not None and record.get("uncertain"):
        return (
            f"Rank {record['rank']} failed too, also outside its program's collectives: it "
            f"{record['what']}. Ranks that fail alike each report their own failure; where "
            f"this rank's error is a broken collective, rank {record['rank']}'s is its cause."
        )
    if record is None and own_possible:
        return (
            f"No other rank recorded a failure within {wait_s:g} s. This failure happened "
            "outside the program's collectives and may be this rank's own; else a peer may "
            "be stuck elsewhere (another collective, Python code), slower than the "
            "collective timeout, or killed without a trace."
        )
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
