"""Python float arguments of the step as graph inputs.

NOTE: [float arguments as graph inputs]
A Python ``float`` argument of the train step (a loss weight, a temperature, a
schedule value) that changes every call would compile a new program every call if it
were a guard. Capture first tries it as a graph input: a 0-dim float64 tensor in place
of the float. The rule that keeps this exact:
- Only ``float`` arguments (``type(a) is float``). ``int`` and ``bool`` arguments stay
  guards: they usually steer shapes, indices, loop counts and branches. So do NumPy
  scalars: ``np.float32`` rounds its arithmetic to 32 bits, which a float64 stand-in
  would not, and ``np.float64``, a float subclass, is the type a step tests for
  (``isinstance(w, np.floating) and w > 0.5``), a test the tensor stand-in fails where
  eager's value passes it: as a graph input (2026-12-06, reverted the same day) later
  values silently ran the first one's branch (parameters 2e-1 off eager). Their
  recompile warning says to pass ``float(value)``.
- The float must be used numerically only, in tensor ops. Anything Python does with
  the value itself (``if scale > 0``, ``float(scale)``, ``math.exp(scale)``, ``range``,
  a Scalar argument such as ``F.dropout(x, p)`` or ``full_like(x, scale)`` but those of
  NOTE: [float arguments in Scalar arguments], returning
  a number computed from it, storing it) fails the tensor trace, and the step is
  captured again with the float as a guard (a new value recompiles, which is then exact
  by construction). A float the traced program does not read at all is a guard too
  (NOTE: [float arguments the program does not read] in ``trace.py``). The float itself
  returned (``{"scale": scale}``) comes back from the program as the Python float, as a
  returned ``.item()`` does
  (NOTE: [returned .item() values]; before, a guard: a program per value).
- Type promotion and rounding are the ones a Python number gets: where the tensor
  stand-in meets other tensors in an op, it is cast first to the dtype the op computes
  in with a Python scalar (the other floating operands' dtype, float32 opmath for
  16-bit floats next to a non-scalar operand, the default dtype next to integer
  tensors). Arithmetic among stand-ins alone stays in float64, as Python's does.

NOTE: [float arguments in Scalar arguments]
An EMA written ``e.mul_(d).add_(p, alpha=1 - d)`` with the decay ``d`` a float argument
gave the stand-in to ``add_``'s ``alpha``, a Scalar argument: torch's argument parser
read its value, the trace failed, and ``d`` became a guard: a program per value (every
call of an EMA warm-up, 0.5-1 s each on a Linear(16, 4) at 2 simulated ranks, where
``add_(p * (1 - d))`` compiled once), with a warning blaming ``float()`` / math / an
``if``. Such calls are now computed with the stand-in as a tensor operand, the rewrites
of NOTE: [tensor hyper-parameters in Scalar arguments] in ``optimizers.py``: ``add`` /
``sub`` ``alpha=`` as ``addcmul`` (eager's fused multiply-add), ``addcmul`` / ``addcdiv``
``value=`` folded into the first operand in the op's compute dtype, ``lerp``'s weight
applied in the compute dtype, and their foreach forms per tensor (one code path with
the 0-dim tensors of NOTE: [0-d tensors in Scalar arguments]: ``ScalarArgumentRewrites``
in ``scalar_arguments.py``). float32 and float64
results are eager's bit for bit; 16-bit ones are the vectorized CPU kernel's, whose
scalar tail (the last ``numel % 32`` elements) rounds some elements differently by
1 ulp (eager's own result depends on an element's position there). Any other op whose
parser reads the stand-in as a number (``full_like(x, d)``, ``addmm(beta=d)``) keeps
that float a guard, and the recompile warning names the op and the argument
(``CapturedStep.floats_read``) instead of the generic "float() / math / an `if`".

NOTE: [Scalar arguments eager refuses]
The rewrites above compute with the stand-in as a tensor operand, where torch's checks
of a Python Scalar do not run: ``int.add(int, alpha=d)`` computed ``alpha`` truncated to
0 (eager: float alpha with integral tensors is refused), ``int.add_(float, alpha=d)``
returned the int tensor unchanged (eager: the result type cannot be cast in place),
``sub(float, bool, alpha=d)`` and ``lerp(f32, f64, d)`` returned numbers (eager refuses
both), and ``_foreach_add`` on integer lists too: silent results where the base tree
refused the step at capture, as eager does. So a call is rewritten only where eager
accepts it with a Python float there: the op itself is first called, outside the trace,
on 1-element CPU tensors of the operands' dtypes and ranks with a Python float in place
of each stand-in (``_eager_error``, cached per signature: torch's own checks, which its
meta kernels do not all repeat: ``sub`` of a bool passes on meta); and only where an
operand is floating or complex (an integral result converts the float to an integer,
which eager refuses beyond int64's range). Otherwise the float stays a guard, and the
step captured with it runs eager's op: eager's error at capture. A foreach op is checked
for every tensor before any is computed. Not covered: eager's value checks (an ``alpha``
beyond the dtype's range, 65504 for float16, raises in eager; the graph computes inf).
"""

