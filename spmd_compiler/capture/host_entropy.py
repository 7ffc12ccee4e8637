"""Reads of the OS's entropy by the step's own code while it is traced: refused.

NOTE: [host entropy at capture]
A compiled step runs its Python once, at capture. A value drawn there from the OS's
entropy is a number of that moment, and every later call reuses it, while eager draws
a new one every call. NumPy's recommended API made the common case: a mixup weight from
``np.random.default_rng().beta(0.4, 0.4)``, an unseeded generator made inside the step,
was 0.568, 0.215, 0.936, 0.595 on four eager calls and 0.021891 on every compiled one,
with no error (found by a probe; the generator objects of NOTE: [host random generator
objects at capture] are looked for before the trace, and one made in it was not seen).
``random.SystemRandom()``, ``secrets`` and ``os.urandom`` gave a constant factor the same
way. While the step is traced, ``os.urandom`` (also as the ``random`` module's
``_urandom``, which ``SystemRandom`` and ``secrets`` read) and ``os.getrandom`` refuse
when the code that asked is the user's own: the first frame, going outwards from the
read, that is not in ``os`` / ``random`` / ``secrets`` / ``uuid`` or NumPy is in a user's
file (``users_file``: not torch, this project, the standard library or an installed
package, nor any ``-packages`` folder, as ``own_code``). So an unseeded
``np.random.default_rng()`` / ``RandomState()`` / ``SeedSequence()`` / ``PCG64()`` made
in the step, ``random.SystemRandom()``'s draws, ``secrets.*``, ``os.urandom`` and
``uuid.uuid4()`` are refused, naming the call and the line; what torch and libraries read for themselves (``tempfile``'s names, Inductor's,
NumPy seeding itself at its first import: an import frame comes first) goes through.
``from os import urandom`` into a user's module is patched there too
(``users_globals_holding``). A generator made in the step with a fixed seed draws the
same numbers every eager call, as the program reuses: it goes through. Most read no
entropy; ``RandomState(seed)``, ``RandomState.seed(seed)`` and ``bit_generator.jumped()``
read it and then set the state from the seed or the generator: the call running in the
user's frame (found in its source by the position of the frame's instruction) is looked
at, and such a read goes through unless the seed is missing, ``None`` or a name bound to
``None``. Limits: a seed given as another expression that is ``None`` at run time
(``RandomState(cfg.seed)``) is taken as a seed; ``random.Random()`` without a seed reads
the entropy in C, unseen (its draws are refused by NOTE: [host random generator objects
at capture]); ``hash(object())`` (an address) and ``id()`` are not entropy reads and
are not seen.
"""

from __future__ import annotations

import ast
import contextlib
import linecache
import os
import random
import secrets
import sys
import threading
import types
import uuid
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

from ..errors import SourceLocation, SPMDCompileError
from .callers import users_file, users_globals_holding
from .source_sites import call_running

_HINT = (
    "draw outside the step (a mixup weight from rng.beta(a, a) with rng = "
    "np.random.default_rng() made once, before the loop) and pass the value as a float or "
    "0-d tensor argument (a graph input, NOTE: [float arguments as graph inputs]); or draw "
    "with torch ops inside the step (torch.rand(()), torch.randint), which the program "
    "draws anew every call from the default generator seeded outside the step."
)


def _modules_read_through() -> tuple[set[str], tuple[str, ...]]:
    """(files, folders) whose frames between the read and the code that asked are
    passed over: the standard library's doors to the entropy, and NumPy."""
    files = {os.path.abspath(m.__file__) for m in (os, random, secrets, uuid) if m.__file__}
    numpy = sys.modules.get("numpy")
    folders = (os.path.dirname(os.path.abspath(numpy.__file__)) + os.sep,) if numpy and numpy.__file__ else ()
    return files, folders


def _asker(frame: types.FrameType | None) -> tuple[types.FrameType | None, types.FrameType | None]:
    """(the first frame outwards from ``frame`` outside the doors, the outermost door
    frame it called) (see the NOTE)."""
    files, folders = _modules_read_through()
    door = None
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path not in files and not path.startswith(folders):
            break
        door, frame = frame, frame.f_back
    return frame, door


