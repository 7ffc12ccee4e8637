"""``loss.item()`` returned by the train step.

NOTE: [returned .item() values]
``return loss.item()`` (or ``{"loss": loss.item(), ...}``) is how many train steps hand a
number to the logging loop. A traced program has no value to give ``.item()``: fake
tensors refuse it. So while the step is traced, an ``.item()`` that the fake tensor
refuses returns a ``TracedItem`` holding the tensor; a ``TracedItem`` among the step's
returned values becomes a returned tensor of the program, and the runtime hands back its
``.item()`` (``int`` / ``float`` / ``bool`` as eager's), the global value as a returned
loss is. Its truth value (``if flag.item():``, Longformer's ``if is_global_attn:``) is
the tensor's, an ``if`` on a tensor's value (NOTE: [value checks]). A comparison with a
number or another item (``if loss.item() > 1e4:``, ``loss.item() != loss.item()``) is
another ``TracedItem``, computed as Python compares the numbers: in float64 for a float
item (``.item()`` of a float32 loss is its exact double), in int64 for an integer one;
a mix that would round there (an integer item against a float, a float item against an
integer beyond 2**53) is refused. A comparison with a tensor (``p.masked_fill_(score
<= thr, 0.0)`` with ``thr = kthvalue(score, k)[0].item()``: peft AdaLoRA's budget mask)
is the tensor eager's comparison gives, the number converted to the dtype torch compares
in (``TracedItem._against_tensor``), as torch.compile traces it; before 2026-12-05 it was
refused as "used as a size or index" (the reflected comparison made a ``TracedItem`` of
the whole mask, which ``masked_fill_`` could not take). Anything else Python does with it while the step is
traced (arithmetic, formatting, ``float()``) would need the value the trace does not
have, so it raises ``ItemUsedInPython``, which capture reports as a value read in Python
(the refusal ``.item()`` had before), naming the line. An ``.item()`` a fake tensor can
answer (a constant made in the step) keeps its value. ``float(t)`` and ``int(t)`` cannot
return a ``TracedItem`` (Python requires the built-in type), so they are refused as an
``ItemUsedInPython`` that says to write ``t.item()`` to return the number (before,
``{"grad_norm": float(gn)}`` got the advice for value-dependent shapes) and to keep it a
tensor to use it in the step. An item used as a size or index (``x.narrow(0, 0,
n.item())``, ``x.split(counts.tolist())``) reaches torch's argument parser, which
refuses its type with a TypeError; ``caught_item_uses`` turns that into the
``ItemUsedInPython`` of a value-dependent shape, or, where the function takes a number
there (``torch.where(c, x, thr)``, ``x.clamp(max=thr)``), one that says to pass the
0-d tensor instead. An item put back into a tensor (``losses[k] = loss.item()``,
``torch.tensor([a.item(), b.item()])``) is that tensor's element, the item's tensor
converted (NOTE: [items kept in a tensor]).
"""

from __future__ import annotations

import contextlib
import functools
import operator
import os
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import torch
from torch.overrides import TorchFunctionMode

from .. import _torch_private as private
from ..errors import SourceLocation, innermost_model_frame_of_stack
from ..ir.graph_utils import ALIASING_UNANNOTATED
from ..ir.node_meta import is_item_snapshot, set_item_snapshot
from .mask_selections import RowsOfAModelMaskCounted
from .value_checks import drawn_alone


