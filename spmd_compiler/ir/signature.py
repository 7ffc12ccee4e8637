"""What a captured train step's graph takes and gives back.

A captured step is one functional ATen graph. Each placeholder is tagged with the piece of
training state (or the user input) it stands for, and each output with the state it
replaces or the returned value it is. The runtime uses these tags to feed the graph and to
write the new state back; parallel modes use them to choose placements.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from .._torch_private import pytree


class Kind(enum.Enum):
    """The role of a graph input or output."""

    PARAM = "param"
    BUFFER = "buffer"
    GRAD = "grad"
    OPTIM_STATE = "optim_state"
    # a torch.amp.GradScaler's scale and growth tracker (NOTE: [loss scaling in the program])
    SCALER = "scaler"
    # a tensor held in a param group that the step reads and writes (timm's Lamb's
    # group['step']: NOTE: [tensors held in a param group])
    GROUP_STATE = "group_state"
    HYPERPARAM = "hyperparam"
    INPUT = "input"
    RETURN = "return"

    def __repr__(self) -> str:
        return self.value


STATE_KINDS = (Kind.PARAM, Kind.BUFFER, Kind.GRAD, Kind.OPTIM_STATE, Kind.SCALER, Kind.GROUP_STATE)
# State a fully_shard program holds row-padded when its rows do not divide the ranks
# (NOTE: [uneven shards] in parallel_modes/padding.py); the runtime pads and unpads it.
PADDED_KINDS = (Kind.PARAM, Kind.GRAD, Kind.OPTIM_STATE)


@dataclass(frozen=True)
class StateRef:
    """Names one graph input or output.

    ``name`` is the parameter/buffer FQN (prefixed by the module index when the step takes
    several modules), or a tensor argument's path in the step's arguments (``x``,
    ``batch['input_ids']``: NOTE: [inputs by name] in ``capture/bindings.py``); ``key`` is the optimizer-state key (``exp_avg``) or hyper-parameter
    (``lr``); ``index`` is the position among the step's tensor inputs or returned tensors,
    or the scaler's among the step's GradScalers (``key``: ``_scale`` or ``_growth_tracker``).
    """

    kind: Kind
    name: str = ""
    key: str = ""
    optimizer: int = -1
    group: int = -1
    index: int = -1

    def __str__(self) -> str:
        if self.kind is Kind.OPTIM_STATE:
            return f"optimizer[{self.optimizer}].state[{self.name}][{self.key!r}]"
        if self.kind is Kind.SCALER:
            return f"scaler[{self.index}].{self.key}"
        if self.kind is Kind.HYPERPARAM and self.optimizer < 0:
            return f"float argument {self.index}"
        if self.kind in (Kind.HYPERPARAM, Kind.GROUP_STATE):
            return f"optimizer[{self.optimizer}].param_groups[{self.group}][{self.key!r}]"
        if self.kind is Kind.INPUT and self.name:
            return f"{self.kind.value}[{self.index}] ({self.name})"
        if self.kind in (Kind.INPUT, Kind.RETURN):
            return f"{self.kind.value}[{self.index}]"
        return f"{self.kind.value} {self.name}"

    @property
    def param_name(self) -> str:
        """The parameter this ref belongs to (params, grads and optimizer state)."""
        return self.name


@dataclass(frozen=True)
class TensorMeta:
    """Global (single-device) metadata of a tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool = False

    @staticmethod
    def of(t: torch.Tensor) -> TensorMeta:
        return TensorMeta(tuple(t.shape), t.dtype, t.device, t.requires_grad)

    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize


def state_dtype(ref: StateRef, meta: TensorMeta) -> torch.dtype:
    """The dtype a piece of state has inside compiled programs (NOTE: [float64 step
    counters] in capture/trace.py): float32 scalar optimizer state becomes float64."""
    if ref.kind is Kind.OPTIM_STATE:
        return optim_state_dtype(meta.shape, meta.dtype)
    return meta.dtype


def optim_state_dtype(shape: tuple[int, ...], dtype: torch.dtype) -> torch.dtype:
    """``state_dtype`` of optimizer state of this shape and dtype."""
    return torch.float64 if shape == () and dtype == torch.float32 else dtype


@dataclass(frozen=True)
class ValueCheck:
    """A condition the program returns and the runtime compares with ``expected`` before
    it writes any state (NOTE: [value checks] in ``capture/value_checks.py``)."""

    output: int  # the index of the returned tensor holding the condition
    expected: bool
    where: str  # the model or train-step line of the ``if``
    raised: str  # what the step raised, traced with the other answer


