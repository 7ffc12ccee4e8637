"""Value checks: ``if`` on a tensor's value, kept in the program and verified every call.

NOTE: [value checks]
``torch.distributions`` validates its arguments (``if not torch._is_all_true(valid):
raise ValueError``), ``F.gaussian_nll_loss`` checks its variance (``if torch.any(var <
0): raise``), train steps assert ``torch.isfinite(loss)`` or skip the update of a
non-finite loss (``if torch.isfinite(loss): loss.backward(); optim.step()``). Each is a
Python ``if`` on a tensor's value, which one traced program cannot take both ways.

- While the step is traced, ``bool()`` of a tensor whose value the trace does not have
  is answered from a list of decisions; an ``if`` met beyond the list is decided on the
  spot where its one way runs straight into a ``raise`` (NOTE: [checks decided from
  their bytecode]), and otherwise stops the trace (``Undecided``). Capture then traces
  the step with each answer for it:
  - a check: exactly one answer makes the step raise an exception of its own (a
    ``ValueError``, an ``AssertionError``, ...) before it meets another such ``if``. The
    other answer is the decision, and a call where the condition comes out the raising
    way raises ``SPMDRuntimeError`` naming the line and what the step raised there;
  - a branch: both answers go on. The decision is speculated (NOTE: [the guess for
    later ifs]: the way the same ``if`` always went in the trace, else True); a call where the condition comes out the other way runs the program of
    that way instead (below). The
    speculated program may be one no call runs: ``AveragedModel.update_parameters``
    (``if n == 0: copy``, ``if n > 0: average``) compiles (True, True) first, then
    (True, False) on its first call and (False, True) on its second, and again per
    program key (AdamW's state made by the first call): 3 programs with SGD, 4 with
    AdamW (``test_averaged_model_programs_are_counted``);
  - both answers raise: the step raises that, as eager would.
  - NOTE: [a check that stops the run]: the raising answer may raise a BaseException
    that is no Exception (``sys.exit(1)`` after "Loss is not finite", DeiT / MAE / DINO;
    ``raise KeyboardInterrupt`` from a hook's value check).
  - NOTE: [a way no program holds]: one answer leads the step to a value read no
    program can hold (a count read in Python, a value-dependent shape: what capture
    refuses), and the other goes on. The other is the decision, and the refused way is
    treated as a check's raising way: a call that goes there raises ``SPMDRuntimeError``
    naming the ``if`` and the line of the read (Longformer without global attention
    tokens: ``if is_global_attn:``, whose True way sizes tensors by a count). Before,
    the whole step was refused at capture.
- The condition (``bool(t)`` as a 0-dim bool tensor) becomes a returned tensor of the
  program, a global value like the loss. Every call the runtime compares each with its
  decision, in order, before any state is written. At the first that differs nothing
  is written (model, optimizer and gradients keep the last completed step's state): a
  check raises; a branch makes the compiled step run, on the same inputs and
  random-number state, the program whose decisions are those before it and the way it
  went, compiling it (capture with those decisions) on first need. The program that
  ran last is tried first on the next call. So a result is only ever used when every
  condition came out as its program was compiled: never one of the way not taken.
- An ``if`` on a Python float argument (``if scale > 1``: its stand-in tensor, NOTE:
  [float arguments as graph inputs]) is Python's decision, not the data's: the float
  stays a guard, as before.
- Bounds: ``MAX_VALUE_IFS`` ``if``s traced both ways per traced call (a ``while`` on a
  tensor's value is refused at its first test: NOTE: [while loops on tensor values] in
  ``trace.py``), ``MAX_VALUE_CHECKS`` ``if``s in all,
  ``MAX_BRANCH_PROGRAMS`` programs per step (used by ``api.py``), and
  ``MAX_COIN_BRANCHES`` branches on random draws alone (NOTE: [ifs on random draws
  alone]). An ``if`` traced both ways costs two traces of the step from its start at
  capture (``n`` of them: O(n^2) ops traced); a check decided from its bytecode costs
  nothing beyond the one trace. Reading the conditions is one device-to-host copy per
  call; a step with no such ``if`` is traced once and reads nothing, as before.

NOTE: [programs for the ways of ifs]
A step compiles at most ``MAX_BRANCH_PROGRAMS`` programs for the ways its branches go,
and the refusal past them counts both numbers: the distinct ways the calls that
completed went (recorded by ``api.py`` per program key) and the programs compiled. They
differ because a program guesses the ``if``s after the one it was compiled for: a way
with ``n`` ``if``s after a mismatch can compile ``n`` programs before the one the data
needs (DINO's ``clip_gradients``, one ``if clip_coef < 1`` per parameter, reached 8
programs at 4 to 5 distinct ways, and was refused as "8 ways"; NOTE: [the guess for
later ifs] makes that rarer). The hint says what takes both ways in one program: a
clamped factor (``p.grad.mul_(torch.clamp(clip / (norm + 1e-6), max=1))``),
``clip_grad_norm_``, ``torch.where``; and how to make a refresh every k steps Python's
decision: a flag the training loop sets on the optimizer (``opt.refresh = i % k == 0``,
read in ``step()``) or a bool argument of the step, one program per value.
The refusal counts the programs it does not count too, so its numbers add up to
``compile_count``: before the sixty-eighth session a step whose first call made the
optimizer's state (its program under a key of its own) was refused as "compiled 8
programs ... no call has completed yet" with ``compile_count`` 9 and the first call
completed; it now says "(9 in all; 1 more program serves other shapes or optimizer
state, ...)" and "no call has completed on them yet".
The limit is per set of Python values the step reads (its guards, NOTE: [guards on
Python values]): a program whose guards no longer hold does not count. Before the
sixty-fifth session every program of the key counted, so a changed value rebuilt all the
ways inside the same 8: an ACT halting loop (at most 5 steps, ``if (cum > 0.9).all():
break``) that logged ``self.max_steps = max(self.max_steps, n + 1)`` compiled 4 programs
at ``max_steps`` 0, 5 at 4, and was refused on its third call, at ``max_steps`` 5, saying
its calls went "1 distinct way" (it counted the ways per key, and the first call's
programs are under the key without the optimizer state). Now the programs of the values
the call found count, their ways are those the calls that completed on them went
(``StepExecutable.completed``), and the refusal names how many programs serve other
values and one changed value. Their guards are read on the values the call found: a
trace earlier in the call may have written a guarded value (``self.max_steps = ...``), so
``_branch_program`` first puts back what it wrote (it did so before compiling only, and a
refusal left the trace's writes).

NOTE: [the guess for later ifs]
A program compiled for a mismatched way knows the ways of the ``if``s up to it (those
the call verified, and the one that went the other way); those after it are guessed.
A refresh every k steps per parameter (Shampoo, GaLore, SOAP: ``for p in params: ...
if state["step"] % k == 0: refresh``, the count in a tensor as the refusal of a Python
counter advises) goes one way at every parameter on a given call. Guessing True for
each, as before the sixty-eighth session, made an all-False call compile one program
per parameter: a 4-Linear MLP (8 parameters) was refused on its second call, 8
programs for the call's key (9 with the first call's), after 162 s (the probers'
``repro_every_k_refused.py``, 2 shared cores). Now a branch met beyond the decisions is
guessed the way every ``if`` at the same site (its code and instruction, or its line
where there is no such frame) went in this trace: the mismatched ``if``'s real way
carries over to the other parameters, and the all-False call compiles one program (3
in all, matching eager). Where they went both ways the guess is True, as before: the
way of the latest alone would cost a program at every change of way, and DINO's
``clip_gradients`` (weights clipped, biases not: ``FFTFTF`` over 6 parameters) needed
6 programs on its first call with it against 5 with True; with this rule 5, and 0 more
for a later all-False call (4 more with True): a ``clip_gradients`` run of 8 calls
(3 Linear layers, SGD, ways ``FFTFTF`` x 3, ``FFTTTT``, ``FFTFTF`` x 2, ``FFFFFF``,
``TFTFTF``) was refused on call 6 before, and now completes all 8 with 8 programs,
matching eager. True is still the guess for a site met first, for a coin (NOTE: [ifs
on random draws alone]) and for an ``if`` one of whose ways leaves the innermost loop
holding it (``if halted: break``, ``return``, a ``while`` test: ``leaves_loop``, from
the bytecode): there the way it went so far (on) says little of the next, and
guessing "on" would run an unbounded ``while True: ... if done: break`` to
``MAX_VALUE_IFS``, where guessing the exit compiles one program per trip count (an
ACT halting loop's programs stay 2 + 4 + 3, ``tests/sim/test_value_checks.py``).
The guess is only about cost: every condition is verified every call, and a program
runs only where all came out its way (NOTE: [value checks]); a wrong guess (two
groups refreshed every 2 and 3 steps: 1 + 5 programs over 7 calls, 8 before)
compiles the way the data went and gives eager's numbers
(``tests/sim/test_every_k_refresh.py``). Two clips per parameter on one line
(``clip_in_steps_step``) need 2 programs for an all-False call where they needed 3.

NOTE: [checks decided from their bytecode]
Traced both ways, ``n`` checks cost ``2n`` traces of the step from its start: a PPO epoch
of minibatches with a ``Categorical`` policy (validated by default: its logits in
``__init__``, its actions in ``log_prob``, two checks per minibatch) took 108 s to capture
at 8 minibatches, and past 8 it met more than ``MAX_VALUE_IFS`` and was refused (41 s).
So where the frame that asked ``bool()`` (past the capture's torch function modes) sits
at a jump on the condition (``if``, ``if not``, ``assert``, ``while``), and exactly one
of its two ways runs straight into ``raise X`` (no jump, return or re-raise before it;
``raising_way``), the trace decides the other way on the spot and goes on: the raising
way is not traced. Its ``ValueCheck.raised`` is ``UNTRACED``. A call where the condition
comes out the raising way is treated as a branch (nothing written, ``BranchMismatch``):
the program of that way is captured then, and
- where the step raises there, capture raises ``WayRaised``; the call raises
  ``SPMDRuntimeError`` as a check does, naming the line and what the step raised, and
  the check holds that text from then on (a later such call raises without a trace);
- where it goes on (the exception caught further up the step), it is a branch program
  like any other, matched to the ways taken by their booleans.
So the guess is only ever about cost: no result of a way that was not traced is used,
and a wrong guess (the raise caught, or the other way raising too) costs a capture when
a call goes there. ``if cond and not ok:``, ``bool(t)`` called, an ``if`` in a user
object's ``__bool__``, and pytest's rewritten ``assert`` (its message is formatted with
jumps) are not decided this way: traced both ways, as before. Measured (Linear(6, 3),
SGD, ddp at ``sc.simulate(world_size=2)``, first call): ``n`` minibatches each with one
``if not (y >= 0).all(): raise`` took 5.9 / 15.5 / 53.6 s at n = 4 / 8 / 16 and were
refused at 32; now 3.2 / 3.7 / 5.8 / 8.4 s at n = 4 / 8 / 16 / 32 (without the ``if``
3.0 / 2.7 / 5.5 / 6.8 s, same run). The PPO epoch above (8 minibatches, Adam, float64):
9.3 s first call (5.7 s with validation off); 9 minibatches compile in 7 s instead of
being refused (``tests/sim/test_value_checks.py``).

NOTE: [ifs on random draws alone]
LayerDrop (transformers' M2M100, NLLB, Wav2Vec2, Hubert, ... with ``layerdrop`` /
``encoder_layerdrop`` above 0, M2M100's and Wav2Vec2's defaults) skips each layer on a
coin flip: ``if torch.rand([]) < self.layerdrop``. Each such ``if`` is a branch whose way
changes from call to call at random, so the calls of a step with ``n`` of them need up
to ``2 ** n`` programs. Before, such a step compiled program after program as the flips
came (M2M100 with 2 + 2 layers: 10 compiles in its first 2 calls) until it met the
``MAX_BRANCH_PROGRAMS`` refusal, which with a small ``layerdrop`` may come only after
thousands of steps. A branch whose condition is computed from random draws and constants
alone (``drawn_alone``: no input of the step behind it) is counted at capture, and a
step with more than ``MAX_COIN_BRANCHES`` of them (more ways than ``MAX_BRANCH_PROGRAMS``
programs hold) is refused on its first call, naming the ``if``s. A coin that goes one
way whatever it draws (a uniform draw compared with a number outside (0, 1): peft's
LoHa / LoKr ``torch.rand(1) > module_dropout`` at their default dropout 0, one per
adapted layer) is decided that way and not counted (``settled_coin``; refused at 4
adapted layers before the fifty-fourth session); its value check still runs every call. An ``if`` on a value
that a random draw only touches (``if torch.isfinite(loss)`` after dropout) reads the
step's inputs too and is not counted: its way is the data's, not a coin's.

NOTE: [a check that stops the run]
``if not torch.isfinite(loss): print(...); sys.exit(1)`` raises ``SystemExit``, a
BaseException that is no Exception; so do ``KeyboardInterrupt`` and a user's own
``class Stop(BaseException)``. Before the sixtieth session capture caught ``Exception``
alone: the traced raising way ended the capture and the process, on the first call of a
healthy run (``sys.exit(1)`` exited with status 1; a hook raising KeyboardInterrupt failed
every call). Such a raise is now the check's raising way like a ``ValueError``, with one
difference at run time: a call whose condition comes out the raising way raises the
same class with the same arguments, as eager does (``SystemExit(1)`` exits with status
1), not ``SPMDRuntimeError``; a warning on stderr says so first, because the ``print``
before it ran once, at capture (NOTE: [Python effects at capture]). The class and
arguments travel after a newline in ``ValueCheck.raised`` (JSON; arguments that JSON
cannot hold become ``str(exc)``), so cache entries and branch programs keep them; a
class defined in a function is found by name in this process only, and elsewhere
``SPMDRuntimeError`` is raised instead (nothing is written either way).
A real Ctrl-C, or a signal handler's ``sys.exit``, must still stop the capture, not be
taken for the step's branch: while a way is traced, every signal with a Python handler
is wrapped to record that its handler raised (``signals_told_apart``); a BaseException
raised after one did ends the capture as before. A handler that returns (a sampling
profiler's SIGPROF every millisecond) is not counted: a review found that counting
every arrival took the step's own ``sys.exit(1)`` for a real stop on every call. Signals run their Python handlers in the
main thread only, so in another thread nothing needs wrapping.
"""