class ItemUsedInPython(Exception):
    """A traced ``.item()`` was used by Python code, not only returned; ``hint``: what
    to do, where the capture's generic advice does not fit (a list from ``.tolist()``)."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint


# torch's words when a C++ kernel reads the data of a traced tensor (which has none)
KERNEL_READ_VALUES = "its data is not allocated yet"


class KernelReadValues(RuntimeError):
    """torch's error of a kernel that read the data of a traced tensor, with the torch
    function that was called (NOTE: [kernels that read values at capture])."""

    def __init__(self, func: Any, message: str) -> None:
        super().__init__(message)
        self.func = func


# NOTE: [values of .tolist() in messages]
# ``t.tolist()`` of a traced tensor reaches ``ItemsAsOutputs`` as one ``.item()`` per
# element (torch's tolist does not dispatch itself), so its values are TracedItems and
# every refusal said ".item()": `for t in torch.linspace(9, 0, 5).long().tolist(): x + t`
# was told about ".item()" and to "pass the 0-d tensor .item() was called on", which does
# not fit a list of loop counts. An item is marked as from .tolist() where the user's line
# that made it calls .tolist() and not .item(); a refusal then says ".tolist()" and to
# compute such a list in Python (a tensor the step makes from constants is still the
# program's value: the capture reads no tensor's value). Messages only: nothing traced
# depends on the mark.
TOLIST_HINT = (
    "compute a list the step uses as numbers (loop counts, timesteps) in Python: a list "
    "literal or comprehension, `numpy.linspace(...)`, or torch outside the compiled step "
    "passed in as an argument; or keep it a tensor and compute with it. A list from "
    ".tolist() may only be returned."
)


def _origin_on_line() -> str:
    """``.tolist()`` where the user's line running now calls .tolist() and not .item(),
    else ``.item()`` (NOTE: [values of .tolist() in messages])."""
    where = innermost_model_frame_of_stack(skip_stdlib=True)
    line = where.code if where is not None else ""
    return ".tolist()" if ".tolist(" in line and ".item(" not in line else ".item()"


# NOTE: [a random draw read in Python]
# torchvision's detection models draw their training resize size in Python:
# ``GeneralizedRCNNTransform.torch_choice`` is ``int(torch.empty(1).uniform_(0.0,
# float(len(k))).item())``. Its refusal advised "return the value", which a draw inside a
# library cannot. An ``.item()`` used in Python whose tensor is computed from random draws
# alone (``drawn_alone``, NOTE: [ifs on random draws alone]) is refused saying it is a draw
# that capture would fix for every call, with advice that applies: draw it in Python
# outside the step and pass it in, and for torchvision's transform, which draws an index
# among its ``min_size`` values, put the transform in eval mode where it has one (the
# same size every call). A draw over one value (``uniform_(0, 1)`` then ``int`` is 0) is
# not proven constant: that needs every device's uniform below its upper bound.
_TORCHVISION_RESIZE = os.path.join("torchvision", "models", "detection", "transform.py")


def _draw_hint() -> str:
    """What to do about a random draw read in Python (NOTE: [a random draw read in
    Python])."""
    hint = (
        "draw the number in Python outside the compiled step (`random.randrange(n)`) and "
        "pass it in as an argument, or keep the draw a tensor and compute with it"
    )
    where = innermost_model_frame_of_stack(skip_stdlib=True)
    if where is not None and where.filename.endswith(_TORCHVISION_RESIZE):
        hint += (
            ". This is torchvision's GeneralizedRCNNTransform choosing a training resize "
            "size among its min_size values: with one min_size it always takes it, as in "
            "eval mode, so call `model.transform.eval()` after each `model.train()` (or "
            "resize the images before the step and build the model with one min_size)"
        )
    return hint + "."


# what to do about an item used as a Python number (the generic refusal's): where the
# number feeds tensor math (CleanRL's SAC: ``alpha = log_alpha.exp().item()``, then
# ``alpha * log_prob``), ``.detach()`` keeps it a tensor without a gradient, which the
# program computes as eager computes the float
ITEM_HINT = (
    "where the number feeds tensor math (`alpha = log_alpha.exp().item()`, then "
    "`alpha * log_prob`), keep it a tensor without a gradient instead: `alpha = "
    "log_alpha.exp().detach()`, which computes as eager does; a number for Python "
    "(logging) is returned (`return loss.item()` works: NOTE: [returned .item() values]) "
    "and used outside the compiled step."
)


class TracedItem:
    """The value of ``tensor.item()``, known only when the program runs."""

    __slots__ = ("tensor", "origin")

    def __init__(self, tensor: torch.Tensor, origin: str = ".item()") -> None:
        self.tensor = tensor
        self.origin = origin  # NOTE: [values of .tolist() in messages]

    def _used(self, *args: Any, **kwargs: Any) -> NoReturn:
        if self.origin == ".tolist()":
            _raise_used(
                "the values of .tolist() are computed by the program at run time (also "
                "those of a tensor the step makes from constants: the capture reads no "
                "tensor's values); inside a compiled step they can only be returned",
                hint=TOLIST_HINT,
            )
        if drawn_alone(self.tensor):  # NOTE: [a random draw read in Python]
            _raise_used(
                "the value of .item() is a random draw (computed from random numbers alone): "
                "read in Python while the step is captured it would be one draw, fixed in the "
                "program for every call, where the step run eagerly draws afresh each call; "
                "inside a compiled step it can only be returned",
                hint=_draw_hint(),
            )
        _raise_used(
            "the value of .item() is computed by the program at run time; inside a compiled "
            "step it can only be returned, compared (`if loss.item() > 1e4:`) or put back "
            "into a tensor (`torch.tensor(x.item())`), not used as a Python number "
            "(arithmetic, float(), formatting)"
        )

    def __bool__(self) -> bool:
        # its truth value is the tensor's: an `if` on it is a value check or branch of the
        # program (NOTE: [value checks]), as `if tensor:` is. Longformer's
        # `is_global_attn = mask.any().item(); if is_global_attn:`
        return bool(self.tensor)

    __float__ = __int__ = __index__ = __complex__ = _used
    __str__ = __format__ = __round__ = __trunc__ = __floor__ = __ceil__ = _used
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _used
    __truediv__ = __rtruediv__ = __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = _used
    __pow__ = __rpow__ = __neg__ = __pos__ = __abs__ = _used

    def _compare(self, other: Any, op: Callable[[torch.Tensor, Any], torch.Tensor]) -> TracedItem | torch.Tensor:
        """``item OP other`` as Python compares the numbers, exactly: floats in float64,
        integers in int64; a mix where that would round is refused (``_used``). Against
        a tensor, the tensor eager's comparison gives (``_against_tensor``)."""
        if isinstance(other, torch.Tensor):
            return self._against_tensor(other, op)
        mine = _exact_operand(self.tensor)
        theirs = _exact_operand(other.tensor) if isinstance(other, TracedItem) else other
        if mine is None or theirs is None or not _comparable(mine, theirs):
            self._used()
        return TracedItem(op(mine, theirs), self.origin)

    def _against_tensor(self, other: torch.Tensor, op: Callable[[torch.Tensor, Any], torch.Tensor]) -> torch.Tensor:
        """``number OP tensor`` as eager computes it for the number ``.item()`` gives
        (``score <= thr`` reaches here reflected, as ``thr >= score``): the number is
        converted to the dtype torch compares in, ``torch.result_type(tensor, number)``
        (a Python number does not promote a tensor of its kind), and compared
        elementwise; a tensor, as eager's. The conversion is the one eager makes of the
        number (the item's tensor holds it exactly: ``.item()`` of a float32 is its
        double). Refused (``_used``): a complex operand, and a float16 / bfloat16 tensor,
        which eager compares against the number converted to float32 on CUDA but to the
        tensor's dtype on CPU."""
        t = self.tensor
        if t.numel() != 1 or t.is_complex() or other.is_complex():
            self._used()
        number: bool | int | float = True if t.dtype == torch.bool else 1.0 if t.is_floating_point() else 1
        dtype = torch.result_type(other, number)
        if dtype.is_floating_point and torch.finfo(dtype).bits < 32:
            _raise_used(
                f"a value of .item() is compared with a {dtype} tensor; eager converts the "
                "number to float32 on CUDA but to the tensor's dtype on CPU, so the program "
                "cannot follow both. Keep it a tensor (`score <= thr_tensor`, thr_tensor "
                "the 0-d tensor .item() was called on) and convert it as wanted"
            )
        return op(t.reshape(()).to(dtype), other)

    __lt__ = functools.partialmethod(_compare, op=torch.lt)  # type: ignore[assignment]
    __le__ = functools.partialmethod(_compare, op=torch.le)  # type: ignore[assignment]
    __gt__ = functools.partialmethod(_compare, op=torch.gt)  # type: ignore[assignment]
    __ge__ = functools.partialmethod(_compare, op=torch.ge)  # type: ignore[assignment]
    __eq__ = functools.partialmethod(_compare, op=torch.eq)  # type: ignore[assignment]
    __ne__ = functools.partialmethod(_compare, op=torch.ne)  # type: ignore[assignment]

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"TracedItem({tuple(self.tensor.shape)} {self.tensor.dtype})"


