"""Tensors a step reads from outside its arguments: program constants, guarded.

NOTE: [tensors read from outside the arguments]
A step often reads a tensor that is neither an argument nor a parameter or buffer of its
modules: a plain tensor attribute set in ``__init__`` without ``register_buffer``
(``self.scale = torch.tensor(...)``), a global or closure tensor (class weights, a mask),
a tensor held by a config object. The trace reads it as a constant of the program (its
fake tensor mode accepts real tensors), replicated on every rank like a tensor created
inside the step (NOTE: [tensor constants]), and each such constant is guarded where the
step found it (NOTE: [guards on Python values]): the same object still there and its
version counter unchanged, and at that version the bytes it held at capture (a write
through memory it shares, ``torch.frombuffer``'s bytearray, ``torch.from_numpy``'s
array, ``.data``, leaves the counter as it was: NOTE: [constants changed through shared
memory]). Replacing it (``model.scale = new``) or changing it outside the step, in
place or through memory it shares, compiles a new program on the next call; a program
never computes with a stale value (before the sixty-eighth session it did, after a
write that left the counter as it was). Where it was found: the walk of NOTE: [tensors the step keeps]
(module attributes, object arguments, globals and closure cells of the step, its
modules' ``forward``\\ s and hooks, and what they hold; the attributes the code names of
the user's modules and classes it loads, ``cfg.POS_WEIGHT``: NOTE: [tensors of modules
and classes read by name]). Refused, naming the line:
- a constant read from a place that walk does not reach (nothing could guard it), or
  a class attribute inherited from a base class (named: NOTE: [tensors of modules and
  classes read by name]);
- one that requires grad (its gradient would never reach it) or a DTensor;
- one that is, or shares memory with, a parameter or buffer of the step's modules (an
  alias such as ``self.w_t = self.weight.t()``), or one a placement replaced: the
  program's state moves on, a constant would not;
- an in-place write to a real tensor while the step is traced (``G.mul_(2)``,
  ``G[0] = 1``, ``out=G``): it would change the user's tensor once, at capture (the
  check runs before the write, so the tensor is left as it was).
A step with such constants has no pre-capture cache entry (the guards hold live
objects); its programs are cached as any. On real ranks every call checks that the ranks'
constants hold the same values (NOTE: [constants agree across ranks] in
``runtime/same_inputs.py``): a batch inside an object argument that is not opened (NOTE:
[batch containers]) is refused there instead of training each rank on its own shard.

NOTE: [every place a constant is read from]
A tensor found at several places (``cfg.POS_WEIGHT`` that the script also holds as a
global, a class weight both a global and a plain attribute of the model) is guarded at
each: the walk cannot tell which of them the step's code read it through, and guarding
one only ran the old program when the other was replaced (before the sixty-first
session, the first place found was the only one guarded). A change at a place the step
does not read compiles anew needlessly, never wrongly.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.fx
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from .. import _torch_private as private
from .._torch_private import pytree
from ..errors import (
    SPMDCompileError,
    innermost_model_frame_of_stack,
    node_error,
    torch_function_called_by_model,
)
from .bindings import StepBindings, aliases_state, replacement_of
from .constant_bytes import CapturedBytes
from .meta_templates import template_read

_LIFTS = (torch.ops.aten.lift_fresh_copy.default, torch.ops.aten.lift_fresh.default)
_IN_PLACE_DUNDERS = frozenset({
    "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
    "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
    "__imatmul__",
})
_NOT_WRITES = frozenset({"requires_grad_", "retain_grad", "share_memory_"})
# NOTE: [outside tensors read as Python values]
_VALUE_READS = frozenset({
    "item", "tolist", "numpy", "__float__", "__int__", "__index__", "__bool__", "__complex__", "__array__",
})


class FoundTensor(NamedTuple):
    """A tensor the step can reach outside its arguments and modules' state, and where
    (collected before the trace by ``KeptTensors``)."""

    label: str
    container: Any  # a dict (module / object __dict__, globals, a dict) or a closure cell
    key: Any
    tensor: torch.Tensor
    in_argument: bool  # inside an argument object the step's arguments do not open


@dataclass(eq=False)
class OutsideTensor:
    """A program constant read from a user's object, and where (see the NOTE)."""

    label: str
    container: Any  # a dict (module / object __dict__, globals, a dict) or a closure cell
    key: Any
    tensor: torch.Tensor
    version: int
    in_argument: bool = False  # read from an argument object (FoundTensor.in_argument)
    # the line where the step read it as a Python value (``float(STEP)``), None where it
    # did not (NOTE: [outside tensors read as Python values]); named by the advice of
    # the warning of a value that recompiles every call (``api.py``)
    read_at: Any = field(default=None, compare=False)
    # its bytes as captured, one record for every place of the same tensor (NOTE:
    # [constants changed through shared memory])
    captured: CapturedBytes | None = field(default=None, repr=False, compare=False)


