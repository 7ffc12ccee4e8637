"""Numbers given to torch's Scalar arguments as 0-dim tensors, computed as tensor operands.

NOTE: [0-d tensors in Scalar arguments]
A DINO-style trainer keeps its schedule counter in a buffer (as the refusal of
``self.global_step += 1`` advises), so its EMA momentum is a 0-dim tensor ``m =
sched.mom[sched.it]``, and the natural EMA lines give it to a Scalar argument:
``torch._foreach_lerp_(teacher, student, 1 - m)``, ``t.mul_(m).add_(s, alpha=1 - m)``.
Eager runs them: torch's argument parser reads a 0-dim tensor there with ``.item()``
(the value as a Python number: a float of a floating tensor, an int of an integer one).
A traced program has no value to read, and the step was refused with the generic
"reads the value of a tensor in Python ... use torch.where / masking" (the user wrote no
``if``, ``.item()`` or mask). While the user's step is traced (not an optimizer's
``step()``, which NOTE: [tensor hyper-parameters in Scalar arguments] covers),
``ScalarTensors`` now computes such calls with the tensor as a tensor operand, by the
rewrites of NOTE: [float arguments in Scalar arguments] (one code path,
``ScalarArgumentRewrites``): ``add`` / ``sub`` ``alpha=``, ``addcmul`` / ``addcdiv``
``value=``, and the foreach forms' Scalar (``_foreach_lerp``'s weight,
``_foreach_add`` / ``_foreach_sub`` ``alpha=``, ``_foreach_addcmul`` /
``_foreach_addcdiv`` ``value=``). The rules that keep it eager's:
- Only a slot torch's schemas type as a number and never as a Tensor (``_number_slot``):
  ``lerp(a, b, w)`` and ``_foreach_addcmul_(a, b, c, w)`` take a 0-dim tensor as a
  Tensor in eager (lerp.Tensor; the packed-scalars overload, which eager refuses for a
  0-dim one) and are left as they are.
- Only a real, non-bool 0-dim tensor that does not require grad (eager's parser refuses
  one that requires grad with a TypeError before any mode sees the call, as here).
- The value is applied in the op's compute dtype, as eager's kernel applies the Python
  number it read: a float32 tensor next to float64 parameters is widened exactly (its
  ``.item()`` is the same double), a float64 one next to float32 parameters rounded once
  to float32, an integer one converted as the kernel converts an int Scalar.
- A call is rewritten only where eager computes it with a Python number of the tensor's
  kind there (NOTE: [Scalar arguments eager refuses]; an int for an integer tensor, a
  float for a floating one); where eager refuses, so does the capture, with eager's error.
A 0-dim tensor reaching any other Scalar argument (``full_like(x, t)``,
``addmm(beta=t)``, ``F.dropout(x, p=t)``) is refused naming the op and the argument,
saying that torch reads it as a Python number and what to write instead (a tensor form,
or a float argument of the step), not the generic value-dependent-shape advice.
Float arguments' stand-ins keep their own rule (a guard where not covered).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from collections.abc import Iterator
from typing import Any, NoReturn

import torch
from torch.overrides import TorchFunctionMode

from .. import _torch_private as private
from .._torch_private import pytree
from ..errors import SPMDCompileError, innermost_model_frame_of_stack
from .int_arguments import INT_TYPES, READ_AS_INT, int_argument_refusal
from .optimizers import _add_with_tensor_alpha, _lerp_in_compute_dtype, _scaled_operand

_REDUCED = (torch.float16, torch.bfloat16)
_NOT_REWRITTEN = object()
# foreach ops (without the in-place ``_``) -> their Scalar argument rewritten per tensor
_FOREACH_SCALARS = {
    "_foreach_add": "alpha", "_foreach_sub": "alpha", "_foreach_addcmul": "value",
    "_foreach_addcdiv": "value", "_foreach_lerp": "weight",
}
_ALPHA_OPS = frozenset({"add", "add_", "sub", "sub_"})
_VALUE_OPS = frozenset({"addcdiv", "addcdiv_", "addcmul", "addcmul_"})


@dataclasses.dataclass(frozen=True)
class _TensorLike:
    """A tensor's dtype and rank, for ``_eager_error``."""

    dtype: torch.dtype
    dim: int


@dataclasses.dataclass(frozen=True)
class _PythonNumber:
    """A Python number of this type, for ``_eager_error``."""

    kind: type


