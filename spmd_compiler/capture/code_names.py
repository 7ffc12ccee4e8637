"""The names a function's code reads, its nested code (comprehensions, lambdas, inner
functions) included: the globals a step can reach by name (guards, kept tensors, the
GradScalers and LR schedulers a step uses)."""

from __future__ import annotations

import contextlib
import dis
import functools
import inspect
import linecache
import sys
import types
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from ..errors import SourceLocation
from .plain_objects import skipped_function


def names_in(code: types.CodeType) -> Iterator[str]:
    """``co_names`` of ``code`` and of every code object nested in it."""
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from names_in(const)


# NOTE: [globals by the bytecode]
# ``co_names`` holds the names of attributes (``LOAD_ATTR``, ``LOAD_METHOD``) and of
# globals (``LOAD_GLOBAL``) alike. Looking each of them up as a global guarded a script's
# global that merely shares an attribute's name: a loss log ``out = []`` appended every
# call, with a model reading ``self.out``, compiled a new program on every call (6
# programs for 6 calls, the warning naming ``global out``, which ``forward`` never reads).
# The globals a code reads are the names of its global loads: ``LOAD_GLOBAL``, and
# ``LOAD_NAME`` / ``LOAD_FROM_DICT_OR_GLOBALS`` (a class body's names, which fall back to
# the globals), on every Python from 3.10 to 3.13 (``dis`` gives the name, without 3.11's
# NULL bit). A global only stored (``global seen; seen = 1``) is not read by that code.
_GLOBAL_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "LOAD_FROM_DICT_OR_GLOBALS"})
_GLOBAL_NAMES: dict[types.CodeType, tuple[str, ...]] = {}


def global_names_in(code: types.CodeType) -> tuple[str, ...]:
    """The names ``code`` and its nested code (comprehensions, lambdas, inner functions,
    class bodies) load as globals (NOTE: [globals by the bytecode]), in order of first
    load. Cached per code object."""
    found = _GLOBAL_NAMES.get(code)
    if found is None:
        names: dict[str, None] = {}
        for instruction in dis.get_instructions(code):
            if instruction.opname in _GLOBAL_LOADS and isinstance(instruction.argval, str):
                names.setdefault(instruction.argval)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                names.update(dict.fromkeys(global_names_in(const)))
        found = _GLOBAL_NAMES[code] = tuple(names)
    return found


def strings_in(code: types.CodeType) -> Iterator[str]:
    """The string constants of ``code`` and its nested code that are identifiers: the
    attribute names a ``getattr(obj, "name")`` and the keys a ``d["name"]`` read."""
    for const in code.co_consts:
        if isinstance(const, str) and const.isidentifier():
            yield const
        elif isinstance(const, types.CodeType):
            yield from strings_in(const)


_METHOD_LOADS = frozenset({"LOAD_METHOD"})
_STORES = frozenset({"STORE_ATTR", "DELETE_ATTR", "STORE_GLOBAL", "DELETE_GLOBAL", "STORE_NAME", "DELETE_NAME"})
_VALUE_NAMES: dict[types.CodeType, frozenset[str]] = {}


def value_names_in(code: types.CodeType) -> frozenset[str]:
    """The names of ``code`` (and its nested code) read as values: not those only stored
    (``self.seen = 0``) or named as a method called at once (``optim.step()``: a counter
    ``trainer.step`` is no such method, calling it would raise). Cached per code
    object."""
    found = _VALUE_NAMES.get(code)
    if found is None:
        names: set[str] = set()
        for instruction in dis.get_instructions(code):
            if not isinstance(instruction.argval, str) or instruction.opname == "LOAD_CONST":
                continue
            if instruction.opname in _STORES:  # ``self.seen = 0`` reads nothing
                continue
            if instruction.opname in _METHOD_LOADS or (  # 3.12+: LOAD_ATTR, low bit set
                sys.version_info >= (3, 12) and instruction.opname == "LOAD_ATTR" and (instruction.arg or 0) & 1
            ):
                continue
            names.add(instruction.argval)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                names |= value_names_in(const)
        found = _VALUE_NAMES[code] = frozenset(names)
    return found


