"""``torch.distributed`` called by the train step: traced as on one device.

NOTE: [torch.distributed inside the step]
A compiled step is written as for one device on the global batch: every tensor it
traces holds its value over the whole batch, and the program inserts the collectives the
placements need. Steps ported from DDP still talk to the process group themselves:
``dist.all_reduce(loss); loss /= dist.get_world_size()`` to log a mean loss,
``loss.sum() / (x.shape[0] * dist.get_world_size())`` to normalize by the global batch,
Accelerate's ``gather`` of metrics, a hand-written gradient all-reduce. Traced as they
are, they were wrong or failed: the world size was baked into the program (the
normalization above divides by twice the global batch on 2 ranks, the trace's batch
already being global), a rank read in Python was rank 0's program on every rank, and a collective on
the trace's fake tensors failed with an unrelated error.

So while the step is traced, the step's own code (anything not in torch or this
package: the user's step, transformers, Accelerate) sees the process group of the one
device it is written for: ``get_rank()`` is 0, ``get_world_size()`` is 1, and each
collective does what it does on a world of one: ``all_reduce`` / ``reduce`` /
``broadcast`` leave the tensor as it is, ``all_gather`` / ``all_gather_into_tensor`` /
``reduce_scatter*`` / ``all_to_all*`` / ``gather`` / ``scatter`` copy the one piece,
``barrier`` does nothing, the object collectives keep the object. That is what the
single-device reference computes (a world of one), and on the global values of the trace
it is what DDP computes from local ones: the mean loss above is the global mean, a
gathered metric is the global batch's. ``torch.distributed.nn.functional``'s
collectives with a backward (a contrastive loss gathering features across ranks) return
their one piece the same way. Each such call logs a warning naming its line,
once per line and step. Refused, with the line: buffers sized for more than one rank
(``all_gather`` into a list of 2: the code read the world size outside the step), and
point-to-point calls (``send`` / ``recv``: no peer on one device). Calls from torch and
from this package (the capture's own agreement rounds on real ranks) reach the real
process group. Whatever name the step reaches a function by (NOTE: [names of
torch.distributed's functions]); a process group's and a DeviceMesh's size and rank read
the same way (NOTE: [process groups and meshes inside the step]); the launcher's
variables are refused (NOTE: [launcher variables inside the step]). A number read
outside the step (``WORLD = dist.get_world_size()`` before the call) cannot be answered:
the collectives' warning says so.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import sys
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

from ..errors import (
    SourceLocation,
    SPMDCompileError,
    in_installed_package,
    innermost_model_frame_of_stack,
    warn_once_per_line,
)
from .callers import from_stdlib, users_file

# callers that reach the real process group: torch itself and this project's packages
_OWN_MODULES = ("torch", "spmd_compiler", "parallel_modes", "passes")


class _DoneWork:
    """What an ``async_op=True`` call returns on a world of one: already complete."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(None)
        return future


def _async(kwargs: dict[str, Any], args: tuple[Any, ...], position: int) -> Any:
    """``_DoneWork()`` where the call asked for ``async_op``, else None."""
    wanted = kwargs.get("async_op", args[position] if len(args) > position else False)
    return _DoneWork() if wanted else None


def _one_piece(name: str, pieces: Any, what: str) -> Any:
    """The only element of a per-rank list; refused when it is sized for more ranks."""
    if len(pieces) != 1:
        _refuse(
            f"torch.distributed.{name} is given {len(pieces)} {what}, one per rank of a "
            f"world of {len(pieces)}, but the step is traced as one device (a world of one: "
            "NOTE: [torch.distributed inside the step]), where the list holds one.",
            "size the list with dist.get_world_size() inside the step, or drop the "
            "collective: inside a compiled step every value is already global.",
        )
    return pieces[0]


def _copy_whole(name: str, out: torch.Tensor, source: torch.Tensor) -> None:
    if out.numel() != source.numel():
        _refuse(
            f"torch.distributed.{name}'s output holds {out.numel()} elements for an input "
            f"of {source.numel()}: it is sized for several ranks, but the step is traced "
            "as one device (a world of one: NOTE: [torch.distributed inside the step]).",
            "size the output from dist.get_world_size() inside the step, or drop the "
            "collective: inside a compiled step every value is already global.",
        )
    out.copy_(source.reshape(out.shape))


def _refuse(message: str, hint: str, where: SourceLocation | None = None) -> None:
    raise SPMDCompileError(message, user_line=where or innermost_model_frame_of_stack(), hint=hint)