from __future__ import annotations

import inspect
from typing import Any, NoReturn

import torch
from torch.overrides import TorchFunctionMode

from .._torch_private import pytree
from ..errors import SPMDCompileError, innermost_model_frame_of_stack
from .scalar_arguments import (
    _NOT_REWRITTEN,
    ScalarArgumentRewrites,
    UserStepMode,
    _python_scalar_dtype,
)


class FloatArgumentUsedInPython(Exception):
    """The trace used a float argument other than in tensor ops; capture it as a guard.
    ``indices``: the positions of the arguments concerned, where known (the others stay
    graph inputs); None: every float argument becomes a guard."""

    def __init__(self, message: str, indices: frozenset[int] | None = None,
                 op: str | None = None, argument: str | None = None, unread: bool = False) -> None:
        super().__init__(message)
        self.indices = indices
        # the program does not read them (NOTE: [float arguments the program does not
        # read] in ``trace.py``): the recompile warning says so
        self.unread = unread
        # the op and its Scalar argument that read the float, where one did (NOTE:
        # [float arguments in Scalar arguments]): the recompile warning names them
        self.op, self.argument = op, argument


class FloatArgumentMode(ScalarArgumentRewrites, TorchFunctionMode):
    """Tracks the stand-ins of float arguments (and scalars computed only from them)
    and casts them where they meet other tensors (see the NOTE)."""

    def __init__(self, stand_ins: list[torch.Tensor], indices: list[int] | None = None) -> None:
        super().__init__()
        self.scalars: dict[int, torch.Tensor] = {id(t): t for t in stand_ins}
        # id(stand-in) -> the position of its float in the step's flat arguments
        self.index_of: dict[int, int] = {id(t): i for t, i in zip(stand_ins, indices or [], strict=False)}
        # 0-dim bools computed only from stand-ins (``scale > 1``): an ``if`` on one is
        # Python's decision, which keeps the float a guard (NOTE: [value checks])
        self.flags: dict[int, torch.Tensor] = {}

    def is_stand_in(self, value: Any) -> bool:
        return isinstance(value, torch.Tensor) and id(value) in self.scalars

    def is_python_value(self, value: Any) -> bool:
        """A stand-in, or a 0-dim result computed only from stand-ins."""
        return self.is_stand_in(value) or (isinstance(value, torch.Tensor) and id(value) in self.flags)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        leaves = pytree.tree_leaves((args, kwargs))
        ours = [t for t in leaves if self.is_stand_in(t)]
        if not ours:
            return func(*args, **kwargs)
        if inspect.isfunction(func) and getattr(func, "__module__", "") != "torch._tensor":
            # a torch function written in Python (F.smooth_l1_loss tests ``beta == 0.0``
            # and passes beta on as a Scalar): its Python would decide on the value where
            # this mode cannot see it (its ops run with the mode off), and a decision on
            # a stand-in was taken for a check on a tensor's value, one way compiled and
            # every call of another value refused at run time. The float stays a guard.
            # (Running the function under this mode instead re-entered it through its
            # own ``handle_torch_function``: a RecursionError on ``F.cross_entropy``.)
            # ``torch._tensor``'s operators (``1 - scale``) are tensor ops.
            known = [self.index_of.get(id(t)) for t in ours]
            raise FloatArgumentUsedInPython(
                f"a float argument is passed to {func.__module__}.{func.__qualname__}",
                None if None in known else frozenset(i for i in known if i is not None),
                op=f"{func.__module__}.{func.__qualname__}",
            )
        others = [t for t in leaves if isinstance(t, torch.Tensor) and not self.is_stand_in(t)]
        name = getattr(func, "__name__", "")
        rewritten = self._scalar_argument_as_operand(func, name, args, kwargs, others)
        if rewritten is not _NOT_REWRITTEN:
            return rewritten
        if not others:
            out = self._call(func, name, args, kwargs)
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.dim() == 0 and t.is_floating_point():
                    self.scalars[id(t)] = t
                elif isinstance(t, torch.Tensor) and t.dim() == 0 and t.dtype == torch.bool:
                    self.flags[id(t)] = t
            return out
        dtype = _python_scalar_dtype(others)

        def cast(x: Any) -> Any:
            return x.to(dtype) if self.is_stand_in(x) else x

        return self._call(func, name, *pytree.tree_map(cast, (args, kwargs)), stand_ins=(args, kwargs))

    def _number(self, value: Any) -> bool:
        return self.is_stand_in(value)

    def _operand_number(self, value: Any) -> bool:
        return self.is_stand_in(value)

    def _refuse(self, name: str, slot: str, refused: str, numbers: list[Any]) -> NoReturn:
        """A call eager refuses with a Python float there: the float stays a guard
        (NOTE: [Scalar arguments eager refuses])."""
        known = [self.index_of.get(id(a)) for a in numbers]
        raise FloatArgumentUsedInPython(
            f"a float argument is given to `{name}` as {slot}, where eager does not compute the op "
            f"with a Python number and these dtypes ({refused})",
            None if None in known else frozenset(i for i in known if i is not None),
            op=name, argument=slot,
        )

    def _call(self, func: Any, name: str, args: tuple, kwargs: dict[str, Any],
              stand_ins: tuple[tuple, dict[str, Any]] | None = None) -> Any:
        """``func(*args, **kwargs)``; where its argument parser reads the value of a
        stand-in given for a Number (a Scalar argument, ``F``'s functions aside), the
        float stays a guard, and the reason names the op and the argument (NOTE: [float
        arguments in Scalar arguments])."""
        from .traced_items import value_read_errors  # not at the top: an import cycle

        try:
            return func(*args, **kwargs)
        except value_read_errors() as exc:
            given_args, given_kwargs = stand_ins if stand_ins is not None else (args, kwargs)
            slots = [
                (f"argument {k + 1}" if isinstance(k, int) else f"{k}=", a)
                for k, a in [*enumerate(given_args), *given_kwargs.items()] if self.is_stand_in(a)
            ]
            if not slots or name.startswith("__") or name in ("item", "tolist"):
                raise  # float(d), d.item(): Python reads it, not an op's argument
            known = [self.index_of.get(id(a)) for _, a in slots]
            slot = " / ".join(s for s, _ in slots)
            raise FloatArgumentUsedInPython(
                f"a float argument is given to `{name or func}` as {slot}, which reads it as a "
                "Python number (a Scalar argument)",
                None if None in known else frozenset(i for i in known if i is not None),
                op=name or str(func), argument=slot,
            ) from exc


