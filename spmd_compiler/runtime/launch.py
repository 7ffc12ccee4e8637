"""Start real process groups: ``launch`` spawns N local ranks, ``init_from_env`` joins torchrun's.

    def work(rank, world_size, steps):
        ...                                   # the default process group is ready here
        return {"loss": loss.item()}          # anything picklable (plain CPU tensors too)

    results = spmd_compiler.launch(work, world_size=2, args=(3,))   # one result per rank

NOTE: [launch protocol]
Each rank is a fresh ``spawn`` process (no state inherited from the parent, as under
torchrun). It gets MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE/LOCAL_RANK in its environment,
joins the default group through the parent's TCP store (the parent hosts it, as
torchrun's agent does, so that it can record a rank's death there: NOTE: [fault
attribution] in faults.py), loads its own copy of ``fn`` and ``args`` (NOTE: [each rank
its own copy of the arguments]), runs ``fn(rank, world_size, *args)``, and reports through one
file per rank in a private temporary folder, written atomically: either the result or the
formatted traceback. A rank that fails records its error in the store, reports, and exits
at once. Files (not a multiprocessing queue) because a queue
shares tensors through the sender's memory, which disappears when the rank exits. The
parent waits on the process sentinels; when a rank fails it gives the others a short grace
period to report their own errors (their collectives with the dead rank fail), then kills
those still running and raises ``LaunchError`` naming the failed ranks, the first first;
a rank that reported an error is listed with its error, never as killed. Each rank's
result is read from its own file, so results never share memory with one another, with
the arguments or with the ranks.

NOTE: [each rank its own copy of the arguments]
``fn`` and ``args`` are written once, with ``torch.save``, to a file of the launch's
folder, and each rank loads its own copy from it. They are not handed to
``Process(args=...)``: importing torch registers torch.multiprocessing's reducers with
the multiprocessing pickler, which moves every tensor it sends into shared memory (CUDA
tensors through CUDA IPC) instead of copying it. All ranks and the parent then held ONE
tensor: a model built in the parent and passed in ``args`` was trained by both ranks
into the same memory (a double DQN on 2 gloo ranks, ddp: loss 3.7e-3 to 8.9e-3 off eager
as the ranks raced, params up to 1.3e-2; fsdp 2.5e-2 / 1.8e-2, no error) and the parent's
model changed too. torchrun's
ranks are separate processes, and a rank's writes must stay its own. One file, not a
pickled bytes object per ``Process``: the parent serialises the arguments once, whatever
the world size. ``torch.save`` (not plain ``pickle``) because it keeps arguments that view
one storage viewing one (copied) storage; a parameter and its optimizer stay linked
through the one Parameter object either way. Tensors arrive on the device they were on.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import pickle
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from . import faults, teardown

DEFAULT_TIMEOUT_S = 300.0
# Seconds the surviving ranks get to report after the first failure (see NOTE above).
FAILURE_GRACE_S = 5.0
_OK = "ok"
_ERROR = "error"


class LaunchError(RuntimeError):
    """One or more ranks of a ``launch`` failed, crashed or timed out.

    Attributes:
        failures: ``{rank: traceback or reason}`` for every rank that did not succeed.
    """

    def __init__(self, message: str, failures: dict[int, str]) -> None:
        super().__init__(message)
        self.failures = failures

    @property
    def ranks(self) -> list[int]:
        return sorted(self.failures)


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in the default process group."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *,
    backend: str = "gloo",
    args: Sequence[Any] = (),
    timeout_s: float = DEFAULT_TIMEOUT_S,
    collective_timeout_s: float | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local ranks of a real process group.

    Why: real-collective tests and CPU demos without torchrun. Single node only; multi-node
    is torchrun's job (use ``init_from_env`` there). See NOTE: [launch protocol]. As with
    any ``spawn`` start, a script calling this needs an ``if __name__ == "__main__":`` guard.

    Args:
        fn: a module-level (picklable) function; it runs with the default process group
            initialized and should return something picklable (not DTensors: call
            ``full_tensor()`` inside ``fn`` and return plain CPU tensors).
        world_size: number of ranks (processes) to start.
        backend: "gloo" (CPU; each rank gets one torch thread) or "nccl" (rank r uses
            cuda:r).
        args: extra positional arguments for ``fn``; must be picklable. Each rank gets
            its own copy (as a separate torchrun process would): a model, optimizer or
            tensor built in the parent and passed here is copied, never shared, so a
            rank's writes into it are not seen by the other ranks nor by the parent,
            whose objects are left as they were (NOTE: [each rank its own copy of the
            arguments]). Tensors arrive on the device they were on.
        timeout_s: wall-clock limit for the whole run; also the process group's
            collective timeout unless ``collective_timeout_s`` is given.
        collective_timeout_s: how long a collective waits for the other ranks before
            it fails (a rank that died makes the others fail after this, not hang).

    Returns:
        The value each rank's ``fn`` returned, indexed by rank: a copy, sharing no memory
        with another rank's result nor with ``args``.

    Raises:
        LaunchError: a rank raised (its traceback is in the message), crashed, or the run
            did not finish within ``timeout_s``; the remaining ranks are killed.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(
            f"backend='nccl' with world_size={world_size} needs {world_size} CUDA devices, "
            f"found {torch.cuda.device_count()}; use backend='gloo' on CPU."
        )
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="spmd_launch_") as folder:
        _write_work(folder, fn, args)  # NOTE: [each rank its own copy of the arguments]
        store = dist.TCPStore(
            "127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port)}
        procs = [
            ctx.Process(
                target=_run_rank,
                args=(rank, world_size, backend, collective_timeout_s or timeout_s, env, folder),
                name=f"spmd-rank{rank}",
            )
            for rank in range(world_size)
        ]
        try:
            for p in procs:
                p.start()
            results, failures = _wait_all(procs, folder, timeout_s, store)
        finally:
            _kill(procs)
    if failures:
        raise LaunchError(_failure_message(failures, world_size), failures)
    return [results[rank] for rank in range(world_size)]


def init_from_env(
    backend: str | None = None, *, collective_timeout_s: float | None = None
) -> RankInfo:
    """Join the default process group described by torchrun's environment variables.

    Why: code started by ``torchrun`` (one process per rank, possibly many nodes) needs the
    same set-up ``launch`` does. A no-op for the group if one is already initialized.

    Args:
        backend: "nccl" or "gloo"; by default nccl when CUDA is available, else gloo.
        collective_timeout_s: how long a collective waits for the other ranks before it
            fails (torch's default: 10 min for NCCL, 30 min for gloo).

    Returns:
        This process's rank, world size, local rank, backend and device (cuda:LOCAL_RANK
        under nccl, else cpu).

    An uncaught exception is recorded for the other ranks' errors and ends the process
    at once (NOTE: [fault attribution] in faults.py).
    """
    missing = [
        k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ
    ]
    if missing and not dist.is_initialized():
        raise RuntimeError(
            f"init_from_env: environment variables {missing} are not set; start this script "
            "with torchrun (or use spmd_compiler.launch to spawn local ranks)."
        )
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    if not dist.is_initialized():
        timeout = (
            datetime.timedelta(seconds=collective_timeout_s) if collective_timeout_s else None
        )
        dist.init_process_group(backend=backend, init_method="env://", timeout=timeout)
    # after init_process_group: its own hook captures stderr while calling the previous one
    faults.install_excepthook()
    if not faulthandler.is_enabled():  # NOTE: [a rank killed by a signal]: torchrun shows stderr
        faulthandler.enable(all_threads=True)
    teardown.install()  # NOTE: [gloo teardown race]
    return RankInfo(dist.get_rank(), dist.get_world_size(), local_rank, dist.get_backend(), device)


def _write_work(folder: str, fn: Callable[..., Any], args: Sequence[Any]) -> None:
    """Serialise ``fn`` and ``args`` once for every rank to load its own copy (NOTE: [each
    rank its own copy of the arguments]); fail in the parent, before starting anything, if
    a rank could not receive its work."""
    try:
        pickle.dumps(fn)
    except Exception as e:  # noqa: BLE001 - pickling raises several types
        raise TypeError(
            f"launch: fn {fn!r} cannot be sent to the spawned ranks ({e}); pass a function "
            "defined at module level (not a lambda or a nested function)."
        ) from e
    try:
        torch.save((fn, tuple(args)), _work_path(folder), pickle_protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # noqa: BLE001
        raise TypeError(f"launch: args cannot be sent to the spawned ranks ({e}).") from e


def _read_work(folder: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """This rank's own copy of ``fn`` and ``args``: nothing shared with the parent or a peer."""
    # the launch wrote this file itself: TORCH_FORCE_WEIGHTS_ONLY_LOAD=1, which overrides
    # weights_only=False, would refuse the function and any non-tensor argument
    forced = os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD", None)
    try:
        fn, args = torch.load(_work_path(folder), weights_only=False)
    finally:
        if forced is not None:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = forced
    return fn, args


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1 (bind port 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_rank(
    rank: int,
    world_size: int,
    backend: str,
    timeout_s: float,
    env: dict[str, str],
    folder: str,
) -> None:
    """Body of one spawned rank: set up, run ``fn``, report, tear down."""
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    timeout = datetime.timedelta(seconds=timeout_s)
    store = None
    # NOTE: [a rank killed by a signal]: the Python stacks of a rank that dies by a signal
    # (gloo's SIGABRT on mismatched collectives, a segfault) go to a file the parent reads
    fault_file = open(_fault_path(folder, rank), "w")  # noqa: SIM115 - open until the process ends
    faulthandler.enable(file=fault_file, all_threads=True)
    try:
        if backend == "gloo":
            torch.set_num_threads(1)  # N ranks share the machine's cores
        else:
            torch.cuda.set_device(rank)
        fn, args = _read_work(folder)
        store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), None, False, timeout)
        faults.use_launch_store(store)
        teardown.install()  # NOTE: [gloo teardown race]
        dist.init_process_group(
            backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout
        )
        result = fn(rank, world_size, *args)
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        if store is not None:
            faults.record_failure(store, rank, faults.describe_exception(exc))
        _write_report(folder, rank, (_ERROR, traceback.format_exc(), time.time()))
        faults.exit_after_failure(1)
    try:
        _write_report(folder, rank, (_OK, result, time.time()))
    except Exception:  # noqa: BLE001 - e.g. an unpicklable result
        reason = "could not send its result to the parent:\n" + traceback.format_exc()
        _write_report(folder, rank, (_ERROR, reason, time.time()))
        raise SystemExit(1) from None


