"""Which code and objects are the user's: what the guards walk and how arguments are keyed.

A *plain object* is an instance of a class that is not torch's, NumPy's, this
compiler's or a builtin, with a ``__dict__``, and not a function, module, class, tensor,
``nn.Module`` or optimizer: a config object, a trainer, a loss object with settings.
The guards walk its attributes (NOTE: [guards on Python values] in ``guards.py``). Such
an object passed to the step is keyed by its class (``keyed_by_class``), not by
identity: a new config object on every call with the same settings reuses the program,
since the guards compare what it holds (NOTE: [guards follow the call's objects]).
"""

from __future__ import annotations

import abc
import enum
import sys
import sysconfig
import types
import typing
from collections.abc import Iterator
from typing import Any

import torch

_SKIPPED_PACKAGES = frozenset({"torch", "spmd_compiler", "parallel_modes", "passes", "numpy"})
_STDLIB = sysconfig.get_paths()["stdlib"]


def skipped_module(name: str | None) -> bool:
    return name is None or name.split(".")[0] in _SKIPPED_PACKAGES or name in sys.builtin_module_names


def skipped_function(fn: types.FunctionType) -> bool:
    return skipped_module(fn.__globals__.get("__name__")) or fn.__code__.co_filename.startswith(_STDLIB)


def plain_object(value: Any) -> bool:
    """Objects whose attributes a forward may read as settings (a config object)."""
    if isinstance(value, (types.FunctionType, types.MethodType, types.ModuleType, type)):
        return False
    if isinstance(value, (torch.Tensor, torch.nn.Module, torch.optim.Optimizer)):
        return False
    return hasattr(value, "__dict__") and not skipped_module(type(value).__module__)


def stdlib_module(name: str | None) -> bool:
    """A module of the standard library (or a builtin one): its objects are not walked
    by name (a logger, ``linecache.cache``, ``os.environ``: NOTE: [guards below the
    walked depth])."""
    if name is None or name in sys.builtin_module_names:
        return True
    path = getattr(sys.modules.get(name), "__file__", None)
    return not isinstance(path, str) or (path.startswith(_STDLIB) and "-packages" not in path)


# bases that define no attribute of the user's and read none of their objects' (an
# abstract base, a generic class)
NEUTRAL_BASES = (object, abc.ABC, typing.Generic)


def users_class(cls: type) -> bool:
    """A class of the user's or a library's code: not torch's, NumPy's, this compiler's,
    a builtin or the standard library's (a notebook's ``__main__`` has no file: the
    user's)."""
    module = cls.__module__
    return not skipped_module(module) and (module == "__main__" or not stdlib_module(module))


def users_bases(cls: type) -> Iterator[type]:
    """``cls`` and its bases, in method resolution order, while they are the user's or a
    library's (``users_class``); the neutral ones skipped."""
    for owner in cls.__mro__:
        if owner in NEUTRAL_BASES:
            continue
        if not users_class(owner):
            return
        yield owner


def users_own_class(cls: type) -> bool:
    """A class of the user's own code: not an installed library's either."""
    path = getattr(sys.modules.get(cls.__module__), "__file__", None) or ""
    return users_class(cls) and "-packages" not in path


def read_by_name(cls: type) -> bool:
    """Whether code reads the attributes of a ``cls`` object only by naming them (NOTE:
    [guards on the names the code reads] in ``guards.py``): every class it derives from
    is the user's own (``nn.Module``, ``object``, ``abc.ABC`` and ``typing.Generic``
    aside), so no torch, library or standard library code of its own reads them (a
    subclass of ``nn.Dropout`` has torch's ``forward`` read ``self.p``; transformers hands
    its attention modules to functions it looks up at run time), and none computes
    attributes (``__getattr__``, ``__getattribute__``)."""
    for owner in cls.__mro__:
        if owner in NEUTRAL_BASES or owner is torch.nn.Module:
            continue
        if not users_own_class(owner):
            return False
        if "__getattr__" in owner.__dict__ or "__getattribute__" in owner.__dict__:
            return False
    return True


def keyed_by_class(value: Any) -> bool:
    """Whether an argument of the step is keyed by its class, its contents guarded: a
    plain object of a class with a source file outside the standard library (a
    ``functools.partial`` keeps its function where no guard sees it), not an enum
    member (keyed by value)."""
    if not plain_object(value) or isinstance(value, enum.Enum):
        return False
    return not stdlib_module(type(value).__module__)


__all__ = [
    "keyed_by_class", "plain_object", "read_by_name", "skipped_function", "skipped_module", "stdlib_module",
    "NEUTRAL_BASES", "users_bases", "users_class", "users_own_class",
]