# functions that read an attribute by a name given as an argument: the position of that
# argument (``getattr(obj, name)``: 2; ``obj.__getattribute__(name)``: the last, 0)
_NAME_ARGUMENT = {"getattr": 2, "hasattr": 2, "getattr_static": 2, "__getattribute__": 0}
# readers whose names cannot be told from the call (``attrgetter("a.b")``,
# ``methodcaller(name)``): always computed
_ALWAYS_COMPUTED = frozenset({"attrgetter", "methodcaller"})
_LOADS = frozenset(
    {"LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF", "LOAD_FAST", "LOAD_ATTR", "LOAD_METHOD", "LOAD_CLASSDEREF",
     "LOAD_FROM_DICT_OR_DEREF", "LOAD_FROM_DICT_OR_GLOBALS", "LOAD_FAST_CHECK", "LOAD_FAST_LOAD_FAST"}
)
_CALLS = frozenset({"PRECALL", "CALL", "CALL_FUNCTION", "CALL_METHOD"})
_JUMPS = frozenset(dis.hasjrel) | frozenset(dis.hasjabs)
_COMPUTED: dict[types.CodeType, bool] = {}


def reads_computed_attributes(code: types.CodeType) -> bool:
    """Whether ``code`` (or its nested code) reads an attribute by a name it computes:
    ``getattr(self, "gain_" + kind)``, ``hasattr(cfg, f"use_{x}")``,
    ``reduce(getattr, path.split("."), obj)``. A call whose name argument is a string
    constant (``getattr(self, "scale", 1.0)``) is not: ``strings_in`` has that name.
    Anything this cannot follow (a branch or a ``*args`` call among the arguments, an
    unknown opcode) counts as computed. Cached per code object."""
    found = _COMPUTED.get(code)
    if found is None:
        instructions = list(dis.get_instructions(code))
        found = any(
            i.opname in _LOADS and i.argval in _ALWAYS_COMPUTED
            or i.opname in _LOADS and i.argval in _NAME_ARGUMENT and _constant_name(instructions, n) is None
            for n, i in enumerate(instructions)
        ) or any(reads_computed_attributes(c) for c in code.co_consts if isinstance(c, types.CodeType))
        _COMPUTED[code] = found
    return found


_PROBED: dict[types.CodeType, frozenset[str]] = {}
# names whose use in a function makes every attribute name it reads one that may be absent
_PROBING_NAMES = frozenset({"AttributeError", "__dict__", "vars"})


def probed_names(code: types.CodeType) -> frozenset[str]:
    """The attribute names ``code`` (or its nested code) reads by a constant that may
    be absent: ``getattr(opt, "count", 0)``, ``hasattr(self, "cache")``, and every name
    read by code that catches ``AttributeError`` or reads ``__dict__`` / ``vars``. A guard of the
    object each is read from must see it appear (NOTE: [names read that may be absent]
    in ``guards.py``). Cached per code object."""
    found = _PROBED.get(code)
    if found is None:
        instructions = list(dis.get_instructions(code))
        names = {
            name for n, i in enumerate(instructions)
            if i.opname in _LOADS and i.argval in ("getattr", "hasattr")
            and (name := _constant_name(instructions, n)) is not None
        }
        if _PROBING_NAMES & set(code.co_names):
            # ``try: s = opt.scale / except AttributeError``, ``opt.__dict__.get("scale")``,
            # ``"scale" in vars(opt)``: any name it reads may be absent
            names |= {n for n in names_in(code) if n.isidentifier()} | set(strings_in(code))
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                names |= probed_names(const)
        found = _PROBED[code] = frozenset(names)
    return found