_PYTHON_FLOAT = _PythonNumber(float)
_SAMPLE = {float: 0.5, int: 2}


@functools.lru_cache(maxsize=1024)
def _eager_error(func: Any, signature: tuple[tuple, tuple]) -> str | None:
    """What eager raises calling ``func`` on the arguments ``signature`` describes
    (``_TensorLike``: 1-element CPU tensors of that dtype and rank, ``_PythonNumber``: a
    Python number of its type), as ``"TypeName: message"``, or None where it computes
    (NOTE: [Scalar arguments eager refuses]). Run outside the trace, on real tensors:
    eager's checks."""

    def made(value: Any) -> Any:
        if isinstance(value, _PythonNumber):
            return _SAMPLE[value.kind]
        if isinstance(value, _TensorLike):
            return torch.ones((1,) * value.dim, dtype=value.dtype)
        return value

    described_args, described_kwargs = signature
    with private.outside_the_trace():
        try:
            func(*[made(a) for a in described_args], **{k: made(v) for k, v in described_kwargs})
        except Exception as exc:  # noqa: BLE001 - eager's refusal, whatever its type
            return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


def _python_scalar_dtype(others: list[torch.Tensor]) -> torch.dtype:
    """The dtype an op computes a Python float operand in, next to ``others``."""
    floating = [t for t in others if t.is_floating_point() or t.is_complex()]
    if not floating:
        return torch.get_default_dtype()
    dims = any(t.dim() > 0 for t in floating)
    candidates = [t for t in floating if t.dim() > 0] if dims else floating
    dtype = candidates[0].dtype
    for t in candidates[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    if dtype.is_complex:
        dtype = torch.float64 if dtype == torch.complex128 else torch.float32
    if dtype in _REDUCED and dims:
        return torch.float32  # opmath: the scalar is not rounded to 16 bits
    return dtype


class ScalarArgumentRewrites:
    """The rewrites of NOTE: [float arguments in Scalar arguments] and NOTE: [0-d tensors
    in Scalar arguments]: a call given a number (``_number``) for its Scalar ``alpha=`` /
    ``value=`` / lerp weight computed with it as a tensor operand. Subclasses say what a
    number is, which operands stand for Python floats, and how a call eager refuses is
    refused."""

    # where eager computes a Python float with integer operands, it converts the float to
    # an integer; float arguments are not given there (NOTE: [Scalar arguments eager refuses])
    floating_operands_only = True
    def _number(self, value: Any) -> bool:
        raise NotImplementedError

    def _operand_number(self, value: Any) -> bool:
        """An operand that stands for a Python float (cast to the compute dtype)."""
        return False

    def _python_kind(self, value: Any) -> type:
        """The type of Python number eager reads for the number ``value``."""
        return float

    def _takes_number(self, name: str, slot: int | str) -> bool:
        """Whether eager gives a number in argument ``slot`` of op ``name`` to a Scalar
        (a Python float always does)."""
        return True

    def _refuse(self, name: str, slot: str, refused: str, numbers: list[Any]) -> NoReturn:
        raise NotImplementedError

    def _scalar_argument_as_operand(
        self, func: Any, name: str, args: tuple, kwargs: dict[str, Any], others: list[torch.Tensor],
        of_foreach: bool = False,
    ) -> Any:
        """The op computed with a number given for its Scalar ``alpha=`` / ``value=`` /
        lerp ``weight`` as a tensor operand, or ``_NOT_REWRITTEN``; ``of_foreach``: a
        per-tensor op of a foreach op whose Scalar it was."""
        foreach = _FOREACH_SCALARS.get(name.removesuffix("_"))
        if foreach is not None:
            return self._foreach_as_operands(name, foreach, args, kwargs)
        key = "alpha" if name in _ALPHA_OPS else "value" if name in _VALUE_OPS else None
        if key is not None:
            scalar = kwargs.get(key)
            count = 2 if key == "alpha" else 3
            if not (self._number(scalar) and others and len(args) >= count
                    and set(kwargs) <= {key} and (of_foreach or self._takes_number(name, key))
                    and all(isinstance(a, torch.Tensor) for a in args[:count])):
                return _NOT_REWRITTEN
            self._check_eager_accepts(func, name, args, kwargs, key + "=")
            dtype = _python_scalar_dtype(others)
            operands = [a.to(dtype) if self._operand_number(a) else a for a in args[:count]]
            assert isinstance(scalar, torch.Tensor)
            if key == "alpha":
                return _add_with_tensor_alpha(func, operands[0], operands[1], scalar, tuple(args[2:]), {})
            return _scaled_operand(func, operands[0], operands[1], operands[2], scalar, {})
        if name in ("lerp", "lerp_") and len(args) == 3 and not kwargs \
                and (of_foreach or self._takes_number(name, 2)) \
                and self._number(args[2]) and isinstance(args[0], torch.Tensor) \
                and isinstance(args[1], torch.Tensor) \
                and not self._operand_number(args[0]) and not self._operand_number(args[1]):
            # a lerp.Tensor weight must have the operands' dtype; eager's Python weight
            # is applied in the op's compute dtype and rounded once
            self._check_eager_accepts(func, name, args, kwargs, "argument 3")
            return _lerp_in_compute_dtype(func, args[0], args[1], args[2], {})
        return _NOT_REWRITTEN

    def _foreach_as_operands(self, name: str, key: str, args: tuple, kwargs: dict[str, Any]) -> Any:
        """A foreach op given a number for its Scalar (``torch._foreach_lerp_(emas,
        params, 1 - d)``) as its per-tensor ops, each rewritten as above; the foreach
        kernels compute each tensor's per-tensor arithmetic. Or ``_NOT_REWRITTEN``."""
        n = 3 if key == "value" else 2
        scalar = kwargs.get(key, args[n] if len(args) == n + 1 else None)
        lists = args[:n]
        if not (self._number(scalar) and set(kwargs) <= {key} and len(args) in (n, n + 1)
                and self._takes_number(name, key if key in kwargs else n)
                and all(isinstance(a, (list, tuple)) for a in lists)
                and len({len(a) for a in lists}) == 1
                and all(isinstance(t, torch.Tensor) and not self._operand_number(t) and not self._number(t)
                        for a in lists for t in a)):
            return _NOT_REWRITTEN
        in_place = name.endswith("_")
        base = name.removeprefix("_foreach_").removesuffix("_")
        per_tensor = getattr(torch.Tensor, base + "_") if in_place else getattr(torch, base)
        calls = [
            ((*tensors, scalar), {}) if key == "weight" else (tensors, {key: scalar})
            for tensors in zip(*lists, strict=True)
        ]
        for args_, kwargs_ in calls:  # every tensor checked before any is computed
            self._check_eager_accepts(per_tensor, name, args_, kwargs_, "argument 3" if key == "weight" else key + "=")
        outs = []
        for args_, kwargs_ in calls:
            tensors = args_[:n]
            outs.append(self._scalar_argument_as_operand(
                per_tensor, per_tensor.__name__, args_, kwargs_, list(tensors), of_foreach=True,
            ))
        return None if in_place else outs

    def _check_eager_accepts(self, func: Any, name: str, args: tuple, kwargs: dict[str, Any], slot: str) -> None:
        """Calls ``_refuse`` unless eager computes ``func(*args, **kwargs)`` with a Python
        number for each number (NOTE: [Scalar arguments eager refuses])."""
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and not self._number(a)]
        signature = tuple(self._described(a) for a in args), tuple((k, self._described(v)) for k, v in kwargs.items())
        try:
            refused = _eager_error(func, signature)
        except TypeError:  # an argument not hashable: no rule for it
            refused = "an argument this check does not know"
        if refused is None and self.floating_operands_only and \
                not any(t.is_floating_point() or t.is_complex() for t in tensors):
            refused = "integer operands: the float would be converted to an integer"
        if refused is not None:
            self._refuse(name, slot, refused, [a for a in (*args, *kwargs.values()) if self._number(a)])

    def _described(self, value: Any) -> Any:
        """``value`` as ``_eager_error`` rebuilds it: a tensor as its dtype and rank, a
        number as a Python number of eager's type."""
        if self._number(value):
            return _PythonNumber(self._python_kind(value))
        if isinstance(value, torch.Tensor):
            return _TensorLike(value.dtype, value.dim())
        return value


