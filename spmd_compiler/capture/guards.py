"""Guards on the Python values a captured train step read.

NOTE: [guards on Python values]
Tracing runs the user's Python once; every Python number, string or flag it reads (a
module attribute such as ``self.temperature`` or ``dropout.p``, a global, a closure
value, a non-tensor argument) is baked into the program as a constant. Each such value
is either a graph input (learning rates; float arguments, see NOTE: [float arguments as
graph inputs]) or a guard of the cached program: before a call reuses a program, every
guard is checked, and a changed value compiles a new program (logged with what
changed). What is guarded, found without running anything (over-guarding rather than
missing a value):
- every module and submodule of the step, and every module the code reaches by name (a
  global or closure loss module): the scalar entries of its ``__dict__`` (int,
  float, bool, str, None, torch dtypes and devices, NumPy scalars and arrays (by
  value), and tuples / lists / dicts of those),
  descending into plain objects it holds (a config object) up to ``OBJECT_DEPTH``, plus
  the number of entries of its ``__dict__`` (an attribute added later is seen);
- the code of the step function and of the ``forward`` of the modules' own classes (not
  torch's), and of every method, function they reach through ``self.name``, global
  names, attribute names and closure cells, transitively: each global or closure cell
  it names that holds a scalar, and each scalar attribute it names of a module, class
  or object it reaches that way;
- non-tensor arguments that are not graph inputs, and the scalar attributes of object
  arguments;
- the environment variables the capture read (``os.environ[...]``, ``os.getenv``), by
  the step or by a library it calls (a library's reads while it is first imported are
  its own settings and left out);
- the hooks that change what the step computes: each module's forward / backward (pre-)
  hooks, each optimizer's step pre- and post-hooks and torch's global module and
  optimizer hooks, by number and by identity (a hook registered after the compile ran
  nowhere before: the program had been traced without it). A hook on a parameter tensor
  is refused instead (NOTE: [hooks on parameters] in ``api.py``).
A check is a loop of dictionary lookups and identity tests (measured on the demo GPT in
the README). A value the trace itself changes (a Python counter in ``forward``) cannot be
replayed by a compiled program: the step is captured twice and refused if it changes
again.

NOTE: [guards follow the call's objects]
A guard reads a container found by walking the call that compiled the program: a
submodule's ``__dict__``, a config object's, a global namespace, a closure cell. A later
call may bring other objects: another model instance, a submodule or config object put
in place of another, a global rebound to a new config object. Reading the first call's
containers then checks the wrong objects: a model built with ``scale=3.0`` ran the
program traced with ``scale=1.0``, silently (and the guards kept the first model's
parameters alive). So the guards also record how the walk reached each container: the
call's submodules and optimizers (weakly, in walk order, with their classes) and every
link (a dict entry, a closure cell, an argument) through which it descended into an
object. A call whose submodules, optimizers or links are other objects derives the
guards afresh from its own objects and compares them with the program's, value for
value, code object for code object and class for class (a stateless ``nn.Sigmoid`` in
place of an ``nn.Tanh`` differs in nothing else): equal, the program runs and its guards
read the new objects from then on; different, the step compiles anew, logged with the
first difference. Checking the links costs a dictionary lookup and an identity test
each; the submodules and optimizers, one identity test each (4 us on an 8-layer GPT).
"""

from __future__ import annotations

import functools
import inspect
import operator
import os
import sys
import sysconfig
import types
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .bindings import StepBindings, numpy_kind
from .code_names import names_in

OBJECT_DEPTH = 2
_MISSING = object()
_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device)
# nn.Module internals that are not settings the forward reads.
_MODULE_INTERNALS = frozenset(
    {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "_state_dict_hooks"}
)
# the hooks that change what a module's forward and backward, or an optimizer's step,
# compute: one registered after the program was compiled is a change (NOTE: [guards on
# Python values]); the other hook dicts (state_dict, load) are not the step's
_MODULE_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_OPTIMIZER_HOOKS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")
_SKIPPED_PACKAGES = frozenset({"torch", "spmd_compiler", "parallel_modes", "passes", "numpy"})
_STDLIB = sysconfig.get_paths()["stdlib"]

# Entry kinds: read ``container.get(key)``, a closure cell, a step argument, a dict length,
# a tensor's identity and version (NOTE: [tensors read from outside the arguments]), how
# far an iterator has gone (``iterator_position``), the sizes of all hook dicts at once
# (one entry: four a module; its key names each dict).
_DICT, _CELL, _ARG, _LEN, _TENSOR, _ITERATOR, _HOOK_COUNTS = range(7)