def _constant_name(instructions: list[dis.Instruction], at: int) -> str | None:
    """The identifier constant the reader loaded at ``instructions[at]`` is called with at
    once as its name argument, or None (a stack walk over its arguments)."""
    position = _NAME_ARGUMENT[instructions[at].argval]
    depth, depths = 0, []  # values pushed since the reader, after each instruction
    previous = ""
    for instruction in instructions[at + 1 :]:
        # 3.11 calls are PRECALL n then CALL n: the CALL is the same call
        called = instruction.opname in _CALLS and not (instruction.opname == "CALL" and previous == "PRECALL")
        previous = instruction.opname
        if called and depth == (instruction.arg or 0):
            argc = depth
            break
        if instruction.opcode in _JUMPS or instruction.opname.startswith(("CALL_FUNCTION_", "CALL_KW")):
            return None
        try:
            depth += dis.stack_effect(
                instruction.opcode, instruction.arg if instruction.opcode >= dis.HAVE_ARGUMENT else None
            )
        except ValueError:
            return None
        if depth < 0:  # the reader was handed on (``reduce(getattr, ...)``), not called
            return None
        depths.append(depth)
    else:
        return None
    k = position or argc
    if not 1 <= k <= argc:
        return None
    # the k-th argument ends where the depth last comes down to k, and starts after the
    # last point before that where it stood at k - 1
    end = max(n for n, d in enumerate(depths) if d == k and all(e >= k for e in depths[n:]))
    start = max((n for n, d in enumerate(depths[:end]) if d == k - 1), default=-1)
    if end != start + 1:
        return None
    name = instructions[at + 1 + end]
    if name.opname == "LOAD_CONST" and isinstance(name.argval, str) and name.argval.isidentifier():
        return name.argval
    return None


def step_function(func: Any) -> types.FunctionType | None:
    """The Python function a step callable runs: the function itself, a bound method's
    (a classmethod's too), a ``functools.partial``'s, a callable object's ``__call__``;
    None for anything else (a builtin)."""
    for _ in range(16):  # a partial of a bound method of ...
        if isinstance(func, types.FunctionType):
            return func
        if isinstance(func, types.MethodType):
            func = func.__func__
        elif isinstance(func, functools.partial):
            func = func.func
        else:
            call = inspect.getattr_static(type(func), "__call__", None)
            if not isinstance(call, types.FunctionType):
                return None
            func = call
    return None


def step_code(func: Any) -> types.CodeType:
    """The code of the function a step callable runs (``step_function``).

    Raises:
        TypeError: a callable without Python code (checked when the step is compiled).
    """
    fn = step_function(func)
    if fn is None:
        raise TypeError(f"{func!r} runs no Python function")
    return fn.__code__


def step_where(func: Any) -> str:
    """``file:line`` of the function a step callable runs (for errors)."""
    fn = step_function(func)
    return f"{fn.__code__.co_filename}:{fn.__code__.co_firstlineno}" if fn is not None else repr(func)


def return_line(func: Any) -> SourceLocation | None:
    """The line of the ``return`` statement of the function a step callable runs (its
    last, where it has several), for an error about what the step returns: the values
    are looked at after the step's frame is gone, so no frame of the step names it."""
    fn = step_function(func)
    if fn is None:
        return None
    code = fn.__code__
    found = None
    for instruction in dis.get_instructions(code):
        line = instruction.positions.lineno if instruction.positions is not None else None
        if instruction.opname in ("RETURN_VALUE", "RETURN_CONST") and line is not None:
            text = linecache.getline(code.co_filename, line).strip()
            if text.startswith("return"):
                found = SourceLocation(code.co_filename, line, text)
    return found


def step_name(func: Any) -> str:
    """A step callable's name for logs: a function's or method's own, a partial's
    function's, a callable object's class."""
    if isinstance(func, (types.FunctionType, types.MethodType)):
        return func.__name__
    if isinstance(func, functools.partial):
        return step_name(func.func)
    return getattr(func, "__name__", None) or type(func).__name__