@dataclass
class CapturedStep:
    """A train step as one functional single-device graph plus its signature.

    Attributes:
        graph_module: the functional ATen graph; placeholders follow ``inputs``, the
            output tuple follows ``outputs``.
        inputs: one ``(ref, meta)`` per placeholder.
        outputs: one ref per graph output (RETURN refs are the user's returned tensors,
            the others are new values of state that changed).
        return_spec: pytree spec of the user's return value; its leaves are either
            ``("tensor", i)`` (the i-th RETURN output) or ``("const", value)``.
        step_code: the code object of the user's train step, for error messages.
        output_metas: global metadata of each output.
        unchanged: state the step returns exactly as it received it (no output).
        checks: conditions among the returned tensors the runtime verifies every call.
        kept: where the step stores returned tensors in Python objects, set again after
            every call (``capture.kept_tensors.KeptTensor``; NOTE: [tensors the step
            keeps]).
        outside: tensors read from the user's objects as program constants, guarded
            where they were found (``capture.outside_tensors.OutsideTensor``; NOTE:
            [tensors read from outside the arguments]).
        scheduler_steps: the ``scheduler.step()`` calls the runtime replays around
            every call (``capture.lr_schedulers.SchedulerStep``; NOTE: [schedulers
            stepped in the step]).
        counted: the lines of selections compiled for a count per row read from the
            arguments at capture (NOTE: [rows of one count]).
        returns_containers: the return value holds a batch container, rebuilt after
            every call (NOTE: [batch containers]).
        rewound_generators: the device types ("cpu", "cuda") whose default generator
            the runtime sets back after every call to its state before it, as the
            step's own ``fork_rng`` does eagerly (NOTE: [a step's own fork_rng]).
        requires_grad_after: (parameter name, flag) of each parameter whose
            ``requires_grad`` the step changed, set on the user's parameters after every
            call (NOTE: [requires_grad set in the step] in ``capture/trace.py``).
    """

    graph_module: torch.fx.GraphModule
    inputs: list[tuple[StateRef, TensorMeta]]
    outputs: list[StateRef]
    return_spec: pytree.TreeSpec
    return_leaves: list[tuple[str, Any]]
    step_code: Any
    output_metas: list[TensorMeta] = field(default_factory=list)
    unchanged: list[StateRef] = field(default_factory=list)
    capture_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    checks: list[ValueCheck] = field(default_factory=list)
    kept: list[Any] = field(default_factory=list)
    outside: list[Any] = field(default_factory=list)
    scheduler_steps: list[Any] = field(default_factory=list)
    counted: list[str] = field(default_factory=list)
    returns_containers: bool = False
    rewound_generators: tuple[str, ...] = ()
    requires_grad_after: tuple[tuple[str, bool], ...] = ()
    # the optimizer state made before this program, when this capture made it
    # (``capture.initial_state.MadeState``; NOTE: [optimizer state made before the first
    # program])
    made_state: Any = None
    # the Python values the captured graph's ops were given, as the ranks compare them
    # (``runtime.same_inputs.traced_text``), taken before the pipeline rewrites the graph
    # in place; None: not taken yet (NOTE: [the traced step as captured])
    traced_text: str | None = None
    # why a float argument the program bakes as a setting is one, by its position in the
    # flat arguments, where an op named it (NOTE: [float arguments in Scalar arguments]
    # in ``capture/python_scalars.py``): the recompile warning repeats it
    floats_read: dict[int, str] = field(default_factory=dict)
    # the float arguments kept guards because the program does not read them (NOTE:
    # [float arguments the program does not read] in ``capture/trace.py``): the
    # recompile warning says so
    floats_unread: frozenset[int] = frozenset()
    # where the step read a float argument in Python (``float()``, ``math``, an ``if``,
    # torch's clip_grad_norm_), by position, as the recompile warning names it (NOTE:
    # [float arguments read in Python] in ``capture/trace.py``)
    floats_in_python: dict[int, str] = field(default_factory=dict)

    def input_refs(self) -> list[StateRef]:
        return [ref for ref, _ in self.inputs]

    @functools.cached_property
    def reshaped_state(self) -> frozenset[int]:
        """The positions of the buffer and optimizer-state outputs whose shape or dtype
        is not the one their input had (or that have no input): NOTE: [state the step
        gives a new shape] in ``runtime/runner.py``. Read once per program, not per call."""
        before = {ref: (meta.shape, meta.dtype) for ref, meta in self.inputs}
        return frozenset(
            j for j, (ref, meta) in enumerate(zip(self.outputs, self.output_metas, strict=True))
            if ref.kind in (Kind.BUFFER, Kind.OPTIM_STATE) and before.get(ref) != (meta.shape, meta.dtype)
        )

    def param_metas(self) -> dict[str, TensorMeta]:
        """Parameter name -> its global metadata, as the inputs hold it."""
        return {ref.name: meta for ref, meta in self.inputs if ref.kind is Kind.PARAM}

    def input_meta(self, ref: StateRef) -> TensorMeta:
        for r, meta in self.inputs:
            if r == ref:
                return meta
        raise KeyError(ref)


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (size-0 dims count as 1)."""
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))