_EXACT_INTEGERS = 2**53  # a double holds every integer up to this one exactly
_INT64 = 2**63


def _exact_operand(t: torch.Tensor) -> torch.Tensor | None:
    """The one-element tensor as the number ``.item()`` gives: float64 or int64."""
    if t.numel() != 1 or t.is_complex():
        return None
    return (t.double() if t.is_floating_point() else t.long()).reshape(())


def _comparable(mine: torch.Tensor, theirs: Any) -> bool:
    """``mine OP theirs`` in torch equals Python's comparison of the two numbers."""
    floating = mine.dtype == torch.float64
    if isinstance(theirs, torch.Tensor):
        return (theirs.dtype == torch.float64) == floating
    if isinstance(theirs, bool) or (isinstance(theirs, int) and not floating):
        return -_INT64 <= int(theirs) < _INT64
    if isinstance(theirs, int):
        return abs(theirs) <= _EXACT_INTEGERS
    return isinstance(theirs, float) and floating


# NOTE: [an item is its value at the read]
# ``.item()`` gives the number the tensor holds when it is called; a write to the tensor
# afterwards does not change it. The HF Accelerate way of telling that a GradScaler
# skipped the step reads the scale before and after (``before = scaler.get_scale();
# scaler.step(opt); scaler.update(); if scaler.get_scale() >= before: sched.step()``).
# Until 2026-12-06 a ``TracedItem`` held ``tensor.detach()``, a view of the tensor read,
# so everything computed from it later (the returned number, a comparison, an ``if`` on
# it) read the tensor as the step left it: ``before = model.scale.item();
# model.scale.mul_(2)`` returned the doubled scale as ``before``, and with the scaler
# ``get_scale() < before`` came out False on a skipped call, so the scheduler stepped
# where eager's did not (parameters 5e-2 off eager in float64, silently). The item now
# holds a copy made where it is read (``_snapshot``: an ``aten.clone`` marked
# ``ITEM_SNAPSHOT``). Where no write follows, the copy costs an op for nothing: once the
# program is functional, ``drop_unneeded_snapshots`` reads the value itself instead of
# the copy unless the value is (a view of) training state the step writes, the one case
# where the program's input buffer may hold the new value when the item is read (state
# written back, or updated in place by ``reinplace``). ``loss.item()`` of a value the
# step computes has no copy; ``scaler.get_scale()`` of the scale ``update()`` writes
# has one (a one-element copy).
def _snapshot(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` as it is now, marked as an item's (see the NOTE)."""
    copy = t.detach().clone()
    node = private.traced_node_of(copy)
    if node is not None:
        set_item_snapshot(node)
    return copy


def drop_unneeded_snapshots(gm: torch.fx.GraphModule, written: set[torch.fx.Node]) -> None:
    """In the functional program ``gm``, an item's copy reads its value directly unless
    the value is, or is a view of, a placeholder in ``written`` (NOTE: [an item is its
    value at the read]); where it cannot tell, the copy stays."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.clone.default:
            continue
        if not is_item_snapshot(node) or not isinstance(node.args[0], torch.fx.Node):
            continue
        root = _viewed(node.args[0])
        if root is not None and root not in written:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)


def _viewed(node: torch.fx.Node) -> torch.fx.Node | None:
    """The node whose memory ``node`` is (through views and the pieces of ops returning
    views), or None where an op is not one whose aliasing its schema tells."""
    while node.op == "call_function":
        if node.target is operator.getitem:
            source = node.args[0]
        elif private.is_op_overload(node.target):
            returns = node.target._schema.returns  # type: ignore[union-attr]
            if node.target not in ALIASING_UNANNOTATED and not any(r.alias_info is not None for r in returns):
                return node  # a fresh tensor
            source = node.args[0] if node.args else None
        else:
            return None
        if not isinstance(source, torch.fx.Node):
            return None
        node = source
    return node


class ItemsAsOutputs(TorchFunctionMode):
    """Answers ``.item()`` on a traced tensor with a ``TracedItem`` (see the NOTE)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func is torch.Tensor.__setitem__ and len(args) == 3 and isinstance(args[2], TracedItem):
            return func(args[0], args[1], _assigned(args[2], args[0]))
        if func is torch.tensor and args and _holds_items(args[0]):
            return _tensor_of_items(args[0], **kwargs)
        if func is not torch.Tensor.item and func not in _CONVERSIONS:
            try:
                return func(*args, **kwargs)
            except RuntimeError as exc:
                if KERNEL_READ_VALUES not in str(exc) or isinstance(exc, KernelReadValues):
                    raise
                raise KernelReadValues(func, str(exc)).with_traceback(exc.__traceback__) from exc
        try:
            return func(*args, **kwargs)
        except private.data_dependent_error_types():
            if func is torch.Tensor.item:
                item = TracedItem(_snapshot(args[0]), _origin_on_line())
                if _ITEM_USES.origins is not None:
                    _ITEM_USES.origins.add(item.origin)
                return item
            name = _CONVERSIONS[func]
            _raise_used(
                f"{name}() of a tensor needs its value in Python while the step is traced "
                f"(Python requires {name}() to return {'an' if name == 'int' else 'a'} {name}); "
                f"`t.item()` gives the number where the step only returns it "
                f"(`{{'value': {name}(t)}}`)",
                _INT_HINT if name == "int" else _FLOAT_HINT,
            )


# NOTE: [an index read with int()]
# MoCo's queue write is ``ptr = int(self.queue_ptr); self.queue[:, ptr:ptr + bs] = k.T;
# self.queue_ptr[0] = (ptr + bs) % K``. Until the sixty-seventh session the refusal of
# ``int()`` offered, beside the tensor form, "keep the number as a plain Python value
# outside the step (an int attribute the loop updates after each call)" and, among the
# tensor forms, ``torch.roll``. Followed, the Python value recompiled the step for every
# pointer value (6 programs for K/B = 5 in the probe, 256 at MoCo's defaults) and then warned
# against the changing argument; ``torch.roll`` takes Python ints, so a tensor shift is
# refused too. The hint now leads with the tensor form of a slice write and read at a
# pointer (``index_copy_`` / ``index_select`` at ``(ptr + arange(n)) % K``: exact, one
# program) and says what the Python value costs: one program per distinct value.
_INT_HINT = (
    "keep the index a tensor and index with it (`.item()` is refused there too): a slice write at a pointer "
    "`buf[:, ptr:ptr + n] = rows.T` is `buf.index_copy_(1, (ptr + torch.arange(n)) % K, "
    "rows.T.contiguous())` then `ptr.copy_((ptr + n) % K)` (ptr a 1-element long buffer), a read "
    "(or a roll by a tensor shift s) is `x.index_select(d, (torch.arange(n) - s) % n)`, and "
    "`torch.where` picks by a value; one program serves every value. An int passed in from "
    "outside the step instead compiles one program per distinct value (K / n programs for a "
    "circular pointer). To return the number, write `t.item()`."
)
_FLOAT_HINT = (
    "compute with the 0-dim tensor itself (`x * t` for `x * float(t)`), or, to return the "
    "number, write `t.item()`."
)


# NOTE: [items kept in a tensor]
# nanoGPT's estimate_loss writes ``losses[k] = loss.item()`` into a tensor made in the
# step, and steps write ``torch.tensor([a.item(), b.item()])``: the number goes back into
# a tensor, so the program needs no value in Python. ``t[k] = item`` is traced as
# ``t[k] = item_tensor`` converted to t's dtype and device, and ``torch.tensor(data)``
# with items among the (nested) list's numbers as the stack of the items' 0-d tensors and
# the numbers, of the dtype torch.tensor infers (a float among them: the default dtype;
# else an int: int64; else bool) or is given, on its device (the default device). That
# is eager's result where the conversion is eager's: the item's tensor holds the number
# ``.item()`` gives exactly, and converting it to the same dtype, a wider one of its
# kind, an integer one to float32 / float64 or anything to bool (a bool to anything)
# gives the number eager converts. Other conversions are refused, saying what to write
# (``t[k] = x.detach()``, ``torch.stack(...)``): a float into an integer tensor, an
# integer into a narrower integer or a 16-bit float tensor (eager checks for overflow), a
# float64 item assigned into a float32 tensor (eager's assignment refuses a number
# beyond float32's range; torch.tensor makes it inf, as the conversion does), complex.
# Before 2026-12-06 the assignment was refused as "used as a size or index", and
# torch.tensor raised "Could not infer dtype of TracedItem".
def _converts_as_eager(item: torch.dtype, target: torch.dtype, *, assigned: bool) -> bool:
    """Converting the item's tensor to ``target`` gives what eager's conversion of the
    Python number gives (NOTE: [items kept in a tensor])."""
    if item == target or item == torch.bool or target == torch.bool and not item.is_floating_point:
        return not item.is_complex
    if item.is_complex or target.is_complex or target == torch.bool:
        return False
    if not item.is_floating_point:
        if target.is_floating_point:
            return target in (torch.float32, torch.float64)
        return torch.promote_types(item, target) == target
    if target not in (torch.float32, torch.float64):
        return False
    return torch.promote_types(item, target) == target or not assigned


_KEEP_A_TENSOR = (
    "keep it a tensor: `losses[k] = loss.detach()` (converted as wanted: "
    "`.to(losses.dtype)`), `torch.stack([a.detach(), b.detach()])` for a "
    "torch.tensor of items"
)


def _assigned(item: TracedItem, target: torch.Tensor) -> torch.Tensor:
    """``target[k] = item`` as the 0-d tensor eager assigns (NOTE: [items kept in a tensor])."""
    t = item.tensor
    if t.numel() != 1 or not _converts_as_eager(t.dtype, target.dtype, assigned=True):
        _raise_used(
            f"a value of .item() ({t.dtype}) is assigned into a {target.dtype} tensor, a "
            "conversion the program does not make as eager converts the number; "
            + _KEEP_A_TENSOR
        )
    return t.detach().reshape(()).to(device=target.device, dtype=target.dtype)


def _holds_items(data: Any) -> bool:
    if isinstance(data, TracedItem):
        return True
    return isinstance(data, (list, tuple)) and any(_holds_items(d) for d in data)


def _tensor_of_items(
    data: Any, dtype: torch.dtype | None = None, device: Any = None, requires_grad: bool = False,
    pin_memory: bool = False,
) -> torch.Tensor:
    """``torch.tensor(data)`` with items among data's numbers (NOTE: [items kept in a tensor])."""
    leaves: list[Any] = []

    def collect(d: Any) -> None:
        if isinstance(d, (list, tuple)):
            if not d:
                _refuse_tensor_of_items("an empty list among them")
            for x in d:
                collect(x)
        elif isinstance(d, (TracedItem, bool, int, float)):
            leaves.append(d)
        else:
            what = "tensor" if isinstance(d, torch.Tensor) else type(d).__name__
            _refuse_tensor_of_items(f"a {what} among them")

    collect(data)
    if requires_grad or pin_memory:
        _refuse_tensor_of_items("requires_grad=True or pin_memory=True")
    kinds = [x.tensor.dtype if isinstance(x, TracedItem) else x for x in leaves]
    if dtype is None:
        if any(isinstance(k, float) or isinstance(k, torch.dtype) and k.is_floating_point for k in kinds):
            dtype = torch.get_default_dtype()
        elif any(isinstance(k, int) and not isinstance(k, bool) or k in _INTEGERS for k in kinds):
            dtype = torch.int64
        elif all(isinstance(k, bool) or k == torch.bool for k in kinds):
            dtype = torch.bool
        else:
            _refuse_tensor_of_items("a complex item among them")
    device = torch.device(device) if device is not None else torch.get_default_device()
    for x in leaves:
        if isinstance(x, TracedItem) and (
            x.tensor.numel() != 1 or not _converts_as_eager(x.tensor.dtype, dtype, assigned=False)
        ):
            _refuse_tensor_of_items(f"a {x.tensor.dtype} item converted to {dtype}")

    def build(d: Any) -> torch.Tensor:
        if isinstance(d, (list, tuple)):
            return torch.stack([build(x) for x in d])
        if isinstance(d, TracedItem):
            return d.tensor.detach().reshape(()).to(device=device, dtype=dtype)
        return torch.tensor(d, dtype=dtype, device=device)

    return build(data)


_INTEGERS = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})


