"""Every private torch API the project uses, in one place.

NOTE: [private torch APIs]
torch 2.13 offers no public entry point for a few things the pipeline needs: swapping a
module's parameters for traced values, the simulated-rank machinery (LocalTensorMode and
the fake process group), the DTensor redistribution hook we memoize, the proxy tracer of
an active ``make_fx`` trace, and DTensor's local-tensor slot. Each is wrapped here, so a
torch upgrade touches this file only. Nothing else in the package imports a module or
attribute whose name starts with an underscore from torch.

NOTE: [supported torch versions]
torch 2.11 to 2.14 (pyproject.toml). Every difference between them is handled here and
detected by asking torch for the feature, never by its version string:
- ``register_stack_trace_anchor``: 2.11 has no ``fx.proxy._register_stack_trace_anchor``;
- ``lift_group_names``: 2.11 bakes process-group names into traced collectives instead of
  tracing ``_dtensor.mesh_get_process_group``;
- ``local_tensor_mode``: 2.11's LocalTensorMode gives every simulated rank rank 0's
  run-time mesh coordinate (a silent wrong result in simulation); 2.12's cannot take the
  ProcessGroup that ``_dtensor.mesh_get_process_group`` gives its collectives;
- ``memoized_redistribute_cost``: 2.14 prices every placement combination of its
  single-mesh-dim strategies (greedy plans shared between prices of the same
  placements); 2.11 traces the run-time coordinate for shape arguments' local shapes;
- ``bounded_decomposition_propagation``: DecompShardingStrategy's methods are static in
  2.11 (sharding propagator last), instance methods from 2.12, with an extra
  ``output_tensor_meta`` argument in 2.14; the wrappers take any of these;
- ``compile_on_one_rank_config``: 2.14 moved the ``compile_on_one_rank`` flag to
  ``torch.compiler.config``; ``torch.distributed.config``'s is a deprecated alias there
  (a FutureWarning on every patch);
- NOTE: [DTensor gap fills]: 2.11's view rule (incl. a flatten split again), strided-shard
  redistribution (from and to ``_StridedShard``s its planner cannot read), sharding
  strategies for squeeze.dims / flip / roll / cummax / var_mean.correction /
  constant_pad_nd (2.11's replicates with one placement on any mesh), and rules
  that ignore ``_StridedShard`` (``settle_strided_shards``).
``scripts/compat.sh VERSION`` runs the suite against one release.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import logging
import math
import operator
import os
import sys
import time
import types
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeGuard, cast
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree  # re-exported: the package's one way to pytree

from .stack_room import call_with_room

if TYPE_CHECKING:
    from torch._C._distributed import StridedShard
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard

# ---------------------------------------------------------------------------- capture


def reparametrize_module(module: torch.nn.Module, tensors: dict[str, torch.Tensor]):
    """Context manager: ``module``'s parameters and buffers are ``tensors`` inside it.

    NOTE: [one submodule under two names]. A submodule registered under two paths
    (timm's CoaT hands one ``ConvRelPosEnc`` to every block of a stage) gives each of its
    tensors two names. torch swaps name by name and restores in the same order: the
    second name's "original" is the tensor the first name swapped in, so the module kept
    the trace's stand-in after the step (the next call refused the optimizer's parameter
    as owned by no module). One name per (module, attribute) is swapped here; the caller
    names every path (``named_modules(remove_duplicate=False)``), so tensors tied across
    modules are all given and torch's own tying, which would add the dropped names back,
    is off."""
    from torch.nn.utils.stateless import _reparametrize_module

    owners: set[tuple[int, str]] = set()
    once: dict[str, torch.Tensor] = {}
    for fqn, t in tensors.items():
        prefix, _, attr = fqn.rpartition(".")
        key = (id(module.get_submodule(prefix)), attr)
        if key not in owners:
            owners.add(key)
            once[fqn] = t
    return _reparametrize_module(module, once, tie_weights=False, strict=False)


def legacy_reduction(size_average: Any, reduce: Any) -> str:
    """The ``reduction`` a loss's deprecated ``size_average`` / ``reduce`` arguments name,
    as torch's losses read them."""
    from torch.nn import _reduction

    return _reduction.legacy_get_string(size_average, reduce)


def check_batch_norm_input(module: torch.nn.Module, input: torch.Tensor) -> None:
    """A batch norm module's own check of its input's rank (``_check_input_dim``: a
    ``BatchNorm2d`` refuses a 3-D input), as its ``forward`` runs it."""
    module._check_input_dim(input)  # type: ignore[operator]


def plain_batch_norm_forward(module: torch.nn.Module, input: torch.Tensor) -> torch.Tensor:
    """torch's batch norm ``forward`` without a process group (``_BatchNorm.forward``, the
    one ``nn.BatchNorm*d`` run), called on ``module`` (a ``SyncBatchNorm`` too)."""
    return torch.nn.modules.batchnorm._BatchNorm.forward(module, input)  # type: ignore[arg-type]


# NOTE: [torch's functions replaced by the user]
# torch's overridable functions hand themselves to ``__torch_function__`` by their
# module's global name (``handle_torch_function(silu, ...)`` inside ``F.silu``). A script
# that replaced one with a wrapper calling the original (``F.silu = lambda x, inplace=False:
# orig(x) * 2.0``, a patched ``scaled_dot_product_attention``) thus had the wrapper handed
# to every function mode active while the step is traced (the capture's own and torch's
# ``TorchFunctionMetadataMode``), and each one called it again: the wrapper ran once per
# mode (its factor 2 ** 7 times instead of once: losses 32.8 against eager's 1.52,
# silently). Eager runs no mode. So while a step is traced each such replacement is
# called through a shim that puts torch's own function back under the name for the
# duration of the call (the replacement runs once; the original it calls hands itself
# to the modes, as eager would run it), and the replacement is the name's value again
# after it. torch's own functions are the ones the namespaces held when this module was
# imported; a function replaced before that (its code is not torch's) cannot be told
# from torch's: where its call re-enters itself (the modes handing it back) the step is
# refused.
def _namespaces() -> list[Any]:
    import torch.nn.functional

    return [torch, torch.nn.functional, torch.functional, torch.linalg, torch.fft, torch.special]


_TORCH_DIR = os.path.dirname(torch.__file__)
_ORIGINALS: list[tuple[Any, dict[str, Any]]] = [
    (module, {k: v for k, v in vars(module).items()
              if isinstance(v, (types.FunctionType, types.BuiltinFunctionType))})
    for module in _namespaces()
]


def _torch_code(fn: Any) -> bool:
    """Whether ``fn`` is torch's: a builtin or Python code under torch's folder, and so is
    every function it wraps (``functools.wraps(F.silu)`` on a user's wrapper: the user's;
    ``torch.compiler.disable(user_fn)``: the user's)."""
    for _ in range(16):
        if isinstance(fn, types.BuiltinFunctionType):
            return True
        code = getattr(fn, "__code__", None)
        if code is None or not code.co_filename.startswith(_TORCH_DIR + os.sep):
            return False
        wrapped = getattr(fn, "__wrapped__", None)
        if wrapped is None:
            return True
        fn = wrapped
    return False


def _shim(module: Any, name: str, original: Any, replacement: Any, live: list[bool]) -> Callable[..., Any]:
    d = vars(module)

    def shim(*args: Any, **kwargs: Any) -> Any:
        if not live:  # the trace ended (a reference kept past it): the replacement, plainly
            return replacement(*args, **kwargs)
        d[name] = original
        try:
            return replacement(*args, **kwargs)
        finally:
            if live:
                d[name] = shim

    return functools.wraps(replacement)(shim)


def _reentry_refused(module: Any, name: str, replacement: Any) -> Callable[..., Any]:
    running: list[bool] = []

    def shim(*args: Any, **kwargs: Any) -> Any:
        if running:
            from .errors import SPMDCompileError

            raise SPMDCompileError(
                f"{module.__name__}.{name} was replaced (by {getattr(replacement, '__qualname__', replacement)!r}) "
                "before spmd_compiler was imported, and the replacement calls the function it "
                "replaced: the compiled step cannot tell torch's own function from it (NOTE: "
                "[torch's functions replaced by the user] in spmd_compiler/_torch_private.py).",
                hint="import spmd_compiler before replacing torch's functions.",
            )
        running.append(True)
        try:
            return replacement(*args, **kwargs)
        finally:
            running.pop()

    return functools.wraps(replacement)(shim)


@contextlib.contextmanager
def torch_functions_replaced_by_the_user() -> Iterator[None]:
    """Inside: each function of a torch namespace the user replaced runs through a shim
    (see the NOTE); the namespaces hold the user's functions again on the way out."""
    installed: list[tuple[dict[str, Any], str, Any, Any]] = []
    live = [True]
    try:
        for module, originals in _ORIGINALS:
            d = vars(module)
            for name, original in originals.items():
                current = d.get(name)
                if current is None or isinstance(current, type) or not callable(current) or _torch_code(current):
                    continue  # torch's own (its swaps too)
                if current is not original:
                    shim = _shim(module, name, original, current, live)
                elif isinstance(current, types.FunctionType) and not _torch_code(current):
                    shim = _reentry_refused(module, name, current)
                else:
                    continue
                installed.append((d, name, current, shim))
                d[name] = shim
        yield
    finally:
        live.clear()
        for d, name, current, shim in installed:
            if d.get(name) is shim or d.get(name) is not current:
                d[name] = current


class NestedEncoderCall:
    """What ``transformer_encoder_would_nest`` found out for a call that eager would run
    on a nested tensor: ``valid`` (N, L) bool, the positions torch keeps (its
    ``src_key_padding_mask.logical_not()`` on the canonical mask), the ``is_causal`` torch
    gives the layers, and whether torch checked the mask's left alignment first (its
    ``mask_check``)."""

    __slots__ = ("alignment_checked", "is_causal", "valid")

    def __init__(self, valid: torch.Tensor, is_causal: bool, alignment_checked: bool) -> None:
        self.valid, self.is_causal, self.alignment_checked = valid, is_causal, alignment_checked


class _WouldNest(Exception):
    def __init__(self, valid: torch.Tensor) -> None:
        super().__init__()
        self.valid = valid


class _WouldNotNest(Exception):
    pass


def transformer_encoder_would_nest(
    module: torch.nn.Module, src: torch.Tensor, mask: torch.Tensor | None,
    src_key_padding_mask: torch.Tensor | None, is_causal: bool | None,
) -> NestedEncoderCall | None:
    """Whether eager ``nn.TransformerEncoder.forward`` would take its nested-tensor fast
    path for this call (NOTE: [nn.TransformerEncoder's nested fast path] in
    capture/transformer_fast_path.py), asked of torch's own ``forward`` (the same in 2.11
    to 2.14) run with the trace's traits hidden: ``has_torch_function`` and
    ``is_compiling`` answer False, the left-alignment check (a read of the mask's values)
    answers True and is recorded (the caller decides alignment in the graph), and the two
    calls after the decision stop the run, before any layer: ``_nested_tensor_from_mask``
    (it would nest) and ``_get_seq_len`` (it would not). None where it would not nest."""
    transformer = torch.nn.modules.transformer
    seq_len = transformer._get_seq_len
    asked: list[bool] = []

    def left_aligned(t: torch.Tensor, valid: torch.Tensor) -> bool:
        asked.append(True)
        return True

    def nest(t: torch.Tensor, valid: torch.Tensor, mask_check: bool = True) -> torch.Tensor:
        raise _WouldNest(valid)

    def stop(*args: Any) -> int:
        raise _WouldNotNest

    with (
        mock.patch.object(torch.overrides, "has_torch_function", lambda *args: False),
        mock.patch.object(torch.compiler, "is_compiling", lambda: False),
        mock.patch.object(torch, "_nested_tensor_from_mask_left_aligned", left_aligned),
        mock.patch.object(torch, "_nested_tensor_from_mask", nest),
        mock.patch.object(transformer, "_get_seq_len", stop),
    ):
        try:
            torch.nn.TransformerEncoder.forward(
                module, src, mask, src_key_padding_mask, is_causal  # type: ignore[arg-type]
            )
        except _WouldNest as nested:
            length = seq_len(src, cast(Any, module).layers[0].self_attn.batch_first)
            causal = transformer._detect_is_causal_mask(None, is_causal, length)
            return NestedEncoderCall(nested.valid, causal, bool(asked))
        except _WouldNotNest:
            return None
    raise RuntimeError(
        "torch's nn.TransformerEncoder.forward ran to the end without deciding on its nested "
        "fast path where spmd_compiler expects it to (NOTE: [nn.TransformerEncoder's nested "
        "fast path]); this torch release is not supported."
    )


# NOTE: [loss scaling in the program] (capture/grad_scalers.py): torch.amp.GradScaler keeps
# its scale, growth tracker and per-optimizer stages in private attributes; these are the
# only reads and writes of them.
GRAD_SCALER_STATE = ("_scale", "_growth_tracker")


def grad_scaler_type() -> type:
    return torch.amp.GradScaler


def grad_scaler_enabled(scaler: Any) -> bool:
    return bool(scaler._enabled)


def grad_scaler_state(scaler: Any, device: torch.device) -> dict[str, torch.Tensor]:
    """The scale and growth tracker of an enabled ``scaler``, created on ``device`` as its
    first ``scale()`` would create them when it has none yet."""
    if scaler._scale is None:
        scaler._lazy_init_scale_growth_tracker(device)
    return {key: getattr(scaler, key) for key in GRAD_SCALER_STATE}


def grad_scaler_settings(scaler: Any) -> tuple[float, float, int]:
    """(growth factor, backoff factor, growth interval): constants of a program."""
    return (scaler._growth_factor, scaler._backoff_factor, scaler._growth_interval)


def grad_scaler_between_steps(scaler: Any) -> bool:
    """No optimizer of ``scaler`` is unscaled or stepped since its last ``update()``."""
    return all(
        state["stage"].name == "READY" and not state["found_inf_per_device"]
        for state in scaler._per_optimizer_states.values()
    )


def steps_with_amp_scaling(optimizer: Any) -> bool:
    """``optimizer`` unscales gradients inside its own step (a fused optimizer)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def read_grad_scaler_state(scaler: Any, key: str) -> torch.Tensor:
    assert key in GRAD_SCALER_STATE, key
    return getattr(scaler, key)


def write_grad_scaler_state(scaler: Any, key: str, value: torch.Tensor) -> None:
    """Write a program's new scale or growth tracker into ``scaler`` in place, as its
    ``update()`` writes them."""
    assert key in GRAD_SCALER_STATE, key
    getattr(scaler, key).copy_(value)


@contextlib.contextmanager
def traced_grad_scaler(
    scaler: Any, state: dict[str, torch.Tensor], maybe_opt_step: Callable[..., Any]
) -> Iterator[Callable[[], dict[str, torch.Tensor]]]:
    """Inside: ``scaler`` holds the traced ``state``, fresh per-optimizer stages and
    ``maybe_opt_step(scaler, optimizer, optimizer_state, *args, **kwargs)`` in place of
    its own; yields a function giving its state as it is now. Restored on exit."""
    saved = {key: getattr(scaler, key) for key in (*GRAD_SCALER_STATE, "_per_optimizer_states")}
    own = scaler.__dict__.get("_maybe_opt_step", _NO_ATTRIBUTE)
    for key, value in state.items():
        setattr(scaler, key, value)
    scaler._per_optimizer_states = defaultdict(saved["_per_optimizer_states"].default_factory)
    scaler._maybe_opt_step = functools.partial(maybe_opt_step, scaler)
    try:
        yield lambda: {key: getattr(scaler, key) for key in GRAD_SCALER_STATE}
    finally:
        for key, value in saved.items():
            setattr(scaler, key, value)
        if own is _NO_ATTRIBUTE:
            del scaler._maybe_opt_step
        else:
            scaler._maybe_opt_step = own


_NO_ATTRIBUTE = object()


@contextlib.contextmanager
def optimizer_capturable_path() -> Iterator[None]:
    """Make torch.optim take its graph-capturable path while we trace ``step()``.

    The capturable path keeps the step counter and the learning rate as tensors (no
    ``.item()``), but on CPU it asserts unless torch believes it is compiling, so
    ``torch.compiler.is_compiling`` is patched for the duration of ``optimizer.step()``.
    State the optimizer creates gets float64 step counters (see NOTE: [float64 step
    counters] in capture/trace.py), by patching each optimizer module's ``_get_scalar_dtype``.
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch("torch.compiler.is_compiling", lambda: True))
        for name, module in list(sys.modules.items()):
            if name.startswith("torch.optim") and hasattr(module, "_get_scalar_dtype"):
                stack.enter_context(
                    mock.patch.object(module, "_get_scalar_dtype", lambda *a, **k: torch.float64)
                )
        yield


@contextlib.contextmanager
def adam_update_as_eager() -> Iterator[None]:
    """Inside: torch's per-parameter Adam / AdamW update takes its non-capturable branch
    (the state is made as the capturable path makes it; NOTE: [Adam's update as eager's]
    in capture/optimizers.py)."""
    import torch.optim.adam as module

    original = module._single_tensor_adam

    def update(*args: Any, capturable: bool = False, differentiable: bool = False, **kwargs: Any) -> None:
        return original(*args, capturable=capturable and differentiable, differentiable=differentiable, **kwargs)

    with mock.patch.object(module, "_single_tensor_adam", update):
        yield


def adafactor_single_tensor_step() -> Any:
    """torch's per-parameter Adafactor update (``torch.optim._adafactor``, private), or
    None where this torch has none."""
    try:
        import torch.optim._adafactor as module
    except ImportError:
        return None
    return getattr(module, "_single_tensor_adafactor", None)


@contextlib.contextmanager
def adafactor_single_tensor_step_replaced(replacement: Callable[..., None]) -> Iterator[None]:
    """Inside: torch's Adafactor runs ``replacement`` as its per-parameter update (NOTE:
    [Adafactor in tensor ops] in capture/adafactor.py)."""
    import torch.optim._adafactor as module

    with mock.patch.object(module, "_single_tensor_adafactor", replacement):
        yield


def optimizer_set_up(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``torch.optim.Optimizer.__init__`` ran on ``optimizer`` itself: its hook
    dicts are its own (a wrapper that skips it, accelerate's ``AcceleratedOptimizer``, has
    none, and its ``register_load_state_dict_pre_hook`` raised AttributeError)."""
    return "_optimizer_load_state_dict_pre_hooks" in vars(optimizer)


@contextlib.contextmanager
def optimizer_state_left_unmade() -> Iterator[None]:
    """Inside: ``torch.distributed.checkpoint.state_dict``'s ``get_state_dict`` /
    ``set_state_dict`` leave an optimizer that has not stepped without state, where they
    would make it with one ``step()`` at ``lr=0`` on zero gradients (``_init_optim_state``):
    a step Adam counts, Rprop's step sizes made from ``lr=0``, and the user's step hooks
    run (NOTE: [an optimizer saved before its first step] in runtime/checkpoint.py)."""
    from torch.distributed.checkpoint import state_dict

    with mock.patch.object(state_dict, "_init_optim_state", lambda optim: None):
        yield


@contextlib.contextmanager
def torch_checks_answered(kind: type, answer: Callable[[Any], bool]) -> Iterator[None]:
    """Inside: torch's own condition checks (``torch._check_with``, which ``torch._check``
    and ``torch._check_tensor_all_with`` call) given a condition of type ``kind`` take its
    truth from ``answer`` and raise their error where it is false; any other condition
    goes to torch's (which accepts only ``bool`` / ``SymBool``)."""
    real = torch._check_with

    def check_with(error_type: type, cond: Any, message: Any = None) -> None:
        if isinstance(cond, kind):
            cond = bool(answer(cond))
        real(error_type, cond, message)

    with mock.patch.object(torch, "_check_with", check_with):
        yield


def register_stack_trace_anchor(fn: Callable[..., Any]) -> None:
    """Keep the frames of ``fn`` (the user's train step) in recorded stack traces.

    torch 2.11 gap: ``torch.fx.proxy._register_stack_trace_anchor`` is absent, and the
    tracer keeps only ``forward`` frames (the train step's own line, the loss and the
    optimizer step would carry no stack trace). Feature-tested; without it, the same
    rule is installed on ``TracerBase._filter_traceback_frames`` once.
    """
    import torch.fx.proxy as fx_proxy

    if hasattr(fx_proxy, "_register_stack_trace_anchor"):
        fx_proxy._register_stack_trace_anchor(fn)
        return
    code = getattr(fn, "__code__", None)
    if code is None:
        return
    _install_stack_trace_anchor_filter()
    _STACK_TRACE_ANCHORS.add((code.co_filename, code.co_name))


_STACK_TRACE_ANCHORS: set[tuple[str, str]] = set()


def _install_stack_trace_anchor_filter() -> None:
    import traceback

    from torch.fx.proxy import TracerBase

    original = TracerBase._filter_traceback_frames
    if getattr(original, "_spmd_anchor_filter", False):
        return

    def filter_frames(self: Any, summary: traceback.StackSummary) -> traceback.StackSummary:
        if not self._record_forward_stack_traces_only:
            return original(self, summary)
        from torch.fx.experimental.symbolic_shapes import uninteresting_files

        skip = uninteresting_files()
        return traceback.StackSummary.from_list([
            frame
            for frame in summary
            if (
                frame.name == "forward"
                or frame.filename.endswith("torch/__init__.py")
                or (frame.filename, frame.name) in _STACK_TRACE_ANCHORS
            )
            and frame.filename not in skip
        ])

    filter_frames._spmd_anchor_filter = True  # type: ignore[attr-defined]
    TracerBase._filter_traceback_frames = filter_frames  # type: ignore[method-assign,assignment]


# NOTE: [stack traces without the whole stack]
# A trace that records stack traces (the capture's, so that errors name the model's and
# the train step's lines) has fx take the whole Python stack at every node it creates
# (``CapturedTraceback.extract().summary()`` in ``TracerBase.create_node``), look up the
# file, name and source line of each of its ~100 frames (the capture's dispatch modes,
# make_fx and the autograd engine are all on it), then keep the few frames its filter
# wants: under make_fx, ``forward`` frames, the registered anchors (the train step) and
# ``torch/__init__.py``. That was 2.2 s of the 8-layer demo GPT's 21 s compile (py-spy).
# ``light_stack_traces`` walks the frames instead and builds frame summaries only for
# those the filter would keep, source lines read lazily when the trace is formatted: fx's
# filter then runs on them as before, so every node's ``stack_trace`` is the same text
# (checked node for node on the demo GPT's program, and by
# ``tests/unit/test_light_stack_traces.py``). A tracer that keeps more than those frames
# (``_record_forward_stack_traces_only`` false) gets torch's own extraction.


class _FramesKept:
    """``CapturedTraceback``'s ``extract().summary()`` for a tracer that keeps the forward
    frames and anchors only (NOTE: [stack traces without the whole stack])."""

    def __init__(self, frames: list[Any]) -> None:
        self.frames = frames

    def summary(self) -> Any:
        import traceback

        return traceback.StackSummary.from_list(self.frames)


class _LightTraceback:
    """Stands for ``CapturedTraceback`` in ``torch.fx.proxy`` inside ``light_stack_traces``."""

    def __init__(self, real: Any) -> None:
        self.real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def extract(self, *args: Any, **kwargs: Any) -> Any:
        import traceback

        caller = sys._getframe(1)
        tracer = caller.f_locals.get("self") if caller.f_code.co_name == "create_node" else None
        if args or kwargs:
            return self.real.extract(*args, **kwargs)
        if not getattr(tracer, "_record_forward_stack_traces_only", False):
            return self.real.extract(skip=1)  # as if called from ``caller``
        anchors = _stack_trace_anchors()
        kept = []
        frame: Any = caller
        while frame is not None:
            code = frame.f_code
            if (
                code.co_name == "forward"
                or code.co_filename.endswith("torch/__init__.py")
                or (code.co_filename, code.co_name) in anchors
            ):
                kept.append(traceback.FrameSummary(
                    code.co_filename, frame.f_lineno, code.co_name, lookup_line=False
                ))
            frame = frame.f_back
        kept.reverse()
        return _FramesKept(kept)


def _stack_trace_anchors() -> set[tuple[str, str]]:
    import torch.fx.proxy as fx_proxy

    return getattr(fx_proxy, "_STACK_TRACE_ANCHORS", _STACK_TRACE_ANCHORS)


# NOTE: [compiled helpers and selective checkpointing at capture]
# Two torch features ask "is this a compiler's trace?" and, under our make_fx capture,
# answer yes, then expect the rest of torch.compile that we do not run:
# - a ``torch.compile``d function or submodule the model calls (``@torch.compile`` on an
#   activation helper): dynamo refused to be traced by FX ("Detected that you are using
#   FX to symbolically trace a dynamo-optimized function"), so the step was refused.
#   Dynamo's own setting ``error_on_nested_fx_trace=False`` runs the function's Python
#   instead, which the capture traces into the program as any other code: its kernels
#   come from the step's own backend.
# - selective activation checkpointing (``checkpoint(..., context_fn=
#   create_selective_checkpoint_contexts(policy))``): under a proxy mode torch's SAC saves
#   every op's output and tags nodes for AOT autograd's partitioner, which this program
#   has not; a dropout inside (its noise written in place after being saved) failed with
#   "Tensor cached during selective activation checkpoint has been mutated". While the
#   step is traced SAC runs as eagerly: the policy's saved ops are reused, the others
#   recomputed in the backward (the memory the user asked for), their draws replayed
#   (NOTE: [draws replayed by a restored generator]).
# - a ``@torch.jit.script`` function runs in the TorchScript interpreter, where an ``if``
#   on a tensor's value (``if bool(x.max() > 0.5):``) failed the capture with the
#   interpreter's bare "RuntimeError:" (an ``if`` in the step's own Python is a value
#   check, NOTE: [value checks]). While the step is traced such a function runs the
#   Python it was scripted from (``_torchdynamo_inline``, the function torch.compile
#   inlines in its place), the same ops, its own ``raise`` raised as the
#   ``torch.jit.Error`` TorchScript raises; a scripted function with no Python behind it
#   (made from a string) and a ``torch.jit.trace``d one (it froze one way through its
#   Python's ifs) run as before. Scripted modules (``torch.jit.script(module)``) keep no
#   Python: they run in the interpreter as before.
# what a scripted function's own ``raise`` / ``assert`` raise in Python; TorchScript
# raises them as ``torch.jit.Error`` (a step may catch that)
_SCRIPT_RAISES = (
    ValueError, AssertionError, TypeError, LookupError, ArithmeticError, NotImplementedError,
)


@contextlib.contextmanager
def compiled_helpers_and_checkpoints_as_eager() -> Iterator[None]:
    """While the step is traced: see the NOTE."""
    import torch.utils.checkpoint as checkpoint_module
    from torch.jit._state import _try_get_jit_cached_function

    script_call = torch.jit.ScriptFunction.__call__

    def call_as_python(self: Any, *args: Any, **kwargs: Any) -> Any:
        python: Callable[..., Any] | None = getattr(self, "_torchdynamo_inline", None)
        # scripted, not traced: ``torch.jit.trace`` sets ``_torchdynamo_inline`` too, but
        # its function froze one way through the Python's ifs, which eager keeps taking
        scripted = _try_get_jit_cached_function(python) if callable(python) else None
        if python is None or scripted is None or scripted.qualified_name != self.qualified_name:
            return script_call(self, *args, **kwargs)
        try:
            return python(*args, **kwargs)
        except _SCRIPT_RAISES as exc:  # a ``raise`` in TorchScript is a torch.jit.Error
            raise torch.jit.Error(f"{type(exc).__name__}: {exc}") from exc

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(torch.jit.ScriptFunction, "__call__", call_as_python))
        if hasattr(checkpoint_module, "_is_compiling"):
            stack.enter_context(mock.patch.object(checkpoint_module, "_is_compiling", lambda *a, **k: False))
        dynamo = sys.modules.get("torch._dynamo")  # imported by the user's torch.compile, if any
        if dynamo is not None and hasattr(dynamo.config, "error_on_nested_fx_trace"):
            stack.enter_context(dynamo.config.patch(error_on_nested_fx_trace=False))
        yield


@contextlib.contextmanager
def light_stack_traces() -> Iterator[None]:
    """Inside: fx tracers that keep forward frames only record their stack traces from a
    walk over the kept frames (NOTE: [stack traces without the whole stack])."""
    import torch.fx.proxy as fx_proxy

    real = fx_proxy.CapturedTraceback
    if isinstance(real, _LightTraceback):  # nested
        yield
        return
    fx_proxy.CapturedTraceback = _LightTraceback(real)  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        fx_proxy.CapturedTraceback = real  # type: ignore[misc]


@contextlib.contextmanager
def nodes_created_seen(seen: Callable[[torch.fx.Node], None]) -> Iterator[None]:
    """Inside: every node an fx tracer creates is passed to ``seen`` right after its
    creation, while the Python stack that made it is still running (NOTE: [random draws
    shaped like a tensor]: the line of a refused draw inside a helper function, which
    the recorded stack traces keep no frame of)."""
    from torch.fx.proxy import TracerBase

    real = TracerBase.create_node

    def create_node(self: Any, *args: Any, **kwargs: Any) -> torch.fx.Node:
        node = real(self, *args, **kwargs)
        seen(node)
        return node

    with mock.patch.object(TracerBase, "create_node", create_node):
        yield


@contextlib.contextmanager
def lazy_graph_modules() -> Iterator[None]:
    """Inside: graph modules that make_fx returns, and the ``recompile()`` calls on them,
    generate their Python code only when it is read or the module is called.

    NOTE: [code generated once]
    A compile traces four graph modules (the first and the steady capture, the
    functionalization, the per-rank program) and rewrites them pass by pass; fx generated
    and ``exec``-ed each one's whole Python source at its construction and at every
    ``recompile()`` (ten per compile). Measured on the 8-layer demo GPT (ddp, 2 simulated
    ranks, 4,909 nodes): 3.66 s of a 32.3 s compile. The runtime calls only the final
    program, and an error or ``explain`` reads only its ``code``: with torch's
    ``_LazyGraphModule`` (what Inductor uses for its pattern graphs) each is generated
    where it is needed.
    """
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    with _use_lazy_graph_module(True):
        yield


def current_trace_graph() -> torch.fx.Graph | None:
    """The graph that the active ``make_fx`` trace is writing to, if any."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    mode = get_proxy_mode()
    return None if mode is None else mode.tracer.graph


def traced_node_of(t: torch.Tensor) -> torch.fx.Node | None:
    """The node of the active ``make_fx`` trace that produced ``t``, if any."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot

    mode = get_proxy_mode()
    if mode is None:
        return None
    slot = get_proxy_slot(t, mode.tracer, None)
    return None if slot is None else slot.proxy.node


def trace_constant(node: torch.fx.Node) -> Any:
    """The real value of a ``get_attr`` node of the active ``make_fx`` trace (a tensor
    constant the trace keeps on its tracer's root: ``torch.tensor([...])`` in the step),
    or None."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    mode = get_proxy_mode()
    if mode is None or node.op != "get_attr" or not isinstance(node.target, str):
        return None
    root = getattr(mode.tracer, "root", None)  # make_fx's tracer keeps its constants there
    try:
        return operator.attrgetter(node.target)(root) if root is not None else None
    except AttributeError:
        return None


def operator_schemas(qualified_name: str) -> list[Any]:
    """The schemas of every overload of the operator ``qualified_name`` (``aten::add_``),
    none where it is unknown (NOTE: [0-d tensors in Scalar arguments])."""
    try:
        return list(torch._C._jit_get_schemas_for_operator(qualified_name))
    except RuntimeError:
        return []


@contextlib.contextmanager
def outside_the_trace() -> Iterator[None]:
    """Inside: ops run eagerly on real tensors while a ``make_fx`` trace is active (its
    proxy and fake modes, and every torch function mode, set aside)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing
    from torch.utils._python_dispatch import _disable_current_modes

    with (
        disable_proxy_modes_tracing(), unset_fake_temporarily(), _disable_current_modes(),
        torch._C.DisableTorchFunction(), torch.no_grad(),
    ):
        yield


def eager_attention_takes_cpu_flash(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
    dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool,
) -> bool:
    """Whether eager ``F.scaled_dot_product_attention`` runs torch's CPU flash kernel for
    tensors like these (NOTE: [the CPU flash kernel at capture]): ``_fused_sdp_choice`` on
    empty real tensors of their shapes, strides, dtypes and ``requires_grad``, in the
    caller's grad mode and under autocast never (autocast casts the call's inputs)."""
    from torch.nn.attention import SDPBackend

    tensors = [t for t in (query, key, value, attn_mask) if t is not None]
    if any(t.device.type != "cpu" for t in tensors) or torch.is_autocast_enabled("cpu"):
        return False
    if any(not isinstance(n, int) for t in tensors for n in (*t.shape, *t.stride())):
        return False
    grad = torch.is_grad_enabled()

    def empty(t: torch.Tensor) -> torch.Tensor:
        real = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype)
        return real.requires_grad_(t.requires_grad)

    with outside_the_trace(), torch.set_grad_enabled(grad):
        choice = torch._fused_sdp_choice(
            empty(query), empty(key), empty(value), attn_mask=None if attn_mask is None else empty(attn_mask),
            dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
        )
    return bool(choice == SDPBackend.FLASH_ATTENTION.value)