_NUMBER_TYPES = frozenset({"number", "float", "Optional[number]", "Optional[float]"})
_TENSOR_TYPES = frozenset({"Tensor", "Optional[Tensor]"})
_NUMBER_ANNOTATIONS = frozenset({float, "float", "Optional[float]", "_float", "Number", "float | None"})


@functools.lru_cache(maxsize=512)
def _slot_types(name: str, slot: int | str) -> frozenset[str]:
    """The types torch's schemas of ``aten::name`` give argument ``slot`` (a position or a
    keyword), in the overloads that take a Tensor first."""
    types: set[str] = set()
    for schema in private.operator_schemas(f"aten::{name}"):
        arguments = schema.arguments
        if not arguments or str(arguments[0].type) not in ("Tensor", "List[Tensor]"):
            continue  # the Python-number overloads (aten::add.int)
        if isinstance(slot, int):
            positional = [a for a in arguments if not a.kwarg_only]
            if slot < len(positional):
                types.add(str(positional[slot].type))
        else:
            types.update(str(a.type) for a in arguments if a.name == slot)
    return frozenset(types)


def _number_slot(name: str, slot: int | str) -> bool:
    """Whether torch's schemas of ``aten::name`` type argument ``slot`` as a number (Scalar
    or float) in some overload and as a Tensor in none."""
    types = _slot_types(name, slot)
    return bool(types & _NUMBER_TYPES) and not types & _TENSOR_TYPES