from __future__ import annotations

import contextlib
import dis
import importlib
import json
import linecache
import os
import re
import signal
import sys
import threading
import traceback
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast
from unittest import mock

import torch

from .. import _torch_private as private
from ..errors import SourceLocation, innermost_model_frame_of_stack, innermost_model_traceback
from ..ir.signature import ValueCheck
from .python_scalars import FloatArgumentUsedInPython
from .source_sites import builtin_called, while_of_condition

# programs one step may need for the ways its `if`s on tensor values go (``api.py``)
MAX_BRANCH_PROGRAMS = 8
# branches on random draws alone: 2 ** 3 ways fill MAX_BRANCH_PROGRAMS (NOTE: [ifs on
# random draws alone])
MAX_COIN_BRANCHES = 3
# `if`s one traced call may decide without tracing their raising way (NOTE: [checks
# decided from their bytecode]): a bound for a loop that never ends
MAX_VALUE_CHECKS = 1024
# ``ValueCheck.raised`` of a check decided from its bytecode: its other way was not traced
UNTRACED = "(its other way, which runs into a raise, was not traced)"
# how ``ValueCheck.raised`` opens for a way no program holds (NOTE: [a way no program
# holds]; ``trace._refusal_text``): the step raised nothing there
REFUSED_ITEM = "it uses the value of .item() in Python"
REFUSED_READ = "it reads a tensor's value in Python"
REFUSED_WAY_TEXTS = (REFUSED_ITEM, REFUSED_READ)
# how ``ValueCheck.raised`` opens for this package's own check (NOTE: [checks of this
# package decided on the spot]): the step raised nothing there, the program cannot go on
OWN_CHECK = "(a condition the program was compiled for) "