def partial_arguments(func: Any) -> tuple[Any, list[tuple[Any, str]]]:
    """NOTE: [modules bound by a partial]
    The callable a ``functools.partial`` (or a partial of a partial: a subclass's is not
    merged by ``functools``) calls, and the values it binds, each with where (for
    messages): ``partial(step, model, opt)`` binds the step's model as a closure
    variable would. Before 2026-12-06 the module search did not look there, so such a
    step was refused as training no nn.Module although README lists a partial as a step
    (``tests/sim/test_step_callables.py``). The guards walk what a partial binds already
    (``guards.code_of``). ``func`` itself and [] for anything else."""
    bound: list[tuple[Any, str]] = []
    for _ in range(16):
        if not isinstance(func, functools.partial):
            break
        bound += [(v, f"argument {i} of the partial") for i, v in enumerate(func.args)]
        bound += [(v, f"keyword {k!r} of the partial") for k, v in func.keywords.items()]
        func = func.func
    return func, bound


# NOTE: [optimizers held in containers]
# Parallel WaveGAN's (and ESPnet-style) trainers keep ``self.optimizer = {"generator":
# AdamW(...), "discriminator": AdamW(...)}`` and a matching ``self.scheduler`` dict, and
# step ``self.optimizer["generator"].step()``. The same dict passed as an argument was
# found (pytree opens it), but one on the step's object, a global or a closure variable
# was not: only values that were themselves optimizers / schedulers / scalers counted.
# Before the sixty-ninth session such a step was refused, and with the usual
# ``zero_grad()`` first the refusal spoke of "parameter 0.weight ... held outside its
# modules", a name the user never wrote (NOTE: [optimizers the step was not given] in
# ``capture/optimizers_not_passed.py``). The values of dicts, lists and tuples (nested,
# ``_CONTAINER_DEPTH`` deep) among what a step reaches by name are searched as the plain
# values are. The names are found anew on every call, so the search is bounded: the
# containers opened for one value hold at most ``_CONTAINER_ENTRIES`` entries in all, and
# a container that would pass that is not opened (walked whole, a trainer's list of
# 1,000 tensors cost 0.6 ms per call and kind; within the bound a search costs at most
# about 35 us, a dict of two optimizers about 1.3 us). An optimizer
# only beyond it is refused as not among the step's optimizers (a scheduler or scaler as
# one the step cannot name), never guessed. Modules are not searched in containers
# (``containers=False``): README documents a module reached only through a dict as
# refused, naming it, with the advice to pass it.
_CONTAINER_DEPTH = 3
_CONTAINER_ENTRIES = 64


def held_in_containers(value: Any, kind: type | tuple[type, ...], depth: int = _CONTAINER_DEPTH) -> list[Any]:
    """``[value]`` where it is of ``kind``; else the objects of ``kind`` among the values
    of ``value`` when it is a dict, list or tuple, searched ``depth`` containers deep, in
    order, opening at most ``_CONTAINER_ENTRIES`` entries in all (NOTE: [optimizers held
    in containers])."""
    if isinstance(value, kind):
        return [value]
    if depth <= 0 or not isinstance(value, (dict, list, tuple)):  # most values: no walk
        return []
    found: list[Any] = []
    left = _CONTAINER_ENTRIES

    def visit(item: Any, deeper: int) -> None:
        nonlocal left
        if isinstance(item, kind):
            found.append(item)
        elif deeper > 0 and isinstance(item, (dict, list, tuple)):
            # the built-in types' own methods: a subclass's are its code, which the walk
            # must not run (transformers' lazy registries import every model when read)
            entries: list[Any] = (
                list(dict.values(item)) if isinstance(item, dict)
                else list(list.__iter__(item)) if isinstance(item, list)
                else list(tuple.__iter__(item))
            )
            if len(entries) > left:
                return
            left -= len(entries)
            for entry in entries:
                visit(entry, deeper - 1)

    visit(value, depth)
    return found