def _point_to_point(name: str) -> Callable[..., Any]:
    def refused(*args: Any, **kwargs: Any) -> Any:
        _refuse(
            f"The train step calls torch.distributed.{name}: a compiled step is traced as "
            "one device on the global batch (NOTE: [torch.distributed inside the step]), "
            "which has no peer to send to or receive from.",
            "let the parallel mode move values between ranks (its placements insert the "
            "collectives), or keep point-to-point code outside the compiled step.",
        )
    return refused


def _world_of_one() -> dict[str, Callable[..., Any]]:
    """Each call as a world of one does it (the NOTE), by name."""

    def all_gather(tensor_list: Any, tensor: torch.Tensor, *a: Any, **k: Any) -> Any:
        _one_piece("all_gather", tensor_list, "output tensors").copy_(tensor)
        return _async(k, a, 1)

    def reduce_scatter(output: torch.Tensor, input_list: Any, *a: Any, **k: Any) -> Any:
        output.copy_(_one_piece("reduce_scatter", input_list, "input tensors"))
        return _async(k, a, 2)

    def all_to_all(output_list: Any, input_list: Any, *a: Any, **k: Any) -> Any:
        _one_piece("all_to_all", output_list, "output tensors").copy_(
            _one_piece("all_to_all", input_list, "input tensors"))
        return _async(k, a, 1)

    def gather(tensor: torch.Tensor, gather_list: Any = None, *a: Any, **k: Any) -> Any:
        if gather_list:
            _one_piece("gather", gather_list, "output tensors").copy_(tensor)
        return _async(k, a, 2)

    def scatter(tensor: torch.Tensor, scatter_list: Any = None, *a: Any, **k: Any) -> Any:
        if scatter_list:
            tensor.copy_(_one_piece("scatter", scatter_list, "input tensors"))
        return _async(k, a, 2)

    def all_gather_object(object_list: Any, obj: Any, *a: Any, **k: Any) -> None:
        _one_piece("all_gather_object", object_list, "entries")
        object_list[0] = obj

    def gather_object(obj: Any, object_gather_list: Any = None, *a: Any, **k: Any) -> None:
        if object_gather_list is not None:
            _one_piece("gather_object", object_gather_list, "entries")
            object_gather_list[0] = obj

    def scatter_object_list(output: Any, inputs: Any = None, *a: Any, **k: Any) -> None:
        if inputs is not None:
            output[0] = _one_piece("scatter_object_list", inputs, "entries")

    def whole_copy(name: str, async_position: int) -> Callable[..., Any]:
        def call(output: torch.Tensor, source: torch.Tensor, *a: Any, **k: Any) -> Any:
            _copy_whole(name, output, source)
            return _async(k, a, async_position)
        return call

    def unchanged(async_position: int) -> Callable[..., Any]:
        def call(*a: Any, **k: Any) -> Any:
            return _async(k, a, async_position)
        return call

    calls: dict[str, Callable[..., Any]] = {
        "get_rank": lambda group=None: 0,
        "get_world_size": lambda group=None: 1,
        "get_process_group_ranks": lambda group: [0],
        "get_node_local_rank": lambda fallback_rank=None: 0,
        "all_reduce": unchanged(3),  # (tensor, op, group, async_op)
        "reduce": unchanged(4),  # (tensor, dst, op, group, async_op)
        "broadcast": unchanged(3),  # (tensor, src, group, async_op)
        "all_gather": all_gather,
        "all_gather_into_tensor": whole_copy("all_gather_into_tensor", 1),
        "reduce_scatter": reduce_scatter,
        "reduce_scatter_tensor": whole_copy("reduce_scatter_tensor", 2),
        "all_to_all": all_to_all,
        "all_to_all_single": whole_copy("all_to_all_single", 4),
        "gather": gather,
        "scatter": scatter,
        "barrier": unchanged(1),  # (group, async_op, device_ids)
        "monitored_barrier": lambda *a, **k: None,
        "all_gather_object": all_gather_object,
        "gather_object": gather_object,
        "broadcast_object_list": lambda *a, **k: None,
        "scatter_object_list": scatter_object_list,
    }
    for name in ("send", "recv", "isend", "irecv", "batch_isend_irecv", "send_object_list",
                 "recv_object_list"):
        calls[name] = _point_to_point(name)
    return calls


_NOT_COLLECTIVES = frozenset({"get_rank", "get_world_size", "get_process_group_ranks",
                               "get_node_local_rank", "barrier", "monitored_barrier"})