# NOTE: [optimizer settings read in the step]
# A step that logs its learning rate (``return {"loss": loss.item(), "lr":
# opt.param_groups[0]["lr"]}``) reads a graph input: the group's ``lr`` (and Adam's first
# beta) is a float64 0-dim tensor while the step is traced (NOTE: [Adam's beta1 as a
# graph input]), so the call returned ``tensor(0.0010)`` where eager returns ``0.001``,
# and ``json.dumps`` of the metrics failed; ``loss * lr`` promoted a float32 loss to
# float64 (eager keeps float32: 3e-11 off in the logged value). While the user's step
# runs (not the optimizer's ``step()``, which NOTE: [hyper-parameters kept Python
# numbers] covers), ``GroupNumbers`` follows those inputs as Python numbers:
# - one meeting other tensors in an op is cast first to the dtype the op computes a
#   Python number in (``_python_scalar_dtype``, as for float arguments);
# - ``+ - * /``, negation and ``abs`` among them and Python numbers give numbers, in
#   float64, exactly as Python computes them; a comparison gives a flag;
# - the step returning one gives back the Python number of eager's type (the input's
#   value, a float, or an int where the group holds an int; a flag's bool), from the
#   program, as a returned ``.item()`` is (NOTE: [returned .item() values]).
# A number computed any other way (``lr ** 0.5``, ``torch.log(lr)``, or from a group
# value that is an int) would come back as a number Python might not have computed, so
# returning it is refused, naming the line. ``float(lr)``, ``math.log(lr)`` and format
# strings need the value in Python: refused, saying the group value is a Python number
# in eager and a graph input here (until the sixty-fourth session the refusal called it
# "the value of a tensor" and said to write ``t.item()``, which a float has not).
#
# NOTE: [tensors made of optimizer settings]
# Lightning's ``self.log("lr", lr)`` stores ``torch.tensor(lr)`` of the Python float.
# That call met the stand-in as a tensor: torch warned "To copy construct from a
# tensor", the result was followed as a number computed by ``tensor`` and the step
# refused ("returns a number computed from ... by `tensor`"), though it returns no
# number. ``torch.tensor(v)`` and ``torch.as_tensor(v)`` of a number above that Python
# computes alike (the value itself, ``+ - * /``, negation, abs,
# a comparison) are now the tensor eager makes of the number: the stand-in (float64,
# holding eager's double) converted to the dtype torch infers for a Python number (a
# float: the default dtype; an int: int64; a bool: bool) or is given, on the device
# given or the default one, detached; a float64-to-dtype conversion rounds as the
# Python float's conversion does. It is a plain tensor of the program, exact for each
# call's learning rate. With ``requires_grad=True`` or other arguments, and for a
# number computed otherwise (``lr ** 0.5``), the call is traced as before.
# ``torch.full(size, lr)`` is not covered: torch's argument parser refuses the traced
# stand-in as its Number before any mode sees the call (a TypeError naming the line).