def reachable_by_name(
    func: Callable[..., Any], flat_args: list[Any], kind: type | tuple[type, ...], holders: Sequence[Any] = (),
    *, containers: bool = True,
) -> list[Any]:
    """The objects of ``kind`` a step can reach by name: its arguments, the globals its
    code names, its closure variables, for a bound method the attributes of its ``self``
    (``self.scheduler`` of a trainer object), and the attributes the code names of a
    plain object among ``holders`` (the step's arguments, for optimizers: an RL agent's
    ``opts.critic``, refused before as an optimizer the step was not given), in that
    order; an object met twice is listed twice. ``containers``: also the objects of
    ``kind`` held in dicts, lists and tuples among those values (``self.optimizer
    ["generator"]``, NOTE: [optimizers held in containers])."""
    depth = _CONTAINER_DEPTH if containers else 0

    def of_kind(values: Iterable[Any]) -> list[Any]:
        return [found for value in values for found in held_in_containers(value, kind, depth)]

    found = [a for a in flat_args if isinstance(a, kind)]
    func, bound = partial_arguments(func)
    found += of_kind(v for v, _ in bound)
    owner = getattr(func, "__self__", None)
    func = getattr(func, "__func__", func)
    code = getattr(func, "__code__", None)
    names: dict[str, None] = {}
    if code is not None:
        namespace = getattr(func, "__globals__", {})
        names = dict.fromkeys(names_in(code))  # nested code too (a lambda, a comprehension)
        found += of_kind(namespace[n] for n in names if n in namespace)
        for cell in getattr(func, "__closure__", None) or ():
            with contextlib.suppress(ValueError):  # an empty cell
                found += of_kind([cell.cell_contents])
    if owner is not None and hasattr(owner, "__dict__"):
        found += of_kind(vars(owner).values())
    for holder in holders:
        if isinstance(holder, kind) or type(holder).__module__.split(".")[0] == "torch":
            continue
        held = getattr(holder, "__dict__", None)
        if isinstance(held, dict):
            found += of_kind(v for n, v in held.items() if n in names)
    return found


_NAMES: dict[types.CodeType, frozenset[str]] = {}
_METHODS: dict[tuple[type, types.CodeType], tuple[Any, ...]] = {}


def _methods_named(cls: type, code: types.CodeType, names: frozenset[str]) -> tuple[Any, ...]:
    """The functions of ``cls`` (methods, static and class methods) that ``code``
    names. Cached per class and code object (``inspect.getattr_static`` of every name a
    step reads took most of a call's walk)."""
    found = _METHODS.get((cls, code))
    if found is None:
        methods = []
        for name in names:
            method = inspect.getattr_static(cls, name, None)
            if isinstance(method, (staticmethod, classmethod)):
                method = method.__func__
            if isinstance(method, types.FunctionType):
                methods.append(method)
        found = _METHODS[(cls, code)] = tuple(methods)
    return found


def _self_attributes(code: types.CodeType, name: str | None = None) -> frozenset[str]:
    """The attributes ``code`` reads from its first argument (``self.teacher``, or
    ``getattr(self, "teacher")`` with the name written out), and those that the
    functions and comprehensions nested in it read from it as a free variable (``self``
    in a ``def`` or lambda inside the method). ``name``: the variable that is ``self``
    in nested code."""
    found = _SELF_ATTRIBUTES.get((code, name))
    if found is None:
        names: set[str] = set()
        first = name if name is not None else (code.co_varnames[0] if code.co_argcount else None)
        if first is not None:
            loads = ("LOAD_FAST", "LOAD_DEREF", "LOAD_CLOSURE", "LOAD_FAST_CHECK", "LOAD_FAST_BORROW")
            recent: list[dis.Instruction] = []
            for ins in dis.get_instructions(code):
                if ins.opname == "CACHE":
                    continue
                if recent and recent[-1].opname in loads and recent[-1].argval == first:
                    if ins.opname in ("LOAD_ATTR", "LOAD_METHOD"):
                        names.add(ins.argval)
                    elif (ins.opname == "LOAD_CONST" and isinstance(ins.argval, str) and len(recent) > 1
                          and recent[-2].opname == "LOAD_GLOBAL" and recent[-2].argval == "getattr"):
                        names.add(ins.argval)
                recent = [*recent[-1:], ins]
            for const in code.co_consts:
                if isinstance(const, types.CodeType) and first in const.co_freevars:
                    names.update(_self_attributes(const, first))
        found = _SELF_ATTRIBUTES[(code, name)] = frozenset(names)
    return found