def _refused(name: str, real: Callable[..., Any], tracing: list[bool]) -> Callable[..., Any]:
    """``real``, refusing a read the user's code asks for on this thread while
    ``tracing[0]`` holds (a module first imported in the step that bound the patched
    function by name, ``from os import urandom``, keeps it after the trace: eager calls
    of it then pass through). A module's own top-level code asking (an import during the
    step: ``SALT = urandom(4)``, drawn once by eager too) is not refused."""
    tracing_thread = threading.get_ident()

    def read(*args: Any, **kwargs: Any) -> Any:
        if tracing[0] and threading.get_ident() == tracing_thread:
            asker, door = _asker(sys._getframe(1))
            if asker is not None and asker.f_code.co_name != "<module>" and _users_own(asker.f_code.co_filename):
                call = call_running(asker)
                if not _seeds_deterministically(asker, door, call):
                    _refuse(name, asker, door, call)
        return real(*args, **kwargs)

    return read


def _users_own(filename: str) -> bool:
    """A user's file: also not in any ``site-packages`` / ``dist-packages`` folder (an
    environment that reads another's packages through a ``.pth``), as ``own_code``."""
    return users_file(filename) and "-packages" not in filename


# NumPy calls that read the entropy and then set the state from their argument
# (``RandomState(seed)`` makes an unseeded MT19937 first; ``jumped()`` a new bit generator)
_RESEEDING = ("RandomState", "seed")
_OVERWRITING = ("jumped",)


def _seeds_deterministically(frame: types.FrameType, door: types.FrameType | None, call: ast.Call | None) -> bool:
    """Whether NumPy reads the entropy for ``call`` but the result does not depend on it
    (see ``_RESEEDING``); a seed that is ``None`` or a name bound to ``None`` does."""
    if call is None or door is None or door.f_code.co_qualname != "SystemRandom.getrandbits":
        return False
    callee = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
    if callee in _OVERWRITING:
        return True
    seed = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "seed"), None)
    if callee not in _RESEEDING or seed is None:
        return False
    if isinstance(seed, ast.Constant):
        return seed.value is not None
    if isinstance(seed, ast.Name):
        scope = {**frame.f_globals, **frame.f_locals}
        return scope.get(seed.id) is not None
    return True  # an expression: taken as a seed (a limit of the NOTE)


def _refuse(name: str, asker: types.FrameType, door: types.FrameType | None, call: ast.Call | None) -> None:
    filename = asker.f_code.co_filename
    line = linecache.getline(filename, asker.f_lineno).strip()
    if call is not None and door is not None:
        what = f"{ast.unparse(call.func)}(), which reads {name}()"
    elif door is not None:
        module = os.path.splitext(os.path.basename(door.f_code.co_filename))[0]
        what = f"{module}.{door.f_code.co_qualname}(), which reads {name}()"
    else:
        what = f"{name}()"
    raise SPMDCompileError(
        f"The train step draws from the OS's entropy ({what}): a compiled step runs its "
        "Python once, at capture, so every call would reuse the value drawn then, while "
        "eager draws a new one every call (NOTE: [host entropy at capture]).",
        user_line=SourceLocation(filename, asker.f_lineno, line),
        hint=_HINT,
    )


@contextlib.contextmanager
def refuse_entropy_reads() -> Iterator[None]:
    """While the step is traced, an entropy read the user's own code asked for raises
    (the NOTE)."""
    reals = {"os.urandom": os.urandom}
    if hasattr(os, "getrandom"):
        reals["os.getrandom"] = os.getrandom
    tracing = [True]
    with contextlib.ExitStack() as stack:
        stack.callback(tracing.__setitem__, 0, False)
        for module, key, name in users_globals_holding(reals):
            stack.enter_context(mock.patch.object(module, key, _refused(name, reals[name], tracing)))
        for name, real in reals.items():
            stack.enter_context(mock.patch.object(os, name.split(".")[1], _refused(name, real, tracing)))
        if getattr(random, "_urandom", None) is reals["os.urandom"]:
            stack.enter_context(mock.patch.object(random, "_urandom", _refused("os.urandom", reals["os.urandom"], tracing)))
        yield


__all__ = ["refuse_entropy_reads"]