def random_op(target: Any) -> bool:
    """An ATen op that draws random numbers (its ``nondeterministic_seeded`` tag)."""
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags


def data_dependent_error_types() -> tuple[type[BaseException], ...]:
    """Exceptions fake tensors raise when Python code reads a tensor's value."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
    )
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    return (DataDependentOutputException, DynamicOutputShapeException, GuardOnDataDependentSymNode)


def value_dependent_shape_op(exc: BaseException) -> Any:
    """The op of a fake-tensor error raised because the op's output shape depends on its
    input's values (``nonzero``, ``bincount``, ``unique``, ...); None for other errors."""
    from torch._subclasses.fake_tensor import DynamicOutputShapeException

    return exc.func if isinstance(exc, DynamicOutputShapeException) else None


def value_dependent_shape_error(op: Any) -> Exception:
    """The error fake tensors raise for ``op`` whose output shape depends on its input's
    values (``value_dependent_shape_op`` reads ``op`` back from it)."""
    from torch._subclasses.fake_tensor import DynamicOutputShapeException

    return DynamicOutputShapeException(op)


def graph_node_at_line(gm: torch.fx.GraphModule, lineno: int) -> torch.fx.Node | None:
    """The node whose code is at line ``lineno`` of ``gm``'s generated ``forward``, or None
    (fx's ``_lineno_map``, keyed by the line within the function, gives the node's index:
    how dynamo finds the node of a frame in a graph module, ``output_graph.py``)."""
    lines = getattr(gm, "_lineno_map", None)
    if not lines:
        return None
    index = lines.get(lineno - type(gm).forward.__code__.co_firstlineno)
    if index is None:
        return None
    nodes = list(gm.graph.nodes)
    return nodes[index] if 0 <= index < len(nodes) else None


def is_real_tensor_constant(t: torch.Tensor) -> bool:
    """True for a real (not fake) tensor met while a fake trace runs: a graph constant."""
    from torch._subclasses.fake_tensor import FakeTensor, maybe_get_fake_mode

    return not isinstance(t, FakeTensor) and maybe_get_fake_mode(t) is None


def lift_constant(t: torch.Tensor) -> torch.Tensor:
    """A real tensor constant as a value of the active ``make_fx`` trace.

    The trace records it as a ``get_attr`` constant followed by ``lift_fresh_copy``; the
    result is a fake tensor the trace tracks, which DTensor can wrap.
    """
    return torch.ops.aten.lift_fresh_copy.default(t)


def fake_tensor_mode(with_shape_env: bool = False, allow_real_tensors: bool = False) -> Any:
    """A fake tensor mode; ``allow_real_tensors``: real tensors met in ops are read as
    constants (capture: NOTE: [tensors read from outside the arguments])."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    return FakeTensorMode(
        allow_non_fake_inputs=allow_real_tensors,
        shape_env=ShapeEnv() if with_shape_env else None,
    )


# ---------------------------------------------------------------------------- DTensor


def rehome(dtensor: DTensor, mesh: DeviceMesh) -> None:
    """Put ``dtensor`` on ``mesh``, a mesh equal to its own (the same ranks, shape and
    names) whose process groups are live, in place: parameters and optimizer state keep
    their identity (NOTE: [state after a simulation] in runtime/simulate.py)."""
    if dtensor.device_mesh != mesh:
        raise ValueError(f"{dtensor.device_mesh} and {mesh} are not the same ranks")
    spec = copy.copy(dtensor._spec)
    spec.mesh = mesh  # DTensorSpec.__setattr__ drops its cached hash
    dtensor._spec = spec


def local_tensor_of(dtensor: DTensor) -> torch.Tensor:
    """The local shard of ``dtensor`` without going through autograd."""
    return dtensor._local_tensor


_LOCAL_TENSOR = operator.attrgetter("_local_tensor")


def local_tensors_of(dtensors: Iterable[DTensor]) -> Iterator[torch.Tensor]:
    """The local shards of ``dtensors``, read in C (the feed of every call: NOTE: [one
    walk over the state per call])."""
    return map(_LOCAL_TENSOR, dtensors)


def version_of(t: torch.Tensor) -> int:
    """``t``'s version counter, which every in-place write to it advances (NOTE: [writes
    between calls while an update is pending] in runtime/step_executable.py)."""
    return t._version


def dtensor_of_local(
    local: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Any], shape: torch.Size,
    stride: tuple[int, ...],
) -> DTensor:
    """``DTensor.from_local`` without the local's storage offset on the wrapper: NOTE:
    [placed state that deepcopy copies]."""
    offset = local.storage_offset()
    stand_in = local.as_strided(local.shape, local.stride(), 0) if offset else local
    dtensor = DTensor.from_local(stand_in, mesh, list(placements), run_check=False, shape=shape, stride=stride)
    if offset:
        dtensor._local_tensor = local
    return dtensor


# NOTE: [placed state that deepcopy copies]
# A DTensor's wrapper takes its storage offset from the local tensor it is made from,
# and a program's gradients are views into one flat buffer (a Linear's weight gradient
# at offset 4, after its bias): the wrapper's data_ptr() was then 16, not 0, so
# ``Tensor.__deepcopy__`` took it for a tensor with storage and copied a wrapper's
# storage that holds no data: ``copy.deepcopy(model)`` after a compiled step (DQN's
# target network, an EMA copy, which copy the parameters' .grad too) raised "Attempted
# to call copy_() on an invalid python storage". A wrapper holds no data, so its offset
# says nothing: state the runner wraps is made over an offset-0 alias of the local
# (``as_strided`` to offset 0, no copy, not read) and then given the real local, and
# deepcopy takes its wrapper-subclass route (``clone``): an independent DTensor with the
# same placement and values.


def set_local_tensor(dtensor: DTensor, local: torch.Tensor) -> None:
    """Swap the local shard of ``dtensor`` for ``local`` (same shape, dtype, device)."""
    dtensor._local_tensor = local


def plain_attribute_reads() -> contextlib.AbstractContextManager[None]:
    """Tensor attributes (``shape``, ``grad``, hooks) read off a DTensor at a plain
    tensor's cost while it is active: a subclass's attribute getters first look for a
    ``__torch_function__`` override (DTensor has none), 2x slower. Only for reads: no op
    may run inside (NOTE: [one walk over the state per call])."""
    return torch._C.DisableTorchFunctionSubclass()


def ambient_autocast() -> tuple[tuple[str, torch.dtype], ...]:
    """The ``torch.autocast`` regions the caller is in: (device type, dtype) each."""
    return tuple(
        (device, torch.get_autocast_dtype(device))
        for device in ("cpu", "cuda") if torch.is_autocast_enabled(device)
    )


_SMALLEST_NORMAL = sys.float_info.min  # a module global: no constant folding of the probe


def call_settings() -> tuple[Any, ...]:
    """torch's process and thread settings around a compiled call that change what its
    capture traces, besides the grad mode, autocast and the default dtype (NOTE:
    [torch settings in the program key] in ``api.py``), in ``CALL_SETTINGS``' order.
    1.1 us with none set, 5 us under a default device, 8 us under ``save_on_cpu``."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return (
        _default_device() if torch._C._len_torch_function_stack() else None,
        # flush-denormal mode (no getter in torch): it flushes Python's floats too
        _SMALLEST_NORMAL / 2.0 == 0.0,
        _sdpa_backends(),
        None if hooks is None else tuple(_hook_identity(f) for f in hooks),
    )


# the names of ``call_settings``' parts, for the recompile log
CALL_SETTINGS = (
    "torch's default device (torch.set_default_device)",
    "torch's flush-denormal mode (torch.set_flush_denormal)",
    "the attention backends enabled (torch.nn.attention.sdpa_kernel)",
    "the saved-tensor hooks around the call (torch.autograd.graph.saved_tensors_hooks)",
)


def call_setting_text(k: int, value: Any) -> str:
    """Part ``k`` of ``call_settings()`` in a recompile line."""
    if k == 2:
        names = [n for n, on in zip(_SDPA_NAMES, value) if on]
        return ", ".join(names) or "none"
    if value is None:
        return "unset"
    if k == 3:
        return ", ".join(_hook_text(f) for f in value)
    return str(value)


def _hook_text(key: Any) -> str:
    """A hook's part of ``_hook_identity`` as the recompile line shows it: what differs
    between two calls shows (a plain value it holds, or which object it is)."""
    if isinstance(key, tuple) and key and key[0] == "partial":
        return f"partial({', '.join(_hook_text(p) for p in key[1])})"
    if isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], types.CodeType):
        code, values = key
        held = f" holding {', '.join(repr(v) for _, v in values)}" if values else ""
        return f"{code.co_qualname}{held}"
    if isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], type):
        return repr(key[1])  # a plain value a partial binds
    name = getattr(key, "__qualname__", type(key).__qualname__)
    return f"{name} (the object at {id(key):#x})"


def _default_device() -> str | None:
    """The device of the innermost ``torch.set_default_device`` / ``with torch.device``
    mode (``torch.get_default_device`` takes 7.6 us); None outside one."""
    from torch.utils._device import DeviceContext

    for i in range(torch._C._len_torch_function_stack() - 1, -1, -1):
        mode = torch._C._get_function_stack_at(i)
        if isinstance(mode, DeviceContext):
            return None if str(mode.device) == "cpu" else str(mode.device)  # "cpu": as unset
    return None


_SDPA_NAMES = tuple(
    name for name in ("flash", "mem_efficient", "math", "cudnn", "overrideable")
    if hasattr(torch._C, f"_get_{name}_sdp_enabled")
)
_SDPA_FLAGS = tuple(getattr(torch._C, f"_get_{name}_sdp_enabled") for name in _SDPA_NAMES)


def _sdpa_backends() -> tuple[bool, ...]:
    """Which of ``F.scaled_dot_product_attention``'s backends are enabled (the global
    flags ``torch.nn.attention.sdpa_kernel`` and ``torch.backends.cuda.enable_*_sdp`` set)."""
    return tuple([f() for f in _SDPA_FLAGS])  # a list: half a generator's time


_PLAIN_CELLS = (type(None), bool, int, float, str, torch.device, torch.dtype)