def _autograd_world_of_one() -> dict[str, Callable[..., Any]]:
    """``torch.distributed.nn.functional`` (collectives with a backward, as contrastive
    losses gather features with) on a world of one: each returns its one piece."""

    def one_piece(name: str, pieces: Any) -> Any:
        return _one_piece(name, pieces, "tensors")

    return {
        "all_gather": lambda tensor, group=None: (tensor,),
        "all_reduce": lambda tensor, op=None, group=None: tensor,
        "broadcast": lambda tensor, src, group=None: tensor,
        "reduce": lambda tensor, dst, op=None, group=None: tensor,
        "reduce_scatter": lambda output, input_list, op=None, group=None: one_piece(
            "nn.functional.reduce_scatter", input_list),
        "all_to_all": lambda output_tensor_list, input_tensor_list, group=None: (
            one_piece("nn.functional.all_to_all", input_tensor_list),),
        "all_to_all_single": lambda output, input, *a, **k: input,
        "gather": lambda tensor, dst=0, group=None: (tensor,),
        "scatter": lambda tensors, src=0, group=None: one_piece("nn.functional.scatter", tensors),
    }


# NOTE: [names of torch.distributed's functions]
# Swapping the functions as attributes of ``torch.distributed`` reached only the code that
# looks them up there (``dist.get_world_size()``). A name bound before the trace
# (``from torch.distributed import get_world_size, all_reduce, get_rank`` at the top of
# the user's file, a helper module's, a default argument, ``functools.partial``) held
# torch's function itself: the world size 2 was baked into the program on 2 ranks (the
# loss half of eager's, parameters 0.53 off after 3 steps, silently), ``all_reduce`` ran
# torch's collective on a FakeTensor (refused as a draw from Python's ``random``: the
# fake work draws its sequence number there) and a rank-0 branch ran on rank 0 alone
# (refused at the ranks' agreement, naming no line). So the function objects themselves
# answer as a world of one while the step is traced, whatever name reaches them: torch
# wraps most of them in a logging wrapper whose closure cell holds the function, and that
# cell holds the answer meanwhile; a function without a closure runs, meanwhile, a code
# object that calls the answer (``_answering_code``). Both are put back after the trace;
# the answer calls torch's function for torch's own callers (the caller past those
# frames, ``_PASS_THROUGH``) and for other threads.
_ANSWERS: dict[str, Callable[..., Any]] = {}
_PASS_THROUGH: set[Any] = set()  # codes of the frames between a caller and the answer


_ANSWERING_CODES: dict[str, Any] = {}


def _answering_code(key: str, name: str) -> Any:
    """A code object without free variables that calls ``_ANSWERS[key]`` (it runs with
    torch's module globals, so it reaches this module through ``sys.modules``); one per
    ``key``, made once."""
    found = _ANSWERING_CODES.get(key)
    if found is not None:
        return found
    source = (f"def {name}(*args, **kwargs):\n"
              f"    return __import__('sys').modules[{__name__!r}]._ANSWERS[{key!r}](*args, **kwargs)\n")
    namespace: dict[str, Any] = {}
    exec(compile(source, __file__, "exec"), namespace)  # noqa: S102 - our own fixed source
    code = _ANSWERING_CODES[key] = namespace[name].__code__
    _PASS_THROUGH.add(code)
    return code


def _swap_behaviour(function: Any, make_answer: Callable[[Callable[..., Any]], Callable[..., Any]],
                    stack: contextlib.ExitStack) -> bool:
    """``function`` answers ``make_answer(torch's function)`` until ``stack`` closes
    (NOTE: [names of torch.distributed's functions]); False where it cannot be swapped."""
    closure = getattr(function, "__closure__", None)
    if not isinstance(function, types.FunctionType):
        return False
    if closure is not None:
        if len(closure) != 1 or not isinstance(closure[0].cell_contents, types.FunctionType):
            return False
        cell, inner = closure[0], closure[0].cell_contents  # torch's logging wrapper
        _PASS_THROUGH.add(function.__code__)
        cell.cell_contents = make_answer(inner)
        stack.callback(setattr, cell, "cell_contents", inner)
        return True
    key = f"{function.__module__}.{function.__qualname__}"
    if function.__code__ is _ANSWERING_CODES.get(key):
        return True  # swapped already by a trace still open (it is put back by that one)
    real = types.FunctionType(function.__code__, function.__globals__, function.__name__,
                              function.__defaults__)
    real.__kwdefaults__ = function.__kwdefaults__
    _ANSWERS[key] = make_answer(real)
    original = function.__code__
    function.__code__ = _answering_code(key, function.__name__)
    # the answer stays in ``_ANSWERS`` after the code is put back: another thread that
    # entered the answering code just before is still answered (by torch's function,
    # the answer passes other threads through); a review saw KeyErrors there when the
    # answer was dropped first
    stack.callback(setattr, function, "__code__", original)
    return True


