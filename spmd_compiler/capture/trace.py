"""Capture a whole train step (forward, loss, backward, optimizer) as one functional graph.

NOTE: [capture in two traces]
1. ``make_fx`` on fake tensors traces the user's step with the module's parameters and
   buffers swapped for the traced inputs and the optimizer pointed at traced parameters,
   state and learning rates. ``backward()`` turns into explicit ATen ops; the optimizer
   runs its capturable path (no ``.item()``), single-tensor (``foreach=False``) so that
   every update is plain ATen ops, with the learning rate as a tensor input. The traced
   function returns every piece of state after the step (parameters, buffers, grads that
   survive the step, optimizer state including state created on the first step).
2. ``functionalize`` cannot wrap ``backward()``, so the first graph (which holds no autograd
   anymore, only in-place updates) is re-traced under ``functionalize`` on inputs that do
   not require grad. The copy-back epilogue into mutated placeholders is dropped: new state
   leaves the graph as outputs and the runtime installs it.
The learning rate tensor requires grad during the first trace only so that SGD takes its
tensor-lr path (``addcmul``) instead of reading ``lr`` as a Python number.

NOTE: [steps without an optimizer]
A step needs a module, not an optimizer: an evaluation step (forward under ``no_grad``,
metrics returned) or a step that only accumulates gradients into ``.grad`` is captured,
placed and expanded like a train step, with the model's state placed by the same mode,
so it runs on a model a compiled train step left as DTensors (and the other way round).
Its returned tensors are global values, as a train step's loss is. An optimizer that is
not an argument but steps inside the step (a global or a closure variable) is refused:
traced, it would update the real parameters once at capture, not the program's state
every call; except one the step makes over tensors the call makes (NOTE: [optimizers
over tensors made in the call] in ``call_optimizers.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NoReturn, cast
from unittest import mock

import torch
import torch.fx
from torch.fx import traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import make_fx
from torch.overrides import TorchFunctionMode

from .. import _torch_private as private
from .._torch_private import pytree
from ..errors import (
    SourceLocation,
    SPMDCompileError,
    exception_summary,
    innermost_model_frame,
    innermost_model_frame_of_stack,
    installed_package_of,
    node_error,
    step_frame_from_traceback,
    step_line_from_stack_trace,
)
from ..ir.graph_utils import (
    RetracingInterpreter,
    last_node,
    new_nodes_after,
    output_args,
    placeholders,
    remove_profiler_and_detach,
    replace_with_input,
    set_outputs,
)
from ..ir.node_meta import (
    MODULE_FQN,
    RNN_HIDDEN,
    TIME_MAJOR_INPUT,
    TIME_MAJOR_RNN,
    USER_LINE,
    Phase,
    set_phase,
    set_traced_by_autograd,
)
from ..ir.signature import (
    STATE_KINDS,
    CapturedStep,
    Kind,
    StateRef,
    TensorMeta,
    ValueCheck,
    state_dtype,
)
from . import initial_state, selected_rows
from .argument_flags import RequiresGradCalls
from .attention import attention_as_math
from .batch_norm import cumulative_batch_norms
from .bindings import (
    BETA1,
    MOMENTUM,
    StepBindings,
    argument_paths,
    beta1_is_input,
    check_plain_modules,
    group_tensor_keys,
    keep_lr_a_setting,
    keep_momentum_a_setting,
    lr_is_input,
    lr_may_become_a_setting,
    momentum_is_input,
    tensor_argument_names,
)
from .call_optimizers import OptimizerNotPassed, OtherOptimizers
from .code_names import return_line, step_code, step_name, step_where
from .containers import (
    Closed,
    close_containers,
    distribution_object,
    holds_containers,
    open_containers,
    traced_inside,
)
from .diagonals import diagonal_scatter_by_mask
from .dtype_agreement import refuse_mixed_dtype_operands
from .functional_rewrite import functional_by_rewriting
from .functions_as_ops import functions_as_ops
from .grad_scalers import (
    SCALER_HINT,
    loss_scaling_decompositions,
    traced_scalers,
    unbound_scaler_error,
)
from .gradients import mark_gradients
from .group_writes import LR_WRITE_HINT, GroupWritesSeen, MomentumGroupWritesSeen, written_at
from .guards import set_or_delete
from .held_parameters import HeldParameterUses
from .hooks_as_found import HooksAsFound, HookState
from .int_arguments import torch_function_name
from .kept_tensors import KeptTensor, KeptTensors, refuse_kept_read_back
from .lr_schedulers import (
    LRReadAfterSchedulerStep,
    SchedulerStep,
    SchedulerSteps,
    learning_rate_of,
    note_optimizer_step,
    refuse_step_after_its_scheduler,
)
from .mask_selections import (
    RowsOfAModelMaskCounted,
    counted_in_capture,
    forget_settled,
    mask_selection_decompositions,
    mask_selections,
    model_mask_hint,
    settled_in_capture,
)
from .ops_named_in_place import named_in_place_decompositions, refuse_ops_named_in_place
from .optimizer_advice import TENSOR_COUNT_OPTIMIZERS, group_counters_hint, library_counter_hint
from .optimizers import CycledValue, CycledValueUsed, MomentumGroup, tracing_optimizer_step
from .optimizers import check_supported as check_supported_optimizers
from .outside_tensors import (
    FoundTensor,
    OutsideWrites,
    outside_constants,
    written_through_shared_memory,
)
from .parameter_copies import parameters_copied_as_eager
from .python_effects import (
    OWN_GENERATOR,
    OWN_GENERATOR_HINT,
    is_own_generator_failure,
    python_effects,
    refuse_explicit_generators,
    user_caches_called_through,
)
from .python_scalars import (
    FloatArgumentMode,
    FloatArgumentUsedInPython,
    GroupNumbers,
)
from .python_valued_shapes import python_valued_shape_decompositions
from .random_draws import draw_lines_recorded, global_draw_decompositions, refuse_shard_local_draws
from .registered_state import RegistrationsWatched, refuse_state_registered
from .removed_state import settle_removed_state
from .replayed_draws import generators_counted_in_draws, replayed_draw_decompositions
from .scalar_arguments import ScalarTensors, user_step_modes_paused
from .strided_windows import names_its_elements_in_order
from .tensor_indices import TensorIndicesTaken
from .traced_items import (
    ITEM_HINT,
    KERNEL_READ_VALUES,
    ItemsAsOutputs,
    ItemUsedInPython,
    KernelReadValues,
    TracedItem,
    caught_item_uses,
    checks_on_items,
    drop_unneeded_snapshots,
    value_read_errors,
)
from .transformer_fast_path import transformer_encoders_as_eager
from .value_checks import (
    MAX_BRANCH_PROGRAMS,
    MAX_COIN_BRANCHES,
    MAX_VALUE_CHECKS,
    REFUSED_ITEM,
    REFUSED_READ,
    UNTRACED,
    BranchDecisions,
    Undecided,
    WayRaised,
    choose,
    read_runs_into_raise,
    signals_told_apart,
    stop_text,
)
from .written_state import copy_state_values

log = logging.getLogger("spmd_compiler")

HYPERPARAM_DTYPE = torch.float64
SCHEDULER_HINT = (
    "call scheduler.step(), or set param_group['lr'] (a hand-written warmup), outside "
    "the compiled train step, before calling it; the learning rate is read as a graph "
    "input on every call, so no recompile follows."
)

# NOTE: [float64 step counters]
# Eager optimizers read the step counter with ``.item()`` and compute Adam's bias
# corrections (1 - beta ** step) in double precision. The capturable path computes them
# with tensors of the step's dtype; in float32, 1 - 0.999 ** 1 is off by 1.3e-5 relative,
# which shows up as a 7e-6 relative parameter error after one step. So scalar optimizer
# state (step counters) is kept in float64: state created in the graph is made float64,
# and existing float32 counters are converted when the runtime installs the state.


# NOTE: [ops decomposed at capture]
# Element-wise losses (mse, smooth L1, Huber, BCE, soft margin) and their backwards are
# decomposed into plain ops: DTensor's rule for ``mse_loss_backward`` with reduction
# "mean" on a batch-sharded input divides by the *local* element count (gradients N
# times too large on N ranks, found by the parity tests). Decomposed at capture, the
# global element count is a constant of the single-device graph and stays right.
# CPU dropout is ``x * empty_like(x).bernoulli_(1 - p) / (1 - p)``; see
# random_draws._bernoulli_with_probability for how its random draw is traced.
# ``aten.native_batch_norm`` updates running_mean/var in place but its schema does not say
# so, which functionalization then misses (the update would silently hit the inputs). It
# and its backward are decomposed into plain ATen ops during the first trace; the running
# statistics then leave the graph as buffer outputs like any other new state, and the
# batch statistics become reductions that DTensor reduces across ranks.
# ``embedding_dense_backward`` with ``scale_grad_by_freq`` counts indices per rank; see
# _embedding_backward_global_counts; ``max_norm``'s in-place renormalization of the rows
# the batch uses: _embedding_renorm_over_global_batch. ``any`` / ``all`` become counts:
# _reduce_by_count.
# ``native_group_norm`` and its backward take the batch size, channels and spatial size
# as integers read off the global shape; DTensor localizes them in the forward's rule
# only (torch 2.13; 2.11 and 2.12 have no rule), and derives the backward's rule from
# its decomposition, running the local kernel with the global sizes. Decomposed, the
# sizes become reshapes of the global shape, which DTensor localizes. The forward is
# torch's reference formula (its CPU branch reads the sizes through ``as_strided``, which
# DTensor refuses).
# A reduction with an empty ``dim`` list names every dimension (_empty_dims_as_all); a
# scan's negative ``dim`` is counted from the front (_scan_with_nonnegative_dim), so is
# ``select_backward``'s and ``slice_backward``'s (_backward_with_nonnegative_dim);
# ``argmax`` / ``argmin`` become the first index of the ``amax`` / ``amin``
# (_first_index_of).
# An ``as_strided`` that only names its input's elements in their order becomes a view
# (_as_strided_as_view: a global average pool of a channels-last input writes one).
# ``nll_loss_forward`` / ``nll_loss2d_forward`` with reduction "mean" becomes the "sum"
# reduction divided by the total weight: DTensor's rule averages the per-rank means,
# which is not the global mean when ranks hold different numbers of non-ignored targets
# (ignore_index, class weights).
# NOTE: [ops without a sharding rule]
# An ATen op DTensor has no sharding rule for (nor a handler of its own) is decomposed at
# capture with torch's own decomposition where torch has one (``reflection_pad2d``,
# ``im2col``, ``hardswish_backward``, ``log_sigmoid_forward``, ...; ``_trilinear``, of
# ``nn.Bilinear``, has none and becomes an ``einsum`` of ours):
# its parts are ops DTensor has rules for, so the op is expanded instead of refused.
# Ops with a rule are traced as they are; an op with neither a rule nor a decomposition
# is refused at expansion with the op and the user's line named. Decompositions are
# applied below autograd, so a forward op's backward op is decomposed the same way where
# it has no rule. Numerics: the parts round like torch's reference implementation, not
# like the fused kernel (float64 tests agree with eager within 1e-15 relative).
# NOTE: [inference mode in the step]
# ``torch.inference_mode()`` inside the step is traced as it runs eagerly: its tensors are
# inference tensors on the fakes too, so using one where autograd saves it ("Inference
# tensors cannot be saved for backward") or writing one in place outside the region
# fails at capture with eager's message, and the values are the ones ``no_grad`` traces.
# What differs is dispatch: inference mode turns autograd's keys off, so an op autograd
# decomposes with its own C++ kernel (CompositeImplicitAutograd: ``nll_loss``,
# ``var.dim``, ``upsample_bilinear2d.vec``, ``fft_rfft``, ``prelu``, ...) reaches
# make_fx as itself, which looks it up in the decomposition table before running that
# kernel. torch's table holds Python references for some of these whose signatures are
# the ``torch.nn.functional`` ones, not the op's: ``aten.nll_loss(self, target, weight,
# reduction, ignore_index)`` called ``nll_loss(input, target, weight, size_average,
# ignore_index, ...)``, the int reduction read as ``size_average``. Cross-entropy's
# "sum" returned the mean (1.4585 for eager's 5.8339), "none" the sum as a 0-d tensor,
# ``ignore_index=0`` half the sum (1.334 for 2.668), ``ignore_index=-100`` failed at run
# time indexing with -100, every world size, ddp and fsdp; ``var(x, 0)`` and ``rfft``
# were refused (a prim without a sharding rule), ``hinge_embedding_loss`` failed at
# capture. decompositions_without_sharding_rules leaves these ops out: under inference
# mode make_fx runs their own kernel, as autograd does otherwise, and the trace is the
# one ``no_grad`` gives (tests/sim/test_inference_mode_in_the_step.py). Our own entries
# keyed on such ops (``where.Scalar``) take the op's schema and are correct either way.
def _zeros_for_zero_tensor(size, *, dtype=None, layout=None, device=None, pin_memory=None):  # noqa: ANN001, ANN202
    return torch.zeros(size, dtype=dtype, layout=layout, device=device, pin_memory=pin_memory)


# namespaces whose ops writing an argument the capture handles (torch's own)
_TORCH_NAMESPACES = frozenset({"aten", "prims", "_c10d_functional", "c10d", "_c10d_functional_autograd"})


def _refuse_custom_ops_writing_arguments(gm: torch.fx.GraphModule) -> None:
    """A user's ``torch.library.custom_op`` with ``mutates_args`` writes its arguments in
    place, which the program's functional form cannot express (torch's functionalization
    raised its own RuntimeError about "alias annotations", for an op returning nothing).
    Refused naming the op and the line, with the functional form that compiles."""
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or not private.is_op_overload(target):
            continue
        if target.namespace in _TORCH_NAMESPACES:
            continue
        written = [a.name for a in target._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        if written:
            raise node_error(
                f"The custom operator {target.name()} writes its argument(s) "
                f"{', '.join(written)} in place (mutates_args); the compiled program is "
                "functional and cannot express an operator's own writes.",
                node,
                hint="make the operator return the new value (mutates_args=()) and write "
                "it in Python in the step: `buf.copy_(op(x, buf))` under torch.no_grad() "
                "for a buffer.",
            )


def capture_decompositions() -> dict:
    aten = torch.ops.aten
    table = dict(private.decompositions_without_sharding_rules())
    table |= private.decompositions([
        aten.mse_loss.default,
        aten.mse_loss_backward.default,
        aten.smooth_l1_loss.default,
        aten.smooth_l1_loss_backward.default,
        aten.huber_loss.default,
        aten.huber_loss_backward.default,
        aten.binary_cross_entropy.default,
        aten.binary_cross_entropy_backward.default,
        aten.soft_margin_loss.default,
        aten.soft_margin_loss_backward.default,
        aten.native_batch_norm.default,
        aten._native_batch_norm_legit.default,
        aten._native_batch_norm_legit_functional.default,
        aten._native_batch_norm_legit_no_training.default,
        aten.native_batch_norm_backward.default,
        aten.native_group_norm.default,
        aten.native_group_norm_backward.default,
    ])
    table[aten.native_group_norm.default] = _group_norm_by_reshapes
    if aten.diagonal_scatter.default in table:  # no rule on this torch (2.11)
        table[aten.diagonal_scatter.default] = diagonal_scatter_by_mask  # NOTE: [diagonals at capture]
    for where in (aten.where.Scalar, aten.where.ScalarSelf, aten.where.ScalarOther):
        table[where] = _where_with_scalars
    # autograd's zero gradients in a second derivative (``torch.func.hessian``): a
    # ZeroTensor has no DTensor rule and its meta kernel makes a real meta tensor, which
    # expansion's fake mode refused; plain zeros hold the same values
    table[aten._efficientzerotensor.default] = _zeros_for_zero_tensor
    table |= loss_scaling_decompositions()  # NOTE: [loss scaling in the program]
    table |= global_draw_decompositions()  # NOTE: [random draws shaped like a tensor]
    table |= replayed_draw_decompositions()  # NOTE: [draws replayed by a restored generator]
    table |= mask_selection_decompositions()  # NOTE: [selections by a mask of the batch]
    table |= python_valued_shape_decompositions()  # NOTE: [value-dependent shapes of Python values]
    table |= named_in_place_decompositions()  # NOTE: [ops named like in-place ones]
    # the conditions of value checks (NOTE: [value checks]): ops with a DTensor rule
    table[aten._is_all_true.default] = lambda t: torch.all(t)
    table[aten._is_any_true.default] = lambda t: torch.any(t)
    for op in (aten.nll_loss_forward.default, aten.nll_loss2d_forward.default):
        table[op] = functools.partial(_nll_loss_forward_global_mean, op)
    table[aten.mse_loss_backward.default] = functools.partial(
        _mse_loss_backward_allow_empty, table[aten.mse_loss_backward.default]
    )
    table[aten.embedding_dense_backward.default] = _embedding_backward_global_counts
    table[aten.embedding.default] = _embedding_of_one_index
    table[aten.embedding_renorm_.default] = _embedding_renorm_over_global_batch
    for op in (aten.any.default, aten.any.dim, aten.any.dims):
        table[op] = functools.partial(_reduce_by_count, True)
    for op in (aten.all.default, aten.all.dim, aten.all.dims):
        table[op] = functools.partial(_reduce_by_count, False)
    table[aten.as_strided.default] = _as_strided_as_view
    for op, at in _REDUCTIONS_OVER_DIMS:
        table[op] = functools.partial(_empty_dims_as_all, op, at)
    for op in (aten.cumsum.default, aten.cumprod.default, aten.logcumsumexp.default):
        table[op] = functools.partial(_scan_with_nonnegative_dim, op)
    for op in (aten.select_backward.default, aten.slice_backward.default):
        table[op] = functools.partial(_backward_with_nonnegative_dim, op)
    table[aten.argmax.default] = functools.partial(_first_index_of, True)
    table[aten.argmin.default] = functools.partial(_first_index_of, False)
    table[aten._trilinear.default] = _trilinear_as_einsum
    table[aten.as_strided_.default] = functools.partial(_as_strided_as_view, in_place=True)
    if private.dtensor_index_put_with_none_gap():
        table[aten.index_put.default] = functools.partial(
            _index_put_on_a_leading_dim, table[aten.index_put.default]
        )
    return table


def _index_put_on_a_leading_dim(
    other: Callable[..., Any], x: torch.Tensor, indices: list, values: torch.Tensor,
    accumulate: bool = False,
) -> Any:
    """``index_put`` with ``None`` before its indices (``[None, idx]``: the backward of
    ``index_select`` on dimension 1, of ``x[:, idx]``, of ``F.unfold``) as the same
    ``index_put`` on those dimensions moved first. torch 2.11's DTensor fails on the
    ``None`` in the list (``'list' object has no attribute 'children'``); equal values,
    as view round trips. Any other ``index_put`` goes to ``other`` (a boolean mask's
    selection, NOTE: [selections by a mask of the batch])."""
    leading = 0
    while leading < len(indices) and indices[leading] is None:
        leading += 1
    rest = list(indices[leading:])
    if leading == 0 or not rest or any(i is None or i.dtype == torch.bool for i in rest):
        return other(x, indices, values, accumulate)
    indexed = list(range(leading, leading + len(rest)))
    broadcast = torch.broadcast_shapes(*(i.shape for i in rest))
    shape = (*x.shape[:leading], *broadcast, *x.shape[leading + len(rest):])
    spans = list(range(leading, leading + len(broadcast)))
    moved = torch.ops.aten.index_put.default(
        x.movedim(indexed, list(range(len(rest)))), rest,
        values.expand(shape).movedim(spans, list(range(len(broadcast)))), accumulate,
    )
    return moved.movedim(list(range(len(rest))), indexed)


# (op, position of its ``dim`` list): an empty list reduces every dimension
_REDUCTIONS_OVER_DIMS = [
    (torch.ops.aten.sum.dim_IntList, 1), (torch.ops.aten.mean.dim, 1),
    (torch.ops.aten.amax.default, 1), (torch.ops.aten.amin.default, 1),
    (torch.ops.aten.nansum.default, 1), (torch.ops.aten.logsumexp.default, 1),
    (torch.ops.aten.linalg_vector_norm.default, 2), (torch.ops.aten.count_nonzero.dim_IntList, 1),
    (torch.ops.aten.var.correction, 1), (torch.ops.aten.std.correction, 1),
    (torch.ops.aten.var_mean.correction, 1), (torch.ops.aten.std_mean.correction, 1),
]


def _empty_dims_as_all(op: Any, at: int, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """A reduction given an empty ``dim`` list reduces every dimension, and is traced with
    them named. DTensor reads the empty list as no dimension at all: a batch-sharded
    ``x.sum([], keepdim=True)`` stayed "sharded" and gave rank 0's partial sum (also
    ``mean``, ``amax``, ``logsumexp``, ``vector_norm``; the others failed). Autograd
    writes one in the backward of every full ``amax()`` / ``amin()`` (the count of the
    maxima): ``h / h.abs().amax()`` under data parallelism divided by rank 0's count,
    0 where the maximum was on another rank, and the parameters became NaN (a probe)."""
    rest = list(args)
    where = at - 1
    dims = rest[where] if where < len(rest) else kwargs.get("dim")
    if x.dim() == 0 or not isinstance(dims, (list, tuple)) or len(dims) > 0:
        return NotImplemented
    every = list(range(x.dim()))
    if where < len(rest):
        rest[where] = every
    else:
        kwargs["dim"] = every
    return op(x, *rest, **kwargs)


def _backward_with_nonnegative_dim(
    op: Any, grad: torch.Tensor, input_sizes: Sequence[Any], dim: int, *args: Any
) -> Any:
    """``select_backward`` / ``slice_backward`` with a negative ``dim`` (the backward of
    ``x.select(-1, i)``, ``x.narrow(-1, ...)``) are traced with it counted from the front.
    DTensor's rules compare it with the shard's dimension unnormalized: ``select_backward``
    moved a batch-sharded gradient's ``Shard(0)`` to ``Shard(1)`` of the result (-1 <= 0),
    which then broadcast silently where the shapes let it (a parameter 4.9e-2 off after two
    SGD steps, a probe of ``torch.select(x * w, -1, 2)``) and failed elsewhere.
    ``slice_backward``'s rule makes the same unnormalized comparison
    (``placement.dim == dim``); no failure of it was seen, the normalization is the same."""
    if dim >= 0:
        return NotImplemented
    return op(grad, input_sizes, dim % len(input_sizes), *args)


def _scan_with_nonnegative_dim(op: Any, x: torch.Tensor, dim: int, *args: Any, **kwargs: Any) -> Any:
    """``cumsum`` / ``cumprod`` / ``logcumsumexp`` with a negative ``dim`` are traced with
    it counted from the front. DTensor compares the scanned dimension with the shard's
    without normalizing a negative one, and scanned each rank's shard alone: a
    column-parallel layer's ``h.cumsum(-1)`` under tensor parallelism (or a batch
    ``cumsum(-2)``) ran locally, 4.5e-2 off the loss in a probe."""
    if dim >= 0 or x.dim() == 0:
        return NotImplemented
    return op(x, dim % x.dim(), *args, **kwargs)


def _first_index_of(
    largest: bool, x: torch.Tensor, dim: int | None = None, keepdim: bool = False
) -> torch.Tensor:
    """``argmax`` / ``argmin`` as the smallest index where ``x`` equals its ``amax`` /
    ``amin`` (the first one, as torch's kernels; a NaN counts as the extreme, as there).
    DTensor's handler for these ops, over a sharded dimension, offsets each rank's local
    index by its shard's start, which it cannot compute while the program is traced for
    every rank at once (an ``AssertionError`` in ``_get_shard_size_and_offsets``: ``h *
    h.argmax(0)`` under data parallelism did not compile). Here the indices are a
    constant ``arange`` that DTensor slices like ``x``, and the reductions are ``amax`` /
    ``amin``, which DTensor reduces across ranks."""
    if dim is None:
        out = _first_index_of(largest, x.reshape(-1), 0)
        return out.reshape([1] * x.dim()) if keepdim else out
    if x.dim() == 0:
        return torch.zeros((), dtype=torch.long, device=x.device)
    dim = dim % x.dim()
    n = x.size(dim)
    extreme = x.amax(dim, keepdim=True) if largest else x.amin(dim, keepdim=True)
    hit = x == extreme
    if x.is_floating_point() or x.is_complex():
        hit = hit | (torch.isnan(x) & torch.isnan(extreme))
    shape = [1] * x.dim()
    shape[dim] = n
    positions = torch.arange(n, device=x.device).reshape(shape)
    candidates = torch.where(hit, positions, torch.full((), n, dtype=torch.long, device=x.device))
    return candidates.amin(dim, keepdim=keepdim)


def _trilinear_as_einsum(
    i1: torch.Tensor, i2: torch.Tensor, i3: torch.Tensor, expand1: Any, expand2: Any,
    expand3: Any, sumdim: Any, unroll_dim: int = 1,
) -> torch.Tensor:
    """``aten._trilinear`` (``nn.Bilinear``, ``F.bilinear``) as one ``einsum``: the three
    inputs, each missing the dimensions it is expanded in, multiplied and summed over
    ``sumdim``. DTensor has no rule for it; ``einsum`` becomes products DTensor shards.
    ``unroll_dim`` only chooses ATen's loop order. Its backward is more ``_trilinear``
    calls, each decomposed the same way."""
    total = i1.dim() + len(expand1)
    letters = [chr(ord("a") + d) for d in range(total)]

    def term(expanded: Any) -> str:
        gone = {d % total for d in expanded}
        return "".join(letters[d] for d in range(total) if d not in gone)

    summed = {d % total for d in sumdim}
    out = "".join(letters[d] for d in range(total) if d not in summed)
    return torch.einsum(f"{term(expand1)},{term(expand2)},{term(expand3)}->{out}", i1, i2, i3)


def _as_strided_as_view(
    x: torch.Tensor, size: Any, stride: Any, storage_offset: Any = None, in_place: bool = False
) -> Any:
    """``as_strided`` where it only names ``x``'s own elements in their order: a view.

    DTensor refuses every ``as_strided``, and ATen writes two harmless ones: a global
    average pool (``adaptive_avg_pool{1,2}d`` to size 1) of a channels-last input, as
    ``nn.AdaptiveAvgPool1d(1)`` after a transpose (Swin's pooler), restrides the ``mean``
    it returns in place (only dimensions of length 1 change stride), and that op's
    backward writes the gradient into a fresh contiguous buffer through ``as_strided``
    with contiguous strides. Both become views (the in-place one: nothing, ``x`` keeps its
    strides). Any other ``as_strided`` is traced as it is and refused at expansion (the
    user's own windows are answered above autograd: NOTE: [windows by as_strided])."""
    size = list(size)
    if not names_its_elements_in_order(x, size, stride, storage_offset, in_place):
        return NotImplemented
    return x if in_place else torch.ops.aten.view.default(x, size)


def _embedding_renorm_over_global_batch(
    weight: torch.Tensor, indices: torch.Tensor, max_norm: float, norm_type: float
) -> torch.Tensor:
    """``nn.Embedding(max_norm=...)``: before the lookup, each row the batch uses whose
    ``norm_type``-norm exceeds ``max_norm`` is scaled to ``max_norm`` (in place, as
    torch's kernel: by ``max_norm / (norm + 1e-7)``). DTensor has no rule for the kernel.
    Here the rows used are those with a nonzero count (an embedding gradient of ones,
    summed over the global batch like _embedding_backward_global_counts), and every row's
    norm is computed, the others scaled by 1."""
    used = _global_index_counts(weight, indices, weight.size(0)) > 0
    norms = torch.linalg.vector_norm(weight, norm_type, dim=1, keepdim=True)
    scale = torch.where(used & (norms > max_norm), max_norm / (norms + 1e-7), 1.0)
    return weight.mul_(scale)


def _reduce_by_count(
    is_any: bool, x: torch.Tensor, dim: Any = None, keepdim: bool = False
) -> torch.Tensor:
    """``any`` / ``all`` as a count of (non-)zero elements compared with 0. DTensor
    reduces a batch-sharded ``any`` to a bool ``Partial(sum)`` and then treats it as
    linear: ``h * (h > 0).any(0)`` became ``all_reduce(h_full * any_local)``, 2h where
    two ranks each saw a True (26% off the loss in a probe, ddp, 2 ranks). A count is a
    true sum, and comparing it needs the reduced value."""
    if isinstance(dim, (list, tuple)) and len(dim) == 0:  # any.dims(x, []): element-wise
        out = x != 0
        return out.to(torch.uint8) if x.dtype == torch.uint8 else out
    hit = x != 0 if is_any else x == 0
    dims = [dim] if isinstance(dim, int) else list(range(x.dim())) if dim is None else dim
    count = hit.sum(dims, keepdim=keepdim) if dims else hit.sum()
    out = count > 0 if is_any else count == 0
    return out.to(torch.uint8) if x.dtype == torch.uint8 else out


def _global_index_counts(like: torch.Tensor, indices: torch.Tensor, num_weights: int) -> torch.Tensor:
    """How often each of ``num_weights`` rows occurs in ``indices``, as a (num_weights, 1)
    tensor of ``like``'s dtype: an embedding gradient of ones, which DTensor sums over a
    sharded batch like any embedding gradient (the global batch's counts)."""
    ones = like.new_ones((*indices.shape, 1))
    return torch.ops.aten.embedding_dense_backward(ones, indices, num_weights, -1, False)


def _embedding_of_one_index(
    weight: torch.Tensor, indices: torch.Tensor, padding_idx: int = -1,
    scale_grad_by_freq: bool = False, sparse: bool = False,
) -> Any:
    """An embedding looked up by a 0-d index (``emb(torch.tensor(2))``) as a lookup of
    one index, then the row: DTensor's vocabulary-sharded rule masks the indices with
    ``t[mask] = 0``, which on a 0-d tensor needs the count of true elements (a
    data-dependent size; it refused such a lookup under RowwiseParallel). Same values."""
    if indices.dim() != 0:
        return NotImplemented
    row = torch.ops.aten.embedding(weight, indices.reshape(1), padding_idx, scale_grad_by_freq, sparse)
    return row.reshape(weight.shape[1:])


def _embedding_backward_global_counts(
    grad_output: torch.Tensor, indices: torch.Tensor, num_weights: int, padding_idx: int,
    scale_grad_by_freq: bool,
) -> Any:
    """``nn.Embedding(scale_grad_by_freq=True)`` divides each token's gradient by how
    often its index occurs in the batch. The kernel counts the indices it is given: on a
    rank, its local batch (found by a probe: 8.8e-3 relative error on the embedding after
    3 AdamW steps, ddp and fsdp, 2 ranks). Here the counts are an embedding gradient of
    ones, which DTensor sums over the batch like any embedding gradient, so every rank
    divides by the global count; the unscaled backward then runs as before. A 0-d index's
    backward runs as one index's (see _embedding_of_one_index)."""
    aten = torch.ops.aten
    if indices.dim() == 0:
        return aten.embedding_dense_backward(
            grad_output.reshape(1, -1), indices.reshape(1), num_weights, padding_idx, scale_grad_by_freq
        )
    if not scale_grad_by_freq:
        return NotImplemented
    counts = _global_index_counts(grad_output, indices, num_weights)
    scale = aten.embedding(counts, indices)  # (*indices.shape, 1): each token's count
    return aten.embedding_dense_backward(grad_output / scale, indices, num_weights, padding_idx, False)


def _mse_loss_backward_allow_empty(
    decomposition: Callable[..., Any], grad_output: torch.Tensor, input: torch.Tensor,
    target: torch.Tensor, reduction: int,
) -> Any:
    """torch's decomposition divides by ``input.numel()`` in Python: an empty batch
    raised ZeroDivisionError at capture where eager returns an empty gradient (and a
    NaN loss). The empty gradient needs no scale."""
    if input.numel() == 0:
        return (input - target) * grad_output
    return decomposition(grad_output, input, target, reduction)


def _group_norm_by_reshapes(
    input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
    N: int, C: int, HxW: int, group: int, eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``native_group_norm`` as reshapes and a ``var_mean`` (NOTE: [ops decomposed at
    capture]); statistics in float32 for reduced-precision inputs, as torch's reference."""
    low = input.dtype in (torch.float16, torch.bfloat16)
    x = input.float() if low else input
    grouped = x.reshape(N, group, C // group, HxW)
    var, mean = torch.var_mean(grouped, dim=[2, 3], correction=0, keepdim=True)
    rstd = torch.rsqrt(var + eps)
    out = ((grouped - mean) * rstd).reshape(input.shape)
    channel = (1, C) + (1,) * (input.dim() - 2)
    if weight is not None:
        out = out * weight.reshape(channel)
    if bias is not None:
        out = out + bias.reshape(channel)
    return (out.to(input.dtype), mean.reshape(N, group).to(input.dtype),
            rstd.reshape(N, group).to(input.dtype))


def _where_with_scalars(condition: torch.Tensor, a: Any, b: Any) -> Any:
    """``torch.where`` with a Python number on a side (no DTensor rule; torch's own
    decomposition makes a ``prims.where``, which has none either): the number as a 0-d
    tensor of the result's dtype, and ``where.self``."""
    if not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor):
        return NotImplemented
    dtype = torch.result_type(a, b)

    def lift(v: Any) -> torch.Tensor:
        if isinstance(v, torch.Tensor):
            return v.to(dtype)
        return torch.full((), v, dtype=dtype, device=condition.device)

    return torch.ops.aten.where.self(condition, lift(a), lift(b))


_MEAN_REDUCTION, _SUM_REDUCTION = 1, 2  # torch's Reduction enum


def _nll_loss_forward_global_mean(
    op: Any, self: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None,
    reduction: int, ignore_index: int,
) -> Any:
    """Mean NLL as (sum of weighted losses) / (sum of weights); see NOTE: [ops
    decomposed at capture]. ``op`` is ``nll_loss_forward`` or ``nll_loss2d_forward``
    (``F.cross_entropy`` on (N, C, H, W) or (N, C, L) logits: segmentation with an
    ignored label returned the mean of the ranks' means, 1.5e-2 off in a probe, while
    the gradients were right). Other reductions are traced as they are."""
    if reduction != _MEAN_REDUCTION:
        return NotImplemented
    total, total_weight = op(self, target, weight, _SUM_REDUCTION, ignore_index)
    if weight is None:
        # The same count, read from the targets alone: its all-reduce can then be issued
        # at the start of the step and overlap the forward (schedule_overlap).
        total_weight = (target != ignore_index).sum(dtype=self.dtype)
    return total / total_weight, total_weight


@dataclasses.dataclass(frozen=True)
class CaptureOptions:
    """How the single-device program computes (chosen by the parallel mode).

    Args:
        param_dtype: forward and backward read every floating parameter cast to this
            dtype, and the root modules' floating tensor inputs are cast to it too
            (FSDP2's ``MixedPrecisionPolicy.param_dtype``); parameters, gradients and
            optimizer state stay in their own dtype.
    """

    param_dtype: torch.dtype | None = None


def capture_step(
    func: Callable[..., Any],
    bindings: StepBindings,
    input_metas: list[TensorMeta],
    options: CaptureOptions = CaptureOptions(),
    decisions: tuple[tuple[bool, str], ...] = (),
    make_state: bool = False,
) -> CapturedStep:
    """Trace ``func`` into one functional single-device graph.

    Python float arguments become graph inputs where the step uses them in tensor ops
    only (NOTE: [float arguments as graph inputs]); otherwise the step is captured again
    with them as constants (the compiled step guards them).

    Args:
        func: the user's train step.
        bindings: its modules, optimizers and named state (``find_bindings``).
        input_metas: global (single-device) metadata of each tensor argument, in the order
            of ``bindings.tensor_args()``.
        decisions: how the first ``if``s on tensor values go, with what their other
            branch raised ("" for a branch): a variant after a branch came out the other
            way (NOTE: [value checks]).
        make_state: make the optimizer state the step's first ``optimizer.step()``
            would make before the program, where that leaves the program the same
            (NOTE: [optimizer state made before the first program]).

    Returns:
        The captured step. Nothing of the user's model or optimizer is changed, except
        with ``make_state``: when ``made_state`` of the result is set, the optimizers
        hold that state (``MadeState.remove`` takes it out again).
    """
    while True:
        try:
            return _capture_step(func, bindings, input_metas, options, decisions, make_state)
        except CycledValueUsed as used:  # NOTE: [SGD's momentum as a graph input]
            log.info("%s: %s; it is a setting of the program from now on", step_name(func), used)
            if used.key == "lr":  # NOTE: [a learning rate read in Python]
                keep_lr_a_setting(bindings.optimizers[used.optimizer], used.where)
            else:
                keep_momentum_a_setting(bindings.optimizers[used.optimizer])


def _capture_step(
    func: Callable[..., Any], bindings: StepBindings, input_metas: list[TensorMeta],
    options: CaptureOptions, decisions: tuple[tuple[bool, str], ...], make_state: bool,
) -> CapturedStep:
    floats = tuple(i for i, a in enumerate(bindings.flat_args) if type(a) is float)
    read: dict[int, str] = {}  # CapturedStep.floats_read
    unread: set[int] = set()  # CapturedStep.floats_unread
    in_python: dict[int, str] = {}  # CapturedStep.floats_in_python
    while floats:
        try:
            captured = _capture(func, bindings, input_metas, options, floats, decisions, make_state)
            captured.floats_read, captured.floats_unread = read, frozenset(unread)
            captured.floats_in_python = in_python
            return captured
        except WayRaised:  # the step raised there: so it does with constants (NOTE: [checks decided from their bytecode])
            raise
        except Exception as exc:  # noqa: BLE001 - retried with the floats as constants
            found = _float_argument_error(exc)
            used = found.indices if found is not None else None
            kept = tuple(i for i in floats if used is not None and i not in used)
            if found is not None and found.op is not None:
                for i in floats:
                    if i not in kept:
                        read[i] = (f"the step gives it to `{found.op}` as {found.argument}, a Scalar "
                                   "argument it reads as a Python number" if found.argument else
                                   f"the step gives it to `{found.op}`, which reads it in Python")
            if found is not None and found.unread:  # NOTE: [float arguments the program does not read]
                unread.update(i for i in floats if i not in kept)
            elif found is None or found.op is None:  # NOTE: [float arguments read in Python]
                reader = _python_reader(exc, len(floats) - len(kept))
                in_python.update((i, reader) for i in floats if i not in kept)
            log.info(
                "float arguments %s of %s stay guarded constants (%s)",
                [i for i in floats if i not in kept], func.__name__, exception_summary(exc),
            )
            floats = kept  # the others are graph inputs still
    captured = _capture(func, bindings, input_metas, options, (), decisions, make_state)
    captured.floats_read, captured.floats_unread = read, frozenset(unread)
    captured.floats_in_python = in_python
    return captured


# torch functions that read a float argument in Python, and what they read
_TORCH_READERS = {
    "clip_grad_norm_": "torch's clip_grad_norm_ calls float(max_norm)",
    "clip_grad_value_": "torch's clip_grad_value_ calls float(clip_value)",
    "get_total_norm": "torch's get_total_norm calls float(norm_type)",
}


def _python_reader(exc: BaseException, count: int) -> str:
    """What read a float argument in Python in the capture that ``exc`` failed, as the
    recompile warning says it (NOTE: [float arguments read in Python]): a torch function
    known to read one, else the line of the user's code, else ""."""
    chain: list[BaseException] = []
    seen: BaseException | None = exc
    while seen is not None and len(chain) < 8:  # the read, through the errors that wrap it
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    for failure in reversed(chain):
        for frame in reversed(traceback.extract_tb(failure.__traceback__)):
            if frame.name in _TORCH_READERS and f"{os.sep}torch{os.sep}" in frame.filename:
                return _TORCH_READERS[frame.name]
    line = next((found for failure in reversed(chain)
                 if (found := innermost_model_frame(failure.__traceback__)) is not None), None)
    if line is None:
        return ""
    if count == 1:
        return f"at {line}"
    return f"one of its float arguments, at {line}: which one the capture cannot tell, so each is kept"


# NOTE: [float arguments read in Python]
# A float argument the step reads in Python (``math.cos(math.pi * f)``, ``min(f, 0.6)``,
# ``round(f, 1)``, an ``if``, torch's clip_grad_norm_) is a setting of the program, and
# a new value recompiles with a warning. The warning's reason was one fixed text that
# blamed "torch's clip_grad_norm_ calls float(max_norm)" whatever read the float. The
# capture that failed on the read keeps what read it: clip_grad_norm_ (or another torch
# function known to read a float) where its frame is in the failure's traceback, else
# the innermost line of the user's code; the warning names that, and gives the hand-
# written clipping only where clip_grad_norm_ is the reader.


def _float_argument_error(exc: BaseException) -> FloatArgumentUsedInPython | None:
    """The ``FloatArgumentUsedInPython`` a failed capture with floats as inputs raised,
    through the errors that wrap it (its ``indices``: the floats used in Python, None:
    all); None where another error failed it (every float is kept a guard)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, FloatArgumentUsedInPython):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def float_argument_ref(index: int) -> StateRef:
    """The graph input standing for the float at ``bindings.flat_args[index]``."""
    return StateRef(Kind.HYPERPARAM, key="arg", index=index)


@dataclasses.dataclass
class _FirstTrace:
    """The first trace of a step (NOTE: [capture in two traces]) and what came with it."""

    graph: torch.fx.GraphModule
    tracer: _StepTracer
    inputs: list[tuple[StateRef, TensorMeta]]
    fake_mode: Any
    code: Any
    outside: list[Any]
    scheduler_steps: list[Any]

    def refs(self) -> list[StateRef]:
        return [ref for ref, _ in self.inputs]

    def holds_more(self) -> bool:
        """Whether the capture recorded value checks or kept values, which a made
        state's program is not compared on."""
        return bool(self.tracer.checks or self.tracer.kept)

    def side(self) -> tuple[Any, ...]:
        """What the capture records besides the graph, for ``StatePlan``: the tensors
        read from outside the arguments by identity and version, so that a step reading
        one (diffusers' ``scheduler.add_noise`` reads ``alphas_cumprod``) makes its state
        first too; before, it compiled a second program (a tiny UNet: +44 s)."""
        t = self.tracer
        outside = tuple((o.label, id(o.tensor), o.version, o.in_argument) for o in self.outside)
        return (t.return_spec, t.return_leaves, self.scheduler_steps, counted_in_capture(), outside)


def _capture(
    func: Callable[..., Any],
    bindings: StepBindings,
    input_metas: list[TensorMeta],
    options: CaptureOptions,
    floats: tuple[int, ...],
    decisions: tuple[tuple[bool, str], ...],
    make_state: bool = False,
) -> CapturedStep:
    start = time.perf_counter()
    if make_state and not decisions:
        steady = _steady_with_predicted_state(func, bindings, input_metas, options, floats, start)
        if steady is not None:
            return steady
    first = _trace_first(func, bindings, input_metas, options, floats, decisions)
    if make_state and not decisions:
        steady = _steady_with_made_state(first, func, bindings, input_metas, options, floats, start)
        if steady is not None:
            return steady
    return _finish(first, start)


def _steady_with_predicted_state(
    func: Callable[..., Any], bindings: StepBindings, input_metas: list[TensorMeta],
    options: CaptureOptions, floats: tuple[int, ...], start: float,
) -> CapturedStep | None:
    """The steady step's capture with torch Adam's first state predicted, not traced;
    None when it is not shown right (NOTE: [Adam's first state predicted])."""
    made = initial_state.predicted(bindings)
    if made is None:
        return None
    made.install(bindings)
    unread: set[tuple[int, str, Any]] = set()
    try:
        steady = _trace_first(func, bindings, input_metas, options, floats, ())
        if steady.holds_more():
            reason: str | None = "the trace keeps values or checks"
        else:
            reason, unread = initial_state.prediction_differs(
                made, steady.graph, steady.refs(), steady.tracer.swapped
            )
    except CycledValueUsed:  # captured again: the optimizers as they were
        made.remove(bindings)
        raise
    except Exception as exc:  # noqa: BLE001 - the two traces go on as before
        reason = f"the trace failed ({exception_summary(exc)})"
    if reason is not None:
        made.remove(bindings)
        log.info("%s: the optimizer state is traced, not predicted: %s", step_name(func), reason)
        return None
    kept: initial_state.MadeState | None = made
    if unread:  # parameters the optimizer did not step: no state, as eager's first step
        _drop_unread_state(steady, unread)
        kept = made.without(unread, bindings)
    return _finish_with_state(steady, kept, func, bindings, start, " (predicted)")


def _drop_unread_state(trace: _FirstTrace, unread: set[tuple[int, str, Any]]) -> None:
    """Take predicted state entries that nothing but the trace's outputs read out of
    its inputs and outputs: the trace is then the one taken without them (the
    optimizer skipped their parameters, no gradient, or did not step), whose program
    makes no state for them (NOTE: [Adam's first state predicted])."""
    def dropped(ref: StateRef) -> bool:
        return ref.kind is Kind.OPTIM_STATE and (ref.optimizer, ref.name, ref.key) in unread

    gm, tracer = trace.graph, trace.tracer
    values = output_args(gm)
    kept = [(ref, value) for ref, value in zip(tracer.out_refs, values, strict=True) if not dropped(ref)]
    tracer.out_refs[:] = [ref for ref, _ in kept]
    set_outputs(gm, [value for _, value in kept])
    for (ref, _), node in zip(trace.inputs, placeholders(gm), strict=True):
        if dropped(ref):
            gm.graph.erase_node(node)  # its one user, the output, no longer reads it
    trace.inputs[:] = [(ref, meta) for ref, meta in trace.inputs if not dropped(ref)]
    private.use_plain_codegen(gm)  # flat inputs, fewer of them


def _steady_with_made_state(
    first: _FirstTrace, func: Callable[..., Any], bindings: StepBindings,
    input_metas: list[TensorMeta], options: CaptureOptions, floats: tuple[int, ...], start: float,
) -> CapturedStep | None:
    """The steady step's capture, with the state the first trace made put into the
    optimizers; None when it is not made (NOTE: [optimizer state made before the first
    program])."""
    tracer = first.tracer
    if first.holds_more():
        log.debug("%s makes no optimizer state before its program: it has value checks "
                  "or kept values", step_name(func))
        return None
    try:
        state_plan = initial_state.plan(
            first.graph, first.refs(), tracer.out_refs, tracer.swapped, first.side()
        )
    except initial_state.NotPlanned as exc:
        # a sentence whatever NotPlanned says ("the state is made by <op>", "'step' was
        # not made by a traced op"); before: "its optimizer state the state is made by ..."
        log.info("%s keeps a first program, for the call that makes its optimizer state: "
                 "that state cannot be made before the program (%s); the steady-state "
                 "program is compiled at the next call", step_name(func), exc)
        return None
    if state_plan is None:
        return None
    made = state_plan.made
    made.install(bindings)
    try:
        steady = _trace_first(func, bindings, input_metas, options, floats, ())
        reason = state_plan.differs_from(
            steady.graph, steady.refs(), steady.tracer.out_refs, steady.side()
        ) or ("the steady trace keeps values or checks" if steady.holds_more() else None)
    except CycledValueUsed:  # captured again: the optimizers as they were
        made.remove(bindings)
        raise
    except Exception as exc:  # noqa: BLE001 - the first trace goes on as before
        reason = f"the steady trace failed ({exception_summary(exc)})"
    if reason is not None:
        made.remove(bindings)
        log.info("%s keeps a first program, for the call that makes its optimizer state "
                 "(%s); the steady-state program is compiled at the next call", step_name(func), reason)
        # the capture's module-level records are the steady trace's now: trace again
        return _finish(_trace_first(func, bindings, input_metas, options, floats, ()), start)
    return _finish_with_state(steady, made, func, bindings, start)


def _finish_with_state(
    steady: _FirstTrace, made: initial_state.MadeState | None, func: Callable[..., Any],
    bindings: StepBindings, start: float, how: str = "",
) -> CapturedStep:
    """``_finish`` of a steady trace taken with ``made`` in the optimizers, which the
    captured step then holds; ``made`` leaves the optimizers again where it fails."""
    try:
        captured = _finish(steady, start)
    except BaseException:
        if made is not None:
            made.remove(bindings)
        raise
    captured.made_state = made
    if made is not None:
        log.info("%s makes its optimizer state before the first program%s: %s",
                 step_name(func), how, ", ".join(made.names()))
    return captured


@contextlib.contextmanager
def _without_onednn() -> Iterator[None]:
    """NOTE: [recurrent layers without oneDNN]: torch's oneDNN switch off while the step
    is traced (``torch.backends.mkldnn.flags`` would also set its TF32 switch, which warns
    on a CPU build)."""
    before = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = before  # type: ignore[assignment]


def _trace_first(
    func: Callable[..., Any],
    bindings: StepBindings,
    input_metas: list[TensorMeta],
    options: CaptureOptions,
    floats: tuple[int, ...],
    decisions: tuple[tuple[bool, str], ...],
) -> _FirstTrace:
    code, where = step_code(func), step_where(func)
    check_supported_optimizers(bindings.optimizers, where)
    check_plain_modules(bindings.modules, where)
    device = next(iter(bindings.params.values())).device
    inputs: list[tuple[StateRef, TensorMeta]] = []
    for ref, value in bindings.state_refs():
        meta = TensorMeta.of(value)
        inputs.append((ref, dataclasses.replace(meta, dtype=state_dtype(ref, meta))))
    inputs += [(ref, TensorMeta((), HYPERPARAM_DTYPE, device)) for ref in bindings.hyperparam_refs()]
    inputs += [(float_argument_ref(i), TensorMeta((), HYPERPARAM_DTYPE, device)) for i in floats]
    names = tensor_argument_names(func, bindings)
    inputs += [
        (StateRef(Kind.INPUT, name=name, index=k), meta)
        for k, (name, meta) in enumerate(zip(names, input_metas, strict=True))
    ]
    fake_mode = private.fake_tensor_mode(allow_real_tensors=True)
    private.register_stack_trace_anchor(func)
    scopes: list[tuple[str, torch.fx.Node | None]] = []  # where the last trace stopped

    def trace(decisions: list[bool]) -> tuple[torch.fx.GraphModule, _StepTracer]:
        fakes = [_fake(meta, fake_mode, first_trace=_requires_grad_in_first_trace(ref, meta))
                 for ref, meta in inputs]
        tracer = _StepTracer(func, bindings, [r for r, _ in inputs], options, decisions)
        rewound: list[str] = []  # NOTE: [a step's own fork_rng]
        with (
            _module_scopes(bindings.module_fqns) as stack,
            _time_major_marks(bindings.modules, bindings.module_fqns),
            _tag_backward(tracer.mark_gradients),
            _refuse_anomaly_checks(),  # NOTE: [anomaly detection at capture]
            attention_as_math(),
            # NOTE: [recurrent layers without oneDNN]: float32 nn.LSTM / nn.GRU on CPU take
            # oneDNN's ``mkldnn_rnn_layer``, which no DTensor rule shards (refused at
            # expansion); without it they trace as torch's own cell ops (float64 always did)
            _without_onednn(),
            functions_as_ops(),  # NOTE: [functions as plain ops at capture]
            cumulative_batch_norms(bindings.modules),
            transformer_encoders_as_eager(bindings.modules),
            # NOTE: [torch's functions replaced by the user]
            private.torch_functions_replaced_by_the_user(),
            private.light_stack_traces(),  # NOTE: [stack traces without the whole stack]
            draw_lines_recorded(),  # NOTE: [random draws shaped like a tensor]
            generators_counted_in_draws(rewound),  # NOTE: [draws replayed by a restored generator]
            # NOTE: [compiled helpers and selective checkpointing at capture]
            private.compiled_helpers_and_checkpoints_as_eager(),
        ):
            try:
                with caught_item_uses() as uses:  # NOTE: [an item use the step caught]
                    graph = make_fx(
                        tracer, capture_decompositions(), tracing_mode="fake", record_stack_traces=True
                    )(*fakes)
            finally:
                scopes[:] = stack
        if uses:
            exc, line = uses[0]
            raise SPMDCompileError(
                "The train step used the value of a tensor in Python, and its code caught the "
                f"error this raised ({exc}): logging catches it (\"--- Logging error ---\"), "
                "as does a try/except. The trace then went on along the handler's path, "
                "which the step run eagerly does not take (NOTE: [an item use the step "
                "caught]).",
                user_line=line,
                hint="return the value (`return {'loss': loss.item()}`) and log or use it "
                "outside the compiled step.",
            )
        _note_hook_changes()
        tracer.written = _TRACE_STARTS[-1].written(made=_hooks_put_back()) if _TRACE_STARTS else []
        if _hooks_put_back() and _HOOK_STARTS and _HOOK_STARTS[-1] is not None:  # NOTE: [hooks each trace starts from]
            tracer.hooks_left = _HOOK_STARTS[-1].now()
        tracer.rewound_generators = tuple(rewound)
        return graph, tracer

    forget_settled()
    try:
        first, tracer = _decide_value_checks(trace, decisions)
        _leave_written(tracer)  # NOTE: [a step that changes what it reads]
    except SPMDCompileError as exc:
        named = exc.in_module(scopes[-1][0]) if scopes else exc  # the innermost module running
        if named is exc:
            raise
        raise named from exc
    except value_read_errors() as exc:
        op = private.value_dependent_shape_op(exc)
        raise SPMDCompileError(
            (
                f"{op} in the train step makes a tensor of value-dependent shape (its size "
                "depends on the values of its input), which cannot be captured into one graph"
                if op is not None
                else "The train step uses rows a mask selects where their number matters (a "
                "value-dependent shape), which cannot be captured into one graph"
                if isinstance(exc, RowsOfAModelMaskCounted)
                else "The train step reads the value of a tensor in Python (control flow "
                "on a tensor, .item(), .tolist() or a value-dependent shape), which cannot "
                "be captured into one graph"
            )
            + _where_it_failed(exc)
            + (f": {exc}." if isinstance(exc, (RowsOfAModelMaskCounted, ItemUsedInPython)) else "."),
            op=str(op) if op is not None else None,
            module_fqn=scopes[-1][0] if scopes else None,
            user_line=step_frame_from_traceback(exc.__traceback__, code),
            failed_at=innermost_model_frame(exc.__traceback__),
            hint=(
                getattr(exc, "hint", None) or ITEM_HINT
                if isinstance(exc, ItemUsedInPython)
                else model_mask_hint(exc.__traceback__)  # NOTE: [advice for rows of a model mask counted]
                if isinstance(exc, RowsOfAModelMaskCounted)
                else getattr(exc, "hint", None)  # NOTE: [value-dependent shapes of Python values]
                or _VALUE_SHAPE_HINTS.get(getattr(op, "__name__", "").split(".")[0])
                or "use ops whose output shape does not depend on values "
                "(torch.where(cond, a, b), masking) instead, or move the check "
                "outside the compiled step."
            ),
        ) from exc
    except WayRaised:  # the api's to report (NOTE: [checks decided from their bytecode])
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised with the user's line
        if _raised_in(exc, "lr_scheduler.py"):
            raise SPMDCompileError(
                "An LR scheduler stepped inside the compiled train step: it assigns "
                "optimizer.param_groups[i]['lr'], which a compiled step reads as an input.",
                user_line=step_frame_from_traceback(exc.__traceback__, code),
                hint=SCHEDULER_HINT,
            ) from exc
        if isinstance(exc, unbound_scaler_error()):
            raise SPMDCompileError(
                str(exc),
                user_line=step_frame_from_traceback(exc.__traceback__, code),
                hint=SCALER_HINT,
            ) from exc
        if isinstance(exc, OptimizerNotPassed) and (held := _held_by_an_optimizer(exc.optimizer, bindings)):
            # NOTE: [modules and optimizers by name]: an optimizer a given one holds is
            # taken where the step's modules own its every parameter; this one's are not
            raise SPMDCompileError(
                f"The train step calls {exc.method}() of a {type(exc.optimizer).__module__}."
                f"{type(exc.optimizer).__name__}, {held} (an attribute of an optimizer it "
                "is given), which updates parameters that no module the step trains owns.",
                user_line=step_frame_from_traceback(exc.__traceback__, code),
                hint=f"build {held} over the parameters of the modules passed to the step, "
                "or pass the modules that own its parameters to the step too.",
            ) from exc
        if isinstance(exc, OptimizerNotPassed) and (wrapped := _held_by_a_plain_argument(exc.optimizer, func, bindings)):
            path, wrapper = wrapped
            inner = f"{type(exc.optimizer).__module__}.{type(exc.optimizer).__name__}"
            raise SPMDCompileError(
                f"The train step calls {exc.method}() of a {inner} that is not among its "
                f"optimizers, reached through attribute {path} (a {wrapper}: a plain "
                "object, not a torch.optim.Optimizer). A step takes the "
                "optimizers it is given, those its code names whose every parameter "
                "belongs to the modules it trains, and those a given torch.optim.Optimizer "
                "holds in an attribute (NOTE: [modules and optimizers by name]).",
                user_line=step_frame_from_traceback(exc.__traceback__, code),
                hint=f"make {wrapper} a torch.optim.Optimizer subclass that holds the "
                f"{type(exc.optimizer).__name__} in an attribute and shares its param_groups "
                "(as SAM's and Lookahead's wrappers do), with any counter or slow weights "
                "kept as tensors in its state (a Python counter the step changes is "
                "refused); or pass the inner optimizer to the step itself and write the "
                "wrapper's work in the step.",
            ) from exc
        if isinstance(exc, OptimizerNotPassed) and exc.holds_stand_ins:
            name = f"{type(exc.optimizer).__module__}.{type(exc.optimizer).__name__}"
            raise SPMDCompileError(
                f"The train step calls {exc.method}() of a {name} that was created inside the "
                "step over the model's own parameters (the trace's stand-ins, or tensors "
                "sharing their memory, `p.detach()`): an optimizer made on the first call "
                "(`if self.opt is None: self.opt = AdamW(...)`) is not among the "
                "optimizers the step was given or can name when it is called (NOTE: "
                "[optimizers created inside the step]).",
                user_line=step_frame_from_traceback(exc.__traceback__, code),
                hint="create the optimizer before the first call (in __init__, or before "
                "compiling the step), over the model's parameters, and keep the step's "
                "call to its step(). An inner optimizer made in every call over tensors the "
                "call makes alone (a per-call clone's parameters, "
                "`SGD(copy.deepcopy(model).parameters(), lr)`, as in Reptile) compiles "
                "(NOTE: [optimizers over tensors made in the call]).",
            ) from exc
        if isinstance(exc, OptimizerNotPassed) and (bare := _tensor_of_no_module(exc.optimizer)) is not None:
            raise SPMDCompileError(
                f"The train step calls {exc.method}() of a {type(exc.optimizer).__module__}."
                f"{type(exc.optimizer).__name__} that is not among its optimizers, and it "
                f"updates a tensor of shape {tuple(bare.shape)} that is no nn.Parameter, so "
                "belongs to no module (a leaf made with requires_grad=True, SAC's "
                "`self.log_alpha = torch.zeros(1, requires_grad=True)`): passing the "
                "optimizer alone does not help, since a compiled step trains only the "
                "parameters of the modules it is given (NOTE: [optimizers over tensors of "
                "no module]).",
                user_line=step_frame_from_traceback(exc.__traceback__, code),
                hint="hold the tensor in an nn.Module and pass that module and the optimizer "
                "to the step: `alpha = nn.Module(); alpha.log_alpha = nn.Parameter(torch.zeros(1))`, "
                "`alpha_optim = Adam(alpha.parameters(), lr)`, the step reading "
                "`alpha.log_alpha` (docs/porting.md).",
            ) from exc
        if isinstance(exc, OptimizerNotPassed):
            raise SPMDCompileError(
                f"The train step calls {exc.method}() of a {type(exc.optimizer).__module__}."
                f"{type(exc.optimizer).__name__} that is not among its optimizers: those it "
                "is given, and those its code names (a global, a closure variable, an "
                "attribute of its object, or an entry of a dict, list or tuple held so) whose "
                "every parameter belongs to the modules it trains (NOTE: [modules and "
                "optimizers by name]).",
                user_line=step_frame_from_traceback(exc.__traceback__, code),
                hint="pass the optimizer, and the modules whose parameters it updates, to "
                "the step, e.g. train_step(model, optimizer, batch, target).",
            ) from exc
        if is_own_generator_failure(exc):
            raise SPMDCompileError(
                OWN_GENERATOR,
                module_fqn=scopes[-1][0] if scopes else None,
                user_line=step_frame_from_traceback(exc.__traceback__, code),
                hint=OWN_GENERATOR_HINT,
            ) from exc
        if _VALUES_READ in str(exc):
            text = f"{CAPTURE_FAILED}{_where_it_failed(exc)}: {_values_read_text(exc)}"
        else:
            text = f"{CAPTURE_FAILED}{_where_it_failed(exc)}: {type(exc).__name__}: {exc}"
        settled = settled_in_capture()
        if settled:  # a size error from selections traced as all true
            text = text.rstrip(".") + settled
        text = text.rstrip() + _NOTHING_APPLIED
        raise SPMDCompileError(
            text,
            module_fqn=scopes[-1][0] if scopes else None,
            user_line=step_frame_from_traceback(exc.__traceback__, code),
            failed_at=innermost_model_frame(exc.__traceback__),
            hint=_FLEX_HINT if any(word in text for word in _FLEX)
            else _values_read_hint(exc) if _VALUES_READ in str(exc)
            else _NUMPY_HINT if _NUMPY in str(exc) else None,
        ) from exc
    _check_float_arguments_read(first, [r for r, _ in inputs])
    _drop_refused_value_reads(first)
    _annotate_user_lines(first, code)
    refuse_mixed_dtype_operands(first)  # NOTE: [operands of one dtype]
    refuse_explicit_generators(first)  # NOTE: [Python effects at capture]
    _refuse_custom_ops_writing_arguments(first)
    refuse_shard_local_draws(first)  # NOTE: [random draws shaped like a tensor]
    outside = outside_constants(first, tracer.outside, bindings, tracer.unplaced, tracer.inherited, tracer.outside_reads)  # NOTE: [tensors read from outside the arguments]
    refuse_kept_read_back(first, outside, tracer.kept, bindings, step_where(func))  # NOTE: [tensors the step keeps]
    scheduler_steps = []
    if tracer.schedulers is not None:  # NOTE: [schedulers stepped in the step]
        scheduler_steps = tracer.schedulers.steps()
        tracer.schedulers.check_reads(code)
        _refuse_schedules_of_settings(scheduler_steps, bindings)
    return _FirstTrace(first, tracer, inputs, fake_mode, code, outside, scheduler_steps)


def _refuse_schedules_of_settings(steps: list[SchedulerStep], bindings: StepBindings) -> None:
    """Refuse a scheduler stepped before its optimizer's step in the train step where the
    learning rate (or a cycled momentum) it sets is a setting of the program, not a graph
    input (NOTE: [a learning rate read in Python], NOTE: [SGD's momentum as a graph
    input]): the capture records the scheduler without running it, so the program would
    hold the value from before its step, and every call would update with the rate of the
    call before (found by a review: 0.157 relative off after 6 calls of a LambdaLR, no
    sign). Stepped after the optimizer's step, the program's value is the one eager uses."""
    for s in steps:
        if not s.before:
            continue
        scheduler = bindings.schedulers[s.index]
        oi = next((i for i, o in enumerate(bindings.optimizers) if o is getattr(scheduler, "optimizer", None)), None)
        if oi is None:
            continue
        opt = bindings.optimizers[oi]
        cycled = getattr(scheduler, "cycle_momentum", False)
        keyed = [
            key for key, kept in (
                ("learning rate", not lr_is_input(opt)),
                ("momentum", cycled and any(
                    MOMENTUM in g and not momentum_is_input(opt, g) for g in opt.param_groups
                )),
                ("first beta", cycled and any(
                    "betas" in g and not beta1_is_input(opt, g) for g in opt.param_groups
                )),
            ) if kept
        ]
        if keyed:
            raise SPMDCompileError(
                f"{type(scheduler).__name__}.step() runs before optimizer[{oi}].step() inside "
                f"the compiled train step ({s.where}), and optimizer[{oi}]'s "
                f"{' and '.join(keyed)} {'is a setting' if len(keyed) == 1 else 'are settings'} "
                "of the program, not a graph input: the program would hold the value from "
                "before the scheduler's step, and every call would update with the value "
                "of the call before.",
                hint="step the scheduler after optimizer.step() (the order torch's schedulers "
                "ask for: the program then holds the value the update uses)"
                + (", or compute with group['lr'] in tensor ops inside the optimizer's "
                   "step() (no math.* or float() on it) so it stays a graph input."
                   if "learning rate" in keyed else "."),
            )


def _finish(first: _FirstTrace, start: float) -> CapturedStep:
    """The second trace (NOTE: [capture in two traces]) and the captured step."""
    tracer = first.tracer
    gm = _functionalize(first.graph, first.inputs, first.fake_mode)
    refuse_ops_named_in_place(gm)  # NOTE: [ops named like in-place ones]
    captured = CapturedStep(
        graph_module=gm,
        inputs=first.inputs,
        outputs=tracer.out_refs,
        return_spec=tracer.return_spec,
        returns_containers=holds_containers(tracer.return_spec),
        return_leaves=tracer.return_leaves,
        step_code=first.code,
        checks=tracer.checks,
        kept=tracer.kept,
        outside=first.outside,
        scheduler_steps=first.scheduler_steps,
        counted=counted_in_capture(),
        rewound_generators=tracer.rewound_generators,
        requires_grad_after=tracer.requires_grad_after,
    )
    _finish_signature(captured)
    captured.capture_seconds = time.perf_counter() - start
    return captured


# a failure inside FlexAttention (transformers' attn_implementation="flex_attention" path,
# which torch.compiles flex_attention; its Python runs under capture, NOTE: [compiled
# helpers and selective checkpointing at capture]): on CPU it has no backward, and no
# DTensor rule shards its higher-order op
# How a capture failure the step raised (no more specific refusal) begins; the compile
# adds what to do where split arguments may be the cause (NOTE: [capture failures of split
# arguments] in ``parallel_modes/batch_dims.py``)
CAPTURE_FAILED = "Capturing the train step failed"
# A failed capture changes nothing; the step run eagerly keeps what ran before its error
# (gradients a backward() accumulated, an optimizer step): a loop that catches the error
# and goes on would part from eager without this said.
_NOTHING_APPLIED = (
    " (nothing of this call was applied: the model, its gradients and the optimizer are "
    "as before the call, where the step run eagerly keeps what ran before the error)"
)
_FLEX = ("flex_attention", "FlexAttention")
_FLEX_HINT = (
    "FlexAttention (a transformers model with attn_implementation='flex_attention') is not "
    "supported in a compiled step: use 'sdpa' (or 'eager'); sc.compile(..., "
    "backend=\"inductor\") lowers the whole step to kernels."
)


# torch's words when a C++ function reads the data of a traced tensor: one taking a tensor
# of sizes or indices (``torch.tensor_split(x, idx_tensor)``) to shape its result. Before
# 2026-12-02 the error went on about custom kernels and Caffe2.
# ``t.numpy()`` of a traced tensor (torch's words: the trace's tensors are subclasses)
_NUMPY = ".numpy() is not supported for tensor subclasses"
_NUMPY_HINT = (
    "a compiled step has no values while it is traced, so .numpy() cannot run inside it: "
    "return the tensor (or `loss.item()`, a number) and call .numpy() on what the call "
    "returns."
)
_VALUES_READ = KERNEL_READ_VALUES
_VALUES_READ_TEXT = (
    "a torch function read the values of a tensor to decide the shape of its result (a "
    "tensor of sizes or split indices); the trace holds no values, and a compiled step "
    "has fixed shapes."
)
_VALUES_READ_HINT = (
    "pass the sizes or indices as Python ints (a list: `idx.tolist()` outside the step), "
    "or compute them from shapes."
)


# NOTE: [kernels that read values at capture]
# torch's "its data is not allocated yet" comes from any C++ kernel that reads the data of
# a traced tensor. The refusal said, for every one, that "a torch function read the values
# of a tensor to decide the shape of its result ... pass the sizes as Python ints": right
# for ``torch.tensor_split(x, idx_tensor)``, wrong for a PINN's quasi-random collocation
# points, ``torch.quasirandom.SobolEngine(2).draw(16)`` in the step, whose shape is fixed:
# ``torch._sobol_engine_draw`` has no fake (meta) kernel and computes from the engine's
# state tensors in C++, and the engine keeps its position in Python (``num_generated``).
# ``ItemsAsOutputs`` names the torch function called (``KernelReadValues``); the refusal
# says the shape text only for the functions that read sizes or indices
# (``_SIZES_READ``), and for any other that the op has no kernel that runs without
# values: compute it outside the step and pass the result in (for Sobol: draw outside,
# pass the points). Nothing of the engine ran (``num_generated`` stays as found).
_SIZES_READ = frozenset({"tensor_split"})
_NO_KERNEL_HINTS = {
    "_sobol_engine_draw": "draw the points outside the compiled step and pass them in as an "
    "argument (`x = engine.draw(n)` in the loop, then `step(model, opt, xb, x)`): the engine "
    "keeps its position in Python, which a compiled step cannot advance.",
}


def _values_read_text(exc: BaseException) -> str:
    """What the refusal of a kernel that read a traced tensor's data says (NOTE: [kernels
    that read values at capture])."""
    if not isinstance(exc, KernelReadValues):
        return _VALUES_READ_TEXT
    shown = torch_function_name(exc.func)
    if exc.func.__name__ in _SIZES_READ:
        return f"{shown}: {_VALUES_READ_TEXT}"
    return (
        f"{shown} has no kernel that runs on the trace's tensors (no fake or meta "
        "kernel: its C++ code reads their values), so it cannot be captured into the program."
    )


def _values_read_hint(exc: BaseException) -> str:
    """What the refusal of a kernel that read a traced tensor's data advises."""
    name = exc.func.__name__ if isinstance(exc, KernelReadValues) else None
    if name is None or name in _SIZES_READ:
        return _VALUES_READ_HINT
    return _NO_KERNEL_HINTS.get(name, (
        "compute it outside the compiled step and pass the result in as an argument (a "
        "tensor argument: one program for every value)."
    ))


# `if`s on tensor values one traced call may trace both ways (NOTE: [value checks]);
# those decided from their bytecode count toward ``MAX_VALUE_CHECKS``
MAX_VALUE_IFS = 16


def _decide_value_checks(
    trace: Callable[[list[bool]], tuple[torch.fx.GraphModule, _StepTracer]],
    given: tuple[tuple[bool, str], ...],
) -> tuple[torch.fx.GraphModule, _StepTracer]:
    """Trace the step, deciding each ``if`` on a tensor's value on the way (NOTE: [value
    checks]), after the ``given`` (decision, what the other answer raised) pairs; the
    tracer's checks carry what the other answer raised ("" for a branch, ``UNTRACED``
    for a check decided from its bytecode).

    The last given decision taking the way of a check decided from its bytecode (its
    text ``UNTRACED``, NOTE: [checks decided from their bytecode]): where the step
    raises on that way, ``WayRaised`` says what it raised; where it goes on (the
    exception caught further up), that ``if`` is a branch of the program."""
    trying = bool(given) and given[-1][1] == UNTRACED
    if trying:
        given = (*given[:-1], (given[-1][0], ""))
    with signals_told_apart() as arrived:
        try:
            return _decide_value_ifs(trace, given)
        except value_read_errors() as exc:
            if not trying:
                raise
            # the way tried reads a value no program can hold (an assert's message
            # formatting `loss.item()`): a check's raising way (NOTE: [a way no program
            # holds]), as when both ways are traced; a review found this refused as a
            # value read of the whole step
            raise WayRaised(_read_raise_text(exc) if read_runs_into_raise(exc) else _refusal_text(exc)) from exc
        except _not_raised_by_the_step():
            raise
        except Exception as exc:  # noqa: BLE001 - the step raised on the way tried
            if not trying:
                raise
            raise WayRaised(stop_text(exc)) from exc
        except BaseException as exc:
            if not trying or arrived:  # a real Ctrl-C: NOTE: [a check that stops the run]
                raise
            raise WayRaised(stop_text(exc)) from exc  # sys.exit(1) on the way tried


def _decide_value_ifs(
    trace: Callable[[list[bool]], tuple[torch.fx.GraphModule, _StepTracer]],
    given: tuple[tuple[bool, str], ...],
) -> tuple[torch.fx.GraphModule, _StepTracer]:
    decisions = [decision for decision, _ in given]
    raised = [text for _, text in given]
    coins: list[str] = []  # NOTE: [ifs on random draws alone]
    while True:
        try:
            first, tracer = trace(decisions)
            break
        except Undecided as undecided:
            # the checks the trace decided from their bytecode before this `if`
            decisions += undecided.guessed
            raised += undecided.guessed_raised
            coin = undecided.coin
            settled = undecided.settled
            guess = undecided.guess  # NOTE: [the guess for later ifs]
            where = undecided.where
            compared_in = undecided.compared_in
            if undecided.loop is not None:  # NOTE: [while loops on tensor values]
                _refuse_while(undecided)
            if sum(text != UNTRACED for text in raised) >= MAX_VALUE_IFS or len(decisions) >= MAX_VALUE_CHECKS:
                traced = sum(text != UNTRACED for text in raised) >= MAX_VALUE_IFS
                raise SPMDCompileError(
                    f"{undecided.owner} meets more than "
                    + (f"{MAX_VALUE_IFS} `if`s on tensor values in one call that are traced "
                       "both ways" if traced else
                       f"{MAX_VALUE_CHECKS} `if`s on tensor values in one call")
                    + f" (the last at {undecided.where}); each is verified every call, so "
                    "this many is refused (a loop that runs until a value converges, say; "
                    "NOTE: [value checks]).",
                    hint=_many_ifs_hint(undecided.in_torch),
                ) from None
        results: dict[bool, tuple[torch.fx.GraphModule, _StepTracer]] = {}
        outcomes: dict[bool, BaseException | None] = {}
        refused: dict[bool, BaseException] = {}  # a value read no program can hold
        texts: dict[bool, str] = {}  # what a way raised, where its exception cannot say
        for answer in (True, False):
            with signals_told_apart() as arrived:
                try:
                    results[answer] = trace([*decisions, answer])
                    outcomes[answer] = None
                except value_read_errors() as exc:
                    if read_runs_into_raise(exc):  # NOTE: [a value read in what a way raises]
                        outcomes[answer], texts[answer] = exc, _read_raise_text(exc)
                        continue
                    outcomes[answer] = None
                    refused[answer] = exc
                except _not_raised_by_the_step():
                    outcomes[answer] = None  # went on (or failed for a reason of ours)
                except Exception as exc:  # noqa: BLE001 - the step raised: the check's branch
                    outcomes[answer] = exc
                except BaseException as exc:
                    if arrived:  # a real Ctrl-C: NOTE: [a check that stops the run]
                        raise
                    outcomes[answer] = exc  # sys.exit(1) in the check's branch
        choice = choose(outcomes)
        if choice is None and outcomes[True] is not None:
            raise cast(BaseException, outcomes[True])  # both answers raise: so would eager
        if choice is None and len(refused) == 1:
            # NOTE: [a way no program holds]: the other way is compiled; a call that goes
            # this way is refused, as a check's raising way is
            ((way, refusal),) = refused.items()
            if compared_in is not None and isinstance(refusal, ItemUsedInPython):
                _refuse_item_clamp(compared_in, where, refusal)  # NOTE: [max and min of an .item() value]
            choice, text = not way, _refusal_text(refusal)
        elif choice is None:  # a branch: speculated, verified every call (NOTE: [value checks])
            choice, text = guess, ""
            if coin and settled is not None:  # NOTE: [ifs on random draws alone]
                choice = settled
            elif coin:  # its last draw says nothing of its next
                choice = True
                coins.append(where)
                _refuse_coin_branches(coins)
        else:
            text = texts.get(not choice) or stop_text(cast(BaseException, outcomes[not choice]))
        raised.append(text)
        decisions.append(choice)
        if choice in results:
            first, tracer = results[choice]
            break
    # the checks the completed trace decided from their bytecode after the last given
    raised += [check.raised for check in tracer.checks[len(raised):]]
    tracer.checks = [
        dataclasses.replace(check, raised=text)
        for check, text in zip(tracer.checks, raised, strict=True)
    ]
    return first, tracer


# NOTE: [while loops on tensor values]
# ``while (neg == pos).any(): neg = torch.where(neg == pos, torch.randint(...), neg)`` (BPR
# negatives redrawn until none equals the positive; eager runs it 0 to 2 times) tests a
# tensor's value on every round, so how many rounds run is the data's (and the draws')
# decision, which one program of fixed ops cannot hold. Capture traced each test both
# ways as a branch, guessing True (another round), so a `while` whose body does not raise
# ran rounds until ``MAX_VALUE_IFS``: refused after 50.8 s of capture (sixty-eighth
# session's probe) as "more than 16 `if`s ... traced both ways", naming no loop. Now the
# `if` met beyond the decisions whose instruction is a ``while`` statement's condition
# (its position in the file's syntax tree, ``source_sites.while_of_condition``: the
# condition's own instructions, or the jump that tests it at the loop's top and end) is
# refused on the spot, before any way of it is traced, naming the ``while`` line and the
# fixed-rounds form. In a ``while True:`` loop an ``if`` whose body breaks is the loop's
# condition too (torch's ``trunc_normal_``: ``while True: ... if not mask.any(): break``,
# refused at its first test instead of after 16). An ``if`` in a ``for`` loop's body
# (DINO's per-parameter ``if clip_coef < 1``) and an ``if ...: break`` in a ``for`` or in
# a ``while`` on a Python value are not: traced both ways as before (the ACT halting
# loop, NOTE: [programs for the ways of ifs]). Nor is a loop that may end in Python: a
# condition combined by ``and`` / ``or`` (``while k < 5 and err > tol:``) or another
# ``break`` / ``return`` / ``raise`` in the body (a review of the sixty-eighth session:
# refused at its first test, where its ways compiled as branches before). A ``while``
# whose condition is a Python value only is no value check at all; one whose way runs into a ``raise`` is decided from its bytecode first
# (NOTE: [checks decided from their bytecode]).
_WHILE_HINT = (
    "loop a fixed number of rounds and select with torch.where: a rejection loop "
    "`while (neg == pos).any(): neg = torch.where(neg == pos, torch.randint(...), neg)` "
    "becomes `for _ in range(R): neg = torch.where(neg == pos, torch.randint(...), neg)` "
    "(R large enough that a clash left over is rare, or masked out of the loss); a loop "
    "until a value converges, a fixed number of iterations with `x = torch.where(done, x, "
    "update(x))`. The fixed rounds draw R times on every call where eager's `while` draws "
    "only as many times as it needs, so the random numbers no longer match an eager run "
    "of the `while` draw for draw; where that exactness matters, run the loop outside the "
    "compiled step and pass its result in as an argument."
)


def _refuse_while(undecided: Undecided) -> NoReturn:
    """Refuse a ``while`` whose condition is a tensor's value (see the NOTE)."""
    tested = "" if undecided.where == str(undecided.loop) else f" (tested at {undecided.where})"
    raise SPMDCompileError(
        f"{undecided.owner} loops on a tensor's value: the `while` at {undecided.loop} "
        f"runs until a tensor's value ends it{tested}, so the number "
        "of times it runs depends on the values on each call, and a loop whose trip count depends on tensor "
        "values cannot be one compiled program (its ops are fixed). Every `while` on a "
        "tensor value is refused (NOTE: [while loops on tensor values]).",
        user_line=undecided.loop,
        hint=_many_ifs_hint(undecided.in_torch) if undecided.in_torch else _WHILE_HINT,
    )


# NOTE: [max and min of an .item() value]
# ``n = m.sum().item(); loss = l.sum() / max(n, 1)`` compares the item with 1 in Python
# (``1 > n``, a ``TracedItem`` whose truth value is an ``if`` on a tensor). Of its two
# ways, the one where max() gives ``n`` divides by the item in Python, which no program
# holds (NOTE: [a way no program holds]), so capture compiled the other, max() giving 1:
# the way a count clamped at 1 takes only when it is 0. The step compiled, and nearly
# every call after it was refused with SPMDRuntimeError (sixty-eighth session's probe).
# Where the `if` is the comparison inside a call of the builtin max() or min() (its frame
# runs that call: ``source_sites.builtin_called``) and one way uses the item in Python,
# capture refuses the step, naming the line and the tensor form (``clamp(min=1)``). Other
# `if`s with such a way (``if loss.item() > 1e4: print(f"{loss.item()}")``, Longformer's
# ``if is_global_attn:``) stay a way no program holds: the compiled way is the usual one.
def _refuse_item_clamp(builtin: str, where: str, refusal: ItemUsedInPython) -> NoReturn:
    """Refuse max() / min() of an ``.item()`` value whose one way uses it in Python (see
    the NOTE)."""
    bound = "min" if builtin == "max" else "max"
    used = _where_it_failed(refusal)
    used = " on the same line" if where in used else used or " further on"
    raise SPMDCompileError(
        f"The train step compares an .item() value with a number in Python: {builtin}() at "
        f"{where}. One way of that comparison uses the value in Python"
        f"{used}, which no compiled program holds, so "
        f"only the other way could be compiled, where {builtin}() gives the number: it "
        f"would serve only the calls whose value is {'below' if builtin == 'max' else 'above'} "
        "that number, and refuse the others (for a count clamped at 1, nearly every call). "
        "So it is refused at capture (NOTE: [max and min of an .item() value]).",
        user_line=where,
        hint=f"compute with the tensor instead of its .item(): `m.sum().clamp({bound}=1)` "
        f"for `{builtin}(m.sum().item(), 1)`, then use that 0-d tensor (`loss = (l * "
        f"m).sum() / m.sum().clamp({bound}=1)`); an .item() value can only be returned "
        "(NOTE: [returned .item() values]).",
    )


def _many_ifs_hint(in_torch: str | None) -> str:
    """What to do about a refused number of ``if``s, for where they are."""
    if in_torch is None:
        return "select with torch.where(cond, a, b), or loop a fixed number of times."
    if in_torch.startswith("torch.distributions."):
        return (
            f"the `if`s are torch.distributions' argument checks ({in_torch}): pass "
            "validate_args=False to the distributions the step makes (Categorical(logits=..., "
            "validate_args=False)), or call torch.distributions.Distribution."
            "set_default_validate_args(False) before the first call."
        )
    if in_torch.endswith(".trunc_normal_"):
        return (
            f"the `if`s are in torch's own {in_torch} (a loop until its values settle), which "
            "the step calls: run it outside the compiled step (initialise parameters before "
            "the first call), or use normal_(mean, std).clamp_(a, b), which puts the tails at "
            "the bounds instead of redrawing them."
        )
    return (
        f"the `if`s are in torch's own {in_torch}, which the step calls: run it outside the "
        "compiled step, or use an equivalent without `if`s on tensor values."
    )


def _refuse_coin_branches(coins: list[str]) -> None:
    """Refuse a step whose `if`s on random draws alone need more programs than a step
    may have (NOTE: [ifs on random draws alone])."""
    if len(coins) <= MAX_COIN_BRANCHES:
        return
    lines = list(dict.fromkeys(coins))  # a loop's `if` is one line met many times
    places = "; ".join(lines[:3]) + ("; ..." if len(lines) > 3 else "")
    # LayerDrop is named first only where the `if`s read a layerdrop setting: a seq2seq
    # decoder's teacher forcing (`inp = gold if torch.rand(()) < p else pred` per time
    # step) was told of LayerDrop first (sixty-fourth session)
    layerdrop = any("layerdrop" in line.lower() for line in lines)
    message = (
        f"The train step branches on random draws alone at more than {MAX_COIN_BRANCHES} "
        f"`if`s in one call ({places}): which way each goes changes from call to call, "
        f"and each way through them is a program of its own, so its calls may need "
        f"{2 ** len(coins)} or more programs, more than the {MAX_BRANCH_PROGRAMS} a step "
        "may have (NOTE: [ifs on random draws alone])."
    )
    if layerdrop:
        raise SPMDCompileError(
            f"{message} LayerDrop (`if torch.rand([]) < self.layerdrop`) is the usual cause.",
            hint="set the model's layerdrop to 0 (config.layerdrop, encoder_layerdrop, "
            "decoder_layerdrop), or select with torch.where(draw < p, x, layer(x)) instead of "
            "branching in Python.",
        )
    raise SPMDCompileError(
        message,
        hint="select with torch.where instead of branching in Python: one program computes "
        "both ways and the draw picks per call (teacher forcing: inp = torch.where("
        "torch.rand(()) < p, gold, pred)); for a layer skipped on a coin flip (LayerDrop, "
        "one example: set its layerdrop to 0), torch.where(draw < p, x, layer(x)).",
    )


def _refusal_text(exc: BaseException) -> str:
    """What a failed check says of a way the step cannot be compiled (NOTE: [a way no
    program holds])."""
    where = _where_it_failed(exc)
    if isinstance(exc, ItemUsedInPython):
        # a comparison of the number (``max(n, 1)``, ``n if n > 0 else 1``) is the `if`,
        # and the number itself is used further on: the refusal capture gives ``l / n``
        # alone, with its advice, rather than the `if`'s generic words (fifty-eighth
        # session: "a check ... came out False" on the first call, no hint)
        return (
            f"{REFUSED_ITEM}{where or ' further on'}: {exc}; only "
            "the way that does not was compiled. Return the value (`return loss.item()` "
            "works: NOTE: [returned .item() values]) and use the number outside the "
            "compiled step, or compute with the tensor itself (a count as "
            "`(y != -100).sum().clamp(min=1)`, not `max(n.item(), 1)`)"
        )
    return (
        f"{REFUSED_READ}{where or ' further on'} (a value-dependent "
        "shape, .item() or an `if`), which no compiled program holds; only the other way "
        "was compiled"
    )


# NOTE: [a value read in what a way raises]
# ``raise ValueError(f"degenerate box at {int(bb)}")`` on the way of an ``if`` on a tensor's
# value reads a value the trace does not have while it builds what it raises. The read
# was taken for a way no program holds (NOTE: [a way no program holds]): the other way
# was compiled, and a call that went this way was refused as "a tensor's value used as a
# Python number", although the step raises there. Where the model's frame that read the
# value runs from the read straight into ``raise X`` (``read_runs_into_raise``: no jump,
# return or re-raise between; a read kept in a variable the `raise` on the next line
# formats counts too), the way raises: a check's raising way, and a call that goes there
# raises ``SPMDRuntimeError`` saying the step raises there, as for ``raise
# ValueError("degenerate box")``. A read followed by code that goes on (``s =
# int(bb)`` used by the loss) is not: it stays a way no program holds, as before. A
# ``.tolist()`` or f-string of ``.item()`` in the message needs none of this: it formats
# the ``TracedItem`` without reading the value.
def _read_raise_text(exc: BaseException) -> str:
    """What a way raises whose ``raise`` reads a tensor's value (NOTE: [a value read in
    what a way raises])."""
    return (
        f"a raise{_where_it_failed(exc) or ' further on'}, which reads a tensor's value in "
        "Python for its message"
    )


def _drop_refused_value_reads(gm: torch.fx.GraphModule) -> None:
    """The trace records ``.item()``'s read before the fake tensor refuses it; a read
    answered by a ``TracedItem`` (NOTE: [returned .item() values]) or by a constant has
    no users in the graph and must not run in the second trace."""
    dropped = [
        node for node in gm.graph.nodes
        if node.target is torch.ops.aten._local_scalar_dense.default and not node.users
    ]
    for node in dropped:
        gm.graph.erase_node(node)
    if dropped:
        gm.recompile()


def _requires_grad_in_first_trace(ref: StateRef, meta: TensorMeta) -> bool:
    if ref.kind is Kind.HYPERPARAM:
        return ref.optimizer >= 0  # learning rates (NOTE: [capture in two traces])
    # a tensor argument as the caller's (NOTE: [tensor arguments that require grad])
    return ref.kind in (Kind.PARAM, Kind.INPUT) and meta.requires_grad


def _refuse_hooks_left_on_parameters(
    params: dict[str, torch.Tensor], compute: dict[str, torch.Tensor], where: str | None
) -> None:
    """NOTE: [hooks on parameters] in ``api.py``: a hook the step registered on a
    parameter and left registered is refused (one it removed is traced)."""
    for name, p in params.items():
        if private.has_tensor_hooks(p) or private.has_tensor_hooks(compute.get(name, p)):
            raise SPMDCompileError(
                f"The train step registers a hook on parameter {name} (Tensor.register_hook "
                "or register_post_accumulate_grad_hook) and leaves it registered: eager runs "
                "it again on every later step, while a compiled step runs only the hooks "
                "registered and removed within the same call (NOTE: [hooks on parameters]).",
                user_line=where,
                hint="remove the hook before the step returns (handle = p.register_hook(fn); "
                "...; handle.remove()) and register it on every call, or change the "
                "gradient in the step between loss.backward() and optimizer.step() "
                "(p.grad.mul_(0.1)).",
            )


def _requires_grad_set(
    params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], real: Mapping[str, torch.Tensor],
    found: list[tuple[str, bool]], param_dtype: torch.dtype | None, where: str | None,
) -> tuple[tuple[str, bool], ...]:
    """NOTE: [requires_grad set in the step]
    A step that freezes or unfreezes parameters itself (``model[0].requires_grad_(False)``
    on some call; pix2pix's ``set_requires_grad(netD, False)`` before the generator's
    update, left so) runs that Python at capture only, on the stand-ins of the trace:
    the program computes as eager does on that call, but before the fifty-ninth session
    the user's parameters kept their flags, so the next call's program key saw the old
    flags and ran the program of those, training the frozen layer on (SGD, float64,
    freeze on call 2 of 4: the first layer's weight 6.2e-2 relative off eager, no
    warning; unfreezing alike). The flag each parameter has when the step returns is
    recorded here, where it differs from the one the trace found (a toggle and back
    records nothing), and set on the user's parameters after every call of the program
    completed (``api.py``), so the next call's key reads them and runs, or compiles, the
    program for those flags; a call refused or failed sets nothing. Refused: a buffer
    made to require grad (eager would make it an autograd leaf; the program's buffers
    take no gradient), and, with ``param_dtype``, a parameter made to require grad (its
    cast for forward was made, without a gradient, before the step ran). Refused too,
    with the flag put back: the user's parameter itself set while traced, reached
    through a reference held outside the modules (a global list of parameters): the
    trace's stand-in kept its flag, so the program would train a layer eager freezes
    (3.4e-2 off eager before). That compares the flags after the trace only, and a
    freeze set back within the step (Spinning Up's ``q_params``) passed it: such a set
    is refused at the set since the sixty-eighth session (NOTE: [parameters held
    outside the modules]); this check stays for a set no torch function mode sees."""
    for name, before in found:
        if real[name].requires_grad != before:
            for other, flag in found:
                real[other].requires_grad_(flag)
            raise SPMDCompileError(
                f"The train step sets requires_grad of parameter {name} through a reference "
                "held outside its modules (a list of parameters made before the call): the "
                "compiled step traces the modules' parameters, so the program would not see "
                "the change (NOTE: [requires_grad set in the step]).",
                user_line=where,
                hint="set it through the module inside the step (model[0].requires_grad_(False), "
                "or on p for p in model[0].parameters()), or before calling the step.",
            )
    for name, b in buffers.items():
        if b.requires_grad and b.is_leaf:  # an in-place update from a graph is no flag set
            raise SPMDCompileError(
                f"The train step makes buffer {name} require grad (requires_grad_() on it, or "
                "on a module that holds it): a compiled step's buffers take no gradient "
                "(NOTE: [requires_grad set in the step]).",
                user_line=where,
                hint="make it a parameter (nn.Parameter, registered on the module) if it is "
                "to be trained, or leave its requires_grad False.",
            )
    changed = tuple(
        (name, params[name].requires_grad) for name, before in found
        if params[name].requires_grad != before
    )
    if param_dtype is not None and any(flag for _, flag in changed):
        name = next(n for n, flag in changed if flag)
        raise SPMDCompileError(
            f"The train step makes parameter {name} require grad (requires_grad_(True)), "
            f"with param_dtype={param_dtype}: its cast for forward is made before the step "
            "runs, so the program would compute no gradient for it, where eager does "
            "(NOTE: [requires_grad set in the step]).",
            user_line=where,
            hint="unfreeze the parameter before calling the compiled step (outside it): the "
            "next call then compiles the program for the new flags.",
        )
    return changed


def _refuse_argument_gradients(
    values: dict[StateRef, torch.Tensor], requiring: list[StateRef], set_at: dict[int, SourceLocation | None]
) -> None:
    """NOTE: [tensor arguments that require grad]
    A tensor argument that requires grad is traced as one, so the step computes as eager
    does with it (``torch.autograd.grad(out, x)``, a gradient penalty, needs nothing
    more). But where the step's ``backward()`` reaches it, eager leaves the gradient in
    the caller's ``x.grad`` (or, for a tensor made by autograd-tracked code outside the
    step, carries it back into that code), and the program writes no gradient of its
    arguments back: before 2026-12-03 such a step returned ``x.grad`` as None and left
    the caller's unset, silently. That is refused, naming the argument; the way out
    keeps eager's result and the program's alike: a copy made in the step,
    ``x = x.detach().requires_grad_()``, whose gradient the step reads and returns.
    An argument the caller passed without requires_grad and the step switched on
    (``real.requires_grad_()`` for an R1 penalty) is not refused: it compiled before, and
    its gradient reaches the weights alike (eager's side effect on the caller's tensor,
    its flag and ``.grad``, is not repeated). Where the step's own ``requires_grad_``
    set the flag of the tensor passed (on an earlier eager run of the step), the
    refusal names that line (NOTE: [requires_grad set on an argument by the step])."""
    for ref in requiring:
        traced = values[ref]
        if traced.grad is not None:
            name = ref.name or f"input[{ref.index}]"
            fix = f"`{name} = {name}.detach().requires_grad_()`"
            if id(traced) in set_at:
                raise SPMDCompileError(
                    f"backward() in the train step computes a gradient for its tensor argument "
                    f"{name}, which requires grad because the step calls {name}.requires_grad_() "
                    "on the caller's tensor: eager sets the caller's flag there (so the tensor "
                    "passed again, or run through the step eagerly before, arrives requiring "
                    f"grad) and leaves the gradient in the caller's {name}.grad, but a compiled "
                    "step does not write gradients of its arguments back (NOTE: [requires_grad "
                    "set on an argument by the step]).",
                    user_line=set_at[id(traced)],
                    hint=f"make the leaf a copy in the step instead, {fix} at that line (eager "
                    f"then leaves the caller's {name} alone too), and pass {name} without "
                    "requires_grad (`.detach()`) where an earlier eager run set it.",
                )
            raise SPMDCompileError(
                f"backward() in the train step computes a gradient for its tensor argument "
                f"{name}, which requires grad: eager leaves it in {name}.grad (or carries it "
                "back into the code outside the step that made the tensor), but a compiled "
                "step does not write gradients of its arguments back (NOTE: [tensor "
                "arguments that require grad]).",
                hint=f"pass {name} without requires_grad (`.detach()`), and where the step "
                f"needs its gradient (an adversarial example), make the leaf in the step: "
                f"{fix}, then read `{name}.grad` there and return what the caller needs.",
            )


# NOTE: [float arguments the program does not read]
# A float argument the trace with tensor stand-ins (NOTE: [float arguments as graph
# inputs]) leaves unread (an unused ``lr_for_logging``, ``w if use_w else 1.0`` with
# ``use_w`` False) is a guard: a new value compiles a new program. That trace cannot
# tell an argument the step ignores from one whose value the step reads where the
# capture cannot see it: a type test (``isinstance(w, float)``, ``isinstance(w,
# np.floating)``: False for the tensor stand-in) sends the stand-in down another path
# than eager's, one that does not read it, while eager's path reads the value, often
# through C code (``math.isclose(w, 1.0)``, ``"%.1f" % w``) that no Python-level hook
# observes. A second trace with the floats themselves and a comparison
# of the programs (2026-12-06, reverted the same day) ran later values as the first
# one's program, silently: ``if isinstance(w, float) and not math.isclose(w, 1.0): loss =
# loss * w`` first called with 1.0 gave the same program, and 0.5 and 2.0 then ran as
# 1.0 (parameters 5e-1 off eager). So an unread float stays a guard, exact by
# construction; the recompile warning says why, and to pass the step only what it uses
# or to use the value in tensor ops (``CapturedStep.floats_unread``).


def _check_float_arguments_read(gm: torch.fx.GraphModule, refs: list[StateRef]) -> None:
    """A float argument the program does not read may have steered Python (a type
    test): it must be a guarded constant instead (NOTE: [float arguments the program
    does not read]); the floats the program reads stay graph inputs."""
    unread = frozenset(
        ref.index for node, ref in zip(placeholders(gm), refs, strict=True)
        if ref.kind is Kind.HYPERPARAM and ref.optimizer < 0 and not node.users
    )
    if unread:
        named = ", ".join(str(i) for i in sorted(unread))
        raise FloatArgumentUsedInPython(f"arguments {named} are not read by the program", unread, unread=True)


# What to write instead of an op whose output shape depends on values (by op name).
_COUNTS_HINT = (
    "count with a fixed length instead: torch.bincount(labels, minlength=n) compiles as n "
    "bins (a call with a label >= n raises: NOTE: [counts of a fixed length]), as do "
    "torch.zeros(n).index_add_(0, labels, torch.ones_like(labels, dtype=torch.float)) and "
    "F.one_hot(labels, n).sum(0); (counts > 0).sum() for the number of distinct labels."
)
# NOTE: [repeats of a fixed total at capture] (capture/repeated_rows.py): the forms that
# compile; before the sixty-sixth session this said to pass a Python list, which
# torch.repeat_interleave does not take
_REPEATS_HINT = (
    "give the frames a fixed length T: pad the durations so each row sums to T (a pad "
    "entry takes the rest) and pass output_size=T: torch.repeat_interleave(x, dur, dim=0, "
    "output_size=T) (a call whose repeats sum to another total raises, as eager does); or "
    "gather by indices padded to T: ends = dur.cumsum(-1); idx = torch.searchsorted(ends, "
    "torch.arange(T).expand(B, T), right=True).clamp(max=P - 1); frames = x.gather(1, "
    "idx[..., None].expand(-1, -1, D)), masked past ends[:, -1:]; or an alignment matrix: "
    "t = torch.arange(T)[None, :, None]; frames = ((t >= (ends - dur)[:, None]) & (t < "
    "ends[:, None])).to(x.dtype) @ x. An int repeats (x.repeat_interleave(2, 0)) is a "
    "shape and compiles as it is."
)
_VALUE_SHAPE_HINTS = {
    "bincount": _COUNTS_HINT,
    "_unique2": _COUNTS_HINT,
    "unique_dim": _COUNTS_HINT,
    "unique_consecutive": _COUNTS_HINT,
    "repeat_interleave": _REPEATS_HINT,
}


def _raised_in(exc: BaseException, filename: str) -> bool:
    """The exception passed through a frame of a file named ``filename``."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.endswith(filename):
            return True
        tb = tb.tb_next
    return False


def _fake(meta: TensorMeta, fake_mode: Any, first_trace: bool) -> torch.Tensor:
    with fake_mode:
        t = torch.empty(meta.shape, dtype=meta.dtype, device=meta.device)
    return t.requires_grad_(first_trace)


# NOTE: [a step that changes what it reads] (capture/guards.py): one capture may trace the
# step several times (the ways of a value check, a float argument retried as a constant,
# SGD's momentum retried); each trace starts from the values the call found, which the
# innermost ``traces_start_from`` guards put back (an earlier trace's ``model.warmup =
# False`` made the next one trace the path without the set-up: loss 9x off on the first
# call), and the capture leaves the values the trace of its program wrote, on the values
# the call found (a value check's other way, traced last, left its own: until the
# fifty-fourth session they stayed where the program's trace wrote nothing, so a step
# with ``model.eval()``, a ``torch.multinomial`` and ``model.train()`` was left in eval
# mode and refused as changing ``training`` every run)
_TRACE_STARTS: list[Any] = []
# NOTE: [hooks each trace starts from]: beside each entry of ``_TRACE_STARTS``, the hook
# dicts followed (None: not followed); the user's hooks in them as the call found them,
# the capture's own (its module hooks naming scopes, installed around each trace) left
_HOOK_STARTS: list[HooksAsFound | None] = []
_HOOKS_CHANGED: list[bool] = []  # beside them: a trace of the capture changed the user's hooks
# beside them: the refusal of NOTE: [set-ups a later trace cannot start without], kept (the
# ways of a value check go on past a capture's own errors) and raised as the capture ends
_SET_UPS_REFUSED: list[SPMDCompileError | None] = []


@contextlib.contextmanager
def traces_start_from(found: Any, hooks: HooksAsFound | None = None) -> Iterator[None]:
    """``found``: the guards of the values the call found (``unwrite`` / ``written``);
    ``hooks``: the hook dicts as it found them (NOTE: [hooks each trace starts from]).
    The user's cached functions ``found`` reached are called through meanwhile (NOTE:
    [the user's cached functions at capture])."""
    found.note_found()  # NOTE: [contents a step changes in place]
    _TRACE_STARTS.append(found)
    _HOOK_STARTS.append(hooks)
    _HOOKS_CHANGED.append(False)
    _SET_UPS_REFUSED.append(None)
    try:
        with user_caches_called_through(found.cached_functions()), (
            hooks.calls_noted() if hooks is not None else contextlib.nullcontext()
        ):
            yield
    finally:
        _TRACE_STARTS.pop()
        _HOOK_STARTS.pop()
        _HOOKS_CHANGED.pop()
        _SET_UPS_REFUSED.pop()


def _hooks_put_back() -> bool:
    """Whether the traces of this capture start from the call's hooks, its attributes
    made and its lists / dicts changed in place (NOTE: [hooks each trace starts from]):
    not once a trace registered or removed a user's hook. A set-up keeps what goes with
    its hook where no rule here reaches (the handle in an attribute, ``self.h = None``
    after ``self.h.remove()``): putting the hook back without them made later traces
    skip the set-up and lose the hook, or keep a hook the step removes (a review: losses
    2x eager's). Such a capture's traces start as before the sixty-third session: from
    the plain values the call found, the rest as the earlier trace left it: right where
    the hook was registered before its module ran, refused where after (NOTE: [set-ups
    a later trace cannot start without])."""
    return not (_HOOKS_CHANGED and _HOOKS_CHANGED[-1])


def _note_hook_changes() -> None:
    """At the end of a trace: remember that it changed the user's hooks (sticky)."""
    if _HOOK_STARTS and _HOOK_STARTS[-1] is not None and _HOOK_STARTS[-1].user_changed():
        _HOOKS_CHANGED[-1] = True


def _start_as_found(func: Callable[..., Any] | None = None) -> None:
    """NOTE: [a step that changes what it reads], NOTE: [hooks each trace starts from]
    A trace starts from the Python values and the hooks the call found. A one-time
    set-up that registers a hook beside its flag (``if not hasattr(self, "hooked"):
    register_forward_hook(fn); self.hooked = True``) registered it again in each trace
    of the capture (each ``if`` on a tensor value stops a trace and starts the next),
    and the program of the first call ran the hooks of every trace: a hook doubling the
    output ran 4 times (loss 19.9 against eager's 0.47), and 4 stayed on the model.
    Until the sixty-third session the flag was not put back either (an attribute made
    on a torch module, NOTE: [attributes a step makes on a counted object]): the hook
    a first trace registered ran in the second, whose program served the first call
    (0.62 against 0.47). ``func``: the step, where a trace starts (not where the capture
    leaves the values: ``_leave_written``)."""
    _note_hook_changes()  # by the trace before, stopped at an `if` or complete
    whole = _hooks_put_back()
    _refuse_set_ups_not_put_back(func, whole)
    if _TRACE_STARTS:
        _TRACE_STARTS[-1].unwrite(made=whole)
    if _HOOK_STARTS and _HOOK_STARTS[-1] is not None:
        if whole:
            _HOOK_STARTS[-1].put_back()
        _HOOK_STARTS[-1].note_start()  # NOTE: [set-ups a later trace cannot start without]


# NOTE: [set-ups a later trace cannot start without]
# Where a trace of the capture changed what no rule here sets back for the next, that
# trace starts from other values than the call found, and its program (the one that
# runs the first call) computes other numbers than eager's first call. Three such changes
# are refused at the start of the trace after, naming what changed and where:
# - a user's forward / backward hook registered or removed on a module after the module
#   ran in the trace (``HooksAsFound.calls_noted``): the trace ran the module as eager's
#   first call does, without the hook, and the next would run it with the hook, which
#   the program of the first call then ran (loss 2.80 against eager's 1.46, silently,
#   until the sixty-fourth session). Hooks registered before the module runs (beside a
#   flag) start the next trace as they are: it runs the module as the first did. A trace
#   that ends with the hooks it started with (a hook registered before the forward and
#   removed after it, to read activations: ``HooksAsFound.note_start``) leaves the next
#   trace starting as it did, whatever changed between: exact, and not refused (it was,
#   in the sixty-fourth session only: a review);
# - a plain value made under a name no code the walk read names, where the user's code
#   computes attribute names (``setattr(model, name, True)``, read back by ``getattr``:
#   ``Guards.made_elsewhere``): a library's flag made beside its hooks is no set-up to
#   remove (NOTE: [attributes a step makes on a counted object]), and this one cannot be
#   told from it (the first call 10x off eager before, silently);
# - a guarded container of a dict / list / set subclass no ``_Contents`` sets back (a
#   user's ``class Flags(dict)``, a ``Counter``: it may keep more than its items) that
#   differs from what the call found (``Guards.not_set_back``; the first call 10x off
#   eager, silently, until the sixty-fifth session).
# A capture of one trace checks nothing but an empty record and the sizes of the dicts
# its guards count; the hooks are noted by a global forward pre-hook while tracing.


def _refuse_set_ups_not_put_back(func: Callable[..., Any] | None, whole: bool) -> None:
    """NOTE: [set-ups a later trace cannot start without]: refuse a trace's start from
    what the trace before changed and no rule sets back (``func`` None: the capture
    ends, and raises a refusal kept)."""
    if not _SET_UPS_REFUSED:
        return
    if _SET_UPS_REFUSED[-1] is not None:
        raise _SET_UPS_REFUSED[-1]
    if func is None:
        return
    try:
        _refuse_set_ups_changed(func, whole)
    except SPMDCompileError as exc:
        _SET_UPS_REFUSED[-1] = exc
        raise


def _refuse_set_ups_changed(func: Callable[..., Any], whole: bool) -> None:
    hooks = _HOOK_STARTS[-1] if _HOOK_STARTS else None
    changed = hooks.changed_after_call() if hooks is not None else None
    if changed is not None:
        module, kind, hook, registered = changed
        fn = getattr(hook, "func", hook)
        code = getattr(fn, "__code__", None)
        named = getattr(fn, "__qualname__", type(fn).__qualname__) + (
            f" ({code.co_filename}:{code.co_firstlineno})" if code is not None else "")
        raise SPMDCompileError(
            f"The train step {'registers' if registered else 'removes'} a hook of a {type(module).__name__} "
            f"({kind.strip('_').replace('_', ' ')[:-1]} {named}) after that module ran, beside an "
            "`if` on a tensor value: the capture traces the step once for each way of such "
            "an `if`, each from what the call found, and the trace after this one would "
            "run the module with the hook changed, which eager's first call does not "
            "(NOTE: [set-ups a later trace cannot start without]).",
            user_line=step_where(func),
            hint=("make the set-up before the first call (register the hook outside the "
                  "compiled step), or register it in the step before the module runs, or "
                  "remove it again before the step returns (a hook for this call only)"
                  if registered else
                  "make the set-up before the first call (remove the hook outside the "
                  "compiled step), or remove it in the step before the module runs")
            + "; a hook registered or removed between calls recompiles the step.",
        )
    kept = _TRACE_STARTS[-1].not_set_back() if _TRACE_STARTS else []
    if kept:
        where, value = kept[0]
        raise SPMDCompileError(
            f"The train step changes {where}, a {type(value).__qualname__} (now {value!r}), beside "
            "an `if` on a tensor value: the capture traces the step once for each way of such "
            "an `if`, each from what the call found, and cannot set a container of this "
            "class back (it may keep more than its items), so the trace after this one "
            "would start from the change (NOTE: [set-ups a later trace cannot start without]).",
            user_line=step_where(func),
            hint="keep the flag in a plain dict, list or set (or an OrderedDict / "
            "defaultdict), or make the set-up before the first call; the refused call "
            "left the value as it found it.",
        )
    made = _TRACE_STARTS[-1].made_elsewhere() if whole and _TRACE_STARTS else []
    if made:
        where, value = made[0]
        raise SPMDCompileError(
            f"The train step makes {where} = {value!r} through a name its code computes, "
            "beside an `if` on a tensor value: the capture traces the step once for each "
            "way of such an `if`, each from what the call found, and cannot tell this "
            "value from a library's own flag to leave, so the trace after this one would "
            "start from it (NOTE: [set-ups a later trace cannot start without]).",
            user_line=step_where(func),
            hint="make the set-up before the first call (set the attribute outside the "
            "compiled step, or give it a value there first), or name the attribute in the "
            "step's code (getattr(model, 'warm', False)).",
        )


def _leave_written(tracer: _StepTracer) -> None:
    """Leave the values as the trace of the program left them: first those the call
    found, since a way traced after it (a value check's raising way) left its own where
    the program's trace wrote nothing or wrote the value back (``model.eval()``, a
    ``torch.multinomial`` check's raise, ``model.train()``: the raising way stopped with
    ``training`` False, the program's way changed nothing, and the capture left the
    model in eval mode, refused as a value changed every run); so too the hooks."""
    _start_as_found()
    for container, key, value in tracer.written:
        set_or_delete(container, key, value)
    if _hooks_put_back() and _HOOK_STARTS and _HOOK_STARTS[-1] is not None and tracer.hooks_left is not None:
        _HOOK_STARTS[-1].put_back(tracer.hooks_left)


class _StepTracer:
    """The function traced by ``make_fx``: the user's step on swapped-in state."""

    def __init__(
        self,
        func: Callable[..., Any],
        bindings: StepBindings,
        refs: list[StateRef],
        options: CaptureOptions,
        decisions: list[bool],
    ) -> None:
        self.func, self.bindings, self.refs, self.options = func, bindings, refs, options
        self.code = step_code(func)
        self.floats = FloatArgumentMode([])
        self.group_numbers = GroupNumbers([])  # NOTE: [optimizer settings read in the step]
        # the Python values this trace wrote (NOTE: [a step that changes what it reads])
        self.written: list[tuple[dict, Any, Any]] = []
        self.hooks_left: HookState | None = None  # the hooks this trace left (``HooksAsFound.now``)
        # NOTE: [value checks]; `self.floats` is this call's (set in __call__)
        self.branches = BranchDecisions(decisions, lambda t: self.floats.is_python_value(t))
        self.checks: list[ValueCheck] = []
        self.out_refs: list[StateRef] = []
        self.return_spec: Any = None
        self.return_leaves: list[tuple[str, Any]] = []
        self.kept: list[KeptTensor] = []
        # NOTE: [a step's own fork_rng]: set when the trace completes
        self.rewound_generators: tuple[str, ...] = ()
        self.schedulers: SchedulerSteps | None = None
        self.outside: dict[int, list[FoundTensor]] = {}
        self.outside_reads: dict[int, tuple[torch.Tensor, Any]] = {}  # OutsideWrites.read
        self.unplaced: dict[int, str] = {}  # KeptTensors.unplaced
        self.inherited: dict[int, str] = {}  # KeptTensors.inherited
        self._params: dict[str, torch.Tensor] = {}
        # NOTE: [requires_grad set in the step]: (parameter name, flag) of each parameter
        # whose requires_grad the step left other than it found it
        self.requires_grad_after: tuple[tuple[str, bool], ...] = ()
        # each optimizer's state during the trace, and its parameters by name
        self.swapped: list[tuple[initial_state.RecordedStates, dict[str, tuple[int, torch.Tensor]]]] = []

    def mark_gradients(self) -> None:
        """Mark the gradients backward left (NOTE: [gradients settle after backward])."""
        mark_gradients(self._params)

    def __call__(self, *flat: torch.Tensor) -> list[torch.Tensor]:
        _start_as_found(self.func)  # NOTE: [a step that changes what it reads]
        b = self.bindings
        values = dict(zip(self.refs, flat, strict=True))
        params = {r.name: v for r, v in values.items() if r.kind is Kind.PARAM}
        buffers = {r.name: v for r, v in values.items() if r.kind is Kind.BUFFER}
        for r, v in values.items():
            if r.kind is Kind.GRAD:
                params[r.name].grad = v
        self._params = params
        traced_args = list(b.flat_args)
        positions = [i for i, _ in b.tensor_args()]
        # NOTE: [tensor arguments that require grad]: as the caller passed them
        requiring = [r for r, v in values.items() if r.kind is Kind.INPUT and v.requires_grad]
        stand_ins, stand_in_indices = [], []
        for r, v in values.items():
            if r.kind is Kind.INPUT:
                traced_args[positions[r.index]] = v
            elif r.kind is Kind.HYPERPARAM and r.optimizer < 0:
                traced_args[r.index] = v
                stand_ins.append(v)
                stand_in_indices.append(r.index)
        args, kwargs = pytree.tree_unflatten(traced_args, b.args_spec)
        closed = Closed()  # NOTE: [batch containers]
        if b.containers:
            args, kwargs = close_containers((args, kwargs), b.containers, closed)
        self.floats = FloatArgumentMode(stand_ins, stand_in_indices)
        self.group_numbers = GroupNumbers(_group_numbers(b, values))
        compute = _compute_params(params, self.options.param_dtype)
        _carry_python_attributes(b.params, params, compute)  # NOTE: [Python attributes of parameters]
        found_flags = [(name, p.requires_grad) for name, p in params.items()]
        with contextlib.ExitStack() as stack:
            casts: list[tuple[torch.nn.Module, dict[str, torch.Tensor]]] = []
            for mi, mod in enumerate(b.modules):
                # NOTE: [low-precision parameters inside forward only]: the step sees
                # the parameters themselves; module forward calls see their casts
                swap = {fqn: params[name] for fqn, name in b.module_params[mi].items()}
                swap.update({fqn: buffers[name] for fqn, name in b.module_buffers[mi].items()})
                stack.enter_context(private.reparametrize_module(mod, swap))
                if self.options.param_dtype is not None:
                    casts.append((mod, {fqn: compute[name] for fqn, name in b.module_params[mi].items()}))
                    stack.enter_context(_cast_forward_inputs(mod, self.options.param_dtype))
            if casts:
                stack.enter_context(_casts_inside_forward(casts))
            swapped = self.swapped = [
                stack.enter_context(_swap_optimizer(opt, oi, b, params, values, self.code))
                for oi, opt in enumerate(b.optimizers)
            ]
            stack.enter_context(parameters_copied_as_eager(b.params, params))  # NOTE: [deep copies of the step's parameters]
            # NOTE: [optimizers over tensors made in the call]
            others = stack.enter_context(OtherOptimizers([*b.optimizers, *b.wrappers], list(values.values()), self.code))
            # NOTE: [loss scaling in the program]
            scaler_finals = stack.enter_context(traced_scalers(b.scalers, values))
            # NOTE: [schedulers stepped in the step]
            self.schedulers = stack.enter_context(
                SchedulerSteps(b.schedulers, b.optimizers, others.made_in_the_call)
            )
            stack.enter_context(ItemsAsOutputs())  # NOTE: [returned .item() values]
            stack.enter_context(checks_on_items())
            stack.enter_context(self.branches)
            real_inputs = [t for _, t in b.tensor_args()]
            # NOTE: [selections by a mask of the batch], NOTE: [rows of one count]
            stack.enter_context(mask_selections(self.refs, real_inputs.__getitem__))
            stack.enter_context(TensorIndicesTaken())  # NOTE: [0-d tensor indices at capture]
            stack.enter_context(python_effects(self.code, (self.func, *b.modules, *b.flat_args)))
            outside_writes = stack.enter_context(OutsideWrites())  # NOTE: [tensors read from outside the arguments]
            stack.enter_context(private.data_setter_of_torch())  # NOTE: [data replaced between calls]
            keeper = KeptTensors(self.func, b, (args, kwargs))  # NOTE: [tensors the step keeps]
            self.outside = outside_writes.found = keeper.outside
            self.outside_reads = outside_writes.read  # NOTE: [outside tensors read as Python values]
            outside_writes.templates = b.templates  # NOTE: [meta templates read by name]
            outside_writes.unplaced = keeper.unplaced
            outside_writes.state = {id(p) for p in b.params.values()}
            self.unplaced = keeper.unplaced
            self.inherited = keeper.inherited
            try:
                with (
                    self.group_numbers, self.floats if stand_ins else contextlib.nullcontext(),
                    ScalarTensors(self.floats.is_stand_in),  # NOTE: [0-d tensors in Scalar arguments]
                    RegistrationsWatched(b.modules) as registered,
                    RequiresGradCalls([values[r] for r in requiring]) as flags_set,
                    # NOTE: [parameters held outside the modules]
                    HeldParameterUses(b, params, [*b.optimizers, *b.wrappers]),
                ):
                    result = self.func(*args, **kwargs)
                others.refuse_kept()
                # NOTE: [outside tensors written through shared memory in the step]
                if (written := outside_writes.restore_written()) is not None:
                    raise written_through_shared_memory(written[0], step_where(self.func), written[1])
                settle_removed_state(b.optimizers, swapped)  # NOTE: [optimizer state removed in the step]
                refuse_state_registered(b, registered, step_where(self.func), params)  # NOTE: [state registered in the step]
                _refuse_argument_gradients(values, requiring, flags_set.set_at)
                _refuse_hooks_left_on_parameters(params, compute, step_where(self.func))
                self.requires_grad_after = _requires_grad_set(
                    params, buffers, b.params, found_flags, self.options.param_dtype, step_where(self.func)
                )
                closed.refuse_writes(step_where(self.func))
                kept = keeper.collect(step_where(self.func))
                # NOTE: [selected rows kept in place]: what leaves the step is eager's
                selected_rows.settle([result, [value for _, value in kept]], at_selection=True,
                                     use="the step's result or a tensor it keeps")
                result, kept = selected_rows.compacted((result, kept))  # NOTE: [rows of one count]
            finally:
                keeper.restore()
                outside_writes.restore_written()  # a refused trace leaves them as found
            final_buffers = {
                b.module_buffers[mi][fqn]: t
                for mi, mod in enumerate(b.modules)
                for fqn, t in mod.named_buffers(remove_duplicate=False)
            }
            outs = self._collect(result, params, final_buffers, swapped, values, kept)
            for ref, value in scaler_finals():
                self.out_refs.append(ref)
                outs.append(value)
        return outs

    def _kept_number(self, target: KeptTensor, value: Any) -> None:
        """NOTE: [kept Python numbers]
        A value the step keeps that stands for a Python number (``opt.last_w = w`` of a
        float argument ``w``, a custom optimizer's ``self.last_lr = group["lr"]``) is
        stored after every call as the number eager stores (``.item()`` of the call's
        value), as a returned one is; before a review of the fifty-ninth session it was
        a 0-dim float64 tensor where eager has a float. A number computed from a float
        argument only is refused as a returned one is (the argument is then captured as
        a guarded constant)."""
        if not isinstance(value, torch.Tensor):
            return
        index = self.floats.index_of.get(id(value)) if self.floats.is_stand_in(value) else None
        if index is not None and type(self.bindings.flat_args[index]) is not float:
            raise FloatArgumentUsedInPython(f"the step keeps a NumPy float64 argument in {target.label}", frozenset({index}))
        if index is not None:
            target.as_item = True
            return
        if self.floats.is_stand_in(value):
            raise FloatArgumentUsedInPython(f"the step keeps a value computed from a float argument only in {target.label}")
        number = self.group_numbers.returned(value)
        if number is not None:  # NOTE: [optimizer settings read in the step]
            how = _returned_number(*number, step_where(self.func))
            target.as_item, target.as_int = how == "item", how == "int"

    def _refuse_traced_inside(self, leaf: Any) -> None:
        """NOTE: [returned objects holding traced values] (``containers.py``)."""

        def traced(x: Any) -> bool:
            if isinstance(x, torch.Tensor):
                return private.traced_within_transforms(x) or self.floats.is_stand_in(x)
            return isinstance(x, TracedItem)

        path = traced_inside(leaf, traced)
        if path is None:
            return
        kind = type(leaf).__qualname__
        why = (
            f" ({kind} is a subclass of {type(leaf).__mro__[-2].__name__} with attributes set "
            "on the object, which is not opened: NOTE: [subclasses of dict, list and tuple])"
            if isinstance(leaf, (dict, list, tuple)) and getattr(leaf, "__dict__", None) else ""
        )
        hint = (
            "return the values in a dict, a tuple, a @dataclass or a "
            "types.SimpleNamespace (opened and rebuilt with each call's values), or "
            "register the class with torch.utils._pytree.register_pytree_node."
        )
        if distribution_object(leaf):  # NOTE: [returned distributions] (``containers.py``)
            why = f" (NOTE: [returned distributions]: a torch.distributions {kind} is not opened)"
            hint = (
                f"return the tensors the {kind} is built from (return loss, out; or "
                "d.logits, d.loc, d.scale) and build the distribution from them outside "
                "the compiled step (Categorical(logits=out))."
            )
        raise SPMDCompileError(
            f"The train step returns a {kind} holding a value it computed ({path}): a "
            f"compiled step returns what pytree does not open as it is{why}, so every call "
            f"would get the same {kind}, holding the trace's stand-in tensors instead of the "
            f"call's values.",
            user_line=step_where(self.func),
            hint=hint,
        )

    def _collect(self, result, params, final_buffers, swapped, values, kept) -> list[torch.Tensor]:
        # NOTE: [batch containers]: a returned dataclass is opened as an argument is
        leaves, self.return_spec = pytree.tree_flatten(open_containers(result, lambda x: False))
        outs: list[torch.Tensor] = []
        for leaf in leaves:
            number = self.group_numbers.returned(leaf)
            index = self.floats.index_of.get(id(leaf)) if self.floats.is_stand_in(leaf) else None
            if index is not None:
                # a float argument returned as it is: the number eager returns
                # (NOTE: [float arguments as graph inputs])
                self.return_leaves.append(("item", len(outs)))
                self.out_refs.append(StateRef(Kind.RETURN, index=len(outs)))
                outs.append(leaf)
            elif self.floats.is_stand_in(leaf):
                raise FloatArgumentUsedInPython("the step returns a value computed from a float argument only")
            elif number is not None:  # NOTE: [optimizer settings read in the step]
                self.return_leaves.append((_returned_number(*number, step_where(self.func)), len(outs)))
                self.out_refs.append(StateRef(Kind.RETURN, index=len(outs)))
                outs.append(leaf)
            elif isinstance(leaf, (torch.Tensor, TracedItem)):
                kind = "item" if isinstance(leaf, TracedItem) else "tensor"
                self.return_leaves.append((kind, len(outs)))
                self.out_refs.append(StateRef(Kind.RETURN, index=len(outs)))
                outs.append(leaf.tensor if isinstance(leaf, TracedItem) else leaf)
            elif isinstance(leaf, LRReadAfterSchedulerStep):
                leaf.refuse_at(return_line(self.func), returned=True)
            else:
                self._refuse_traced_inside(leaf)
                self.return_leaves.append(("const", leaf))
        for site in self.branches.sites:  # NOTE: [value checks]
            self.checks.append(ValueCheck(len(outs), site.expected, site.where, site.raised))
            self.out_refs.append(StateRef(Kind.RETURN, index=len(outs)))
            outs.append(site.condition)
        for target, value in kept:  # NOTE: [tensors the step keeps]
            self._kept_number(target, value)
            target.index = len(outs)
            self.kept.append(target)
            self.out_refs.append(StateRef(Kind.RETURN, index=len(outs)))
            outs.append(value.tensor if isinstance(value, TracedItem) else value)
        for name, p in params.items():
            self.out_refs.append(StateRef(Kind.PARAM, name))
            outs.append(p)
        for name, t in final_buffers.items():
            self.out_refs.append(StateRef(Kind.BUFFER, name))
            outs.append(t)
        for name, p in params.items():
            if p.grad is not None:
                self.out_refs.append(StateRef(Kind.GRAD, name))
                outs.append(p.grad)
        for oi, (opt_state, by_param) in enumerate(swapped):
            for name, (gi, traced_p) in by_param.items():
                for key, value in sorted(opt_state.get(traced_p, {}).items()):
                    if isinstance(value, torch.Tensor):
                        self.out_refs.append(StateRef(Kind.OPTIM_STATE, name, key, oi, gi))
                        outs.append(value)
            for gi, key, group in opt_state.group_tensors:  # NOTE: [tensors held in a param group]
                self.out_refs.append(StateRef(Kind.GROUP_STATE, key=key, optimizer=oi, group=gi))
                outs.append(dict.__getitem__(group, key))
        return outs


_MISSING = object()


def _carry_python_attributes(real: Mapping[str, torch.Tensor], *traced: dict[str, torch.Tensor]) -> None:
    """NOTE: [Python attributes of parameters]
    Code marks parameters with Python attributes (``p.no_decay = True``, a muP
    ``p.lr_scale``) and reads them in the step (``getattr(p, "no_decay", False)``). The
    trace runs on stand-in tensors, which had none: before 2026-12-02 ``getattr`` gave
    its default, silently, from the first call on. The stand-ins now carry each real
    parameter's attributes (tensor-valued ones left out: a tensor read that way is no
    input of the program, and reading one fails as before). The guards keep their values
    (``_Walker.parameter_attributes``: how many each parameter has, and what each holds),
    and the installed replacement of a parameter holds the same dict of attributes
    (``runtime/runner.py``): the guards built on the parameter read what code sets on
    its replacement."""
    for name, p in real.items():
        own = {key: value for key, value in vars(p).items() if not isinstance(value, torch.Tensor)}
        if own:
            for values in traced:
                vars(values[name]).update(own)


def _compute_params(
    params: dict[str, torch.Tensor], dtype: torch.dtype | None
) -> dict[str, torch.Tensor]:
    """The parameter values compute reads: one cast per parameter (tied weights share it)."""
    if dtype is None:
        return params
    return {
        name: p.to(dtype) if p.is_floating_point() and p.dtype != dtype else p
        for name, p in params.items()
    }


@contextlib.contextmanager
def _casts_inside_forward(casts: list[tuple[torch.nn.Module, dict[str, torch.Tensor]]]) -> Iterator[None]:
    """NOTE: [low-precision parameters inside forward only]
    With ``param_dtype`` set, forward and backward compute with each parameter's cast.
    Before 2026-12-06 the casts were swapped into the modules for the whole step, so
    ``model.parameters()`` after ``backward()`` gave the casts: non-leaf tensors whose
    ``.grad`` is None. ``clip_grad_norm_(model.parameters(), 0.05)`` skipped them all,
    returned 0.0 and clipped nothing (the 6-8-4 MLP, SGD lr 1, 3 steps: losses 1.42,
    1.18, 1.05 where eager clipped gives 1.43, 1.40, 1.37; parameters 0.285 off), and
    ``p.grad.norm()`` failed on None. As FSDP2 does, the casts are now what a module's
    forward reads, and the parameters themselves, with their float32 ``.grad``, are what
    the step reads anywhere else (clipping, gradient reads, the optimizer, a loss term
    read from a weight outside forward). A call of any module of the step's models
    (the root, or a submodule called directly, and the recompute of an activation
    checkpoint inside backward) swaps every model's casts in until the outermost such
    call returns or raises. The casts are made once per trace (tied weights share one),
    so the program is the one the whole-step swap gave."""
    members = {id(m) for root, _ in casts for m in root.modules()}
    depth = [0]
    inside = contextlib.ExitStack()

    def pre_hook(module: torch.nn.Module, args: Any) -> None:
        if id(module) not in members:
            return
        if depth[0] == 0:
            for root, swap in casts:
                inside.enter_context(private.reparametrize_module(root, swap))
        depth[0] += 1

    def post_hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        if id(module) not in members or depth[0] == 0:
            return
        depth[0] -= 1
        if depth[0] == 0:
            inside.close()

    hooks = [
        torch.nn.modules.module.register_module_forward_pre_hook(pre_hook),
        torch.nn.modules.module.register_module_forward_hook(post_hook, always_call=True),
    ]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
        inside.close()


@contextlib.contextmanager
def _cast_forward_inputs(module: torch.nn.Module, dtype: torch.dtype) -> Iterator[None]:
    def cast(x: Any) -> Any:
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    def hook(_module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return pytree.tree_map(cast, args), pytree.tree_map(cast, kwargs)

    handle = module.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def _held_by_an_optimizer(opt: torch.optim.Optimizer, bindings: StepBindings) -> str | None:
    """How the code reaches ``opt`` through an attribute of one of the step's optimizers
    (``optimizer.base_optimizer``), or None."""
    for holder in bindings.optimizers:
        for name, value in vars(holder).items():
            if value is opt:
                return f"optimizer.{name}"
    return None


def _held_by_a_plain_argument(
    opt: torch.optim.Optimizer, func: Callable[..., Any], bindings: StepBindings
) -> tuple[str, str] | None:
    """Where ``opt`` is an attribute of a step argument that is neither a module nor an
    optimizer (a plain Lookahead class holding ``self.base = SGD(...)``): the attribute,
    in words (``base of argument opt``), and that object's class name; or None. Said in
    the refusal: "pass the optimizer" alone was advice the user had followed."""
    try:
        paths = argument_paths(func, bindings.args_spec)
    except Exception:  # noqa: BLE001 - a signature not read: positions
        paths = []
    for i, arg in enumerate(bindings.flat_args):
        if isinstance(arg, (torch.Tensor, torch.nn.Module, torch.optim.Optimizer)):
            continue
        try:
            attributes = vars(arg)
        except TypeError:  # no __dict__ (a number, a string, a slotted object)
            continue
        for name, value in attributes.items():
            if value is opt:
                label = paths[i] if len(paths) == len(bindings.flat_args) else f"args[{i}]"
                return f"{name} of argument {label}", type(arg).__name__
    return None


def _tensor_of_no_module(optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
    """NOTE: [optimizers over tensors of no module]
    An optimizer the step was not given, refused as such (NOTE: [modules and optimizers
    by name]), told the user to pass it and the modules whose parameters it updates;
    where it updates a plain leaf tensor (SAC's ``self.log_alpha = torch.zeros(1,
    requires_grad=True)`` with ``Adam([self.log_alpha])``) no module holds it and passing
    the optimizer was refused again. The first such tensor, for a refusal naming the
    module form (an ``nn.Parameter`` on a module passed to the step)."""
    return next(
        (p for group in optimizer.param_groups for p in group["params"] if not isinstance(p, torch.nn.Parameter)),
        None,
    )


# NOTE: [optimizers created inside the step]
# A trainer that makes its optimizer lazily (``if self.opt is None: self.opt =
# AdamW(self.model.parameters())`` in the step) builds it, while the step is traced,
# over the parameters the trace swapped in: fake tensors. Its step() is refused as any
# optimizer the step was not given is (it would update tensors of the trace once, not
# the model every call), and the message said to pass the optimizer to the step, which
# a user who had none before the call could not do. An optimizer holding a stand-in
# (or a tensor sharing a stand-in's memory) can only have been made during the trace,
# so the refusal says so and to create it before the first call. One over tensors the
# call made alone (Reptile's inner SGD over a per-call clone) is traced since the
# sixty-ninth session (NOTE: [optimizers over tensors made in the call] in
# ``call_optimizers.py``); until then it got this message, whose hint would have
# trained the model's parameters in the inner loop.


def _not_raised_by_the_step() -> tuple[type[BaseException], ...]:
    """Exceptions of the capture itself, not a branch of the step raising (NOTE: [value
    checks])."""
    return (
        SPMDCompileError, Undecided, FloatArgumentUsedInPython, OptimizerNotPassed,
        unbound_scaler_error(), *value_read_errors(),
    )


@contextlib.contextmanager
def _swap_optimizer(
    opt: torch.optim.Optimizer,
    oi: int,
    b: StepBindings,
    params: dict[str, torch.Tensor],
    values: dict[StateRef, torch.Tensor],
    step_code: Any,
) -> Iterator[tuple[initial_state.RecordedStates, dict[str, tuple[int, torch.Tensor]]]]:
    """Point ``opt`` at traced parameters, state and learning rates; restore on exit."""
    saved_groups, saved_state = opt.param_groups, opt.state
    lr_setting = lr_may_become_a_setting(opt)  # NOTE: [a learning rate read in Python]
    groups: list[dict[str, Any]] = []
    by_param: dict[str, tuple[int, torch.Tensor]] = {}
    for gi, group in enumerate(saved_groups):
        new = dict(group)
        new["params"] = [params[b.param_name(p)] for p in group["params"]]
        for p in group["params"]:
            by_param[b.param_name(p)] = (gi, params[b.param_name(p)])
        held = group_tensor_keys(group)  # NOTE: [tensors held in a param group]
        for key in held:
            new[key] = values[StateRef(Kind.GROUP_STATE, key=key, optimizer=oi, group=gi)]
        lr = values.get(StateRef(Kind.HYPERPARAM, key="lr", optimizer=oi, group=gi))
        if lr is not None:  # else a setting (NOTE: [a learning rate read in Python])
            new["lr"] = lr
        beta1 = values.get(StateRef(Kind.HYPERPARAM, key=BETA1, optimizer=oi, group=gi))
        if beta1 is not None:  # NOTE: [Adam's beta1 as a graph input]
            new["betas"] = (beta1, group["betas"][1])
        # NOTE: [capture in two traces] explains these three flags.
        if "capturable" in new:
            new["capturable"] = True
        if "foreach" in new:
            new["foreach"] = False
        if new.get("fused"):
            new["fused"] = False
        # the step's writes from here on keep their lines (NOTE: [lines of param-group writes])
        momentum = values.get(StateRef(Kind.HYPERPARAM, key=MOMENTUM, optimizer=oi, group=gi))
        if momentum is not None:  # NOTE: [SGD's momentum as a graph input]
            groups.append(MomentumGroupWritesSeen(new, CycledValue(group[MOMENTUM], momentum, oi)))
        else:
            groups.append(GroupWritesSeen(new))
    # what the capture set in each traced group, to refuse the step's own writes to it
    # (NOTE: [param-group writes in the step]); dict's own methods: not a read (MomentumGroup)
    set_groups = [{k: dict.__getitem__(g, k) for k in dict.keys(g)} for g in groups]
    # NOTE: [optimizer state made before the first program]: the dicts note new entries
    state = initial_state.RecordedStates(initial_state.class_files(opt))
    for p, entries in saved_state.items():
        name = b.param_name(p)
        state[params[name]] = initial_state.RecordedState({
            key: values.get(StateRef(Kind.OPTIM_STATE, name, key, oi, by_param[name][0]), v)
            for key, v in entries.items()
        })
        state.before[id(params[name])] = set(entries)
    before = {k: dict(v) for k, v in state.items()}
    forced_capturable = any("capturable" in g and not g["capturable"] for g in saved_groups)
    state.group_tensors = [
        (gi, key, group) for gi, group in enumerate(groups) for key in group_tensor_keys(saved_groups[gi])
    ]
    opt.param_groups, opt.state = groups, state
    original_step = opt.step
    # An LR scheduler wraps ``step`` on the instance; keep that wrapper to restore it.
    instance_step = opt.__dict__.get("step", _MISSING)

    def capturable_step(*args: Any, **kwargs: Any) -> Any:
        refuse_step_after_its_scheduler(opt, oi)  # NOTE: [a scheduler stepped between two optimizer steps]
        graph = private.current_trace_graph()
        mark = last_node(graph)
        with user_step_modes_paused(), private.optimizer_capturable_path(), tracing_optimizer_step(
            opt, oi, lambda exc: step_frame_from_traceback(exc.__traceback__, step_code), numbers,
            lr_setting,
        ), contextlib.ExitStack() as opened:
            for group in groups:
                if isinstance(group, MomentumGroup):
                    opened.enter_context(group.opened())
            try:
                result = original_step(*args, **kwargs)
            except (AssertionError, RuntimeError, ValueError) as exc:
                if forced_capturable and "capturable" in str(exc):
                    raise _capturable_refused(opt, oi, exc) from exc
                raise
        note_optimizer_step(opt)  # NOTE: [schedulers stepped in the step]
        if graph is not None:
            for node in new_nodes_after(mark, graph):
                set_phase(node, Phase.OPTIMIZER)
        return result

    # the inputs that stand for Python floats of eager's groups (NOTE: [hyper-parameters
    # kept Python numbers] in capture/optimizers.py)
    numbers = tuple(
        values[StateRef(Kind.HYPERPARAM, key=key, optimizer=oi, group=gi)]
        for gi, group in enumerate(saved_groups)
        for key in ("lr", BETA1)
        if StateRef(Kind.HYPERPARAM, key=key, optimizer=oi, group=gi) in values
        and (key == BETA1 or type(group["lr"]) in (float, int))
    )
    opt.step = capturable_step  # type: ignore[method-assign]
    stand_ins = {
        (gi, "lr" if key == "lr" else "betas'][0"): values[StateRef(Kind.HYPERPARAM, key=key, optimizer=oi, group=gi)]
        for gi in range(len(saved_groups))
        for key in ("lr", BETA1)
        if StateRef(Kind.HYPERPARAM, key=key, optimizer=oi, group=gi) in values
    }
    instance_add = opt.__dict__.get("add_param_group", _MISSING)
    opt.add_param_group = functools.partial(_refuse_add_param_group, opt, oi)  # type: ignore[method-assign]
    try:
        # NOTE: [group values changed in place] (no mode where no group value is an input)
        with _GroupValuesWrittenInPlace(oi, stand_ins) if stand_ins else contextlib.nullcontext():
            yield state, by_param
        if len(groups) != len(set_groups):  # NOTE: [param groups added in the step]
            raise _groups_added_in_the_step(opt, oi, None)
        _check_python_state(opt, oi, groups, before, state, values, set_groups)
    finally:
        if instance_step is _MISSING:
            del opt.step
        else:
            opt.step = instance_step  # type: ignore[method-assign]
        if instance_add is _MISSING:
            del opt.add_param_group
        else:
            opt.add_param_group = instance_add  # type: ignore[method-assign]
        opt.param_groups, opt.state = saved_groups, saved_state


# NOTE: [group values changed in place]
# A learning rate that is a graph input (and Adam's beta1) is a 0-d tensor in the traced
# param group. `g["lr"] = g["lr"] * 0.5` in the step (or in an optimizer step hook) puts a
# new object in the group, which _check_python_state refuses clearly ("changes
# optimizer[0].param_groups[0]['lr']"); `g["lr"] *= 0.5` instead changed the tensor
# itself: the first trace, where the stand-in requires grad, failed with torch's "a leaf
# Variable that requires grad is being used in an in-place operation", and in a trace
# without grad the group would keep its object and the write go unseen. While the step
# runs, an in-place op (`*=`, `mul_`, `copy_`, `out=`) on a stand-in is refused with the
# same words as the assignment, naming the line.
_IN_PLACE_DUNDERS = frozenset(
    f"__i{op}__" for op in
    ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift",
     "rshift", "matmul")
)


class _GroupValuesWrittenInPlace(TorchFunctionMode):
    """Refuses an in-place op on a traced group value (NOTE: [group values changed in place])."""

    def __init__(self, optimizer: int, stand_ins: dict[tuple[int, str], torch.Tensor]) -> None:
        super().__init__()
        self.optimizer = optimizer
        self.stand_ins = stand_ins

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.stand_ins:
            name = getattr(func, "__name__", "")
            written = (
                args[0] if args and (name in _IN_PLACE_DUNDERS or (name.endswith("_") and not name.endswith("__")))
                else kwargs.get("out")
            )
            if isinstance(written, torch.Tensor):
                for (gi, key), tensor in self.stand_ins.items():
                    if written is tensor:
                        raise SPMDCompileError(
                            f"The train step changes optimizer[{self.optimizer}].param_groups[{gi}]"
                            f"['{key}'] in place ({name}, as `g['lr'] *= 0.5` runs; an LR scheduler "
                            "stepped, or the learning rate set, inside the compiled step?).",
                            user_line=innermost_model_frame_of_stack(),
                            hint=LR_WRITE_HINT,
                        )
        return func(*args, **kwargs)


def _refuse_add_param_group(opt: torch.optim.Optimizer, oi: int, *args: Any, **kwargs: Any) -> None:
    """NOTE: [param groups added in the step]
    ``optimizer.add_param_group(...)`` inside the step (unfreezing a layer on a flag)
    appended to the traced copy of the groups (``_swap_optimizer``), and the capture
    then failed at its own check with "IndexError: list index out of range" at
    contextlib.py, naming neither ``add_param_group`` nor the step's line (2026-12-06).
    A compiled step runs no Python after capture: the group would be added once, to
    the copy, and never to the user's optimizer. Refused at the call, naming its line,
    before anything is added; a group appended to ``optimizer.param_groups`` by other
    means is refused after the trace. Added between calls, the group is read by the
    next call, which compiles a program for it."""
    raise _groups_added_in_the_step(opt, oi, innermost_model_frame_of_stack())


def _groups_added_in_the_step(
    opt: torch.optim.Optimizer, oi: int, where: SourceLocation | None
) -> SPMDCompileError:
    return SPMDCompileError(
        f"The train step adds a param group to optimizer[{oi}] ({type(opt).__name__}."
        "add_param_group): a compiled step runs no Python after capture, so the group would "
        "be added once, to the traced copy of the optimizer's groups, and never to the "
        "optimizer (NOTE: [param groups added in the step]).",
        user_line=where,
        hint="call optimizer.add_param_group(...) outside the compiled step, between calls "
        "(set requires_grad there too when unfreezing a layer): the next call reads the new "
        "group and compiles a program for it.",
    )


def _group_numbers(b: StepBindings, values: dict[StateRef, torch.Tensor]) -> list[tuple[torch.Tensor, type, str]]:
    """The group values the program takes as inputs whose eager value is a Python
    number, with its type and name (NOTE: [optimizer settings read in the step])."""
    found = []
    for ref, value in values.items():
        if ref.kind is not Kind.HYPERPARAM or ref.optimizer < 0 or ref.key not in ("lr", BETA1):
            continue
        group = b.optimizers[ref.optimizer].param_groups[ref.group]
        eager = group["lr"] if ref.key == "lr" else group["betas"][0]
        if type(eager) in (float, int):
            where = "lr" if ref.key == "lr" else "betas'][0"
            found.append((value, type(eager), f"optimizer[{ref.optimizer}].param_groups[{ref.group}]['{where}']"))
    return found


def _returned_number(how: str, label: str, where: str) -> str:
    """How the runtime hands back a returned group number (NOTE: [optimizer settings
    read in the step]): ``item`` (a float, or a flag's bool), ``int``; else refused."""
    if how in ("float", "exact", "flag"):
        return "item"
    if how == "int":
        return "int"
    raise SPMDCompileError(
        f"The train step returns a number computed from {label} by {how}: the group "
        "value is a graph input of the program, and only the value itself, `+ - * /`, "
        "negation, abs and comparisons with Python numbers come back as the Python "
        "number eager computes (NOTE: [optimizer settings read in the step]).",
        user_line=where,
        hint="return the group value itself and compute the rest outside the compiled "
        "step, or read it from the optimizer after the call.",
    )


def _check_python_state(opt, oi, groups, before, state, values, set_groups) -> None:
    """Refuse steps whose effect on Python-side optimizer state we could not replay.

    NOTE: [param-group writes in the step]
    The step's optimizer sees traced copies of its param groups (``_swap_optimizer``),
    so a write into a group inside the step (``g["weight_decay"] *= 0.5``, Adam's
    ``betas``, SGD's ``momentum``, ``eps``, a custom ``g["micro"] += 1`` counter, a new
    key) lands in the copy: it ran once, at capture, on the copy, and never reached the
    user's group. Until the fifty-fifth session only ``lr`` was compared, and the others
    were dropped silently (AdamW's weight decay halved each step by hand: 0.146 relative
    off in the weights after 4 steps; a group counter gating the optimizer step: 0.84).
    Every key but ``params`` is now compared, by identity, with what the capture set
    (a scheduler's stand-in, NOTE: [schedulers stepped in the step], counts as its
    original), and a change is refused before the program exists, leaving the user's
    groups as they were: a compiled step runs no Python, so it cannot repeat the write.
    Settings changed between calls, outside the step, are read by the next call (AdamW's
    weight decay halved between 4 calls: within 1.7e-16 of eager, a program per value).
    The learning rate set in the step (nanoGPT's ``g["lr"] = lr`` before its micro-batch
    loop) is refused too, not replayed as a scheduler is: no Python runs to compute the
    value again, and one computed from an ``int`` argument (a guard) would compile a
    program per call; the hint gives the form that compiles once, the rate set before
    the call (a graph input). Each refusal names the line of the write (NOTE: [lines of
    param-group writes] in ``group_writes.py``).
    """
    for gi, group in enumerate(groups):
        lr = learning_rate_of(group["lr"])  # NOTE: [schedulers stepped in the step]
        # a setting: the number the capture left there (NOTE: [a learning rate read in Python])
        was_lr = values.get(StateRef(Kind.HYPERPARAM, key="lr", optimizer=oi, group=gi), set_groups[gi].get("lr"))
        if lr is not was_lr:
            where = written_at(group, ["lr"])  # NOTE: [lines of param-group writes]
            raise SPMDCompileError(
                f"The train step changes optimizer[{oi}].param_groups[{gi}]['lr']"
                + (" (the learning rate set inside the compiled step): a compiled step runs "
                   "no Python after capture, so the write would happen once, on the traced "
                   "copy of the group." if where is not None else
                   " (an LR scheduler stepped, or the learning rate set, inside the compiled "
                   "step?)."),
                user_line=where,
                hint=LR_WRITE_HINT,
            )
        was = set_groups[gi]
        held = {key for g, key, _ in state.group_tensors if g == gi}
        changed = sorted(
            (k for k in {*dict.keys(group), *was}
             if k not in ("params", "lr") and (
                 k not in was or k not in dict.keys(group)
                 or learning_rate_of(dict.__getitem__(group, k)) is not was[k]
             ) and not _group_tensor_kept(group, was, k, held)),
            key=repr,
        )
        if changed:
            _refuse_group_state_made(opt, oi, gi, group, was, changed, state.owners)
            raise SPMDCompileError(
                f"The train step, or the optimizer's own step(), writes "
                f"optimizer[{oi}].param_groups[{gi}][{', '.join(map(repr, changed))}] "
                f"({type(opt).__name__}): a compiled step runs no Python after capture, so "
                "the write would happen once, on the traced copy of the group, and never "
                "on later calls (NOTE: [param-group writes in the step]).",
                user_line=written_at(group, changed),  # NOTE: [lines of param-group writes]
                hint="change param-group settings outside the compiled step, between calls "
                "(the next call reads them; a setting other than the learning rate compiles "
                "a program per value), or use an LR scheduler for the learning rate; "
                "keep a step counter outside the step (count calls in the training loop); "
                "an optimizer that counts its steps in a param group (group['step'] += 1) "
                "can keep the count in its per-parameter state (self.state[p]['step'], a "
                "tensor) instead.",
            )
    for p, entries in state.items():
        for key, value in entries.items():
            old = before.get(p, {}).get(key, None)
            if not isinstance(value, torch.Tensor) and value != old:
                # NOTE: [per-parameter state kept a Python number]: the hint's claim (a
                # tensor count and tensor arithmetic on it compile, matching eager) is
                # tested in tests/sim/test_python_writes_in_the_step.py
                cls = type(opt).__name__
                library = _optimizer_of_a_library(opt)  # NOTE: [counters the optimizer keeps]
                raise SPMDCompileError(
                    f"optimizer[{oi}] ({cls}) keeps non-tensor state "
                    f"{key!r} that changes every step ("
                    + (f"{old!r} -> {value!r}" if key in before.get(p, {}) else f"set to {value!r} while the step was traced")
                    + (f"; {cls}'s own step() does this, in the installed package "
                       f"{library!r}" if library else "")
                    + "): a compiled "
                    "step runs no Python after capture, so a Python number in the state "
                    "would keep the value it had when the step was traced (NOTE: [counters "
                    "the optimizer keeps]).",
                    hint=library_counter_hint(opt) if library else
                    f"keep it in a tensor, as torch.optim's optimizers keep their step "
                    f"count: `state[{key!r}] = torch.zeros((), dtype=torch.float64)` where the "
                    f"state is made (float64 computes as Python numbers do); `state[{key!r}] += 1` "
                    "then counts in the program, and "
                    f"arithmetic on it must be tensor ops too (`1 - beta ** state[{key!r}]`, "
                    "`.sqrt()`, `torch.pow`, not math.sqrt / math.pow / float()), or use a "
                    "torch.optim optimizer (Adam, AdamW, Adafactor, ...).",
                )


def _group_tensor_kept(group: dict[str, Any], was: dict[str, Any], key: Any, held: set[str]) -> bool:
    """Whether ``key`` is a tensor the group held before the step and holds after it,
    of the same shape and dtype: an output of the program (NOTE: [tensors held in a
    param group]), written in place or replaced."""
    if key not in held or key not in dict.keys(group):
        return False
    now, before = dict.__getitem__(group, key), was[key]
    return (
        isinstance(now, torch.Tensor) and now.shape == before.shape and now.dtype == before.dtype
        and now.device == before.device
    )


def _capturable_refused(opt: torch.optim.Optimizer, oi: int, exc: BaseException) -> SPMDCompileError:
    """NOTE: [capturable refused by the optimizer]
    The compiled step traces every optimizer whose groups hold a ``capturable`` key
    with it set (NOTE: [capture in two traces]): that path keeps the step count and the
    learning rate as tensors, with no ``.item()``, which a program needs. timm's NAdamW
    copies torch's key but checks itself that its parameters are on CUDA when it is set,
    and the capture failed with its bare ``AssertionError: If capturable=True, params
    and state_steps must be on supported devices`` (a probe, sixty-sixth session), not saying that
    the compiler, not the user, set it. An error naming ``capturable`` raised inside
    such an optimizer's step is now refused naming the class and why the flag is on."""
    cls = type(opt).__name__
    nadamw = " (for timm's NAdamW: torch.optim.NAdam(decoupled_weight_decay=True))" if cls == "NAdamW" else ""
    return SPMDCompileError(
        f"optimizer[{oi}] ({cls}) refused its capturable path, which the compiled step "
        f"turned on: {type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''} "
        "The compiled step traces optimizers with capturable=True (their step count and "
        "learning rate kept as tensors, no .item(), so one program serves every call); "
        f"{cls} does not support that on this device (NOTE: [capturable refused by the "
        "optimizer]).",
        user_line=innermost_model_frame(exc.__traceback__),
        hint=f"use an optimizer that supports capturable=True on this device{nadamw}, or "
        f"{TENSOR_COUNT_OPTIMIZERS}.",
    )


def _optimizer_of_a_library(opt: torch.optim.Optimizer) -> str | None:
    """The installed package (``timm``) that defines ``opt``'s class, or None for the
    user's own class (torch.optim's included: its optimizers keep tensor counts)."""
    module = sys.modules.get(type(opt).__module__)
    where = getattr(module, "__file__", None)
    if not where:
        return None
    return installed_package_of(SourceLocation(where, 0, ""))


def _optimizers_own_line(where: SourceLocation | None, owners: frozenset[str]) -> bool:
    """Whether ``where`` is in the source of the optimizer's own classes."""
    return where is not None and where.filename in owners


# NOTE: [counters the optimizer keeps]
# timm's Lamb makes its group step counter a tensor on its first call (``group['step']
# = _init_scalar()``; a probe, 2027-01), Adan keeps it a Python int in the group
# (``group['step'] = 1``, then ``+= 1``), AdamP and MADGRAD a Python int in the
# per-parameter state. The refusals said what a compiled step cannot do and that the
# user could keep a counter outside the step, advice for the user's own code; here the
# optimizer's own code writes, which the user does not own. The messages now name the
# optimizer's class and the key, say that its own step() writes it when the line is in
# its classes' files, and give what works: a tensor created before the first call
# (NOTE: [tensors held in a param group]), or an optimizer that keeps its count in a
# tensor (torch.optim's Adam, AdamW, NAdam, RAdam; timm's Lion, LARS, Adopt, LaProp).
# (TENSOR_COUNT_OPTIMIZERS and the other hints: optimizer_advice.py; a class outside an
# installed package is told to keep its counters in self.state as tensors: NOTE:
# [counters a custom optimizer keeps].)


def _refuse_group_state_made(
    opt: torch.optim.Optimizer, oi: int, gi: int, group: dict[str, Any], was: dict[str, Any],
    changed: list[Any], owners: frozenset[str],
) -> None:
    """Refuse a param-group entry the step's optimizer made or changed, when it is a
    counter or a tensor its own step() keeps there (NOTE: [counters the optimizer
    keeps]); returns for the general refusal otherwise."""
    cls = type(opt).__name__
    counters = [  # NOTE: [counters a custom optimizer keeps]: every one, in the message
        key for key in changed
        if key in dict.keys(group) and type(dict.__getitem__(group, key)) in (int, float)
        and (key not in was or type(was[key]) in (int, float))
        and _optimizers_own_line(written_at(group, [key]), owners)
    ]
    for key in changed:
        if key not in dict.keys(group):
            continue
        value = dict.__getitem__(group, key)
        where = written_at(group, [key])
        own = _optimizers_own_line(where, owners)
        label = f"optimizer[{oi}].param_groups[{gi}][{key!r}]"
        by = f"{cls}'s own step()" if own else "the train step"
        if isinstance(value, torch.Tensor) and key not in was:
            raise SPMDCompileError(
                f"{by} creates {label}, a tensor, on its first call ({cls}): a compiled "
                "step runs no Python after capture, so the tensor would be made once, in the "
                "traced copy of the group, and never reach the optimizer (NOTE: [tensors "
                "held in a param group], NOTE: [param-group writes in the step]).",
                user_line=where,
                hint=f"create it in every param group before the first compiled call: "
                f"`for g in opt.param_groups: g[{key!r}] = torch.tensor(0.0)` (of the dtype "
                f"{cls} makes it with; a tensor the group holds is state of the program, "
                "read and written back on every call)"
                + (f"; {cls} then takes the path that updates it in place." if own else "."),
            )
        if key in counters:
            also = [k for k in counters if k != key]
            more = f" (and in {', '.join(map(repr, also))})" if also else ""
            raise SPMDCompileError(
                f"{by} keeps a Python number in {label}{more} that changes every step: a "
                "compiled step runs no Python after capture, so the number would keep the "
                "value it had when the step was traced (NOTE: [counters the optimizer keeps], "
                "NOTE: [param-group writes in the step]).",
                user_line=where,
                hint=library_counter_hint(opt) if _optimizer_of_a_library(opt)
                else group_counters_hint(cls, counters),
            )


@contextlib.contextmanager
def _tag_backward(after: Callable[[], None]) -> Iterator[None]:
    """Record ``Phase.BACKWARD`` for nodes traced inside ``backward()``; ``after()`` runs
    when it returns (NOTE: [gradients settle after backward])."""
    original = torch.Tensor.backward
    # each torch function mode active in the trace dispatches ``Tensor.backward`` again,
    # re-entering this wrapper: ``after`` runs once, when the outermost call returns
    depth = [0]

    def backward(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        graph = private.current_trace_graph()
        mark = last_node(graph)
        depth[0] += 1
        try:
            result = original(self, *args, **kwargs)
        finally:
            depth[0] -= 1
        if graph is not None:
            for node in new_nodes_after(mark, graph):
                set_phase(node, Phase.BACKWARD, overwrite=False)
            if depth[0] == 0:
                after()
        return result

    with mock.patch.object(torch.Tensor, "backward", backward):
        yield


_ANOMALY_HINT = (
    "switch anomaly detection off around the compiled step (torch.autograd."
    "set_detect_anomaly(False), or no `with torch.autograd.detect_anomaly():` inside it); "
    "to hunt a NaN, run the undecorated step eagerly with it on (or use "
    "detect_anomaly(check_nan=False), which checks no values)."
)


def refuse_anomaly_checks(user_line: SourceLocation | str | None) -> None:
    """Refuse a step while autograd's anomaly detection checks for NaN (NOTE: [anomaly
    detection at capture]); ``user_line`` is where it was met."""
    if torch.is_anomaly_enabled() and torch.is_anomaly_check_nan_enabled():
        raise SPMDCompileError(
            "The train step runs with autograd's anomaly detection on "
            "(torch.autograd.set_detect_anomaly(True) or detect_anomaly()): its NaN check "
            "reads the value of every gradient backward computes, in Python, which a "
            "compiled step cannot do (one graph runs them all). Nothing was applied.",
            user_line=user_line,
            hint=_ANOMALY_HINT,
        )


@contextlib.contextmanager
def _refuse_anomaly_checks() -> Iterator[None]:
    """NOTE: [anomaly detection at capture]
    With ``torch.autograd.set_detect_anomaly(True)`` (or ``detect_anomaly()`` around the
    step's ``backward()``), autograd checks every gradient it computes for NaN, reading
    its value (``isnan().any()`` as a Python bool). A trace has no values: before
    2026-12-06 every step was refused as "reads the value of a tensor in Python" at its
    backward line, with nothing naming anomaly detection. Capturing with the check
    switched off would silently drop the check the user asked for, and one graph cannot
    raise where a NaN appears; so a backward traced with the NaN check on is refused,
    naming it, before anything of it is traced; a program compiled before, with it off,
    is refused too when a call switches it on and the program runs a backward
    (``CompiledTrainStep._call_program``): it would run without the check. A step without
    a backward (an evaluation step) is not refused: the check has nothing to read there.
    ``check_nan=False`` reads no values (it only keeps forward stack traces for
    autograd's own errors) and compiles as usual."""
    backward, grad = torch.autograd.backward, torch.autograd.grad

    def tagged(run: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        # the nodes autograd traces are marked: a call of the compiled program made with
        # the check on is refused where they are (a gradient penalty's
        # torch.autograd.grad, a direct torch.autograd.backward: not Tensor.backward's
        # Phase.BACKWARD, which the first version of this check looked for alone)
        roots = args[0] if args else kwargs.get("tensors", kwargs.get("outputs"))
        roots = roots if isinstance(roots, (list, tuple)) else [roots]
        if any(isinstance(t, torch.Tensor) and t.requires_grad for t in roots):
            # else autograd's own error ("does not require grad", a train step called
            # under no_grad) is the one to see, as eagerly (the first review)
            refuse_anomaly_checks(innermost_model_frame_of_stack())
        graph = private.current_trace_graph()
        mark = last_node(graph)
        try:
            return run(*args, **kwargs)
        finally:
            if graph is not None:
                for node in new_nodes_after(mark, graph):
                    set_traced_by_autograd(node)

    def checked_backward(*args: Any, **kwargs: Any) -> Any:
        return tagged(backward, *args, **kwargs)

    def checked_grad(*args: Any, **kwargs: Any) -> Any:
        return tagged(grad, *args, **kwargs)

    with mock.patch.object(torch.autograd, "backward", checked_backward), \
            mock.patch.object(torch.autograd, "grad", checked_grad):
        yield


def _where_it_failed(exc: BaseException) -> str:
    """' at file:line: "code"' for the innermost model line of ``exc`` ('' if none)."""
    where = innermost_model_frame(exc.__traceback__)
    return f" at {where}" if where is not None else ""


@contextlib.contextmanager
def _module_scopes(fqn_of: dict[int, str]) -> Iterator[list[tuple[str, torch.fx.Node | None]]]:
    """Record ``node.meta[MODULE_FQN]`` for nodes traced inside each module's forward.

    Yields the stack of modules whose forward is running: after an exception it still
    holds the modules the failure happened in (their post-hooks did not run)."""
    stack: list[tuple[str, torch.fx.Node | None]] = []

    def pre_hook(module: torch.nn.Module, args: Any) -> None:
        fqn = fqn_of.get(id(module))
        if fqn is not None:
            stack.append((fqn, last_node(private.current_trace_graph())))

    def post_hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        fqn = fqn_of.get(id(module))
        graph = private.current_trace_graph()
        if fqn is None or not stack or graph is None:
            return
        _, mark = stack.pop()
        # NOTE: [a batch dimension iterated over]: torch's recurrent layers on (T, B, F)
        recurrent = _layer_label(fqn, module) if isinstance(module, torch.nn.RNNBase) else None
        hidden = _hidden_shape(module) if isinstance(module, torch.nn.RNNBase) else None
        for node in new_nodes_after(mark, graph):
            node.meta.setdefault(MODULE_FQN, fqn)
            if recurrent is not None:
                node.meta.setdefault(TIME_MAJOR_RNN, recurrent)
                node.meta.setdefault(RNN_HIDDEN, hidden)

    hooks = [
        torch.nn.modules.module.register_module_forward_pre_hook(pre_hook),
        torch.nn.modules.module.register_module_forward_hook(post_hook),
    ]
    try:
        yield stack
    finally:
        for h in hooks:
            h.remove()


def _timed_inputs(module: torch.nn.Module) -> tuple[str, ...]:
    """The forward parameters of ``module`` that hold time: torch's recurrent layers
    (``input``) and attention (``query``, ``key``, ``value``); none for any other module."""
    if isinstance(module, torch.nn.RNNBase):
        return ("input",)
    return ("query", "key", "value") if isinstance(module, torch.nn.MultiheadAttention) else ()


def _time_dim(module: torch.nn.Module, value: torch.Tensor) -> int:
    """The dimension of ``value`` that ``module`` reads as time: 1 of a batched input with
    ``batch_first=True`` (``(B, T, F)``), else 0 (``(T, B, F)``, or unbatched ``(T, F)``)."""
    return 1 if getattr(module, "batch_first", False) and value.ndim == 3 else 0


def _hidden_shape(module: torch.nn.RNNBase) -> tuple[int, tuple[int, ...]]:
    """``(num_layers * directions, sizes of the last dimension)`` of the hidden state of
    ``module`` (an LSTM's ``h`` is ``proj_size`` wide where it has one, its ``c``
    ``hidden_size``; NOTE: [a hidden state's layers walked])."""
    layers = module.num_layers * (2 if module.bidirectional else 1)
    return layers, tuple({module.hidden_size, getattr(module, "proj_size", 0) or module.hidden_size})


def _layer_label(fqn: str, module: torch.nn.Module) -> str:
    """How the time checks name a layer: ``"'enc.self_attn' (MultiheadAttention,
    batch_first=False)"``."""
    name = repr(fqn) if fqn else "<root module>"
    return f"{name} ({type(module).__name__}, batch_first={bool(getattr(module, 'batch_first', False))})"


@contextlib.contextmanager
def _time_major_marks(modules: list[torch.nn.Module], fqn_of: dict[int, str]) -> Iterator[None]:
    """NOTE: [a batch dimension iterated over]: mark the nodes whose values torch's
    recurrent and attention layers read, with the dimension they read as time
    (``TIME_MAJOR_INPUT``: 0 time-major, 1 batch-first), passed by position or by keyword
    (``attn(query=x, key=x, value=x)``: the global module hooks see positional arguments
    only), checked against the split dimension at expansion."""

    def mark(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        names = _timed_inputs(module)
        values = [*args[: len(names)], *(kwargs[n] for n in names[len(args):] if n in kwargs)]
        for value in values:
            node = private.traced_node_of(value) if isinstance(value, torch.Tensor) else None
            if node is not None:
                node.meta.setdefault(
                    TIME_MAJOR_INPUT, (_layer_label(fqn_of.get(id(module), "?"), module), _time_dim(module, value))
                )

    hooks = [
        sub.register_forward_pre_hook(mark, with_kwargs=True)
        for mod in modules for sub in mod.modules() if _timed_inputs(sub)
    ]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def _annotate_user_lines(gm: torch.fx.GraphModule, step_code: Any) -> None:
    for node in gm.graph.nodes:
        line = step_line_from_stack_trace(node.meta.get("stack_trace"), step_code)
        if line is not None:
            node.meta[USER_LINE] = line


# NOTE: [functional by rewriting]; False: always the retrace (tests compare the two)
REWRITE_FUNCTIONAL = True


def _functionalize(
    first: torch.fx.GraphModule, inputs: list[tuple[StateRef, TensorMeta]], fake_mode: Any
) -> torch.fx.GraphModule:
    """Second trace: the in-place graph re-traced under ``torch.func.functionalize``."""
    remove_profiler_and_detach(first)
    first.recompile()

    def replay(*flat: torch.Tensor) -> Any:
        with fx_traceback.preserve_node_meta():
            return RetracingInterpreter(first).run(*flat)

    if REWRITE_FUNCTIONAL and functional_by_rewriting(first, [r for r, _ in inputs], fake_mode):
        gm = first  # NOTE: [functional by rewriting]
    else:
        fakes = [_fake(meta, fake_mode, first_trace=False) for _, meta in inputs]
        gm = make_fx(torch.func.functionalize(replay, remove="mutations"), tracing_mode="fake")(*fakes)
    remove_profiler_and_detach(gm)
    _constants_without_copies(gm)
    _drop_legacy_empty_cat_inputs(gm)
    _drop_copy_back(gm, [ref for ref, _ in inputs])
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def _constants_without_copies(gm: torch.fx.GraphModule) -> None:
    """Read tensor constants directly instead of through ``lift_fresh_copy``.

    NOTE: [tensor constants]
    A tensor created from Python data inside the step (``torch.tensor(2.0)``, the
    ``torch.tensor([])`` of transformers' cache objects) is traced as a ``get_attr``
    constant plus ``lift_fresh_copy``. In the functional graph nothing writes to the copy,
    so the copy is the constant itself (DTensor has no rule for ``lift_fresh_copy``).
    Expansion turns each constant into a Replicate value of the per-rank program: the
    same tensor on every rank, stored in the program like any constant.
    """
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in (
            torch.ops.aten.lift_fresh_copy.default,
            torch.ops.aten.lift_fresh.default,
        ):
            replace_with_input(node)


def _drop_legacy_empty_cat_inputs(gm: torch.fx.GraphModule) -> None:
    """Drop the 1-D empty tensors of ``cat``: torch skips them (its legacy rule), and
    they are no-ops that DTensor's ``cat`` rule cannot place beside a sharded N-D input
    (transformers' cache concatenates ``torch.tensor([])`` with each layer's keys)."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.aten.cat.default:
            continue
        tensors = node.args[0]
        kept = [t for t in tensors if not _is_legacy_empty(t)]
        if kept and len(kept) < len(tensors) and any(
            isinstance(t, torch.fx.Node) and getattr(t.meta.get("val"), "dim", lambda: 1)() > 1
            for t in kept
        ):
            node.args = (kept, *node.args[1:])


def _is_legacy_empty(node: object) -> bool:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and tuple(val.shape) == (0,)


def _drop_copy_back(gm: torch.fx.GraphModule, refs: list[StateRef]) -> None:
    """Remove ``copy_(placeholder, new)`` epilogue nodes; state leaves as outputs."""
    ref_of = dict(zip(placeholders(gm), refs, strict=True))
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten.copy_.default:
            dest = node.args[0]
            if dest in ref_of:
                ref = ref_of[dest]
                if ref.kind is Kind.INPUT:
                    raise _argument_written_in_place(ref, node)
                if ref.kind not in STATE_KINDS:
                    raise node_error(f"Internal: {ref} is written in place.", node)
                node.replace_all_uses_with(dest)
                gm.graph.erase_node(node)


def _argument_written_in_place(ref: StateRef, node: torch.fx.Node) -> SPMDCompileError:
    """The refusal of a tensor argument the step writes in place: NOTE: [a tensor
    argument written in place]."""
    source = node.args[1]
    if USER_LINE not in node.meta and isinstance(source, torch.fx.Node):
        # the copy-back is the functional graph's epilogue, traced from no user line:
        # the line is the one that computed the value written back
        for key in (USER_LINE, "stack_trace"):
            if key in source.meta:
                node.meta[key] = source.meta[key]
    name = ref.name or f"input[{ref.index}]"
    example = name if name.isidentifier() else "running_mean"
    op = getattr(source.target, "__name__", "").split(".")[0] if (
        isinstance(source, torch.fx.Node) and private.is_op_overload(source.target)
    ) else ""
    # the out-of-place form of the write first: most such writes clean or scale a batch
    # (``x.nan_to_num_(0.0)``); a running value kept across calls comes second
    copy = (
        f"`{example} = {example}.{op}(...)` in place of `{example}.{op}_(...)`"
        if op.isidentifier() and hasattr(torch.Tensor, op) and hasattr(torch.Tensor, f"{op}_")
        else f"`{example} = {example}.clone()` before the write"
    )
    clean = "" if op == "nan_to_num" else "; cleaning a batch: `x = x.nan_to_num(0.0)`"
    return node_error(
        f"The train step modifies its tensor argument `{name}` in place. A tensor argument "
        "is an input of the program, read afresh on each call: a change to it would not "
        "reach the caller's tensor.",
        node,
        hint=f"work on a copy ({copy}{clean}), or do "
        "the change in the data pipeline, outside the compiled step. Where the value is "
        "kept across calls (a running mean), register it as a buffer of a module the step "
        f"takes (`model.register_buffer(\"{example}\", torch.zeros(()))`, the step reading "
        f"and updating model.{example}): a buffer is state the program updates in place.",
    )


# NOTE: [a tensor argument written in place]
# A tensor argument is an input of the program (a batch, a replicated value), not state
# it keeps placed and writes back, so an in-place write to it is refused. The refusal
# was "modifies its tensor argument input[0] (pl_mean) in place", at graph node
# ``copy__4`` with no user line: ``input[0]`` is the position among the tensor inputs
# (StyleGAN's pl_mean was the step's third argument), and the copy-back node is the
# functional graph's epilogue, traced from no line of the user's. It now names the
# argument as the step's code does, takes the line of the value written back, and gives
# the fix that keeps the step's meaning for a running statistic: a buffer of a module
# the step takes (StyleGAN's path-length mean then compiled and matched eager to 6e-16,
# sixty-third session's probe).


def _refuse_new_parameter_shape(ref: StateRef, before: TensorMeta, after: TensorMeta, node: torch.fx.Node) -> None:
    """A parameter the step leaves with another shape or dtype (a frozen one made empty
    and ``resize_``-d on the first call) is refused: its optimizers hold it by object
    and the modes place it for its shape, so it cannot be given a new one as a buffer is
    (NOTE: [state the step gives a new shape] in ``runtime/runner.py``); before, the
    DTensor kept its old global shape under the new values."""
    if (before.shape, before.dtype) == (after.shape, after.dtype):
        return
    was, now = (
        (before.shape, after.shape) if before.shape != after.shape else (before.dtype, after.dtype)
    )
    raise node_error(
        f"The train step changes parameter {ref.name!r} from {was} to {now}: a compiled "
        "step keeps each parameter's shape and dtype (its optimizers hold it, and it is "
        "placed on the ranks for its shape).",
        node,
        hint="keep a value whose shape changes in a buffer (register_buffer: a buffer may "
        "take a new shape in the step), or give the parameter its final shape before the "
        "first compiled call.",
    )


def _finish_signature(captured: CapturedStep) -> None:
    """Drop outputs that return a state input unchanged; the runtime skips them."""
    gm = captured.graph_module
    ref_of = dict(zip(placeholders(gm), captured.input_refs(), strict=True))
    meta_of = dict(captured.inputs)
    keep_vals, keep_refs = [], []
    for value, ref in zip(output_args(gm), captured.outputs, strict=True):
        if ref.kind is not Kind.RETURN and ref_of.get(value) == ref:
            captured.unchanged.append(ref)
            continue
        if ref.kind is Kind.PARAM:
            before = meta_of.get(ref)
            if before is not None:
                _refuse_new_parameter_shape(ref, before, TensorMeta.of(value.meta["val"]), value)
        keep_vals.append(value)
        keep_refs.append(ref)
    set_outputs(gm, keep_vals)
    captured.outputs = keep_refs
    # NOTE: [state written as another state's value]
    copy_state_values(gm, captured.input_refs(), keep_refs)
    written = {ref for ref in keep_refs if ref.kind is not Kind.RETURN}
    drop_unneeded_snapshots(gm, {p for p, ref in ref_of.items() if ref in written})
    captured.output_metas = [TensorMeta.of(v.meta["val"]) for v in output_args(gm)]
    gm.graph.eliminate_dead_code()
    gm.recompile()