class Undecided(Exception):
    """The trace met a value check beyond the decided ones."""

    def __init__(
        self, where: str, coin: bool = False, settled: bool | None = None, guessed: list[bool] | None = None,
        guessed_raised: list[str] | None = None, frame: Any = None, guess: bool = True,
    ) -> None:
        super().__init__(f"a check on a tensor's value at {where}")
        self.where = where
        # the `while` whose condition this is (NOTE: [while loops on tensor values]) and
        # the builtin whose comparison it is (NOTE: [max and min of an .item() value])
        self.loop = None if frame is None else while_line(frame)
        self.compared_in = None if frame is None else builtin_called(frame)
        # the decisions the trace took on the spot before it stopped here, after those it
        # was given (NOTE: [checks decided from their bytecode], NOTE: [checks of this
        # package decided on the spot]), and what each one's other way raises
        self.guessed = guessed or []
        self.guessed_raised = guessed_raised or [UNTRACED] * len(self.guessed)
        self.owner = "The train step"  # or the optimizer whose step() it is in
        self.coin = coin  # NOTE: [ifs on random draws alone]
        self.settled = settled  # the way a coin goes whatever it draws, if it has one
        # the answer a branch here is guessed to take (NOTE: [the guess for later ifs])
        self.guess = guess
        # the torch function the step called that holds the `if` (``torch.nn.init.
        # trunc_normal_``'s rejection loop), if it is torch's: the refusal says so
        self.in_torch = torch_function_called()