# NOTE: [outside tensors read as Python values]
# A real outside tensor the step reads as a Python number (``float(START)``,
# ``START.item()``, ``x[:, int(START):]``, ``x.narrow(1, START, P)``, whose start torch
# reads in C++) is read at capture and makes no graph constant, so ``outside_constants``
# never listed it and no guard held it: changed between calls (in place, through
# ``.data``, or the global rebound) the first program ran with the old value (2
# simulated ranks: losses 0.19696 / 0.14621 where eager gave 0.05250 / 0.01336,
# sixty-eighth session, a review). ``OutsideWrites`` records each found tensor that a
# value read (``_VALUE_READS``) takes as ``self``, and each one-element found tensor
# any other torch function takes as an argument (an int or Scalar argument torch reads;
# a graph operand is guarded anyway, once), with the line; ``outside_constants`` guards
# them as it does graph constants (object, version, bytes), refusing an alias of the
# step's state or a DTensor alike; one requiring grad is guarded, not refused (a number
# carries no gradient in eager either). Property reads (``shape``, ``dtype``) are left
# out. An ``nn.Parameter`` held apart from the step's modules (a frozen target network's
# temperature, ``float(TEMPERATURE)``) is guarded as a tensor is: it was left out (with
# the step's own parameters, which are stand-ins in the trace, not real, so ``_real``
# leaves them out anyway) and ran the old program when changed (parameters 2.38 off
# eager, sixty-ninth session, a review). A value read of a real tensor the walk did not
# find (held in a set, a list) is refused at its line, as a graph constant from such a
# place is (``outside_constants``): nothing could guard it, and the program kept the
# number of call 0 (2.38 off); so is one made in the step on memory torch does not own
# (``torch.from_numpy(arr).tolist()``), as it is when the program computes with it
# (NOTE: [tensors on memory torch does not own]).
#
# NOTE: [outside tensors read through NumPy]
# ``T.numpy()`` / ``np.asarray(T)`` (``__array__``) of a real tensor, run in the trace,
# read memory the trace's modes made, not the tensor's (``float(T.numpy()[0])`` gave
# 3.7e+246, ``np.asarray(T)`` 0.0, changing from run to run; sixty-ninth session, a
# review). They run outside the trace, on the tensor itself, so the array shares its
# memory as in eager; the read is guarded as ``float(T)`` is (above). A write through
# that array (``T.numpy()[0] += 1``) changes the tensor where no op shows it: it is
# refused when the step returns (NOTE: [outside tensors written through shared memory
# in the step]), naming the line of the ``.numpy()`` call.
#
# NOTE: [outside tensors written through shared memory in the step]
# ``C.data`` of a real outside tensor is a fake view whose in-place write reaches the
# real tensor at capture (the fake mode computes with constants), where ``C.add_(1)``
# is refused: the step wrote ``C`` once per capture, every call recompiled on the
# changed bytes, with a warning only (parameters 1.17 off eager). ``OutsideWrites``
# keeps the trace's ``.data`` of each outside tensor, and every other alias of it
# (NOTE: [aliases of outside tensors made in the step]), and refuses an in-place write
# to them as it does one to the tensor, at the line, before the write.
# Writes no torch function shows (``ARR[0] += 1`` of ``C = torch.from_numpy(ARR)``, a
# ``bytearray`` behind ``torch.frombuffer``): each found tensor's bytes are taken when
# the trace first sees it (``CapturedBytes``) and compared when the step returns; a
# change is refused naming the tensor and the step, and the bytes are put back through
# ``.data`` (its version counter as found; also when the trace fails otherwise), except
# for one over ``SNAPSHOT_BYTES``, of which only a digest is kept.