def _refuse_tensor_of_items(what: str) -> NoReturn:
    _raise_used(
        f"torch.tensor() of values of .item() ({what}) cannot be made as eager makes it; "
        + _KEEP_A_TENSOR
    )


# NOTE: [an item use the step caught]
# ``ItemUsedInPython`` stops the trace where Python needs a value the trace does not
# have. Code between that use and the capture can catch it: ``logging`` does, for a
# ``log.info("loss %.3f", loss.item())`` in the step (it prints "--- Logging error ---"
# with the traceback and goes on), and so does a ``try: ... except Exception:`` of the
# user's. The trace then went on along the handler's path, which eager, having the value,
# never takes: the program would silently differ from the step (the log line is never
# written on a compiled call; a fallback branch is compiled in). So every use raised while
# the step is traced is recorded (``caught_item_uses``), and a trace that ends normally
# after one is refused as the use itself would have been, naming the line.
class _ItemUses(threading.local):
    def __init__(self) -> None:
        self.raised: list[tuple[ItemUsedInPython, SourceLocation | None]] | None = None
        self.origins: set[str] | None = None  # of the items this trace made


_ITEM_USES = _ItemUses()


def _raise_used(message: str, hint: str | None = None) -> NoReturn:
    exc = ItemUsedInPython(message, hint)
    if _ITEM_USES.raised is not None:
        _ITEM_USES.raised.append((exc, innermost_model_frame_of_stack(skip_stdlib=True)))
    raise exc