def _work_path(folder: str) -> str:
    return os.path.join(folder, "work.pt")


def _report_path(folder: str, rank: int) -> str:
    return os.path.join(folder, f"rank{rank}.pt")


def _fault_path(folder: str, rank: int) -> str:
    return os.path.join(folder, f"rank{rank}.fault")


# NOTE: [a rank killed by a signal]
# A rank killed by a signal reports nothing: stop 78's CI saw "rank 1 ... was killed by
# signal 6 without reporting an error" beside its peer's "Connection reset by peer", and
# nothing said where rank 1 was (gloo aborts a process on a collective whose sizes
# disagree, NOTE: [every rank in the same step's round]). Each rank enables
# ``faulthandler`` on a file of the launch's folder (every thread's Python stack on
# SIGSEGV, SIGFPE, SIGABRT, SIGBUS, SIGILL), and a rank that died without a report is
# described with the last ``FAULT_LINES`` lines of it. A user's ``fn`` that enables
# faulthandler elsewhere takes the dump with it. Under torchrun (``init_from_env``),
# whose agent shows each rank's stderr, faulthandler writes there unless already on.
FAULT_LINES = 60


def _died_without_report(folder: str, rank: int, exitcode: int | None) -> str:
    """How a rank that wrote no report ended, with its Python stacks if it left any."""
    reason = faults.describe_exit_code(exitcode)
    try:
        with open(_fault_path(folder, rank)) as f:
            stacks = f.read().strip().splitlines()
    except OSError:
        return reason
    if not stacks:
        return reason
    return reason + "; its Python stacks when it died (faulthandler):\n" + "\n".join(stacks[-FAULT_LINES:])


