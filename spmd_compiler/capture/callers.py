"""Whose code calls a function the trace replaces: the user's, or a library's.

While the step is traced, a few Python functions refuse (reseeding torch's generator,
Python's and NumPy's random draws, the host clock, the OS's entropy: NOTE: [Python
effects at capture], NOTE: [host random numbers at capture], NOTE: [host clock at
capture], NOTE: [host entropy at capture]). They refuse only a call of the step's own:
one made on the tracing thread (a data-loading thread may draw meanwhile), from code the
rule is about. ``refusing`` builds that replacement for most of them (the entropy's
looks past the stdlib's doors to it first); the tests of the calling file live here.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import threading
import types
from collections.abc import Callable
from typing import Any, NoReturn

import torch

TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# files whose calls are their own business: torch, this project, the standard library
# and installed packages
_NOT_THE_USERS = tuple(
    os.path.abspath(p) + os.sep
    for p in {
        TORCH_DIR,
        os.path.join(_PACKAGE_ROOT, "spmd_compiler"),
        os.path.join(_PACKAGE_ROOT, "parallel_modes"),
        os.path.join(_PACKAGE_ROOT, "passes"),
        sysconfig.get_paths()["stdlib"],
        sysconfig.get_paths()["purelib"],
        sysconfig.get_paths()["platlib"],
    }
)


def from_torch(filename: str) -> bool:
    """Whether ``filename`` is torch's own code (its checkpointing forks the generator)."""
    return filename.startswith(TORCH_DIR)


_STDLIB = os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep


def from_stdlib(filename: str) -> bool:
    """Whether ``filename`` is Python's standard library (``tempfile`` draws its names
    from a ``random.Random`` of its own), not a package installed beside it."""
    path = os.path.abspath(filename)
    return path.startswith(_STDLIB) and "site-packages" not in path[len(_STDLIB):]


_OURS = os.path.join(_PACKAGE_ROOT, "spmd_compiler") + os.sep
_CHECKPOINT = os.path.join(TORCH_DIR, "utils", "checkpoint.py")


def called_from_torch_checkpoint() -> bool:
    """Whether the code calling the caller, past this package's frames (a refusing
    wrapper), is ``torch.utils.checkpoint``."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_OURS):
        frame = frame.f_back
    return frame is not None and os.path.abspath(frame.f_code.co_filename) == _CHECKPOINT


def users_file(filename: str) -> bool:
    """Whether ``filename`` is the user's code: not torch, this project, the standard
    library or an installed package, nor a file-less frame."""
    return not filename.startswith("<") and not os.path.abspath(filename).startswith(_NOT_THE_USERS)


def refusing(
    real: Callable[..., Any], refuse: Callable[[], NoReturn], refused_for: Callable[[str], bool]
) -> Callable[..., Any]:
    """``real`` for every caller but the tracing thread's calls from a file
    ``refused_for`` accepts, which ``refuse()`` (it raises). Build it on the tracing thread."""
    tracing_thread = threading.get_ident()

    def call(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() == tracing_thread and refused_for(sys._getframe(1).f_code.co_filename):
            refuse()
        return real(*args, **kwargs)

    return call


def users_globals_holding(reals: dict[str, Any]) -> list[tuple[Any, str, str]]:
    """(module, global name, key of ``reals``) for every global of a user's module that
    holds one of ``reals``' functions, imported by name (``from time import perf_counter``,
    ``from os import urandom``): the same function bound to another name, which patching
    its module's attribute does not reach."""
    by_id = {id(real): name for name, real in reals.items()}
    found = []
    for module in list(sys.modules.values()):
        filename = getattr(module, "__file__", None)
        if not isinstance(filename, str) or not users_file(filename):
            continue
        for key, value in list(vars(module).items()):
            name = by_id.get(id(value))
            if name is not None and value is reals[name]:
                found.append((module, key, name))
    return found