def _users_call(depth: int, tracing_thread: int) -> bool:
    """Whether the call ``depth`` frames up (past ``_PASS_THROUGH`` frames) is the step's
    own: made on the tracing thread, from code outside torch and this project."""
    if threading.get_ident() != tracing_thread:
        return False
    frame: types.FrameType | None = sys._getframe(depth + 1)
    while frame is not None and frame.f_code in _PASS_THROUGH:
        frame = frame.f_back
    caller = frame.f_globals.get("__name__", "") if frame is not None else ""
    return str(caller).split(".")[0] not in _OWN_MODULES


_COLLECTIVE_NOTE = (
    " A number read outside the step is not answered so: where the step divides by a "
    "world size read before the call (WORLD = dist.get_world_size() outside it; "
    "p.grad /= WORLD after a hand-written all_reduce), that division stays in the program "
    "and divides the global value by the real world size (gradients halved on 2 ranks). "
    "Read the world size inside the step, or drop the collective and the division."
)


def _answered(name: str, real: Callable[..., Any], one: Callable[..., Any], step_code: Any,
              tracing_thread: int, collective: bool = True) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        if not _users_call(1, tracing_thread):
            return real(*args, **kwargs)
        warn_once_per_line(
            (step_code, "distributed", name),
            f"torch.distributed.{name} at {{line}}: a compiled step is traced as one device "
            "on the global batch, so it runs as on a world of one (rank 0, world size 1; a "
            "collective keeps its one piece): every value there is already global."
            + (_COLLECTIVE_NOTE if collective else "")
            + " (NOTE: [torch.distributed inside the step])",
        )
        return one(*args, **kwargs)
    return call


# NOTE: [process groups and meshes inside the step]
# ``dist.group.WORLD.size()``, a group's ``rank()``, and a DeviceMesh the user made
# (``init_device_mesh("cpu", (2,))``) read with ``mesh.size()`` / ``get_rank()`` /
# ``get_local_rank()`` / ``get_coordinate()`` / ``shape`` learn the world size as
# ``dist.get_world_size()`` does, and were baked into the program as it was (the loss
# half of eager's on 2 ranks, silently). While the step is traced the step's own reads
# answer as ``get_world_size(group)`` does for any group: a world of one (size 1, rank 0,
# coordinate 0 along every dimension). That is exact, not a guess: on the trace's global
# values every collective over any group is the identity, so the one-device program is
# what a world of one computes, the same answer the functions give. torch's own reads
# (DTensor, FSDP, the parallel mode's mesh) reach the real group. ``mesh.mesh`` (the
# tensor of ranks) is not answered.
def _group_and_mesh_methods() -> list[tuple[Any, str, Callable[..., Any], bool]]:
    """(class, attribute, world-of-one answer, is a property) of what a process group
    and a DeviceMesh tell of the world (NOTE: [process groups and meshes inside the step])."""
    found: list[tuple[Any, str, Callable[..., Any], bool]] = []
    group = getattr(dist, "ProcessGroup", None)
    if group is not None:
        found += [(group, "size", lambda self: 1, False), (group, "rank", lambda self: 0, False)]
    mesh = sys.modules.get("torch.distributed.device_mesh")
    mesh_class = getattr(mesh, "DeviceMesh", None)
    if mesh_class is not None:
        found += [
            (mesh_class, "size", lambda self, mesh_dim=None: 1, False),
            (mesh_class, "get_rank", lambda self: 0, False),
            (mesh_class, "get_local_rank", lambda self, mesh_dim=None: 0, False),
            (mesh_class, "get_coordinate", lambda self: [0] * self.ndim, False),
            (mesh_class, "shape", lambda self: (1,) * self.ndim, True),
        ]
    return found


# NOTE: [launcher variables inside the step]
# ``int(os.environ["WORLD_SIZE"])`` inside the step reads the launcher's value (2 on 2
# ranks), which the capture guards but which the trace's global batch does not divide
# by: the loss was half of eager's, silently. No value of the variable is right for
# every read (``RANK`` may name a file, ``WORLD_SIZE`` size a buffer or divide a loss),
# so while the step is traced the step's own read of ``WORLD_SIZE`` / ``RANK`` /
# ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` / ``GROUP_RANK`` is refused, naming the line,
# where the variable is set to other than a world of one's value (1 for a size, 0 for a
# rank); reads by torch, this project and installed packages, and reads on other
# threads, go through.
_LAUNCHER_VARIABLES = {"WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "RANK": "0",
                       "LOCAL_RANK": "0", "GROUP_RANK": "0"}