def _int_slot(name: str, slot: int | str) -> bool:
    """Whether torch's schemas of ``aten::name`` type argument ``slot`` as an int (or a
    list of ints) in some overload and as a Tensor in none (NOTE: [0-d tensors in int
    arguments])."""
    if slot in READ_AS_INT.get(name, ()):
        return True  # a Tensor overload that reads it with .item() all the same
    types = _slot_types(name, slot)
    return bool(types & INT_TYPES) and not types & _TENSOR_TYPES


def _slot_name(name: str, slot: int | str) -> str | None:
    """The name torch's schemas give positional argument ``slot`` of ``aten::name``."""
    if not isinstance(slot, int):
        return slot
    for schema in private.operator_schemas(f"aten::{name}"):
        positional = [a for a in schema.arguments if not a.kwarg_only]
        if slot < len(positional) and str(positional[slot].type) in INT_TYPES:
            return str(positional[slot].name)
    return None


def _number_parameter(func: Any, slot: int | str) -> str | None:
    """The name of a torch Python function's parameter at ``slot`` where it is annotated
    as a float (``F.dropout``'s ``p: float``), else None."""
    try:
        parameters = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        return None
    found = parameters[slot] if isinstance(slot, int) and slot < len(parameters) else next(
        (p for p in parameters if p.name == slot), None
    )
    if found is None or found.annotation not in _NUMBER_ANNOTATIONS:
        return None
    return found.name


# tensor forms of Scalar arguments with no rewrite, for the refusal's hint
_TENSOR_FORMS = {
    "full_like": "`torch.zeros_like(x) + t` (or `t.expand_as(x)`)",
    "full": "`torch.zeros(size) + t`",
    "new_full": "`x.new_zeros(size) + t`",
    "fill_": "`x.copy_(t.expand_as(x))` (or `x.fill_(t)` with t a 0-dim tensor of x's dtype)",
    "addmm": "`beta * c + alpha * (a @ b)` with the 0-dim tensors as operands",
    "addmv": "`beta * c + alpha * (a @ v)` with the 0-dim tensors as operands",
    "addbmm": "`beta * c + alpha * (a @ b).sum(0)` with the 0-dim tensors as operands",
    "baddbmm": "`beta * c + alpha * (a @ b)` with the 0-dim tensors as operands",
    "clamp": "`x.clamp(min=t)` with t a tensor of x's dtype (clamp.Tensor)",
    "threshold": "`torch.where(x > t, x, value)`",
}


