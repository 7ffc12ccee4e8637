"""Which torch.optim optimizers a compiled step supports, and how their step is traced.

NOTE: [tensor hyper-parameters in Scalar arguments]
The learning rate is a graph input (a 0-dim tensor) so that schedulers never recompile.
Adagrad, RMSprop and Adadelta pass it (or ``-lr``, or Adagrad's decayed ``clr``) as the
``alpha=`` / ``value=`` Scalar argument of ``add_`` / ``addcdiv_`` / ``addcmul_``, and
Rprop as the ``fill_value`` of ``full_like``; a Scalar argument reads a tensor with
``.item()``, which a traced program cannot do. While the optimizer's ``step()`` is traced,
those calls are rewritten into the same arithmetic with the scalar as a tensor operand:

    param.addcdiv_(grad, avg, value=-lr)    ->  param.addcdiv_((-lr).to(dtype) * grad, avg)
    param.add_(delta, alpha=-lr)            ->  param.add_(delta * (-lr).to(dtype))
    torch.full_like(grad, lr)               ->  torch.full_like(grad, 0) + lr.to(dtype)

(``full_like`` is patched on the torch module for the step: its argument parser refuses a
tensor before ``__torch_function__`` runs.)

The eager kernels compute ``self + value * t1 / t2`` (and ``self + alpha * other``) in the
op's compute dtype (the operands' promoted dtype; float32 for 16-bit floats) and round
once, to the result's dtype. The rewrite computes the product in that dtype too: the
scalar *and* the tensor it scales are cast to it before they are multiplied, and the
product stays in it. Multiplying a 16-bit tensor by the 0-dim scalar instead (what the
rewrite first did) rounds the product to 16 bits before the add: every bf16 Adagrad and
RMSprop step then differed from eager on one rank by bf16 rounding (5e-3 relative after
3 steps), and Muon's bf16 orthogonalized update applied to a float32 or float64 weight
was rounded to bf16 (eager adds it at the weight's precision). (Adam and AdamW compute
eager's single-tensor update bit for bit: NOTE: [Adam's update as eager's], NOTE:
[hyper-parameters kept Python numbers].) An
out-of-place op is cast back to the dtype eager's op returns. Calls with Python-number
scalars are left as they are.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode

from .. import _torch_private as private
from ..errors import SourceLocation, SPMDCompileError, innermost_model_frame

# NOTE: [optimizers a compiled step cannot run]
# Optimizers that cannot become one program, and what the user can do instead. LBFGS
# (the second stage of a PINN's Adam-then-LBFGS schedule) runs uncompiled, but not on
# the model a compiled step placed: its closure calls that model with plain tensors,
# which is refused (NOTE: [calling a placed model directly] in ``runtime/eager_calls.py``,
# whose refusal from inside an optimizer's step gives this advice too). Until the
# sixty-seventh session both refusals sent the user to the other ("run the LBFGS step
# uncompiled" / update_bn's compiled form). The way out is the gathered weights in a
# plain model on one device (``tests/sim/test_adam_then_lbfgs.py``: equal to the all-eager
# schedule, float64).
UNSUPPORTED = {
    "LBFGS": (
        "it re-evaluates a closure a data-dependent number of times (line search and "
        "convergence tests read tensor values in Python), which is not one program",
        "use another optimizer (Adam, AdamW, SGD, ...) in the compiled step, or run LBFGS "
        "uncompiled on one device, on a plain model holding the weights the compiled steps "
        "trained (not on the model they placed, whose parameters are DTensors): "
        "`state = sc.checkpoint.full_state_dict(model)` on every rank (it gathers; rank 0 "
        "gets the tensors), then `plain = make_model()` (a new model built as `model` was), "
        "`plain.load_state_dict(state['model'])`, `lbfgs = torch.optim.LBFGS(plain.parameters())`, "
        "`lbfgs.step(closure)` with a closure computing the loss of `plain` (on real ranks, "
        "on rank 0; docs/porting.md, \"Adam then LBFGS\")",
    ),
    "SparseAdam": (
        "it needs sparse gradients (nn.Embedding(sparse=True)), and a compiled step "
        "computes dense gradients",
        "use torch.optim.Adam or AdamW (dense gradients) in the compiled step",
    ),
    "ZeroRedundancyOptimizer": (
        "it shards the optimizer state over the ranks itself and steps an inner optimizer "
        "it builds, which is not an argument of the step",
        "pass the inner optimizer (torch.optim.Adam(model.parameters(), ...)) and compile "
        "with DataParallel('fully_shard') (make_mode('fsdp')), which shards parameters, "
        "gradients and optimizer state",
    ),
}
_OPTIMIZER_PACKAGES = ("torch.optim", "torch.distributed.optim")

_ALPHA_OPS = frozenset({"add", "add_", "sub", "sub_"})
_NOT_HANDLED = object()
_VALUE_OPS = frozenset({"addcdiv", "addcdiv_", "addcmul", "addcmul_"})


def check_supported(optimizers: list[torch.optim.Optimizer], where: str | None) -> None:
    """Refuse optimizers a compiled step cannot run, naming them and what to do."""
    for oi, opt in enumerate(optimizers):
        for cls in type(opt).__mro__:
            reason = UNSUPPORTED.get(cls.__name__)
            if reason is not None and cls.__module__.startswith(_OPTIMIZER_PACKAGES):
                package = next(p for p in reversed(_OPTIMIZER_PACKAGES) if cls.__module__.startswith(p))
                raise SPMDCompileError(
                    f"optimizer[{oi}] is {package}.{cls.__name__}, which a compiled train "
                    f"step cannot run: {reason[0]}.",
                    user_line=where,
                    hint=reason[1] + ".",
                )
        for gi, group in enumerate(opt.param_groups):
            for key, value in group.items():
                # the optimizer's own settings only: a scheduler adds keys its step never
                # reads (``initial_lr``, a clone of a tensor ``lr``; ``max_lr``, ...)
                if key in opt.defaults and key != "lr" and _holds_tensor(value):
                    # before: traced as a tensor from outside the step, refused as one
                    # (`aten.rsub` "neither an argument nor part of a module"), misleading
                    raise SPMDCompileError(
                        f"optimizer[{oi}].param_groups[{gi}][{key!r}] is given as a tensor "
                        f"({type(opt).__name__}(..., {key}=tensor)); a compiled step takes a "
                        "tensor only for the learning rate, other hyper-parameters as "
                        "Python numbers.",
                        user_line=where,
                        hint=f"pass {key} as " + ("floats, e.g. betas=(0.9, 0.999)" if key == "betas"
                                                  else "a Python number") + ": a scheduler "
                        "changing them (OneCycleLR's cycled momentum) does not recompile "
                        "Adam's first beta or SGD's momentum, which are fed to the program "
                        "like the learning rate.",
                    )


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    return isinstance(value, torch.Tensor)


def _compute_dtype(*operands: torch.Tensor) -> tuple[torch.dtype, torch.dtype]:
    """(result dtype, compute dtype) of an element-wise op on ``operands``: their promoted
    dtype (0-dim tensors promote within their category only, as in eager), and the dtype
    eager kernels compute it in (opmath: float32 for 16-bit floats)."""
    probe = operands[0]
    result = probe.dtype
    for t in operands[1:]:
        result = torch.result_type(probe, t)
        probe = torch.empty((1,) if probe.dim() or t.dim() else (), dtype=result, device="meta")
    return result, torch.float32 if result in (torch.float16, torch.bfloat16) else result


@functools.cache
def _cpu_alpha_rounds_to_dtype(dtype: torch.dtype) -> bool:
    """Whether this torch's CPU ``add`` kernel rounds ``alpha`` to a 16-bit tensor dtype
    before it multiplies (torch 2.13's does), read off the kernel: with ``eps`` the dtype's
    epsilon, 1 + 1 * alpha for alpha = eps / 2 * (1 + eps / 4) is 1 + eps when alpha is
    kept in float32, and 1 (a tie, to even) when alpha is rounded to the dtype first."""
    if dtype not in (torch.float16, torch.bfloat16):
        return False
    eps = torch.finfo(dtype).eps
    # first asked inside a trace: the probe must run on real tensors, or its comparison
    # would be an `if` on a traced value (NOTE: [value checks]) kept in the program
    with private.outside_the_trace():
        one = torch.ones(1, dtype=dtype)
        return bool(one.add(one, alpha=eps / 2 * (1 + eps / 4)) == 1)


def _add_with_tensor_alpha(op: Any, self_: torch.Tensor, other: torch.Tensor, alpha: torch.Tensor,
                           rest: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """``op(self_, other, alpha=alpha)`` (``add`` / ``sub``, in place or not) as
    ``addcmul(self_, other, ±alpha)``: the kernel computes ``self + 1 * other * alpha``,
    the fused multiply-add eager's ``add`` does, rounded once (NOTE: [tensor
    hyper-parameters in Scalar arguments])."""
    result, compute = _compute_dtype(self_, other)
    if op.__name__.startswith("sub"):
        alpha = -alpha
    if self_.device.type == "cpu" and _cpu_alpha_rounds_to_dtype(result):
        alpha = alpha.to(result)
    factor, scale = other.to(compute), alpha.to(compute)
    if op.__name__.endswith("_"):
        return self_.addcmul_(factor, scale, *rest, **kwargs)
    return torch.addcmul(self_, factor, scale, *rest, **kwargs).to(result)


def _scaled_operand(op: Any, self_: torch.Tensor, t1: torch.Tensor, t2: torch.Tensor,
                    value: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    """``op(self_, t1, t2, value=value)`` (``addcdiv`` / ``addcmul``) as ``op(self_,
    value * t1, t2)``, the product formed and kept in the op's compute dtype, where the
    eager kernel forms it (``self + value * t1 / t2``, left to right)."""
    result, compute = _compute_dtype(self_, t1, t2)
    out = op(self_, t1.to(compute) * value.to(compute), t2, **kwargs)
    return out if op.__name__.endswith("_") else out.to(result)


# NOTE: [Adam's update as eager's]
# The capture runs torch.optim's capturable path (NOTE: [capture in two traces]): its
# step counter and learning rate are tensors there. Its Adam / AdamW update is written
# for that path as ``param.addcdiv_(exp_avg, denom)`` with ``denom = sqrt(v) /
# (bc2_sqrt * -step_size) + eps / -step_size``: at a learning rate of exactly 0 (every
# transformers warmup schedule starts there; a group held at 0 to freeze it) ``-step_size``
# is -0, and an element whose second moment is 0 (an embedding row no batch used, a
# gradient that is exactly 0) gets 0 / -0 = NaN: the whole model NaN after two steps of a
# GPT-2 fine-tune, silently, where eager leaves the parameters as they are. So the update
# takes torch's other branch, eager's own formula: ``denom = sqrt(v) / bc2_sqrt + eps``,
# ``param.addcdiv_(exp_avg, denom, value=-step_size)`` with the 0-d ``step_size`` a tensor
# (the call rewritten by NOTE: [tensor hyper-parameters in Scalar arguments]; the step
# counter read as a tensor, ``_get_value`` under the patched ``is_compiling``). The state
# is still made by the capturable path's ``_init_group`` (``capturable`` in the group);
# only ``_single_tensor_adam`` is told otherwise (``_torch_private.adam_update_as_eager``),
# unless the group is differentiable. Eager's formula is also eager's rounding.


# NOTE: [SGD's momentum as a graph input]
# ``OneCycleLR`` / ``CyclicLR`` with SGD (torch's own OneCycleLR example) set a new
# ``momentum`` every step; as a setting of the program, each value compiled a program on
# every call. torch's SGD reads momentum in Python (``if momentum != 0``), so it cannot be
# handed a tensor as Adam is its first beta (NOTE: [Adam's beta1 as a graph input]).
# Instead, while the traced ``step()`` of a ``torch.optim.SGD`` runs, its group holds a
# ``CycledValue``: a float equal to the momentum (``!= 0`` and truth answer in Python,
# which the program key already fixes: momentum is an input only while it is not 0) that
# carries the 0-dim float64 graph input. ``_TensorScalars`` feeds the tensor wherever the
# value reaches a torch op: ``buf.mul_(momentum)`` (in the op's compute dtype, as eager's
# kernel multiplies by a Python float) and Nesterov's ``alpha=momentum`` (NOTE: [tensor
# hyper-parameters in Scalar arguments]). Any other use, inside the step or out of it,
# would bake the value silently, so it is not allowed to happen: Python arithmetic,
# ordering or ``float()`` on the value, another op taking it, or a read of the group's
# momentum outside ``step()`` (the user's step logging it; a ``MomentumGroup``
# records reads) raise ``CycledValueUsed``, and the step is captured again with the
# momentum of that optimizer a setting of the program, as before (``bindings.
# keep_momentum_a_setting``): a program per value, never a stale one.


# NOTE: [a learning rate read in Python]
# The learning rate is a graph input (NOTE: [tensor hyper-parameters in Scalar
# arguments]): while the step is traced, each group's ``lr`` is a 0-dim tensor. torch's
# optimizers compute with it in tensor ops only; a custom one may do Python arithmetic
# on it (``step_size = math.sqrt(group["lr"]) * 0.3``, a warmup ``min(1.0, ...)``), which
# reads the tensor's value and was refused as "reads the value of a tensor in Python",
# although the user's code read a float. As SGD's momentum does (NOTE: [SGD's momentum as
# a graph input]), such an optimizer's learning rates then become settings of its
# programs: the step is captured again with each group's ``lr`` the Python number eager
# reads (``CycledValueUsed`` with key ``lr``, ``bindings.keep_lr_a_setting``), and the
# program key holds the value: a program per value, never a stale one (a scheduler
# changing it recompiles at each new value). Only where every group's ``lr`` is a Python
# number: a tensor the user gave stays a tensor, and its read stays refused. A step that
# still reads a tensor in Python with the learning rates numbers is refused as before,
# the read being elsewhere. torch's foreach ops taking a Scalar (``torch._foreach_add_(
# params, updates, alpha=-group["lr"])``) read a tensor given there too; those with a
# rule here compute per tensor with the learning rate a graph input instead (the
# arithmetic of their per-tensor ops, NOTE: [tensor hyper-parameters in Scalar
# arguments]): no program per value. An op whose argument parser takes a Number only
# (``torch._foreach_lerp_(exp_avgs, grads, group["lr"])``) raises a TypeError before
# any rule sees it; such an error inside the step makes the learning rates settings too
# (a TypeError of the optimizer's own survives that capture and is raised as before).
# A scheduler the step steps before the optimizer's step is refused then
# (``_refuse_schedules_of_settings`` in trace.py): recorded, not run, at capture, it
# would leave the program the value from before its step (a review: 0.157 off).
# The line that read it is kept (``bindings.lr_read_in_python``): the warning of a
# learning rate recompiling at every value said "only the learning rate ... is a graph
# input", the opposite (a probe, sixty-eighth session); it now says the step reads it as
# a Python number, names the line, and gives the form that stays an input (``lr ** 0.5``
# for ``math.sqrt(lr)``: Python operators on the tensor, then ``alpha=``: one program
# through a LambdaLR, float64 within 1.2e-16 of eager).


class CycledValueUsed(BaseException):
    """A cycled hyper-parameter (``key``) was used other than as a graph input: capture
    again with it a setting of the program (NOTE: [SGD's momentum as a graph input],
    NOTE: [a learning rate read in Python]). Not an ``Exception``: the capture's handlers
    of the step's own errors let it through."""

    def __init__(self, optimizer: int, how: str, key: str = "momentum", where: SourceLocation | None = None) -> None:
        super().__init__(f"optimizer[{optimizer}]'s {key} {how}")
        self.optimizer = optimizer
        self.key = key
        self.where = where  # the line that read it, where known


class CycledValue(float):
    """A hyper-parameter fed to the program as ``tensor`` (NOTE: [SGD's momentum as a
    graph input]): a float whose only Python uses are ``!= 0``, ``== 0`` and truth."""

    tensor: torch.Tensor
    optimizer: int

    def __new__(cls, value: float, tensor: torch.Tensor, optimizer: int) -> CycledValue:
        made = super().__new__(cls, value)
        made.tensor, made.optimizer = tensor, optimizer
        return made

    def _used(self, *args: Any) -> Any:
        raise CycledValueUsed(self.optimizer, "was computed with in Python")

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _used
    __truediv__ = __rtruediv__ = __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = _used
    __pow__ = __rpow__ = __neg__ = __pos__ = __abs__ = __float__ = __int__ = __round__ = _used
    __lt__ = __le__ = __gt__ = __ge__ = __trunc__ = __floor__ = __ceil__ = _used


class MomentumGroup(dict):
    """A traced param group whose ``momentum`` is a graph input: the ``CycledValue`` while
    the optimizer's ``step()`` runs (``opened``); a read at any other time raises
    ``CycledValueUsed`` (NOTE: [SGD's momentum as a graph input])."""

    def __init__(self, entries: dict[str, Any], value: CycledValue) -> None:
        super().__init__(entries)
        self.value, self.open = value, False

    @contextlib.contextmanager
    def opened(self) -> Iterator[None]:
        self.open = True
        try:
            yield
        finally:
            self.open = False

    def __getitem__(self, key: Any) -> Any:
        if key != "momentum":
            return super().__getitem__(key)
        if not self.open:
            raise CycledValueUsed(self.value.optimizer, "was read outside its step()")
        return self.value

    def get(self, key: Any, default: Any = None) -> Any:
        return self[key] if key in self else default

    def __iter__(self) -> Iterator[Any]:  # dict(g), {**g}: through __getitem__
        return iter(list(self.keys()))

    def items(self) -> Any:
        return [(k, self[k]) for k in self.keys()]

    def values(self) -> Any:
        return [self[k] for k in self.keys()]

    def copy(self) -> dict[str, Any]:
        return dict(self.items())


def _cycled_values_fed(func: Any, name: str, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """``args`` / ``kwargs`` with each ``CycledValue`` replaced by its tensor, where the op
    is one whose use of it is known: ``mul`` / ``mul_``'s factor, ``add`` / ``sub``'s alpha."""
    for position, a in [*enumerate(args), *kwargs.items()]:
        if isinstance(a, CycledValue) and not (
            (name in ("mul", "mul_") and position == 1) or (name in _ALPHA_OPS and position == "alpha")
        ):
            raise CycledValueUsed(a.optimizer, f"was given to {name}")
    fed = tuple(a.tensor if isinstance(a, CycledValue) else a for a in args)
    return fed, {k: v.tensor if isinstance(v, CycledValue) else v for k, v in kwargs.items()}


def _scaled(op: Any, self_: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``op(self_, factor)`` (``mul`` / ``mul_``) for a float64 0-dim ``factor`` standing
    for a Python float: multiplied in the op's compute dtype (a 16-bit tensor's float32,
    where eager's kernel keeps the float) and rounded once to ``self_``'s dtype."""
    _, compute = _compute_dtype(self_)
    if compute == self_.dtype:
        return op(self_, factor.to(compute))
    product = self_.to(compute) * factor.to(compute)
    return self_.copy_(product) if op.__name__.endswith("_") else product.to(self_.dtype)


# NOTE: [hyper-parameters kept Python numbers]
# Eager's optimizer holds the learning rate and Adam's first beta as Python floats; a
# program holds them as float64 0-dim graph inputs (NOTE: [Adam's beta1 as a graph
# input]). torch's Adam casts a tensor beta1 to the weights' dtype before ``exp_avg.lerp_
# (grad, 1 - beta1)`` (``beta1.to(device=, dtype=param.dtype)``, a workaround for CUDA
# graphs), where eager subtracts in double and its lerp kernel computes with the weight
# in the op's compute dtype (float32 for 16-bit weights). bf16 rounds 0.9 to 0.8984375:
# ``1 - beta1`` was 0.1015625, every bf16 ``exp_avg`` 1.6% too large (compiled 1.15e-2
# off exact float64 Adam after 3 steps, eager 1.79e-3; the weights 2.0e-2 off eager),
# silently; float32 weights were 3.6e-7 off eager after 3 steps. While the step is
# traced those inputs, and 0-dim values computed from them alone (``1 - beta1``), are
# numbers: a cast of one to a floating dtype keeps it float64 (a Python float has no
# dtype of its own), and ``lerp`` / ``lerp_`` with one as the weight computes in the op's
# compute dtype, weight included, and rounds once to the result's dtype, as eager's
# kernel does with a Python weight (``torch.lerp`` on float32 operands is the 16-bit
# kernel's own arithmetic: bf16 and fp16 Adam and AdamW on one rank are now bit-exact
# with eager's single-tensor update, ``test_one_rank_is_bit_exact``). Other ops see the
# float64 tensor as before (a 0-dim operand does not promote a tensor with dimensions,
# and the CPU kernels read it in the op's compute dtype).


def _cast_dtype(args: tuple, kwargs: dict[str, Any]) -> Any:
    """The dtype ``Tensor.to(*args, **kwargs)`` casts to, where it names one."""
    dtype = kwargs.get("dtype")
    for a in args[1:]:
        if isinstance(a, torch.dtype):
            dtype = a
    return dtype


def _lerp_in_compute_dtype(op: Any, self_: torch.Tensor, end: torch.Tensor, weight: torch.Tensor,
                           kwargs: dict[str, Any]) -> torch.Tensor:
    """``op(self_, end, weight)`` (``lerp`` / ``lerp_``) for a float64 0-dim ``weight``
    standing for a Python float: computed in the op's compute dtype and rounded once to
    the result's dtype (NOTE: [hyper-parameters kept Python numbers])."""
    result, compute = _compute_dtype(self_, end)
    if compute == self_.dtype and result == self_.dtype:
        return op(self_, end, weight.to(compute), **kwargs)
    out = torch.lerp(self_.to(compute), end.to(compute), weight.to(compute))
    return self_.copy_(out) if op.__name__.endswith("_") else out.to(result)


_FOREACH_ALPHA_OPS = ("_foreach_add", "_foreach_add_", "_foreach_sub", "_foreach_sub_")
_FOREACH_VALUE_OPS = ("_foreach_addcdiv", "_foreach_addcdiv_", "_foreach_addcmul", "_foreach_addcmul_")
_FOREACH_LERP_OPS = ("_foreach_lerp", "_foreach_lerp_")


def _foreach_accepting_tensors(
    name: str, original: Callable[..., Any], scalars: _TensorScalars
) -> Callable[..., Any]:
    """``torch.<name>`` (a foreach op) whose Scalar argument may be a 0-dim tensor
    (``torch._foreach_add_(params, updates, alpha=-group["lr"])``): computed as its
    per-tensor ops, which ``_TensorScalars`` rewrites (NOTE: [a learning rate read in
    Python]); the argument parser refuses a traced tensor there before any
    ``__torch_function__`` could see it, and the per-tensor ops' parser refuses one that
    requires grad (a group's ``lr`` in the first trace, NOTE: [capture in two traces]),
    so it is given detached (a number of ``scalars`` stays one). The foreach kernels
    compute each tensor's per-tensor arithmetic. Any other call: the op as it is."""
    in_place = name.endswith("_")
    base = name.removeprefix("_foreach_").removesuffix("_")
    per_tensor = getattr(torch.Tensor, base + "_") if in_place else getattr(torch, base)

    def call(*args: Any, **kwargs: Any) -> Any:
        lists = [a for a in args if isinstance(a, (list, tuple))]
        if name in _FOREACH_ALPHA_OPS:
            key, scalar, n = "alpha", kwargs.get("alpha"), 2
        elif name in _FOREACH_VALUE_OPS:
            key, scalar, n = "value", kwargs.get("value", args[3] if len(args) == 4 else None), 3
        else:
            key, scalar, n = "weight", kwargs.get("weight", args[2] if len(args) == 3 else None), 2
        if not (isinstance(scalar, torch.Tensor) and scalar.dim() == 0) or len(lists) != n \
                or set(kwargs) - {key} or len(args) not in (n, n + 1):
            return original(*args, **kwargs)
        if scalar.requires_grad:
            detached = scalar.detach()
            if scalars._number(scalar):
                scalars.numbers[id(detached)] = detached
            scalar = detached
        outs = [per_tensor(*tensors, **{key: scalar}) for tensors in zip(*args[:n], strict=True)]
        return None if in_place else outs

    return call


class _TensorScalars(TorchFunctionMode):
    """Rewrites Scalar arguments given as tensors (NOTE: [tensor hyper-parameters in
    Scalar arguments]); ``numbers``: the graph inputs that stand for Python floats
    (NOTE: [hyper-parameters kept Python numbers])."""

    def __init__(self, numbers: tuple[torch.Tensor, ...] = ()) -> None:
        super().__init__()
        self.numbers = {id(t): t for t in numbers}

    def _number(self, value: Any) -> bool:
        return isinstance(value, torch.Tensor) and id(value) in self.numbers

    def _numbers_kept(self, func: Any, name: str, args: tuple, kwargs: dict[str, Any]) -> Any:
        """The result of an op on numbers (NOTE: [hyper-parameters kept Python
        numbers]), or ``_NOT_HANDLED``."""
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if not any(self._number(t) for t in tensors):
            return _NOT_HANDLED
        if name in ("lerp", "lerp_") and len(args) == 3 and self._number(args[2]) and not self._number(args[0]):
            return _lerp_in_compute_dtype(func, args[0], args[1], args[2], kwargs)
        if not all(self._number(t) for t in tensors):
            return _NOT_HANDLED
        if name == "to":
            dtype = _cast_dtype(args, kwargs)
            if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                return _NOT_HANDLED
            kwargs = {k: v for k, v in kwargs.items() if k != "dtype"}
            args = tuple(a for a in args if not isinstance(a, torch.dtype))
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.dim() == 0 and out.dtype == torch.float64:
            self.numbers[id(out)] = out
        return out

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        if self.numbers:
            kept = self._numbers_kept(func, name, args, kwargs)
            if kept is not _NOT_HANDLED:
                return kept
        if any(isinstance(a, CycledValue) for a in (*args, *kwargs.values())):
            args, kwargs = _cycled_values_fed(func, name, args, kwargs)
            if name in ("mul", "mul_"):
                return _scaled(func, args[0], args[1])
        if name in _ALPHA_OPS and isinstance(kwargs.get("alpha"), torch.Tensor):
            alpha = kwargs.pop("alpha")
            return _add_with_tensor_alpha(func, args[0], args[1], alpha, tuple(args[2:]), kwargs)
        if name in _VALUE_OPS and isinstance(kwargs.get("value"), torch.Tensor):
            value = kwargs.pop("value")
            return _scaled_operand(func, args[0], args[1], args[2], value, kwargs)
        return func(*args, **kwargs)


def _full_like_accepting_tensors(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``torch.full_like`` whose fill value may be a 0-dim tensor (Rprop's initial step
    size is ``full_like(grad, lr)``; the argument parser refuses a tensor that requires
    grad before any ``__torch_function__`` could see it)."""

    def full_like(input: torch.Tensor, fill_value: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if isinstance(fill_value, torch.Tensor):
            out = original(input, 0, *args, **kwargs)
            return out + fill_value.detach().to(out.dtype)  # copy_ has no DTensor rule
        return original(input, fill_value, *args, **kwargs)

    return full_like


@contextlib.contextmanager
def _adafactor_in_tensor_ops(opt: torch.optim.Optimizer) -> Iterator[None]:
    """For a ``torch.optim.Adafactor``: its update traced with tensor scalars (NOTE:
    [Adafactor in tensor ops] in ``adafactor.py``), where this torch's update is the one
    mirrored; anything else as it is."""
    from . import adafactor

    adafactor_class = getattr(torch.optim, "Adafactor", None)
    if adafactor_class is None or not isinstance(opt, adafactor_class) or not adafactor.mirrors(
        private.adafactor_single_tensor_step()
    ):
        yield
        return
    with private.adafactor_single_tensor_step_replaced(adafactor.single_tensor_adafactor):
        yield


@contextlib.contextmanager
def tracing_optimizer_step(opt: torch.optim.Optimizer, oi: int, where: Callable[[BaseException], Any],
                           numbers: tuple[torch.Tensor, ...] = (), lr_setting: bool = False) -> Iterator[None]:
    """Context for tracing ``opt.step()``: tensor Scalars rewritten, the graph inputs
    ``numbers`` computed with as eager computes with Python floats (NOTE: [hyper-parameters
    kept Python numbers]), and a Python read of a tensor's value inside the optimizer
    refused with the optimizer's name; with ``lr_setting`` (its learning rates are
    inputs that may become settings) such a read captures the step again with them
    settings first (NOTE: [a learning rate read in Python])."""
    from .traced_items import value_read_errors
    from .value_checks import Undecided

    scalars = _TensorScalars(numbers)
    try:
        with scalars, mock.patch.object(
            torch, "full_like", _full_like_accepting_tensors(torch.full_like)
        ), _adafactor_in_tensor_ops(opt), private.adam_update_as_eager(), contextlib.ExitStack() as foreach:
            for name in (*_FOREACH_ALPHA_OPS, *_FOREACH_VALUE_OPS, *_FOREACH_LERP_OPS):
                if hasattr(torch, name):
                    foreach.enter_context(
                        mock.patch.object(torch, name, _foreach_accepting_tensors(name, getattr(torch, name), scalars))
                    )
            yield
    except Undecided as exc:  # NOTE: [value checks]: named if it is refused
        exc.owner = f"optimizer[{oi}] ({type(opt).__module__}.{type(opt).__name__}) in its step()"
        raise
    except TypeError as exc:
        if lr_setting:  # NOTE: [a learning rate read in Python]: a tensor given for a Number
            raise CycledValueUsed(oi, f"was refused by an op inside its step() ({exc})", key="lr",
                                  where=innermost_model_frame(exc.__traceback__)) from exc
        raise
    except value_read_errors() as exc:
        if lr_setting:  # NOTE: [a learning rate read in Python]
            raise CycledValueUsed(oi, "was read in Python inside its step()", key="lr",
                                  where=innermost_model_frame(exc.__traceback__)) from exc
        raise SPMDCompileError(
            f"optimizer[{oi}] ({type(opt).__module__}.{type(opt).__name__}) reads the value "
            "of a tensor in Python inside its step() (.item() or control flow on a tensor), "
            "which cannot be captured into one program.",
            user_line=where(exc),
            hint="use another torch.optim optimizer (all but LBFGS and SparseAdam compile), "
            "or make this optimizer's step use tensor ops only (its capturable path).",
        ) from exc