@dataclass
class Guards:
    """The Python values one compiled program was traced with."""

    entries: list[tuple[int, Any, Any, Any]] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    # source files of the user code the walk reached (the pre-capture cache key hashes them)
    code_files: set[str] = field(default_factory=set)
    # how the walk reached the containers (NOTE: [guards follow the call's objects]): the
    # call's submodules, weakly, in ``StepBindings.submodules`` order; each link
    # (kind, container, key, object) it descended through; the code objects it walked
    roots: list[weakref.ref] = field(default_factory=list, repr=False)
    root_types: list[type] = field(default_factory=list, repr=False)
    links: list[tuple[int, Any, Any, Any]] = field(default_factory=list, repr=False)
    codes: list[types.CodeType] = field(default_factory=list, repr=False)
    # the same guards built from another call's objects (set by whoever built these)
    rebuild: Callable[[StepBindings], Guards] | None = field(default=None, repr=False)
    # the positions of the guards on a hook itself (``described`` leaves them out)
    hook_entries: set[int] = field(default_factory=set, repr=False)
    # the environment variables guarded (``add_environment``), kept by a rebuild
    environment: dict[str, str | None] = field(default_factory=dict, repr=False)

    def add(self, kind: int, container: Any, key: Any, expected: Any, name: str) -> None:
        self.entries.append((kind, container, key, _frozen(expected)))
        self.names.append(name)

    def first_change(self, bindings: StepBindings) -> str | None:
        """A description of the first guarded value that changed, or None."""
        for k, (kind, container, key, expected) in enumerate(self.entries):
            if kind == _DICT:  # most guards (attributes): the value itself, read inline
                value = container.get(key, _MISSING)
                if value is expected:
                    continue
                value = _frozen(value)
            elif kind == _LEN:  # the next most (a dict's size)
                value = len(container)
                if value == expected:
                    continue
            elif kind == _HOOK_COUNTS:
                value = tuple(map(len, container))
                if value == expected:
                    continue
                i = next(i for i, (a, b) in enumerate(zip(value, expected, strict=True)) if a != b)
                return f"the number of {key[i]} was {expected[i]}, now {value[i]}"
            else:
                value = _read(kind, container, key, bindings)
            if value is expected:
                continue
            if type(value) is not type(expected) or value != expected:
                return f"{self.names[k]} was {_show(expected)}, now {_show(value)}"
        return None

    def for_call(self, bindings: StepBindings) -> tuple[Guards, str | None]:
        """The guards that apply to this call's objects (these, or these derived afresh
        from other objects: NOTE: [guards follow the call's objects]) and the first
        guarded value that changed, or None."""
        if self.same_objects(bindings) or self.rebuild is None:
            return self, self.first_change(bindings)
        fresh = self.rebuild(bindings)
        fresh.add_environment(self.environment)
        difference = self.difference(fresh)
        if difference is not None:
            return self, difference
        return fresh, fresh.first_change(bindings)

    def same_objects(self, bindings: StepBindings) -> bool:
        """Whether the call's submodules and every link lead to the objects these guards
        were built from."""
        submodules, optimizers = bindings.submodules, bindings.optimizers
        if len(submodules) + len(optimizers) != len(self.roots):
            return False
        roots = [ref() for ref in self.roots]
        if not all(map(operator.is_, submodules, roots)):
            return False
        if not all(map(operator.is_, optimizers, roots[len(submodules):])):
            return False
        for kind, container, key, obj in self.links:
            if kind == _DICT:
                if container.get(key, _MISSING) is not obj:
                    return False
            elif kind == _CELL:
                try:
                    if container.cell_contents is not obj:
                        return False
                except ValueError:
                    return False
            elif key >= len(bindings.flat_args) or bindings.flat_args[key] is not obj:  # _ARG
                return False
        return True

    def difference(self, other: Guards) -> str | None:
        """How ``other`` (the same step walked on other objects) differs from these
        guards: the first value, or the code walked; None when they are the same."""
        if len(other.codes) != len(self.codes) or not all(map(operator.is_, other.codes, self.codes)):
            return "the code the step reaches was replaced"
        if other.root_types != self.root_types:  # nn.Tanh for nn.Sigmoid: no attribute differs
            return "a submodule or optimizer of the step is of another class"
        for k, (name, (_, _, _, expected)) in enumerate(zip(self.names, self.entries, strict=True)):
            if k >= len(other.entries) or other.names[k] != name:
                return f"the Python values the step reads changed ({name} is not read the same way)"
            value = other.entries[k][3]
            if value is not expected and (type(value) is not type(expected) or value != expected):
                return f"{name} was {_show(expected)}, now {_show(value)}"
        if len(other.entries) != len(self.entries):
            extra = other.names[len(self.entries)]
            return f"the Python values the step reads changed ({extra} is read as well)"
        return None

    def add_tensor(self, container: Any, key: Any, tensor: Any, version: int, name: str) -> None:
        """``tensor`` must stay at ``container[key]`` (a dict, or a closure cell with key
        None) with its version counter at ``version`` (NOTE: [tensors read from outside
        the arguments])."""
        self.entries.append((_TENSOR, container, (key, tensor), ("the same tensor", version)))
        self.names.append(name)

    def add_environment(self, reads: dict[str, str | None]) -> None:
        """The environment variables the capture read (name -> value, None when unset)
        keep those values (``os.getenv("SCALE")`` in the step: a new value recompiles)."""
        self.environment.update(reads)
        for name, value in reads.items():
            if name.startswith("<"):  # the whole environment was iterated: no one value
                continue
            self.add(_DICT, os.environ, name, _MISSING if value is None else value,
                     f"environment variable {name}")

    def __len__(self) -> int:
        return len(self.entries)

    def described(self) -> list[tuple[str, Any]]:
        """Each guard's name and the value it holds (the pre-capture cache key), but the
        hooks themselves: that key describes them by their code (``step_key``)."""
        return [(name, ["unset"] if expected is _MISSING else expected)
                for k, (name, (_, _, _, expected)) in enumerate(zip(self.names, self.entries, strict=True))
                if k not in self.hook_entries]