def _real(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and not private.traced_within_transforms(value)


# NOTE: [aliases of outside tensors made in the step]
# Only ``C.data`` was followed (above): a write through any other alias the step makes
# of a real outside tensor went through, as the trace's alias is a fake tensor, not the
# real one. ``C.detach().add_(1)`` (the modern ``.data``) put the write into the
# program, which then wrote the user's ``C`` on every run and read the written value
# at call 0 (losses 4x eager's, a recompile per call); a view's write (``C.view(2)``,
# ``C[0:1]``, ``C.unbind()[0]``, ``torch.split(C, 1)[0]``) was dropped (``C`` stayed
# 0 where eager reached 3); sixty-ninth session, a review. Each result of a torch
# function that takes a real tensor, or such an alias, and returns one sharing its
# memory is an alias too: ``detach()`` and ``.data`` (aliases autograd does not record
# as views) of one, and any view (``_is_view()``) whose ``_base`` is a real tensor or an
# alias (a view's ``_base`` is the tensor it views, or that tensor's own base); tuple
# and list results (``unbind``, ``split``, ``broadcast_tensors``) alike. An in-place
# write to an alias is refused as one to the tensor is, naming the tensor, the alias
# and the line. A copy (``clone()``, ``C * 1``, an index by a tensor) is no alias; an
# op that returns the tensor itself (``contiguous()``, ``to()`` of its own dtype) gives
# the real tensor, whose writes are refused anyway.
_ALIAS_MAKERS = frozenset({"detach"})  # aliases that are no views (``.data`` besides)


def _describe_alias(func: Any, name: str) -> str:
    """How the step wrote the alias a function made (``.detach()``, ``.view()``, an
    index or slice, ``.data``), for the refusal."""
    if name == "__get__":
        return f".{getattr(getattr(func, '__self__', None), '__name__', 'data')}"
    if name == "__getitem__":
        return "[...]"
    return f".{name}()"


def _sets_data(func: Any) -> bool:
    """``tensor.data = value``: the setter of ``Tensor.data``."""
    return getattr(func, "__name__", "") == "__set__" and getattr(func, "__self__", None) is torch.Tensor.data


def _data_set_to_itself(tensor: Any, value: Any = None, *_: Any) -> bool:
    """``tensor.data = value`` where ``value`` views exactly what ``tensor`` holds (the same
    storage, offset, shape, strides, dtype and conj / neg bits): the assignment changes
    nothing (NOTE: [data replaced inside the step]). Anything else, or a tensor whose
    storage cannot be compared, is a real swap."""
    if not isinstance(tensor, torch.Tensor) or not isinstance(value, torch.Tensor):
        return False
    try:
        return bool(
            private.storage_ref(tensor) == private.storage_ref(value)
            and tensor.storage_offset() == value.storage_offset()
            and tensor.shape == value.shape
            and tensor.stride() == value.stride()
            and tensor.dtype == value.dtype
            and tensor.device == value.device
            and tensor.is_conj() == value.is_conj()
            and tensor.is_neg() == value.is_neg()
        )
    except (RuntimeError, NotImplementedError, TypeError):  # no plain storage to compare
        return False


_DTENSOR_HINT = (
    "keep the copy as buffers of a module passed to the step (`snap.register_buffer(name, "
    "p.detach().clone())` for each parameter, then `train_step(model, snap, ...)`): they "
    "are placed like the parameters; or copy the full values as plain tensors, which the "
    "step reads as constants: `p.detach().full_tensor().clone()` on real ranks (every "
    "rank: it gathers), `sc.checkpoint.full_state_dict(model)[\"model\"]` on simulated "
    "ranks."
)

# NOTE: [DTensors read from outside the arguments]
# After a compiled call the step's parameters are DTensors (NOTE: [calling a placed model
# directly]), so a copy made of them between calls (an EWC or L2-SP anchor, ``old = {n:
# p.detach().clone() for n, p in model.named_parameters()}`` held by a plain object) is
# DTensors too. The step reads such a tensor as a constant of the program; but the trace
# computes with it first, and DTensor refused the mix with the traced tensors ("aten.sub.
# Tensor got mixed torch.Tensor and DTensor"), naming neither the compiler nor what to do,
# before ``outside_constants`` could refuse it as a DTensor. The mode below refuses the
# first torch call (other than reading a property: ``shape``, ``dtype``) that takes a real
# DTensor while the step is traced, naming it where the walk of NOTE: [tensors the step
# keeps] found it, with what to do: buffers of a module passed to the step (placed like
# the parameters), or full plain copies (constants). Arguments that are DTensors are
# refused before the trace (``api.py``), and the step's own state is traced as plain
# stand-ins, so a real DTensor met here is always one read from outside.
def _real_dtensors(args: Any, kwargs: dict) -> list[DTensor]:
    """The real DTensors among a torch call's arguments, and in its list arguments
    (``torch.cat``, ``torch._foreach_*``): no deeper, this runs for every call traced."""
    found = []
    for a in (*args, *kwargs.values()):
        for t in a if isinstance(a, (list, tuple)) else (a,):
            # a placed parameter of the step's own modules reached from outside is
            # refused by its own rule, which names it (test_requires_grad_in_step)
            if isinstance(t, DTensor) and _real(t) and not isinstance(t, torch.nn.Parameter):
                found.append(t)
    return found


class OutsideWrites(TorchFunctionMode):
    """Refuses an in-place write to a real tensor while the step is traced, any
    ``tensor.data = value`` (NOTE: [data replaced inside the step]), and computing with a
    real DTensor (NOTE: [DTensors read from outside the arguments]; ``found``: where the
    walk found the tensors, set once it ran)."""

    def __init__(self) -> None:
        super().__init__()
        self.found: dict[int, list[FoundTensor]] = {}
        # NOTE: [meta templates read by name]: their tensors, by id, set once bound
        self.templates: dict[int, str] = {}
        # NOTE: [outside tensors read as Python values]: by id, with the line of the read
        self.read: dict[int, tuple[torch.Tensor, Any]] = {}
        # NOTE: [outside tensors written through shared memory in the step]: each found
        # tensor the trace saw, with its bytes at first sight
        self.sighted: dict[int, tuple[torch.Tensor, CapturedBytes]] = {}
        # NOTE: [aliases of outside tensors made in the step]: by id, each alias with the
        # real tensor it shares memory with and how the step made it
        self.aliases: dict[int, tuple[torch.Tensor, torch.Tensor, str]] = {}
        # NOTE: [outside tensors read through NumPy]: by id, the line of the first
        # ``.numpy()`` / ``np.asarray`` of each real tensor
        self.numpy_at: dict[int, Any] = {}
        # NOTE: [modules read by name beside the given ones]: the state of modules the
        # walk met that are not the step's, by tensor (``KeptTensors.unplaced``)
        self.unplaced: dict[int, str] = {}
        # the ids of the step's parameters: one held outside its modules (or one a
        # placement retired) is refused by ``HeldParameterUses`` but for a metadata
        # read, and never copied or guarded here
        self.state: set[int] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if self.templates and getattr(func, "__name__", "") != "__get__":
            for leaf in pytree.tree_leaves((args, kwargs)):
                if isinstance(leaf, torch.Tensor) and id(leaf) in self.templates:
                    raise template_read(self.templates[id(leaf)])
        if getattr(func, "__name__", "") != "__get__" and (read := _real_dtensors(args, kwargs)):
            places = self.found.get(id(read[0]))
            label = places[0].label if places else "a tensor"
            raise SPMDCompileError(
                f"The train step computes with {label}, a DTensor from outside its "
                "arguments (a copy of placed parameters made between calls is DTensors); "
                "the compiled step cannot read it as a constant, nor watch it as its state "
                "(NOTE: [DTensors read from outside the arguments]).",
                user_line=innermost_model_frame_of_stack(),
                hint=_DTENSOR_HINT,
            )
        if _sets_data(func) and not _data_set_to_itself(*args):
            # NOTE: [data replaced inside the step]
            # ``p.data = value`` swaps the tensor's storage outside autograd and outside
            # torch's dispatcher: no op records it, so the program never wrote the new
            # values (``model.weight.data = model.weight.data.clamp(-c, c)`` after the
            # optimizer step left the weights unclamped, silently). Refused with the
            # line and the in-place form, which the program records and computes alike.
            # An assignment of the tensor's own ``.data`` changes nothing and is let
            # through (``_data_set_to_itself``): ``p.data -= lr * p.grad`` (hand-written
            # SGD) and ``p.grad.data *= k`` (center-loss recipes) are an in-place op on
            # ``p.data``, which the program records as ``p.data.mul_(k)`` is, then
            # ``p.data = <that same .data>``; pytorch-metric-learning's margin losses
            # (ArcFace, CosFace, ProxyAnchor, ...) run ``self.W.data =
            # self.W.data.to(device)`` in forward, which returns ``self.W.data`` itself.
            # Those were refused (2 simulated ranks, all three) where eager ran.
            raise _data_set()
        name = getattr(func, "__name__", "")
        writes = (name in _IN_PLACE_DUNDERS or (
            name.endswith("_") and not name.startswith("_") and name not in _NOT_WRITES
        )) and bool(args) and (_real(args[0]) or id(args[0]) in self.aliases)
        out = kwargs.get("out")
        if writes or _real(out) or (isinstance(out, (tuple, list)) and any(map(_real, out))):
            raise _written_in_place(name, innermost_model_frame_of_stack(), *self._written_label(args[:1]))
        self._first_sight(func, name, args, kwargs)
        if name in ("numpy", "__array__") and args and _real(args[0]):
            # NOTE: [outside tensors read through NumPy]
            self.numpy_at.setdefault(id(args[0]), innermost_model_frame_of_stack())
            with private.outside_the_trace():
                return func(*args, **kwargs)
        result = func(*args, **kwargs)
        self._keep_aliases(func, name, args, result)
        return result

    def _keep_aliases(self, func: Any, name: str, args: Any, result: Any) -> None:
        """Record each alias ``result`` holds of a real tensor (NOTE: [aliases of outside
        tensors made in the step])."""
        if not args or not any(
            isinstance(t, torch.Tensor) and (id(t) in self.aliases or _real(t))
            for a in args for t in (a if isinstance(a, (list, tuple)) else (a,))
        ):
            return  # the common case: nothing real or aliased among the arguments
        first = args[0]
        root, how = self.aliases[id(first)][1:] if id(first) in self.aliases else (first, "")
        how += _describe_alias(func, name)
        no_view = name in _ALIAS_MAKERS or (name == "__get__" and getattr(func, "__self__", None) is torch.Tensor.data)
        for r in result if isinstance(result, (list, tuple)) else (result,):
            if not isinstance(r, torch.Tensor) or _real(r):
                continue  # the real tensor itself (``contiguous()``): refused as it is
            if no_view and (id(first) in self.aliases or _real(first)):
                self.aliases[id(r)] = (r, root, how)
            elif r._is_view() and (base := r._base) is not None:
                if id(base) in self.aliases:
                    self.aliases[id(r)] = (r, self.aliases[id(base)][1], how)
                elif _real(base):
                    self.aliases[id(r)] = (r, base, how)

    def _written_label(self, written: Any) -> tuple[str, ...]:
        """The words of ``_written_in_place`` for a write to ``written[0]``: the place the
        walk found the tensor, and the alias it was written through, where known."""
        if not written or not isinstance(written[0], torch.Tensor):
            return ()
        alias = self.aliases.get(id(written[0]))
        tensor = alias[1] if alias else written[0]
        places = self.found.get(id(tensor))
        if not places and not alias:
            return ()
        where = places[0].label if places else "a tensor"
        through = f", through its alias {alias[2]} (a view or detached alias sharing its memory)" if alias else ""
        return (f"{where}, a tensor that is neither an argument nor part of a module or optimizer{through}",)

    def _first_sight(self, func: Any, name: str, args: Any, kwargs: dict) -> None:
        """Take the bytes of each outside tensor ``func`` is the first to see, and record
        the ones it reads as Python values (NOTE: [outside tensors read as Python values])."""
        for i, a in enumerate((*args, *kwargs.values())):
            for t in a if isinstance(a, (list, tuple)) else (a,):
                if not isinstance(t, torch.Tensor) or isinstance(t, DTensor):
                    continue
                if id(t) not in self.found:
                    if name in _VALUE_READS and i == 0 and a is t and _real(t):
                        raise _unwatched_value_read(name, self.unplaced.get(id(t)))
                    continue
                if not _real(t) or id(t) in self.state or replacement_of(t) is not None:
                    continue  # one of the step's parameters, or one a placement retired
                if id(t) not in self.sighted:
                    with private.outside_the_trace():
                        self.sighted[id(t)] = (t, CapturedBytes.of(t, self.found[id(t)][0].label))
                if id(t) in self.read or name == "__get__":
                    continue
                if (name in _VALUE_READS and i == 0 and a is t) or (not t.requires_grad and t.numel() == 1):
                    self.read[id(t)] = (t, innermost_model_frame_of_stack())

    def restore_written(self) -> tuple[str, Any] | None:
        """The label of an outside tensor the step wrote without an op this mode saw
        (through ``.data``, a NumPy array or a buffer it shares: NOTE: [outside tensors
        written through shared memory in the step]), with the line of the step's
        ``.numpy()`` of it where there was one (else None), each such tensor's bytes put
        back as they were at first sight (by its ``.data``: the version counter as
        found); None where none was written."""
        written = None
        with private.outside_the_trace():
            for t, captured in self.sighted.values():
                if not captured.unchanged(t):
                    written = written or (self.found[id(t)][0].label, self.numpy_at.get(id(t)))
                    captured.restore(t)
        return written


def _written_in_place(name: str, line: Any, label: str = "a tensor that is neither an argument nor part "
                      "of a module or optimizer (a global, a closure value or a plain attribute)") -> SPMDCompileError:
    """The refusal of a write to a real tensor while the step is traced (NOTE: [tensors
    read from outside the arguments])."""
    return SPMDCompileError(
        f"The train step writes in place ({name}) to {label}; a compiled step runs its "
        "Python once, so that write would happen once, at capture (NOTE: [tensors read "
        "from outside the arguments]).",
        user_line=line,
        hint="keep state the step updates in a buffer (module.register_buffer) or "
        "return the value from the step and update it outside. An average of the "
        "weights (diffusers' EMAModel, timm's ModelEma keeping plain tensors): hold "
        "it as a module and pass it to the step, "
        "torch.optim.swa_utils.AveragedModel(model, multi_avg_fn="
        "get_ema_multi_avg_fn(decay)) updated there with update_parameters(model); "
        "outside the step the model's weights are placed DTensors.",
    )


def written_through_shared_memory(label: str, line: Any, numpy_at: Any = None) -> SPMDCompileError:
    """The refusal of NOTE: [outside tensors written through shared memory in the step]
    (``numpy_at``: the line of the step's ``.numpy()`` of the tensor, named instead of
    ``line``, the step's, where there was one: NOTE: [outside tensors read through
    NumPy])."""
    return _written_in_place(
        "through the NumPy array of its .numpy()" if numpy_at is not None else "through .data or memory it shares",
        numpy_at if numpy_at is not None else line,
        f"{label}, a tensor that is neither an argument nor part of a module or optimizer "
        "(the compiled step put its values back as they were before the call)",
    )


def _unwatched_value_read(name: str, unplaced: str | None) -> SPMDCompileError:
    """The refusal of a value read of a real tensor the walk did not find (NOTE:
    [outside tensors read as Python values])."""
    what = (
        f"{unplaced}, a module that is neither an argument of the step nor one it reads by "
        "name, so its state cannot be watched for changes (NOTE: [modules read by name "
        "beside the given ones])" if unplaced else
        "a tensor that is neither an argument nor part of a module or optimizer, from a "
        "place the compiled step cannot watch for changes (a set, a list or tuple, or made "
        "from a NumPy array or a buffer: NOTE: [outside tensors read as Python values])"
    )
    return SPMDCompileError(
        f"The train step reads the value of {what} in Python ({name}); the program would "
        "keep the number read at capture.",
        user_line=innermost_model_frame_of_stack(),
        hint="pass the module to the step as an argument, or read it by a name of its own "
        "(a global or closure variable)." if unplaced else
        "hold the tensor by a name of its own (a global, a closure variable, an "
        "attribute of the model or of an object passed to the step), where a change "
        "compiles a new program; or pass it to the step as a tensor argument and compute "
        "with it in tensor ops; or read the Python data itself (the list or array it was "
        "made from).",
    )


_DATA_SET_HINT = (
    "write the values in place instead, which compiles and computes alike: `with "
    "torch.no_grad(): param.copy_(value)` (or `param.data.copy_(value)`, "
    "`param.data.clamp_(-c, c)`)."
)
# NOTE: [data replaced inside the step]: torch's helpers that set ``.data`` for the step,
# with the in-place form of each
_HELPER_HINTS = {
    "vector_to_parameters": (
        "copy the vector's slices into the parameters in place, which compiles and "
        "computes the same values: `ps = list(model.parameters())`, then under `with "
        "torch.no_grad():` `for p, v in zip(ps, torch.split(vec, [p.numel() for p in "
        "ps])): p.copy_(v.view_as(p))`; the parameters then hold copies, where "
        "vector_to_parameters makes them views of the vector."
    ),
}


def _data_set() -> SPMDCompileError:
    """The refusal of ``tensor.data = value`` (NOTE: [data replaced inside the step]),
    naming the torch helper that ran the assignment where the step did not write it
    (``torch.nn.utils.vector_to_parameters``)."""
    helper = torch_function_called_by_model()
    who = (
        f"The train step calls torch's {helper}, which sets tensors' .data (`param.data = "
        "value` inside torch)" if helper else "The train step sets a tensor's .data (tensor.data = value)"
    )
    return SPMDCompileError(
        f"{who}: that swaps the storage outside every op the compiled program records, "
        "so the program would never write the new values.",
        user_line=innermost_model_frame_of_stack(),
        hint=_HELPER_HINTS.get(helper or "", _DATA_SET_HINT),
    )


# NOTE: [tensors on memory torch does not own]
# ``torch.frombuffer(bytearray(raw), dtype=torch.uint8)`` inside the step (``raw`` a
# ``bytes`` argument) makes a real tensor that no op of the trace records: it reaches
# the graph as a constant of unknown origin, and was refused as "neither an argument
# nor part of a module or optimizer ... register it on the model ... or create it
# inside the step", though the user had created it in the step (sixty-eighth session,
# an outside probe). Its values are a view of a Python buffer (or a NumPy array:
# ``torch.from_numpy``, ``torch.as_tensor``), which nothing guards, so it cannot be
# compiled as a constant made from Python data (NOTE: [tensor constants]) is: the
# refusal says what it is and what compiles (make it outside and pass it, or copy the
# data: ``torch.tensor(list(raw))``). Such a tensor's storage is not resizable, as every
# storage torch allocates is (``_shares_foreign_memory``).
def _shares_foreign_memory(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s storage belongs to another object (a Python buffer, a NumPy
    array): see the NOTE."""
    try:
        return not tensor.untyped_storage().resizable()
    except (RuntimeError, NotImplementedError, TypeError):  # no plain storage
        return False


def outside_constants(
    gm: torch.fx.GraphModule, found: dict[int, list[FoundTensor]],
    bindings: StepBindings, unplaced: dict[int, str] | None = None, inherited: dict[int, str] | None = None,
    read: dict[int, tuple[torch.Tensor, Any]] | None = None,
) -> list[OutsideTensor]:
    """The first graph's constants that came from outside the step, each with where it
    was found (at each place: NOTE: [every place a constant is read from]); refuses
    those that cannot be guarded or computed with (see the NOTE). ``unplaced``: the
    state of modules the walk met that are not the step's, by tensor
    (``KeptTensors.unplaced``), named when the step reads one; ``inherited``: the class
    attributes inherited from a base class, by tensor (``KeptTensors.inherited``), named
    when the step reads one found nowhere else; ``read``: the tensors the step read as
    Python values (``OutsideWrites.read``: NOTE: [outside tensors read as Python values]),
    guarded alike."""
    constants: list[OutsideTensor] = []
    seen: set[int] = set()
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        value = operator.attrgetter(node.target)(gm)
        if not isinstance(value, torch.Tensor) or id(value) in seen:
            continue
        if node.users and all(u.target in _LIFTS for u in node.users):
            continue  # made from Python data inside the step (NOTE: [tensor constants])
        seen.add(id(value))
        user = next(iter(node.users), node)
        if unplaced and id(value) in unplaced:
            raise node_error(
                f"The train step reads {unplaced[id(value)]}, a module that is neither "
                "an argument of the step nor one it reads by name (a global, a closure "
                "variable or an attribute of its object that its code names), so its "
                "state is not the step's and cannot be placed or watched for changes "
                "(NOTE: [modules read by name beside the given ones]).",
                user,
                hint="pass the module to the step as an argument, train_step(model, "
                "teacher, optimizer, x, y), or read it by a name of its own (a global "
                "or closure variable, self.teacher) rather than through a dict, list "
                "or other object.",
            )
        if inherited and id(value) in inherited:
            # NOTE: [tensors of modules and classes read by name]: refused even where
            # the tensor is also guarded elsewhere (``Cfg.W`` read beside ``Sub.W``):
            # that guard does not see ``Sub.W = new`` shadow it (a review: 5e-2 off)
            raise node_error(
                f"The train step reads {inherited[id(value)]}: a tensor the compiled step "
                "would keep as a constant, but a value set on the class itself later "
                "would shadow the base class's where the compiled step cannot watch for "
                "it (NOTE: [tensors of modules and classes read by name]).",
                user,
                hint="set the tensor on the class the step names (Cfg.POS_WEIGHT = "
                "torch.tensor(...) in its body) or read it from the base class by name, "
                "or register it on the model (model.register_buffer('name', t)).",
            )
        if id(value) not in found and _shares_foreign_memory(value):
            raise node_error(  # NOTE: [tensors on memory torch does not own]
                "The train step uses a tensor on memory torch does not own (made by "
                "torch.frombuffer from a bytearray or bytes, or torch.from_numpy / "
                "torch.as_tensor from a NumPy array), neither an argument nor part of a "
                "module or optimizer: made inside the step, it is a view of Python data "
                "the compiled step would bake in once and cannot watch; read from "
                "outside, of a place it cannot watch.",
                user,
                hint="make the tensor outside the step and pass it as an argument "
                "(x = torch.frombuffer(bytearray(raw), dtype=torch.uint8) before the "
                "call, then train_step(model, opt, x)), or copy the data into a new "
                "tensor inside the step, which compiles as a constant made from Python "
                "data: torch.tensor(list(raw), dtype=torch.long).",
            )
        if id(value) not in found:
            raise node_error(
                "The train step uses a tensor that is neither an argument nor part of a "
                "module or optimizer, from a place the compiled step cannot watch for "
                "changes (NOTE: [tensors read from outside the arguments]).",
                user,
                hint="register it on the model (model.register_buffer('name', t)) and read "
                "it from there, or create it inside the step; a loss module holding one "
                "(nn.CrossEntropyLoss(weight=w)) can be passed to the step as an argument, "
                "train_step(model, criterion, optimizer, x, y); a batch drawn inside the "
                "step (x, y = next(batches)) is drawn outside and passed as arguments.",
            )
        read_at = read[id(value)][1] if read and id(value) in read else None
        constants += _guarded(found[id(value)], bindings, user, read_at=read_at)
    for key, (_tensor, line) in (read or {}).items():  # NOTE: [outside tensors read as Python values]
        if key not in seen:
            seen.add(key)
            constants += _guarded(found[key], bindings, None, line, read_at=line)
    return constants


def _guarded(
    places: list[FoundTensor], bindings: StepBindings, user: torch.fx.Node | None, line: Any = None,
    read_at: Any = None,
) -> list[OutsideTensor]:
    """A constant's guards, one for each place it was found; refuses one that requires
    grad (``user``: the node reading it; None where the step reads it as a Python value,
    at ``line``, which no gradient reaches in eager either), is a DTensor, or aliases the
    step's state. ``read_at``: the line of a read as a Python value (``OutsideTensor``)."""
    label, tensor = places[0].label, places[0].tensor
    alias = aliases_state(tensor, bindings, any_parameter=user is not None)
    if (tensor.requires_grad and user is not None) or isinstance(tensor, DTensor) or alias:
        what = (
            "requires grad (its gradient would never reach it)" if tensor.requires_grad and user is not None
            else "is a DTensor" if isinstance(tensor, DTensor)
            else f"is (or shares memory with) {alias}: as a constant it would not see "
            "the updates"
        )
        message = f"The train step reads {label}, a tensor from outside its arguments that {what}."
        hint = _DTENSOR_HINT if isinstance(tensor, DTensor) else (
            "read the parameter or buffer itself in forward, or make the tensor a "
            "parameter or buffer of a module passed to the step."
        )
        if user is None:
            raise SPMDCompileError(message, user_line=line, hint=hint)
        raise node_error(message, user, hint=hint)
    # NOTE: [every place a constant is read from]
    captured = CapturedBytes.of(tensor, label)  # NOTE: [constants changed through shared memory]
    return [
        OutsideTensor(p.label, p.container, p.key, tensor, tensor._version, p.in_argument, read_at, captured)
        for p in places
    ]


__all__ = ["FoundTensor", "OutsideTensor", "OutsideWrites", "outside_constants", "written_through_shared_memory"]