_SELF_ATTRIBUTES: dict[tuple[types.CodeType, str | None], frozenset[str]] = {}


def modules_read_by_name(func: Callable[..., Any], depth: int = 4) -> list[tuple[Any, str]]:
    """The ``nn.Module`` objects a step's code reads by name, each with where (for
    messages): the globals its code loads, its closure variables, for a bound method the
    attributes of its ``self`` that the code names, and the same in the user functions it
    reaches that way (a helper ``kd_loss`` it calls, the methods of its ``self`` it
    names), to ``depth`` calls deep; library code (torch's, ...) is not entered
    (NOTE: [modules read by name beside the given ones] in ``capture/bindings.py``). An
    object met twice is listed twice."""
    bound, arguments = partial_arguments(func)
    owner = getattr(bound, "__self__", None)
    start = step_function(func)
    # NOTE: [modules bound by a partial]
    found: list[tuple[Any, str]] = [(v, where) for v, where in arguments if isinstance(v, torch.nn.Module)]
    attribute_names: set[str] = set()
    seen: set[int] = set()

    def visit(fn: types.FunctionType, left: int, *, of_owner: bool) -> None:
        if id(fn.__code__) in seen or left < 0 or skipped_function(fn):
            return
        seen.add(id(fn.__code__))
        where = f"{fn.__qualname__} ({fn.__code__.co_filename}:{fn.__code__.co_firstlineno})"
        values = [(fn.__globals__.get(n), f"global {n!r} read by {where}") for n in global_names_in(fn.__code__)]
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True):
            with contextlib.suppress(ValueError):  # an empty cell
                values.append((cell.cell_contents, f"closure variable {name!r} of {where}"))
        names = _NAMES.get(fn.__code__)
        if names is None:
            names = _NAMES[fn.__code__] = frozenset(names_in(fn.__code__))
        methods: tuple[Any, ...] = ()
        if owner is not None and of_owner:
            # ``self.<name>`` only: ``F.linear`` in the code names no ``self.linear``
            # (a first review: an unread module of the trainer placed, its eager use broken)
            attribute_names.update(_self_attributes(fn.__code__))
            methods = _methods_named(type(owner), fn.__code__, names)
        for value, label in values:
            if isinstance(value, torch.nn.Module):
                found.append((value, label))
            elif isinstance(value, types.FunctionType):
                visit(value, left - 1, of_owner=False)
        for method in methods:
            visit(method, left - 1, of_owner=True)

    if start is not None:
        visit(start, depth, of_owner=owner is not None)
    if owner is not None and hasattr(owner, "__dict__") and not isinstance(owner, type):
        found += [
            (value, f"attribute {name!r} of the step's object ({type(owner).__name__})")
            for name, value in vars(owner).items()
            if name in attribute_names and isinstance(value, torch.nn.Module)
        ]
    return found


__all__ = [
    "global_names_in", "held_in_containers", "modules_read_by_name", "names_in", "partial_arguments", "reachable_by_name", "reads_computed_attributes", "step_code", "step_function", "step_name", "step_where",
    "strings_in", "value_names_in",
]