class UserStepMode(TorchFunctionMode):
    """A mode of the user's step that leaves an optimizer's ``step()`` alone
    (``user_step_modes_paused``): there, NOTE: [tensor hyper-parameters in Scalar
    arguments] and NOTE: [a learning rate read in Python] rule."""

    def __init__(self) -> None:
        super().__init__()
        self.paused = 0

    def __enter__(self) -> UserStepMode:
        _USER_STEP_MODES.append(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        _USER_STEP_MODES.remove(self)
        super().__exit__(*exc)


_USER_STEP_MODES: list[UserStepMode] = []


@contextlib.contextmanager
def user_step_modes_paused() -> Iterator[None]:
    """Inside: the innermost active ``UserStepMode`` of each kind leaves ops alone."""
    paused = list({type(mode): mode for mode in _USER_STEP_MODES}.values())
    for mode in paused:
        mode.paused += 1
    try:
        yield
    finally:
        for mode in paused:
            mode.paused -= 1


class ScalarTensors(ScalarArgumentRewrites, UserStepMode):
    """0-dim tensors the user's step gives to Scalar arguments (NOTE: [0-d tensors in
    Scalar arguments]); ``skipped``: values another rule follows (float arguments'
    stand-ins, NOTE: [float arguments in Scalar arguments])."""

    floating_operands_only = False

    def __init__(self, skipped: Any = lambda value: False) -> None:
        super().__init__()
        self.skipped = skipped

    def _candidate(self, value: Any) -> bool:
        from .packed_sequences import padded_of  # not at the top: an import cycle

        # a packed sequence's padded stand-in is no number, and its dim() would be refused
        # as a read of the packed data (NOTE: [packed sequences at capture])
        return isinstance(value, torch.Tensor) and padded_of(value) is None and value.dim() == 0 and not self.skipped(value)

    def _number(self, value: Any) -> bool:
        return self._candidate(value) and not value.requires_grad and (
            value.is_floating_point() or (not value.is_complex() and value.dtype != torch.bool)
        )

    def _python_kind(self, value: Any) -> type:
        return float if value.is_floating_point() else int

    def _takes_number(self, name: str, slot: int | str) -> bool:
        return _number_slot(name, slot)

    def _refuse(self, name: str, slot: str, refused: str, numbers: list[Any]) -> NoReturn:
        raise SPMDCompileError(
            f"The train step gives a 0-dim tensor to `{name}` as {slot}, a Scalar argument "
            f"that torch reads as a Python number (.item()); eager refuses this call with "
            f"that number and these dtypes ({refused}) (NOTE: [0-d tensors in Scalar arguments]).",
            user_line=innermost_model_frame_of_stack(),
            hint="the step fails in eager too: give the op operands of dtypes it accepts.",
        )

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if self.paused or not any(self._candidate(t) for t in pytree.tree_leaves((args, kwargs))):
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        python_function = inspect.isfunction(func) and getattr(func, "__module__", "") != "torch._tensor"
        if not python_function:
            rewritten = self._scalar_argument_as_operand(
                func, name, args, kwargs, [a for a in args if isinstance(a, torch.Tensor)]
            )
            if rewritten is not _NOT_REWRITTEN:
                return rewritten
        from .traced_items import value_read_errors  # not at the top: an import cycle

        try:
            return func(*args, **kwargs)
        except value_read_errors() as exc:
            if name.startswith("__") or name in ("item", "tolist"):
                raise  # float(t), t.item(): Python reads it, not an op's argument
            for slot, value in [*enumerate(args), *kwargs.items()]:
                if not self._candidate(value):
                    continue
                described = f"argument {slot + 1}" if isinstance(slot, int) else f"{slot}="
                if python_function:
                    parameter = _number_parameter(func, slot)
                    if parameter is None:
                        continue
                    described, name = f"{parameter}=", f"{func.__module__}.{func.__qualname__}"
                elif not _number_slot(name, slot):
                    if not python_function and _int_slot(name, slot) and not value.is_floating_point():
                        raise int_argument_refusal(func, described, _slot_name(name, slot)) from exc
                    continue
                raise _unrewritten(name, described) from exc
            raise


def _unrewritten(name: str, slot: str) -> SPMDCompileError:
    """The refusal of a 0-dim tensor in a Scalar argument no rewrite covers (NOTE: [0-d
    tensors in Scalar arguments])."""
    form = _TENSOR_FORMS.get(name if name == "fill_" else name.removesuffix("_"))
    return SPMDCompileError(
        f"The train step gives a 0-dim tensor to `{name}` as {slot}: torch reads that "
        "argument as a Python number (.item() of the tensor), which a compiled step "
        "cannot do: the program computes the tensor at run time (NOTE: [0-d tensors in "
        "Scalar arguments]; add/sub alpha=, addcmul/addcdiv value= and the foreach ops' "
        "Scalar take one).",
        user_line=innermost_model_frame_of_stack(),
        hint=(f"write it in tensor ops: {form}; or " if form else "compute with the tensor as an operand of "
              "tensor ops where the op has such a form; or ")
        + "pass the value as a float argument of the step (a Python float is a graph input).",
    )