def while_line(frame: Any) -> SourceLocation | None:
    """The line of the ``while`` whose condition ``frame`` is testing (NOTE: [while loops
    on tensor values]), or None."""
    loop = while_of_condition(frame)
    if loop is None:
        return None
    filename = frame.f_code.co_filename
    return SourceLocation(filename, loop.lineno, linecache.getline(filename, loop.lineno).strip())


def torch_function_called() -> str | None:
    """The torch function the innermost frame of the user's code called, where the
    running code is inside it (``torch.nn.init.trunc_normal_``); None otherwise."""
    from .callers import TORCH_DIR, users_file

    frame: Any = sys._getframe(1)
    inner = None
    while frame is not None and not users_file(frame.f_code.co_filename):
        inner, frame = frame, frame.f_back
    if frame is None or inner is None or not inner.f_code.co_filename.startswith(TORCH_DIR):
        return None
    module = os.path.relpath(inner.f_code.co_filename, os.path.dirname(TORCH_DIR.rstrip(os.sep)))
    return f"{os.path.splitext(module)[0].replace(os.sep, '.')}.{inner.f_code.co_name}"


class WayRaised(Exception):
    """A branch program traced the way of a check decided from its bytecode, and the
    step raised there (NOTE: [checks decided from their bytecode]): ``text`` is what it
    raised (``describe_raise``)."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text


@dataclass
class _Site:
    condition: torch.Tensor
    expected: bool
    where: str
    raised: str = ""  # UNTRACED: decided from the bytecode
    site: Any = None  # the `if` in the code (NOTE: [the guess for later ifs])


class BranchDecisions:
    """Answers ``bool()`` of a traced tensor from ``decisions`` (see the NOTE).

    A context manager that wraps ``torch.Tensor.__bool__`` while the step is traced: a
    torch function mode would miss the ``if`` inside torch's own Python functions
    (``F.gaussian_nll_loss`` runs with the modes it was dispatched through disabled).
    """

    def __init__(self, decisions: list[bool], python_value: Callable[[torch.Tensor], bool]) -> None:
        self.decisions = list(decisions)
        self.given = len(decisions)
        self.python_value = python_value  # a float argument's stand-in: Python's own value
        self.sites: list[_Site] = []
        self._patch: Any = None

    def __enter__(self) -> BranchDecisions:
        original = torch.Tensor.__bool__

        def answer(t: torch.Tensor) -> bool:
            try:
                return original(t)
            except private.data_dependent_error_types():
                return self._decide(t, sys._getframe(1))

        self._patch = mock.patch.object(torch.Tensor, "__bool__", answer)
        self._patch.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._patch.__exit__(*exc)

    def _decide(self, t: torch.Tensor, frame: Any) -> bool:
        if self.python_value(t):  # `if scale > 1` on a float argument: it stays a guard
            raise FloatArgumentUsedInPython("an `if` on a float argument")
        where = _LOCATED[-1] if _LOCATED else where_now() or "an unknown line"
        k = len(self.sites)
        raised = ""
        found = _frame_of_the_if(frame)
        site = where if found is None else (found.f_code, found.f_lasti)
        if k >= len(self.decisions) and _OWN_CHECKS and k < MAX_VALUE_CHECKS:
            # NOTE: [checks of this package decided on the spot]
            self.decisions.append(True)
            raised = OWN_CHECK + stop_text(_OWN_CHECKS[-1]())
        elif k >= len(self.decisions):
            # NOTE: [checks decided from their bytecode]
            raising = None if found is None or k >= MAX_VALUE_CHECKS else raising_way(found.f_code, found.f_lasti)
            if raising is None:
                coin = drawn_alone(t)
                raise Undecided(
                    where, coin=coin, settled=settled_coin(t) if coin else None,
                    guessed=self.decisions[self.given:],
                    guessed_raised=[s.raised for s in self.sites[self.given:]], frame=found,
                    guess=self._guess(site, found),
                ) from None
            self.decisions.append(not raising)
            raised = UNTRACED
        # a copy: a view of a buffer the branch then writes (``if not self.done:
        # self.done.fill_(True)``) read the written value, and the check failed every call
        condition = (t if t.dtype == torch.bool else t.ne(0)).detach().reshape(()).clone()
        self.sites.append(_Site(condition, self.decisions[k], where, raised, site))
        return self.decisions[k]

    def _guess(self, site: Any, found: Any) -> bool:
        """The answer to guess for a branch at ``site`` met beyond the decisions: the
        way every ``if`` at the same site went on this trace; True where none did, where
        they went both ways, or where one of its ways leaves its loop (NOTE: [the guess
        for later ifs])."""
        if found is not None and leaves_loop(found.f_code, found.f_lasti):
            return True
        ways = {s.expected for s in self.sites if s.site == site}
        return ways.pop() if len(ways) == 1 else True


# NOTE: [checks of this package decided on the spot]
# A selection by a mask of the batch checks its mask (``if not bool(mask.all()): raise
# MaskWithFalseElements``, NOTE: [selections by a mask of the batch] in
# ``mask_selections.py``): a check whose False way raises, known before any trace. Traced
# both ways like a user's `if`, it cost two traces, and it stopped the trace of a way
# being tried: torchvision's detection models validate their targets with ``if
# degenerate.any(): bb = torch.where(degenerate.any(1))[0][0]; torch._assert(False,
# f"... {boxes[bb].tolist()}")``, whose True way met the selection's check before its
# raise, was taken for a way that goes on, and the step was refused at capture (sixty-
# fourth session: "ValueError: degenerate box. Note: the rows selected by a mask ...").
# Inside ``own_check(make)`` the `if` met beyond the given decisions is decided True on
# the spot, its other way recorded as raising ``make()`` (the text the traced way gave,
# after ``OWN_CHECK``); a call where it comes out False raises ``SPMDRuntimeError`` naming
# it, as before. That error opened "the step raises there" until the sixty-sixth session,
# of a step that raises nothing (``pitch[mask].std()`` runs in eager): it now says the
# program was compiled only for calls where the condition holds.
_OWN_CHECKS: list[Callable[[], BaseException]] = []


@contextlib.contextmanager
def own_check(make: Callable[[], BaseException]) -> Iterator[None]:
    """Inside: ``bool()`` of a traced tensor is this package's own check, whose False way
    raises ``make()`` (NOTE: [checks of this package decided on the spot])."""
    _OWN_CHECKS.append(make)
    try:
        yield
    finally:
        _OWN_CHECKS.pop()


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# torch's frames between an `if` and ``Tensor.__bool__``: its torch function and dispatch
# machinery, which the modes of the capture run through
_DISPATCH_FILES = tuple(
    os.path.join("torch", *name.split("/"))
    for name in ("overrides.py", "_tensor.py", "utils/_python_dispatch.py", "fx/experimental/proxy_tensor.py")
)


def _frame_of_the_if(frame: Any) -> Any:
    """The frame whose ``if`` (or ``assert``, ``while``) asked ``bool()`` of the tensor,
    from the frame that called our ``__bool__``: past the capture's own torch function
    modes and torch's dispatch to them. None where the first other frame is not at such
    a jump (``bool(t)`` called, ``not t`` kept as a value)."""
    for _ in range(64):
        if frame is None:
            return None
        name = frame.f_code.co_filename
        if not (
            name.startswith(_PACKAGE_DIR) or name.endswith(_DISPATCH_FILES)
            or frame.f_code.co_name in ("__torch_function__", "__torch_dispatch__")
        ):
            return frame
        frame = frame.f_back
    return None


_JUMPS = frozenset(dis.hasjrel) | frozenset(dis.hasjabs)
_ENDS = frozenset(("RETURN_VALUE", "RETURN_CONST", "RERAISE", "YIELD_VALUE", "RETURN_GENERATOR"))
_RAISING_WAYS: dict[tuple[Any, int], bool | None] = {}


def raising_way(code: Any, lasti: int) -> bool | None:
    """The answer of the ``if`` at instruction ``lasti`` of ``code`` whose way runs
    straight into a ``raise`` (no jump, return or other ``raise`` before it), when one
    of its two ways does and the other does not; None otherwise (NOTE: [checks decided
    from their bytecode]). ``if not ok: raise ValueError(...)`` is False, ``assert ok``
    False."""
    key = (code, lasti)
    if key not in _RAISING_WAYS:
        _RAISING_WAYS[key] = _raising_way(code, lasti)
    return _RAISING_WAYS[key]


def _raising_way(code: Any, lasti: int) -> bool | None:
    instructions = list(dis.get_instructions(code))
    at = {ins.offset: n for n, ins in enumerate(instructions)}
    n = at.get(lasti)
    if n is None:
        return None
    name = instructions[n].opname
    # a jump that pops the condition (`if x:`, `if not x:`, `assert x`, `while x:`);
    # `x and y` keeps it on the stack and is not looked at
    if not name.startswith("POP_JUMP") or not name.endswith(("IF_TRUE", "IF_FALSE")):
        return None
    jumps_when = name.endswith("IF_TRUE")
    jumped = _runs_into_raise(instructions, at.get(instructions[n].argval))
    fell = _runs_into_raise(instructions, n + 1)
    if jumped == fell:
        return None
    return jumps_when if jumped else not jumps_when


_LEAVES_LOOP: dict[tuple[Any, int], bool] = {}


def leaves_loop(code: Any, lasti: int) -> bool:
    """Whether one way of the ``if`` at instruction ``lasti`` of ``code`` leaves the
    innermost loop of ``code`` that holds it (``if done: break``, ``return``, the test
    of a ``while``), as far as straight-line code shows (NOTE: [the guess for later
    ifs]). An ``if`` in no loop of its own code is False."""
    key = (code, lasti)
    if key not in _LEAVES_LOOP:
        _LEAVES_LOOP[key] = _leaves_loop(code, lasti)
    return _LEAVES_LOOP[key]


def _leaves_loop(code: Any, lasti: int) -> bool:
    instructions = list(dis.get_instructions(code))
    at = {ins.offset: n for n, ins in enumerate(instructions)}
    n = at.get(lasti)
    if n is None or not (instructions[n].opname.startswith("POP_JUMP") and isinstance(instructions[n].argval, int)):
        return False  # not an `if` that pops its condition (`x and y` keeps it)
    # a loop: from the target of its backward jumps (`continue` jumps there too) to
    # the last of them
    ends: dict[int, int] = {}
    for ins in instructions:
        if ins.opcode in _JUMPS and isinstance(ins.argval, int) and ins.argval <= ins.offset:
            ends[ins.argval] = max(ends.get(ins.argval, 0), ins.offset)
    spans = [(start, end) for start, end in ends.items() if start <= lasti <= end]
    if not spans:
        return False
    start, end = min(spans, key=lambda span: span[1] - span[0])
    return any(
        _way_leaves(instructions, at, way, start, end)
        for way in (at.get(instructions[n].argval), n + 1)
    )


def _way_leaves(instructions: list[dis.Instruction], at: dict[int, int], n: int | None, start: int, end: int) -> bool:
    """Whether the code from instruction ``n`` on, following unconditional forward
    jumps, returns or reaches an instruction outside ``[start, end]`` before any other
    jump, raise or yield."""
    for _ in range(len(instructions)):
        if n is None or n >= len(instructions):
            return True
        ins = instructions[n]
        if not start <= ins.offset <= end or ins.opname.startswith("RETURN"):
            return True
        if ins.opname in ("JUMP_FORWARD", "JUMP_ABSOLUTE", "JUMP") and ins.argval > ins.offset:
            n = at.get(ins.argval)
            continue
        if ins.opcode in _JUMPS or ins.opname in _ENDS or ins.opname.startswith("RAISE"):
            return False
        n += 1
    return False


def _runs_into_raise(instructions: list[dis.Instruction], n: int | None) -> bool:
    """Whether the code from instruction ``n`` on reaches ``raise X`` before any jump,
    return, re-raise or yield."""
    while n is not None and n < len(instructions):
        ins = instructions[n]
        if ins.opname == "RAISE_VARARGS":
            return bool(ins.arg)  # a bare `raise` re-raises what is being handled
        if ins.opcode in _JUMPS or ins.opname in _ENDS:
            return False
        n += 1
    return False


def read_runs_into_raise(exc: BaseException) -> bool:
    """Whether the value read that raised ``exc`` (an ``.item()`` or ``int()`` the trace
    cannot answer) sits in code of the model that runs straight into ``raise X`` (no
    jump, return or re-raise between): the read is part of what the step raises
    (``raise ValueError(f"bad box {int(i)}")``), so the way that reached it raises
    (NOTE: [a value read in what a way raises])."""
    tb = innermost_model_traceback(exc.__traceback__)
    if tb is None:
        return False
    instructions = list(dis.get_instructions(tb.tb_frame.f_code))
    at = {ins.offset: n for n, ins in enumerate(instructions)}
    n = at.get(tb.tb_lasti)
    return n is not None and _runs_into_raise(instructions, n + 1)


_LOCATED: list[str] = []


def drawn_alone(t: torch.Tensor) -> bool:
    """Whether the traced ``t`` is computed from random draws and constants alone: no
    input of the step (parameter, batch, state) among what it is computed from (NOTE:
    [ifs on random draws alone])."""
    node = private.traced_node_of(t)
    if node is None:
        return False
    seen: set[torch.fx.Node] = set()
    stack = [node]
    drawn = False
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            return False
        drawn |= n.op == "call_function" and torch.Tag.nondeterministic_seeded in getattr(
            n.target, "tags", ()
        )
        stack.extend(n.all_input_nodes)
    return drawn


_UNIFORM_DRAWS = (torch.ops.aten.rand.default, torch.ops.aten.rand_like.default)
_PASSING = (
    torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten.squeeze.default,
    torch.ops.aten.squeeze.dim, torch.ops.aten.select.int, torch.ops.aten.clone.default,
    torch.ops.aten.alias.default, torch.ops.aten.detach.default,  # no casts: `rand(1).long() > 0` is False
)
# comparison of a draw u in [0, 1) with a number c -> the way it goes whatever u is, or
# None: (True when, False when)
_SETTLED: dict[Any, tuple[Callable[[float], bool], Callable[[float], bool]]] = {
    torch.ops.aten.gt.Scalar: (lambda c: c <= 0, lambda c: c >= 1),
    torch.ops.aten.ge.Scalar: (lambda c: c <= 0, lambda c: c >= 1),
    torch.ops.aten.lt.Scalar: (lambda c: c >= 1, lambda c: c <= 0),
    torch.ops.aten.le.Scalar: (lambda c: c >= 1, lambda c: c <= 0),
}


def _through_views(node: Any) -> torch.fx.Node | None:
    """The node ``node`` views or copies through ``_PASSING`` ops (None: not a node)."""
    while isinstance(node, torch.fx.Node) and node.target in _PASSING:
        node = node.args[0]
    return node if isinstance(node, torch.fx.Node) else None


def settled_coin(t: torch.Tensor) -> bool | None:
    """The way an ``if`` on ``t`` goes whatever its draw, where ``t`` compares a uniform
    draw in [0, 1) with a number outside (0, 1): peft's LoHa / LoKr ``torch.rand(1) >
    module_dropout`` with its default dropout 0 is True (but for a draw of exactly 0, 2**-24
    of the time, which the value check still catches every call). None otherwise (NOTE:
    [ifs on random draws alone])."""
    node = _through_views(private.traced_node_of(t))
    if node is None or node.target not in _SETTLED or len(node.args) < 2:
        return None
    draw, c = _through_views(node.args[0]), node.args[1]
    if draw is None or draw.target not in _UNIFORM_DRAWS or isinstance(c, bool) or not isinstance(c, (int, float)):
        return None
    true_when, false_when = _SETTLED[node.target]
    return True if true_when(float(c)) else False if false_when(float(c)) else None


@contextlib.contextmanager
def located(where: str | None) -> Iterator[None]:
    """Inside: a value check is reported at ``where`` (a line the step ran earlier) rather
    than at the innermost line of the step on the stack."""
    if where is not None:
        _LOCATED.append(where)
    try:
        yield
    finally:
        if where is not None:
            _LOCATED.pop()


def where_now() -> str | None:
    """The innermost line of the step on the stack, as value checks report it."""
    found = innermost_model_frame_of_stack()
    return None if found is None else str(found)


def eager_check(condition: torch.Tensor, message: str) -> None:
    """An argument check of an eager kernel answered in plain ops (CTC loss, packed
    sequences): a value check, so it is verified every call and a failing call raises
    ``SPMDRuntimeError`` with ``message``, as eager raises ``RuntimeError``."""
    if not bool(condition.all()):
        raise RuntimeError(message)


def describe_raise(exc: BaseException) -> str:
    """``ValueError: message`` (its first lines), for a failed check's error."""
    lines = traceback.format_exception_only(type(exc), exc)[-1].strip().splitlines()
    ours = type(exc).__module__.startswith("spmd_compiler.")
    if ours:  # the bare class name
        lines[0] = lines[0].removeprefix(f"{type(exc).__module__}.")
    text = " ".join(line.strip() for line in lines[:3])
    if not ours and _TRACED_ITEM.search(text):
        # a message formatting ``.tolist()`` / ``.item()`` values at capture (torchvision's
        # "Found invalid box [...]"): the values were not there to format
        text = _TRACED_ITEM.sub("?", text) + " (? : a tensor's value, not known when the step was captured)"
    # a user's exception is cut short; ours carry their advice whole
    # (NOTE: [selections concatenated row by row])
    limit = 1000 if ours else 300
    return text if len(text) <= limit else text[:limit - 3] + "..."