def _read(kind: int, container: Any, key: Any, bindings: StepBindings) -> Any:
    """The current value of a guard of any kind but ``_DICT`` (``first_change`` reads
    those inline: most guards are attributes)."""
    if kind == _TENSOR:
        name, tensor = key
        if isinstance(container, types.CellType):
            try:
                current = container.cell_contents
            except ValueError:
                current = _MISSING
        else:
            current = container.get(name, _MISSING)
        return ("the same tensor", tensor._version) if current is tensor else ("another value",)
    if kind == _LEN:
        return len(container)
    if kind == _ITERATOR:
        return iterator_position(container)
    if kind == _CELL:
        try:
            return _frozen(container.cell_contents)
        except ValueError:
            return _MISSING
    return _frozen(bindings.flat_args[key])


def _frozen(value: Any) -> Any:
    """Mutable containers compared by content (lists become tuples; a NumPy array its
    dtype, shape and values, a NumPy scalar its dtype and value)."""
    if type(value) is list:
        return tuple(_frozen(v) for v in value)
    if type(value) is dict:
        return tuple((k, _frozen(v)) for k, v in value.items())
    numpy = numpy_kind(value)
    if numpy == "scalar":
        return ("numpy", str(value.dtype), value.item())
    if numpy == "array":
        values = value.tolist() if value.size <= NUMPY_VALUES else value.tobytes()
        return ("numpy array", str(value.dtype), value.shape, _frozen(values))
    return value


# a NumPy array guarded by more values than this is compared by its bytes (which the
# persistent cache's key cannot describe: such a step has no key before capture)
NUMPY_VALUES = 4096


def iterator_position(value: Any) -> Any:
    """How far an iterator the step can reach has gone, for the iterators whose position
    can be read (``itertools.count``, a generator's frame, a list or range iterator, a
    DataLoader's iterator); None for anything else. ``next(counter)`` in the step changes
    it at capture, which the guards then refuse (the program would reuse the value the
    capture drew: NOTE: [guards on Python values])."""
    if isinstance(value, (torch.Tensor, str, bytes, dict, list, tuple)) or not hasattr(value, "__next__"):
        return None
    if isinstance(value, types.GeneratorType):
        frame = value.gi_frame
        if frame is None:
            return ("finished",)
        scalars = tuple((k, v) for k, v in frame.f_locals.items() if is_scalar(v))
        return ("generator", frame.f_lasti, scalars)
    yielded = getattr(value, "_num_yielded", None)  # torch's DataLoader iterators
    if isinstance(yielded, int):
        return ("yielded", yielded)
    try:
        reduced = value.__reduce__()
    except Exception:  # noqa: BLE001 - an iterator that cannot say where it is
        return None
    state = [part for part in reduced[1:] if is_scalar(part)] if isinstance(reduced, tuple) else []
    return (type(value).__name__, *state) if state else None


