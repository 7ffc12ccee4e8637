"""NOTE: [gloo teardown race] (runtime/teardown.py): at exit a rank waits, the GIL released,
until gloo's worker threads are asleep, so that none is still putting down a tensor (which
needs the GIL) when the interpreter finalizes. The end-to-end case is the torchrun example
in tests/unit/test_docs_examples.py (it aborted at exit about 1 run in 20 before)."""

from __future__ import annotations

import ctypes
import hashlib
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from spmd_compiler.runtime import teardown

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
_PR_SET_NAME = 15


def _name_this_thread(name: str) -> None:
    ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode(), 0, 0, 0)


@linux_only
def test_no_gloo_thread_means_no_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    # another test's group in this process may have left real gloo threads: another name
    monkeypatch.setattr(teardown, "GLOO_WORKER_THREAD", "spmd_no_thread")
    assert teardown._gloo_workers() == {}
    assert teardown.wait_for_gloo_workers() == 0.0


@linux_only
def test_waits_while_a_worker_runs_and_returns_once_it_sleeps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(teardown, "GLOO_WORKER_THREAD", "spmd_test_work")  # this one alone
    started, stop = threading.Event(), threading.Event()
    busy_s = 0.3

    def worker() -> None:
        _name_this_thread(teardown.GLOO_WORKER_THREAD)
        started.set()
        end = time.monotonic() + busy_s
        block = bytes(1 << 20)
        while time.monotonic() < end:  # a worker still putting down its tensors
            # in C with the GIL released, as gloo's threads run: a loop of Python
            # bytecode waited for the GIL whenever the test read /proc, so it looked
            # asleep and idle on a loaded machine (the wait ended at 0.14 s of 0.3)
            hashlib.sha256(block).digest()
        stop.wait()  # then asleep, waiting for work

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    started.wait()
    try:
        assert len(teardown._gloo_workers()) == 1
        waited = teardown.wait_for_gloo_workers()
        assert busy_s * 0.8 <= waited < teardown.MAX_WAIT_S
    finally:
        stop.set()
        thread.join()


@linux_only
def test_a_real_gloo_group_is_idle_after_its_collectives() -> None:
    assert not dist.is_initialized()
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        t = torch.ones(4)
        dist.all_reduce(t)
        dist.barrier()
        assert teardown._gloo_workers(), "gloo's worker threads were not found by name"
        assert teardown.wait_for_gloo_workers() < teardown.MAX_WAIT_S
    finally:
        dist.destroy_process_group()