@contextlib.contextmanager
def caught_item_uses() -> Iterator[list[tuple[ItemUsedInPython, SourceLocation | None]]]:
    """Inside: every ``ItemUsedInPython`` raised is recorded in the list yielded, with
    the user's line (see the NOTE)."""
    outer, _ITEM_USES.raised = _ITEM_USES.raised, []
    outer_origins, _ITEM_USES.origins = _ITEM_USES.origins, set()
    try:
        yield _ITEM_USES.raised
    except TypeError as exc:
        # torch's argument parser tries __index__ (refused), clears that error and
        # raises its own TypeError naming our type: an item used as a size or index
        # (`x.narrow(0, 0, n.item())`, `x.split(counts.tolist())`), a value read in Python
        if TracedItem.__name__ not in str(exc):
            raise
        # the parser does not say which item: .tolist() where every item came from one
        tolist = _ITEM_USES.origins == {".tolist()"}
        raise ItemUsedInPython(
            _argument_use(str(exc), tolist), TOLIST_HINT if tolist else None
        ).with_traceback(exc.__traceback__) from exc
    finally:
        _ITEM_USES.raised = outer
        _ITEM_USES.origins = outer_origins


def _argument_use(parser_error: str, tolist: bool = False) -> str:
    """What torch's argument parser refused a ``TracedItem`` for (its TypeError): a
    number operand where the function takes a ``Number`` (``torch.le(x, thr)``,
    ``torch.where(c, x, thr)``, ``x.clamp(max=thr)``), else a size or index. Before
    2026-12-05 every such use was called a size or index."""
    called = re.match(r"(\w+)\(", parser_error)
    name = f"{called.group(1)}()" if called else "a torch function"
    if "Number" in parser_error and not (called and called.group(1) in _SIZE_FROM_NUMBERS) and tolist:
        return (
            f"a value of .tolist() is passed to {name} as a number operand (a fill value, "
            "a comparison's or torch.where's other value, a clamp bound): the values of "
            ".tolist() are computed by the program at run time (also those of a tensor "
            "the step makes from constants: the capture reads no tensor's values), and "
            "torch takes a Python number as a constant"
        )
    if "Number" in parser_error and not (called and called.group(1) in _SIZE_FROM_NUMBERS):
        return (
            f"a value of .item() or .tolist() is passed to {name} as a number operand (a "
            "comparison's or torch.where's other value, a clamp bound, a fill value): the "
            "number is computed by the program at run time, and torch takes a Python "
            "number as a constant. Keep it a tensor: pass the 0-d tensor .item() was "
            "called on (`torch.le(score, thr_t)`, `torch.where(c, x, thr_t)`, "
            "`x.clamp(max=thr_t)`); a comparison written with the operator, `score <= "
            "thr`, works as it is"
        )
    return (
        f"a value of {'.tolist()' if tolist else '.item() or .tolist()'} is used as a size or index by {name} (a split "
        "size, a narrow length, a shape): the result's shape would depend on tensor "
        "values the program computes at run time (a value-dependent shape)"
    )