def _show(value: Any) -> str:
    return "unset" if value is _MISSING else repr(value)


def is_scalar(value: Any) -> bool:
    """Python values a trace bakes in as constants (and containers of them)."""
    if isinstance(value, _SCALARS) or numpy_kind(value) is not None:
        return True
    if type(value) in (tuple, list):
        return all(is_scalar(v) for v in value)
    if type(value) is dict:
        return all(isinstance(k, _SCALARS) and is_scalar(v) for k, v in value.items())
    return False


def build_guards(
    func: Any, bindings: StepBindings, graph_args: frozenset[int], skipped: frozenset[int] = frozenset()
) -> Guards:
    """Guards for a program traced from ``func`` on ``bindings`` (see the NOTE).

    Args:
        graph_args: positions in ``bindings.flat_args`` fed to the program as inputs.
        skipped: ids of containers not to guard: the lists the step appends to (NOTE:
            [tensors the step keeps]), which change every call by design.
    """
    from .. import _torch_private as private

    guards = Guards()
    roots = [*bindings.submodules, *bindings.optimizers]
    guards.roots = [weakref.ref(root) for root in roots]
    guards.root_types = [type(root) for root in roots]
    walker = _Walker(guards, skipped)
    for label, hooks in private.global_hook_dicts():
        walker.hooks(hooks, label)
    for oi, opt in enumerate(bindings.optimizers):
        for key in _OPTIMIZER_HOOKS:
            found = vars(opt).get(key)
            if isinstance(found, dict):
                walker.hooks(found, f"{_hook_kind(key)} of optimizer[{oi}]")
    for i, arg in enumerate(bindings.flat_args):
        if isinstance(arg, (torch.Tensor, torch.nn.Module, torch.optim.Optimizer)):
            continue
        if i in graph_args or id(arg) in skipped:
            continue
        if is_scalar(arg):
            guards.add(_ARG, None, i, arg, f"argument {i} of the step")
            continue
        guards.links.append((_ARG, None, i, arg))
        if walker.iterator(arg, f"argument {i} of the step"):
            continue
        if hasattr(arg, "__dict__"):
            walker.object_dict(arg, f"argument {i} of the step", OBJECT_DEPTH)
    classes: dict[type, None] = {}
    for mi, mod in enumerate(bindings.modules):
        for fqn, sub in mod.named_modules():
            name = (f"{mi}." if len(bindings.modules) > 1 else "") + (fqn or "<root>")
            walker.module(sub, f"module {name}")
            for fn in functions_of(inspect.getattr_static(type(sub), "forward", None)):
                if not skipped_function(fn):  # iterators its forward names (next(self.it))
                    walker.named_iterators(sub, fn, f"module {name}")
            classes.setdefault(type(sub))
    walker.callable(func)
    for cls in classes:
        if not skipped_module(cls.__module__):
            for fn in functions_of(inspect.getattr_static(cls, "forward", None)):
                walker.function(fn, cls)
    walker.counted_hooks()
    return guards


def functions_of(value: Any) -> Iterator[types.FunctionType]:
    if isinstance(value, (staticmethod, classmethod, types.MethodType)):
        value = value.__func__
    if isinstance(value, property):
        yield from (f for f in (value.fget, value.fset) if isinstance(f, types.FunctionType))
    elif isinstance(value, types.FunctionType):
        yield value


def skipped_module(name: str | None) -> bool:
    return name is None or name.split(".")[0] in _SKIPPED_PACKAGES or name in sys.builtin_module_names


def skipped_function(fn: types.FunctionType) -> bool:
    return skipped_module(fn.__globals__.get("__name__")) or fn.__code__.co_filename.startswith(_STDLIB)


