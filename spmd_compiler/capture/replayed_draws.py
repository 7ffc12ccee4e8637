"""Random draws repeated where torch restores the generator (activation checkpointing).

NOTE: [draws replayed by a restored generator]
``torch.utils.checkpoint`` (``use_reentrant`` True or False, and transformers'
``gradient_checkpointing_enable()``, which calls it) takes the generator's state before
a block's forward and puts it back before recomputing the block in backward, so the
recomputed dropout draws the forward's masks and the gradient is that of the forward
that ran. At capture that restore did nothing: the program's draws are nodes of the
graph (NOTE: [random numbers]), the real generator never moves while fake tensors are
traced, so the recompute drew new masks. The loss was eager's, the update the gradient
of another forward: in a probe a checkpointed dropout block's parameters ended 1.1e-2
off the same block without checkpointing (eagerly they are equal), on 1 rank and on 2,
and nothing said so.

While the step is traced the generator's position is counted in draws, one count per
device type: ``torch.get_rng_state()`` (and ``torch.cuda.get_rng_state()``) records the
position with the state object it returns; ``set_rng_state`` of such an object moves the
position back to it; a draw (``aten.rand``, ``randn``, ``randint``, ``randperm``,
``normal`` of a size: the factory ops every random op becomes at capture, NOTE: [random
draws shaped like a tensor]) at a position already drawn is that draw again, a copy of
the tensor the program drew there, and a draw past the last is new. ``fork_rng`` leaving
the recompute puts the position back at the end, so what follows draws anew, as eagerly.
So a checkpointed block's recompute reads the very numbers its forward drew: the program
keeps that draw from the forward until the recompute (the size of the block's random
numbers; torch.compile keeps a seed and an offset instead, which a CPU generator has not).

Refused, naming the op and the line: after activation checkpointing's restore, a
replayed position whose draw was another op, shape or dtype (the recompute took another
path than the forward) or a draw changed in place since it was drawn; and a state set
that no ``get_rng_state`` of the trace returned.

NOTE: [a step's own fork_rng]
A step's own ``with torch.random.fork_rng():`` block (or torch code doing the same
get/set pair) puts eager's generator back where it was: the block's draws repeat every
call and what follows draws on from there. The program draws every distinct draw once
per call, so its generator ends ``len(draws)`` draws on; before the fifty-eighth session
it ended there whatever the block restored (in a probe the "fixed" noise of a
``fork_rng`` block changed every call, and ``torch.rand(3)`` after 3 calls differed from
eager's). Now, when the trace ends: a generator whose position is at the end of its
draws (nothing restored, or what followed the block drew the block's draws again:
copies) is eager's already; one whose position is back at the start (every draw of the
call was inside ``fork_rng`` blocks) is set back after every call by the runtime to its
state before the call (``CapturedStep.rewound_generators``), as eager's is; any other
restore (draws before the block and inside it only, or another draw than the block's
after it: eager's generator then ends where the program's cannot) is refused, naming
``fork_rng`` and the line of the draw or of the step.
Outside a trace nothing changes; the user's own ``torch.set_rng_state`` inside a step is
refused before it gets here (NOTE: [Python effects at capture]).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch

from ..errors import SourceLocation, SPMDCompileError, innermost_model_frame_of_stack
from .callers import called_from_torch_checkpoint

aten = torch.ops.aten

# the factory draws of NOTE: [random draws shaped like a tensor] (a generator given to
# one is refused later, by refuse_explicit_generators)
DRAWS = (
    aten.rand.default,
    aten.randn.default,
    aten.randint.default,
    aten.randint.low,
    aten.randperm.default,
    aten.normal.float_float,
)


@dataclass
class _Draw:
    key: tuple[Any, ...]
    tensor: torch.Tensor
    version: int


class _Generators:
    """The positions of one trace (see the NOTE)."""

    def __init__(self) -> None:
        self.draws: dict[str, list[_Draw]] = {}
        self.position: dict[str, int] = {}
        self.states: list[tuple[torch.Tensor, str, int]] = []  # kept alive: matched by identity
        self.drawing = False
        # whether the last restore was activation checkpointing's (its recompute must draw
        # what its forward drew); another's (the user's ``fork_rng``) may draw otherwise
        self.by_checkpoint: dict[str, bool] = {}
        # a draw after another restore than checkpointing's that is not the block's draw
        # (NOTE: [a step's own fork_rng]): the line where it happened
        self.inexact: dict[str, SourceLocation | None] = {}
        self.restored_at: dict[str, SourceLocation | None] = {}  # the last such restore's line

    def taken(self, state: torch.Tensor, device_type: str) -> torch.Tensor:
        self.states.append((state, device_type, self._at(device_type)))
        return state

    def put_back(self, state: torch.Tensor, device_type: str, by_checkpoint: bool) -> None:
        for kept, kind, position in self.states:
            if kept is state and kind == device_type:
                self.position[device_type] = position
                self.by_checkpoint[device_type] = by_checkpoint
                if not by_checkpoint:
                    self.restored_at[device_type] = innermost_model_frame_of_stack(skip_stdlib=True)
                return
        raise SPMDCompileError(
            f"torch set the {device_type} random-number generator to a state that was not "
            "taken while the step was traced; a compiled step counts the generator's "
            "position in draws, and cannot tell where that state is (NOTE: [draws replayed "
            "by a restored generator]).",
            user_line=innermost_model_frame_of_stack(),
            hint="take the state inside the step (torch.utils.checkpoint does), or seed "
            "outside the compiled step.",
        )

    def _at(self, device_type: str) -> int:
        return self.position.get(device_type, len(self.draws.get(device_type, ())))

    def draw(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.drawing:
            return NotImplemented  # the draw itself, traced as it is
        device = kwargs.get("device")
        device_type = torch.device(device).type if device is not None else torch.get_default_device().type
        key = (op, _plain(args), _plain(sorted(kwargs.items())))
        drawn = self.draws.setdefault(device_type, [])
        at = self._at(device_type)
        self.position[device_type] = at + 1
        if at < len(drawn):
            if drawn[at].key == key or self.by_checkpoint.get(device_type, False):
                return self._again(drawn[at], key)
            # another draw than the one at this position, after a restore that was not a
            # recompute's (a step's own fork_rng, then dropout): eager's generator ends
            # where the program's cannot; refused when the trace ends (the NOTE)
            self.inexact.setdefault(device_type, innermost_model_frame_of_stack())
            self.position[device_type] = len(drawn) + 1
        self.drawing = True
        try:
            out = op(*args, **kwargs)
        finally:
            self.drawing = False
        drawn.append(_Draw(key, out, out._version))
        return out

    def rewound(self) -> tuple[str, ...]:
        """The device types whose generator the runtime sets back after every call to its
        state before it; the other restores of NOTE: [a step's own fork_rng] refused."""
        out: list[str] = []
        for device_type, drawn in self.draws.items():
            at = self._at(device_type)
            line = self.inexact.get(device_type) or self.restored_at.get(device_type)
            if device_type not in self.inexact and at == len(drawn):
                continue
            if device_type not in self.inexact and at == 0:
                out.append(device_type)
                continue
            raise SPMDCompileError(
                f"The train step restores the {device_type} random-number generator "
                "(torch.random.fork_rng(), or get_rng_state / set_rng_state in torch's "
                "code) and then "
                + ("draws another draw than the restored block drew"
                   if device_type in self.inexact else
                   f"ends {len(drawn) - at} draw(s) before its last, after drawing before the "
                   "block too")
                + ": eager's generator ends where the compiled program's cannot (it draws "
                "every distinct draw once per call; NOTE: [a step's own fork_rng]).",
                user_line=line,
                hint="draw the fork_rng block's numbers outside the compiled step and pass "
                "them in as a tensor argument, or put every draw of the step inside the "
                "fork_rng block (the generator is then set back after every call, as "
                "eagerly), or drop fork_rng.",
            )
        return tuple(out)

    def _again(self, first: _Draw, key: tuple[Any, ...]) -> torch.Tensor:
        if first.key != key or first.tensor._version != first.version:
            why = (
                f"drew {_describe(first.key)} there, and now {_describe(key)}"
                if first.key != key else "its draw was changed in place since"
            )
            raise SPMDCompileError(
                "torch restored the random-number generator (activation checkpointing's "
                "recompute) and the step drew again from a position it had drawn before, "
                f"but not the same draw: the trace {why}. A compiled step repeats the "
                "first draw there (NOTE: [draws replayed by a restored generator]), which "
                "would not be eager's numbers.",
                user_line=innermost_model_frame_of_stack(),
                hint="make the checkpointed block draw the same random numbers in its "
                "recompute as in its forward (no branch on training state or step count "
                "inside it), or checkpoint without preserve_rng_state.",
            )
        return first.tensor.clone()


def _describe(key: tuple[Any, ...]) -> str:
    op, args, kwargs = key
    shown = [repr(a) for a in args] + [f"{k}={v}" for k, v in kwargs if k in ("dtype", "device")]
    return f"{op}({', '.join(shown)})"


def _plain(value: Any) -> Any:
    """A comparable form of a draw's arguments (sizes, dtypes, devices)."""
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v) for v in value)
    if isinstance(value, torch.SymInt):
        return str(value)
    return value


