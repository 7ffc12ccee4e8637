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
process group.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

from ..errors import SPMDCompileError, innermost_model_frame_of_stack, warn_once_per_line

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


def _refuse(message: str, hint: str) -> None:
    raise SPMDCompileError(message, user_line=innermost_model_frame_of_stack(), hint=hint)


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


def _answered(name: str, real: Callable[..., Any], one: Callable[..., Any], step_code: Any) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.split(".")[0] in _OWN_MODULES:
            return real(*args, **kwargs)
        warn_once_per_line(
            (step_code, "distributed", name),
            f"torch.distributed.{name} at {{line}}: a compiled step is traced as one device "
            "on the global batch, so it runs as on a world of one (rank 0, world size 1; a "
            "collective keeps its one piece): every value there is already global. "
            "(NOTE: [torch.distributed inside the step])",
        )
        return one(*args, **kwargs)
    return call


@contextlib.contextmanager
def distributed_calls_as_one_device(step_code: Any) -> Iterator[None]:
    """While the step is traced, its own ``torch.distributed`` calls run as on a world
    of one (NOTE: [torch.distributed inside the step])."""
    with contextlib.ExitStack() as stack:
        for name, one in _world_of_one().items():
            real = getattr(dist, name, None)
            if real is None:
                continue
            answered = _answered(name, real, one, step_code)
            for owner in (dist, dist.distributed_c10d):
                if getattr(owner, name, None) is real:
                    stack.enter_context(mock.patch.object(owner, name, answered))
        autograd = sys.modules.get("torch.distributed.nn.functional")
        if autograd is not None:  # imported by the user's code
            for name, one in _autograd_world_of_one().items():
                real = getattr(autograd, name, None)
                if real is None:
                    continue
                answered = _answered(f"nn.functional.{name}", real, one, step_code)
                for module in (autograd, sys.modules.get("torch.distributed.nn")):
                    if getattr(module, name, None) is real:  # re-exported by torch.distributed.nn
                        stack.enter_context(mock.patch.object(module, name, answered))
        yield


__all__ = ["distributed_calls_as_one_device"]