def _write_report(folder: str, rank: int, report: tuple[str, Any, float]) -> None:
    """Write atomically so the parent never reads half a file."""
    path = _report_path(folder, rank)
    tmp = path + ".tmp"
    torch.save(report, tmp)
    os.replace(tmp, path)


def _read_report(folder: str, rank: int) -> tuple[str, Any, float] | None:
    """``(status, result or traceback, wall-clock time written)``, or None if none was."""
    path = _report_path(folder, rank)
    if not os.path.exists(path):
        return None
    try:
        return torch.load(path, weights_only=False)
    except (OSError, EOFError, pickle.UnpicklingError, RuntimeError) as e:
        return (_ERROR, f"its result could not be read in the parent: {e!r}", time.time())


def _wait_all(
    procs: list[Any], folder: str, timeout_s: float, store: Any
) -> tuple[dict[int, Any], dict[int, str]]:
    """Wait for every rank (see NOTE: [launch protocol]).

    Returns:
        ``{rank: result}`` of the ranks that succeeded and ``{rank: reason}`` of those that
        did not, in order of failure (the first is usually the cause of the others).
    """
    deadline = time.monotonic() + timeout_s
    results: dict[int, Any] = {}
    failed_at: dict[int, tuple[float, str]] = {}
    running = dict(enumerate(procs))
    while running and time.monotonic() < deadline:
        ready = wait([p.sentinel for p in running.values()], timeout=deadline - time.monotonic())
        for rank, p in list(running.items()):
            if p.sentinel not in ready:
                continue
            p.join()
            del running[rank]
            report = _read_report(folder, rank)
            if report is None:
                reason = _died_without_report(folder, rank, p.exitcode)
                faults.record_failure(store, rank, faults.describe_exit_code(p.exitcode))
                failed_at[rank] = (time.time(), reason)
            elif report[0] == _ERROR:
                failed_at[rank] = (report[2], report[1])
            else:
                results[rank] = report[1]
                if running:  # the others may now wait for it in a collective
                    faults.record_failure(store, rank, faults.RETURNED_EARLY)
        if failed_at and running:
            deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
    first = min(failed_at, key=lambda rank: (failed_at[rank][0], rank), default=None)
    for rank in running:
        report = _read_report(folder, rank)
        if report is not None and report[0] == _ERROR:  # reported, then stopped exiting
            failed_at[rank] = (report[2], report[1])
        elif first is not None:
            reason = f"killed after rank {first} failed (it was probably waiting in a collective)"
            failed_at[rank] = (float("inf"), reason)
        else:
            reason = f"did not finish within timeout_s={timeout_s:g} s; killed"
            failed_at[rank] = (float("inf"), reason)
    order = sorted(failed_at, key=lambda rank: (failed_at[rank][0], rank))
    return results, {rank: failed_at[rank][1] for rank in order}


def _kill(procs: list[Any]) -> None:
    """Stop every rank still alive: SIGTERM, then SIGKILL if it lingers."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        if p.pid is None:
            continue
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()


def _failure_message(failures: dict[int, str], world_size: int) -> str:
    """``failures`` is in order of failure; the first is usually the cause of the rest."""
    order = list(failures)
    head = f"launch: rank {order[0]} of {world_size} failed"
    if len(order) > 1:
        head += f" first (then also rank {', '.join(str(r) for r in order[1:])})"
    parts = [head]
    for rank in order:
        parts.append(f"--- rank {rank} ---\n{failures[rank].rstrip()}")
    return "\n".join(parts)