# ``repr`` of a ``TracedItem`` (``traced_items.py``)
_TRACED_ITEM = re.compile(r"TracedItem\(\([0-9, ]*\) torch\.\w+\)")


def stop_text(exc: BaseException) -> str:
    """``describe_raise(exc)``, followed for a BaseException that is no Exception by a
    newline and the JSON of its class and arguments (NOTE: [a check that stops the run])."""
    text = describe_raise(exc)
    if isinstance(exc, Exception):
        return text
    cls = type(exc)
    name = f"{cls.__module__}:{cls.__qualname__}"
    _STOP_CLASSES[name] = cls
    args: list[Any] = list(exc.args)
    try:
        if json.loads(json.dumps(args)) != args:
            args = [str(exc)]
    except (TypeError, ValueError):
        args = [str(exc)]
    return text + "\n" + json.dumps({"class": name, "args": args})


# classes stop_text met in this process, by name (a class defined in a function has none
# that importlib can find)
_STOP_CLASSES: dict[str, type[BaseException]] = {}


def stop_of(raised: str) -> BaseException | None:
    """The BaseException a check's ``raised`` text records (NOTE: [a check that stops the
    run]), built afresh; None for an Exception's text or a class not found."""
    if "\n" not in raised:
        return None
    recorded = json.loads(raised.split("\n", 1)[1])
    name, args = recorded["class"], recorded["args"]
    cls: Any = _STOP_CLASSES.get(name)
    if cls is None:
        module, _, qualname = name.partition(":")
        try:
            cls = importlib.import_module(module)
            for part in qualname.split("."):
                cls = getattr(cls, part)
        except (ImportError, AttributeError):
            return None
    if not (isinstance(cls, type) and issubclass(cls, BaseException)) or issubclass(cls, Exception):
        return None
    try:
        return cast(BaseException, cls(*args))
    except Exception:  # noqa: BLE001 - a class whose __init__ takes other arguments
        return None