# functions whose Number arguments give the result's shape (``torch.arange(n.item())``)
_SIZE_FROM_NUMBERS = frozenset({"arange", "range", "linspace", "logspace"})


# Python's conversions of a tensor to a number: they must return the built-in type, so
# they cannot hand back a TracedItem (NOTE: [returned .item() values])
_CONVERSIONS = {torch.Tensor.__float__: "float", torch.Tensor.__int__: "int"}


def checks_on_items() -> Any:
    """Inside: ``torch._check(item_condition)`` (transformers' ``torch_compilable_check``:
    Llava's image-token count) is an ``if`` on the item's tensor, a value check that
    raises torch's error on a call where it is false (NOTE: [value checks])."""
    return private.torch_checks_answered(TracedItem, bool)


def value_read_errors() -> tuple[type[BaseException], ...]:
    """What a trace raises when Python code needs a tensor's value."""
    return (*private.data_dependent_error_types(), ItemUsedInPython, RowsOfAModelMaskCounted)


__all__ = [
    "ITEM_HINT", "KERNEL_READ_VALUES", "ItemUsedInPython", "KernelReadValues", "ItemsAsOutputs", "TracedItem", "caught_item_uses", "checks_on_items", "drop_unneeded_snapshots",
    "value_read_errors",
]