_CURRENT: list[_Generators] = []


def replayed_draw_decompositions() -> dict[Any, Any]:
    """Capture decompositions of the NOTE's draws: they only count while a trace is
    inside ``generators_counted_in_draws``; otherwise traced as they are."""

    def decomposition(op: Any) -> Any:
        def draw(*args: Any, **kwargs: Any) -> Any:
            return _CURRENT[-1].draw(op, args, kwargs) if _CURRENT else NotImplemented

        return draw

    return {op: decomposition(op) for op in DRAWS}


@contextlib.contextmanager
def generators_counted_in_draws(rewound: list[str]) -> Iterator[None]:
    """While one trace runs: the generator's state taken and set by torch counts draws
    (see the NOTE). ``rewound`` gets, once the trace completed, the device types whose
    generator the runtime sets back after every call (NOTE: [a step's own fork_rng])."""
    generators = _Generators()

    def getter(real: Any, device_type: str) -> Any:
        def get_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
            return generators.taken(real(*args, **kwargs), device_type)

        return get_rng_state

    def setter(real: Any, device_type: str) -> Any:
        def set_rng_state(new_state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            generators.put_back(new_state, device_type, called_from_torch_checkpoint())
            real(new_state, *args, **kwargs)

        return set_rng_state

    with contextlib.ExitStack() as stack:
        owners: list[tuple[Any, str]] = [(torch, "cpu"), (torch.random, "cpu")]
        if torch.cuda.is_available():
            owners += [(torch.cuda, "cuda"), (torch.cuda.random, "cuda")]
        for owner, device_type in owners:
            get, put = owner.get_rng_state, owner.set_rng_state
            stack.enter_context(mock.patch.object(owner, "get_rng_state", getter(get, device_type)))
            stack.enter_context(mock.patch.object(owner, "set_rng_state", setter(put, device_type)))
        _CURRENT.append(generators)
        try:
            yield
        finally:
            _CURRENT.pop()
        rewound[:] = generators.rewound()


__all__ = ["DRAWS", "generators_counted_in_draws", "replayed_draw_decompositions"]