def _users_environment_read(tracing_thread: int) -> SourceLocation | None:
    """The line of the user's own code making the environment read now (past the
    standard library's ``os.getenv`` / ``Mapping.get`` frames), None where the reader is
    torch, this project or an installed package (networkx, imported lazily during a
    capture, scans the whole environment), or another thread."""
    if threading.get_ident() != tracing_thread:
        return None
    frame: types.FrameType | None = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith("<frozen")
                                 or from_stdlib(frame.f_code.co_filename)):
        frame = frame.f_back
    if frame is None:
        return None
    filename = frame.f_code.co_filename
    if not users_file(filename) or in_installed_package(os.path.abspath(filename)):
        return None
    return SourceLocation(filename, frame.f_lineno, linecache.getline(filename, frame.f_lineno).strip())


@contextlib.contextmanager
def _launcher_variables_refused(tracing_thread: int) -> Iterator[None]:
    """NOTE: [launcher variables inside the step]."""
    cls = type(os.environ)
    read = cls.__getitem__

    def getitem(self: Any, key: Any) -> Any:
        value = read(self, key)
        one = _LAUNCHER_VARIABLES.get(key) if isinstance(key, str) else None
        where = _users_environment_read(tracing_thread) if one is not None and value != one else None
        if where is not None:
            _refuse(
                f"The train step reads the environment variable {key} (= {value}): a compiled "
                "step is traced as one device on the global batch (NOTE: [torch.distributed "
                "inside the step]), where a world size read from the launcher's variables "
                "divides the global values again and a rank picks one rank's program for all.",
                "call dist.get_world_size() / dist.get_rank() inside the step (the compiled "
                "step reads them as a world of one: 1 and 0), or drop the division: every "
                "value there is already global.",
                where,
            )
        return value

    cls.__getitem__ = getitem  # type: ignore[method-assign]
    try:
        yield
    finally:
        cls.__getitem__ = read  # type: ignore[method-assign]


@contextlib.contextmanager
def distributed_calls_as_one_device(step_code: Any) -> Iterator[None]:
    """While the step is traced, its own ``torch.distributed`` calls run as on a world
    of one (NOTE: [torch.distributed inside the step]), whatever name reaches them (NOTE:
    [names of torch.distributed's functions]), and so do its reads of a process group's
    or a DeviceMesh's size and rank (NOTE: [process groups and meshes inside the step]);
    its reads of the launcher's variables are refused (NOTE: [launcher variables inside
    the step])."""
    tracing_thread = threading.get_ident()
    with contextlib.ExitStack() as stack:
        for name, one in _world_of_one().items():
            function = getattr(dist.distributed_c10d, name, None)
            if function is None:
                continue
            collective = name not in _NOT_COLLECTIVES

            def make_answer(real: Callable[..., Any], name: str = name, one: Callable[..., Any] = one,
                            collective: bool = collective) -> Callable[..., Any]:
                return _answered(name, real, one, step_code, tracing_thread, collective)

            if not _swap_behaviour(function, make_answer, stack):  # as attributes, at least
                answered = make_answer(function)
                for owner in (dist, dist.distributed_c10d):
                    if getattr(owner, name, None) is function:
                        stack.enter_context(mock.patch.object(owner, name, answered))
        autograd = sys.modules.get("torch.distributed.nn.functional")
        if autograd is not None:  # imported by the user's code
            for name, one in _autograd_world_of_one().items():
                function = getattr(autograd, name, None)
                if function is None:
                    continue

                def make_autograd_answer(real: Callable[..., Any], name: str = name,
                                         one: Callable[..., Any] = one) -> Callable[..., Any]:
                    return _answered(f"nn.functional.{name}", real, one, step_code, tracing_thread)

                if not _swap_behaviour(function, make_autograd_answer, stack):
                    answered = make_autograd_answer(function)
                    for module in (autograd, sys.modules.get("torch.distributed.nn")):
                        if getattr(module, name, None) is function:
                            stack.enter_context(mock.patch.object(module, name, answered))
        for owner, attribute, one, is_property in _group_and_mesh_methods():
            real = owner.__dict__.get(attribute, getattr(owner, attribute))
            what = f"{owner.__name__}.{attribute}"
            if is_property:
                getter = _answered(what, real.fget, one, step_code, tracing_thread, False)
                stack.enter_context(mock.patch.object(owner, attribute, property(getter)))
            else:
                stack.enter_context(mock.patch.object(
                    owner, attribute, _answered(what, real, one, step_code, tracing_thread, False)))
        stack.enter_context(_launcher_variables_refused(tracing_thread))
        yield


__all__ = ["distributed_calls_as_one_device"]