_EXACT = frozenset({
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
    "__rtruediv__", "__neg__", "__pos__", "__abs__", "add", "sub", "rsub", "mul", "div",
    "true_divide", "neg", "abs",
})
_COMPARISONS = frozenset({
    "__lt__", "__le__", "__gt__", "__ge__", "__eq__", "__ne__", "lt", "le", "gt", "ge", "eq", "ne",
})


class GroupNumbers(UserStepMode):
    """Optimizer group values read in the step, followed as Python numbers (NOTE:
    [optimizer settings read in the step]). ``stand_ins``: each input with the type
    of eager's value (``float`` / ``int``) and what it is (``param_groups[0]['lr']``)."""

    def __init__(self, stand_ins: list[tuple[torch.Tensor, type, str]]) -> None:
        super().__init__()
        # id -> (tensor, how it was made: "float" / "int" the input itself, "exact",
        # "flag", or the op / group value that makes returning it inexact, and the label)
        self.numbers: dict[int, tuple[torch.Tensor, str, str]] = {
            id(t): (t, kind.__name__, label) for t, kind, label in stand_ins
        }

    def returned(self, value: Any) -> tuple[str, str] | None:
        """(how, label) where ``value`` is one of the numbers, else None."""
        entry = self.numbers.get(id(value)) if isinstance(value, torch.Tensor) else None
        return None if entry is None or entry[0] is not value else (entry[1], entry[2])

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        leaves = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        ours = [self.numbers[id(t)] for t in leaves if self.returned(t) is not None]
        if not ours or (inspect.isfunction(func) and getattr(func, "__module__", "") != "torch._tensor"):
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name in _READ_IN_PYTHON:
            _refuse_read_in_python(name, ours[0][2])
        made = self._made_tensor(func, args, kwargs)
        if made is not None:
            return made
        others = [t for t in leaves if self.returned(t) is None]
        if others:
            dtype = _python_scalar_dtype(others)

            def cast(x: Any) -> Any:
                return x.to(dtype) if self.returned(x) is not None else x

            args, kwargs = pytree.tree_map(cast, (args, kwargs))
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.dim() == 0:
            inexact = [
                "arithmetic on its int value" if how == "int" else how for _, how, _ in ours
                if how not in ("float", "exact", "flag")
            ]
            label = ours[0][2]
            if out.dtype == torch.bool and name in _COMPARISONS:
                self.numbers[id(out)] = (out, inexact[0] if inexact else "flag", label)
            elif out.is_floating_point():
                how = inexact[0] if inexact else "exact" if name in _EXACT else (
                    f"`{name}` ({innermost_model_frame_of_stack() or 'in the step'})"
                )
                self.numbers[id(out)] = (out, how, label)
        return out


    def _made_tensor(self, func: Any, args: tuple, kwargs: dict[str, Any]) -> torch.Tensor | None:
        """``torch.tensor(lr)`` / ``torch.as_tensor(lr)`` of a number Python computes alike, as the tensor eager makes of the Python number
        (NOTE: [tensors made of optimizer settings]), or None where the call is not one."""
        if func not in (torch.tensor, torch.as_tensor) or len(args) != 1:
            return None
        value = args[0]
        allowed = {"dtype", "device", "requires_grad"} if func is torch.tensor else {"dtype", "device"}
        entry = self.returned(value)
        if entry is None or entry[0] not in _PYTHON_EXACT or not set(kwargs) <= allowed \
                or kwargs.get("requires_grad", False):
            return None
        dtype = kwargs.get("dtype") or {
            "int": torch.int64, "flag": torch.bool,
        }.get(entry[0], torch.get_default_dtype())
        device = kwargs.get("device")
        device = torch.device(device) if device is not None else torch.get_default_device()
        assert isinstance(value, torch.Tensor)
        return value.detach().to(device=device, dtype=dtype, copy=True)