@contextlib.contextmanager
def signals_told_apart() -> Iterator[list[int]]:
    """Inside: the signals that arrived, in a list (NOTE: [a check that stops the run]);
    each Python handler still runs as before."""
    arrived: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield arrived  # handlers run in the main thread: none interrupts this one
        return
    wrapped: dict[signal.Signals, Any] = {}

    def recording(handler: Callable[..., Any]) -> Callable[..., Any]:
        def record(signum: int, frame: Any) -> Any:
            # only a handler that raises stops the run: a profiler's SIGPROF handler
            # returning at once is no Ctrl-C (a review: with one firing every 1 ms, the
            # step's own sys.exit(1) was taken for a real stop and raised on every call)
            try:
                return handler(signum, frame)
            except BaseException:
                arrived.append(signum)
                raise
        return record

    try:
        for sig in signal.valid_signals():
            handler = signal.getsignal(sig)
            if callable(handler):
                signal.signal(sig, recording(handler))
                wrapped[sig] = handler
        yield arrived
    finally:
        for sig, handler in wrapped.items():
            signal.signal(sig, handler)


def too_many_ways(
    step: str, programs: int, ways_run: int, checks: Sequence[ValueCheck], others: int = 0,
    changed: str = "", elsewhere: int = 0,
) -> tuple[str, str]:
    """The refusal of a call that needs a program past ``MAX_BRANCH_PROGRAMS`` (NOTE:
    [programs for the ways of ifs]): its message and hint. ``programs``: those compiled
    for the Python values the call found; ``ways_run``: the distinct ways the calls that
    completed on them went; ``checks``: the ``if``s of a program of the step;
    ``others``: the programs of other Python values, ``changed`` how one of them differs;
    ``elsewhere``: the step's programs of other shapes or state (the three add up to
    ``compile_count`` where no program was dropped from memory)."""
    lines = Counter(c.where for c in checks)
    where = "; ".join(f"{n} at {line}" if n > 1 else line for line, n in lines.items())
    them = "them" if programs != 1 else "it"
    went = (
        f"the calls that completed on {them} went {ways_run} distinct way{'s' if ways_run != 1 else ''}"
        if ways_run else f"no call has completed on {them} yet; this one goes"
    )
    values = "" if not others else (
        f"; {others} more program{'s serve' if others != 1 else ' serves'} earlier values of "
        f"Python values the step reads, and {'do' if others != 1 else 'does'} not count: {changed}; each new value compiles "
        "the ways of its `if`s again"
    )
    shapes = "" if not elsewhere else (
        f"; {elsewhere} more program{'s serve' if elsewhere != 1 else ' serves'} other shapes "
        f"or optimizer state, and {'do' if elsewhere != 1 else 'does'} not count (a first call "
        "that makes the optimizer's state has its own)"
    )
    total = programs + others + elsewhere
    counted = f" ({total} in all{values}{shapes})" if total != programs else ""
    message = (
        f"{step} has compiled {programs} program{'s' if programs != 1 else ''} for the ways its `if`s on "
        "tensor values go at these shapes, state and Python values, the most one step may "
        f"have{counted}, and this call needs another: {went} through its {len(checks)} "
        f"`if`s ({where}). The "
        "other programs are the compiler's own, made on the way: a program guesses the "
        "`if`s after the one it was compiled for (the way the same `if` went in the call "
        "where it always went one way, else True), and an `if` that "
        "comes out against the guess compiles one more program, up to one per `if` for a "
        "new way (NOTE: [programs for the ways of ifs], NOTE: [the guess for later ifs])"
    )
    hint = (
        "replace an `if` on a tensor by arithmetic that takes both ways in one program: "
        "a clamped factor for a per-parameter clip (DINO's clip_gradients: "
        "`p.grad.mul_(torch.clamp(clip / (param_norm + 1e-6), max=1))` instead of "
        "`if clip_coef < 1: p.grad.mul_(clip_coef)`, or torch.nn.utils.clip_grad_norm_), "
        "torch.where(cond, a, b) to choose between values. Or make the decision Python's: "
        "for a refresh every k steps (Shampoo, GaLore, SOAP: `if state['step'] % k == 0`), "
        "a flag the training loop sets on the optimizer (`opt.refresh = i % k == 0`, read "
        "in its step() as `if self.refresh:`) or a bool argument of the step "
        "(`step(model, opt, x, y, refresh=i % k == 0)`): one program per value, 2 in all."
    )
    return message, hint


def choose(outcomes: dict[bool, Any]) -> bool | None:
    """The decision for a check, given each answer's outcome: an exception the step
    raised, or None when the trace went on. None when it is not a check."""
    raising = [answer for answer, outcome in outcomes.items() if outcome is not None]
    if len(raising) != 1:
        return None
    return not raising[0]


__all__ = [
    "MAX_BRANCH_PROGRAMS", "MAX_COIN_BRANCHES", "MAX_VALUE_CHECKS", "REFUSED_ITEM", "REFUSED_READ",
    "REFUSED_WAY_TEXTS", "UNTRACED", "BranchDecisions",
    "Undecided", "WayRaised", "choose", "describe_raise", "drawn_alone", "eager_check", "located",
    "OWN_CHECK", "own_check", "raising_way", "read_runs_into_raise", "signals_told_apart", "stop_of", "stop_text", "too_many_ways", "where_now",
]
