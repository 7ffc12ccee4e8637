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
import collections.abc
import contextlib
import enum
import sys
import sysconfig
import types
import typing
import weakref
from collections.abc import Iterator
from typing import Any

import torch

# The guard walk reads nothing of these. Beside torch, numpy and ours: libraries that only
# show progress and log lines, whose objects and class attributes change as they run
# (tqdm starts a monitor thread and sets ``tqdm.monitor`` on its first bar: a step whose
# code named ``monitor`` and ``tqdm`` compiled again after the training loop's first bar,
# a peft LoRA step among them, 13 s) and hold no setting of what a step computes.
_DISPLAY_PACKAGES = frozenset({"tqdm", "rich", "loguru", "colorama", "termcolor"})
_SKIPPED_PACKAGES = frozenset({"torch", "spmd_compiler", "parallel_modes", "passes", "numpy"}) | _DISPLAY_PACKAGES
SKIPPED_PACKAGES = _SKIPPED_PACKAGES
_STDLIB = sysconfig.get_paths()["stdlib"]


def skipped_module(name: str | None) -> bool:
    return name is None or name.split(".")[0] in _SKIPPED_PACKAGES or name in sys.builtin_module_names


def skipped_function(fn: types.FunctionType) -> bool:
    return skipped_module(fn.__globals__.get("__name__")) or fn.__code__.co_filename.startswith(_STDLIB)


def own_code(code: types.CodeType) -> bool:
    """Code of the user's own: not in an installed library's file (torch's, transformers')
    nor the standard library's."""
    return "-packages" not in code.co_filename and not code.co_filename.startswith(_STDLIB)


def plain_object(value: Any) -> bool:
    """Objects whose attributes a forward may read as settings (a config object, one
    with ``__slots__`` too: ``@dataclass(slots=True)``)."""
    if isinstance(value, (types.FunctionType, types.MethodType, types.ModuleType, type)):
        return False
    if isinstance(value, (torch.Tensor, torch.nn.Module, torch.optim.Optimizer)):
        return False
    return holds_attributes(value) and not skipped_module(type(value).__module__)


def holds_attributes(value: Any) -> bool:
    """Whether ``value`` holds attributes ``attributes`` can read: a ``__dict__`` or
    ``__slots__``."""
    return hasattr(value, "__dict__") or bool(slot_names(type(value)))


def slot_names(cls: type) -> tuple[str, ...]:
    """The attributes the ``__slots__`` of ``cls`` and its bases hold (a private
    ``__x`` under its mangled name), ``__dict__`` and ``__weakref__`` aside. Cached per
    class (weakly)."""
    try:
        return _SLOT_NAMES[cls]
    except (KeyError, TypeError):
        pass
    names: list[str] = []
    for owner in cls.__mro__:
        slots = owner.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name in ("__dict__", "__weakref__"):
                continue
            if name.startswith("__") and not name.endswith("__"):
                name = f"_{owner.__name__.lstrip('_')}{name}"
            names.append(name)
    found = tuple(dict.fromkeys(names))
    with contextlib.suppress(TypeError):
        _SLOT_NAMES[cls] = found
    return found


_SLOT_NAMES: weakref.WeakKeyDictionary[type, tuple[str, ...]] = weakref.WeakKeyDictionary()


class Attributes(collections.abc.MutableMapping):
    """What an object with ``__slots__`` holds, its slots (those set) and its
    ``__dict__`` if it has one, as the mapping ``vars`` gives of other objects: what the
    guards and kept tensors read and write (NOTE: [guards on Python values] in
    ``guards.py``)."""

    __slots__ = ("obj", "order", "slots", "rest")

    def __init__(self, obj: Any, slots: tuple[str, ...]) -> None:
        self.obj, self.order, self.slots = obj, slots, frozenset(slots)
        self.rest: dict[str, Any] = vars(obj) if hasattr(obj, "__dict__") else {}

    def get(self, key: Any, default: Any = None) -> Any:
        if key in self.slots:
            try:
                return object.__getattribute__(self.obj, key)
            except AttributeError:  # not set
                return default
        return self.rest.get(key, default)

    def __getitem__(self, key: Any) -> Any:
        value = self.get(key, _UNSET)
        if value is _UNSET:
            raise KeyError(key)
        return value

    def __setitem__(self, key: Any, value: Any) -> None:
        if key in self.slots:
            object.__setattr__(self.obj, key, value)
        else:
            self.rest[key] = value

    def __delitem__(self, key: Any) -> None:
        if key in self.slots:
            try:
                object.__delattr__(self.obj, key)
            except AttributeError:
                raise KeyError(key) from None
        else:
            del self.rest[key]

    def __iter__(self) -> Iterator[str]:
        for key in self.order:  # ``slot_names`` order: no sort per guard check
            if self.get(key, _UNSET) is not _UNSET:
                yield key
        yield from self.rest

    def __len__(self) -> int:
        return sum(1 for _ in self)


_UNSET = object()


def attributes(obj: Any) -> Any:
    """``vars(obj)``, or for an object with ``__slots__`` a mapping of what they hold
    (``Attributes``)."""
    slots = slot_names(type(obj))
    return Attributes(obj, slots) if slots else vars(obj)


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
    "Attributes", "attributes", "holds_attributes", "keyed_by_class", "own_code", "slot_names", "plain_object", "read_by_name", "reads_its_own_way", "skipped_function", "skipped_module", "stdlib_module",
    "NEUTRAL_BASES", "users_bases", "users_class", "users_own_class",
]


# NOTE: [containers that read their own way]
# A subclass of dict, list or tuple may answer reads with its own code: transformers'
# ``_LazyAutoMapping(OrderedDict)`` keeps nothing in the dict and imports every model
# class in ``items()`` (which raised for a step whose code merely named such a mapping).
# The guards read what such a container stores by the base type's methods, never
# through its class: whether it is a constant, its snapshot (copied item by item, not by
# ``deepcopy``, which would call ``items()`` too), the comparison of each call's value
# with it (``dict.__eq__``) and its description in the key before capture. So a config
# of such a class (mmengine's ``ConfigDict`` over ``addict.Dict``, which defines
# ``__deepcopy__``) is still guarded by what it holds, and the lazy mapping, which
# stores nothing, costs nothing. Capture's walk for the tensors a step keeps reads its
# attributes instead of its items. Only methods written in Python count: a C type's
# (``OrderedDict``, ``defaultdict``, a struct sequence such as ``sys.version_info``,
# whose snapshot is the value itself: it cannot be made item by item) read its storage.
_ITEM_READERS = frozenset({
    "__iter__", "__getitem__", "__len__", "__contains__", "__eq__", "__ne__", "items",
    "keys", "values", "get", "__reduce__", "__reduce_ex__", "__deepcopy__", "__copy__",
})


_OWN_WAY: weakref.WeakKeyDictionary[type, bool] = weakref.WeakKeyDictionary()


def reads_its_own_way(cls: type) -> bool:
    """Whether ``cls`` (a dict, list or tuple subclass) reads its items in its own Python
    code (see the NOTE); cached per class (weakly)."""
    known = _OWN_WAY.get(cls)
    if known is None:
        known = _OWN_WAY[cls] = any(
            isinstance(owner.__dict__[name], (types.FunctionType, staticmethod, classmethod, property))
            for owner in cls.__mro__
            for name in _ITEM_READERS & owner.__dict__.keys()
        )
    return known