class _Walker:
    def __init__(self, guards: Guards, skipped: frozenset[int] = frozenset()) -> None:
        self.guards = guards
        self.skipped = skipped
        self.seen_code: set[int] = set()
        self.seen_objects: set[int] = set()
        self.hook_dicts: list[dict] = []
        self.hook_names: list[str] = []

    def counted_hooks(self) -> None:
        """One guard on the sizes of every hook dict the walk met (hundreds: a length
        test each, in one C loop)."""
        if self.hook_dicts:
            self.guards.add(
                _HOOK_COUNTS, self.hook_dicts, tuple(self.hook_names),
                tuple(map(len, self.hook_dicts)), "the number of hooks",
            )

    def module(self, mod: torch.nn.Module, name: str) -> None:
        d = mod.__dict__
        self.guards.add(_LEN, d, None, len(d), f"the number of attributes of {name}")
        for key in _MODULE_HOOKS:
            hooks = d.get(key)
            if isinstance(hooks, dict):
                self.hooks(hooks, f"{_hook_kind(key)} of {name}")
        for key, value in d.items():
            if key in _MODULE_INTERNALS or "hook" in key or isinstance(value, torch.nn.Module):
                continue
            self.value_in_dict(d, key, value, f"{name}.{key}", OBJECT_DEPTH)

    def reached_module(self, mod: torch.nn.Module, name: str) -> None:
        """A module the step reaches by name, not by argument (a global or closure
        ``criterion = nn.CrossEntropyLoss(label_smoothing=0.1)``): each submodule's
        settings and hooks, its own classes' ``forward`` code, and which submodule sits
        where (a call that finds another derives the guards afresh)."""
        if id(mod) in self.seen_objects:
            return
        self.seen_objects.add(id(mod))
        for fqn, sub in mod.named_modules():
            self.module(sub, f"{name}.{fqn}" if fqn else name)
            for child_name, child in sub._modules.items():
                self.link(_DICT, sub._modules, child_name, child)
            if not skipped_module(type(sub).__module__):
                for fn in functions_of(inspect.getattr_static(type(sub), "forward", None)):
                    self.function(fn, type(sub))

    def hooks(self, hooks: dict, name: str) -> None:
        """A hook registered or removed after the capture changes what the step
        computes: their number (one guard for all the dicts: ``counted_hooks``), and
        each one by identity, are guards."""
        self.hook_dicts.append(hooks)
        self.hook_names.append(name)
        for position, (handle, hook) in enumerate(hooks.items()):  # named by position:
            # handles count up per process, so another model's are other numbers
            self.guards.hook_entries.add(len(self.guards.entries))
            self.guards.add(_DICT, hooks, handle, hook, f"{name} #{position}")

    def link(self, kind: int, container: Any, key: Any, value: Any) -> None:
        """The walk goes on into ``value``, found at ``container[key]``: a call that
        finds another object there derives the guards afresh (NOTE: [guards follow the
        call's objects])."""
        self.guards.links.append((kind, container, key, value))

    def value_in_dict(self, d: dict, key: Any, value: Any, name: str, depth: int) -> None:
        if isinstance(value, torch.Tensor) or id(value) in self.skipped:
            return
        if is_scalar(value):
            self.guards.add(_DICT, d, key, value, name)
        elif iterator_position(value) is not None:
            # an iterator found by walking a whole object (a trainer's data iterator,
            # advanced between calls) is guarded only where the step's code names it
            # (``named_iterators``)
            return
        elif type(value) is dict and depth > 0:
            self.link(_DICT, d, key, value)
            self.guards.add(_LEN, value, None, len(value), f"the number of entries of {name}")
            for k, v in value.items():
                self.value_in_dict(value, k, v, f"{name}[{k!r}]", depth - 1)
        elif depth > 0 and plain_object(value):
            self.link(_DICT, d, key, value)
            self.object_dict(value, name, depth - 1)

    def object_dict(self, obj: Any, name: str, depth: int) -> None:
        if id(obj) in self.seen_objects:  # a config object many submodules share
            return
        self.seen_objects.add(id(obj))
        d = vars(obj)
        for k, v in list(d.items()):
            self.value_in_dict(d, k, v, f"{name}.{k}", depth)

    def callable(self, func: Any) -> None:
        """The step: a function, a bound method, a ``functools.partial`` or an object
        with ``__call__``."""
        if isinstance(func, functools.partial):  # its own arguments cannot change
            self.callable(func.func)
            return
        if isinstance(func, types.MethodType):
            if plain_object(func.__self__):
                self.object_dict(func.__self__, type(func.__self__).__name__, OBJECT_DEPTH)
                self.named_iterators(func.__self__, func.__func__, type(func.__self__).__name__)
            func = func.__func__
        if isinstance(func, types.FunctionType):
            self.function(func)
        elif plain_object(func):
            self.object_dict(func, type(func).__name__, OBJECT_DEPTH)
            for fn in functions_of(inspect.getattr_static(type(func), "__call__", None)):
                self.function(fn, type(func))

    def named_iterators(self, obj: Any, fn: Any, name: str) -> None:
        """The iterator attributes of ``obj`` that ``fn``'s code names (``next(self.ticks)``)."""
        code = getattr(fn, "__code__", None)
        if code is None or not hasattr(obj, "__dict__"):
            return
        d = vars(obj)
        for attribute in sorted(set(names_in(code)) & d.keys()):
            if self.iterator(d[attribute], f"{name}.{attribute}"):
                self.link(_DICT, d, attribute, d[attribute])

    def function(self, fn: types.FunctionType, cls: type | None = None) -> None:
        """Walk ``fn``'s code; with ``cls``, the methods of ``cls`` it names too (the
        helpers a ``forward`` calls through ``self``)."""
        if id(fn.__code__) in self.seen_code or skipped_function(fn):
            return
        self.seen_code.add(id(fn.__code__))
        self.guards.codes.append(fn.__code__)
        self.guards.code_files.add(fn.__code__.co_filename)
        where = f"{fn.__qualname__} ({fn.__code__.co_filename}:{fn.__code__.co_firstlineno})"
        names = sorted(set(names_in(fn.__code__)))  # sorted: the same walk every time
        if cls is not None:
            for name in names:
                for method in functions_of(inspect.getattr_static(cls, name, None)):
                    self.function(method, cls)
        reached: list[Any] = []
        for name in names:
            value = fn.__globals__.get(name, _MISSING)
            if value is not _MISSING:
                self.reach(fn.__globals__, name, value, f"global {name!r} read by {where}", names, reached)
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True):
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            if id(value) in self.skipped:
                continue
            if is_scalar(value):
                self.guards.add(_CELL, cell, None, value, f"closure value {name!r} of {where}")
                continue
            self.link(_CELL, cell, None, value)
            if not self.iterator(value, f"closure value {name!r} of {where}"):
                reached.append(value)
        for obj in reached:
            self.attributes(obj, set(names), where)

    def reach(self, d: dict, name: str, value: Any, label: str, names: list[str], reached: list) -> None:
        if id(value) in self.skipped:
            return
        if is_scalar(value):
            self.guards.add(_DICT, d, name, value, label)
            return
        self.link(_DICT, d, name, value)
        if not self.iterator(value, label):
            reached.append(value)

    def iterator(self, value: Any, label: str) -> bool:
        """Guard where an iterator the step reaches has got to; whether it was one."""
        position = iterator_position(value)
        if position is None:
            return False
        self.guards.add(_ITERATOR, value, None, position, f"the position of iterator {label}")
        return True

    def attributes(self, obj: Any, names: set[str], where: str) -> None:
        """Functions ``obj`` leads to are walked; the scalar attributes the code names
        (``config.scale``) are guarded."""
        for fn in functions_of(obj):
            self.function(fn)
            return
        if isinstance(obj, torch.nn.Module):
            self.reached_module(obj, f"{type(obj).__name__} read by {where}")
            return
        if isinstance(obj, torch.Tensor) or not hasattr(obj, "__dict__"):
            return
        if isinstance(obj, types.ModuleType) and skipped_module(obj.__name__):
            return
        if isinstance(obj, type) and skipped_module(obj.__module__):
            return
        d = vars(obj)
        for name in sorted(names & d.keys()):
            value = d[name]
            if id(value) in self.skipped:
                continue
            label = f"{getattr(obj, '__name__', type(obj).__name__)}.{name} read by {where}"
            if is_scalar(value):
                self.guards.add(_DICT, d, name, value, label)
                continue
            self.link(_DICT, d, name, value)
            if not self.iterator(value, label):
                for fn in functions_of(value):
                    self.function(fn)


def _hook_kind(key: str) -> str:
    """``_forward_pre_hooks`` -> ``forward pre-hooks``, ``_optimizer_step_post_hooks``
    -> ``step post-hooks``."""
    words = key.strip("_").removeprefix("optimizer_").split("_")
    if words[-2] in ("pre", "post"):
        return " ".join([*words[:-2], f"{words[-2]}-{words[-1]}"])
    return " ".join(words)


def plain_object(value: Any) -> bool:
    """Objects whose attributes a forward may read as settings (a config object)."""
    if isinstance(value, (types.FunctionType, types.MethodType, types.ModuleType, type)):
        return False
    if isinstance(value, (torch.Tensor, torch.nn.Module, torch.optim.Optimizer)):
        return False
    return hasattr(value, "__dict__") and not skipped_module(type(value).__module__)