def _hook_identity(fn: Any) -> Any:
    """A saved-tensor hook as the program key holds it: a plain function by its code and
    the plain values it closes over and defaults to (``save_on_cpu`` makes new closures on
    every entry, over a bool and a module; a lambda written in the loop is new on every
    call), a ``functools.partial`` by its function's and its arguments' identities (plain
    values by value, functions as hooks are), anything else by itself.

    NOTE: [saved-tensor hooks made every call]
    A hook closing over a fresh object (a list it counts in) or a partial binding one is
    new every call and keyed by itself: a program per call, as a hook that reads a value
    which changes may compute otherwise (keying it by its code alone could serve a wrong
    program). The recompile line names the hook and which object or value differs, and
    the compiled step warns at the third such change (``api.py``'s ``_count_recompile``),
    saying to make the hooks once, outside the loop."""
    if isinstance(fn, functools.partial):
        parts = [_hook_identity(fn.func)]
        for v in (*fn.args, *fn.keywords.values()):
            if type(v) in _PLAIN_CELLS or isinstance(v, types.ModuleType):
                parts.append((type(v), v))
            elif isinstance(v, (types.FunctionType, functools.partial)):
                parts.append(_hook_identity(v))
            else:
                return fn
        return "partial", tuple(parts), tuple(fn.keywords)
    code = getattr(fn, "__code__", None)
    if not isinstance(fn, types.FunctionType) or code is None:
        return fn
    try:
        values = [c.cell_contents for c in fn.__closure__ or ()]
    except ValueError:  # a cell not yet assigned
        return fn
    values += [*(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values()]
    if not all(type(v) in _PLAIN_CELLS or isinstance(v, types.ModuleType) for v in values):
        return fn
    return code, tuple((type(v), v) for v in values)  # typed: 1 == True == 1.0


@contextlib.contextmanager
def autocast_regions(ambient: tuple[tuple[str, torch.dtype], ...], enabled: bool) -> Iterator[None]:
    """Enter the autocast regions ``ambient`` again, or leave them for a while
    (``enabled=False``; NOTE: [autocast around the step] in ``api.py``)."""
    with contextlib.ExitStack() as stack:
        for device, dtype in ambient:
            stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
        yield


def has_tensor_hooks(t: torch.Tensor) -> bool:
    """Whether a hook is registered on ``t`` itself (``Tensor.register_hook``,
    ``register_post_accumulate_grad_hook``; removed ones leave an empty dict)."""
    return bool(t._backward_hooks) or bool(t._post_accumulate_grad_hooks)


def global_hook_dicts() -> list[tuple[str, dict]]:
    """torch's process-wide module and optimizer hooks (``register_module_forward_hook``,
    ``register_optimizer_step_pre_hook``, ...), each dict with what it holds."""
    from torch.nn.modules import module
    from torch.optim import optimizer

    return [
        ("global module forward pre-hooks", module._global_forward_pre_hooks),
        ("global module forward hooks", module._global_forward_hooks),
        ("global module backward pre-hooks", module._global_backward_pre_hooks),
        ("global module backward hooks", module._global_backward_hooks),
        ("global optimizer step pre-hooks", optimizer._global_optimizer_pre_hooks),
        ("global optimizer step post-hooks", optimizer._global_optimizer_post_hooks),
    ]


class RedistributionCache(dict):
    """The memo of ``memoized_redistribution``; ``bypass()`` turns it off for a while
    (a mode that asks for a fresh gather, e.g. FSDP's backward re-gather).
    ``round_when_reduced`` names a local tensor whose pending sum is rounded to a low
    precision once reduced (NOTE: [low-precision partials rounded where reduced] in
    ``expand/retrace.py``)."""

    bypassed = False

    def __init__(self) -> None:
        super().__init__()
        # id(local tensor) -> (the tensor, kept alive so the id is not reused; its dtype)
        self._rounded: dict[int, tuple[torch.Tensor, torch.dtype]] = {}

    @contextlib.contextmanager
    def bypass(self) -> Iterator[None]:
        self.bypassed = True
        try:
            yield
        finally:
            self.bypassed = False

    def round_when_reduced(self, local: torch.Tensor, dtype: torch.dtype) -> None:
        """Round ``local``'s sum to ``dtype`` (and back) where a redistribution reduces it."""
        self._rounded[id(local)] = (local, dtype)

    def rounding_of(self, local: torch.Tensor) -> torch.dtype | None:
        """The dtype ``local``'s sum is rounded to once reduced, or None."""
        hit = self._rounded.get(id(local))
        return hit[1] if hit is not None and hit[0] is local else None

    def rounded(self, local: torch.Tensor, before: Any, after: Any, out: torch.Tensor) -> torch.Tensor:
        """``out``, ``local`` redistributed from spec ``before`` to ``after``, rounded
        where that reduced the last of a sum ``round_when_reduced`` named (still marked
        where a partial is left)."""
        dtype = self.rounding_of(local)
        if dtype is None or not any(p.is_partial() for p in before.placements):
            return out
        if any(p.is_partial() for p in after.placements):
            self.round_when_reduced(out, dtype)
            return out
        return _round_through(out, dtype)


def _round_through(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``value`` rounded to ``dtype`` and back to its own dtype (NOTE: [low-precision
    partials rounded where reduced])."""
    low = torch.ops.aten._to_copy.default(value, dtype=dtype)
    return torch.ops.aten._to_copy.default(low, dtype=value.dtype)


def _between_sum_and_avg_partials(local: torch.Tensor, current_spec: Any, target_spec: Any) -> Any:
    """``Partial("avg")`` to ``Partial("sum")`` (or back) on a mesh dimension, in the
    local tensor: divide by (multiply by) that dimension's size. Returns the local tensor
    and its spec after that.

    torch 2.11 gap: its pointwise rule adds a ``Partial("sum")`` and a ``Partial("avg")``
    by redistributing one to the other, which its redistribution then refuses
    ("Redistribution from one partial type (P(avg)) to another (P(sum)) is
    unsupported"): ``F.cross_entropy(out, y) + 0.01 * out.pow(2).mean()`` under data
    parallelism failed to compile. Both are sums of the ranks' values, one of them
    divided by the ranks, so the change is local."""
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    placements = list(current_spec.placements)
    for i, (cur, tgt) in enumerate(zip(current_spec.placements, target_spec.placements, strict=True)):
        if not (isinstance(cur, Partial) and isinstance(tgt, Partial)):
            continue
        ops = (cur.reduce_op, tgt.reduce_op)
        if ops == ("avg", "sum"):
            local = local / current_spec.mesh.size(i)
        elif ops == ("sum", "avg"):
            local = local * current_spec.mesh.size(i)
        else:
            continue
        placements[i] = tgt
    if placements == list(current_spec.placements):
        return local, current_spec
    return local, DTensorSpec(current_spec.mesh, tuple(placements), tensor_meta=current_spec.tensor_meta)


def _replicate_between_shards(current_spec: Any, target_spec: Any) -> Any:
    """An intermediate spec with Replicate wherever a mesh dimension goes from one shard
    to another (``Shard(a) -> Shard(b)``), or None.

    torch 2.13 gap: on CPU such a step is an all-to-all emulated by all-gather + chunk,
    and under ``compile_on_one_rank`` that chunk is rank 0's, baked into the program
    (every rank keeps rank 0's rows). Going through Replicate uses the same all-gather
    and then the run-time coordinate to keep this rank's slice.
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    hops = [
        Replicate() if cur.is_shard() and tgt.is_shard() and cur != tgt else cur
        for cur, tgt in zip(current_spec.placements, target_spec.placements, strict=True)
    ]
    if tuple(hops) == tuple(current_spec.placements):
        return None
    return DTensorSpec(current_spec.mesh, tuple(hops), tensor_meta=current_spec.tensor_meta)


def _strided_redistribution_gap(current_spec: Any, target_spec: Any) -> bool:
    """True when this torch's redistribution planner cannot leave ``current_spec``'s
    ``_StridedShard`` (torch 2.11 reads every ``_StridedShard`` as a shard order and raises
    for the ones a view makes, e.g. ``[b, t, v] -> [b*t, v]`` with ``t`` sharded)."""
    if not any(is_strided_shard(p) for p in current_spec.placements):
        return False
    return _planner_raises(current_spec, target_spec)


def _strided_target_gap(current_spec: Any, target_spec: Any) -> bool:
    """True when this torch's redistribution planner cannot reach ``target_spec``'s
    ``_StridedShard`` (torch 2.11 reads it only as a shard order: a fused qkv weight's
    ``_StridedShard(0, sf=3)`` on a 1-D mesh "is unable to be interpreted"; 2.14 falls
    back to its greedy planner)."""
    if not any(
        is_strided_shard(t) and t != c
        for c, t in zip(current_spec.placements, target_spec.placements, strict=True)
    ):
        return False
    return _planner_raises(current_spec, target_spec)


def _planner_raises(current_spec: Any, target_spec: Any) -> bool:
    """Whether this torch's redistribution planner refuses ``current_spec -> target_spec``."""
    import torch.distributed.tensor._redistribute as redistribute_module

    try:
        redistribute_module._gen_transform_infos(current_spec, target_spec)
    except (ValueError, AssertionError):
        return True
    return False


def _scatter_strided_shards(
    local: torch.Tensor, spec: Any, target_spec: Any, redistribute: Callable[..., torch.Tensor]
) -> tuple[torch.Tensor, Any]:
    """Reach the ``_StridedShard``s of ``target_spec`` that ``spec`` lacks through
    Replicate: ``redistribute`` (DTensor's) moves the mesh dims before the first such one
    to their target and replicates the others, then each of those mesh dims takes this rank's shard of the target with
    DTensor's own ``_replicate_to_strided_shard`` / ``_replicate_to_shard`` and the
    (run-time) mesh coordinate, left-most first (each splits the shard of the ones
    before it, as DTensor lays nested shards out)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    first = min(
        m for m, (c, t) in enumerate(zip(spec.placements, target_spec.placements, strict=True))
        if is_strided_shard(t) and t != c
    )
    targets = target_spec.placements
    nested = [
        m for m in range(first + 1, len(targets))
        if (targets[m].is_shard() or is_strided_shard(targets[m]))
        and any(is_strided_shard(t) and t.dim == targets[m].dim for t in targets[first:m])
    ]
    if nested:  # a strided shard read as a shard order: not a layout this fill makes
        raise RuntimeError(
            f"spmd_compiler: this torch's DTensor cannot redistribute a tensor of shape "
            f"{tuple(spec.shape)} from {spec.placements} to {targets} (a _StridedShard "
            f"sharded again by a later mesh dim)."
        )
    # mesh dims before the first take their target now (the planner cannot move them once
    # a strided shard it cannot read is in place: (S(0), R) -> (R, _S(0, 3)), a fused
    # bias under FSDP x TP on 2.11); the rest are replicated, then split
    placements = [targets[m] if m < first else Replicate() for m in range(len(targets))]
    staging = DTensorSpec(spec.mesh, tuple(placements), tensor_meta=spec.tensor_meta)
    if staging != spec:
        local = redistribute(local, spec, staging)
    mesh = spec.mesh
    for m in range(first, len(placements)):
        p = target_spec.placements[m]
        if is_strided_shard(p):
            local = p._replicate_to_strided_shard(  # type: ignore[attr-defined]
                local, mesh, m, mesh._sym_get_coordinate(m)
            )
        elif p.is_shard():
            local = p._replicate_to_shard(local, mesh, m, mesh._sym_get_coordinate(m))
        elif not p.is_replicate():
            raise RuntimeError(
                f"spmd_compiler: this torch's DTensor cannot redistribute a tensor of shape "
                f"{tuple(spec.shape)} from {spec.placements} to {target_spec.placements}."
            )
        placements[m] = p
    return local, DTensorSpec(mesh, tuple(placements), tensor_meta=spec.tensor_meta)


def _gather_strided_shards(local: torch.Tensor, spec: Any, target_spec: Any) -> tuple[torch.Tensor, Any]:
    """All-gather every ``_StridedShard`` mesh dim whose target differs into Replicate.

    Rank ``r`` holds piece ``r`` of each of the ``split_factor`` blocks of the dim, so the
    gathered ``[n, split_factor, piece]`` is put back in ``[split_factor, n, piece]``
    order. Right-most mesh dims first: each acts on the shard of the ones before it.
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    placements = list(spec.placements)
    for m in reversed(range(len(placements))):
        p = placements[m]
        if not is_strided_shard(p) or p == target_spec.placements[m]:
            continue
        n, d, size = spec.mesh.size(m), p.dim, local.shape[p.dim]
        if size % p.split_factor:
            raise RuntimeError(
                f"spmd_compiler: this torch's DTensor cannot redistribute an uneven "
                f"{p} (local size {size}) of a tensor of shape {tuple(spec.shape)}."
            )
        gathered = all_gather_along(local.contiguous(), d, spec.mesh, m)
        local = gathered.unflatten(d, (n, p.split_factor, size // p.split_factor))
        local = local.transpose(d, d + 1).flatten(d, d + 2)
        placements[m] = Replicate()
    return local, DTensorSpec(spec.mesh, tuple(placements), tensor_meta=spec.tensor_meta)


@contextlib.contextmanager
def memoized_redistribution() -> Iterator[RedistributionCache]:
    """Redistribute each (value, source spec, target spec) at most once.

    DTensor redistributes an argument separately at every use (a Partial gradient used by
    three optimizer ops is all-reduced three times). Inside this context the dispatcher's
    redistribution goes through a cache keyed by the local tensor's identity and both
    specs. The cache keeps its keys alive, so identities are never reused while it lives.
    It is only sound for functional graphs (no value is mutated after it was
    redistributed), which is what the expander runs.
    """
    import torch.distributed.tensor._dispatch as dispatch_module
    import torch.distributed.tensor._redistribute as redistribute_module

    original = redistribute_module.redistribute_local_tensor
    cache = RedistributionCache()

    def redistribute(local_tensor, current_spec, target_spec, *args, **kwargs):
        out = _redistribute(local_tensor, current_spec, target_spec, *args, **kwargs)
        return cache.rounded(local_tensor, current_spec, target_spec, out)

    def _redistribute(local_tensor, current_spec, target_spec, *args, **kwargs):
        if _strided_redistribution_gap(current_spec, target_spec):
            local_tensor, current_spec = _gather_strided_shards(local_tensor, current_spec, target_spec)
        if _strided_target_gap(current_spec, target_spec):
            local_tensor, current_spec = _scatter_strided_shards(
                local_tensor, current_spec, target_spec,
                lambda t, a, b: redistribute(t, a, b, *args, **kwargs),
            )
            if current_spec == target_spec:
                return local_tensor
        local_tensor, current_spec = _between_sum_and_avg_partials(local_tensor, current_spec, target_spec)
        hop = _replicate_between_shards(current_spec, target_spec)
        if hop is not None:
            local_tensor = original(local_tensor, current_spec, hop, *args, **kwargs)
            current_spec = hop
        return original(local_tensor, current_spec, target_spec, *args, **kwargs)

    # NOTE: [a masked partial redistributed twice]
    # A ``_MaskPartial`` value (an embedding's output over a vocabulary-sharded weight)
    # gives up its mask to its first reduction. Where a second use asks for another target
    # (tied embedding and head under fsdp_tp: (Shard, Shard) for one reader, (Shard,
    # Replicate) for the next), torch found the mask gone and failed an assertion. The
    # second redistribution starts from the first one's reduced result instead: the same
    # value, with no partial left.
    reduced: dict[tuple[int, Any], tuple[Any, Any, Any]] = {}

    def cached(local_tensor, current_spec, target_spec, *args, **kwargs):
        if cache.bypassed:
            return redistribute(local_tensor, current_spec, target_spec, *args, **kwargs)
        # a split onto a masked partial is its mask object's own (NOTE: [a mask for every
        # lookup]): equal placements of two lookups share no split
        masks = tuple(id(p) for p in target_spec.placements if is_mask_partial(p))
        key = (id(local_tensor), current_spec, target_spec, masks)
        hit = cache.get(key)
        if hit is not None and hit[0] is local_tensor:
            return hit[1]
        masked = any(is_mask_partial(p) for p in current_spec.placements)
        earlier = reduced.get((id(local_tensor), current_spec)) if masked else None
        if earlier is not None and earlier[0] is local_tensor:
            out = cached(earlier[1], earlier[2], target_spec, *args, **kwargs)
        else:
            out = redistribute(local_tensor, current_spec, target_spec, *args, **kwargs)
            if masked and not any(p.is_partial() for p in target_spec.placements):
                reduced[(id(local_tensor), current_spec)] = (local_tensor, out, target_spec)
        cache[key] = (local_tensor, out)
        return out

    modules = (dispatch_module, redistribute_module)
    for module in modules:
        module.redistribute_local_tensor = cached  # type: ignore[attr-defined]
    _ACTIVE_CACHES.append(cache)
    try:
        yield cache
    finally:
        _ACTIVE_CACHES.remove(cache)
        for module in modules:
            module.redistribute_local_tensor = original  # type: ignore[attr-defined]


_ACTIVE_CACHES: list[RedistributionCache] = []  # the memoized_redistribution contexts open


def round_reduced_sum(partial: torch.Tensor, reduced: torch.Tensor) -> torch.Tensor:
    """``reduced``, the whole sum of the local ``partial`` that a mode reduced by hand
    (fsdp_tp's gradients, not through DTensor's redistribution), rounded as
    ``RedistributionCache.rounded`` rounds one it reduces (NOTE: [low-precision partials
    rounded where reduced])."""
    dtype = _ACTIVE_CACHES[-1].rounding_of(partial) if _ACTIVE_CACHES else None
    return reduced if dtype is None else _round_through(reduced, dtype)


# NOTE: [Python numbers in DTensor's native sharding cache]
# DTensor's C++ dispatch caches each sharding decision under a key that reads a Python
# number argument as a 0-d replicated tensor of the number's dtype (torch 2.11, 2.13 and
# 2.14.1 alike). So ``add(P, 2.0)``, with ``P`` a partial 0-d float64 sum, found the
# decision cached for ``add(P, R)``, ``R`` a 0-d replicated float64 tensor: keep the sum
# partial and split ``R`` over the ranks. It then added 2.0 on every rank, silently: a
# step returning ``(x * w).sum() + b + 2.0`` under data parallelism lost 54.1 where one
# device gives 52.1, and the same ``+ 2.0`` was wrong in a second step compiled after
# one holding ``+ b`` (the cache outlives a compile). The opposite order failed
# ("'float' object has no attribute 'placements'"). An op given a Python number therefore
# runs with the native cache emptied before and after it: it finds no tensor's decision
# and leaves none of its own. Its decision comes from the Python propagator, whose key
# holds the number's place (``OpSchema``'s comparison key). Tested by
# tests/sim/test_python_numbers_in_sharding.py.
_PYTHON_NUMBERS = (bool, int, float, complex)


@contextlib.contextmanager
def numbers_kept_out_of_sharding_cache(args: tuple, kwargs: dict) -> Iterator[None]:
    """Inside: DTensor ops given a Python number among ``args`` / ``kwargs`` (see the
    NOTE) neither read nor write DTensor's native sharding cache."""
    clear = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    values = (*args, *kwargs.values())
    if clear is None or not any(type(a) in _PYTHON_NUMBERS for a in values) or not any(
        isinstance(a, DTensor) and any(p.is_partial() for p in a.placements) for a in values
    ):
        yield
        return
    clear()
    try:
        yield
    finally:
        clear()


# NOTE: [complex numbers in DTensor's dispatch]
# DTensor's C++ dispatch computes its native sharding-cache key from every argument, and
# fails on a Python ``complex`` ("unhashable type: 'complex'", torch 2.13; a plain
# DTensor ``mul.Scalar(x, 1j)`` fails alike). Autograd's formulas give one to ordinary
# steps: ``Tensor.angle()``'s backward multiplies by ``1j`` (``mul.Scalar``), so does
# ``torch.polar``'s; such steps were refused at expansion (with a hint about batch
# dimensions that did not apply). An op given a complex number (and DTensors) is
# dispatched by DTensor's own Python steps instead: the same sharding rule (uncached;
# ``OpSchema`` hashes a complex number as Python does), redistribution, local op and
# output wrapping that the C++ path calls into; only the native key is skipped. A graph
# after functionalization holds no in-place or ``out=`` op, and views take no number;
# any such op is refused (``complex_number_dispatch_unsupported``). Tested by
# tests/sim/test_complex_parameters.py.
def has_complex_number(args: tuple, kwargs: dict) -> bool:
    """Whether ``args`` / ``kwargs`` hold a Python ``complex`` and a DTensor (NOTE:
    [complex numbers in DTensor's dispatch])."""
    values = (*args, *kwargs.values())
    if not any(type(a) is complex or (type(a) in (list, tuple) and complex in map(type, a)) for a in values):
        return False  # cheap: asked of every op of every expanded graph
    return any(isinstance(a, DTensor) for a in pytree.tree_leaves(values))


def complex_number_dispatch_unsupported(op: Any) -> str | None:
    """Why ``op`` cannot take the Python dispatch of NOTE: [complex numbers in DTensor's
    dispatch] (in place, ``out=``, a view), or None."""
    schema = op._schema
    if schema.is_mutable or any(a.is_out for a in schema.arguments):
        return "it writes its input in place"
    if schema._is_view_op():
        return "it is a view"
    return None


def dispatch_with_complex_number(op: Any, args: tuple, kwargs: dict) -> Any:
    """``op(*args, **kwargs)`` on DTensors through DTensor's Python dispatch steps (NOTE:
    [complex numbers in DTensor's dispatch]); a functional op only."""
    from torch.distributed.tensor._op_schema import OutputSharding

    dispatcher = DTensor._op_dispatcher
    info = dispatcher.unwrap_to_op_info(op, args, kwargs)
    sharding = dispatcher._propagate_op_sharding_dispatch_slow_path(op, args, kwargs, info, try_cache=False)
    if not isinstance(sharding, OutputSharding):  # decomposed (CompositeImplicitAutograd)
        return sharding
    info.output_sharding = sharding
    local = dispatcher._dispatch_get_local_results_slow_path(op, args, info)
    return dispatcher.wrap(local, sharding.output_spec)


def redistribute(value: DTensor, placements: Sequence[Any]) -> DTensor:
    """``value.redistribute`` to ``placements`` on its mesh, outside a trace, with this
    torch's gaps filled (``memoized_redistribution``'s hops, its cache bypassed): torch
    2.11 cannot plan a ``_StridedShard`` to ``Replicate`` (NOTE: [strided shards in a
    checkpoint])."""
    with memoized_redistribution() as cache, cache.bypass():
        return value.redistribute(value.device_mesh, tuple(placements))


class CostMemo(dict):
    """The memo of ``memoized_redistribute_cost``: (source spec, target spec) -> cost,
    with how often DTensor asked (``calls``) and how often it was computed (``misses``)."""

    calls = 0
    misses = 0


# Modules that call ``_collective_utils.redistribute_cost`` through their own global
# (``from ... import redistribute_cost``); the memo replaces it there.
_COST_CALLERS = ("torch.distributed.tensor._ops.utils", "torch.distributed.tensor._utils")


@contextlib.contextmanager
def memoized_redistribute_cost() -> Iterator[CostMemo]:
    """Compute DTensor's redistribution cost of each (source, target) spec pair once.

    torch 2.13 gap: while tracing, DTensor turns off its sharding-propagation and
    redistribution-plan caches (shapes may be symbolic). Every op then re-enumerates its
    strategies and, per strategy and input, plans a redistribution only to price it; on a
    2-D mesh under ``compile_on_one_rank`` each plan also traces the run-time mesh
    coordinate (a dozen graph nodes, dead afterwards). That was ~70% of the expansion
    of an fsdp_tp step. The cost is a pure function of the two specs on one mesh within
    one trace: the only side effects of computing it again are those dead nodes. So the
    memo lives for one trace (the caller opens it inside the traced function), and spec
    pairs that cannot be hashed (symbolic shapes) are computed every time.

    A computed price does not trace the mesh coordinate either: the planners read it only
    for each step's ``logical_shape`` (the local shape an uneven all-gather pads to),
    never to choose the steps, and the price reads only the steps (placements, mesh dim)
    and the global bytes. While pricing, ``_sym_get_coordinate`` answers a plain integer
    and the graph planner's ``get_logical_shape`` the global shape, unread (computing it
    for a ``_StridedShard`` materializes index tensors).

    The plans of real redistributions trace the coordinate for the same logical shapes;
    where every sharded dimension of both specs divides evenly, no shape depends on it
    (``size // n`` on every rank) and the plan is made the same way, without it. The
    coordinate nodes those plans traced were dead; the program is the same.

    torch 2.14 gap: its single-mesh-dim strategies (``t``, ``clone``, ``zeros_like``, ...)
    are expanded to every placement combination of the mesh and each is priced, ~40% more
    distinct (source, target) pairs than 2.13, mostly the same placements on tensors of
    other shapes. A price plans with the shape only for each step's logical shape (unread,
    above); the greedy planner chooses its steps from the placements alone, while the
    graph planner's search weighs steps by bytes. So a price reuses the plan of an earlier
    pair with the same placements, shard orders and rank where that plan was observed to
    come from the greedy planner only (``_placement_plan_key``); the price itself is still
    computed from this pair's bytes.

    Inside a plan, the graph-based planner prices each step of its search from the two
    states' specs (``one_step_redistribute_cost``), a pure function of the mesh, the
    tensor's metadata and the two states; every plan of a tensor of that shape asks it
    again, so each step is priced once per trace too, and each state's neighbours
    (``get_next_state``, with their step costs) are listed once per trace, keyed also by
    what the plan's target admits (its strided shards and partials' reduce ops, which the
    planner collects per plan).

    The rank's coordinate on a mesh dimension is traced once per trace (mesh, dimension
    and fake mode), not once per redistribution that reads it: each trace of it added an
    op, the mesh tensor it reads and a detach to the program (an fsdp_tp step of the demo
    GPT: 104 of each, ~300 of its 3,705 nodes, computed per call and rank). The value is
    the same everywhere in the program: the rank does not change within a step.
    """
    import importlib

    import torch.distributed.tensor._collective_utils as collective_utils
    import torch.distributed.tensor._redistribute as redistribute_module
    import torch.distributed.tensor._sharding_prop as sharding_prop_module
    from torch.distributed.device_mesh import DeviceMesh

    # absent from some releases: each patch below is skipped where its target is missing
    Planner = getattr(redistribute_module, "DTensorRedistributePlanner", None)  # noqa: N806
    original = getattr(collective_utils, "redistribute_cost", None)
    original_plan = getattr(redistribute_module, "_gen_transform_infos_non_cached", None)
    original_coordinate = getattr(DeviceMesh, "_sym_get_coordinate", None)
    original_logical_shape = getattr(Planner, "get_logical_shape", None)
    original_greedy = getattr(Planner, "generate_greedy_transform_infos", None)
    original_graph = getattr(Planner, "generate_graph_based_transform_infos", None)
    original_local_shape = getattr(sharding_prop_module, "compute_local_shape_and_global_offset", None)
    memo = CostMemo()
    pricing = [False]

    def local_shape_only(global_shape, mesh, placements, *args, **kwargs):
        # torch 2.11 gap: the sharding propagator's local shape of a shape argument
        # (zeros, new_empty, ...) asks for the run-time coordinate even when it cannot
        # matter (every shard the same size); 2.13 asks only where it does
        skip_offset = kwargs.get("skip_offset", args[0] if args else False)
        even = even_local_shape(global_shape, mesh, placements) if skip_offset else None
        if even is None or not mesh._is_current_rank_part_of_mesh():
            return original_local_shape(global_shape, mesh, placements, *args, **kwargs)
        return even, ()
    planners_run: list[str] = []  # the planner methods the current plan called
    greedy_plans: dict[Any, Any] = {}  # _placement_plan_key -> a priced greedy plan

    def greedy(planner, *args, **kwargs):
        planners_run.append("greedy")
        return original_greedy(planner, *args, **kwargs)

    def graph_based(planner, *args, **kwargs):
        planners_run.append("graph")
        return original_graph(planner, *args, **kwargs)

    def priced_plan(src_spec, dst_spec, *args, **kwargs):
        key = _placement_plan_key(src_spec, dst_spec, args, kwargs)
        steps = greedy_plans.get(key) if key is not None else None
        if steps is not None:
            return steps
        planners_run.clear()
        steps = original_plan(src_spec, dst_spec, *args, **kwargs)
        if key is not None and planners_run == ["greedy"]:
            greedy_plans[key] = steps
        return steps

    coordinates: dict[Any, Any] = {}  # (mesh, dim, fake mode) -> the traced coordinate

    def sym_get_coordinate(mesh, index):
        if pricing[0]:  # any coordinate prices the same steps (see above)
            return 0
        try:
            key = (mesh, index, id(torch._guards.detect_fake_mode()))
            hit = coordinates.get(key)
        except TypeError:  # a mesh that does not hash
            return original_coordinate(mesh, index)
        if hit is None:
            hit = coordinates[key] = original_coordinate(mesh, index)
        return hit

    def get_logical_shape(planner, src_state, mesh_dim, full_tensor_shape):
        if pricing[0] == "price":
            return list(full_tensor_shape)
        if pricing[0] == "even":
            even = _even_logical_shape(planner.device_mesh, src_state, mesh_dim, full_tensor_shape)
            if even is not None:
                return even
            pricing[0] = False  # not even after all: the real (traced) coordinate
            try:
                return original_logical_shape(planner, src_state, mesh_dim, full_tensor_shape)
            finally:
                pricing[0] = "even"
        return original_logical_shape(planner, src_state, mesh_dim, full_tensor_shape)

    def plan(src_spec, dst_spec, *args, **kwargs):
        if pricing[0] == "price":
            return priced_plan(src_spec, dst_spec, *args, **kwargs)
        if pricing[0] or not _evenly_sharded(src_spec, dst_spec):
            return original_plan(src_spec, dst_spec, *args, **kwargs)
        pricing[0] = "even"
        try:
            return original_plan(src_spec, dst_spec, *args, **kwargs)
        finally:
            pricing[0] = False

    def price(current_spec, target_spec):
        memo.misses += 1
        pricing[0] = "price"
        try:
            return original(current_spec, target_spec) + _uneven_penalty(current_spec, target_spec)
        except data_dependent_error_types():  # NOTE: [uncomputable redistribution costs]
            return float("inf")
        finally:
            pricing[0] = False

    def redistribute_cost(current_spec, target_spec):
        memo.calls += 1
        try:
            key = (_price_key(current_spec), _price_key(target_spec))
            hit = memo.get(key)
        except TypeError:  # a SymInt in a shape is not hashable
            return price(current_spec, target_spec)
        if hit is None:
            hit = memo[key] = price(current_spec, target_spec)
        return hit

    original_callbacks = getattr(Planner, "setup_cost_callbacks", None)
    step_costs: dict[Any, float] = {}

    def setup_cost_callbacks(planner):
        # The planner's search prices each step (one edge) from the two states' specs:
        # a pure function of the mesh, the tensor's metadata and the two states, asked
        # again by every plan of a tensor of that shape; priced once per trace here.
        original_callbacks(planner)
        edge_cost = getattr(planner, "cost_function", None)
        if edge_cost is None or not hasattr(planner, "dtensor_meta"):
            return  # another release's planner: its own costs

        def cost_function(src_state, dst_state):
            try:
                key = (planner.device_mesh, planner.dtensor_meta, src_state, dst_state)
                hit = step_costs.get(key)
            except TypeError:  # a SymInt in the metadata is not hashable
                return edge_cost(src_state, dst_state)
            if hit is None:
                hit = step_costs[key] = edge_cost(src_state, dst_state)
            return hit

        planner.cost_function = cost_function

    original_next = getattr(Planner, "get_next_state", None)
    next_states: dict[Any, Any] = {}

    def get_next_state(planner, *args):
        # The graph planner's search asks each state's neighbours and their step costs: a
        # pure function of the mesh, the tensor's metadata, the state and what the plan's
        # target admits (its strided shards, its partials' reduce ops); every plan of a
        # tensor of that shape searches mostly the same states again. Asked once per trace
        # here (the search only reads the answer).
        try:
            key = (planner.device_mesh, planner.dtensor_meta, args,
                   frozenset(getattr(planner, "strided_shard_placements_in_target", ())),
                   frozenset(getattr(planner, "partial_reduce_ops_in_target", ())))
            hit = next_states.get(key)
        except TypeError:  # a SymInt in the metadata is not hashable
            return original_next(planner, *args)
        if hit is None:
            hit = next_states[key] = original_next(planner, *args)
        return hit

    modules = [importlib.import_module(name) for name in _COST_CALLERS]
    # every caller's current function (DTensor's own, or our uncomputable-cost wrapper of
    # it, NOTE: [uncomputable redistribution costs]) is replaced, and put back after
    previous = {
        m: m.redistribute_cost for m in modules
        if original is not None and hasattr(m, "redistribute_cost")
    }
    for module in previous:
        module.redistribute_cost = redistribute_cost  # type: ignore[attr-defined]
    try:
        with contextlib.ExitStack() as stack:
            for owner, name, replacement in (
                (DeviceMesh, "_sym_get_coordinate", sym_get_coordinate),
                (Planner, "get_logical_shape", get_logical_shape),
                (redistribute_module, "_gen_transform_infos_non_cached", plan),
                (sharding_prop_module if original_local_shape else None,
                 "compute_local_shape_and_global_offset", local_shape_only),
                (Planner if original_greedy else None, "generate_greedy_transform_infos", greedy),
                (Planner if original_graph else None, "generate_graph_based_transform_infos",
                 graph_based),
                (Planner, "setup_cost_callbacks", setup_cost_callbacks),
                (Planner if original_next else None, "get_next_state", get_next_state),
            ):
                if owner is not None and hasattr(owner, name):
                    stack.enter_context(mock.patch.object(owner, name, replacement))
            yield memo
    finally:
        for module, function in previous.items():
            module.redistribute_cost = function  # type: ignore[attr-defined]


def _placement_plan_key(src_spec: Any, dst_spec: Any, args: tuple, kwargs: dict) -> Any:
    """What DTensor's greedy redistribution planner chooses its steps from: the mesh, both
    specs' placements, shard orders and strided-shard reading, and the tensor's rank (not
    its sizes, strides or dtype). None where a spec has no tensor meta or a part does not
    hash."""
    specs = (src_spec, dst_spec)
    if any(spec.tensor_meta is None for spec in specs):
        return None
    key = tuple(
        (spec.mesh, spec.placements, getattr(spec, "shard_order", None),
         _strided_as_order(spec), len(spec.tensor_meta.shape))
        for spec in specs
    ) + (args, tuple(sorted(kwargs.items())))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _price_key(spec: Any) -> tuple:
    """What DTensor's redistribution cost reads of a spec: its mesh, placements, shard
    order, shape and dtype (the planner and the byte count), and how it reads a
    ``_StridedShard``; not its strides, which DTensorSpec's equality also compares
    (a transposed view priced apart from its contiguous twin)."""
    meta = spec.tensor_meta
    if meta is None:
        return (spec, _strided_as_order(spec))
    return (spec.mesh, tuple(spec.placements), spec.shard_order, tuple(meta.shape),
            meta.dtype, _strided_as_order(spec))


# NOTE: [even layouts preferred]
# One program serves every rank (NOTE: [one program for every rank] in expand/retrace.py),
# so a value split into shards of different sizes on different ranks (a 7-wide dimension
# over 2 ranks) can only be traced per mesh coordinate, and is refused when the traces
# differ. DTensor prices its candidate strategies by communication alone and may pick
# such a split where an even one exists: under FSDP x TP, ``clip_grad_value_`` on a
# gradient Partial over dp reduce-scattered it over the 7 columns rather than the 8
# rows. While expanding, redistributing an evenly sharded value to an uneven layout
# costs UNEVEN_PENALTY more, so an even candidate wins whenever there is one; among
# uneven candidates the order (and so DTensor's choice) is unchanged.
UNEVEN_PENALTY = 1e12


def _uneven_penalty(current_spec: Any, target_spec: Any) -> float:
    meta = current_spec.tensor_meta
    if meta is None or not all(type(n) is int for n in meta.shape):
        return 0.0
    mesh = current_spec.mesh
    even_now = even_local_shape(meta.shape, mesh, current_spec.placements) is not None
    even_then = even_local_shape(meta.shape, mesh, target_spec.placements) is not None
    return UNEVEN_PENALTY if even_now and not even_then else 0.0


def _evenly_sharded(*specs: Any) -> bool:
    """Whether every tensor dimension the specs shard divides evenly by all the mesh
    dimensions (and strided split factors) that shard it, in concrete sizes."""
    shape = specs[0].tensor_meta.shape if specs[0].tensor_meta is not None else None
    if shape is None or not all(type(n) is int for n in shape):
        return False
    shards = set()
    for spec in specs:
        for mesh_dim, p in enumerate(spec.placements):
            if p.is_shard() or is_strided_shard(p):
                shards.add((p.dim, mesh_dim, getattr(p, "split_factor", 1)))
    factor = [1] * len(shape)
    for dim, mesh_dim, split in shards:
        factor[dim] *= specs[0].mesh.size(mesh_dim) * split
    return all(n % f == 0 for n, f in zip(shape, factor, strict=True))


def even_local_shape(shape: Any, mesh: Any, placements: Any) -> tuple[int, ...] | None:
    """The local shape of a ``shape`` DTensor on ``mesh`` when every shard of it has the
    same size on every rank (None otherwise, or for a symbolic or unknown case); also
    NOTE: [local shape check] in expand/retrace.py."""
    sizes = local_sizes_where_even(shape, mesh, placements)
    if sizes is None or any(n is None for n in sizes):
        return None
    return cast(tuple[int, ...], sizes)


def local_sizes_where_even(shape: Any, mesh: Any, placements: Any) -> tuple[int | None, ...] | None:
    """Per dimension, the local size of a ``shape`` DTensor on ``mesh`` where it is the
    same on every rank: None for a dimension some mesh dimension shards unevenly (its
    local size depends on the rank); None for all of it for a symbolic shape or a
    placement it does not know."""
    if not all(type(n) is int for n in shape):
        return None
    local: list[int | None] = list(shape)
    for mesh_dim, p in enumerate(placements):
        if p.is_replicate() or p.is_partial():
            continue
        if not (p.is_shard() or is_strided_shard(p)):
            return None
        size, n = local[p.dim], mesh.size(mesh_dim)
        local[p.dim] = None if size is None or size % (n * getattr(p, "split_factor", 1)) else size // n
    return tuple(local)


def _even_logical_shape(mesh: Any, src_state: Any, mesh_dim: int, shape: Any) -> list[int] | None:
    """``DTensorRedistributePlanner.get_logical_shape`` for evenly sharded dimensions:
    the global size divided by every other mesh dimension sharding it (None where a
    division is not exact)."""
    logical = list(shape)
    for entry in src_state.tensor_dim_to_mesh_dim:
        for mdim in entry.mesh_dims:
            if mdim != mesh_dim:
                n = mesh.size(mdim)
                if logical[entry.tensor_dim] % n:
                    return None
                logical[entry.tensor_dim] //= n
    return logical


def _strided_as_order(spec: Any) -> Any:
    # not part of DTensorSpec's hash or equality, but it changes how the planner reads
    # a _StridedShard (torch 2.13; absent on older releases)
    return getattr(spec, "use_strided_shard_as_shard_order", None)


@contextlib.contextmanager
def count_redistribution_planning() -> Iterator[dict[str, int]]:
    """Count, while the block runs, DTensor's redistribution plans (``plans``: priced or
    traced) and the run-time mesh coordinates traced into a graph (``coordinates``).
    For tests that bound the work of an expansion (NOTE: [compile work bounds])."""
    import torch.distributed.tensor._redistribute as redistribute_module
    from torch.distributed.device_mesh import DeviceMesh

    counts = {"plans": 0, "coordinates": 0}
    plan = redistribute_module._gen_transform_infos_non_cached
    coordinate = getattr(DeviceMesh, "_sym_get_coordinate", None)

    def counted_plan(*args, **kwargs):
        counts["plans"] += 1
        return plan(*args, **kwargs)

    def counted_coordinate(mesh, index):
        value = coordinate(mesh, index)
        counts["coordinates"] += not isinstance(value, int)  # traced, not a plain int
        return value

    with contextlib.ExitStack() as stack:
        stack.enter_context(
            mock.patch.object(redistribute_module, "_gen_transform_infos_non_cached", counted_plan)
        )
        if coordinate is not None:  # absent from some releases
            stack.enter_context(
                mock.patch.object(DeviceMesh, "_sym_get_coordinate", counted_coordinate)
            )
        yield counts


class PropagationBudgetExceeded(Exception):
    """DTensor's decomposition-based sharding propagation for ``op`` ran out of time.

    Not a RuntimeError / NotImplementedError on purpose: DTensor's search loop skips
    those and goes on trying placements."""

    def __init__(self, op: Any, seconds: float, attempts: int) -> None:
        super().__init__(
            f"sharding propagation of {op} through its decomposition did not finish "
            f"within {seconds:g} s ({attempts} placement combinations tried)"
        )
        self.op, self.seconds, self.attempts = op, seconds, attempts


@contextlib.contextmanager
def bounded_decomposition_propagation(seconds: float) -> Iterator[None]:
    """Bound DTensor's decomposition-based sharding propagation to ``seconds`` per op.

    torch 2.13 gap: for an op without a sharding rule, DTensor traces the op's
    decomposition once per combination of candidate input placements, and every op of
    that decomposition without a rule does the same, nested; for attention with a 4-D
    mask this ran for more than ten minutes. Here the outermost propagation starts a
    clock; every attempt (nested ones included) checks it, and when it runs out the
    outermost call raises ``PropagationBudgetExceeded`` (DTensor then reports the op as
    having no sharding strategy, with this as the cause).
    """
    from torch.distributed.tensor._decompositions import DecompShardingStrategy

    original_propagate = DecompShardingStrategy.propagate_strategy
    original_attempt = DecompShardingStrategy._propagate_through_decomp
    state: dict[str, Any] = {"deadline": None, "op": None, "attempts": 0, "exceeded": False}

    def propagate_strategy(*args, **kwargs):
        outermost = state["deadline"] is None
        if outermost:
            op = _op_schema_in(args, kwargs).op
            state.update(deadline=time.monotonic() + seconds, op=op, attempts=0, exceeded=False)
        try:
            result = original_propagate(*args, **kwargs)
            if outermost and state["exceeded"]:
                raise PropagationBudgetExceeded(state["op"], seconds, state["attempts"])
            return result
        finally:
            if outermost:
                state["deadline"] = None

    def attempt(*args, **kwargs):
        state["attempts"] += 1
        if state["exceeded"] or time.monotonic() > state["deadline"]:
            state["exceeded"] = True
            raise PropagationBudgetExceeded(state["op"], seconds, state["attempts"])
        return original_attempt(*args, **kwargs)

    with _patch_method_like(DecompShardingStrategy, "propagate_strategy", propagate_strategy), \
            _patch_method_like(DecompShardingStrategy, "_propagate_through_decomp", attempt):
        yield


def _op_schema_in(args: tuple, kwargs: dict) -> Any:
    from torch.distributed.tensor._op_schema import OpSchema

    return next(a for a in (*args, *kwargs.values()) if isinstance(a, OpSchema))


def _patch_method_like(cls: type, name: str, replacement: Callable[..., Any]) -> Any:
    """``mock.patch.object`` keeping the attribute's kind: 2.11's DecompShardingStrategy
    has static methods taking the sharding propagator last; 2.12 on has instance methods
    (2.14 adds an ``output_tensor_meta`` argument). The replacements take ``*args``."""
    import inspect

    static = isinstance(inspect.getattr_static(cls, name), staticmethod)
    return mock.patch.object(cls, name, staticmethod(replacement) if static else replacement)


def budget_exceeded_in(exc: BaseException) -> PropagationBudgetExceeded | None:
    """The ``PropagationBudgetExceeded`` among the causes of ``exc``, if any."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, PropagationBudgetExceeded):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


@contextlib.contextmanager
def compile_on_one_rank() -> Iterator[None]:
    """Trace mesh coordinates as run-time values (torch.distributed.config).

    torch 2.13 gap, closed here: ``_StridedShard._local_shard_size`` (reached whenever a
    view splits a sharded dimension, e.g. attention heads) indexes the list of shards
    with the rank, which is symbolic here and fails as a data-dependent guard. When every
    shard has the same size the answer does not depend on the rank, so it is returned
    directly; uneven strided shards still fail (and the caller falls back).
    """
    from torch.distributed.tensor.placement_types import _StridedShard

    install_dtensor_gap_fills()
    original = _StridedShard._local_shard_size
    original_select = _StridedShard._replicate_to_strided_shard
    original_size_and_offset = _StridedShard.local_shard_size_and_offset

    def local_shard_size_and_offset(self, curr_local_size, num_chunks, rank, offset_mode=0):
        # Even strided shards: rank r holds piece r of each of the split_factor blocks.
        # For a plain-int rank too: torch's answer splits a traced arange only to read
        # its sizes and values (dead nodes, an eighth of the fsdp_tp demo's expansion).
        pieces = self.split_factor * num_chunks
        if isinstance(curr_local_size, int) and curr_local_size % pieces == 0:
            piece = curr_local_size // pieces
            block = curr_local_size // self.split_factor
            if int(offset_mode) == 2:  # NONE
                return curr_local_size // num_chunks, None
            if int(offset_mode) == 0:  # FIRST
                return curr_local_size // num_chunks, rank * piece
            return curr_local_size // num_chunks, [
                i * block + rank * piece + j for i in range(self.split_factor) for j in range(piece)
            ]
        return original_size_and_offset(self, curr_local_size, num_chunks, rank, offset_mode)

    def local_shard_size(sharded_indices, rank):
        sizes = {len(s) for s in sharded_indices}
        if not isinstance(rank, int) and len(sizes) == 1:
            return sizes.pop()
        return original(sharded_indices, rank)

    def replicate_to_strided_shard(self, local_tensor, mesh, mesh_dim, shard_index):
        # Same gap in Replicate -> _StridedShard: with even pieces, rank r's shard is
        # piece r of every one of the split_factor blocks, a select on a reshaped view.
        n = mesh.size(mesh_dim)
        size = local_tensor.shape[self.dim]
        if not isinstance(shard_index, int) and size % (self.split_factor * n) == 0:
            blocks = local_tensor.unflatten(self.dim, (self.split_factor, n, -1))
            return blocks.select(self.dim + 1, shard_index).flatten(self.dim, self.dim + 1).clone()
        return original_select(self, local_tensor, mesh, mesh_dim, shard_index)

    with compile_on_one_rank_config().patch(compile_on_one_rank=True), mock.patch.object(
        _StridedShard, "_local_shard_size", staticmethod(local_shard_size)
    ), _even_replicate_to_shard(), _even_local_shapes(), mock.patch.object(
        _StridedShard, "_replicate_to_strided_shard", replicate_to_strided_shard
    ), mock.patch.object(
        _StridedShard, "local_shard_size_and_offset", local_shard_size_and_offset
    ), _costs_without_rank_dependent_candidates():
        yield


@contextlib.contextmanager
def _even_replicate_to_shard() -> Iterator[None]:
    """Replicate -> Shard at the run-time coordinate, traced without DTensor's checks.

    NOTE: [even shard selections]
    A Replicate -> Shard step keeps this rank's slice: DTensor's
    ``Shard._select_split_tensor`` traces ``narrow(x, dim, split * i, sym_ite(i == n - 1,
    last, split))`` with ``i`` the symbolic coordinate, and both ``narrow``'s checks and
    the fake ``slice`` prove ``0 <= split * i <= size`` with sympy on a fresh symbol each
    time: a third of the fsdp_tp demo's expansion. When the dimension divides evenly,
    ``last == split`` and the same live nodes are ``mul = split * i``, ``add = mul +
    split``, ``slice(x, dim, mul, add)``, ``clone``: traced here directly, with the fake
    slice's bounds read from the coordinate's value range (``fast_coordinate_slice``).
    The checks only made graph nodes that were dead; the program is the same (node
    names aside: fewer dead nodes were numbered). The fake-tensor cache is off for the
    two ops: their inputs hold a fresh symbol each time, so an entry never hits again,
    and building one (which also re-synthesizes the output to check it) cost as much
    as the ops.
    """
    from torch._subclasses import fake_tensor
    from torch.distributed.tensor.placement_types import Shard

    no_cache = getattr(fake_tensor, "disable_fake_tensor_cache", None)

    original = Shard._replicate_to_shard

    def replicate_to_shard(self, local_tensor, mesh, mesh_dim, shard_index):
        n = mesh.size(mesh_dim)
        size = local_tensor.shape[self.dim] if 0 <= self.dim < local_tensor.ndim else None
        if (type(self) is not Shard or isinstance(shard_index, int)
                or not isinstance(shard_index, torch.SymInt) or type(size) is not int or size % n):
            return original(self, local_tensor, mesh, mesh_dim, shard_index)
        split = size // n
        start = split * shard_index
        end = start + split
        fake_mode = torch._guards.detect_fake_mode(local_tensor)
        with fast_coordinate_slice(), (
            no_cache(fake_mode) if fake_mode is not None and no_cache else contextlib.nullcontext()
        ):
            return torch.ops.aten.slice.Tensor(local_tensor, self.dim, start, end).clone()

    with mock.patch.object(Shard, "_replicate_to_shard", replicate_to_shard):
        yield


@contextlib.contextmanager
def _even_local_shapes() -> Iterator[None]:
    """Local shapes of evenly sharded tensors without tracing the run-time coordinate.

    Sharding propagation rewrites the shape argument of a view or factory op to the local
    shape (``compute_local_shape_and_global_offset(..., skip_offset=True)``), which
    traces this rank's mesh coordinate for every sharded mesh dimension although an
    even split gives every rank ``size // n`` (the coordinate nodes were dead). Where
    every sharding is a plain ``Shard`` whose dimension divides evenly, that quotient
    is returned (the rank-independent answer DTensor computes); anything else, or a
    call that wants the offsets, is DTensor's own.
    """
    import torch.distributed.tensor._sharding_prop as sharding_prop
    from torch.distributed.tensor.placement_types import Shard

    original = getattr(sharding_prop, "compute_local_shape_and_global_offset", None)
    if original is None:  # absent from some releases: nothing to skip
        yield
        return

    def local_shape_and_offset(global_shape, mesh, placements, skip_offset=False):
        shape = list(global_shape)
        if skip_offset and all(type(n) is int for n in shape):
            for mesh_dim, p in enumerate(placements):
                if type(p) is Shard and 0 <= p.dim < len(shape) and shape[p.dim] % mesh.size(mesh_dim) == 0:
                    shape[p.dim] //= mesh.size(mesh_dim)
                elif p.is_shard() or is_strided_shard(p) or not (p.is_replicate() or p.is_partial()):
                    break
            else:
                if mesh._is_current_rank_part_of_mesh():
                    return tuple(shape), ()
        return original(global_shape, mesh, placements, skip_offset=skip_offset)

    with mock.patch.object(sharding_prop, "compute_local_shape_and_global_offset", local_shape_and_offset):
        yield


@contextlib.contextmanager
def fast_coordinate_slice() -> Iterator[None]:
    """The fake ``aten.slice.Tensor`` kernel, with its index checks decided from value
    ranges where they are provable (NOTE: [even shard selections]).

    torch's kernel asks ``guard_or_false(0 <= start <= size)`` (and the same for
    ``end``, then ``end >= start``) through sympy relations on every call. When the
    bounds of ``start`` and ``end`` (their symbols' value ranges) lie in ``[0, size]``
    and ``end - start`` is a non-negative integer, each of those questions is statically
    true (torch's static evaluation reads the same ranges), so its first branches are
    taken without asking; anything else runs torch's kernel unchanged.
    """
    from torch._subclasses import fake_impls

    table = getattr(fake_impls, "op_implementations_dict", {})
    op = torch.ops.aten.slice.Tensor
    original = table.get(op)
    if original is None:  # another release's layout: torch's kernel, unchanged
        yield
        return

    def slice_forward(fake_mode, func, x, dim=0, start=None, end=None, step=1):
        fast = _provable_slice(fake_mode, x, dim, start, end, step)
        if fast is None:
            return original(fake_mode, func, x, dim, start, end, step)
        return fast

    table[op] = slice_forward
    try:
        yield
    finally:
        table[op] = original


def _provable_slice(fake_mode: Any, x: Any, dim: int, start: Any, end: Any, step: Any) -> Any:
    """``x[start:end]`` along ``dim`` as torch's fake kernel makes it, or None when its
    index checks are not provable from value ranges (see ``fast_coordinate_slice``)."""
    shape_env = fake_mode.shape_env
    if shape_env is None or step != 1 or x.ndim == 0 or not 0 <= dim < x.ndim:
        return None
    size = x.shape[dim]
    if type(size) is not int or not isinstance(start, torch.SymInt) or not isinstance(end, torch.SymInt):
        return None
    width = end.node.expr - start.node.expr
    if not width.is_Integer or int(width) < 0:
        return None
    for bound in (start, end):
        span = shape_env.bound_sympy(bound.node.expr)
        if not (span.lower.is_finite and span.upper.is_finite and 0 <= span.lower and span.upper <= size):
            return None
    sizes, strides = list(x.size()), list(x.stride())
    sizes[dim] = (end - start + step - 1) // step
    storage_offset = x.storage_offset() + start * strides[dim]
    strides[dim] = strides[dim] * step
    return x.as_strided(sizes, strides, storage_offset)


@contextlib.contextmanager
def _costs_without_rank_dependent_candidates() -> Iterator[None]:
    """Redistribution costs that cannot be computed for a symbolic rank are infinite.

    NOTE: [uncomputable redistribution costs]
    torch 2.13 gap, closed here: on a 2-D mesh, an input held as ``_StridedShard`` (a
    batch sharded on dp, flattened behind the sequence: ``nn.MultiheadAttention``'s
    sequence-first ``(L, B, E) -> (L*B, E)``) makes DTensor's redistribution planner
    price every candidate placement of an op through shard sizes of intermediate states,
    some of them uneven strided shards (``_S(1, 6)`` of a 16-wide dim) whose size depends
    on the rank. With the rank symbolic that raises a data-dependent error and the whole
    op fails, although the candidate is one DTensor would never pick. Such a cost is
    made infinite (the candidate is not chosen). It only steers the choice: the chosen
    strategy's redistribution runs on its own, so a candidate that really needs such a
    size still fails there, with the same error, never with a guessed size.
    """
    from torch.distributed.tensor._ops import utils as op_utils

    original = op_utils.redistribute_cost
    errors = data_dependent_error_types()

    def redistribute_cost(current_spec, target_spec):
        try:
            return original(current_spec, target_spec)
        except errors:
            return float("inf")

    with mock.patch.object(op_utils, "redistribute_cost", redistribute_cost):
        yield


def compile_on_one_rank_config() -> Any:
    """The config module that owns ``compile_on_one_rank``.

    torch 2.14 moved the flag to ``torch.compiler.config`` and kept
    ``torch.distributed.config.compile_on_one_rank`` as an alias that warns
    (FutureWarning) on every read; 2.11 to 2.13 have it only in ``torch.distributed.config``.
    Feature-tested: the new home when it has the flag.
    """
    import torch.compiler.config as compiler_config
    import torch.distributed.config as distributed_config

    if hasattr(compiler_config, "compile_on_one_rank"):
        return compiler_config
    return distributed_config


def _has_traced_group_op() -> bool:
    import torch.distributed.tensor  # noqa: F401  (registers the _dtensor ops)

    return hasattr(torch.ops._dtensor, "mesh_get_process_group")


def mesh_get_process_group(mesh: Any, dim: int) -> str:
    """torch 2.11 stand-in for ``torch.ops._dtensor.mesh_get_process_group``: the name of
    ``mesh``'s process group along ``dim``, looked up when the program runs (2.11's
    functional collectives take group names)."""
    return mesh.get_group(dim).group_name


def pack_padded_sequence_op() -> Callable[..., Any]:
    """The builtin ``pack_padded_sequence`` calls (``torch._VF._pack_padded_sequence``);
    a TorchFunctionMode sees it as this object (NOTE: [packed sequences at capture])."""
    return torch._pack_padded_sequence


def pad_packed_sequence_op() -> Callable[..., Any]:
    """The builtin ``pad_packed_sequence`` calls (``torch._VF._pad_packed_sequence``)."""
    return torch._pad_packed_sequence


def mesh_group_op() -> Callable[..., Any]:
    """What a traced program calls to look up a mesh dimension's group at run time
    (NOTE: [collective groups] in passes/collective_graph.py)."""
    if _has_traced_group_op():
        return torch.ops._dtensor.mesh_get_process_group.default
    return mesh_get_process_group


def lift_group_names(gm: torch.fx.GraphModule, mesh: Any) -> None:
    """Make ``gm``'s collectives look their groups up at run time, as torch 2.13 traces them.

    torch 2.11 gap: under ``compile_on_one_rank`` a functional collective's group is the
    group's name, a string baked in at trace time. A program used after its process group
    was re-created (another ``simulate()``, ``explain`` after the run) would name a group
    that no longer exists, or another one. Feature-tested: where torch traces
    ``_dtensor.mesh_get_process_group`` this does nothing; otherwise every group name
    that is one of ``mesh``'s (or its root mesh's) dimensions becomes ``get_attr`` of the
    mesh + ``mesh_get_process_group(mesh, dim)``, as 2.13 traces it.
    """
    if _has_traced_group_op():
        return
    dims: dict[str, tuple[Any, int]] = {}
    for candidate in (mesh, root_mesh(mesh)):
        for dim in range(candidate.ndim):
            dims.setdefault(candidate.get_group(dim).group_name, (candidate, dim))
    attrs: dict[int, str] = {}
    graph = gm.graph
    for node in list(graph.nodes):
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None or not schema.name.startswith("_c10d_functional::"):
            continue
        for i, (arg, spec) in enumerate(zip(node.args, schema.arguments)):
            if spec.name != "group_name" or not isinstance(arg, str) or arg not in dims:
                continue
            owner, dim = dims[arg]
            attr = attrs.get(id(owner))
            if attr is None:
                attr = attrs[id(owner)] = f"_spmd_mesh{len(attrs)}"
                setattr(gm, attr, owner)
            with graph.inserting_before(node), warnings.catch_warnings():
                # fx warns on a get_attr of a non-module attribute; the mesh is one
                warnings.simplefilter("ignore", UserWarning)
                mesh_node = graph.get_attr(attr)
                group = graph.call_function(mesh_get_process_group, (mesh_node, dim))
            group.meta["val"] = arg  # a name, no tensor: passes may move it (is_free)
            node.update_arg(i, group)
    gm.recompile()


def mesh_coordinates(mesh: Any) -> list[tuple[int, ...]]:
    """Every coordinate of ``mesh``, in rank order."""
    import itertools

    return list(itertools.product(*(range(n) for n in mesh.shape)))


@contextlib.contextmanager
def fixed_mesh_coordinate(mesh: Any, coordinate: tuple[int, ...]) -> Iterator[None]:
    """Trace as the rank at ``coordinate`` of ``mesh`` (its 1-D sub-meshes included).

    NOTE: [sharding decisions made at one coordinate]
    DTensor's sharding decisions are cached by the op's global schema (its native C++
    cache, NOTE: [Python numbers in DTensor's native sharding cache], and the Python
    propagator's), and a decision holds the shape arguments it localized: a view of an
    uneven sequence shard traced here at coordinate (0,) got rank 0's 4 of 7 positions.
    The next compile's trace with a symbolic coordinate found that decision instead of
    failing over to the per-coordinate traces, and its program held rank 0's shape on
    every rank: after a step refused at T=7, tp 2 (``SequenceParallel()`` alone on a
    norm), the same model with ``SequenceParallel()`` on a Linear compiled and failed at
    run time ("shape '[16, 16]' is invalid for input of size 192"), where alone it is
    refused; a decision holding a rank's offset would have been wrong on the other
    ranks without an error. Both caches are emptied on the way in (a decision made at
    another coordinate) and out."""
    install_dtensor_gap_fills()
    saved = mesh._coordinate_on_dim
    _forget_sharding_propagation()
    mesh._coordinate_on_dim = list(coordinate)
    try:
        yield
    finally:
        mesh._coordinate_on_dim = saved
        _forget_sharding_propagation()


def _forget_sharding_propagation() -> None:
    """Empty DTensor's caches of sharding decisions (NOTE: [sharding decisions made at
    one coordinate])."""
    cached = getattr(DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding, "cache_clear", None)
    if cached is not None:
        cached()
    native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if native is not None:
        native()


def all_gather_along(local: torch.Tensor, tensor_dim: int, mesh: Any, mesh_dim: int) -> torch.Tensor:
    """Functional all-gather of ``local`` along ``tensor_dim`` over one mesh dimension."""
    from torch.distributed import _functional_collectives as funcol

    # torch 2.13 renamed all_gather_tensor to all_gather_single (the old name warns with
    # a FutureWarning on every trace); 2.11 has only the old name.
    gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    return funcol.wait_tensor(gather(local, tensor_dim, (mesh, mesh_dim)))


def reduce_scatter_along(
    local: torch.Tensor, reduce_op: str, tensor_dim: int, mesh: Any, mesh_dim: int
) -> torch.Tensor:
    """Functional reduce-scatter of ``local`` along ``tensor_dim`` over one mesh dimension."""
    from torch.distributed import _functional_collectives as funcol

    # renamed like all_gather_single above (reduce_scatter_tensor warns on 2.13)
    scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
    return funcol.wait_tensor(scatter(local, reduce_op, tensor_dim, (mesh, mesh_dim)))


def all_reduce_along(local: torch.Tensor, reduce_op: str, mesh: Any, mesh_dim: int) -> torch.Tensor:
    """Functional all-reduce of ``local`` over one mesh dimension."""
    from torch.distributed import _functional_collectives as funcol

    return funcol.wait_tensor(funcol.all_reduce(local, reduce_op, (mesh, mesh_dim)))


def root_mesh(mesh: Any) -> Any:
    """The parent (root) mesh a sub-mesh was sliced from (itself for a root mesh)."""
    return mesh._get_root_mesh()


def is_strided_shard(placement: Any) -> TypeGuard[StridedShard]:
    # typed as the C base class: the split factors this package makes and meets are ints
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(placement, _StridedShard)


def is_shard_like(placement: Any) -> TypeGuard[Shard | StridedShard]:
    """A placement that splits dimension ``placement.dim``: ``Shard`` or ``_StridedShard``
    (which is no ``Shard`` on some releases)."""
    from torch.distributed.tensor import Shard

    return isinstance(placement, Shard) or is_strided_shard(placement)


def is_mask_partial(placement: Any) -> bool:
    """DTensor's ``_MaskPartial``: an embedding's output over a vocabulary-sharded weight,
    pending a sum that zeroes the rows other ranks own by a mask shaped like the indices."""
    from torch.distributed.tensor.placement_types import _MaskPartial

    return isinstance(placement, _MaskPartial)


# NOTE: [a mask for every lookup]
# An embedding over a vocabulary-sharded table splits its replicated ids into a
# ``_MaskPartial`` (each rank's ids shifted to its rows, a mask of the ids it does not
# hold), and its output is the same kind of partial, reduced by zeroing the masked rows
# and summing. The mask lives in the placement object, and DTensor's sharding strategy
# for ``aten.embedding`` is cached: every lookup with the same shapes and placements gets
# the one ``_MaskPartial`` of the first, for its ids and its output alike. A second lookup
# of the same ids (a model called twice, a teacher beside its student: the memoized
# split of the ids is reused, no new mask) found the mask released by the first output's
# reduction (an empty ``AssertionError``); a second table of the same shape over other
# ids split them onto the shared object too ("Mixing fake modes"), and had one lookup's
# mask been applied to another's rows the sums would have been wrong. Each lookup now
# splits its ids onto a ``_MaskPartial`` of its own and runs on the rank's rows (what
# DTensor's rowwise rule runs), its output carrying that placement, mask and all (a
# local rule, ``expand/local_rules.py``). (Given ids already split, DTensor's propagation
# does not keep them: it picked the batch rule, reduce-scattering the masked ids, so the
# lookup is not handed back to it.) The redistribution memo keys such a split by its
# mask object, so a second lookup of the same ids splits them again, filling its mask.
def lookup_with_own_masks(args: tuple, kwargs: dict) -> DTensor | None:
    """``aten.embedding(weight, ids, ...)`` where the table is vocabulary-sharded on some
    mesh dim and the ids replicated there: the ids split onto a ``_MaskPartial`` of their
    own and the lookup run on the rank's rows, its output carrying that placement (see the
    NOTE). On the other mesh dims a replicated table keeps the ids' layout. None for any
    other layout (DTensor's rule runs)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor.placement_types import _MaskPartial

    weight, ids = args[0], args[1]
    if kwargs or not isinstance(weight, DTensor) or not isinstance(ids, DTensor) or weight.dim() != 2:
        return None
    split: list[Any] = []
    for pw, pi in zip(weight.placements, ids.placements, strict=True):
        if type(pw) is Shard and pw.dim == 0 and isinstance(pi, Replicate):
            split.append(_MaskPartial(offset_shape=torch.Size(weight.shape), offset_dim=0))
        elif isinstance(pw, Replicate) and (isinstance(pi, Replicate) or type(pi) is Shard):
            split.append(pi)
        else:
            return None
    if not any(is_mask_partial(p) for p in split):
        return None
    # DTensor.redistribute refuses a partial target ("for internal use"): split by hand
    import torch.distributed.tensor._redistribute as redistribute_module

    target = DTensorSpec(ids.device_mesh, tuple(split), tensor_meta=ids._spec.tensor_meta)
    local_ids = redistribute_module.redistribute_local_tensor(ids._local_tensor, ids._spec, target)
    local = torch.ops.aten.embedding.default(weight._local_tensor, local_ids, *args[2:])
    from .ir.signature import contiguous_stride

    shape = torch.Size((*ids.shape, weight.shape[1]))
    return DTensor.from_local(
        local, ids.device_mesh, tuple(split), run_check=False, shape=shape,
        stride=contiguous_stride(shape),
    )


def placement_types() -> dict[str, type]:
    """DTensor's placement classes by name, private ones included (the compile cache
    rebuilds placements from these names)."""
    from torch.distributed.tensor._ops._math_ops import _NormPartial
    from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _StridedShard

    # _NormPartial: a vector norm of a shard (clip_grad_norm_ under fully_shard)
    return {t.__name__: t for t in (Shard, Replicate, Partial, _StridedShard, _NormPartial)}


def is_fake(t: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def traced_within_transforms(t: torch.Tensor) -> bool:
    """Whether ``t`` is, or wraps, a fake tensor: torch.func's transforms (``vmap``,
    ``grad``, ``jacrev``: ``hessian``) hand their functions wrapper tensors around the
    trace's fake ones."""
    while torch._C._functorch.is_functorch_wrapped_tensor(t):
        t = torch._C._functorch.get_unwrapped(t)
    return is_fake(t)


def out_of_place_twin(op: Any) -> Any:
    """The out-of-place twin of in-place op ``op`` (NOTE: [functional by rewriting] in
    ``capture/functional_rewrite.py``): ``add.Tensor`` for ``add_.Tensor``, the same
    overload of the name without ``_``, with the same argument names, writing nothing
    and returning a fresh tensor; None when there is none."""
    name = op.overloadpacket.__name__
    if not name.endswith("_") or name.endswith("__"):
        return None
    twin = overload_named(op, name[:-1])
    if twin is None:
        return None
    theirs = twin._schema
    if any(a.alias_info is not None for a in theirs.arguments) or len(theirs.returns) != 1:
        return None
    if theirs.returns[0].alias_info is not None:
        return None
    return twin


def overload_named(op: Any, name: str) -> Any:
    """The overload of op ``name`` in ``op``'s namespace with ``op``'s overload name and
    argument names (``aten.mul_.Tensor`` for ``aten.mul.Tensor`` and ``"mul_"``), or None:
    an op's in-place variant or out-of-place twin."""
    packet = getattr(getattr(torch.ops, op.namespace), name, None)
    other = getattr(packet, op._overloadname, None) if packet is not None else None
    if not isinstance(other, torch._ops.OpOverload):
        return None
    if [a.name for a in other._schema.arguments] != [a.name for a in op._schema.arguments]:
        return None
    return other


def is_op_overload(target: Any) -> bool:
    return isinstance(target, torch._ops.OpOverload)


def use_plain_codegen(gm: torch.fx.GraphModule) -> None:
    """Call ``gm`` with flat positional inputs, as many as its placeholders (a pytree
    codegen keeps the count it was traced with), and recompile it."""
    gm.graph._codegen = torch.fx.graph.CodeGen()
    gm.recompile()


def has_plain_codegen(gm: torch.fx.GraphModule) -> bool:
    """Whether ``gm`` is called with flat positional inputs and returns as its graph
    says (no pytree codegen that a rebuilt graph would lose)."""
    return type(gm.graph._codegen) is torch.fx.graph.CodeGen


@contextlib.contextmanager
def inductor_cache_dir(directory: str | None) -> Iterator[None]:
    """Inductor's on-disk caches (FX graph cache, kernels) under ``directory`` while the
    block runs; nothing changes for None. Inductor reads ``TORCHINDUCTOR_CACHE_DIR`` when
    it looks a cache up; torch's own ``temporary_cache_dir`` sets and restores it."""
    if directory is None:
        yield
        return
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    _INDUCTOR_DIRS.add(os.path.abspath(directory))
    with temporary_cache_dir(directory):
        yield


_INDUCTOR_DIRS: set[str] = set()  # cache directories this process gave Inductor or saw it use


def inductor_cache_roots() -> tuple[str, ...]:
    """The directories Inductor writes its generated kernels to and loads them from as
    modules in this process: its default cache directory, ``TORCHINDUCTOR_CACHE_DIR`` now
    and every value it had when asked before (a kernel loaded from one stays loaded after
    the variable changes), and those ``inductor_cache_dir`` gave it. Read without
    creating them."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current:
        _INDUCTOR_DIRS.add(os.path.abspath(current))
    roots = {os.path.abspath(default_cache_dir()), *_INDUCTOR_DIRS}
    return tuple({r.rstrip(os.sep) + os.sep for root in roots for r in (root, os.path.realpath(root))})


def strided_shard(dim: int, split_factor: int) -> Any:
    """DTensor's placement for a right-to-left nested shard (NOTE: [parent-mesh sharding])."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=split_factor)


def chunk_at_coordinate(local: torch.Tensor, mesh: Any, mesh_dim: int, tensor_dim: int) -> torch.Tensor:
    """This rank's ``torch.chunk`` piece of ``local`` along ``tensor_dim`` for ``mesh_dim``.

    Works on real ranks (the rank's own coordinate) and on simulated ranks (a per-rank
    value holds each rank's piece).
    """
    n = mesh.size(mesh_dim)

    def piece(t: torch.Tensor, coordinate: int) -> torch.Tensor:
        chunks = list(torch.chunk(t, n, dim=tensor_dim))
        if coordinate < len(chunks):
            return chunks[coordinate].contiguous()
        shape = list(t.shape)
        shape[tensor_dim] = 0
        return t.new_empty(shape)

    from torch.distributed._local_tensor import enabled_local_tensor_mode

    mode = enabled_local_tensor_mode()
    if mode is not None and not isinstance(local, local_tensor_type()):
        with mode.disable():
            local = make_local_tensor({rank: local for rank in mode.ranks})
    if isinstance(local, local_tensor_type()):
        coordinates = {
            rank: cast(list[int], mesh_coordinate(mesh, rank)) for rank in per_rank_tensors(local)
        }
        ctx = mode.disable() if mode is not None else contextlib.nullcontext()
        with ctx:
            return make_local_tensor({
                rank: piece(t, coordinates[rank][mesh_dim])
                for rank, t in per_rank_tensors(local).items()
            })
    return piece(local, mesh.get_coordinate()[mesh_dim])


# ---------------------------------------------------------------------------- simulation


def local_tensor_mode(world_size: int) -> Any:
    from torch.distributed._local_tensor import LocalTensorMode

    if _coordinate_op_per_rank() and _local_collectives_take_groups():
        return LocalTensorMode(world_size)
    return _coordinate_aware_mode_class()(world_size)


def _local_collectives_take_groups() -> bool:
    """Whether LocalTensorMode's functional collectives accept a ``ProcessGroup`` where
    the schema says ``group_name`` (what ``_dtensor.mesh_get_process_group`` gives traced
    programs). torch 2.12 gap: they resolve it as a name and raise a TypeError."""
    import torch.distributed._local_tensor._c10d as local_c10d

    return hasattr(local_c10d, "_resolve_pg_or_name")


def _group_names(func: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``func``'s ``group_name`` arguments given as process groups, as their names."""
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.name.startswith("_c10d_functional::"):
        return args, kwargs

    def name(value: Any) -> Any:
        if isinstance(value, torch.ScriptObject):
            value = dist.ProcessGroup.unbox(value)
        return value.group_name if isinstance(value, dist.ProcessGroup) else value

    positions = {a.name: i for i, a in enumerate(schema.arguments)}
    i = positions.get("group_name")
    if i is not None and i < len(args):
        args = (*args[:i], name(args[i]), *args[i + 1 :])
    if "group_name" in kwargs:
        kwargs = {**kwargs, "group_name": name(kwargs["group_name"])}
    return args, kwargs


_COORDINATE_OP_PER_RANK: bool | None = None


def _coordinate_op_per_rank() -> bool:
    """Whether LocalTensorMode answers ``device_mesh::_runtime_compute_coordinate_on_dim``
    (the run-time mesh coordinate of ``compile_on_one_rank`` programs) per simulated rank.

    torch 2.11 gap: it does not; the op runs once and every simulated rank gets rank 0's
    coordinate, so each rank keeps rank 0's slice of a rank-dependent redistribution (a
    SILENT wrong result in simulation; real ranks are right). Asked once, on 2 ranks.
    """
    global _COORDINATE_OP_PER_RANK
    if _COORDINATE_OP_PER_RANK is None:
        import torch.distributed._ops.device_mesh  # noqa: F401  (defines the op)
        from torch.distributed._local_tensor import LocalTensorMode

        mesh_tensor = torch.arange(2, dtype=torch.int).view(1, 2)
        with LocalTensorMode(2):
            got = torch.ops.device_mesh._runtime_compute_coordinate_on_dim.default(mesh_tensor, 0)
        _COORDINATE_OP_PER_RANK = not isinstance(got, int)
    return _COORDINATE_OP_PER_RANK


def _coordinate_aware_mode_class() -> type:
    """LocalTensorMode that answers the run-time coordinate op per rank (as 2.13 does)
    and gives its collectives group names where it cannot take groups (2.12)."""
    from torch.distributed._local_tensor import LocalTensorMode, _combine_int_rank_results
    from torch.distributed.device_mesh import DeviceMesh

    coordinate_op = torch.ops.device_mesh._runtime_compute_coordinate_on_dim.default
    take_groups = _local_collectives_take_groups()

    class CoordinateAwareLocalTensorMode(LocalTensorMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is not coordinate_op or self._disable:
                if not take_groups:
                    args, kwargs = _group_names(func, args, kwargs or {})
                return super().__torch_dispatch__(func, types, args, kwargs)
            bound = dict(zip(("full_mesh", "index"), args), **(kwargs or {}))
            full_mesh, index = bound["full_mesh"], bound["index"]
            per_rank = {}
            for r in self.ranks:
                mesh_tensor = DeviceMesh._get_mesh_tensor_from_full_mesh(full_mesh, current_rank=r)
                coords = DeviceMesh._compute_coordinates_from_mesh(mesh_tensor, r)
                if coords is None:
                    raise RuntimeError(f"simulated rank {r} is not in the mesh {mesh_tensor.tolist()}")
                per_rank[r] = coords[index]
            return _combine_int_rank_results(per_rank)

    return CoordinateAwareLocalTensorMode


def mesh_coordinate(mesh: DeviceMesh, rank: int) -> list[int] | None:
    """``rank``'s coordinate in ``mesh`` (None when it is not in it), read off the mesh's
    rank tensor: ``mesh.get_coordinate()`` gives SymInts under the simulation, which do
    not index a tensor, and knows only this process's rank."""
    found = (mesh.mesh == rank).nonzero()
    return found[0].tolist() if found.shape[0] == 1 else None


# the modules of torch's own tensor subclasses the runtime and the trace handle
_TENSOR_MACHINERY = (
    "torch._tensor", "torch.nn.parameter", "torch.distributed.", "torch._subclasses.",
    "torch._functorch.", "torch.fx.",
)


def tensor_overrides(cls: type) -> list[str]:
    """The torch hooks (``__torch_function__``, ``__torch_dispatch__``) a torch.Tensor
    subclass defines, from its classes outside torch's own machinery: [] for
    torch.Tensor, nn.Parameter, DTensor, LocalTensor, the trace's FakeTensor and
    FunctionalTensor, a subclass that defines neither (``class Tagged(torch.Tensor):
    pass``) or that sets torch's disabled implementations. torch's user-level subclasses
    (``torch.masked``'s MaskedTensor, ``torch.nested``'s jagged tensors) count as the
    user's (NOTE: [tensor subclasses that override torch])."""
    disabled = (torch._C._disabled_torch_function_impl, torch._C._disabled_torch_dispatch_impl)
    found: list[str] = []
    for klass in cls.__mro__:
        module = getattr(klass, "__module__", "") or ""
        if module.startswith(_TENSOR_MACHINERY) or klass is torch.Tensor:
            continue
        for hook in ("__torch_function__", "__torch_dispatch__"):
            impl = vars(klass).get(hook)
            impl = getattr(impl, "__func__", impl)  # a classmethod's or staticmethod's function
            if impl is not None and impl not in disabled and hook not in found:
                found.append(hook)
    return found


def local_tensor_type() -> type:
    from torch.distributed._local_tensor import LocalTensor

    return LocalTensor


def make_local_tensor(per_rank: dict[int, torch.Tensor]) -> torch.Tensor:
    from torch.distributed._local_tensor import LocalTensor

    return LocalTensor(per_rank)


def per_rank_tensors(t: torch.Tensor) -> dict[int, torch.Tensor]:
    """The per-rank values of a simulated tensor (a LocalTensor)."""
    return dict(t._local_tensors)  # type: ignore[attr-defined]


def init_fake_process_group(world_size: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)


def cpu_allocation_peak(fn: Callable[[], Any]) -> int:
    """Peak bytes the CPU allocator held during ``fn()`` above what it held when ``fn``
    began, read off the profiler's allocation events (``profile_memory``: every CPU
    allocation and free, each with the running total). A block allocated before and freed
    during ``fn`` is not subtracted (the profiler does not know its size; c10 warns once),
    so the figure is an upper bound when ``fn`` frees older memory before its peak."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    allocations = []
    pending = list(prof.profiler.kineto_results.experimental_event_tree())
    while pending:
        event = pending.pop()
        pending.extend(event.children)
        if event.tag == _EventType.Allocation:
            allocations.append(event)
    if not allocations:
        return 0
    allocations.sort(key=lambda e: e.start_time_ns)
    first = allocations[0].extra_fields
    base = first.total_allocated - first.alloc_size
    return max(e.extra_fields.total_allocated for e in allocations) - base


def is_fake_process_group() -> bool:
    return dist.is_initialized() and dist.get_backend() == "fake"


# Releases where donated state was checked to come out right (NOTE: [state donation]):
# parameters, buffers and optimizer state. 2.13: the tp step of
# tests/dist/test_inductor_backend.py within 2.5e-7. 2.11: that step ended 0.12 off after
# 3 steps when every state tensor was donated (``CALLED_OUT_READS_MAY_FOLLOW_INPUT_UPDATES``).
# Other releases: not checked, nothing donated.
DONATION_VERIFIED_RELEASES = ("2.11", "2.13")
# Releases whose Inductor may run a kernel writing a donated input before a kernel it
# calls out to (a library matmul) that reads the input's old value: on 2.11 its
# peak-memory reordering (``reorder_for_peak_memory``) ran the kernel writing the second
# Linear's weight update before the backward's matmul ``grad @ W`` (read off the
# generated code, 2026-11-27). There an input read by such a kernel is not donated
# (``inductor_calls_out``), and the reordering stays on: switching it off instead cost
# the GPT its peak memory (H200, gpt-4x256 ddp: 94 MiB against torch DDP's 75; 68 on an
# H100 with nothing donated and the reordering on).
CALLED_OUT_READS_MAY_FOLLOW_INPUT_UPDATES = ("2.11",)


# Releases whose DTensor fails on ``index_put`` with ``None`` in its index list (torch
# 2.11: "'list' object has no attribute 'children'", seen on the backward of
# ``index_select`` on dimension 1 of a batch-sharded tensor); 2.13 and 2.14 run it.
INDEX_PUT_WITH_NONE_GAP_RELEASES = ("2.11",)


# Releases whose DTensor ``scatter`` rule offers only all-replicate placements (torch
# 2.11: "TODO: see if we can support input sharding pattern"); 2.13 and 2.14 shard any
# dimension other than the scattered one. Capture writes a count per row's rows by
# ``scatter_add`` and ``where`` there (NOTE: [rows of one count]), else the batch would
# be gathered.
SCATTER_REPLICATES_ONLY_RELEASES = ("2.11",)


# Releases whose DTensor carries an embedding's ``_MaskPartial`` placement, mask and all,
# on to values computed from it (NOTE: [masked partials reduced before use] in
# expand/retrace.py); 2.13 and 2.14 redistribute it at its first reader.
MASKS_SHARED_BY_DERIVED_VALUES_RELEASES = ("2.11",)


def derived_values_share_masks() -> bool:
    return _release() in MASKS_SHARED_BY_DERIVED_VALUES_RELEASES


def dtensor_scatter_replicates_only() -> bool:
    return _release() in SCATTER_REPLICATES_ONLY_RELEASES


def _release() -> str:
    """This torch's release, "2.13" for 2.13.0+cpu."""
    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


def dtensor_index_put_with_none_gap() -> bool:
    """Whether capture should move ``index_put``'s indexed dimension first."""
    return _release() in INDEX_PUT_WITH_NONE_GAP_RELEASES


def inductor_updates_inputs_safely() -> bool:
    """Whether this torch's Inductor may be given state to update in place."""
    return _release() in DONATION_VERIFIED_RELEASES


def inductor_called_out_reads_may_follow_input_updates() -> bool:
    """Whether a donated input must not be read by a kernel Inductor calls out to
    (``CALLED_OUT_READS_MAY_FOLLOW_INPUT_UPDATES``, NOTE: [state donation])."""
    return _release() in CALLED_OUT_READS_MAY_FOLLOW_INPUT_UPDATES


# ATen ops Inductor lowers to a call of a library kernel (cuBLAS / oneDNN matmuls,
# cuDNN convolutions) in its default configuration, rather than to code it generates.
_CALLED_OUT_LOWERINGS = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "_int_mm", "_scaled_mm", "convolution",
    "convolution_backward", "_convolution",
})


def inductor_calls_out(target: object) -> bool:
    """Whether Inductor computes a node calling ``target`` in a kernel it calls out to (a
    library matmul or convolution, a collective, an ATen fallback) rather than in a kernel
    it generates. Unknown targets count as called out."""
    from torch._inductor.lowering import fallbacks, lowerings

    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten":
        return True
    if target not in lowerings:  # decomposed first; known only for pointwise ops
        return target not in _decomposed_ops() or not _pointwise(target)
    return target in fallbacks or target.overloadpacket.__name__ in _CALLED_OUT_LOWERINGS


def _pointwise(op: torch._ops.OpOverload) -> bool:
    """Tagged pointwise, or the foreach loop of a pointwise op (``_foreach_lerp``)."""
    if torch.Tag.pointwise in op.tags:
        return True
    name = op.overloadpacket.__name__
    if not name.startswith("_foreach_"):
        return False
    single = getattr(torch.ops.aten, name.removeprefix("_foreach_").rstrip("_"), None)
    return single is not None and all(
        torch.Tag.pointwise in getattr(single, o).tags for o in single.overloads()
    )


@functools.lru_cache(maxsize=1)
def _decomposed_ops() -> frozenset[object]:
    """The ops Inductor decomposes before lowering a program compiled with cast emulation
    (``inductor_compile``'s table)."""
    return frozenset(_emulation_decompositions(True) or _decomposition_tables()[1])


def _decomposition_tables() -> tuple[dict[Any, Callable[..., Any]], dict[Any, Callable[..., Any]]]:
    """Inductor's decomposition table without and with ``emulate_precision_casts``."""
    from torch._inductor import config as inductor_config
    from torch._inductor.decomposition import select_decomp_table

    with inductor_config.patch(emulate_precision_casts=False):
        plain = select_decomp_table()
    with inductor_config.patch(emulate_precision_casts=True):
        return plain, select_decomp_table()


def inductor_compile(
    gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor], cuda_graphs: bool = False,
    cache_dir: str | None = None, static_inputs: Sequence[int] = (),
) -> Callable[..., Any]:
    """Compile an ATen-level graph with Inductor (``torch._inductor.compile_fx``).

    The graph is called with flat positional inputs; ``example_inputs`` are real tensors
    of the first call. Loop reordering after fusion is switched off: on torch 2.11 it hit
    an internal assertion (``reorder_loops_by_dep_pair``) on the per-rank programs.
    Low-precision casts are emulated (rounded where the program casts), as eager does.
    With ``cuda_graphs``, ``static_inputs`` are the positions of inputs given at the same
    address on every call (NOTE: [CUDA graphs and the program's outputs]): the graphs read
    them where they are, and may update them in place, where they copy every other input
    into memory of their own first. Inductor learns which inputs are static from
    Dynamo's tracing context; a graph compiled here has none, so the positions are handed
    to its inner compile (the inputs of AOTAutograd's inference graph are the graph's
    inputs in order: nothing is lifted).
    """
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    use_plain_codegen(gm)  # flat inputs, no pytree wrapper
    patches: dict[str, Any] = {"triton.cudagraphs": cuda_graphs}
    if hasattr(inductor_config, "loop_ordering_after_fusion"):
        patches["loop_ordering_after_fusion"] = False
    if hasattr(inductor_config, "emulate_precision_casts"):
        # Round at every bf16 / fp16 cast as eager does: fused kernels otherwise keep the
        # fp32 intermediates, and a mixed-precision step computed in fp32 (measured: 3.5e-2
        # from eager FSDP2's bf16 run, the size of the bf16-vs-fp32 difference itself).
        patches["emulate_precision_casts"] = True
    if hasattr(inductor_config, "fallback_random"):
        # the program's random draws (NOTE: [random numbers]) by torch's own kernels from
        # the global generator, as the interpreter draws them: Inductor's own lowering
        # drew other numbers (dropout losses 12.6% apart between the backends, a probe)
        patches["fallback_random"] = True
    if cache_dir is not None:  # NOTE: [persistent compile cache]: kernels reused too
        patches["fx_graph_cache"] = True
    fixed = sorted(set(static_inputs)) if cuda_graphs else []

    def with_static(gm: torch.fx.GraphModule, inputs: Sequence[Any], *args: Any, **kwargs: Any) -> Any:
        kwargs["static_input_idxs"] = sorted({*kwargs.get("static_input_idxs", ()), *fixed})
        return compile_fx_inner(gm, inputs, *args, **kwargs)

    with inductor_cache_dir(cache_dir):
        return call_with_room(  # type: ignore[return-value]  # NOTE: [room on the Python stack]
            compile_fx, gm, example_inputs, config_patches=patches,
            inner_compile=with_static if fixed else compile_fx_inner,
            decompositions=_emulation_decompositions(patches.get("emulate_precision_casts", False)),
        )


def cudagraph_skips() -> int:
    """How many graphs Inductor has compiled with CUDA graphs asked for and then run
    without them (a CPU op, an input mutation it cannot replay; its reason goes to the
    ``cudagraphs`` log artifact, ``TORCH_LOGS=cudagraphs``)."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


def foreach_copy(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``dst[k].copy_(src[k])`` for every k, in as few kernels as the device allows
    (``torch._foreach_copy_``, what torch's optimizers use)."""
    torch._foreach_copy_(dst, src)


# NOTE: [unfused fallbacks under cast emulation]
# With ``emulate_precision_casts`` Inductor drops its decompositions of ``addcmul`` and the
# foreach ``addcmul`` / ``addcdiv`` so that its own FMA-preserving lowerings compute them.
# torch 2.11 has no lowering for ``_foreach_addcdiv.Scalar`` (2.13 has): the op then runs
# as the unfused ATen kernel, and every input of it (AdamW's new ``exp_avg`` and its
# denominator) and its outputs become parameter-sized buffers. Measured on 2.11 (MLP-512
# ddp, one gloo rank, 8 MiB of parameters): the lowered step's peak 24.2 MiB against 16.0
# for torch's eager step and 5.1 on 2.13; on an H200, mlp-2048: 384 MiB against torch
# DDP's 256. So an op whose decomposition the emulation drops and which then has no
# lowering keeps its decomposition (the one Inductor uses without the emulation: a
# division, then an add; no low-precision cast is involved). Asked of Inductor's tables,
# not the version: on 2.13 nothing is kept back and the default table is used.


def _emulation_decompositions(emulating: bool) -> dict[Any, Callable[..., Any]] | None:
    """Inductor's decomposition table for a compile with cast emulation, plus the
    decompositions of ops that would otherwise run unfused (NOTE: [unfused fallbacks under
    cast emulation]); None where nothing needs adding (Inductor's default table)."""
    if not emulating:
        return None
    from torch._inductor.lowering import lowerings

    plain, table = _decomposition_tables()
    unlowered = {op: fn for op, fn in plain.items() if op not in table and op not in lowerings}
    return {**table, **unlowered} if unlowered else None


def default_store() -> Any:
    """The store of the default process group (shared by every rank)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


# NOTE: [DTensor's sequential-collective warning]
# On a 2-D (dp, tp) mesh DTensor redistributes e.g. (S(0), S(0)) -> (R, R) as two
# collectives, one per mesh dimension, and logs once per mesh "... sequential all_gather
# operations will be performed. This is suboptimal: ... flatten mesh dimensions". The
# advice does not apply to a compiled step: the collectives land in the per-rank program
# where the demo and ``explain`` count and show them; a flattened (dp*tp) group would be a
# third process group the program does not otherwise use; and the "different reduction
# orders" it mentions are covered by the fsdp_tp parity tests (every rank runs the same
# program, so all ranks reduce in the same order). So the message is filtered while we
# expand and while ``sc.checkpoint.full_state_dict`` gathers the state for export (its
# gathers run once, outside any step); elsewhere (the user's own DTensor code) it is left
# alone.
_REDISTRIBUTE_LOGGER = "torch.distributed.tensor._redistribute"
_SEQUENTIAL_WARNING = "This is suboptimal"


class _DropRecords(logging.Filter):
    def __init__(self, dropped: Callable[[str], bool]) -> None:
        super().__init__()
        self._dropped = dropped

    def filter(self, record: logging.LogRecord) -> bool:
        return not self._dropped(str(record.msg))


@contextlib.contextmanager
def _dropping_log_records(logger_name: str, dropped: Callable[[str], bool]) -> Iterator[None]:
    """Drop the records of the logger ``logger_name`` whose message ``dropped`` matches
    while the block runs; every other record goes through."""
    logger = logging.getLogger(logger_name)
    record_filter = _DropRecords(dropped)
    logger.addFilter(record_filter)
    try:
        yield
    finally:
        logger.removeFilter(record_filter)


def quiet_sequential_collective_warning() -> contextlib.AbstractContextManager[None]:
    """Drop DTensor's "sequential collectives ... suboptimal" log record while the block
    runs (NOTE: [DTensor's sequential-collective warning])."""
    return _dropping_log_records(_REDISTRIBUTE_LOGGER, lambda msg: _SEQUENTIAL_WARNING in msg)


# NOTE: [torch's log of a failed meta kernel]
# A traced op whose shapes do not fit (a batch of 5 features into Linear(16, ...)) fails
# in its meta kernel, and FakeTensorMode logs it with ``log.exception`` before it raises:
# 21 lines of "[rank0]:E... failed while attempting to run meta for aten.mm.default" and
# torch's stack on stderr, then our SPMDCompileError naming the line and torch's message.
# The error is raised and reported either way; while the step is traced the log record is
# dropped (elsewhere it is left alone).
_FAKE_TENSOR_LOGGER = "torch._subclasses.fake_tensor"
_META_FAILURE = "failed while attempting to run meta"


def quiet_meta_failure_log() -> contextlib.AbstractContextManager[None]:
    """Drop FakeTensorMode's log of a failed meta kernel while the block runs (NOTE:
    [torch's log of a failed meta kernel]); the error itself still propagates."""
    return _dropping_log_records(_FAKE_TENSOR_LOGGER, lambda msg: msg.startswith(_META_FAILURE))


# ---------------------------------------------------------------------------- DTensor gaps
#
# NOTE: [DTensor gap fills]
# Older DTensor (torch 2.11) lacks a few rules that 2.13 has. Each is detected by a feature
# test (the rule itself is asked, never the version string) and filled here, once, by
# ``install_dtensor_gap_fills()`` (called before expansion). On a torch that has the rule
# nothing is installed.


def install_dtensor_gap_fills() -> None:
    """Fill the DTensor gaps of this torch (NOTE: [DTensor gap fills]); idempotent."""
    global _GAPS_FILLED
    if _GAPS_FILLED:
        return
    _GAPS_FILLED = True
    if _view_flatten_gap():
        _install_strided_view_rule()
        _VIEW_FILLS.add("strided_view")
    elif _view_split_flatten_gap():
        _install_strided_view_rule(split_flatten_only=True)
        _VIEW_FILLS.add("split_flatten")
    # each gap below is asked of the rule as patched so far: where an older torch's fill
    # above already answers a case, the later fill finds no gap and is not installed
    for name, gap, install in (
        ("nested_unflatten", _nested_strided_unflatten_gap, _install_nested_strided_unflatten_rule),
        ("regroup", _regroup_gathers_gap, _install_regroup_rule),
        ("gather_fallback", _view_rule_raises_gap, _install_view_gather_fallback),
        ("single_rank", _single_rank_view_gap, _install_single_rank_views),
    ):
        if gap():
            install()
            _VIEW_FILLS.add(name)
    if _strided_reading_conflict_gap():
        _install_strided_reading_conflict_rule()
    if _div_denominator_partial_gap():
        _install_div_numerator_partials_only()
    _install_missing_dim_strategies()
    _install_fill_strategies()
    _install_weight_norm_strategies()
    _install_per_sample_strategies()
    _install_fft_strategies()
    _install_batch_sharded_convolution()
    _install_convolution_backward_replicated_inputs()
    _install_convolution_operands_placed()
    _install_copy_strategy()
    _install_fake_quantize_strategies()
    _install_integer_sum_partition()
    _install_distance_strategies()
    _install_along_dim_strategies()
    _install_searchsorted_strategy()
    _install_block_diag_strategy()
    _install_linalg_batch_rows()
    if _index_put_leading_dims_gap():
        _install_index_put_checked_strategy()
    if _constant_pad_replicates_only_gap():
        _install_constant_pad_strategy()
    if _grouped_mm_fake_dtype_gap():
        _install_grouped_mm_fake_kernel()


_GAPS_FILLED = False
_VIEW_FILLS: set[str] = set()


def view_fills() -> frozenset[str]:
    """Which of our view-rule fills this torch got (after ``install_dtensor_gap_fills``):
    "strided_view" (2.11), "split_flatten" (2.12), "nested_unflatten" and "regroup"
    (NOTE: [nested strided unflatten], NOTE: [head-local regroup]; 2.13 and later),
    "gather_fallback" (NOTE: [view rule that raises]), "single_rank" (NOTE: [views of a
    shard on one rank])."""
    install_dtensor_gap_fills()
    return frozenset(_VIEW_FILLS)


def _probe_raises(probe: Callable[[], Any], gap: tuple[type[Exception], ...]) -> bool:
    """A gap's feature test: True when ``probe`` raises one of ``gap``; False when it
    answers, or raises anything else (another signature: not the rule a fill knows)."""
    try:
        probe()
    except gap:
        return True
    except Exception:
        return False
    return False


def _view_flatten_gap() -> bool:
    """True when DTensor's view rule refuses to flatten ``(a, b)`` with ``b`` sharded
    (2.13 answers ``_StridedShard``; 2.11 raises)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._ops import _view_ops

    def probe() -> None:
        rule = (_view_ops.Flatten((_view_ops.InputDim(0), _view_ops.InputDim(1))),)
        _view_ops.propagate_shape_and_sharding((Shard(1),), (4, 6), rule, (2,), True)

    return _probe_raises(probe, (RuntimeError,))


def _view_split_flatten_gap() -> bool:
    """True when DTensor's view rule refuses to flatten ``(a, b)`` with ``b`` sharded and
    split the result again (torch 2.12: "not supported yet for non-first flatten dims")."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._ops import _view_ops

    def probe() -> None:
        flat = _view_ops.Flatten((_view_ops.InputDim(0), _view_ops.InputDim(1)))
        rule = (_view_ops.Split(flat, (2, 12), 0), _view_ops.Split(flat, (2, 12), 1))
        _view_ops.propagate_shape_and_sharding((Shard(1),), (4, 6), rule, (2,), True)

    return _probe_raises(probe, (RuntimeError,))


def _install_strided_view_rule(split_flatten_only: bool = False) -> None:
    """torch 2.11 gap: views that flatten a sharded non-first dimension (attention heads,
    ``[b, h, t, d] -> [b*h, t, d]`` in ``matmul``) and views that split a ``_StridedShard``
    dimension back (``[b*h, t, t] -> [b, h, t, t]``), answered as 2.13 answers them."""
    _install_view_fixes(functools.partial(_strided_view_fixes, split_flatten_only=split_flatten_only))


def _install_view_fixes(fixes_of: Callable[..., dict[int, Any]]) -> None:
    """Wrap DTensor's view rule: where ``fixes_of(placements, shape, rule, mesh_sizes)``
    names mesh dims, those are answered by ``_propagate_with_fixes``; elsewhere the rule
    as patched so far answers."""
    from torch.distributed.tensor._ops import _view_ops

    original = _view_ops.propagate_shape_and_sharding

    def propagate(input_src_placements, global_input_shape, rule, mesh_sizes, strict_view=False):
        fixes = fixes_of(input_src_placements, global_input_shape, rule, mesh_sizes)
        if not fixes:
            return original(input_src_placements, global_input_shape, rule, mesh_sizes, strict_view)
        return _propagate_with_fixes(original, fixes, input_src_placements, global_input_shape,
                                     rule, mesh_sizes, strict_view)

    _view_ops.propagate_shape_and_sharding = propagate


def _propagate_with_fixes(original, fixes, placements, shape, rule, mesh_sizes, strict_view) -> Any:
    """torch's view rule on ``placements`` with the mesh dims of ``fixes`` replicated; those
    mesh dims then keep their input placement and give the fix's output placement (the
    step each of our view fills shares)."""
    from torch.distributed.tensor import Replicate

    replicated = [Replicate() if m in fixes else p for m, p in enumerate(placements)]
    tgt, out = original(replicated, shape, rule, mesh_sizes, strict_view)
    tgt = [placements[m] if m in fixes else p for m, p in enumerate(tgt)]
    out = [fixes.get(m, p) for m, p in enumerate(out)]
    return tgt, out


def _strided_view_fixes(placements, shape, rule, mesh_sizes, split_flatten_only=False) -> dict[int, Any]:
    """Mesh dim -> output placement for the shards the 2.11 view rule gets wrong (2.12:
    only a flatten split again, ``split_flatten_only``)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._ops import _view_ops
    from torch.distributed.tensor.placement_types import _StridedShard

    def sharders(dim: int) -> list[int]:
        return [m for m, p in enumerate(placements) if isinstance(p, Shard | _StridedShard) and p.dim == dim]

    def local_before(dim: int, m: int) -> int | None:
        """Size of ``dim`` after the plain shards of mesh dims before ``m`` (None: uneven,
        strided, or sharded by a later mesh dim)."""
        size = shape[dim]
        for other in sharders(dim):
            if other == m:
                continue
            if other > m or is_strided_shard(placements[other]) or size % mesh_sizes[other]:
                return None
            size //= mesh_sizes[other]
        return size

    fixes: dict[int, Any] = {}
    for out_dim, cmd in enumerate(rule):
        split_flatten = isinstance(cmd, _view_ops.Split) and isinstance(cmd.input_dim, _view_ops.Flatten)
        if split_flatten_only and not split_flatten:
            continue
        if isinstance(cmd, _view_ops.Flatten) and all(isinstance(d, _view_ops.InputDim) for d in cmd.input_dims):
            dims = [d.input_dim for d in cmd.input_dims if isinstance(d, _view_ops.InputDim)]
            for i, dim in enumerate(dims[1:], start=1):
                for m in sharders(dim):
                    fix = _flatten_fix(placements, shape, mesh_sizes, dims, i, m, sharders, local_before, out_dim)
                    fixes[m] = fix
        elif isinstance(cmd, _view_ops.Split) and isinstance(cmd.input_dim, _view_ops.Flatten):
            group = cmd.input_dim.input_dims
            if not all(isinstance(d, _view_ops.InputDim) for d in group):
                continue
            dims = [d.input_dim for d in group if isinstance(d, _view_ops.InputDim)]
            for i, dim in enumerate(dims[1:], start=1):
                for m in sharders(dim):
                    if m not in fixes:  # once per mesh dim: the group's outputs share it
                        fixes[m] = _split_flatten_fix(placements, shape, mesh_sizes, dims, i, m, sharders, rule, cmd)
        elif isinstance(cmd, _view_ops.Split) and isinstance(cmd.input_dim, _view_ops.InputDim):
            dim = cmd.input_dim.input_dim
            for m in sharders(dim):
                p = placements[m]
                if not is_strided_shard(p) or m in fixes:
                    continue
                fixes[m] = _split_fix(p, cmd, m, mesh_sizes, local_before(dim, m), rule, dim)
    return fixes


def _flatten_fix(placements, shape, mesh_sizes, dims, i, m, sharders, local_before, out_dim) -> Any:
    """``_StridedShard`` of the flattened output for a plain shard of group dim ``i > 0``."""
    from torch.distributed.tensor.placement_types import _StridedShard

    dim = dims[i]
    ok = (
        not is_strided_shard(placements[m])
        and sharders(dim) == [m]
        and shape[dim] % mesh_sizes[m] == 0
        and all(not sharders(d) for d in dims[1:i] + dims[i + 1 :])
        and local_before(dims[0], m) is not None
    )
    if not ok:
        raise RuntimeError(
            f"spmd_compiler: this torch's DTensor cannot flatten dims {dims} of a tensor of "
            f"shape {tuple(shape)} with placements {tuple(placements)} (dim {dim} sharded "
            "unevenly or together with other dims of the group) without redistribution."
        )
    split_factor = local_before(dims[0], m)
    for d in dims[1:i]:
        split_factor *= shape[d]
    return _StridedShard(out_dim, split_factor=split_factor)


def _split_flatten_fix(placements, shape, mesh_sizes, dims, i, m, sharders, rule, cmd) -> Any:
    """Output placement for a shard of group dim ``i > 0`` of a flatten that is split
    again (``[48, 16] -> [6, 32, 4]``, 16 sharded, and back): the flat dim holds blocks
    of ``shape[dim] / split_factor * inner`` elements (a plain shard: split factor 1), each
    cut into one piece per rank; the output dim whose
    rows hold whole blocks and whose trailing dims fit in a piece carries it (a
    ``_StridedShard`` over its blocks, a ``Shard`` for a single one)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._ops import _view_ops
    from torch.distributed.tensor.placement_types import _StridedShard

    dim, n = dims[i], mesh_sizes[m]
    split = getattr(placements[m], "split_factor", 1)  # a _StridedShard: its blocks
    if (
        sharders(dim) == [m]
        and shape[dim] % (n * split) == 0
        and all(not sharders(d) for d in dims if d != dim)
    ):
        block = shape[dim] // split * math.prod(shape[d] for d in dims[i + 1 :])
        piece = block // n
        group = list(cmd.group_shape)
        for out, c in enumerate(rule):
            if not (isinstance(c, _view_ops.Split) and c.input_dim == cmd.input_dim):
                continue
            rows, inner = group[c.split_id], math.prod(group[c.split_id + 1 :])
            if (rows * inner) % block == 0 and piece % inner == 0:
                split_factor = rows * inner // block
                return Shard(out) if split_factor == 1 else _StridedShard(out, split_factor=split_factor)
    raise RuntimeError(
        f"spmd_compiler: this torch's DTensor cannot flatten dims {dims} of a tensor of shape "
        f"{tuple(shape)} with placements {tuple(placements)} into {tuple(cmd.group_shape)} "
        "without redistribution."
    )


def _split_fix(p, cmd, m, mesh_sizes, local_size, rule, dim) -> Any:
    """``Shard`` of the output dim a ``_StridedShard`` dim is split back into."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._ops import _view_ops

    outs = {
        c.split_id: out
        for out, c in enumerate(rule)
        if isinstance(c, _view_ops.Split) and c.input_dim == cmd.input_dim
    }
    group = list(cmd.group_shape)
    total = math.prod(group)
    # earlier mesh dims' plain shards cut the leading split piece (left-to-right order)
    earlier = total // local_size if local_size else 0
    if earlier and total % local_size == 0 and group[0] % earlier == 0:
        group[0] //= earlier
        prefix = 1
        for j, size in enumerate(group):
            if prefix == p.split_factor and size % mesh_sizes[m] == 0 and j in outs:
                return Shard(outs[j])
            prefix *= size
    raise RuntimeError(
        f"spmd_compiler: this torch's DTensor cannot split the strided-sharded dim {dim} "
        f"({p}) into {tuple(cmd.group_shape)} without redistribution."
    )


# NOTE: [nested strided unflatten]
# Sequence-first attention under FSDP x TP: the batch dim of ``(L, B, E)`` sharded on dp
# AND on tp (DTensor's mm rules pick Shard(0) on tp for a gradient that arrives Partial
# there) flattens to ``(L*B, E)`` as ``(_StridedShard(0, sf=L), _StridedShard(0, sf=L))``,
# which is right: placements apply left to right and tp's split factor counts the groups
# of dp's LOCAL piece, still L. Splitting it back (``[L*B, E] -> [L, B, h, d]``, the
# view in multi_head_attention_forward's backward) fails in torch 2.13 ("Cannot unflatten
# tensor with _StridedShard placement"): ``_expected_split_factor`` divides the split
# prefix by EVERY earlier mesh dim sharding that tensor dim, also by one that cut an inner
# split piece (dp's B), so it expects sf=L/2 on tp. The fill answers only where torch
# raises, and only for pure unflattens (``Split(InputDim)``) whose every shard of the
# split dim resolves to a plain Shard of one output dim: mesh dims in order, each shard's
# split factor must be the product of the LOCAL split pieces before its output dim (the
# pieces earlier mesh dims cut already divided), and that piece must divide evenly. Any
# other case keeps torch's error, so the compile refuses naming aten.view.


def _nested_strided_unflatten_gap() -> bool:
    """True when DTensor's view rule cannot split back what it flattened from
    ``(2, 4)`` sharded on dim 1 by both mesh dims of a 2x2 mesh."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._ops import _view_ops

    def probe() -> None:
        propagate = _view_ops.propagate_shape_and_sharding
        _, flat = propagate(
            (Shard(1), Shard(1)), (2, 4), _view_ops.view_groups((2, 4), (8,)), (2, 2), True
        )
        propagate(tuple(flat), (8,), _view_ops.view_groups((8,), (2, 4)), (2, 2), True)

    return _probe_raises(probe, (RuntimeError,))


def _install_nested_strided_unflatten_rule() -> None:
    """NOTE: [nested strided unflatten]: where torch's view rule raises, answer the
    unflatten of a dim sharded strided by several mesh dims, or raise torch's error."""
    from torch.distributed.tensor._ops import _view_ops

    original = _view_ops.propagate_shape_and_sharding

    def propagate(input_src_placements, global_input_shape, rule, mesh_sizes, strict_view=False):
        try:
            return original(input_src_placements, global_input_shape, rule, mesh_sizes, strict_view)
        except RuntimeError:
            fixes = _nested_unflatten_fixes(input_src_placements, rule, mesh_sizes)
            if fixes is None:
                raise
        return _propagate_with_fixes(original, fixes, input_src_placements, global_input_shape,
                                     rule, mesh_sizes, strict_view)

    _view_ops.propagate_shape_and_sharding = propagate


def _nested_unflatten_fixes(placements, rule, mesh_sizes) -> dict[int, Any] | None:
    """Mesh dim -> output Shard for every shard of a strided-sharded dim that ``rule``
    splits (NOTE: [nested strided unflatten]); None when some shard does not resolve."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._ops import _view_ops

    def refs(cmd: Any) -> list[Any]:
        return [c for c in _view_commands(cmd) if isinstance(c, _view_ops.InputDim)]

    fixes: dict[int, Any] = {}
    strided_dims = {p.dim for p in placements if is_strided_shard(p)}
    for dim in strided_dims:
        splits = {
            cmd.split_id: (out, cmd) for out, cmd in enumerate(rule)
            if isinstance(cmd, _view_ops.Split) and cmd.input_dim == _view_ops.InputDim(dim)
        }
        uses = sum(1 for cmd in rule for ref in refs(cmd) if ref.input_dim == dim)
        if not splits or uses != len(splits):
            return None  # the dim also feeds a flatten or is kept whole: not a pure unflatten
        group = list(next(iter(splits.values()))[1].group_shape)
        for m, p in enumerate(placements):
            if not is_shard_like(p) or p.dim != dim:
                continue
            split_factor = p.split_factor if is_strided_shard(p) else 1
            piece = next(
                (
                    j for j in splits
                    if math.prod(group[:j]) == split_factor and group[j] % mesh_sizes[m] == 0
                ),
                None,
            )
            if piece is None:
                return None
            group[piece] //= mesh_sizes[m]
            fixes[m] = Shard(splits[piece][0])
    return fixes or None


# NOTE: [two readings of a strided shard]
# torch 2.13's DTensorSpec reads a _StridedShard two ways: a spec made from placements
# (distribute_tensor, from_local: the parameters and optimizer state) reads it as a shard
# ORDER (use_strided_shard_as_shard_order), one made by view propagation as a plain
# strided split. On a 1-D mesh both hold the same rows, but the specs differ, and a
# pointwise op between them (AdamW's lerp of a MultiheadAttentionParallel in_proj
# gradient, made by views, into its state) gathers both to Replicate and re-shards. A
# gradient entering the optimizer on a 1-D mesh is re-wrapped in the state's reading
# (no data moves): ``as_state_strided_shard``.
#
# NOTE: [head-local regroup]
# nn.MultiheadAttention splits heads with ``q.view(L, B * H, hd)`` on a (L, B, E) tensor:
# the rule is Split(Flatten(B, E)), and with E sharded on tp (whole heads per rank under
# MultiheadAttentionParallel) torch 2.13 gathers E first ("combined Flatten+Split rewrite
# does not preserve that placement", a Replicate fallback): every rank then computes
# every head. The layout IS a _StridedShard: the flattened dim is (A, s, C) (A the
# product of the dims before the sharded one, s its size, C after), rank k holds chunk k
# of s, i.e. digit k of (A, n, s/n * C). Where the output split g has a piece j with
# prod(g[:j]) dividing A and prod(g[j+1:]) dividing s/n * C, piece j reads as
# (A / prod(g[:j]), n, ...) and the shard is _StridedShard(j, sf=A / prod(g[:j])) there
# (Shard(j) when that is 1). A _StridedShard(sf) input is (sf, n, s / (sf n)): A grows
# by sf. Earlier mesh dims may shard the first flattened dim (FSDP x TP: the batch on
# dp): placements apply left to right, so A and the first split piece are then counted
# locally (divided by those mesh sizes). The way back, ``(B*H, L, hd) -> (L*B, E)`` after the transpose, is the same rule
# (torch 2.13 raised KeyError there). Only for a shard of a non-first flattened dim
# whose tensor dims no other mesh dim shards; anything else is left to torch.


def _regroup_gathers_gap() -> bool:
    """True when DTensor's view rule gathers ``(2, 4) -> (4, 2)`` with dim 1 sharded."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._ops import _view_ops

    try:
        tgt, _ = _view_ops.propagate_shape_and_sharding(
            (Shard(1),), (2, 4), _view_ops.view_groups((2, 4), (4, 2)), (2,), True
        )
    except Exception:  # another signature, or it raises: not the rule this fill knows
        return False
    return tuple(tgt) == (Replicate(),)


def _install_regroup_rule() -> None:
    """NOTE: [head-local regroup]: keep a sharded non-first dim of a flatten-then-split
    view sharded (strided) instead of gathering it."""
    _install_view_fixes(_regroup_fixes)


def _regroup_fixes(placements, shape, rule, mesh_sizes) -> dict[int, Any]:
    """Mesh dim -> output placement per NOTE: [head-local regroup]; empty if none."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._ops import _view_ops

    groups: list[tuple[Any, dict[int, int]]] = []  # (Flatten, split_id -> output dim)
    for out, cmd in enumerate(rule):
        if isinstance(cmd, _view_ops.Split) and isinstance(cmd.input_dim, _view_ops.Flatten):
            found = next((outs for flat, outs in groups if flat == cmd.input_dim), None)
            if found is None:
                found = {}
                groups.append((cmd.input_dim, found))
            found[cmd.split_id] = out
    fixes: dict[int, Any] = {}
    for flatten, outs in groups:
        if not all(isinstance(d, _view_ops.InputDim) for d in flatten.input_dims):
            continue
        dims = [d.input_dim for d in flatten.input_dims]
        sharders = [
            m for m, p in enumerate(placements)
            if is_shard_like(p) and p.dim in dims
        ]
        if not sharders:
            continue
        # earlier mesh dims may cut the FIRST flattened dim (a batch on dp; torch maps
        # that to the first split piece), the last one is the shard kept here
        m, earlier = sharders[-1], sharders[:-1]
        outer = math.prod(mesh_sizes[k] for k in earlier)
        group = list(rule[next(iter(outs.values()))].group_shape)
        if any(placements[k] != Shard(dims[0]) for k in earlier) or group[0] % outer:
            continue
        p, n = placements[m], mesh_sizes[m]
        blocks = p.split_factor if is_strided_shard(p) else 1
        if p.dim == dims[0] or shape[p.dim] % (blocks * n) or shape[dims[0]] % outer:
            continue
        i = dims.index(p.dim)
        group[0] //= outer
        # the flattened dim, local to the earlier shards, as (before, n, inner): rank k
        # holds digit k of n
        before = math.prod(shape[d] for d in dims[:i]) // outer * blocks
        inner = shape[p.dim] // (blocks * n) * math.prod(shape[d] for d in dims[i + 1:])
        for j in sorted(outs):
            lead, trail = math.prod(group[:j]), math.prod(group[j + 1:])
            if group[j] > 1 and before % lead == 0 and inner % trail == 0:
                split_factor = before // lead
                fixes[m] = Shard(outs[j]) if split_factor == 1 else strided_shard(outs[j], split_factor)
                break
    return fixes


# NOTE: [view rule that raises]
# torch 2.13 / 2.14's view rule raises (KeyError in ``_rewrite_strided_shard``) on some
# flatten-then-split views of a tensor strided-sharded on one mesh dim and sharded on
# another: ``[48, 16] -> [6, 32, 4]`` with ``(_S(0, 6), S(1))`` on a 2x2 mesh, which
# torch 2.14's propagation reaches in the backward of ``nn.MultiheadAttention`` under
# FSDP x TP. Where it raises, the view is asked again with the mesh dims that shard a
# flattened input dim replicated: first only the strided ones, then all of them. A
# Replicate input gives a Replicate output on that mesh dim, so the answer is exact (the
# input is gathered there first, as torch's own "Replicate fallback" for such views
# does); if that raises too, torch's error stands and the compile refuses naming the op.
# Only internal errors (KeyError, IndexError, AssertionError) are answered: a RuntimeError
# is the rule's own refusal (2.11: "cannot be performed without redistribution"), kept.


def _view_rule_raises_gap() -> bool:
    """True when DTensor's view rule (as patched so far) raises on the case above."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._ops import _view_ops

    def probe() -> None:
        rule = _view_ops.view_groups((48, 16), (6, 32, 4))
        placements = (strided_shard(0, 6), Shard(1))
        _view_ops.propagate_shape_and_sharding(placements, (48, 16), rule, (2, 2), True)

    return _probe_raises(probe, _VIEW_RULE_BUGS)


# What a view rule raises on a case it gets wrong internally (NOTE: [view rule that raises])
_VIEW_RULE_BUGS = (KeyError, IndexError, AssertionError)


def _install_view_gather_fallback() -> None:
    """NOTE: [view rule that raises]: where the view rule raises, gather the mesh dims
    that shard a flattened dim and ask again."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._ops import _view_ops

    current = _view_ops.propagate_shape_and_sharding

    def propagate(input_src_placements, global_input_shape, rule, mesh_sizes, strict_view=False):
        try:
            return current(input_src_placements, global_input_shape, rule, mesh_sizes, strict_view)
        except _VIEW_RULE_BUGS as error:
            flattened = _flattened_input_dims(rule)
            sharders = [
                m for m, p in enumerate(input_src_placements)
                if (p.is_shard() or is_strided_shard(p)) and p.dim in flattened
            ]
            strided = [m for m in sharders if is_strided_shard(input_src_placements[m])]
            for gathered in (strided, sharders):
                if not gathered:
                    continue
                placements = [
                    Replicate() if m in gathered else p for m, p in enumerate(input_src_placements)
                ]
                try:
                    return current(placements, global_input_shape, rule, mesh_sizes, strict_view)
                except (*_VIEW_RULE_BUGS, RuntimeError):
                    continue
            raise error

    _view_ops.propagate_shape_and_sharding = propagate


# NOTE: [views of a shard on one rank]
# A mesh dimension of size 1 holds the whole tensor on its one rank whatever its
# placement says: Shard(d) there is Replicate. Where every redistribution on it is free,
# DTensor's strategies may shard a dimension of size 1 on it (a ColwiseParallel
# Linear(16, 1) head at tp=1 gives its output Shard(1) on (8, 1)), and its strict view
# rule then refuses the ``squeeze(-1)`` after it ("This operation would remove or
# reshape sharded dimension 1, which requires redistribution", torch 2.13, 2026-12-05).
# Where the rule raises, the view is asked again with such mesh dims replicated: the
# input keeps its placement there (its local tensor is already the whole one, no
# collective) and the output is Replicate there. Other mesh dims keep torch's answer or
# its error.


def _single_rank_view_gap() -> bool:
    """True when DTensor's view rule (as patched so far) refuses ``(8, 1) -> (8,)`` with
    dim 1 sharded on a mesh of one rank."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._ops import _view_ops

    def probe() -> None:
        rule = _view_ops.view_groups((8, 1), (8,))
        _view_ops.propagate_shape_and_sharding((Shard(1),), (8, 1), rule, (1,), True)

    return _probe_raises(probe, (RuntimeError,))


def _install_single_rank_views() -> None:
    """NOTE: [views of a shard on one rank]: where the view rule raises, answer it with
    the shards on mesh dims of size 1 read as Replicate."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._ops import _view_ops

    current = _view_ops.propagate_shape_and_sharding

    def propagate(input_src_placements, global_input_shape, rule, mesh_sizes, strict_view=False):
        try:
            return current(input_src_placements, global_input_shape, rule, mesh_sizes, strict_view)
        except RuntimeError:
            fixes = {
                m: Replicate() for m, p in enumerate(input_src_placements)
                if mesh_sizes[m] == 1 and (p.is_shard() or is_strided_shard(p))
            }
            if not fixes:
                raise
        return _propagate_with_fixes(current, fixes, input_src_placements, global_input_shape,
                                     rule, mesh_sizes, strict_view)

    _view_ops.propagate_shape_and_sharding = propagate


def _flattened_input_dims(rule: Any) -> set[int]:
    """The input dims that a view rule flattens together with others."""
    from torch.distributed.tensor._ops import _view_ops

    return {
        d.input_dim
        for cmd in rule for c in _view_commands(cmd) if isinstance(c, _view_ops.Flatten)
        for d in c.input_dims if isinstance(d, _view_ops.InputDim)
    }


def _view_commands(cmd: Any) -> Iterator[Any]:
    """``cmd`` (one output dim of a view rule) and every command nested in it."""
    yield cmd
    for inner in cmd.inputs():
        yield from _view_commands(inner)


# NOTE: [conflicting strided readings]
# torch 2.12's sharding propagation raises when an op's inputs read a _StridedShard two
# ways (NOTE: [two readings of a strided shard]): "Conflicting use_strided_shard_as_shard_order
# across input specs", e.g. ``mm`` of an activation made by a view (plain strided split)
# with a fused q/k/v weight made from placements (shard order) under FSDP x TP. torch 2.13
# settles such a conflict on the shard-order reading for every spec of the strategy, so
# the inputs are redistributed to it. The 2.12 fill does the same where torch raises;
# without a conflict torch's own function runs.


def _strided_reading_conflict_gap() -> bool:
    """True when sharding propagation raises on inputs that read a _StridedShard two ways."""
    from types import SimpleNamespace

    import torch.distributed.tensor._sharding_prop as sharding_prop

    propagate = getattr(sharding_prop, "_propagate_use_strided_shard_flag", None)
    if propagate is None:
        return False

    def probe() -> None:
        placements = (strided_shard(0, 2),)
        specs = [
            SimpleNamespace(placements=placements, use_strided_shard_as_shard_order=flag)
            for flag in (True, False)
        ]
        propagate(SimpleNamespace(strategies=[]), SimpleNamespace(args_spec=specs))

    return _probe_raises(probe, (ValueError,))


def _install_strided_reading_conflict_rule() -> None:
    """NOTE: [conflicting strided readings]: on a conflict every strided spec of the
    strategy reads the shard order, as torch 2.13 does."""
    import torch.distributed.tensor._sharding_prop as sharding_prop
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    original = sharding_prop._propagate_use_strided_shard_flag

    def strided(spec: Any) -> bool:
        return spec is not None and any(is_strided_shard(p) for p in spec.placements)

    def propagate(op_strategy: Any, op_schema: Any) -> None:
        readings = {
            spec.use_strided_shard_as_shard_order
            for spec in op_schema.args_spec if strided(spec)
        }
        if len(readings) < 2:
            return original(op_strategy, op_schema)
        for op_spec in op_strategy.strategies:
            out = op_spec.output_specs
            specs = [out] if isinstance(out, DTensorSpec) else list(out or ())
            for spec in [*specs, *(op_spec.input_specs or ())]:
                if strided(spec) and not spec.use_strided_shard_as_shard_order:
                    spec.use_strided_shard_as_shard_order = True
                    spec.shard_order = None
        return None

    sharding_prop._propagate_use_strided_shard_flag = propagate


def as_state_strided_shard(value: DTensor) -> DTensor:
    """``value`` (a gradient on a 1-D mesh) with its ``_StridedShard`` read as the
    optimizer state's is (NOTE: [two readings of a strided shard]); otherwise unchanged."""
    spec = value._spec
    if (
        value.device_mesh.ndim != 1
        or not any(is_strided_shard(p) for p in value.placements)
        or getattr(spec, "use_strided_shard_as_shard_order", True)
    ):
        return value
    return DTensor.from_local(
        local_tensor_of(value), value.device_mesh, value.placements, run_check=False,
        shape=value.shape, stride=value.stride(),
    )


def _planner_lacks_strided(spec: Any) -> bool:
    """True when this torch cannot redistribute ``spec``'s ``_StridedShard`` to Replicate:
    its DTensor reads ``_StridedShard`` only as a shard order (torch 2.11), and its other
    sharding rules do not know the strided shards a view makes either."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    replicated = DTensorSpec(spec.mesh, (Replicate(),) * len(spec.placements), tensor_meta=spec.tensor_meta)
    return _strided_redistribution_gap(spec, replicated)


def _strided_aware_ops() -> frozenset[Any]:
    """Ops whose 2.11 rule moves a ``_StridedShard`` correctly: the views (one rule,
    ``propagate_shape_and_sharding``, see ``_install_strided_view_rule``) and ``bmm`` on
    a strided batch dim."""
    aten = torch.ops.aten
    return frozenset({
        aten.view.default, aten._unsafe_view.default, aten.reshape.default,
        aten.transpose.int, aten.permute.default, aten.expand.default,
        aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default, aten.bmm.default,
    })


def arguments_for_dtensor_rules(op: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``op``'s DTensor arguments redistributed where DTensor's rule for ``op`` would
    choose a worse layout or a wrong one, before the op runs: a LayerNorm backward's
    gradient in its statistics' layout (NOTE: [norm backward in its forward's layout]),
    partials of two kinds reduced on releases that mix them, and strided shards this
    torch's rule does not know gathered (NOTE: [DTensor gap fills])."""
    if op is torch.ops.aten.native_layer_norm_backward.default:
        args = _norm_backward_follows_statistics(args)
    if _release() in MIXED_PARTIALS_GAP_RELEASES:
        args, kwargs = _reduce_mixed_partials(args, kwargs)
    return settle_strided_shards(op, args, kwargs)


def settle_strided_shards(op: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Gather the strided shards of ``op``'s DTensor arguments where this torch's rule for
    ``op`` does not know them (NOTE: [DTensor gap fills]).

    torch 2.11 gap: ``_StridedShard`` is not a ``Shard`` there and most rules test
    ``isinstance(p, Shard)``; e.g. ``aten.t`` keeps ``_StridedShard(0)`` on the transposed
    tensor (a silent wrong layout). Where this torch can redistribute the strided shard
    (2.13) nothing changes. ``bmm`` keeps them only when every strided shard is on the
    batch dim and both operands agree.
    """
    dtensors = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, DTensor)]
    strided = [
        d for d in dtensors
        if any(is_strided_shard(p) for p in d.placements) and _planner_lacks_strided(d._spec)
    ]
    if not strided or _keeps_strided(op, dtensors):
        return args, kwargs
    return _replicated_on(args, kwargs, {
        id(d): {i for i, p in enumerate(d.placements) if is_strided_shard(p)} for d in strided
    })


def _replicated_on(args: tuple, kwargs: dict, dims: dict[int, set[int]]) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with each DTensor whose id is in ``dims`` redistributed to
    ``Replicate`` on those mesh dims (its other placements kept)."""
    from torch.distributed.tensor import Replicate

    def settle(value: Any) -> Any:
        mesh_dims = dims.get(id(value)) if isinstance(value, DTensor) else None
        if not mesh_dims:
            return value
        placements = tuple(Replicate() if i in mesh_dims else p for i, p in enumerate(value.placements))
        return value.redistribute(value.device_mesh, placements)

    return pytree.tree_map(settle, args), pytree.tree_map(settle, kwargs)


MIXED_PARTIALS_GAP_RELEASES = ("2.11",)


def _reduce_mixed_partials(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """torch 2.11 gap: given partial sums beside partial maxima on one mesh dim (``x.amax()
    + x.mean()`` over a sharded batch), its pointwise rule plans ``P(max) -> P(sum)``,
    which its redistribute refuses ("Redistribution from one partial type ... is
    unsupported"). The arguments whose partial type differs from the first sum-like one
    are reduced to ``Replicate`` on that dim first (2.13's rule does not mix them)."""
    from torch.distributed.tensor import Partial

    dtensors = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, DTensor)]
    if len(dtensors) < 2:
        return args, kwargs
    reduce: dict[int, set[int]] = {}  # id of a DTensor -> its mesh dims to reduce
    for i in range(dtensors[0].device_mesh.ndim):
        partials = [(d, p) for d in dtensors for p in d.placements[i:i + 1] if isinstance(p, Partial)]
        kinds = {p.reduce_op for _, p in partials}
        if len(kinds) < 2:
            continue
        kept = next((k for k in ("sum", "avg") if k in kinds), next(iter(kinds)))
        for d, p in partials:
            if p.reduce_op != kept:
                reduce.setdefault(id(d), set()).add(i)
    return _replicated_on(args, kwargs, reduce) if reduce else (args, kwargs)


def _keeps_strided(op: Any, dtensors: list[DTensor]) -> bool:
    if op not in _strided_aware_ops():
        return False
    if op is not torch.ops.aten.bmm.default:
        return True
    placements = {tuple(d.placements) for d in dtensors}
    return len(placements) == 1 and all(
        p.dim == 0 for p in next(iter(placements)) if is_strided_shard(p)
    )


def _has_sharding_strategy(op: Any) -> bool:
    """Whether this torch's DTensor has any sharding rule for ``op``."""
    propagator = DTensor._op_dispatcher.sharding_propagator
    tables = ("op_strategy_funcs", "op_to_rules", "op_single_dim_strategy_funcs")
    return any(op in getattr(propagator, table, {}) for table in tables)


# NOTE: [sharding rules keyed by every argument]
# DTensor caches each op's sharding decision (output placements and the output's shape)
# under a key of its DTensor inputs' specs and, from ``RuntimeSchemaInfo.static_argnum``
# on, its other arguments. ``register_sharding`` starts that range at the first ``int``
# argument, so a list (``reflection_pad1d``'s ``padding``, pooling's ``kernel_size``), a
# float (``hardtanh_backward``'s bounds) or a bool before it, and every such argument of
# an op with no ``int`` one, was left out: a second ``reflection_pad1d`` of the same input
# with another padding (HiFi-GAN's kernel sizes 3, 7, 11 on one shape) got the first
# one's output shape and the step was refused ("global shape (8, 4, 34), where the
# single-device step computes shape (8, 4, 38)"; 2026-12-06). A decision that also
# rewrites arguments (``op_to_shape_and_stride_idx``: torch 2.11's upsampling backwards)
# would have run with the first call's arguments, silently. Every rule registered here
# is keyed by all its non-tensor arguments, positional and keyword-only. Tested by
# tests/sim/test_sharding_rule_arguments.py.
def register_sharding_keyed(op: Any, rule: Callable[..., Any]) -> None:
    """``register_sharding(op)(rule)`` with the sharding cache keyed by every non-tensor
    argument of ``op`` (NOTE: [sharding rules keyed by every argument])."""
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
    from torch.distributed.tensor.experimental import register_sharding

    register_sharding(op)(rule)
    arguments = op._schema.arguments
    static = [a for a in arguments if "Tensor" not in str(a.type)]
    positional = [i for i, a in enumerate(arguments) if a in static and not a.kwarg_only]
    keywords = [a.name for a in static if a.kwarg_only]
    DTensor._op_dispatcher.sharding_propagator.op_to_schema_info[op] = RuntimeSchemaInfo(
        min(positional, default=100), keywords or None, needs_pytree=True
    )


def _install_missing_dim_strategies() -> None:
    """torch 2.11 gap: no DTensor rule for ``squeeze.dims``, ``flip``, ``roll``,
    ``cummax``, ``cumprod``, ``logcumsumexp`` and ``var_mean.correction`` (and no torch
    has one for ``unfold``). Each gets ours where this torch has none: a
    shard along a dimension the op works on (squeezes, reduces) is gathered (Replicate),
    other shards are kept (renumbered past removed dims); a Partial input is kept only by
    the linear ones (squeeze, flip, roll)."""
    aten = torch.ops.aten

    def flip_dims(args: tuple, ndim: int) -> list[int]:
        return list(args[1])

    def roll_dims(args: tuple, ndim: int) -> list[int]:
        dims = list(args[2]) if len(args) > 2 else []
        return dims or list(range(ndim))  # no dims: the flattened tensor is rolled

    def cummax_dims(args: tuple, ndim: int) -> list[int]:
        return [args[1]]

    def var_mean_dims(args: tuple, ndim: int) -> list[int]:
        dim = args[1] if len(args) > 1 else None
        return list(range(ndim)) if dim is None else list(dim)

    def squeezed_dims(args: tuple, ndim: int) -> list[int]:
        dims = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
        return [d for d in dims if args[0].shape[d % ndim] == 1]

    table = [
        (aten.squeeze.dims, squeezed_dims, 1, True, True),
        (aten.flip.default, flip_dims, 1, True, False),
        (aten.roll.default, roll_dims, 1, True, False),
        (aten.cummax.default, cummax_dims, 2, False, False),
        (aten.cumprod.default, cummax_dims, 1, False, False),
        (aten.logcumsumexp.default, cummax_dims, 1, False, False),
        (aten.var_mean.correction, var_mean_dims, 2, False, True),
        # every torch: Tensor.unfold(dim, size, step), sliding windows, a view adding the
        # window as a last dimension (its backward is decomposed at capture)
        (aten.unfold.default, cummax_dims, 1, True, False),
    ]
    for op, dims_of, outputs, linear, reduces in table:
        if not _has_sharding_strategy(op):
            _register_dim_strategy(op, dims_of, outputs, linear, reduces)


def _install_fill_strategies() -> None:
    """Gap on every supported torch (and ``select_scatter`` on 2.11): no DTensor rule for the functional ``fill.Scalar`` /
    ``fill.Tensor`` (``x[..., 0] = v`` in a traced step; transformers' T5 shifts its labels
    so). Where this torch has none: the result follows ``self``'s shards (each rank fills
    its slice); a Partial ``self`` gives a Replicate result (fill never reads ``self``'s
    values); a Partial 0-d value gives a Partial result (rank r fills with its part v_r,
    and the parts sum to the value). Never ``fill_.Scalar``'s rule, which keeps a Partial
    ``self`` Partial: every rank's ``v`` would then sum to ``world * v``."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    def placements(self: Any, value_placement: Any) -> list[tuple[list, list]]:
        value: list[Any] = [] if value_placement is None else [value_placement]
        out: list[tuple[list, list]] = [
            ([Replicate()], [Replicate(), *value]), ([Replicate()], [Partial(), *value])
        ]
        out += [([Shard(d)], [Shard(d), *value]) for d in range(len(self.shape))]
        if value:
            out.append(([Partial()], [Replicate(), Partial()]))
        return out

    def select_scatter(self: Any, src: Any, dim: int, index: int) -> list[tuple[list, list]]:
        """torch 2.11 gap. ``self`` with ``self.select(dim, index)`` replaced by ``src``:
        shards on another dim (renumbered in ``src``), or both Partial (linear)."""
        ndim = len(self.shape)
        dim %= ndim
        out: list[tuple[list, list]] = [
            ([Replicate()], [Replicate(), Replicate()]), ([Partial()], [Partial(), Partial()])
        ]
        for d in range(ndim):
            if d != dim:
                out.append(([Shard(d)], [Shard(d), Shard(d if d < dim else d - 1)]))
        return out

    aten = torch.ops.aten
    if not _has_sharding_strategy(aten.fill.Scalar):
        register_sharding_keyed(aten.fill.Scalar, lambda self, value: placements(self, None))
    if not _has_sharding_strategy(aten.fill.Tensor):
        register_sharding_keyed(aten.fill.Tensor, lambda self, value: placements(self, Replicate()))
    if not _has_sharding_strategy(aten.select_scatter.default):
        register_sharding_keyed(aten.select_scatter.default, select_scatter)


def _install_weight_norm_strategies() -> None:
    """Gap on every supported torch: no DTensor rule for ``_weight_norm_interface`` and
    its backward (``nn.utils.parametrizations.weight_norm``). Where this torch has none:
    ``w = v * g / norm(v)``, the norm over every dim but ``dim``, so the rows along
    ``dim`` are independent (v, g, w and the norm sharded alike on ``dim``) or all are
    replicated; the backward is linear in the weight's gradient, so a Partial gradient
    with replicated ``v``, ``g`` and norm gives Partial ``grad_v`` and ``grad_g``."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    def forward(v: Any, g: Any, dim: int = 0) -> list[tuple[list, list]]:
        dim %= len(v.shape)
        return [
            ([Replicate(), Replicate()], [Replicate(), Replicate(), None]),
            ([Shard(dim), Shard(dim)], [Shard(dim), Shard(dim), None]),
        ]

    def backward(grad_w: Any, v: Any, g: Any, norm: Any, dim: int) -> list[tuple[list, list]]:
        dim %= len(v.shape)
        r, s = Replicate(), Shard(dim)
        return [
            ([r, r], [r, r, r, r, None]),
            ([Partial(), Partial()], [Partial(), r, r, r, None]),
            ([s, s], [s, s, s, s, None]),
        ]

    aten = torch.ops.aten
    if not _has_sharding_strategy(aten._weight_norm_interface.default):
        register_sharding_keyed(aten._weight_norm_interface.default, forward)
    if not _has_sharding_strategy(aten._weight_norm_interface_backward.default):
        register_sharding_keyed(aten._weight_norm_interface_backward.default, backward)


# NOTE: [upsampling rules]
# torch 2.11's DTensor has rules for some upsample forwards only (bilinear, bicubic,
# linear, trilinear, nearest 2-d: replicate-only, each rank upsampling the whole gathered
# batch) and for none of their backwards; 2.13 has all of them,
# and rewrites the backward's ``input_size`` argument (the whole [N, C, ...] shape) to the
# local shape when the result is sharded. On 2.11, BEiT (its position bias resized) and
# every model upsampling a batch-sharded feature map were refused at expansion. Where this
# torch has no rule, or only the replicating one, each op gets the per-sample rule below
# (2.13's: every tensor replicated, or sharded alike on the batch or the channel
# dimension; linear, so a Partial input gives a Partial result), and a backward's
# ``input_size`` joins the table of shape arguments DTensor localizes
# (``op_to_shape_and_stride_idx``, index 2; ``_SHAPE_ARGUMENTS``), which 2.11 already has
# for views.
_UPSAMPLE_OPS = {  # name -> spatial dims
    "upsample_nearest1d": 1, "upsample_nearest2d": 2, "upsample_nearest3d": 3,
    "_upsample_nearest_exact1d": 1, "_upsample_nearest_exact2d": 2, "_upsample_nearest_exact3d": 3,
    "upsample_linear1d": 1, "upsample_bilinear2d": 2, "upsample_bicubic2d": 2,
    "upsample_trilinear3d": 3, "_upsample_bilinear2d_aa": 2, "_upsample_bicubic2d_aa": 2,
}
# per-sample ops with an argument holding the whole input's shape, by its index
_SHAPE_ARGUMENTS = {f"{name}_backward": 2 for name in _UPSAMPLE_OPS}


# op name -> (spatial dims, whether its first argument is a gradient it is linear in,
# outputs): ops that work on each sample and channel alike
_PER_SAMPLE_OPS = {
    **{f"{kind}_pad{k}d": (k, False, 1) for kind in ("reflection", "replication") for k in (1, 2, 3)},
    **{f"{kind}_pad{k}d_backward": (k, True, 1) for kind in ("reflection", "replication") for k in (1, 2, 3)},
    # pooling: every torch lacks the backward of average and of adaptive max pooling;
    # torch 2.11 lacks the forward pooling ops too (nn.MaxPool2d, nn.AvgPool2d, ...)
    "avg_pool2d": (2, False, 1),
    "avg_pool3d": (3, False, 1),
    "avg_pool2d_backward": (2, True, 1),
    "avg_pool3d_backward": (3, True, 1),
    "max_pool2d_with_indices": (2, False, 2),
    "max_pool3d_with_indices": (3, False, 2),
    "max_pool2d_with_indices_backward": (2, True, 1),
    "max_pool3d_with_indices_backward": (3, True, 1),
    "adaptive_max_pool2d": (2, False, 2),
    "adaptive_max_pool3d": (3, False, 2),
    "adaptive_max_pool2d_backward": (2, True, 1),
    "adaptive_max_pool3d_backward": (3, True, 1),
    "_adaptive_avg_pool2d": (2, False, 1),
    "_adaptive_avg_pool3d": (3, False, 1),
    "_adaptive_avg_pool2d_backward": (2, True, 1),
    "_adaptive_avg_pool3d_backward": (3, True, 1),
    # F.grid_sample, torch 2.11 and 2.12 (2.13 has these rules): each sample alone, and
    # the grid has no channel dimension, so batch-sharded only (every non-batch dim
    # counts as spatial)
    "grid_sampler_2d": (3, False, 1),
    "grid_sampler_3d": (4, False, 1),
    "grid_sampler_2d_backward": (3, False, 2),
    "grid_sampler_3d_backward": (4, False, 2),
    # element-wise activation gradients, torch's pointwise tag missing: every dim alike.
    # A rule keeps eager's kernel: hardsigmoid_backward's decomposition would differ
    # from it by 3e-8 in float64 (the CPU kernel multiplies by a float32 1/6).
    **{name: (0, True, 1) for name in (
        "hardsigmoid_backward", "hardswish_backward", "hardtanh_backward", "elu_backward",
        "leaky_relu_backward", "softplus_backward", "mish_backward",
        "rrelu_with_noise_backward", "hardshrink_backward", "softshrink_backward",
    )},
    # nn.FractionalMaxPool2d / 3d (torch 2.11: the pooling too): each sample and channel
    # alike; the random samples (N, C, 2 or 3) split with the batch
    "fractional_max_pool2d": (2, False, 2),
    "fractional_max_pool3d": (3, False, 2),
    "fractional_max_pool2d_backward": (2, True, 1),
    "fractional_max_pool3d_backward": (3, True, 1),
    # NOTE: [upsampling rules]
    **{name: (spatial, True, 1) for name, spatial in _UPSAMPLE_OPS.items()},
    **{f"{name}_backward": (spatial, True, 1) for name, spatial in _UPSAMPLE_OPS.items()},
}


def _install_per_sample_strategies() -> None:
    """Gap on every supported torch: no DTensor rule for the backward of average
    pooling (``nn.AvgPool2d``), of adaptive max and 3-d pooling (torch 2.11: for the
    pooling ops themselves, ``nn.MaxPool2d`` included), for reflection and
    replication padding, for several activations' backward (``nn.Hardsigmoid``,
    ``nn.Hardswish``, ``nn.ELU``, ...), and (torch 2.11 and 2.12) for ``F.grid_sample``
    and its backward. Each works on the last ``k`` (spatial; 0 for
    element-wise) dims of every sample and channel alike, so where this torch has no
    rule: every tensor replicated, or every tensor sharded alike on one leading dim; a
    backward, linear in its incoming gradient, also maps a Partial gradient (other
    tensors replicated) to a Partial result."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    def rule_for(spatial: int, linear: bool, outputs: int) -> Callable[..., list[tuple[list, list]]]:
        def rule(*args: Any) -> list[tuple[list, list]]:
            is_tensor = [hasattr(a, "shape") for a in args]

            # a backward's output_mask (grid_sampler_2d_backward's last argument): an
            # output not computed is None, and has no placement
            last = args[-1] if args else None
            is_mask = (
                outputs > 1 and isinstance(last, (list, tuple)) and len(last) == outputs
                and all(type(b) is bool for b in last)
            )
            mask: list[bool] = list(last) if is_mask else [True] * outputs  # type: ignore[arg-type]

            def alike(placement: Any, first: Any = None) -> tuple[list, list]:
                """The outputs placed like the first argument (``first`` where given)."""
                ins = [
                    (first if i == 0 and first is not None else placement) if t else None
                    for i, t in enumerate(is_tensor)
                ]
                return [(first or placement) if wanted else None for wanted in mask], ins

            leading = len(args[0].shape) - spatial
            out = [alike(Replicate())] + [alike(Shard(d)) for d in range(leading)]
            if linear:
                out.append(alike(Replicate(), Partial()))
            return out

        return rule

    propagator = DTensor._op_dispatcher.sharding_propagator
    for name, (spatial, linear, outputs) in _PER_SAMPLE_OPS.items():
        packet = getattr(torch.ops.aten, name, None)
        op = getattr(packet, "default", None)
        if op is None:  # not in this torch
            continue
        # 2.11's replicate-only rules (its upsampling forwards: each rank upsampled the
        # whole gathered batch) count as none
        replicates = getattr(
            getattr(propagator, "op_strategy_funcs", {}).get(op), "__name__", ""
        ) == "linalg_replicate_strategy"
        if _has_sharding_strategy(op) and not replicates:
            continue
        register_sharding_keyed(op, rule_for(spatial, linear, outputs))
        if name in _SHAPE_ARGUMENTS:
            propagator.op_to_shape_and_stride_idx.setdefault(op, _SHAPE_ARGUMENTS[name])


def _install_batch_sharded_convolution() -> None:
    """torch 2.11 gap: DTensor's convolution handler checked its spatial-sharding limits
    (``Stride must be 1 when there is padding for tensor parallel convolution``) before
    asking whether the input is sharded spatially at all, so every strided, padded
    convolution (a ResNet's downsampling, a ViT's patch embedding with padding) was
    refused under data parallelism. 2.13 checks them only where the ranks exchange
    border pixels. The local kernels are wrapped to do the same: with no exchange needed
    (replicated, or sharded on the batch dimension only) the local convolution runs as
    it is; otherwise torch's own path. On 2.13 the wrapper changes nothing."""
    from torch.distributed.tensor import _tp_conv as tp_conv

    if getattr(tp_conv.tp_convolution, "_spmd_local_first", False):
        return
    forward, backward = tp_conv.tp_convolution, tp_conv.tp_convolution_backward

    def convolution(op_call: Any, local_args: Any, local_kwargs: Any, dim_map: Any) -> Any:
        if not tp_conv._requires_data_exchange(local_args[4], dim_map):
            return op_call(*local_args, **local_kwargs)
        return forward(op_call, local_args, local_kwargs, dim_map)

    def convolution_backward(op_call: Any, local_args: Any, local_kwargs: Any, dim_map: Any) -> Any:
        if not tp_conv._requires_data_exchange(local_args[5], dim_map):
            return op_call(*local_args, **local_kwargs)
        return backward(op_call, local_args, local_kwargs, dim_map)

    convolution._spmd_local_first = True  # type: ignore[attr-defined]
    setattr(tp_conv, "tp_convolution", convolution)  # noqa: B010 - typed module attribute
    setattr(tp_conv, "tp_convolution_backward", convolution_backward)  # noqa: B010


# NOTE: [convolution operands placed first]
# DTensor runs ``convolution`` and ``convolution_backward`` through handlers of their own
# (``_tp_conv``), which propagate the sharding and then run the local kernel on the
# arguments as they are: where the propagation asks for a redistribution (2.13 / 2.14's
# strategy wants a replicated weight) the handler drops the request, and 2.11's rule
# copies the input's placement to the output whatever the weight's. Three ways a user
# met it, found by a probe of vision models (float64, 2 simulated ranks):
# - silently wrong: the double backward of a convolution (a gradient penalty on the
#   input: WGAN-GP, R1) computes its weight term as ``convolution(a.transpose(0, 1),
#   v.transpose(0, 1))``, the batch (sharded) now the convolution's input channels: a
#   sum over the ranks, taken as a shard of the output's channels; the penalty's weight
#   gradient came out 1/world of eager's (ddp and fsdp), and with per-sample
#   ``grad_outputs`` the replicas of a weight diverged;
# - refused: under fsdp a convolution reading its weight after ``optimizer.step()`` in
#   the same step (a GAN's generator step) got the updated weight still sharded; under
#   ddp a weight scaled by a value sharded as a batch (``spectral_norm`` on a
#   convolution with as many output channels as the batch has samples).
# - refused: an input sharded along a spatial dimension (sequence parallelism's
#   ``RowwiseParallel(output_layouts=Shard(1))`` or ``SequenceParallel()`` feeding a
#   depthwise ``nn.Conv1d`` over time, tp 2): 2.13's strategy gives such a convolution
#   a replicated output, so the handler saw no sharded dimension, did no halo exchange
#   and ran the kernel on the local half of the sequence (a (4, 16, 4) result for a
#   replicated (4, 16, 8)), which the local shape check refused.
# Before the handler runs, the weight and bias are made replicated, and an input sharded
# on any dimension but the batch, or a partial sum (which the bias would meet on every
# rank), replicated on those mesh dimensions; only batch shards stay (the local kernel
# serves them exactly). Gathering a spatial shard costs one all-gather of the input
# where DTensor's halo exchange would send the borders, but that exchange serves only
# the last spatial dimension, a stride of 1 and (backward) 4-d inputs, and the
# strategy's replicated output disowns it anyway. The common case, a replicated weight
# and a batch-sharded input, passes through unchanged.
# A spatial shard on a mesh dimension a data-parallel mode splits the step's arguments
# over is no sequence parallelism: it is an argument split on a dimension that is not its
# batch (a time-major ``(T, B, C)`` input a convolution reads over time, without
# ``input_batch_dim``). Gathered, the convolution would compute on the whole time axis in
# simulation, and on real ranks, where each rank passes its share of the batch, on the
# ranks' different samples joined along time, silently (a review of the fifty-seventh
# session). There it is kept, and the local shape check refuses the step naming
# ``input_batch_dim``, as before that session. The modes that split arguments say over
# which mesh dimensions (``convolution_spatial_shards_kept``).
# Kept only where the shard is the argument's split still: where the input reads a split
# argument on a path of the per-rank program with no collective on it. A shard DTensor
# moved there itself (an all-to-all: ``aten.index`` of batch rows by indices made in the
# step, ``patches[torch.arange(B), ys, xs]`` of a doubly unfolded image, whose rule moves
# the batch shard to a patch dimension) splits a dimension of the data, not the one the
# mode split, and is gathered like sequence parallelism's (a random crop into a
# ``Conv2d`` was refused naming ``input_batch_dim``, a wrong cause; sixty-eighth session).
# ``convolution_backward`` pairs ``grad_output`` with the input sample by sample, so the
# two must be split over the ranks alike. DTensor's handler redistributes
# ``grad_output`` to the input's placements, but a ``_StridedShard`` reached that way is
# read as a shard order (``use_strided_shard_as_shard_order``), while the input's, made
# by a view (``torch.stack([v1, v2]).flatten(0, 1)``, a video's ``x.transpose(0,
# 1).flatten(0, 1)``), is a plain strided split: equal placements, unequal specs, so
# 2.13's strategy matched neither to the other, chose to replicate all three operands,
# and the handler, dropping that request, ran the kernel on the two local shards and
# called the weight's gradient replicated, with no sum over the ranks. Whenever a
# batch-mixing op (a BatchNorm, ``h - h.mean(0)``, an MSE between the views) left the
# gradient replicated or partial, the weight gradient was one rank's (ddp and fsdp,
# world 2 and 4, simulated and gloo: 1e-2 to 9e-2 off eager after 1 to 3 steps, the
# replicas diverging; found by a probe of vision models in the fifty-eighth session).
# Here ``grad_output`` is laid out as the input first: replicated on the mesh dims the
# input splits with a stride, then cut there with ``_StridedShard``'s own split, and
# given the input's reading. After placing, the strategy the handler will follow must
# ask for no redistribution (the handler would drop it): where it still does, the step
# is refused rather than computed on operands laid out differently.
@dataclasses.dataclass
class _SpatialShardsKept:
    mesh_dims: frozenset[int]
    # the per-rank program's nodes holding the step's split arguments (placeholders)
    split_arguments: set[torch.fx.Node] = dataclasses.field(default_factory=set)


_SPATIAL_SHARDS_KEPT_ON: list[_SpatialShardsKept] = []


@contextlib.contextmanager
def convolution_spatial_shards_kept(mesh_dims: Iterable[int]) -> Iterator[None]:
    """While a data-parallel mode expands its program: a convolution's input sharded on a
    spatial dimension over one of ``mesh_dims``, computed from a split argument with no
    collective between, is kept sharded (and refused by the local shape check), not
    gathered (see the comment above)."""
    _SPATIAL_SHARDS_KEPT_ON.append(_SpatialShardsKept(frozenset(mesh_dims)))
    try:
        yield
    finally:
        _SPATIAL_SHARDS_KEPT_ON.pop()


def split_argument_read(value: DTensor) -> None:
    """Expansion read ``value``, a step argument the mode split: a convolution input
    computed from it with no collective between keeps a spatial shard (NOTE:
    [convolution operands placed first])."""
    node = traced_node_of(local_tensor_of(value)) if _SPATIAL_SHARDS_KEPT_ON else None
    if node is not None:
        _SPATIAL_SHARDS_KEPT_ON[-1].split_arguments.add(node)


def _reads_split_argument_directly(t: DTensor) -> bool:
    """Whether ``t`` is computed from a split argument on a path of the per-rank trace
    with no collective on it (True where the trace does not say)."""
    start = traced_node_of(local_tensor_of(t))
    if start is None or not _SPATIAL_SHARDS_KEPT_ON:
        return True
    arguments = _SPATIAL_SHARDS_KEPT_ON[-1].split_arguments
    seen, todo = {start}, [start]
    while todo:
        node = todo.pop()
        if node in arguments:
            return True
        for parent in node.all_input_nodes:
            if parent not in seen and getattr(parent.target, "namespace", None) != "_c10d_functional":
                seen.add(parent)
                todo.append(parent)
    return False


def _install_convolution_operands_placed() -> None:
    from torch.distributed.tensor import Replicate

    handlers = DTensor._op_dispatcher._custom_op_handlers

    def replicated(t: Any, keep: Callable[[Any, int, DTensor], bool]) -> Any:
        if not isinstance(t, DTensor) or all(keep(p, i, t) for i, p in enumerate(t.placements)):
            return t
        return t.redistribute(
            t.device_mesh, [p if keep(p, i, t) else Replicate() for i, p in enumerate(t.placements)]
        )

    def input_kept(p: Any, mesh_dim: int, t: DTensor) -> bool:
        # Shard(0) or _StridedShard(0) (a batch concatenated from views, NOTE: [batch
        # concatenation] in expand/local_rules.py); 2.13's _StridedShard is no Shard
        if p.is_replicate() or (not p.is_partial() and getattr(p, "dim", None) == 0):
            return True
        spatial = not p.is_partial() and getattr(p, "dim", None) not in (None, 1)
        return (
            spatial and bool(_SPATIAL_SHARDS_KEPT_ON)
            and mesh_dim in _SPATIAL_SHARDS_KEPT_ON[-1].mesh_dims
            and _reads_split_argument_directly(t)
        )

    def is_replicate(p: Any, mesh_dim: int, t: DTensor) -> bool:
        return p.is_replicate()

    def placed(original: Callable[..., Any], input_index: int, bias_index: int | None) -> Callable[..., Any]:
        def handler(op_call: Any, args: tuple, kwargs: dict) -> Any:
            moved = list(args)
            moved[input_index] = replicated(args[input_index], input_kept)
            moved[input_index + 1] = replicated(args[input_index + 1], is_replicate)
            if bias_index is not None:
                moved[bias_index] = replicated(args[bias_index], is_replicate)
            if input_index == 1:  # convolution_backward: grad_output as the input
                moved[0] = _laid_out_as(moved[0], moved[1])
            _refuse_dropped_redistribution(op_call, tuple(moved), kwargs, input_index)
            return original(op_call, tuple(moved), kwargs)

        handler._spmd_operands_placed = True  # type: ignore[attr-defined]
        return handler

    for op, input_index, bias_index in (
        (torch.ops.aten.convolution.default, 0, 2),
        (torch.ops.aten.convolution_backward.default, 1, None),
    ):
        original = handlers.get(op)
        if original is not None and not getattr(original, "_spmd_operands_placed", False):
            handlers[op] = placed(original, input_index, bias_index)


def _laid_out_as(value: Any, like: Any) -> Any:
    """``value`` (a DTensor of ``like``'s leading size) split over the ranks as ``like``
    is, with ``like``'s reading of its ``_StridedShard``s, so that the local rows of the
    two are the same samples (NOTE: [convolution operands placed first])."""
    import torch.distributed.tensor._redistribute as redistribute_module
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    if not (isinstance(value, DTensor) and isinstance(like, DTensor)):
        return value
    spec, target = value._spec, like._spec
    if tuple(spec.placements) == tuple(target.placements) and (
        _strided_as_order(spec) == _strided_as_order(target)
    ):
        return value
    if not any(is_strided_shard(p) for p in target.placements):
        return value.redistribute(like.device_mesh, target.placements)
    # replicated where ``like`` is split with a stride (read back by the reading it was
    # made with), then cut there as a view would cut it
    cleared = tuple(
        Replicate() if is_strided_shard(t) or is_strided_shard(p) else p
        for p, t in zip(spec.placements, target.placements, strict=True)
    )
    if cleared != tuple(spec.placements):
        value = value.redistribute(like.device_mesh, cleared)
    want = DTensorSpec(target.mesh, tuple(target.placements), tensor_meta=value._spec.tensor_meta)
    local, _ = _scatter_strided_shards(
        value._local_tensor, value._spec, want,
        lambda t, a, b: redistribute_module.redistribute_local_tensor(t, a, b),
    )
    reading: dict[str, Any] = {}
    if _strided_as_order(target) is not None:  # torch 2.13 on: how a _StridedShard is read
        reading = {
            "shard_order": None if _strided_as_order(target) else target.shard_order,
            "use_strided_shard_as_shard_order": _strided_as_order(target),
        }
    laid = DTensorSpec(
        target.mesh, tuple(target.placements), tensor_meta=value._spec.tensor_meta, **reading
    )
    return DTensor(local, laid, requires_grad=value.requires_grad)


def _refuse_dropped_redistribution(op_call: Any, args: tuple, kwargs: dict, input_index: int) -> None:
    """Refuse a convolution whose strategy, after the operands were placed, still asks for
    a redistribution: DTensor's handler would drop it and run the kernel on operands laid
    out otherwise (NOTE: [convolution operands placed first]). An input kept sharded
    along a spatial dimension is left to the local shape check, as before."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    dispatcher = DTensor._op_dispatcher
    if input_index == 1 and isinstance(args[0], DTensor) and isinstance(args[1], DTensor):
        # what DTensor's handler does first (a no-op once laid out as the input)
        args = (args[0].redistribute(args[1].device_mesh, args[1].placements), *args[1:])
    op_info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    dispatcher.sharding_propagator.propagate(op_info)
    sharding = op_info.output_sharding
    if sharding is None or not sharding.needs_redistribute:
        return
    specs = [s for s in op_info.flat_args_schema if isinstance(s, DTensorSpec)]
    if any(
        not p.is_partial() and getattr(p, "dim", None) not in (None, 0, 1)
        for s in specs for p in s.placements
    ):
        return  # a spatial shard kept on purpose: the local shape check refuses it
    shown = ", ".join(f"{tuple(s.shape)} {list(s.placements)}" for s in specs)
    raise RuntimeError(
        f"spmd_compiler: {op_call} cannot be computed on these operands as they are split "
        f"over the ranks ({shown}): its rule asks to move them, which DTensor's "
        f"convolution handler would not do, and the result would be silently wrong. "
        f"Build the batch with torch.cat rather than torch.stack(...).flatten, or report "
        f"this with the model."
    )


def _install_convolution_backward_replicated_inputs() -> None:
    """torch 2.11 gap (silent): its only rule for ``convolution_backward`` (a propagation
    rule; 2.13 prefers a strategy that has a replicated case) marks the weight's and the
    bias's gradients ``Partial`` on the first mesh dimension whatever the input's
    placement. With a replicated input (a convolution after an op that gathers the
    batch, such as 2.11's upsampling forward, which replicates) every rank computes the
    whole gradient, which the program then summed over the ranks: a 1x1 convolution head
    after ``F.interpolate(..., mode="bilinear")`` under ddp had gradients twice eager's.
    Here those gradients are ``Partial`` on the mesh dimensions where the input is
    sharded on its batch dimension and ``Replicate`` on the others."""
    from torch.distributed.tensor import Partial, Replicate
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    propagator = DTensor._op_dispatcher.sharding_propagator
    op = torch.ops.aten.convolution_backward.default
    rules = getattr(propagator, "op_to_rules", {})
    strategies = ("op_strategy_funcs", "op_single_dim_strategy_funcs")
    if op not in rules or any(op in getattr(propagator, t, {}) for t in strategies):
        return
    original = rules[op]
    if getattr(original, "_spmd_replicated_inputs", False):
        return

    def rule(op_schema: Any) -> Any:
        sharding = original(op_schema)
        input_spec = op_schema.args_schema[1]
        placements = tuple(
            Partial() if p.is_shard(0) else Replicate() for p in input_spec.placements
        )
        specs = list(sharding.output_spec)
        for k in (1, 2):
            if k < len(specs) and specs[k] is not None:
                specs[k] = DTensorSpec(specs[k].mesh, placements, tensor_meta=specs[k].tensor_meta)
        sharding.output_spec = type(sharding.output_spec)(specs)
        return sharding

    rule._spmd_replicated_inputs = True  # type: ignore[attr-defined]
    rules[op] = rule


def _install_fft_strategies() -> None:
    """Gap on torch 2.11 (2.13 has these rules): no DTensor rule for the FFT kernels
    (``torch.fft.rfft2`` / ``irfft2`` / ``fft``: ``_fft_r2c``, ``_fft_c2r``, ``_fft_c2c``;
    a Fourier neural operator was refused). Each transforms the dimensions in its ``dim``
    argument and treats every other index alike, and is linear: replicated; sharded on a
    dimension it does not transform (the output keeps the dimension); a ``Partial``
    input to a ``Partial`` output."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    def rule(x: Any, dim: Any, *rest: Any) -> list[tuple[list, list]]:
        extra: list[Any] = [None] * len(rest)
        transformed = {d % len(x.shape) for d in dim}
        out: list[tuple[list, list]] = [([Replicate()], [Replicate(), None, *extra]),
                                        ([Partial()], [Partial(), None, *extra])]
        out += [([Shard(d)], [Shard(d), None, *extra])
                for d in range(len(x.shape)) if d not in transformed]
        return out

    for op in (torch.ops.aten._fft_r2c.default, torch.ops.aten._fft_c2r.default,
               torch.ops.aten._fft_c2c.default):
        if not _has_sharding_strategy(op):
            register_sharding_keyed(op, rule)


# NOTE: [integer sums made partial]
# Adding a replicated value to a pending sum (a counter buffer, replicated, plus a count
# over the batch, ``model.tokens += (y >= 0).sum()``: a Partial(sum) under data
# parallelism) makes the replicated operand partial too: DTensor's
# ``Partial._partition_value`` hands each rank ``v / n``, so that the ranks' parts sum
# to ``v``. On an integer tensor that is true division: a float32 part, and the sum, the
# counter and the gradient bucket it was packed in all float32 (an int64 token count
# 2**40 + 25 came back as the float 2**40, 25 off, after 3 steps; an int32 per-class
# count as floats; indexing with it failed the next step; found in the fifty-fourth
# session, torch 2.11 to 2.14). For integer and bool tensors the value is given whole
# to the rank at coordinate 0 and zeros to the others, which sums to ``v`` exactly in
# the value's own dtype; floating values keep torch's ``v / n``.
def _install_integer_sum_partition() -> None:
    """NOTE: [integer sums made partial]; idempotent."""
    from torch.distributed.tensor import Partial

    original = Partial._partition_value
    if getattr(original, "_spmd_integer_sum", False):
        return

    def partition_value(self: Any, tensor: torch.Tensor, mesh: Any, mesh_dim: int) -> torch.Tensor:
        if self.reduce_op != "sum" or tensor.is_floating_point() or tensor.is_complex():
            return original(self, tensor, mesh, mesh_dim)
        n = mesh.size(mesh_dim=mesh_dim)
        coordinate = mesh._sym_get_coordinate(mesh_dim)
        if isinstance(coordinate, int):
            return tensor.clone() if coordinate == 0 else torch.zeros_like(tensor)
        # a traced coordinate (one program for every rank): rank r takes row r of
        # [v, 0, ..., 0]
        rows = torch.stack([tensor] + [torch.zeros_like(tensor)] * (n - 1))
        return rows.narrow(0, coordinate, 1).squeeze(0)

    partition_value._spmd_integer_sum = True  # type: ignore[attr-defined]
    Partial._partition_value = partition_value  # type: ignore[method-assign]


def _install_copy_strategy() -> None:
    """Gap on torch 2.11 to 2.14: no DTensor rule for the out-of-place ``aten.copy``
    (``F.affine_grid``'s decomposition fills its base grid with it, after functionalize).
    The result is ``src`` broadcast into ``self``'s shape and dtype: replicated from
    replicated inputs, or sharded alike where the two have one shape."""
    from torch.distributed.tensor import Replicate, Shard

    op = torch.ops.aten.copy.default
    if _has_sharding_strategy(op):
        return

    def rule(target: Any, source: Any, *rest: Any) -> list[tuple[list, list]]:
        extra: list[Any] = [None] * len(rest)
        out: list[tuple[list, list]] = [([Replicate()], [Replicate(), Replicate(), *extra])]
        if tuple(target.shape) == tuple(source.shape):
            out += [([Shard(d)], [Shard(d), Shard(d), *extra]) for d in range(len(target.shape))]
        return out

    register_sharding_keyed(op, rule)


def _install_fake_quantize_strategies() -> None:
    """Gap on every supported torch: no DTensor rule for the fake-quantize kernels of
    hand-written quantization-aware training (``torch.fake_quantize_per_tensor_affine``
    traces as ``fake_quantize_per_tensor_affine_cachemask``, with tensor qparams as
    ``_fake_quantize_per_tensor_affine_cachemask_tensor_qparams``,
    ``torch.fake_quantize_per_channel_affine`` as ``fake_quantize_per_channel_affine_cachemask``;
    both were refused at expansion). Each element's output and mask depend on that element
    and its channel's (or the tensor's one) scale and zero point only, and rounding is not
    linear: ``self`` replicated or sharded on any dim, outputs and mask sharded alike; the
    per-tensor qparams (and the enabled flag) replicated; the per-channel scale and zero
    point (one per index of ``axis``) sharded on their dim 0 where ``self`` is sharded on
    ``axis``, else replicated. No ``Partial``: a sum of rounded parts is not the rounded
    sum. (The backward, ``grad * mask``, is traced as its ops.)"""
    from torch.distributed.tensor import Replicate, Shard

    aten = torch.ops.aten
    R: Any = Replicate()

    def per_tensor(x: Any, scale: Any, zero_point: Any, enabled: Any, *rest: Any) -> list[tuple[list, list]]:
        extra: list[Any] = [None] * len(rest)
        out: list[tuple[list, list]] = [([R, R], [R, R, R, R, *extra])]
        out += [([Shard(d), Shard(d)], [Shard(d), R, R, R, *extra]) for d in range(len(x.shape))]
        return out

    def per_tensor_numbers(x: Any, *rest: Any) -> list[tuple[list, list]]:
        extra: list[Any] = [None] * len(rest)  # scale, zero point and range as Python numbers
        return [([R, R], [R, *extra])] + [([Shard(d), Shard(d)], [Shard(d), *extra]) for d in range(len(x.shape))]

    def per_channel(x: Any, scale: Any, zero_point: Any, axis: int, *rest: Any) -> list[tuple[list, list]]:
        extra: list[Any] = [None] * len(rest)
        axis %= len(x.shape)
        out: list[tuple[list, list]] = [([R, R], [R, R, R, None, *extra])]
        for d in range(len(x.shape)):
            qparams = Shard(0) if d == axis else R
            out.append(([Shard(d), Shard(d)], [Shard(d), qparams, qparams, None, *extra]))
        return out

    for op, rule in (
        (aten.fake_quantize_per_tensor_affine_cachemask.default, per_tensor_numbers),
        (aten._fake_quantize_per_tensor_affine_cachemask_tensor_qparams.default, per_tensor),
        (aten.fake_quantize_per_channel_affine_cachemask.default, per_channel),
    ):
        if not _has_sharding_strategy(op):
            register_sharding_keyed(op, rule)


def _install_distance_strategies() -> None:
    """Gap on every supported torch: no DTensor rule for ``_cdist_forward`` /
    ``_cdist_backward`` (``torch.cdist`` below 25 rows a side, or with ``p != 2``) nor for
    ``_pdist_forward`` / ``_pdist_backward`` (``F.pdist``).

    ``cdist(x1 [..., P, M], x2 [..., R, M]) -> [..., P, R]``: replicated; sharded alike
    on a leading (batch) dimension both inputs have at one size; x1's rows sharded with
    x2 replicated (output rows); x2's rows sharded with x1 replicated (output columns).
    Its backward (the gradient of x1 only; torch calls it again with the operands
    swapped for x2): the same layouts, where x2's rows sharded give a ``Partial`` sum
    over them; and, linear in the incoming gradient, a ``Partial`` gradient with every
    other tensor replicated. ``pdist`` pairs every row with every other: replicated only
    (its backward also maps a ``Partial`` gradient to a ``Partial`` result)."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    aten = torch.ops.aten
    R: Any = Replicate()

    def batch_dims(x1: Any, x2: Any) -> list[int]:
        lead = len(x1.shape) - 2
        if len(x2.shape) - 2 != lead:
            return []
        return [d for d in range(lead) if x1.shape[d] == x2.shape[d]]

    # rows and columns of the output are its last two dims: with batch dims broadcast
    # from inputs of different ranks (``cdist(x [P, M], c [1, R, M])``) not x1's rows dim.
    # Before 2026-12-02 the output took x1's (a learned query against a batch of point
    # sets lost 6.46 where one device gives 7.44, silently, where the wrong dim had size 1)
    def forward(x1: Any, x2: Any, *rest: Any) -> list[tuple[list, list]]:
        extra: list[Any] = [None] * len(rest)
        rows, columns = len(x1.shape) - 2, len(x2.shape) - 2
        out_rows = max(len(x1.shape), len(x2.shape)) - 2
        out: list[tuple[list, list]] = [([R], [R, R, *extra])]
        out += [([Shard(d)], [Shard(d), Shard(d), *extra]) for d in batch_dims(x1, x2)]
        out += [
            ([Shard(out_rows)], [Shard(rows), R, *extra]),
            ([Shard(out_rows + 1)], [R, Shard(columns), *extra]),
        ]
        return out

    def backward(grad: Any, x1: Any, x2: Any, p: Any, cdist: Any) -> list[tuple[list, list]]:
        rows, columns = len(x1.shape) - 2, len(x2.shape) - 2
        out_rows = len(grad.shape) - 2
        out: list[tuple[list, list]] = [([R], [R, R, R, None, R]), ([Partial()], [Partial(), R, R, None, R])]
        out += [([Shard(d)], [Shard(d), Shard(d), Shard(d), None, Shard(d)]) for d in batch_dims(x1, x2)]
        out += [
            ([Shard(rows)], [Shard(out_rows), Shard(rows), R, None, Shard(out_rows)]),
            ([Partial()], [Shard(out_rows + 1), R, Shard(columns), None, Shard(out_rows + 1)]),
        ]
        return out

    def pdist(x: Any, *rest: Any) -> list[tuple[list, list]]:
        return [([R], [R, *([None] * len(rest))])]

    def pdist_backward(grad: Any, x: Any, p: Any, result: Any) -> list[tuple[list, list]]:
        return [([R], [R, R, None, R]), ([Partial()], [Partial(), R, None, R])]

    for op, rule in (
        (aten._cdist_forward.default, forward), (aten._cdist_backward.default, backward),
        (aten._pdist_forward.default, pdist), (aten._pdist_backward.default, pdist_backward),
    ):
        if not _has_sharding_strategy(op):
            register_sharding_keyed(op, rule)


def _install_along_dim_strategies() -> None:
    """Gap on every supported torch: no DTensor rule for ``cumprod_backward``
    (``torch.cumprod`` under autograd) nor ``scatter_reduce.two`` (``Tensor.scatter_reduce``,
    GNN-style message aggregation). Each works along one dimension ``dim`` of tensors
    that match elsewhere: every tensor replicated, or every tensor sharded alike on another
    dimension where their sizes agree; ``cumprod_backward``, linear in its incoming
    gradient, also maps a ``Partial`` gradient (others replicated) to a ``Partial``
    result."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    aten = torch.ops.aten

    def rule_for(dim_at: int, linear: bool) -> Callable[..., list[tuple[list, list]]]:
        def rule(*args: Any, **kwargs: Any) -> list[tuple[list, list]]:
            tensors = [a for a in args if hasattr(a, "shape")]
            ndim = len(tensors[0].shape)
            dim = args[dim_at] % ndim if ndim else 0

            def alike(placement: Any, first: Any = None) -> tuple[list, list]:
                ins = [
                    (first if i == 0 and first is not None else placement) if hasattr(a, "shape") else None
                    for i, a in enumerate(args)
                ]
                return [first or placement], ins

            out = [alike(Replicate())]
            out += [
                alike(Shard(d)) for d in range(ndim)
                if d != dim and len({t.shape[d] for t in tensors}) == 1
                and all(len(t.shape) == ndim for t in tensors)
            ]
            if linear:
                out.append(alike(Replicate(), Partial()))
            return out

        return rule

    for op, dim_at, linear in (
        (aten.cumprod_backward.default, 2, True),  # (grad, input, dim, output)
        (aten.scatter_reduce.two, 1, False),  # (self, dim, index, src, reduce, include_self)
    ):
        if not _has_sharding_strategy(op):
            register_sharding_keyed(op, rule_for(dim_at, linear))


def _install_block_diag_strategy() -> None:
    """Gap on every supported torch: no DTensor rule for ``block_diag`` (peft's BOFT
    builds its rotation with ``torch.block_diag(*blocks)``), so a step using it was
    refused in every mode, ddp included, where every input is replicated ("Operator
    aten.block_diag.default does not have a sharding strategy registered"). Here: every
    input replicated, the output replicated (a sharded or ``Partial`` input is gathered
    first). Its backward slices the output's gradient (``block_diag_backward``: ``narrow``
    ops, which have rules), so needs none."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._op_schema import OpSpec, OpStrategy, RuntimeSchemaInfo
    from torch.distributed.tensor._ops.utils import (
        generate_redistribute_costs,
        register_op_strategy,
    )

    op = torch.ops.aten.block_diag.default
    if _has_sharding_strategy(op):
        return

    def strategy(op_schema: Any) -> Any:
        children = list(op_schema.args_schema[0].children)
        mesh = children[0].mesh
        replicated = (Replicate(),) * mesh.ndim
        inputs = tuple(
            DTensorSpec(mesh, replicated, tensor_meta=c.strategies[0].output_spec.tensor_meta) for c in children
        )
        return OpStrategy([OpSpec(
            output_specs=DTensorSpec(mesh, replicated), input_specs=inputs,
            redistribute_cost=[generate_redistribute_costs(c, spec) for c, spec in zip(children, inputs)],
        )])

    register_op_strategy(op, schema_info=RuntimeSchemaInfo(needs_pytree=True))(strategy)
    cached = getattr(DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding, "cache_clear", None)
    if cached is not None:
        cached()


def _install_linalg_batch_rows() -> None:
    """Every torch with DTensor's single-dim rule for the batched linalg ops (2.13's
    ``linalg_batch_dim_strategy``): its layouts that shard are replaced by ours, which
    align each operand's batch dimensions from the right (NOTE: [linalg batch
    dimensions] in linalg_batches.py); its replicated and ``Partial`` layouts are kept.
    ``linalg.solve_triangular(L, r)`` with a per-sample L (B, D, D) was refused under ddp
    and fsdp ("Attempting to broadcast a dimension of length 8"): torch offered a
    replicated L against a sharded r."""
    import dataclasses

    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._dtensor_spec import TensorMeta

    from .linalg_batches import batch_shard_rows, knows

    try:  # a torch without single-dim rules has no such rule to replace
        from torch.distributed.tensor._ops.single_dim_strategy import _ShardingPlaceholder
    except ImportError:
        return

    table = getattr(DTensor._op_dispatcher.sharding_propagator, "op_single_dim_strategy_funcs", {})

    def ours(original: Callable[..., list[list[Any]]]) -> Callable[..., list[list[Any]]]:
        def strategy(op: Any, args_schema: tuple, kwargs_schema: dict) -> list[list[Any]]:
            offered = original(op, args_schema, kwargs_schema)
            kept = [row for row in offered if not any(isinstance(p, _ShardingPlaceholder) for p in row)]
            shapes = [tuple(a.shape) for a in args_schema if isinstance(a, TensorMeta)]
            skipped: list[int] = []
            if op is torch.ops.aten.lu_unpack.default:  # (LU, pivots, unpack_data, unpack_pivots)
                flags = [*args_schema[2:4], True, True]
                skipped = ([1, 2] if flags[0] is False else []) + ([0] if flags[1] is False else [])
            rows = batch_shard_rows(str(op), shapes, skipped) or []
            return kept + [
                [Replicate() if d is None else _ShardingPlaceholder(d) for d in row] for row in rows
            ]

        strategy._spmd_linalg_batches = True  # type: ignore[attr-defined]
        return strategy

    for op, info in list(table.items()):
        func = getattr(info, "func", None)
        if not knows(str(op)) or func is None or getattr(func, "_spmd_linalg_batches", False):
            continue
        table[op] = dataclasses.replace(info, func=ours(func))
    cached = getattr(DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding, "cache_clear", None)
    if cached is not None:
        cached()


def _div_denominator_partial_gap() -> bool:
    """Whether this DTensor lets a ``Partial`` denominator through ``div.Tensor`` (its
    linearity table calls division multiplicative in both arguments)."""
    try:
        from torch.distributed.tensor._ops import _pointwise_ops as pointwise
    except ImportError:
        return False
    table = getattr(pointwise, "linear_pointwise_ops", None)
    return isinstance(table, dict) and table.get(torch.ops.aten.div.Tensor) == 2


def _install_div_numerator_partials_only() -> None:
    """torch 2.11 gap (silent): its pointwise rule treats ``div.Tensor`` like ``mul``,
    offering ``Partial / Partial`` results for a ``Partial`` denominator with a replicated
    numerator: ``a / (b1 + b2)`` computed as ``a / b1 + a / b2``. The backward of a full
    ``amax()`` divides by the count of maxima, a ``Partial``: ``h / h.abs().amax()``
    under data parallelism made the parameters NaN (a rank without the maximum divided
    by 0). Here the rule offers only the layouts whose denominator is not ``Partial``
    (as torch 2.13's: "div: only through numerator")."""
    from torch.distributed.tensor._op_schema import OpStrategy, RuntimeSchemaInfo
    from torch.distributed.tensor._ops import _pointwise_ops as pointwise
    from torch.distributed.tensor._ops.utils import register_op_strategy

    pointwise_strategy = getattr(pointwise, "pointwise_strategy")  # noqa: B009 - 2.11's name

    def strategy(op_schema: Any) -> Any:
        offered = pointwise_strategy(op_schema, linearity=2)
        kept = [
            s for s in offered.strategies
            if len(s.input_specs) < 2 or not any(p.is_partial() for p in s.input_specs[1].placements)
        ]
        return OpStrategy(kept) if kept else pointwise_strategy(op_schema)

    for op in (torch.ops.aten.div.Tensor, torch.ops.aten.div_.Tensor):
        register_op_strategy(op, schema_info=RuntimeSchemaInfo(static_kwargkey=["out"]))(strategy)
    cached = getattr(DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding, "cache_clear", None)
    if cached is not None:
        cached()


def _index_put_leading_dims_gap() -> bool:
    """Whether this DTensor's ``index_put`` rule is torch 2.11's ``prop_index_put``, which
    assumes ``values`` has only the non-indexed dims of ``self`` (2.13 replaced it)."""
    from torch.distributed.tensor._ops import _tensor_ops

    return hasattr(_tensor_ops, "prop_index_put") and not hasattr(
        _tensor_ops, "index_put_single_dim_strategy"
    )


def _install_index_put_checked_strategy() -> None:
    """torch 2.11 gap: its ``index_put`` rule shards ``self`` and ``values`` alike on the
    indexed dimension when ``values`` has as many dimensions as ``self`` (the backward of
    ``x[idx]``: ``index_put(zeros, [idx], grad)``, 1-D ``idx``): each rank wrote its local
    rows at global positions ("value tensor of shape [4, 3] cannot be broadcast to
    indexing result of shape [8, 3]"; silent where a local size of 1 broadcasts). Here
    its layouts are kept only where ``self`` is sharded on a dimension no index reads and
    ``values`` on the matching dimension (as torch 2.13's rule maps them), else
    everything replicated."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._op_schema import OpSpec, OpStrategy, RuntimeSchemaInfo
    from torch.distributed.tensor._ops import _tensor_ops
    from torch.distributed.tensor._ops.utils import (
        generate_redistribute_costs,
        register_op_strategy,
    )

    original = getattr(_tensor_ops, "prop_index_put")  # noqa: B009 - 2.11 only

    def values_dim(self_dim: int, n_indexed: int, broadcast_ndim: int, values_ndim: int, self_ndim: int) -> int:
        result_ndim = broadcast_ndim + self_ndim - n_indexed
        return self_dim - n_indexed + broadcast_ndim - (result_ndim - values_ndim)

    def strategy(op_schema: Any) -> Any:
        in_strategy, indices, values_strategy = op_schema.args_schema[:3]
        self_meta = in_strategy.strategies[0].output_spec.tensor_meta
        values_meta = values_strategy.strategies[0].output_spec.tensor_meta
        index_shapes = [c.strategies[0].output_spec.tensor_meta.shape for c in indices.children]
        n_indexed, self_ndim, values_ndim = len(index_shapes), len(self_meta.shape), len(values_meta.shape)
        broadcast_ndim = len(torch.broadcast_shapes(*index_shapes)) if index_shapes else 0

        def valid(spec: Any) -> bool:
            ins, vals = spec.input_specs[0].placements, spec.input_specs[-1].placements
            for p_in, p_val in zip(ins, vals, strict=True):
                if isinstance(p_in, Replicate) and isinstance(p_val, Replicate):
                    continue
                if not (isinstance(p_in, Shard) and isinstance(p_val, Shard)) or p_in.dim < n_indexed:
                    return False
                want = values_dim(p_in.dim, n_indexed, broadcast_ndim, values_ndim, self_ndim)
                if want < 0 or p_val.dim != want or values_meta.shape[want] == 1:
                    return False
            return True

        offered = original(op_schema)
        kept = [spec for spec in offered.strategies if valid(spec)]
        if not kept:
            mesh = values_strategy.mesh
            replicated = (Replicate(),) * mesh.ndim

            def spec_of(strategy_: Any) -> Any:
                meta = strategy_.strategies[0].output_spec.tensor_meta
                return DTensorSpec(mesh=mesh, placements=replicated, tensor_meta=meta)

            inputs = [spec_of(in_strategy), *[spec_of(c) for c in indices.children], spec_of(values_strategy)]
            sources = [in_strategy, *indices.children, values_strategy]
            kept = [OpSpec(
                output_specs=inputs[0], input_specs=tuple(inputs),
                redistribute_cost=[generate_redistribute_costs(src, dst) for src, dst in zip(sources, inputs)],
            )]
        return OpStrategy(kept)

    ops = [torch.ops.aten.index_put.default, torch.ops.aten._index_put_impl_.default]
    register_op_strategy(ops, schema_info=RuntimeSchemaInfo(needs_pytree=True))(strategy)
    cached = getattr(DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding, "cache_clear", None)
    if cached is not None:
        cached()


def _constant_pad_replicates_only_gap() -> bool:
    """Whether this DTensor's ``constant_pad_nd`` rule is torch 2.11's
    ``constant_pad_nd_strategy`` (2.13 replaced it by a single-dim strategy)."""
    from torch.distributed.tensor._ops import _matrix_ops

    rule = getattr(_matrix_ops, "constant_pad_nd_strategy", None)
    propagator = DTensor._op_dispatcher.sharding_propagator
    registered = propagator.op_strategy_funcs.get(torch.ops.aten.constant_pad_nd.default)
    return rule is not None and registered is rule


def _install_constant_pad_strategy() -> None:
    """torch 2.11 gap: its ``constant_pad_nd`` rule offers one replicated layout with one
    placement whatever the mesh, so on a 2-D mesh (fsdp_tp) expansion failed ("zip()
    argument 2 is shorter than argument 1"): ``F.pad(labels, (0, 1), value=-100)`` in
    transformers' ``ForCausalLMLoss`` kept every causal LM with ``labels=`` from training
    there. Here, as torch 2.13's rule: a shard on a dimension the pad leaves alone is kept
    (the output has that dimension's size), a shard on a padded dimension (or a
    ``_StridedShard``) is gathered first; a ``Partial`` stays ``Partial`` where every
    rank's pad value reduces to the value (avg, max, min; sum only for a pad value of 0
    or no padding), else it is reduced first."""
    from torch.distributed.tensor import Partial, Replicate
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._op_schema import OpSpec, OpStrategy, RuntimeSchemaInfo
    from torch.distributed.tensor._ops.utils import (
        generate_redistribute_costs,
        register_op_strategy,
    )

    def zero(value: Any) -> bool:
        return isinstance(value, (int, float)) and value == 0

    def strategy(op_schema: Any) -> Any:
        source, pad = op_schema.args_schema[0], list(op_schema.args_schema[1])
        value = op_schema.args_schema[2] if len(op_schema.args_schema) > 2 else 0
        ndim = source.ndim
        # pad is (last dim's left, right, the dim before's left, right, ...)
        padded = {ndim - 1 - i // 2 for i, amount in enumerate(pad) if not zero(amount)}
        partial_ops = {"avg", "max", "min"} | ({"sum"} if not padded or zero(value) else set())

        def kept(p: Any) -> bool:
            if is_strided_shard(p):
                return False
            if p.is_shard():
                return p.dim not in padded
            # a subclass (an embedding's _MaskPartial) holds state of the input's shape
            return not p.is_partial() or (type(p) is Partial and p.reduce_op in partial_ops)

        result = OpStrategy([])
        for candidate in source.strategies:
            spec = candidate.output_spec
            wanted = tuple(p if kept(p) else Replicate() for p in spec.placements)
            target = DTensorSpec(spec.mesh, wanted, tensor_meta=spec.tensor_meta)
            result.strategies.append(OpSpec(
                output_specs=DTensorSpec(spec.mesh, wanted),
                input_specs=(target,),
                redistribute_cost=[generate_redistribute_costs(source, target)],
            ))
        return result

    register_op_strategy(torch.ops.aten.constant_pad_nd.default, schema_info=RuntimeSchemaInfo(1))(strategy)
    cached = getattr(DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding, "cache_clear", None)
    if cached is not None:
        cached()


def _install_searchsorted_strategy() -> None:
    """Gap on every supported torch: no DTensor rule for ``searchsorted``
    (``torch.searchsorted(boundaries, values)``). With one 1-D sorted sequence, each value
    is looked up alone: the result is placed like the values (replicated or sharded on any
    dimension), the sequence (and its ``sorter``) replicated. With a batch of sequences
    (leading dimensions matching the values'): all replicated, or sharded alike on a
    leading dimension."""
    from torch.distributed.tensor import Replicate, Shard

    op = torch.ops.aten.searchsorted.Tensor
    if _has_sharding_strategy(op):
        return

    def rule(sequence: Any, values: Any, *rest: Any, **kwargs: Any) -> list[tuple[list, list]]:
        sorter = kwargs.get("sorter")
        extra: list[Any] = [None] * len(rest)

        def ins(seq: Any, vals: Any) -> list[Any]:
            return [seq, vals, *extra] + ([seq] if sorter is not None else [])

        out: list[tuple[list, list]] = [([Replicate()], ins(Replicate(), Replicate()))]
        if len(sequence.shape) == 1:
            out += [([Shard(d)], ins(Replicate(), Shard(d))) for d in range(len(values.shape))]
        else:
            out += [([Shard(d)], ins(Shard(d), Shard(d))) for d in range(len(sequence.shape) - 1)]
        return out

    register_sharding_keyed(op, rule)


def _register_dim_strategy(op: Any, dims_of: Callable, outputs: int, linear: bool, reduces: bool) -> None:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._op_schema import OpSpec, OpStrategy, RuntimeSchemaInfo
    from torch.distributed.tensor._ops.utils import (
        generate_redistribute_costs,
        register_op_strategy,
    )

    def strategy(op_schema: Any) -> Any:
        source = op_schema.args_schema[0]
        ndim = source.ndim
        dims = {d % ndim if ndim else 0 for d in dims_of(op_schema.args_schema, ndim)}
        keepdim = bool(op_schema.kwargs_schema.get("keepdim", False))
        result = OpStrategy([])
        for candidate in source.strategies:
            spec = candidate.output_spec
            wanted = tuple(
                Replicate()
                if is_strided_shard(p)
                or (p.is_shard() and p.dim in dims)
                or (p.is_partial() and not linear)
                else p
                for p in spec.placements
            )
            target = DTensorSpec(spec.mesh, wanted, tensor_meta=spec.tensor_meta)
            out = DTensorSpec(spec.mesh, _after_reduction(wanted, dims, reduces and not keepdim))
            result.strategies.append(
                OpSpec(
                    output_specs=out if outputs == 1 else (out,) * outputs,
                    input_specs=(target,),
                    redistribute_cost=[generate_redistribute_costs(source, target)],
                )
            )
        return result

    register_op_strategy(op, schema_info=RuntimeSchemaInfo(1, ["keepdim"]))(strategy)


def _after_reduction(placements: tuple, dims: set[int], removes: bool) -> tuple:
    """Shard dims renumbered after the reduced ``dims`` are removed (keepdim=False)."""
    from torch.distributed.tensor import Shard

    if not removes:
        return placements
    return tuple(
        Shard(p.dim - sum(d < p.dim for d in dims)) if p.is_shard() else p for p in placements
    )


def _norm_backward_follows_statistics(args: tuple) -> tuple:
    """``native_layer_norm_backward(grad_out, input, shape, mean, rstd, ...)`` with the
    input and grad_out in the placement of the saved mean and rstd.

    NOTE: [norm backward in its forward's layout]
    torch 2.11 gap: its rule takes grad_out's and input's placement from the input and uses
    mean and rstd as they are ("they should match"); when the forward redistributed its
    input (sequence parallel: a replicated embedding sum into Shard(1)), the backward gets
    a replicated input next to sharded statistics and fails on shapes. Redistributing the
    two to the statistics' placement is what 2.13's rule chooses for them.
    All releases: under tensor parallelism the gradient reaching a norm is a partial sum
    over tp (the colwise q/k/v or fc_in input gradients). torch 2.13 and 2.14 price
    reducing it onto a shard below an all-reduce, so the norm's backward reduce-scattered
    it onto the batch, which the mesh's dp dimension already splits: from there on tp
    split the batch instead of the heads, down to the weight gradients (replicated on tp)
    and AdamW, which then gathered every colwise parameter and its state over both mesh
    dimensions each step (the demo GPT's fsdp_tp 2x2 program: 39 collectives, 22 of them
    all-gathers over tp, 4,131,080 bytes per step). The partial gradient is reduced
    into the statistics' layout instead, where the forward computed the norm (one
    all-reduce; under sequence parallelism a reduce-scatter onto the sequence): the same
    program on 2.11, 2.13 and 2.14, 13 collectives and 1,225,224 bytes per step.
    """
    grad_out, inp, mean = args[0], args[1], args[3]
    if not all(isinstance(a, DTensor) for a in (grad_out, inp, mean)):
        return args
    wanted = tuple(mean.placements)
    if all(tuple(a.placements) == wanted for a in (grad_out, inp)) or any(p.is_partial() for p in wanted):
        return args
    moved = [a if tuple(a.placements) == wanted else a.redistribute(a.device_mesh, wanted) for a in (grad_out, inp)]
    return (moved[0], moved[1], *args[2:])


@functools.cache
def decompositions_without_sharding_rules() -> dict[Any, Callable[..., Any]]:
    """torch's decompositions of the ATen ops this torch's DTensor has no rule for (after
    our fills), nor a handler of its own: NOTE: [ops without a sharding rule] in
    capture/trace.py. Computed once per process; callers copy before changing it."""
    from torch._decomp import decomposition_table

    install_dtensor_gap_fills()
    handled = DTensor._op_dispatcher._custom_op_handlers
    return {
        op: fn
        for op, fn in decomposition_table.items()
        if isinstance(op, torch._ops.OpOverload)
        and op.namespace == "aten"
        and op not in handled
        and not _has_sharding_strategy(op)
        and not op._schema.is_mutable
        and not any(r.alias_info is not None for r in op._schema.returns)
        and any(str(a.type).startswith("Tensor") for a in op._schema.arguments)
        and not set(op.tags) & _UNDECOMPOSED_TAGS
        and str(op) not in _UNDECOMPOSED_OPS
        and not is_composite_implicit(op)
    }


def is_composite_implicit(op: torch._ops.OpOverload) -> bool:
    """An op autograd decomposes with its own C++ kernel (``nll_loss``, ``var.dim``,
    ``upsample_bilinear2d.vec``, ...): traced as its parts, except under inference mode,
    where it reaches make_fx as itself and must not meet torch's Python reference of it
    (NOTE: [inference mode in the step] in capture/trace.py)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")


# Never decomposed by decompositions_without_sharding_rules: random ops (NOTE: [random
# numbers] traces them its own way), ops whose output depends on values (refused at
# capture with their own message), and factories (no tensor argument: no DTensor rule
# is consulted; expansion makes them Replicate or local, NOTE: [tensor constants]).
_UNDECOMPOSED_TAGS = {
    torch.Tag.nondeterministic_seeded, torch.Tag.data_dependent_output,
    torch.Tag.dynamic_output_shape,
}


# metadata and value-reading ops that reach no kernel, and ``zero`` (kept as traced, as
# before this table existed: its decomposition is a fill, not needed by any case seen)
_UNDECOMPOSED_OPS = {
    "aten.where.default", "aten.lift.default", "aten.sym_numel.default",
    "aten.is_complex.default", "aten.resize_as.default", "aten.zero.default",
}


def decompositions(ops: list[Any]) -> dict[Any, Callable[..., Any]]:
    """torch's registered decompositions of ``ops`` (``torch._decomp``)."""
    from torch._decomp import get_decompositions

    return get_decompositions(ops)


def aten_nn_bindings() -> Any:
    """``torch._C._nn``: where torch's C++ bindings of ``torch.nn.functional`` ops live
    (capture patches ``scaled_dot_product_attention`` there too)."""
    return torch._C._nn


def functional_collective_ops() -> Any:
    """The ``_c10d_functional`` op namespace: the collectives the per-rank program holds."""
    return torch.ops._c10d_functional


def process_group_size(group_name: object) -> int | None:
    """How many ranks the process group registered as ``group_name`` spans (the name a
    folded program's functional collectives carry, NOTE: [lowering]); None when the name
    is not a registered group's."""
    if not isinstance(group_name, str):
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        return int(_resolve_process_group(group_name).size())  # type: ignore[arg-type]
    except (RuntimeError, ValueError, KeyError):
        return None


def dispatch_mode_base() -> type:
    """``TorchDispatchMode``: the base of a mode that sees every ATen op as it runs
    (the benchmarks count an eager step's collectives with one)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


_MODULE_HOOK_DICTS = (
    "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
)


def step_hooks(modules: list[torch.nn.Module], optimizers: list[Any]) -> list[tuple[str, Any]]:
    """Every hook a captured step would run: torch's global module and optimizer hooks,
    each module's forward / backward hooks, each parameter's gradient hooks and each
    optimizer's step hooks, as ``(where, hook)`` (for the pre-capture cache key)."""
    import torch.nn.modules.module as module_module
    import torch.optim.optimizer as optimizer_module

    found: list[tuple[str, Any]] = []
    for name in ("_global_backward_pre_hooks", "_global_backward_hooks",
                 "_global_forward_pre_hooks", "_global_forward_hooks"):
        found += [(name, h) for h in getattr(module_module, name, {}).values()]
    for name in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks"):
        found += [(name, h) for h in getattr(optimizer_module, name, {}).values()]
    for mi, root in enumerate(modules):
        for fqn, mod in root.named_modules(remove_duplicate=False):
            for name in _MODULE_HOOK_DICTS:
                found += [(f"{mi}.{fqn}.{name}", h) for h in getattr(mod, name, {}).values()]
        for fqn, p in root.named_parameters(remove_duplicate=False):
            for name in ("_backward_hooks", "_post_accumulate_grad_hooks"):
                found += [(f"{mi}.{fqn}.{name}", h) for h in (getattr(p, name, None) or {}).values()]
    for oi, opt in enumerate(optimizers):
        for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks"):
            found += [(f"optimizer{oi}.{name}", h) for h in getattr(opt, name, {}).values()]
    return found


def treespec_text(spec: Any) -> str:
    """A pytree spec as text (``treespec_dumps``); raises for types without a
    serialized name (the caller treats that as not cacheable)."""
    return pytree.treespec_dumps(spec)


def treespec_from_text(text: str) -> Any:
    return pytree.treespec_loads(text)


def register_device_mesh_ops() -> None:
    """Register ``torch.ops.device_mesh`` (the run-time mesh coordinate), which torch does
    on the first trace that needs it: a program loaded from the compile cache calls it
    before anything was traced."""
    import importlib

    try:
        importlib.import_module("torch.distributed._ops.device_mesh")
    except ImportError:  # a release without it: its programs do not hold the op either
        pass


# NOTE: [grouped_mm's fake kernel]
# ``torch._grouped_mm`` (``F.grouped_mm``: a mixture of experts' matmul over tokens sorted
# by expert, transformers' default experts implementation) has kernels for float32,
# float16 and bfloat16 (CPU; CUDA's falls back to a loop of matmuls off bfloat16), but its
# fake kernel mirrors only CUDA's fast path and accepts bfloat16 alone: a float32 model
# that runs eagerly could not be traced ("Expected inputs of BF16 type"). Where this torch
# has that gap, the fake kernel accepts what the kernels accept, with their checks
# (dimensions, offsets, 16-byte aligned strides), and makes the output as torch's own
# fake kernel shapes it; bfloat16 goes to torch's kernel unchanged. Other dtypes (float64:
# no kernel runs it) are refused with the kernels' message.

_GROUPED_MM_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _grouped_mm_fake_dtype_gap() -> bool:
    """Whether torch's fake ``_grouped_mm`` refuses float32 where its CPU kernel runs it."""
    op = getattr(torch.ops.aten, "_grouped_mm", None)
    if op is None:
        return False
    from torch._subclasses import fake_impls

    if op.default in getattr(fake_impls, "op_implementations_dict", {}):
        return False

    def grouped_mm(device: str) -> None:
        offs = torch.tensor([4, 8], dtype=torch.int32, device=device)
        torch._grouped_mm(torch.ones(8, 4, device=device), torch.ones(2, 4, 4, device=device), offs=offs)

    try:
        grouped_mm("cpu")
    except (RuntimeError, NotImplementedError):
        return False  # no float32 kernel: nothing to trace for
    return _probe_raises(lambda: grouped_mm("meta"), (RuntimeError,))


def _grouped_mm_strides_aligned(mat: Any) -> bool:
    """The kernels' layout rule: one of the last two dims unit-stride, the other's stride
    a multiple of 16 bytes (as torch's ``_meta_grouped_mm_common`` checks it)."""
    last = mat.dim() - 1
    stride, alignment = mat.stride(), 16 // mat.element_size()
    if stride[last - 1] == 1 and stride[last] >= max(1, mat.shape[last - 1]):
        return stride[last] % alignment == 0
    if stride[last] == 1 and stride[last - 1] >= max(1, mat.shape[last]):
        return stride[last - 1] % alignment == 0
    return False


def _install_grouped_mm_fake_kernel() -> None:
    """NOTE: [grouped_mm's fake kernel]."""
    from torch._meta_registrations import _create_grouped_mm_output_tensor
    from torch._subclasses import fake_impls
    from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager

    def fake_grouped_mm(fake_mode, func, mat_a, mat_b, offs=None, bias=None, out_dtype=None):
        if mat_a.dtype == torch.bfloat16 and mat_b.dtype == torch.bfloat16:
            return NotImplemented  # torch's own fake kernel
        torch._check(
            mat_a.dtype == mat_b.dtype and mat_a.dtype in _GROUPED_MM_KERNEL_DTYPES,
            lambda: "grouped_mm: expected mat_a and mat_b to be Float32, BFloat16 or Float16 "
            f"matrices of one dtype (torch's kernels), got {mat_a.dtype} and {mat_b.dtype}",
        )
        torch._check(mat_a.dim() in (2, 3) and mat_b.dim() in (2, 3),
                     lambda: f"grouped_mm: multiplicands must be 2D or 3D, got {mat_a.dim()}D and {mat_b.dim()}D")
        if mat_a.dim() == 3 or mat_b.dim() == 3:
            torch._check(mat_a.size(-1) == mat_b.size(-2),
                         lambda: "grouped_mm: contraction dimension of mat_a and mat_b must match")
        for name, mat in (("mat_a", mat_a), ("mat_b", mat_b)):
            if not _grouped_mm_strides_aligned(mat):
                raise RuntimeError(
                    f"grouped_mm: {name} strides {tuple(mat.stride())} (sizes {tuple(mat.shape)}) "
                    "are not 16-byte aligned with one unit-stride dimension")
        if mat_a.dim() == 2 or mat_b.dim() == 2:
            torch._check(offs is not None and offs.dim() == 1 and offs.dtype == torch.int32,
                         lambda: "grouped_mm: a 2D operand needs 1D int32 offsets")
        else:
            torch._check(offs is None, lambda: "grouped_mm: offsets given for 3D/3D operands")
        torch._check(bias is None, lambda: "grouped_mm: a bias is not supported")
        torch._check(out_dtype is None or out_dtype == mat_a.dtype,
                     lambda: f"grouped_mm: out_dtype {out_dtype} differs from the inputs' {mat_a.dtype}")
        with in_kernel_invocation_manager(fake_mode):
            out = _create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype)
        return FakeTensor(fake_mode, out, mat_a.device)

    fake_impls.op_implementations_dict[torch.ops.aten._grouped_mm.default] = fake_grouped_mm


def storage_ref(t: torch.Tensor) -> Any:
    """A weak reference to ``t``'s storage that compares equal for every tensor viewing it
    (fake tensors included)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage())


# NOTE: [data replaced between calls]
# ``w.data = value`` between compiled calls on a parameter or buffer a compiled step
# placed (WGAN-style ``w.data = w.data.clamp(-c, c)``, ``vector_to_parameters``, peft's
# ``merge_and_unload(safe_merge=True)``): torch's ``Tensor.data`` setter swaps the DTensor
# wrapper's TensorImpl but leaves its ``_local_tensor``, which the programs read and
# write, and the assigned DTensor's own local tensor dies with it; the assignment was
# silently ignored (losses 0.972434 / 0.902185 against eager's 1.053880 / 1.014909, the
# weight 12.4x off). DTensor's ``__torch_function__`` is disabled, so no mode or override
# sees the setter; ``DTensor.data`` gets a property whose setter, for a tensor registered
# here (``intercept_data_assignment``, at placement), hands the value to the
# registration's callback, which sets the local tensor (or refuses, with nothing
# changed); for every other DTensor, and while a step is traced (``data_setter_of_torch``,
# entered by the trace: ``OutsideWrites`` then refuses ``.data =`` with the step's line),
# it is torch's setter. The trace is told by that flag, not by "a torch function mode is
# active": ``torch.set_default_device(...)`` and ``with torch.device(...)`` install a
# function mode too, and under them the assignment was silently ignored again (params
# 0.338 off eager, fsdp, 2 simulated ranks). The getter is torch's. Nothing is added to
# a compiled call.
# The registry is keyed by ``id`` and holds no reference to the tensor: a weak reference
# to a parameter makes ``torch.utils.swap_tensors`` refuse it, which ``model.double()`` /
# ``.to()`` of a placed model use (an earlier registry of weak references broke them, and
# was taken back with the refusal it served). A stale id (the tensor died, another
# DTensor got its address) is told apart by the callback, which checks that its module
# slot, or another slot of a module holding placed state, holds the tensor (NOTE: [data
# replaced under another name] in ``runtime/eager_calls.py``).
_DATA_DESCRIPTOR: Any = torch._C.TensorBase.data  # a getset_descriptor
_DATA_ASSIGNED: dict[int, Callable[[DTensor, torch.Tensor], bool]] = {}
_STEPS_TRACED = [0]  # how many traces of a step are open (nested: a step traced in a step)


@contextlib.contextmanager
def data_setter_of_torch() -> Iterator[None]:
    """While a step is traced, ``.data =`` is torch's setter on every DTensor (NOTE: [data
    replaced between calls]): ``OutsideWrites`` sees it and refuses it with the line."""
    _STEPS_TRACED[0] += 1
    try:
        yield
    finally:
        _STEPS_TRACED[0] -= 1


_DATA_ASSIGNED_ELSE: list[Callable[[DTensor, torch.Tensor], bool]] = []


def _set_data(self: torch.Tensor, value: torch.Tensor) -> None:
    if not _STEPS_TRACED[0]:
        on_set = _DATA_ASSIGNED.get(id(self))
        if on_set is not None and on_set(cast(DTensor, self), value):
            return
        # not ``on_set is None`` only: a stale entry (a dead tensor's id, now this
        # one's address) answers False and must not hide a gradient or a state tensor
        if any(other(cast(DTensor, self), value) for other in _DATA_ASSIGNED_ELSE):
            return
    _DATA_DESCRIPTOR.__set__(self, value)


def intercept_data_assignment(t: DTensor, on_set: Callable[[DTensor, torch.Tensor], bool]) -> None:
    """Send ``t.data = value`` to ``on_set(t, value)``, which returns False where ``t`` is
    not the tensor it was registered for (torch's setter runs then), and otherwise sets
    the value or raises (NOTE: [data replaced between calls]). The property goes on
    ``DTensor`` once."""
    if DTensor.__dict__.get("data") is None:
        DTensor.data = property(_DATA_DESCRIPTOR.__get__, _set_data)  # type: ignore[assignment,method-assign]
    _DATA_ASSIGNED[id(t)] = on_set


def intercept_other_data_assignment(on_set: Callable[[DTensor, torch.Tensor], bool]) -> None:
    """Send ``t.data = value`` on a DTensor no ``intercept_data_assignment`` registered to
    ``on_set(t, value)`` first (a gradient or an optimizer state tensor of a placed
    model: NOTE: [data replaced between calls]); False: torch's setter runs. Once per
    ``on_set``."""
    if DTensor.__dict__.get("data") is None:
        DTensor.data = property(_DATA_DESCRIPTOR.__get__, _set_data)  # type: ignore[assignment,method-assign]
    if on_set not in _DATA_ASSIGNED_ELSE:
        _DATA_ASSIGNED_ELSE.append(on_set)


def data_assignment_callbacks() -> list[Callable[[DTensor, torch.Tensor], bool]]:
    """Every registered callback (NOTE: [data replaced between calls]: a value that is
    another registered tensor's memory is refused, and its owner is found through them)."""
    return list(_DATA_ASSIGNED.values())


def data_assignment_callback(t: torch.Tensor) -> Callable[[DTensor, torch.Tensor], bool] | None:
    """What ``t.data = value`` is sent to, if anything (for tests and stale entries)."""
    return _DATA_ASSIGNED.get(id(t))


# NOTE: [writes into a redistributed part of a placed tensor]
# After a compiled call a placed parameter is a DTensor; eager code between calls that
# takes a part of it along a dimension the step shards (``emb.weight[PAD]``,
# ``w[2:5]``, ``w.narrow(0, 2, 3)``, ``w.view(-1)[:20]``, ``w.chunk(4)[1]``, the
# ``tensor[i, i]`` of ``nn.init.dirac_``) gets from DTensor a view of a temporary: the
# view op's strategy all-gathers the shard first, so the result's local tensor is a
# fresh copy, and an in-place write into it (``.zero_()``, ``w[3] = 0``,
# ``nn.init.zeros_(w[12:13])``) never reached the parameter: silently dropped (padding
# row, fsdp, 2 simulated ranks: losses [1.492892, 2.288912, 1.945215] against eager's
# [1.492892, 2.222972, 1.975858], the loss with no write at all). Writing through
# (which rank holds which rows of the part, for every view op) is not simple, so the
# write is refused, at the write, naming the parameter, the view op and what works.
# DTensor's dispatch runs in C++ and calls back into Python only for the slow paths;
# two of them are wrapped, and do nothing while a step is traced (the flag of
# ``data_setter_of_torch``, NOTE: [data replaced between calls]):
# - ``_dispatch_get_local_results_slow_path`` (a view op whose strategy redistributes
#   its input): where the input is a placed parameter's or buffer's memory (or such a
#   temporary), and the outputs' local tensors do not share its storage, their
#   storages are marked (weak storage references, so a marked temporary dies as
#   usual; views of it share the storage, so they are marked too);
# - ``_dispatch_fast_path_python_tail`` (every in-place and out= op): a write into a
#   marked storage is refused (the local write went to the temporary only: nothing of
#   the model changed). An out= / in-place op on a placed tensor that changed its
#   placements (``nn.init.eye_(w)`` is ``torch.eye(n, m, out=w)``, whose strategy
#   leaves ``w`` replicated with the whole identity as its local tensor, so the next
#   call failed at a reshape) hands the new value to the tensor's ``.data =`` callback,
#   which puts it back on the tensor's placements (exact: a redistribution of a whole
#   value).
# Ops that need no redistribution (``w.add_(1)``, ``w[:, 3].zero_()`` under fsdp) only
# pay the tail's checks (measured in ``tests/sim/test_writes_into_parts_between_calls.py``'s
# docstring).
_TEMPORARIES: dict[Any, tuple[str, str]] = {}  # StorageWeakRef -> (owner, view op)
_OWNER_OF_MEMORY: list[Callable[[torch.Tensor], str | None]] = []


def _storage_refs(local: Any) -> list[Any]:
    from torch.multiprocessing.reductions import StorageWeakRef

    if not isinstance(local, torch.Tensor):
        return []
    locals_ = (
        list(per_rank_tensors(local).values()) if isinstance(local, local_tensor_type()) else [local]
    )
    if any(x.device.type == "meta" or is_fake(x) for x in locals_):  # a trace's (the expansion's)
        return []
    try:
        return [StorageWeakRef(x.untyped_storage()) for x in locals_]
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):  # no plain storage
        return []


def _temporary_of(t: Any) -> tuple[str, str] | None:
    """(owner, view op) where ``t``'s local memory is a marked temporary."""
    if not _TEMPORARIES or not isinstance(t, DTensor):
        return None
    for ref in _storage_refs(t._local_tensor):
        found = _TEMPORARIES.get(ref)
        if found is not None and not ref.expired():
            return found
    return None


def _forget_dead_temporaries() -> None:
    for ref in [ref for ref in _TEMPORARIES if ref.expired()]:
        del _TEMPORARIES[ref]


def _wrap_local_results(original: Callable[..., Any]) -> Callable[..., Any] | None:
    names = _parameter_names(original)
    if names[:4] != ["self", "op_call", "args", "op_info"]:
        return None  # another torch's signature: the check is not installed

    def local_results(self: Any, op_call: Any, args: Any, op_info: Any, *rest: Any, **more: Any) -> Any:
        results = original(self, op_call, args, op_info, *rest, **more)
        if _STEPS_TRACED[0] or not _OWNER_OF_MEMORY or not args or not isinstance(args[0], DTensor):
            return results
        sharding = op_info.output_sharding
        if sharding is None or not sharding.needs_redistribute or not op_call._schema._is_view_op():
            return results
        base = args[0]
        own = set(_storage_refs(base._local_tensor))
        if not own:
            return results
        found = _temporary_of(base)
        owner = found[0] if found is not None else _OWNER_OF_MEMORY[0](base)
        if owner is None:
            return results
        _forget_dead_temporaries()
        for out in pytree.tree_leaves(results):
            for ref in _storage_refs(out):
                if ref not in own:
                    _TEMPORARIES[ref] = (owner, str(op_call))
        return results

    local_results._spmd_marks_temporaries = True  # type: ignore[attr-defined]
    return local_results


def _parameter_names(fn: Callable[..., Any]) -> list[str]:
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []


_TAIL_PARAMETERS = [
    "self", "op_call", "args", "kwargs", "compute_mesh", "output_sharding", "local_results",
    "participating", "is_inplace_op", "is_out_variant_op",
]


def _wrap_tail(original: Callable[..., Any]) -> Callable[..., Any] | None:
    if _parameter_names(original) != _TAIL_PARAMETERS:
        return None  # another torch's signature (torch 2.11 / 2.14): the check is not installed

    def tail(
        self: Any, op_call: Any, args: Any, kwargs: Any, compute_mesh: Any, output_sharding: Any,
        local_results: Any, participating: Any, is_inplace_op: bool, is_out_variant_op: bool,
    ) -> Any:
        if _STEPS_TRACED[0] or not (is_inplace_op or is_out_variant_op):
            return original(self, op_call, args, kwargs, compute_mesh, output_sharding,
                            local_results, participating, is_inplace_op, is_out_variant_op)
        written = (
            [args[0]] if is_inplace_op
            else [kwargs.get(a.name) for a in op_call._schema.arguments if a.is_out]
        )
        for t in written:
            found = _temporary_of(t)
            if found is not None:
                from .errors import SPMDCompileError

                owner, view = found
                raise SPMDCompileError(
                    f"{op_call} between calls of a compiled step writes into a part of "
                    f"{owner} taken by {view} along a dimension the step shards: DTensor "
                    "gathered that part into a temporary copy, so the write would not reach "
                    f"{owner} (before, silently). Nothing of the model was changed "
                    "(NOTE: [writes into a redistributed part of a placed tensor]).",
                    hint="write it inside the compiled step, or build the whole new value "
                    "and assign it: `full = w.full_tensor().clone(); full[3] = 0; w.data = "
                    "full` (under torch.no_grad()). Whole-tensor in-place ops "
                    "(`w.mul_(0.5)`, `w.copy_(dtensor)`) write through.",
                )
        placed = [(t, t._spec) for t in written if isinstance(t, DTensor) and id(t) in _DATA_ASSIGNED]
        out = original(self, op_call, args, kwargs, compute_mesh, output_sharding,
                       local_results, participating, is_inplace_op, is_out_variant_op)
        for t, spec in placed:
            if t._spec.placements != spec.placements or _holds_whole(t, spec):
                _put_back(op_call, args, kwargs, t, spec)
        return out

    tail._spmd_marks_temporaries = True  # type: ignore[attr-defined]
    return tail


def _local_shapes(t: DTensor) -> tuple[tuple[int, ...], ...]:
    local = t._local_tensor
    if isinstance(local, local_tensor_type()):
        return tuple(tuple(x.shape) for x in per_rank_tensors(local).values())
    return (tuple(local.shape),)


def _holds_whole(t: DTensor, spec: Any) -> bool:
    """Whether each rank's local tensor of ``t``, placed sharded by ``spec``, has the
    global shape (an out= op resized it: ``torch.eye(n, m, out=w)``), which no shard can."""
    local = t._local_tensor
    first = next(iter(per_rank_tensors(local).values())) if isinstance(local, local_tensor_type()) else local
    if first.shape != t.shape:  # the common case, read first: one shape
        return False
    if not any(p.is_shard() and spec.mesh.size(i) > 1 for i, p in enumerate(spec.placements)):
        return False
    return all(shape == tuple(t.shape) for shape in _local_shapes(t))


def _put_back(op_call: Any, args: Any, kwargs: Any, t: DTensor, spec: Any) -> None:
    """``t`` (a placed tensor) left by an out= / in-place op with other placements or
    local shapes than ``spec``'s: its value put back on ``spec``'s placements, or refused
    (NOTE: [writes into a redistributed part of a placed tensor])."""
    from .errors import SPMDCompileError

    on_set = _DATA_ASSIGNED.get(id(t))
    whole = _holds_whole(t, spec)
    inputs = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor) and a is not t]
    local = t._local_tensor
    if isinstance(local, local_tensor_type()):
        # an out= resize changed the per-rank tensors, not the wrapper's shape
        local = make_local_tensor(per_rank_tensors(local))
    new_spec = t._spec
    t._spec = spec
    if on_set is not None and (whole and not inputs):
        # each rank computed the whole value (``torch.eye(n, m, out=w)``): replicated
        from torch.distributed.tensor import Replicate

        replicated = type(spec)(spec.mesh, (Replicate(),) * spec.mesh.ndim, tensor_meta=spec.tensor_meta)
        if on_set(t, DTensor(local, replicated, requires_grad=False)):  # type: ignore[call-arg]
            return
    if on_set is not None and new_spec.placements != spec.placements and not whole:
        if on_set(t, DTensor(local, new_spec, requires_grad=False)):  # type: ignore[call-arg]
            return
    raise SPMDCompileError(
        f"{op_call} between calls of a compiled step changed the local shard of a tensor a "
        "compiled step placed (another shape or placement), and its value cannot be told "
        "exactly; the tensor is no longer valid (NOTE: [writes into a redistributed part "
        "of a placed tensor]).",
        hint="write it inside the compiled step, or build the whole new value and assign "
        "it: `w.data = new` with a plain tensor of w's shape (from `w.full_tensor()`).",
    )


def refuse_writes_into_redistributed_parts(owner_of_memory: Callable[[torch.Tensor], str | None]) -> None:
    """Install the checks of NOTE: [writes into a redistributed part of a placed tensor]
    once; ``owner_of_memory(t)`` names the placed parameter or buffer whose local memory
    ``t``'s is, or None."""
    from torch.distributed.tensor._dispatch import OpDispatcher

    if not _OWNER_OF_MEMORY:
        _OWNER_OF_MEMORY.append(owner_of_memory)
    local_fn, tail_fn = (getattr(OpDispatcher, name, None) for name in _WRAPPED)
    if local_fn is None or tail_fn is None or getattr(tail_fn, "_spmd_marks_temporaries", False):
        return  # another torch's dispatcher (the check is not in force there), or installed
    local_wrapped, tail_wrapped = _wrap_local_results(local_fn), _wrap_tail(tail_fn)
    if local_wrapped is not None and tail_wrapped is not None:  # both or neither
        setattr(OpDispatcher, _WRAPPED[0], local_wrapped)
        setattr(OpDispatcher, _WRAPPED[1], tail_wrapped)


# the two callbacks of DTensor's C++ dispatch wrapped (torch 2.13's names and signatures;
# another torch that lacks either, or calls it otherwise, runs without the check)
_WRAPPED = ("_dispatch_get_local_results_slow_path", "_dispatch_fast_path_python_tail")
