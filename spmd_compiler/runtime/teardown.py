"""A rank's exit waits for gloo's worker threads to put down the tensors they hold.

NOTE: [gloo teardown race]
Seen on 2 gloo ranks under torchrun (``examples/torchrun_ddp.py``, about 1 exit in 20 on
this 2-core machine): after the numbers matched and after ``destroy_process_group``, a
rank aborted with "terminate called without an active exception" (SIGABRT). The core
dump's stack: a gloo worker thread (``ProcessGroupGloo::runLoop``) destroying the work of
the last ``dist.barrier()``, which held the all-reduce just before it, whose tensors have
Python objects; dropping them needs the GIL (``decref_pyobject``), and the interpreter
was already finalizing, so ``take_gil`` ended the thread (``pthread_exit``) inside a
``noexcept`` destructor: ``std::terminate``.

``destroy_process_group`` would join those threads, but on torch 2.13 a process group
that served a functional collective (DTensor's, ours) stays alive after it (references
held inside torch, not by this project's objects), so its threads live until the
interpreter tears down. So when a rank's process exits (``atexit``, which runs before
finalization, while other threads can still take the GIL), it waits, the GIL released,
until every gloo worker thread is asleep and used no CPU time over the last polls:
a thread waiting for the GIL wakes as soon as it is free, finishes its release and goes
back to waiting for work. Bounded by ``MAX_WAIT_S``; nothing is waited for when no gloo
thread exists (NCCL, simulated ranks). Installed by ``init_from_env`` and ``launch``'s
rank body.
"""

from __future__ import annotations

import atexit
import os
import time

GLOO_WORKER_THREAD = "pt_gloo_runloop"  # the name gloo's worker threads carry (Linux)
MAX_WAIT_S = 1.0
POLL_S = 0.01
QUIET_POLLS = 3  # consecutive polls with every worker asleep and its CPU time unchanged
_TASKS = "/proc/self/task"
_installed = False


def install() -> None:
    """Wait for gloo's worker threads at exit (NOTE: [gloo teardown race]); idempotent."""
    global _installed
    if not _installed:
        _installed = True
        atexit.register(wait_for_gloo_workers)


def wait_for_gloo_workers(max_wait_s: float = MAX_WAIT_S) -> float:
    """Sleep (GIL released) until every gloo worker thread is idle; returns seconds waited."""
    start = time.monotonic()
    if not os.path.isdir(_TASKS):  # not Linux: no thread names to read; a short grace
        time.sleep(POLL_S * QUIET_POLLS)
        return time.monotonic() - start
    previous = _gloo_workers()
    if not previous:
        return 0.0
    quiet = 0
    while quiet < QUIET_POLLS and time.monotonic() - start < max_wait_s:
        time.sleep(POLL_S)
        current = _gloo_workers()
        idle = all(state == "S" for state, _ in current.values())
        quiet = quiet + 1 if idle and current == previous else 0
        previous = current
    return time.monotonic() - start


def _gloo_workers() -> dict[str, tuple[str, int]]:
    """``{thread id: (state, CPU ticks)}`` of this process's gloo worker threads."""
    out = {}
    for tid in os.listdir(_TASKS):
        try:
            with open(f"{_TASKS}/{tid}/comm") as f:
                if f.read().strip() != GLOO_WORKER_THREAD:
                    continue
            with open(f"{_TASKS}/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)"
        except OSError:  # the thread ended between the listing and the read
            continue
        out[tid] = (fields[0], int(fields[11]) + int(fields[12]))  # state, utime + stime
    return out