# group numbers a tensor is made of as eager makes it of the Python number: the input
# itself (a float or an int), ``+ - * /``, negation and abs of floats, a comparison
_PYTHON_EXACT = frozenset({"float", "int", "exact", "flag"})
# Python reading a group number's value: refused, saying it is a Python number in eager
_READ_IN_PYTHON = frozenset({"__float__", "__int__", "__index__", "__format__", "__complex__"})


def _refuse_read_in_python(name: str, label: str) -> NoReturn:
    """NOTE: [optimizer settings read in the step]: ``float(lr)``, ``math.log(lr)``, an
    f-string of it."""
    what = {"__format__": "a format string of", "__index__": "an index or size from"}.get(
        name, f"{name.strip('_')}() of"
    )
    raise SPMDCompileError(
        f"The train step computes {what} {label} in Python (float(), math functions and "
        "format strings read the value): eager holds a Python number there, but while the "
        "step is traced the group value is a graph input of the program, so Python has no "
        "value to compute with (NOTE: [optimizer settings read in the step]).",
        user_line=innermost_model_frame_of_stack(),
        hint="use the value as it is: return or store it (`logged['lr'] = "
        "opt.param_groups[0]['lr']` comes back as eager's float), make a tensor of it "
        "(`torch.tensor(lr)`, as Lightning's self.log does), or compute with it in tensor "
        "ops; anything else from the optimizer after the call.",
    )
