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
  global or closure loss module): of a module of torch's or a library's class, the
  scalar entries of its ``__dict__``; of the user's own classes, those some walked code
  names (NOTE: [guards on the names the code reads]). Scalars are (int,
  float, bool, str, None, torch dtypes and devices, NumPy scalars and arrays (by
  value), and tuples / lists / dicts of those, named tuples and ``OrderedDict`` s
  too), descending into the plain objects, dicts, lists and tuples it holds (a config
  object, a list of them) up to ``OBJECT_DEPTH``, and below that by name (NOTE:
  [guards below the walked depth]), plus the number of entries of each ``__dict__``,
  dict and list (an attribute added later is seen). An object with ``__slots__``
  (``@dataclass(slots=True)``) is read through ``plain_objects.attributes``, a mapping of
  its set slots and its ``__dict__`` if any: before, it was not walked (a changed float
  ran the old program silently; a tensor it held was refused);
- the code of the step function and of the ``forward`` of the modules' own classes (not
  torch's), and of every method, function they reach through ``self.name``, global
  names, attribute names and closure cells, transitively: each global or closure value
  it names, walked by name (NOTE: [guards below the walked depth]), and each class
  attribute it names of those classes (``class Block(nn.Module): scale = 2.0``);
- non-tensor arguments that are not graph inputs, and what object arguments hold (an
  object argument is keyed by its class, so a new one with the same settings reuses
  the program: ``capture/plain_objects.py``);
- the environment variables the capture read (``os.environ[...]``, ``os.getenv``), by
  the step or by a library it calls (a library's reads while it is first imported are
  its own settings and left out);
- the hooks that change what the step computes: each module's forward / backward (pre-)
  hooks, each optimizer's step pre- and post-hooks and torch's global module and
  optimizer hooks, by number and by identity (a hook registered after the compile ran
  nowhere before: the program had been traced without it). A hook on a parameter tensor
  is refused instead (NOTE: [hooks on parameters] in ``api.py``).
A check is a loop of dictionary lookups and identity tests (measured on the demo GPT in
the README).

NOTE: [a step that changes what it reads]
A value the trace itself changes is a step's one-time set-up (``if model.warmup: loss =
loss * 0.1; model.warmup = False``; Glow's ActNorm, ``if not self.initialized:`` set the
bias from the first batch, then ``self.initialized = True``) or a counter (``self.calls
+= 1``), which a compiled program cannot repeat. The first trace took the path of the
values the call began with, so its program is this call's, guarded by those values
(``Guards.as_found``: a guard holds what the call found, not what the trace left); the
next call, which finds the set-up done, compiles the other path. To tell a counter from
a set-up the step is traced once more on the changed values: a value that changes again
is refused, and the values are put back as the call found them; where that trace is the
same program (``compile_cache.same_program``: a flag whose branch computes nothing, a
step that calls ``model.train()`` / ``model.eval()`` itself), the program is kept under
the guards of both values, and the next call compiles nothing. A capture that traces the
step several times (the ways of an ``if`` on a tensor's value, a float argument's retry)
starts each trace from the values the call found and leaves those its program's own way
wrote (``capture/trace.py`` ``traces_start_from``); a program served from the cache makes
its writes once it has completed (a way that mismatched writes nothing, and the other
way's program is captured on the values the call found). Before, a train step and
an eval step that each set the mode themselves recaptured on every switch (84 calls of
an alternating loop on 2 gloo ranks: 25 compiles, 60.6 s; 4 compiles, 2.9 s now).
Until the fifty-third session the second trace's program ran the first call too (the
path without the set-up: a warm-up loss 10x off on the first call, ActNorm never
initialized from the data), silently.

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

NOTE: [guards below the walked depth]
The walk above reads every entry of what a module holds down to ``OBJECT_DEPTH`` levels.
Deeper values (``self.cfg.model.attention.scale``), and the objects the step's code
reaches by name (a global or closure config object, and so what a helper reads of the
global it is handed: ``gain_of(GAIN)`` reading ``g.inner.k``), are walked by name: of
an object, module or class, the attributes that some code the walk reached names
(``co_names``, and the string constants for ``getattr(cfg, "scale")`` and
``d["key"]``); of a dict, list or tuple, every item. An attribute the code names that
the object does not hold but its class does (``class Settings: base = 2.0``) is guarded
on the class, and its absence on the object too (a value set there later shadows the
class's); a method the code calls on it is walked, so the names and globals it reads
join. A global is what the code loads as one (``LOAD_GLOBAL``), not any name of
``co_names``: NOTE: [globals by the bytecode]. The walk repeats until no walked code adds a name. Before it, a list of config
objects on a module, an attribute three objects down, an object in a global tuple or
dict, a class attribute, and what a helper reads of a global were all unguarded: a
change ran the old program silently (``tests/unit/test_guards_by_name_walk.py``,
``tests/sim/test_guards_by_name.py``). Bounds:
- what a library's code reaches by name (transformers' registries and logger) and
  what the standard library's objects hold (a logger, ``linecache.cache``,
  ``os.environ``; ``SimpleNamespace`` and ``argparse.Namespace`` excepted) are read one
  level: the scalars the code names of them, nothing below;
- at most ``NAMED_OBJECTS`` objects are walked by name; a walk that reaches more (a
  dataset's list of samples) stops there, logs a warning naming where, and leaves what
  lies below unguarded;
- what no walked code names is not guarded: a value torch's own code reads of a user's
  object, or an attribute read through a computed name.
A name shared by many objects (``step``, ``scale``) is guarded wherever the walk meets
it: over-guarding, which recompiles (logged) rather than runs a stale value.

NOTE: [guards on the names the code reads]
Walking every entry of what a module or object holds guards values no code reads: a
counter or log the training loop keeps on its trainer or model (``self.global_step +=
1``, ``model.seen += n``, ``trainer.history.append(loss)``) compiled a new program on
every call, the step never reading it. Of an object whose classes are all the user's own
(``read_by_name``: not torch's, a library's or the standard library's, ``nn.Module``,
``abc.ABC`` and ``typing.Generic`` aside, and none with ``__getattr__`` or
``__getattribute__``), the walk guards only the attributes some walked code names, at
every depth; what such an attribute holds within ``OBJECT_DEPTH`` is walked as before
(a transformers config on a user's module, whole). The number of its attributes stays
a guard (an attribute set later may shadow a class attribute or answer a ``getattr``
default: one recompile). So that a name the code reads in a way Python hides is still
named, the walk also reads:
- every definition of a method along the class's bases, for ``super().forward(x)``;
- the special methods a user class defines (``__call__`` for ``self.scorer(x)``,
  ``__getitem__``, ``__eq__``, ...), and the constructor of a class the code names
  (``Options()`` runs ``__init__``);
- the function a decorator of torch or the standard library wraps (``@torch.no_grad()``:
  the wrapper's own code is torch's);
- the code of each forward and backward hook, and of each optimizer step hook;
- every method of a user's class that derives from a torch or library class
  (``overrides``: that class's code calls them unnamed, ``_conv_forward`` of an
  ``nn.Conv1d`` subclass), and an optimizer of a user's or library's class: its
  methods, and by the names they read, what the object holds, torch's ``Optimizer``
  entries aside (``optimizer``). Before, neither was walked: a global or an attribute
  such code read ran the old program silently (losses 0.41 and 0.12 off eager);
- a property's getter and setter, and a ``functools.cached_property``'s function, as a
  method the code names, and what a ``functools.cache`` / ``lru_cache`` wrapper runs;
  the ``__get__`` and ``__set__`` of a user's descriptor the
  code names (``gain = Doubled()`` reading ``obj.halved_gain``: unguarded before, a
  loss 1.47 off eager's 2.58 after a change).
A scalar the code names only as a method it calls at once (``optim.step()`` names
``step``: ``value_names_in``) is not guarded, on any object the walk by name reads:
calling a number would raise, so the trainer's ``self.step`` counter is no guard.
Code that reads every attribute of an object (``vars``, ``__dict__``, ``asdict``,
``fields``, ``dir``) turns this off for the step: every entry is guarded, as before. So
does the user's code reading an attribute through a name it computes
(``getattr(self, "gain_" + self.kind)``, ``hasattr(cfg, f"use_{x}")``,
``reduce(getattr, path.split("."), obj)``: ``reads_computed_attributes``, a stack walk
over the bytecode of the call's arguments; a string constant as the name,
``getattr(self, "scale", 1.0)``, is a name the code holds). Before, such an attribute
was unguarded and a changed value ran the old program silently (losses 0.39 and 8.85
off eager's 1.50 and 9.96, on a module and on a trainer: ``tests/sim/test_guards_by_name.py``).
Torch's and libraries' classes keep the whole walk: their own code reads what their
objects hold (``nn.Dropout``'s ``forward`` reads ``self.p``; transformers hands its
attention modules to functions it looks up at run time, which the walk does not read),
so a counter kept on a transformers model still recompiles the step. What is left
unguarded: an attribute of a user's object that only code the walk does not reach
reads (the user's module handed to such a looked-up library function, or a library's
code reading it through a computed name: only the user's code is searched for those).

NOTE: [functions an object holds]
A function, builtin, bound method or ``functools.partial`` that a module, a user's
object or a container holds (``self.act = F.gelu``, ``self.ops = {"scale": fn}``) is a
guard by identity (``_pinned``), and its code is walked. Before, the walk skipped such
values where it read an object whole, and a function found by name was followed by a
link whose replacement re-derived the guards, which compared only the code walked: for
torch's functions, none. So ``model.act = F.relu`` in place of ``F.gelu``, a function
swapped in a dict on the model, or a global ``ACT = F.gelu`` rebound to ``F.relu`` ran
the old program silently (a loss 1% off eager, ``tests/sim/test_guards_by_name.py``).
Re-derived guards now also differ where a linked function is another object
(``difference``). A global or closure function, and a class's or module's, is not
pinned: its link sees it replaced. The key before capture describes a function by its
module and qualified name (``_described``), its source file being part of that key. A
second model instance holding the same functions reuses the program; one holding
per-instance lambdas compiles its own.

NOTE: [names read that may be absent]
An attribute the walk by name finds on no object guards nothing there, yet the user's
code may read it with a default (``getattr(optim, "loss_scale", 1.0)``,
``hasattr(self, "ready")``): set later by the training loop, the old program ran
silently (a returned loss 2x eager's); made by the step itself as a counter
(``optim.calls = getattr(optim, "calls", 0) + 1``) it stayed at 1 after the first call
and the program traced with it ran on (parameters 0.196 relative off eager after 5
SGD steps). So each name the user's code passes as a constant to ``getattr`` /
``hasattr``, and every name read by user code that catches ``AttributeError`` or reads
``__dict__`` / ``vars`` (``code_names.probed_names``), is guarded as absent on every object walked
by name that lacks it (unless its number of attributes is guarded): a value set later
recompiles; one the step makes is a set-up or a counter (NOTE: [a step that changes
what it reads]), and absence is a value a trace starts from, replays and puts back
(``set_or_delete``): a refused counter leaves the object without the attribute. Not
covered: a name computed at run time (``getattr(optim, NAME, 1.0)`` with ``NAME`` a
global) on an object walked by name, the optimizer above all (its number of attributes
is not guarded: torch and schedulers add their own).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dis
import functools
import gc
import hashlib
import inspect
import logging
import operator
import os
import re
import sys
import types
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import Change, readable_name
from .bindings import (
    StepBindings,
    argument_paths,
    mark_parameters,
    numpy_kind,
    parameter_identities,
    parameters_held,
)
from .code_names import (
    global_names_in,
    names_in,
    probed_names,
    reads_computed_attributes,
    strings_in,
    value_names_in,
)
from .constant_bytes import CapturedBytes
from .plain_objects import (
    Attributes,
    attributes,
    holds_attributes,
    own_code,
    plain_object,
    read_by_name,
    reads_its_own_way,
    skipped_function,
    skipped_module,
    stdlib_module,
    users_bases,
    users_class,
    users_own_class,
)

log = logging.getLogger("spmd_compiler")

OBJECT_DEPTH = 2
_MISSING = object()
_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device, complex, bytes, range, slice)
# containers of scalars guarded by value, beside lists, tuples and dicts (``self.skip =
# {"norm"}`` read as ``name in self.skip``; before 2026-12-02 neither these nor complex
# numbers, ranges and slices were guarded: a change ran the old program)
_SCALAR_COLLECTIONS = (set, frozenset, collections.deque)
# nn.Module internals that are not settings the forward reads.
_MODULE_INTERNALS = frozenset(
    {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "_state_dict_hooks"}
)
# the hooks that change what a module's forward and backward, or an optimizer's step,
# compute: one registered after the program was compiled is a change (NOTE: [guards on
# Python values]); the other hook dicts (state_dict, load) are not the step's
_MODULE_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_OPTIMIZER_HOOKS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")

# NOTE: [values of one process]
# A few attributes of libraries' objects hold a value that differs in every process by
# construction, however the object was made: transformers' ``GenerationConfig`` keeps
# ``hash(self)`` (a hash of its JSON text, which Python salts per process) to see later
# whether the user edited it. Every generative transformers model holds one, walked whole
# with the model, so the key before capture (``described``) differed in every process and
# no restart skipped its capture (GPT-2: 5.5 s of captures against a 0.3 s load). Such an
# attribute stays a guard within the process; the key leaves it out, which loses nothing:
# it is a function of the object's other attributes, guarded beside it (transformers
# itself leaves it out of ``to_dict``). By (module, class qualified name) along the MRO.
_PER_PROCESS_ATTRIBUTES: dict[tuple[str, str], frozenset[str]] = {
    ("transformers.generation.configuration_utils", "GenerationConfig"):
        frozenset({"_original_object_hash"}),
}


def per_process_attributes(cls: type) -> frozenset[str]:
    """The attributes of ``cls``'s objects whose values are per process (NOTE: [values of
    one process])."""
    names: frozenset[str] = frozenset()
    for owner in cls.__mro__:
        names |= _PER_PROCESS_ATTRIBUTES.get((owner.__module__, owner.__qualname__), frozenset())
    return names

# Entry kinds: read ``container.get(key)``, a closure cell, a step argument, a dict length,
# a tensor's identity and version (NOTE: [tensors read from outside the arguments]), how
# far an iterator has gone (``iterator_position``), the sizes of all hook dicts at once
# (one entry: four a module; its key names each dict), a list or tuple item
# (``container[key]``), a ``_DICT`` guard on a value holding NumPy values (compared
# frozen: ``_frozen``), the same object at ``container[key[0]]`` (a dict whose entries
# the step only writes: NOTE: [kept numbers only written]).
_DICT, _CELL, _ARG, _LEN, _TENSOR, _ITERATOR, _HOOK_COUNTS, _ITEM, _NUMPY_DICT, _DEFAULT, _SAME = range(11)
# the compiler's records alive (``Guards``, a ``KeptTensor``), weakly: the tuples by which
# they hold a user's objects (their ``held_in``) are no user's reference to a dict (NOTE:
# [kept numbers only written], ``_held_only_by``)
_RECORDS: dict[int, weakref.ref[Any]] = {}


def own_record(record: Any) -> None:
    """Note ``record`` (with a ``held_in()`` yielding the containers by which it holds the
    user's objects) as the compiler's own: see ``_RECORDS`` (dropped when it dies)."""
    key = id(record)

    def forget(_: weakref.ref[Any]) -> None:
        _RECORDS.pop(key, None)

    _RECORDS[key] = weakref.ref(record, forget)


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
    # the positions of the guards on a hook itself, and on a value of one process (NOTE:
    # [values of one process]): ``described`` leaves them out
    hook_entries: set[int] = field(default_factory=set, repr=False)
    per_process_entries: set[int] = field(default_factory=set, repr=False)
    # the environment variables guarded (``add_environment``), kept by a rebuild
    environment: dict[str, str | None] = field(default_factory=dict, repr=False)
    # where the walk by name stopped, if it reached more than ``NAMED_OBJECTS`` objects
    cut_short: str | None = field(default=None, repr=False)
    # (entry, value): what the step's Python wrote there when traced, written again
    # whenever the program runs (NOTE: [a step that changes what it reads])
    writes: list[tuple[int, Any]] = field(default_factory=list, repr=False)
    # a trace wrote a value no call can write again: the program serves its own call only
    once: bool = False
    # every entry of the user's objects is guarded (code reads ``vars``, ``__dict__`` or a
    # computed name: NOTE: [guards on the names the code reads])
    every_entry: bool = False
    # id -> (dict, its keys) of each dict whose number of entries is guarded, as these
    # guards were built: NOTE: [attributes a step makes on a counted object]
    found_keys: dict[int, tuple[dict, frozenset, str]] = field(default_factory=dict, repr=False)
    # (id of a dict, key) -> the plain container held there as a capture began, noted
    # with the user's objects in it (``note_found``; NOTE: [contents a step changes in place])
    found_contents: dict[tuple[int, Any], _Contents] = field(default_factory=dict, repr=False)
    own_names: frozenset[str] | None = field(default=None, repr=False)  # ``_own_names``
    # (name, whether a closure variable, label, its type's name): where the walk met a
    # list or deque the step appends to, unguarded (NOTE: [lists the step appends to and
    # reads])
    appended: list[tuple[str, bool, str, str]] = field(default_factory=list, repr=False)
    # (name or None, whether a closure variable, label, what it is, the parameter's name):
    # where the walk met a container that holds the step's parameters for lookups (NOTE:
    # [parameters held for lookups] in ``capture/held_parameters.py``)
    held_parameters: list[tuple[str | None, bool, str, str, str]] = field(default_factory=list, repr=False)
    # (class, name, function) of each ``functools.lru_cache`` function a user class
    # defines that the walk met (``cached_functions``)
    cached_in_classes: list[tuple[type, str, Any]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        own_record(self)  # NOTE: [kept numbers only written]

    def held_in(self) -> Iterator[Any]:
        """The tuples by which these guards hold the user's objects (``own_record``)."""
        yield from self.entries
        yield from self.links
        yield from (key for kind, _, key, _ in self.entries if kind == _SAME)
        for noted in self.found_contents.values():  # NOTE: [contents a step changes in place]
            yield from noted.holders()

    def add(self, kind: int, container: Any, key: Any, expected: Any, name: str) -> None:
        if kind == _DICT and _numpy_inside(expected):
            kind = _NUMPY_DICT
        elif kind == _LEN and isinstance(container, dict):
            self.found_keys.setdefault(id(container), (container, frozenset(container), name))
        self.entries.append((kind, container, key, _snapshot(expected)))
        self.names.append(name)

    def first_change(self, bindings: StepBindings) -> Change | None:
        """A description of the first guarded value that changed, or None."""
        for k, (kind, container, key, expected) in enumerate(self.entries):
            if kind == _DICT:  # most guards (attributes): the value itself, read inline
                value = container.get(key, _MISSING)
                if value is expected:
                    continue
            elif kind == _LEN:  # the next most (a dict's size)
                value = len(container)
                if value == expected:
                    continue
            elif kind == _HOOK_COUNTS:
                value = tuple(map(len, container))
                if value == expected:
                    continue
                i = next(i for i, (a, b) in enumerate(zip(value, expected, strict=True)) if a != b)
                change = Change(f"the number of {key[i]}", str(expected[i]), str(value[i]))
                change.registered = value[i] > expected[i] and not key[i].startswith("attributes of ")
                return change
            else:
                value = _read(kind, container, key, bindings)
            if value is expected:
                continue
            if type(value) is not type(expected) or _unequal(value, expected):
                change = Change(self.names[k], _show(expected), _show(value))
                if kind == _DICT:  # an attribute: where it lives, to find its writes
                    change.place = (container, key)
                return change
        return None

    def for_call(self, bindings: StepBindings) -> tuple[Guards, Change | None]:
        """The guards that apply to this call's objects (these, or these derived afresh
        from other objects: NOTE: [guards follow the call's objects]) and the first
        guarded value that changed, or None."""
        if self.same_objects(bindings) or self.rebuild is None:
            return self, self.first_change(bindings)
        fresh = self.rebuild(bindings)
        fresh.add_environment(self.environment)
        fresh.writes = self.writes
        difference = self.difference(fresh)
        if difference is not None:
            return self, difference
        return fresh, fresh.first_change(bindings)

    def same_objects(self, bindings: StepBindings) -> bool:
        """Whether the call's submodules and every link lead to the objects these guards
        were built from."""
        submodules, optimizers = bindings.submodules, [*bindings.optimizers, *bindings.wrappers]
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
            elif kind == _ITEM:
                if key >= len(container) or container[key] is not obj:
                    return False
            elif kind == _DEFAULT:
                if _default_of(container, key) is not obj:
                    return False
            elif key >= len(bindings.flat_args) or bindings.flat_args[key] is not obj:  # _ARG
                return False
        return True

    def difference(self, other: Guards) -> Change | None:
        """How ``other`` (the same step walked on other objects) differs from these
        guards: the first value, or the code walked; None when they are the same."""
        if len(other.codes) != len(self.codes) or not all(map(operator.is_, other.codes, self.codes)):
            return Change("the code the step reaches was replaced")
        if len(other.links) != len(self.links):
            return Change("the objects the step reaches changed")
        for (_, _, key, mine), (_, _, _, theirs) in zip(self.links, other.links, strict=True):
            if mine is not theirs and (_pinned(mine) or _pinned(theirs)):  # torch's F.relu for
                return Change(f"the function at {key!r} was replaced")  # F.gelu: no code of its walked
            if type(mine) is not type(theirs):  # a global nn.ReLU() rebound to nn.SiLU(): the
                # same attributes, another forward (the old program ran, silently)
                return Change(f"the object at {key!r}", type(mine).__qualname__, type(theirs).__qualname__)
        if other.root_types != self.root_types:  # nn.Tanh for nn.Sigmoid: no attribute differs
            return Change("a submodule or optimizer of the step is of another class")
        for k, (name, (_, _, _, expected)) in enumerate(zip(self.names, self.entries, strict=True)):
            if k >= len(other.entries) or other.names[k] != name:
                return Change(f"the Python values the step reads changed ({name} is not read the same way)")
            value = other.entries[k][3]
            if value is not expected and (type(value) is not type(expected) or _unequal(value, expected)):
                return Change(name, _show(expected), _show(value))
        if len(other.entries) != len(self.entries):
            extra = other.names[len(self.entries)]
            return Change(f"the Python values the step reads changed ({extra} is read as well)")
        return None

    def add_tensor(
        self, container: Any, key: Any, tensor: Any, version: int, name: str, captured: CapturedBytes | None = None,
    ) -> None:
        """``tensor`` must stay at ``container[key]`` (a dict, a closure cell with key
        None, a function with a key of ``_default_of``, or a ``functools.partial`` with a
        position) with its version counter at ``version`` (NOTE: [tensors read from outside
        the arguments]) and, at that version, the bytes ``captured`` holds (NOTE:
        [constants changed through shared memory]; None: another tensor than the
        program's, a change by its id already)."""
        self.entries.append((_TENSOR, container, (key, tensor, captured), _held(tensor, version)))
        self.names.append(name)

    def add_absent_tensor(self, name: str) -> None:
        """Derived on another call's objects, no tensor sits where the program's
        constant ``name`` was read: these guards differ from the program's there."""
        self.entries.append((_DICT, {}, None, "no tensor"))
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

    def put_back(self) -> None:
        """Set every guarded scalar held in a dict (an attribute of a module or object, a
        dict entry, a global) that changed back to the value it had when these guards
        were built. A capture that is refused for changing one on every run leaves the
        user's objects as the call found them (a hook's ``self.calls += 1`` counted each
        refused call before)."""
        for kind, container, key, expected in self.entries:
            place = _place(kind, container)  # NOTE: [places a trace's write is set back in]
            if place is None:
                continue
            if expected is _MISSING:  # an attribute the step made (NOTE: [names read that may be absent])
                place.pop(key, None)
                continue
            if not is_scalar(expected):
                continue
            value = place.get(key, _MISSING)
            noted = self.found_contents.get((id(container), key))
            if noted is not None:  # NOTE: [contents a step changes in place]
                if not noted.matches(value):
                    set_or_delete(place, key, noted)
                continue
            if _changed_in_place(value, expected):
                _Contents(value, _stored(expected)).apply()
                continue
            if value is expected or (type(value) is type(expected) and not _unequal(value, expected)):
                continue
            place[key] = expected
        # NOTE: [attributes a step makes on a counted object]; here also those no walked
        # code names (a refused call leaves none it made)
        for container, key, _, _ in self._made_plain():
            container.pop(key, None)

    def written(self, made: bool = True) -> list[tuple[dict, Any, Any]]:
        """(dict, key, value) of each guarded value held in a dict that went from one plain
        value (``_WRITABLE``) to another since these guards were built: what a trace wrote
        there. A value that became an object (a GradScaler's lazily made scale tensor, set
        by the capture itself) is no write of the step's."""
        return [(container, key, value) for container, key, _, value in self._plain_changes(made)]

    def unwrite(self, made: bool = True) -> None:
        """Set back what ``written`` lists (a trace starts from the values the call found)."""
        for container, key, expected, _ in self._plain_changes(made):
            set_or_delete(container, key, expected)

    def note_found(self) -> None:
        """Note each plain container these guards hold in a dict, as it is now, with the
        user's objects in it (NOTE: [contents a step changes in place]): a capture
        begins."""
        self.found_contents = {
            (id(container), key): _Contents.of(value)
            for kind, container, key, _ in self.entries
            if (place := _place(kind, container)) is not None
            and _plain_container(value := place.get(key, _MISSING))
        }

    def _plain_changes(self, made: bool = True) -> list[tuple[dict, Any, Any, Any]]:
        """(dict, key, value these guards hold, value now) of ``written``'s entries; a
        value absent then or now is ``_MISSING`` (made or deleted by the step), a plain
        container a ``_Contents`` (``note_found``)."""
        out: list[tuple[Any, Any, Any, Any]] = []
        guarded: set[tuple[int, Any]] = set()
        for kind, container, key, expected in self.entries:
            place = _place(kind, container)  # NOTE: [places a trace's write is set back in]
            if place is None:
                continue
            value = place.get(key, _MISSING)
            noted = self.found_contents.get((id(container), key))
            if noted is not None:  # NOTE: [contents a step changes in place]
                if made and (_writable(value) or _plain_container(value)) and not noted.matches(value):
                    out.append((place, key, noted, _noted(value)))
                    guarded.add((id(container), key))
                continue
            if not _writable(expected):
                continue
            if value is expected or (type(value) is type(expected) and not _unequal(value, expected)):
                continue
            if _writable(value) or (made and _plain_container(value)):  # a new list attribute
                out.append((place, key, expected, _noted(value)))
                guarded.add((id(container), key))
        out += [(container, key, _MISSING, _noted(value)) for container, key, value in (self._made() if made else ())
                if (id(container), key) not in guarded]
        return out

    def _made(self) -> list[tuple[dict, Any, Any]]:
        """NOTE: [attributes a step makes on a counted object]
        (dict, key, value) of each plain value (``_WRITABLE``, or a list / dict / set /
        deque of them: ``model.lin.cfg = {}``) now held under a key that a
        dict whose number of entries these guards hold lacked when they were built: an
        attribute the step made (``model.calls = getattr(model, "calls", 0) + 1`` on a
        torch module, whose ``__dict__`` is guarded whole, so the name is not guarded as
        absent: NOTE: [names read that may be absent]). Only its number of entries told
        of it: the traces of one capture did not start without it (each trace after the
        first found the one before's ``calls``), and a refused counter left it made
        (``model.calls`` 2 after the refused first call, found by a prober of the
        sixty-second session); a one-time set-up made that way beside an ``if`` on a
        tensor value ran the first call 10x off eager (0.891 against 0.0891), silently:
        the value check's second way was traced on the set-up done. It is put back
        (removed) as a changed value is, where the user's own code names it (``names`` of
        ``_own_names``: a library's own flag beside what it did once is no step's
        set-up: transformers' ``_output_capturing_hooks_installed``, set where it
        installs its hooks, removed between traces, left LLaVA's hidden states ``None``;
        the sixty-second session's first attempt, reverted for it); a value that is no
        plain one (an object, a tensor the step keeps) is left to whoever made it (NOTE:
        [tensors the step keeps] puts the traced ones back)."""
        return [(container, key, value) for container, key, value, _ in self._made_plain() if key in self._own_names()]

    def made_elsewhere(self) -> list[tuple[str, Any]]:
        """(where, value) of each plain value made under a key that no code the walk
        read names (``_made`` leaves it), where the user's code reads attributes through
        names it computes (``every_entry``): ``setattr(model, name, True)`` read back by
        ``getattr(model, name, False)``, a set-up no trace of a capture can start
        without (NOTE: [set-ups a later trace cannot start without] in
        ``capture/trace.py``)."""
        if not self.every_entry:
            return []
        own = self._own_names()
        return [(f"{label.removeprefix('the number of attributes of ')}.{key}", value)
                for _, key, value, label in self._made_plain() if key not in own]

    def not_set_back(self) -> list[tuple[str, Any]]:
        """(name, value now) of each guarded container of a class whose contents a trace's
        start cannot set back (a dict, list, set or deque subclass but ``_Contents``'s:
        the user's own, a ``Counter``, which may keep more than its items) that differs
        from what the call found: a set-up no later trace of a capture can start without
        (NOTE: [contents a step changes in place], NOTE: [set-ups a later trace cannot
        start without] in ``capture/trace.py``)."""
        out: list[tuple[str, Any]] = []
        for k, (kind, container, key, expected) in enumerate(self.entries):
            place = _place(kind, container)
            if place is None or type(expected) in _MUTABLE or not isinstance(expected, _MUTABLE):
                continue
            value = place.get(key, _MISSING)
            if value is not expected and (type(value) is not type(expected) or _unequal(value, expected)):
                out.append((self.names[k], value))
        return out

    def _made_plain(self) -> list[tuple[dict, Any, Any, str]]:
        """(dict, key, value, the dict's label) of each plain value held under a key
        that a dict whose number of entries these guards hold lacked."""
        out: list[tuple[dict, Any, Any, str]] = []
        for container, keys, label in self.found_keys.values():
            if len(container) == len(keys) and container.keys() == keys:
                continue
            for key in container.keys() - keys:
                value = container[key]
                if _writable(value) or _plain_container(value):
                    out.append((container, key, value, label))
        return out

    def _own_names(self) -> frozenset[str]:
        """The names and identifier strings of the walked code that is the user's own
        (not an installed library's, the standard library's or torch's), nested code
        too; cached (the walked code of these guards does not change)."""
        if self.own_names is None:
            own = [code for code in self.codes if own_code(code)]
            self.own_names = frozenset(name for code in own for name in (*names_in(code), *strings_in(code)))
        return self.own_names

    def as_found(self, before: Guards) -> bool:
        """Expect, of each guard ``before`` (built on the same objects when the call began)
        also holds, the value it held then, and write the value the trace left there
        whenever the program runs (``replay_writes``; NOTE: [a step that changes what it
        reads]). Returns whether every such value can be written so (a plain value of
        an attribute, dict entry or global), and False where the trace registered or
        removed a hook (NOTE: [a hook the step removes])."""
        if before.hooks_changed():
            return False
        found: dict[Any, Any] = {}
        for kind, container, key, expected in before.entries:
            with contextlib.suppress(TypeError):  # an unhashable key: not matched
                found[(kind, _held_id(container), key)] = expected
        replayable = True
        for k, (kind, container, key, expected) in enumerate(self.entries):
            try:
                then = found.get((kind, _held_id(container), key), expected)
            except TypeError:
                continue
            if then is expected or (type(then) is type(expected) and not _unequal(then, expected)):
                continue
            self.entries[k] = (kind, container, key, then)
            if kind == _DICT and _place(kind, container) is not None and _writable(expected) and _writable(then):
                self.writes.append((k, expected))
            else:
                replayable = False
        return replayable

    def hooks_changed(self) -> bool:
        """NOTE: [a hook the step removes]
        Whether a hook these guards hold is gone or replaced, or a hook dict they count
        holds another number of hooks. A step whose first call runs a hook that removes
        itself (``self._h.remove()`` in a forward pre-hook: weight norm's or Glow's
        ActNorm's init from the first batch) is traced with the hook, which its program
        runs (as eager's first call does), and leaves the hook removed (the capture
        leaves the hooks its program's trace left: NOTE: [hooks each trace starts
        from]). Its guards were built after the trace, on the hooks it left, so until
        the sixty-third session they matched the next call, which found the hook gone,
        and the program re-ran the init on every call, silently (the second loss
        1.380006 against eager's 1.383985, parameters 3.41 off after 4 calls). A
        compiled program runs no Python and cannot remove the hook again, as it cannot
        repeat a write (``as_found``): such a program serves its own call only
        (``once``), and the next call, finding the hook gone, compiles the step without
        it. A hook registered beside a flag is the same (the flag alone made the next
        call recompile)."""
        for k in self.hook_entries:
            _, container, key, expected = self.entries[k]
            if container.get(key, _MISSING) is not expected:
                return True
        return any(  # a parameter's attributes, counted beside them, are no hooks
            len(hooks) != count and not name.startswith("attributes of ")
            for kind, container, names, counts in self.entries if kind == _HOOK_COUNTS
            for hooks, name, count in zip(container, names, counts, strict=True)
        )

    def cached_functions(self) -> list[tuple[Any, Any, Any]]:
        """(holder, key, function) of each ``functools.lru_cache`` / ``functools.cache``
        function of the user's own code the walk reached, where it is held: a dict (a
        module's globals, an object's ``__dict__``) and key, a closure cell (key None)
        or a class and attribute name (NOTE: [the user's cached functions at capture]
        in ``python_effects.py``)."""
        out: list[tuple[Any, Any, Any]] = []
        seen: set[tuple[int, Any]] = set()
        places = [(kind, container, key, value) for kind, container, key, value in self.links]
        places += [(kind, container, key, value) for kind, container, key, value in self.entries
                   if kind == _DICT]
        for kind, container, key, value in places:
            if not isinstance(value, _CACHED_FUNCTION) or not _own_cached(value):
                continue
            if kind == _CELL and isinstance(container, types.CellType):
                key = None
            elif not (kind == _DICT and type(container) is dict):
                continue
            with contextlib.suppress(TypeError):  # an unhashable key: not followed
                if (id(container), key) not in seen:
                    seen.add((id(container), key))
                    out.append((container, key, value))
        for owner, attribute, value in self.cached_in_classes:
            if (id(owner), attribute) not in seen and _own_cached(_unbound(value)):
                seen.add((id(owner), attribute))
                out.append((owner, attribute, value))
        return out

    def replay_writes(self) -> None:
        """Set the values the step's Python set when it was traced (a compiled call runs
        no Python: ``model.eval()`` in the step left the model in training mode before)."""
        for k, value in self.writes:
            _, container, key, _ = self.entries[k]
            set_or_delete(container, key, value)

    def described(self) -> list[tuple[str, Any]]:
        """Each guard's name and the value it holds (the pre-capture cache key), but the
        hooks themselves: that key describes them by their code (``step_key``)."""
        values = [(name, ["unset"] if expected is _MISSING else _described(expected))
                  for k, (name, (_, _, _, expected)) in enumerate(zip(self.names, self.entries, strict=True))
                  if k not in self.hook_entries and k not in self.per_process_entries]
        # what the walk went into, in walk order: a global or closure function, partial or
        # module (``ACT = F.relu`` / ``F.silu`` from a config) is a link, not an entry, and
        # was in no key: a restart with another one loaded the old program (NOTE: [links
        # in the key before capture])
        return values + [("link", [_link_key(key), _linked(obj)]) for _, _, key, obj in self.links]


    def across_ranks(self) -> list[tuple[str, str]]:
        """Each Python value these guards hold that every rank must read alike, by name
        and as text that is the same in every process (NOTE: [Python values agree across
        ranks] in ``runtime/same_inputs.py``): the scalars, and containers of them, held
        in attributes, dict entries, globals, closures, defaults and arguments. Not a
        hook, a value of one process (NOTE: [values of one process]), an environment
        variable (launchers set ``RANK``, ``LOCAL_RANK``, ``CUDA_VISIBLE_DEVICES`` per
        rank) or a device (each rank's own GPU)."""
        out = []
        for k, (kind, _, _, expected) in enumerate(self.entries):
            if kind not in _VALUE_KINDS or k in self.hook_entries or k in self.per_process_entries:
                continue
            name = readable_name(self.names[k])  # NOTE: [names below an argument]
            if name.startswith("environment variable "):
                continue
            if expected is _MISSING:
                out.append((name, "unset"))
                continue
            if not is_scalar(expected):
                continue
            text = _rank_text(expected)
            if text is not None:
                out.append((name, text))
        return out


def _read(kind: int, container: Any, key: Any, bindings: StepBindings) -> Any:
    """The current value of a guard of any kind but ``_DICT`` (``first_change`` reads
    those inline: most guards are attributes)."""
    if kind == _TENSOR:
        name, tensor, captured = key
        if isinstance(container, types.CellType):
            try:
                current = container.cell_contents
            except ValueError:
                current = _MISSING
        elif isinstance(container, types.FunctionType):  # a tensor default argument
            current = _default_of(container, name)
        elif isinstance(container, functools.partial):  # NOTE: [tensors bound by a partial]
            if isinstance(name, int):
                current = container.args[name] if name < len(container.args) else _MISSING
            else:  # a keyword: ``keywords`` read anew (``__setstate__`` replaces the dict whole)
                current = container.keywords.get(name, _MISSING)
        else:
            current = container.get(name, _MISSING)
        if current is not tensor:
            return ("another value",)
        version = tensor._version
        if captured is not None and version == captured.version and not captured.unchanged(tensor):
            return _CHANGED_THROUGH_SHARED_MEMORY  # NOTE: [constants changed through shared memory]
        return _held(tensor, version)
    if kind == _LEN:
        return len(container)
    if kind == _SAME:
        if isinstance(container, types.CellType):  # a closure dict (NOTE: [kept numbers only written])
            try:
                return _same(container.cell_contents, key[1])
            except ValueError:
                return _MISSING
        return _same(container.get(key[0], _MISSING), key[1])
    if kind == _ITEM:
        return _current(container[key]) if key < len(container) else _MISSING
    if kind == _NUMPY_DICT:
        return _frozen(container.get(key, _MISSING))
    if kind == _ITERATOR:
        return iterator_position(container)
    if kind == _CELL:
        try:
            return _current(container.cell_contents)
        except ValueError:
            return _MISSING
    if kind == _DEFAULT:
        return _current(_default_of(container, key))
    return _current(bindings.flat_args[key])


def _default_of(fn: Any, key: tuple[str, Any]) -> Any:
    """A default argument of ``fn``: ``key`` is ``("__defaults__", position)`` or
    ``("__kwdefaults__", name)``, or a keyword a ``functools.partial`` ``fn`` binds,
    ``("keywords", name)``; read anew (code may assign either attribute whole)."""
    attribute, which = key
    held = getattr(fn, attribute)
    if held is None:
        return _MISSING
    if attribute == "__defaults__":
        return held[which] if which < len(held) else _MISSING
    return held.get(which, _MISSING)


# values the step's Python wrote that a compiled call writes again (immutable, so the
# value the trace left can be set as it is)
_WRITABLE = (bool, int, float, str, type(None), torch.dtype, torch.device)


def _writable(value: Any) -> bool:
    """A value a step's write can be replayed or undone with: a plain one, a tuple of
    them (``model.flags = (True,)``), or absence."""
    return value is _MISSING or isinstance(value, _WRITABLE) or (isinstance(value, tuple) and is_scalar(value))


# NOTE: [contents a step changes in place]
# A list, dict, set or deque of plain values the step changes in place (``FLAGS["warm"] =
# True``, ``state[0] = True``, ``DONE.add("warm")``, ``CFG["warmup"]["done"] = True``) is
# guarded by its contents (``_snapshot``): a set-up kept so beside an ``if`` on a tensor
# value ran the first call 10x off eager (0.891 against 0.0891), silently, until the
# sixty-third session, since the traces of a capture did not start from the contents the
# call found (``unwrite`` took only plain values). Each capture notes, as it starts
# (``Guards.note_found``), each such container the guards hold with the user's objects in
# it (``_Contents``: the container and its items, a nested list / dict / set / deque as a
# ``_Contents`` of its own); each trace starts from them, set back in place, recursively,
# the user's inner objects kept (``CFG["warmup"]`` stays the dict the user holds), and the
# capture leaves the contents the program's trace left, noted the same way. Until the
# sixty-fourth session only flat lists and dicts were (a nested flag, a set, a new list
# attribute: the first call 10x off eager, silently; an earlier attempt set back deep
# copies, which replaced the user's inner dicts). Such a write is not replayed by later
# calls of the program (``as_found``: it serves its own call, and the next call, finding
# the set-up done, compiles the other way). An ``OrderedDict`` or ``defaultdict`` is set
# back as a dict, its type kept (through ``OrderedDict``'s own methods: it keeps its order
# beside the dict's storage); until the sixty-fifth session they were not, and a flag in
# one ran the first call 10x off eager, silently. A container of another subclass (the
# user's own, a ``Counter``) may keep more than its items: refused where a trace changed
# it (``Guards.not_set_back``, NOTE: [set-ups a later trace cannot start without]).
_DICTS = (dict, collections.OrderedDict, collections.defaultdict)
_MUTABLE = (*_DICTS, list, set, collections.deque)


def _plain_container(value: Any) -> bool:
    """A list, dict, set, deque, ``OrderedDict`` or ``defaultdict`` (exactly: another
    subclass may read its own way) of plain values."""
    return type(value) in _MUTABLE and is_scalar(value)


def _dict_items(value: dict) -> Any:
    """A dict's items in its order, read past its class (an ``OrderedDict``'s by its own
    order, which ``move_to_end`` changes apart from the dict's storage)."""
    return collections.OrderedDict.items(value) if isinstance(value, collections.OrderedDict) else dict.items(value)


# NOTE: [places a trace's write is set back in]
# The traces of a capture start from the values the call found (NOTE: [a step that
# changes what it reads]) wherever a guard holds a value: an entry of a dict (an
# attribute in an object's ``__dict__``, a global, a dict's item), a slot of an object
# with ``__slots__`` (``@dataclass(slots=True)``, read through an ``Attributes``
# mapping) and a closure cell (``nonlocal done``; a dict, list or set a ``make_step()``
# factory's step closes over). Until the sixty-fifth session only the first were set
# back: a one-time set-up flag in a slot or a closure, beside an ``if`` on a tensor value,
# was seen done by the next trace, whose program ran the first call 10x off eager
# (0.146 against 1.462, ddp and fsdp), silently. ``_place`` gives each as a mapping
# (a cell's one variable as ``_CellPlace``) that ``set_or_delete`` writes.


class _CellPlace:
    """A closure cell read and written as a mapping of its one variable (any key)."""

    __slots__ = ("cell",)

    def __init__(self, cell: types.CellType) -> None:
        self.cell = cell

    def get(self, key: Any, default: Any = None) -> Any:
        try:
            return self.cell.cell_contents
        except ValueError:  # empty
            return default

    def __setitem__(self, key: Any, value: Any) -> None:
        self.cell.cell_contents = value

    def pop(self, key: Any, default: Any = None) -> Any:
        value = self.get(key, _MISSING)
        if value is _MISSING:
            return default
        del self.cell.cell_contents
        return value


def _held_id(container: Any) -> int:
    """The identity of a guard's container, the same in guards built apart: an
    ``Attributes`` mapping is made per walk, so its object's (a slot's guard in the
    guards of the call's start and in the program's matched no entry: a set-up flag in a
    ``@dataclass(slots=True)`` object was expected as the trace left it, and its program,
    the set-up's, ran every call, silently, until the sixty-fifth session)."""
    return id(container.obj) if isinstance(container, Attributes) else id(container)


def _place(kind: int, container: Any) -> Any:
    """The mapping through which a guard's value is set back (NOTE: [places a trace's
    write is set back in]), None where none is (an environment variable, a list item,
    an argument)."""
    if kind == _DICT and isinstance(container, (dict, Attributes)):
        return container
    if kind == _CELL and isinstance(container, types.CellType):
        return _CellPlace(container)
    return None


@dataclass(frozen=True, eq=False, slots=True)
class _Contents:
    """A plain container ``obj`` and the items it held when noted: a nested plain
    container as a ``_Contents`` of its own, so that setting it back keeps the objects."""

    obj: Any
    items: tuple[Any, ...]

    @staticmethod
    def of(value: Any) -> _Contents:
        if type(value) in _DICTS:
            items: tuple[Any, ...] = tuple((k, _noted(v)) for k, v in _dict_items(value))
        elif type(value) is list:
            items = tuple(map(_noted, list.__iter__(value)))
        else:  # a set or deque: hashable / immutable scalars
            items = tuple(value)
        return _Contents(value, items)

    def apply(self) -> None:
        """Set ``obj``'s items back, and those of the containers in it, through its base
        type's methods (a subclass's own are not called: what a refused capture sets back,
        ``_changed_in_place``)."""
        obj = self.obj
        if isinstance(obj, collections.OrderedDict):  # its own order beside the dict's
            collections.OrderedDict.clear(obj)
            for k, v in self.items:
                collections.OrderedDict.__setitem__(obj, k, _object(v))
        elif isinstance(obj, dict):
            dict.clear(obj)
            dict.update(obj, ((k, _object(v)) for k, v in self.items))
        elif isinstance(obj, list):
            list.__setitem__(obj, slice(None), [_object(v) for v in self.items])
        elif isinstance(obj, set):
            set.clear(obj)
            set.update(obj, self.items)
        else:
            collections.deque.clear(obj)
            collections.deque.extend(obj, self.items)
        for item in self.items if isinstance(obj, (list, dict)) else ():
            item = item[1] if isinstance(obj, dict) else item
            if isinstance(item, _Contents):
                item.apply()

    def holders(self) -> Iterator[Any]:
        """The objects by which this note holds the user's (``Guards.held_in``)."""
        yield self
        yield self.items
        for item in self.items:
            yield item
            if type(item) is tuple:  # a dict's (key, item)
                item = item[1]
            if isinstance(item, _Contents):
                yield from item.holders()

    def matches(self, value: Any) -> bool:
        """Whether ``value`` is ``obj`` holding these items (the inner objects the same)."""
        if value is not self.obj:
            return False
        if type(value) in _DICTS:
            return len(value) == len(self.items) and all(
                k2 == k and _same_item(v2, v) for (k, v), (k2, v2) in zip(self.items, _dict_items(value), strict=False)
            )
        if type(value) is list:
            return len(value) == len(self.items) and all(map(_same_item, list.__iter__(value), self.items))
        if type(value) is set:
            return not _unequal(value, set(self.items))
        return len(value) == len(self.items) and not _unequal(list(value), list(self.items))


def _noted(value: Any) -> Any:
    return _Contents.of(value) if type(value) in _MUTABLE else value


def _object(item: Any) -> Any:
    return item.obj if isinstance(item, _Contents) else item


def _same_item(value: Any, noted: Any) -> bool:
    if isinstance(noted, _Contents):
        return noted.matches(value)
    return value is noted or (type(value) is type(noted) and not _unequal(value, noted))


def _changed_in_place(value: Any, expected: Any) -> bool:
    """Whether ``value``, a flat list, dict, set or deque (or a subclass's: the user's own,
    a ``Counter``) of plain values guarded by a copy ``expected`` of its contents, was
    changed in place (NOTE: [contents a step changes in place]): what a refused capture
    sets back, in place, where no ``_Contents`` was noted."""
    return (
        isinstance(value, (list, dict, set, collections.deque)) and type(expected) is type(value)
        and value is not expected and all(map(_writable, _stored(expected)))
        and is_scalar(expected) and _unequal(value, expected)
    )


def _stored(value: Any) -> tuple[Any, ...]:
    """What a list, set or deque stores, or a dict's (key, item) pairs, read past its class."""
    if isinstance(value, dict):
        return tuple(_dict_items(value))
    if isinstance(value, list):
        return tuple(list.__iter__(value))
    return tuple(set.__iter__(value) if isinstance(value, set) else collections.deque.__iter__(value))


def set_or_delete(container: dict, key: Any, value: Any) -> None:
    """``container[key] = value``, or remove ``key`` where ``value`` is absence, or set
    the contents of a plain container back in place (``_Contents``), and it at ``key``."""
    if value is _MISSING:
        container.pop(key, None)
    elif isinstance(value, _Contents):
        value.apply()
        if container.get(key, _MISSING) is not value.obj:
            container[key] = value.obj
    else:
        container[key] = value


def _snapshot(value: Any) -> Any:
    """What a guard keeps of a value: a container deep-copied (compared with the live
    one in C, no freezing per check), or frozen if it holds NumPy values."""
    if _numpy_inside(value):
        return _frozen(value)
    if not isinstance(value, (list, dict, tuple, *_SCALAR_COLLECTIONS)):
        return value
    if reads_its_own_way(type(value)):  # not through its class's code (NOTE: [containers
        return _items_copied(value)  # that read their own way] in plain_objects.py)
    try:
        return copy.deepcopy(value)
    except Exception:  # noqa: BLE001 - a class that answers copy's probes wrongly
        # (``class AttrDict(dict): __getattr__ = dict.__getitem__`` raises KeyError for
        # ``__deepcopy__``): a container of its class holding copies of its items, made
        # without calling its methods
        return _items_copied(value)


def _items_copied(value: Any) -> Any:
    cls: Any = type(value)
    if isinstance(value, dict):
        copied: Any = cls.__new__(cls)
        dict.update(copied, {key: _items_copied(item) for key, item in dict.items(value)})
    elif isinstance(value, list):
        copied = cls.__new__(cls)
        list.extend(copied, [_items_copied(item) for item in list.__iter__(value)])
    elif isinstance(value, tuple):
        items = [_items_copied(item) for item in tuple.__iter__(value)]
        try:
            copied = tuple.__new__(cls, items)
        except TypeError:  # a C struct sequence (``sys.version_info``) cannot be made so;
            # it holds scalars, immutable: the value itself is its copy
            return value if all(map(operator.is_, items, tuple.__iter__(value))) else tuple(items)
    else:  # a set or deque of scalars
        return copy.copy(value)
    try:  # the instance's own attributes, read past a ``__getattr__`` of its class
        own = object.__getattribute__(value, "__dict__")
    except AttributeError:  # __slots__
        return copied
    object.__getattribute__(copied, "__dict__").update(own)
    return copied


def _current(value: Any) -> Any:
    """A live value as its guard's snapshot compares with it."""
    return _frozen(value) if _numpy_inside(value) else value


def _numpy_inside(value: Any) -> bool:
    if numpy_kind(value) is not None:
        return True
    if isinstance(value, dict):
        return any(map(_numpy_inside, dict.values(value)))
    if isinstance(value, (list, tuple)):
        return any(map(_numpy_inside, _stored_items(value)))
    return False


def _stored_items(value: list | tuple) -> Iterator[Any]:
    """The items a list or tuple holds, read past its class (NOTE: [containers that
    read their own way] in plain_objects.py)."""
    return tuple.__iter__(value) if isinstance(value, tuple) else list.__iter__(value)


def _unequal(value: Any, expected: Any) -> bool:
    try:
        base = next((b for b in (dict, list, tuple) if isinstance(expected, b)), None)
        if base is not None and reads_its_own_way(type(expected)):  # compared by what it
            return not base.__eq__(value, expected)  # stores (NOTE: [containers that read
            # their own way]); a set subclass by its own ``!=``, as before
        return bool(value != expected)
    except Exception:  # noqa: BLE001 - an array compared element-wise: not the same value
        return True


def _frozen(value: Any) -> Any:
    """A value holding NumPy values as one that compares by content (lists become
    tuples; a NumPy array its dtype, shape and values, a NumPy scalar its dtype and
    value); also how the key before capture describes every value."""
    if isinstance(value, list):
        return tuple(_frozen(v) for v in list.__iter__(value))
    if isinstance(value, dict):  # an OrderedDict, a defaultdict too
        entries = dict.items(value) if reads_its_own_way(type(value)) else value.items()
        return tuple((k, _frozen(v)) for k, v in entries)
    if isinstance(value, tuple) and type(value) is not torch.Size:  # (1, [2, 3]): the list
        items = tuple(_frozen(v) for v in tuple.__iter__(value))
        return value if all(map(operator.is_, items, tuple.__iter__(value))) else items
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


_CHANGED_THROUGH_SHARED_MEMORY = ("the same tensor, its values changed without a version change",)


def _held(tensor: torch.Tensor, version: int) -> tuple[str, int, int]:
    """What a tensor guard expects: this tensor (by id: the guard holds it, so the id is
    its own) at this version; guards derived on another call's objects that found
    another tensor differ in it (NOTE: [guards follow the call's objects])."""
    return ("the same tensor", version, id(tensor))


def _same(value: Any, obj: Any) -> tuple[Any, ...]:
    """What a ``_SAME`` guard expects: ``obj`` itself (by id: the guard holds it)."""
    return ("the same object", id(obj)) if value is obj else ("another value",)


def _show(value: Any) -> str:
    if value is _MISSING:
        return "unset"
    if type(value) is tuple and value[:1] == ("the same object",):
        return "the dict read at capture"
    if type(value) is tuple and value[:1] == ("the same tensor",):
        return f"the tensor read at capture (version {value[1]})"
    if type(value) is tuple and value == ("another value",):
        return "another value"
    if value == _CHANGED_THROUGH_SHARED_MEMORY:
        return ("other values at the same version (written through memory it shares: a NumPy array, "
                "the buffer of torch.frombuffer, .data)")
    return repr(value)


def is_scalar(value: Any) -> bool:
    """Python values a trace bakes in as constants (and containers of them: their
    items read past their class, NOTE: [containers that read their own way] in
    plain_objects.py)."""
    if isinstance(value, _SCALARS) or numpy_kind(value) is not None:
        return True
    if isinstance(value, dict):
        return all(isinstance(k, _SCALARS) and is_scalar(v) for k, v in dict.items(value))
    if isinstance(value, (tuple, list)):  # named tuples and subclasses too
        return all(map(is_scalar, _stored_items(value)))
    if isinstance(value, _SCALAR_COLLECTIONS):
        return all(map(is_scalar, value))
    return False


def argument_labels(func: Any, bindings: StepBindings) -> list[str]:
    """How a guard names each of ``bindings.flat_args``: by the step's own name for it
    (``argument max_norm of the step``, ``argument batch['lr'] of the step``), which a
    recompile warning repeats; by position where the signature cannot be read."""
    try:
        paths = argument_paths(func, bindings.args_spec)
    except Exception:  # noqa: BLE001 - a signature or structure not read: positions
        paths = []
    if len(paths) != len(bindings.flat_args):
        paths = []
    return [
        f"argument {paths[i]} of the step" if paths else f"argument {i} of the step"
        for i in range(len(bindings.flat_args))
    ]


def build_guards(
    func: Any, bindings: StepBindings, graph_args: frozenset[int], skipped: frozenset[int] = frozenset(),
    by_name: bool = True,
) -> Guards:
    """Guards for a program traced from ``func`` on ``bindings`` (see the NOTE).

    Args:
        graph_args: positions in ``bindings.flat_args`` fed to the program as inputs.
        skipped: ids of containers not to guard: the lists the step appends to (NOTE:
            [tensors the step keeps]), which change every call by design.
        by_name: guard what the user's objects hold by the names the code reads (NOTE:
            [guards on the names the code reads]); False: every entry, as for torch's.
    """
    from .. import _torch_private as private

    mark_parameters(bindings)  # before the walk counts each parameter's attributes
    guards = Guards(every_entry=not by_name)
    # a wrapper standing for an optimizer (NOTE: [optimizers forwarding to an inner one])
    # is walked as one: its step reads its own attributes (accelerate's sync flag)
    optimizers = [*bindings.optimizers, *bindings.wrappers]
    roots = [*bindings.submodules, *optimizers]
    guards.roots = [weakref.ref(root) for root in roots]
    guards.root_types = [type(root) for root in roots]
    walker = _Walker(guards, skipped, by_name)
    walker.identities = parameter_identities(bindings)  # NOTE: [parameters held for lookups]
    for label, hooks in private.global_hook_dicts():
        walker.hooks(hooks, label)
    for oi, opt in enumerate(optimizers):
        for key in _OPTIMIZER_HOOKS:
            found = vars(opt).get(key)
            if isinstance(found, dict):
                walker.hooks(found, f"{_hook_kind(key)} of optimizer[{oi}]")
    labels = argument_labels(func, bindings)
    for i, arg in enumerate(bindings.flat_args):
        if isinstance(arg, (torch.Tensor, torch.nn.Module, torch.optim.Optimizer)):
            continue
        if i in graph_args or id(arg) in skipped:
            continue
        walker.parameters_held(_ARG, i, arg, labels[i], is_scalar(arg))
        if is_scalar(arg):
            guards.add(_ARG, None, i, arg, labels[i])
            continue
        guards.links.append((_ARG, None, i, arg))
        if walker.iterator(arg, labels[i]):
            continue
        if any(arg is s for s in bindings.schedulers):
            # an LR scheduler this program does not step (one it steps is skipped: NOTE:
            # [schedulers stepped in the step]) changes every call all the same, stepped
            # by the program of another way (gradient accumulation stepping it in the
            # branch that updates): guarded by the attributes the code names. Walked
            # whole, its ``last_epoch`` compiled a program for every update
            walker.named.append((arg, labels[i], "", False, set(), False, 0))
            continue
        if holds_attributes(arg):
            walker.whole(arg, labels[i], OBJECT_DEPTH)
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
        walker.class_attribute(cls, "forward")
        walker.overrides(cls)
    for oi, opt in enumerate(optimizers):
        walker.optimizer(opt, f"optimizer[{oi}]")
    walker.by_name()
    # vars(cfg), asdict(cfg), getattr(self, "use_" + kind)
    if by_name and (walker.read_names & _READS_EVERY_ATTRIBUTE or walker.computed_reads):
        log.debug(
            "guards: every entry of the user's objects is guarded (%s)",
            ", ".join(sorted(walker.read_names & _READS_EVERY_ATTRIBUTE))
            or f"an attribute read by a computed name in {walker.computed_reads[0]}",
        )
        return build_guards(func, bindings, graph_args, skipped, by_name=False)
    walker.counted_hooks()
    return guards


# NOTE: [kept numbers only written]
# A Python number the step keeps (``model.last = loss.item()``, ``opt.last = ...``, a
# global object's ``LOG.last = ...``: NOTE: [kept Python numbers]) is stored there by the
# runtime after every call, a new value each call. Where the walked code names that
# attribute, it was a guard like any value: every call found the number the call before
# stored and compiled anew (12 calls, 12 captures, 0.3-0.5 s each, and from the fourth a
# warning to keep the value in a tensor, for a value the step never reads). The placeholders
# of the fifty-ninth session hid this for a new attribute; one made before the first call
# (``self.last = 0.0`` in ``__init__``) always recompiled. Such a value cannot change the
# program unless some code reads it, so an attribute of a kept number that the walked code
# only stores (``STORE_ATTR``) and never reads by any way the bytecode shows (a
# ``LOAD_ATTR`` / ``LOAD_METHOD`` / ``DELETE_ATTR`` of the name, or the name as a constant:
# ``getattr(m, "last", 0)``, ``hasattr``, ``setattr``) is not guarded, and the number of
# attributes of its object is guarded as if it were there (the first call adds it). It
# stays a guard where the code reads it anywhere (``model.last = 0.9 * model.last + ...``,
# ``if hasattr(model, "last")``, an f-string of it: read back, each value recompiles and
# computes as eager), where the code reads every attribute or a computed name
# (``Guards.every_entry``), and where no walked code stores it (a library's ``setattr``).
# A dict entry (``metrics["loss"] = loss.item()`` of a global dict, ``self.stats["l"] =
# ...`` in a trainer's method) is left unguarded by a stricter rule, as a dict is read
# whole without naming a key (``print(metrics)``, ``**metrics``, iteration, ``len``, ``json.dumps``,
# a helper handed it): every instruction of the walked code (nested code too) that names
# the global or attribute holding the dict must load it only to store a constant key of
# a kept number into it (``LOAD_GLOBAL metrics / LOAD_CONST "loss" / STORE_SUBSCR``; the
# attribute ``LOAD_ATTR stats`` or ``LOAD_METHOD`` so), on every guard that holds the dict
# (reached by two names, both); the dict is a plain ``dict`` (or ``OrderedDict`` /
# ``defaultdict``: no ``__setitem__`` of the user's), and no walked code names
# ``globals``, ``vars``, ``__dict__`` or ``eval``. The guard on the dict's contents
# becomes one on its identity (``_SAME``: a global rebound to a new dict recompiles, and
# the kept number goes to the new one), its guarded entries of those keys are dropped and
# its size counts them (the first call adds them). Any other use keeps every guard:
# ``metrics.get("lr", 0.1)``, ``metrics["k"] += 1`` (a read), ``if metrics``,
# ``len(metrics)``, ``x = metrics``, ``f(metrics)``, ``del metrics["k"]``, ``"k" in
# metrics``, a constant value stored (``metrics["done"] = True``: replayed as a write, NOTE:
# [a step that changes what it reads]), a dict inside another guarded container. A dict
# held by a closure variable (a factory's ``stats = {}`` its step writes into) follows the
# same rule on ``LOAD_DEREF stats / LOAD_CONST / STORE_SUBSCR`` (its cell guarded by
# identity; ``LOAD_CLOSURE`` hands the cell to nested code, walked too; ``locals()`` or a
# read of ``__closure__`` / ``cell_contents`` reads it whole); until 2026-12-06 every call
# compiled anew (4 calls, 4 programs, the recompile warning from the third). The names
# show only the reads through the holders: the dict must also be held by nothing else
# (``_held_only_by``: ``gc.get_referrers`` finds only those holders' globals dict,
# ``__dict__`` or cell, running frames, the compiler's own records, ``own_record``, and
# a module's globals under a name no walked code reads: a script's ``step, stats =
# make_step()``, ``from metrics import METRICS``). A dict a ``functools.partial`` holds
# (``partial(scale_from, stats)``, its function reading ``d.get``), an object the walk
# did not meet (``Meter(stats).scale`` reading ``self.d``, kept in a dict or not), a
# list, another cell, keeps every guard; until 2026-12-06 such a read was missed and the
# first call's program ran on (1 compile, losses [1.027, 1.230, 1.228, 1.157] for
# eager's [1.027, 1.263, 1.553, 1.778], parameters 0.057 off). The check walks every
# object the process holds, once per compile of a step with such a dict: 60 ms with
# 290k objects (torch imported), 63 ms with a 10k-parameter model loaded (374k). A dict
# another object holds that nothing reads (a logger handed it) thus compiles every
# call, as before the rule. Measured (``nn.Linear(8, 4)``, ddp, simulated
# world 2, 10 calls): ``metrics["loss"] = loss.item()`` or ``t.stats["l"] = ...`` compiled
# 10 programs (median call 0.33 s, the recompile warning from the fourth), now 1 (median
# call 0.055 s), each call's number in the dict. The walked code includes the bodies of a
# user's ``autograd.Function`` the code names (NOTE: [autograd.Function bodies]; until
# 2026-12-06 not: a ``METRICS.get`` in ``forward`` lost its guard here, silently). What
# is not seen, as for every guard: a read by code the walk does not reach (a library
# function handed the object, an ``autograd.Function`` only a library names) or through
# ``vars`` / ``__dict__`` outside the walked code.
_LOCAL_NAME_OPS = frozenset({
    "LOAD_FAST", "STORE_FAST", "DELETE_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_AND_CLEAR",
    "LOAD_FAST_LOAD_FAST", "STORE_FAST_LOAD_FAST", "STORE_FAST_STORE_FAST", "LOAD_DEREF",
    "STORE_DEREF", "DELETE_DEREF", "LOAD_CLOSURE", "MAKE_CELL", "LOAD_CLASSDEREF",
})


def _attribute_use(codes: list[types.CodeType], name: str) -> tuple[bool, bool]:
    """(stored, read): whether ``codes`` (and the code nested in them) store attribute
    ``name`` and whether any other instruction names it (NOTE: [kept numbers only
    written]); a local or cell variable of that name is neither."""
    stored = read = False
    pending = list(codes)
    while pending:
        code = pending.pop()
        pending += [c for c in code.co_consts if isinstance(c, types.CodeType)]
        for ins in dis.get_instructions(code):
            if ins.opname in _LOCAL_NAME_OPS:
                continue
            value = ins.argval
            if ins.opname == "STORE_ATTR" and value == name:
                stored = True
            elif value == name or (isinstance(value, (tuple, frozenset)) and name in value):
                read = True
    return stored, read


def unguard_written_numbers(guards: Guards, places: list[tuple[Any, str]]) -> list[str]:
    """Stop guarding each ``(object, attribute)`` a kept Python number is stored in that
    the walked code only writes (NOTE: [kept numbers only written]); the names of the
    guards dropped."""
    dropped: list[str] = []
    if guards.every_entry:
        return dropped
    for obj, name in places:
        d = attributes(obj)
        if not isinstance(d, dict) or d is not getattr(obj, "__dict__", None):
            continue  # __slots__: read through a mapping made per call
        stored, read = _attribute_use(guards.codes, name)
        if read or not stored:
            continue
        for k, (kind, container, key, expected) in enumerate(guards.entries):
            if container is not d:
                continue
            if kind in (_DICT, _NUMPY_DICT) and key == name:
                guards.entries[k] = (_DICT, {}, None, _MISSING)  # matches every call
                dropped.append(guards.names[k])
            elif kind == _LEN and name not in d:
                guards.entries[k] = (kind, container, key, expected + 1)
    return dropped


# loads of the name that holds a dict (a global, an attribute)
_HOLDER_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "LOAD_ATTR", "LOAD_METHOD"})
# names by which code reads a namespace whole (the globals, an object's attributes)
_WHOLE_NAMESPACE = frozenset({
    "globals", "vars", "locals", "__dict__", "__globals__", "f_globals", "eval", "exec", "__closure__",
    "cell_contents", "f_locals",
})
# the instructions naming a closure variable (``LOAD_CLOSURE`` hands the cell to nested
# code, which is walked too)
_CELL_LOADS = frozenset({"LOAD_DEREF", "LOAD_CLASSDEREF"})
_CELL_OPS = _CELL_LOADS | {"STORE_DEREF", "DELETE_DEREF", "LOAD_CLOSURE", "MAKE_CELL"}
# dicts whose ``d[k] = v`` reads nothing (no ``__setitem__`` of the user's)
_PLAIN_DICTS = (dict, collections.OrderedDict, collections.defaultdict)


def _entries_only_written(
    codes: list[types.CodeType], name: str, keys: set[Any], cell: bool = False, unnamed: bool = False
) -> bool:
    """Whether ``codes`` (and the code nested in them) name ``name`` (a global or an
    attribute holding a dict; with ``cell``, a closure variable) at least once and only to
    store one of ``keys`` into it (NOTE: [kept numbers only written]); a local variable of
    that name is not it, nor (without ``cell``) a cell variable. With ``unnamed``, code
    that never names it (nor reads a namespace whole) passes too."""
    stored = False
    for _, instructions, i in name_uses(codes, name, cell):
        ins = instructions[i]
        if whole_namespace(ins) or ins.opname not in (_CELL_LOADS if cell else _HOLDER_LOADS) or i + 2 >= len(instructions):
            return False
        key, store = instructions[i + 1], instructions[i + 2]
        if key.opname != "LOAD_CONST" or store.opname != "STORE_SUBSCR":
            return False
        try:
            if key.argval not in keys:
                return False
        except TypeError:  # an unhashable constant
            return False
        stored = True
    return stored or unnamed


def name_uses(
    codes: list[types.CodeType], name: str, cell: bool = False
) -> Iterator[tuple[types.CodeType, list[dis.Instruction], int]]:
    """(code, its instructions, position) of each instruction of ``codes`` (and the code
    nested in them) that names ``name`` (a global, an attribute or a constant: a
    ``getattr`` or a key; with ``cell``, a closure variable but its ``LOAD_CLOSURE`` /
    ``MAKE_CELL``), or reads a namespace whole (``whole_namespace``); a local variable
    of that name is not it, nor (without ``cell``) a cell variable (NOTE: [kept numbers
    only written])."""
    pending = list(codes)
    while pending:
        code = pending.pop()
        pending += [c for c in code.co_consts if isinstance(c, types.CodeType)]
        instructions = list(dis.get_instructions(code))
        for i, ins in enumerate(instructions):
            value = ins.argval
            if whole_namespace(ins):
                yield code, instructions, i
            elif cell:
                if ins.opname in _CELL_OPS and value == name and ins.opname not in ("LOAD_CLOSURE", "MAKE_CELL"):
                    yield code, instructions, i
            elif ins.opname not in _LOCAL_NAME_OPS and (
                value == name or (isinstance(value, (tuple, frozenset)) and name in value)
            ):
                yield code, instructions, i


def whole_namespace(ins: dis.Instruction) -> bool:
    """An instruction naming a way to read a namespace whole (``globals``, ``vars``,
    ``__dict__``, ``eval``, ``cell_contents``)."""
    return isinstance(ins.argval, str) and ins.argval in _WHOLE_NAMESPACE


def _cell_holds(cell: types.CellType, obj: Any) -> bool:
    try:
        return cell.cell_contents is obj
    except ValueError:  # an empty cell
        return False


def _bookkeeping(more: list[Any]) -> set[int]:
    """The ids of the containers by which the compiler's records alive (``_RECORDS``) and
    ``more`` (iterables of tuples) hold the user's objects."""
    held: list[Any] = list(more)
    for ref in list(_RECORDS.values()):
        record = ref()
        if record is not None:
            held.append(record.held_in())
    return {id(t) for records in held for t in records}


def _held_only_by(d: dict, holders: list[Any], more: list[Any], codes: list[types.CodeType], keys: set[Any]) -> bool:
    """Whether nothing holds ``d`` but ``holders`` (a globals dict, an object's
    ``__dict__``, a closure cell), running frames, the guards' own records (``more``
    too) and the globals of a module under names the walked ``codes`` never read (a
    script's ``step, stats = make_step()``, ``from metrics import METRICS``): nothing
    that reads it without naming a holder, as a ``functools.partial``'s argument, an
    object's attribute the walk never met, a list (NOTE: [kept numbers only written])."""
    ignored = _bookkeeping(more)
    allowed = {id(h) for h in holders}
    ident = id(d)
    for referrer in gc.get_referrers(d):
        if id(referrer) in allowed or id(referrer) in ignored or isinstance(referrer, types.FrameType):
            continue
        if _module_globals(referrer):  # NOTE: no comprehension names ``d``: its cell would hold it
            names = [name for name, value in list(referrer.items()) if id(value) == ident]
            if all(isinstance(name, str) and _entries_only_written(codes, name, keys, unnamed=True) for name in names):
                continue
        if not isinstance(referrer, (dict, list, tuple, set, types.CellType)) and holds_attributes(referrer):
            # an object whose attributes are not a dict of their own until read (3.11)
            with contextlib.suppress(TypeError):
                if id(vars(referrer)) in allowed:
                    continue
        log.debug("guards: a dict the step writes is held by a %s too", type(referrer).__qualname__)
        return False
    return True


def _module_globals(value: Any) -> bool:
    """Whether ``value`` is the globals dict of a module (``sys.modules``)."""
    if type(value) is not dict:
        return False
    name = value.get("__name__")
    module = sys.modules.get(name) if isinstance(name, str) else None
    return module is not None and getattr(module, "__dict__", None) is value


def _holders_of(entries: list[tuple[int, Any, Any, Any]], d: dict) -> list[int]:
    """The positions of the guards on a global, an attribute or a closure cell holding ``d``."""
    return [
        k for k, (kind, container, key, _) in enumerate(entries)
        if (kind in (_DICT, _NUMPY_DICT) and isinstance(container, Mapping) and container.get(key, _MISSING) is d)
        or (kind == _CELL and _cell_holds(container, d))
    ]


def unguard_written_entries(guards: Guards, places: list[tuple[Any, Any]]) -> list[str]:
    """Stop guarding the contents of each dict whose ``(dict, key)`` entries hold kept
    Python numbers the walked code only writes, guarding the dict's identity instead
    (NOTE: [kept numbers only written]); the names of the guards changed."""
    changed: list[str] = []
    if guards.every_entry:
        return changed
    written: dict[int, tuple[Any, set[Any]]] = {}
    for d, key in places:
        if type(d) in _PLAIN_DICTS:
            written.setdefault(id(d), (d, set()))[1].add(key)
    entries = guards.entries
    for d, keys in written.values():  # NOTE: no comprehension names ``d``: its cell would hold it
        holders = _holders_of(entries, d)
        if not holders or not all(
            isinstance(entries[k][2], str)
            and _entries_only_written(guards.codes, entries[k][2], keys, cell=entries[k][0] == _CELL)
            for k in holders
        ):
            continue
        if not _held_only_by(d, [entries[k][1] for k in holders], [places, written.values()], guards.codes, keys):
            continue
        for k in holders:
            _, container, key, _ = entries[k]
            entries[k] = (_SAME, container, (key, d), _same(d, d))
            changed.append(guards.names[k])
        missing = len(keys - d.keys())
        for k, (kind, container, key, expected) in enumerate(entries):
            if container is not d:
                continue
            if kind in (_DICT, _NUMPY_DICT) and key in keys:
                entries[k] = (_DICT, {}, None, _MISSING)  # matches every call
                changed.append(guards.names[k])
            elif kind == _LEN:
                entries[k] = (kind, container, key, expected + missing)
    return changed


def functions_of(value: Any) -> Iterator[types.FunctionType]:
    if isinstance(value, (staticmethod, classmethod, types.MethodType)):
        value = value.__func__
    if isinstance(value, (functools.cached_property, functools.partialmethod)):
        yield from functions_of(value.func)
    elif isinstance(value, _CACHED_FUNCTION):  # ``@functools.lru_cache``, ``@functools.cache``
        yield from functions_of(value.__wrapped__)
    elif isinstance(value, property):
        yield from (f for f in (value.fget, value.fset) if isinstance(f, types.FunctionType))
    elif isinstance(value, types.FunctionType):
        yield value


# the type of a function under ``functools.lru_cache`` (a C type; what it runs is its
# ``__wrapped__``)
_CACHED_FUNCTION = type(functools.lru_cache(maxsize=None)(lambda: None))


def _unbound(value: Any) -> Any:
    """The function a ``staticmethod`` / ``classmethod`` in a class's dict wraps, else ``value``."""
    return value.__func__ if isinstance(value, (staticmethod, classmethod)) else value


def _own_cached(value: Any) -> bool:
    """A ``functools.lru_cache`` function whose code is the user's own."""
    code = getattr(getattr(value, "__wrapped__", None), "__code__", None)
    return isinstance(code, types.CodeType) and own_code(code)


# NOTE: [partials and bound methods found by name]
# A ``functools.partial`` or a bound method the step's code reaches by name (a global, a
# closure value, an attribute, a default: ``reader = functools.partial(_k)``, ``reader =
# obj.get``) is walked as ``code_of`` walks the step itself: the partial's function, its
# keywords and what its arguments hold, the method's function and its object. Until
# 2026-12-06 only a bound method's function was walked and a partial's keywords counted,
# so what ``_k`` read of its globals (``K``) or ``obj.get`` of its object (``self.k``) was
# no guard: changing it between calls gave 1 compile and stale values (compiled losses
# [1.03, 1.23, 1.23, 1.16], eager [1.03, 2.46, 3.88, 4.37]). One met only below a
# library's code (``descend`` false), and a method of an object of the standard library
# (``info = logging.getLogger(...).info``: not ``_deep``), are walked as before.
class _Walker:
    def __init__(self, guards: Guards, skipped: frozenset[int] = frozenset(), by_name: bool = True) -> None:
        self.guards = guards
        self.skipped = skipped
        self.read_by_name = by_name  # NOTE: [guards on the names the code reads]
        self.seen_code: set[int] = set()
        self.seen_objects: set[int] = set()
        self.counted_dicts: list[dict] = []
        self.counted_names: list[str] = []
        # NOTE: [guards below the walked depth]: every name and string the walked code
        # holds; what waits to be walked by those names, as (value, path, where read)
        self.read_names: set[str] = set()
        # names the user's code reads by getattr / hasattr with a constant (NOTE: [names
        # read that may be absent])
        self.probed_names: set[str] = set()
        # torch's modules the walked code names (``F``, ``torch``): the functions it names
        # of them are guarded by identity (``torch_namespaces``), their code not walked
        self.torch_modules: dict[int, tuple[types.ModuleType, str, set[str]]] = {}
        # of those, the names read as values (not only as a method called at once,
        # ``optim.step()``): a scalar of a user's object is guarded by these
        self.value_names: set[str] = set()
        # the user's functions that read an attribute by a computed name (where read)
        self.computed_reads: list[str] = []
        # (value, path, where read, whether what it holds is walked on: not where only
        # a library's code reaches it)
        self.pending: collections.deque[tuple[Any, str, str, bool]] = collections.deque()
        # (object, path, where read, deep, attributes done, whether its number of
        # attributes is guarded: an attribute set later is seen without guarding each
        # name it does not hold, how many levels below it are walked whole: a named
        # attribute of a user's object within ``OBJECT_DEPTH``)
        self.named: list[tuple[Any, str, str, bool, set[str], bool, int]] = []
        self.implicit_done: set[tuple[type, frozenset[str] | None]] = set()
        self.visited = 0
        self.seen_class_attributes: set[tuple[int, str]] = set()
        # id -> name of each object that is one of the step's parameters to the user
        self.identities: dict[int, str] = {}

    def parameters_held(self, kind: int, key: Any, value: Any, label: str, scalar: bool) -> None:
        """Note ``value`` (met at ``key`` of a globals dict, an object's attributes, a
        dict, a closure cell, a list; ``scalar``: it ``is_scalar``) where it holds the
        step's parameters for lookups (NOTE: [parameters held for lookups] in
        ``capture/held_parameters.py``), with the name by which code reaches it (None
        where no name does: a list item)."""
        found = parameters_held(value, self.identities, scalar) if self.identities else None
        if found is not None:
            name = key if isinstance(key, str) and kind in (_DICT, _CELL) else None
            self.guards.held_parameters.append((name, kind == _CELL, label, *found))

    def counted_hooks(self) -> None:
        """One guard on the sizes of every hook dict the walk met, and of every
        parameter's attributes (hundreds: a length test each, in one C loop)."""
        if self.counted_dicts:
            self.guards.add(
                _HOOK_COUNTS, self.counted_dicts, tuple(self.counted_names),
                tuple(map(len, self.counted_dicts)), "the number of hooks",
            )

    def module(self, mod: torch.nn.Module, name: str) -> None:
        d = mod.__dict__
        self.guards.add(_LEN, d, None, len(d), f"the number of attributes of {name}")
        self.torch_forward(type(mod))
        self.parameter_attributes(d.get("_parameters") or {}, name)
        for key in _MODULE_HOOKS:
            hooks = d.get(key)
            if isinstance(hooks, dict):
                self.hooks(hooks, f"{_hook_kind(key)} of {name}")
        if self.read_by_name and read_by_name(type(mod)):  # a user's module class
            self.guards.add(_DICT, d, "training", d.get("training", _MISSING), f"{name}.training")
            internal = {k for k, v in d.items() if _module_internal(k, v) or k == "training"}
            self.named.append((mod, name, "", True, internal, True, OBJECT_DEPTH))
            return
        for key, value in d.items():
            if _module_internal(key, value) or isinstance(value, torch.nn.Module):
                continue
            self.value(_DICT, d, key, value, f"{name}.{key}", OBJECT_DEPTH)

    def parameter_attributes(self, parameters: dict[str, Any], name: str) -> None:
        """The Python attributes code set on a module's parameters (NOTE: [Python
        attributes of parameters] in ``trace.py``): their number and values."""
        for key, p in parameters.items():
            own = getattr(p, "__dict__", None)
            if own is None:
                continue
            self.counted_dicts.append(own)  # one set later: ``counted_hooks``
            self.counted_names.append(f"attributes of {name}.{key}")
            for attribute, value in own.items():
                self.value(_DICT, own, attribute, value, f"{name}.{key}.{attribute}", OBJECT_DEPTH)

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
            self.class_attribute(type(sub), "forward")

    def hooks(self, hooks: dict, name: str) -> None:
        """A hook registered or removed after the capture changes what the step
        computes: their number (one guard for all the dicts: ``counted_hooks``), and
        each one by identity, are guards."""
        self.counted_dicts.append(hooks)
        self.counted_names.append(name)
        for position, (handle, hook) in enumerate(hooks.items()):  # named by position:
            # handles count up per process, so another model's are other numbers
            self.guards.hook_entries.add(len(self.guards.entries))
            self.guards.add(_DICT, hooks, handle, hook, f"{name} #{position}")
        for position, hook in enumerate(list(hooks.values())):  # what a hook reads of a module
            self.code_of(hook, f"{name} #{position}")

    def code_of(self, value: Any, name: str | None, iterators: bool = False) -> None:
        """Walk the code a callable runs: a function, a bound method (with what its
        object holds, labelled ``name`` or by its class; with ``iterators``, the
        iterators the method names of it too), a ``functools.partial`` (whose own
        arguments cannot change), an object with ``__call__``."""
        if isinstance(value, functools.partial):
            # its positional arguments cannot be replaced, but its keywords can
            # (``LOSS.keywords["reduction"] = "sum"``: the old program ran, silently), and
            # what an object or container among them holds can change (``partial(step,
            # cfg=cfg)``, then ``cfg.scale = 2``)
            label = name or "the partial"
            self.partial_keywords(value, label)
            bound: list[tuple[Any, Any]] = [*enumerate(value.args), *value.keywords.items()]
            for where, arg in bound:
                if _container(arg) or plain_object(arg):
                    self.whole(arg, f"argument {where!r} of {label}", OBJECT_DEPTH)
            self.code_of(value.func, name, iterators)
        elif isinstance(value, types.MethodType):
            owner = value.__self__
            if plain_object(owner):
                label = name or type(owner).__name__
                self.whole(owner, label, OBJECT_DEPTH)
                if iterators:
                    self.named_iterators(owner, value.__func__, label)
            elif isinstance(owner, type) and users_class(owner):  # a classmethod: ``cls.scale``
                self.pending.append((owner, name or f"class {owner.__qualname__}", "", _deep(owner)))
            self.code_of(value.__func__, name, iterators)
        elif isinstance(value, types.FunctionType):
            self.function(value)
        elif plain_object(value):
            self.whole(value, name or type(value).__name__, OBJECT_DEPTH)
            for fn in functions_of(inspect.getattr_static(type(value), "__call__", None)):
                self.function(fn, type(value))

    def partial_keywords(self, value: functools.partial, label: str) -> None:
        """A partial's keywords, which can change in place (``LOSS.keywords["reduction"] =
        "sum"``: the old program ran, silently): their number and scalar values."""
        self.guards.add(_LEN, value.keywords, None, len(value.keywords), f"the number of keywords of {label}")
        for key, arg in value.keywords.items():
            if is_scalar(arg):  # read from ``value.keywords`` anew each call: NOTE: [tensors bound by a partial]
                self.guards.add(_DEFAULT, value, ("keywords", key), arg, f"keyword {key!r} of {label}")

    def link(self, kind: int, container: Any, key: Any, value: Any) -> None:
        """The walk goes on into ``value``, found at ``container[key]``: a call that
        finds another object there derives the guards afresh (NOTE: [guards follow the
        call's objects])."""
        self.guards.links.append((kind, container, key, value))

    def value(self, kind: int, container: Any, key: Any, value: Any, name: str, depth: int) -> None:
        """``value``, found at ``container[key]`` (``kind``: a dict entry or a list /
        tuple item): guarded if a scalar, else walked whole for ``depth`` more levels and
        by name below them."""
        if isinstance(value, torch.Tensor):
            return
        if id(value) in self.skipped:
            self.appended_place(kind, key, value, name)
            return
        scalar = is_scalar(value)
        self.parameters_held(kind, key, value, name, scalar)
        if scalar and not self.holds_appended(value):
            self.guards.add(kind, container, key, value, name)
            self.names_held(value)
        elif _pinned(value):  # ``self.act = my_act``, ``self.ops = {"a": fn}``
            self.guards.add(kind, container, key, value, name)
            self.code_of(value, name)
        elif iterator_position(value) is not None:
            # an iterator found by walking a whole object (a trainer's data iterator,
            # advanced between calls) is guarded only where the step's code names it
            # (``named_iterators``)
            return
        elif depth > 0 and _descends(value):
            self.link(kind, container, key, value)
            self.whole(value, name, depth - 1)
        elif depth <= 0 and _by_name(value):
            self.link(kind, container, key, value)
            self.pending.append((value, name, "", _deep(value)))

    def whole(self, value: Any, name: str, depth: int) -> None:
        """Every entry of a dict, list, tuple or plain object's ``__dict__``, and of
        what they hold for ``depth`` more levels (a config object, a list of them); its
        number of entries too (an attribute added later is seen)."""
        if id(value) in self.seen_objects:  # a config object many submodules share
            return
        self.seen_objects.add(id(value))
        if self.read_by_name and not _container(value) and read_by_name(type(value)):
            d = attributes(value)
            self.guards.add(_LEN, d, None, len(d), f"the number of attributes of {name}")
            self.named.append((value, name, "", _deep(value), set(), True, depth))
            return
        per_process = frozenset() if _container(value) else per_process_attributes(type(value))
        for kind, container, key, item, path in _entries(value, name):
            if kind == _LEN:
                self.guards.add(_LEN, container, None, len(container), path)
            elif key in per_process and is_scalar(item):
                self.guards.per_process_entries.add(len(self.guards.entries))
                self.guards.add(kind, container, key, item, path)
            else:
                self.value(kind, container, key, item, path, depth)
        if not _container(value):  # its class's attributes the code names
            self.named.append((value, name, "", _deep(value), set(attributes(value)), True, 0))

    def by_name(self) -> None:
        """NOTE: [guards below the walked depth]: what lies deeper than ``OBJECT_DEPTH``,
        and the objects the step's code reaches by name (a global or closure config
        object), walked to any depth through the attributes some walked code names;
        containers (dicts, lists, tuples) whole. Runs until no walked code adds a name."""
        while True:
            while self.pending:
                value, path, where, deep = self.pending.popleft()
                if id(value) in self.seen_objects:
                    continue
                self.seen_objects.add(id(value))
                self.visited += 1
                if self.visited > NAMED_OBJECTS:
                    self.cut_short(path + where)
                    return
                if _container(value):
                    for kind, container, key, item, name in _entries(value, path):
                        if kind == _LEN:
                            self.guards.add(_LEN, container, None, len(container), name + where)
                        else:
                            self.named_value(kind, container, key, item, name, where, deep)
                else:
                    self.named.append((value, path, where, deep, set(), False, 0))
            grew = False
            for obj, path, where, deep, done, counted, depth in self.named:
                d = attributes(obj)
                # an object with ``__slots__`` (``Attributes``): its few keys as a set, not
                # the Python mapping's ``__contains__`` once per name read (a peft model's
                # walk: 128 million calls, 18 minutes of a capture)
                keys = d.keys() if isinstance(d, dict) else frozenset(d)
                for attribute in sorted((keys & self.read_names) - done):
                    value = d[attribute]
                    if attribute not in self.value_names and is_scalar(value):
                        continue  # a user's ``self.step`` counter, named only by ``optim.step()``
                    done.add(attribute)
                    grew = True
                    if depth > 0 and _descends(value) and not is_scalar(value):  # walked whole as
                        self.value(_DICT, d, attribute, value, f"{path}.{attribute}", depth)  # before
                    else:  # a class's or module's functions: their links are compared (``difference``)
                        self.named_value(_DICT, d, attribute, value, f"{path}.{attribute}", where, deep,
                                         pin=not isinstance(obj, (type, types.ModuleType)))
                if isinstance(obj, type) and not path.startswith(_SUPER_CELL):  # a class the
                    # code names: ``Options(...)`` runs its __init__
                    grew |= self.implicit_methods(obj, _CONSTRUCTION)
                    grew |= self.autograd_function(obj)
                if isinstance(obj, (type, types.ModuleType)):
                    continue
                grew |= self.implicit_methods(type(obj)) | self.overrides(type(obj))
                for attribute in sorted(((_class_names(type(obj)) & self.read_names) - done) - keys):
                    # read from its class: guarded there, and a value set on the object
                    # later would shadow it (seen by the number of its attributes, if
                    # guarded, else guarded as absent)
                    done.add(attribute)
                    grew = True
                    self.class_attribute(type(obj), attribute)
                    if not counted:
                        self.guards.add(_DICT, d, attribute, _MISSING, f"{path}.{attribute}{where}")
                if not counted:  # NOTE: [names read that may be absent]
                    for attribute in sorted(self.probed_names - keys - done - _class_names(type(obj))):
                        done.add(attribute)
                        self.guards.add(_DICT, d, attribute, _MISSING, f"{path}.{attribute}{where}")
            grew |= self.torch_namespaces()
            if not grew and not self.pending:
                return

    def torch_namespaces(self) -> bool:
        """NOTE: [torch's functions replaced]: each function of a torch module the walked
        code names (``F.silu``), by identity; one the user put there is walked as theirs.
        Returns whether any was added."""
        grew = False
        for module, path, done in list(self.torch_modules.values()):
            d = vars(module)
            for attribute in sorted((d.keys() & self.read_names) - done):
                done.add(attribute)
                value = d[attribute]
                if _torch_module(value):
                    # ``nn.functional.gelu``, ``torch.nn.functional.gelu``: through a submodule
                    self.torch_modules.setdefault(id(value), (value, f"{path}.{attribute}", set()))
                    grew = True
                    continue
                if not callable(value) or isinstance(value, (type, types.ModuleType)):
                    continue
                self.guards.add(_DICT, d, attribute, value, f"{path}.{attribute}")
                for fn in functions_of(value):
                    if not skipped_function(fn):
                        self.function(fn)
                        grew = True
        return grew

    def implicit_methods(self, cls: type, only: frozenset[str] | None = None) -> bool:
        """Walk the special methods a user class defines (``__call__``, ``__getitem__``,
        ``__eq__``, a property's ``fget`` aside: Python calls them without the code naming
        them: ``self.scorer(x)`` runs ``Scorer.__call__``), but those that make, copy
        state into or drop an object (``__init__``: the attributes it sets are not read);
        with ``only``, just those. Whether any was new."""
        # an installed library's are not walked (transformers' config ``__eq__``, ``__repr__``)
        if (cls, only) in self.implicit_done or not users_own_class(cls):
            return False
        self.implicit_done.add((cls, only))
        walked = False
        for attribute in sorted(_class_names(cls)):
            if not (attribute.startswith("__") and attribute.endswith("__")):
                continue
            if (attribute in only) if only is not None else (attribute not in _NOT_CALLED_ON_READ):
                walked |= self.class_attribute(cls, attribute)
        return walked

    def autograd_function(self, cls: type) -> bool:
        """NOTE: [autograd.Function bodies]: a user's ``torch.autograd.Function`` subclass
        the code names (``Scale.apply(x)``) runs its ``forward`` / ``backward`` /
        ``setup_context`` / ``jvp`` / ``vjp`` through torch's ``apply``, which the code
        names instead: they are walked like the user's methods (their globals, closure
        values, the dict entries they read), their code joins ``Guards.codes`` and each is
        guarded by identity. Before 2026-12-06 they were not walked: a global float read
        only in ``forward`` had no guard (1 compile, losses 4.4 off eager), and a global
        dict ``forward`` read with ``METRICS.get`` lost its guard to NOTE: [kept numbers
        only written] (1 compile, losses [1.276, 1.508, 1.461, 1.416] for eager's [1.276,
        1.923, 2.804, 4.014]). Whether any was new."""
        if (cls, _AUTOGRAD_BODIES) in self.implicit_done or not issubclass(cls, torch.autograd.Function):
            return False
        self.implicit_done.add((cls, _AUTOGRAD_BODIES))
        if not users_class(cls):  # torch's own (``users_bases`` stops at torch's classes too)
            return False
        walked = False
        for attribute in sorted(_AUTOGRAD_BODIES):
            walked |= self.class_attribute(cls, attribute)
        return walked

    def overrides(self, cls: type) -> bool:
        """Walk every method the user's own classes among ``cls`` and its bases define,
        where a torch or library class is among them too: that class's code calls them
        without the user's code naming them (``_conv_forward`` of an ``nn.Conv1d``
        subclass, ``step`` of an ``Optimizer`` subclass). Whether any was new."""
        if (cls, _OVERRIDES) in self.implicit_done or not users_own_class(cls) or read_by_name(cls):
            return False
        self.implicit_done.add((cls, _OVERRIDES))
        walked = False
        for owner in users_bases(cls):
            if not users_own_class(owner):
                continue
            for attribute, value in sorted(owner.__dict__.items()):
                if attribute in _NOT_CALLED_ON_READ:
                    continue
                for fn in functions_of(value):
                    self.function(fn, cls)
                    walked = True
        return walked

    def optimizer(self, opt: torch.optim.Optimizer, name: str) -> None:
        """An optimizer of a user's or a library's class (``class Lion(Optimizer)``):
        its methods (``overrides``) and, by the names that code reads, what the object
        holds (``self.extra``), torch's own entries aside (its ``param_groups`` are keyed
        on their own, its ``state`` is the program's). Torch's optimizers read only
        those, but for what code set on the object (``opt.loss_scale = 2.0``, read by
        the step: before 2026-12-02 not guarded), walked by name like a user's."""
        if users_class(type(opt)):
            self.class_attribute(type(opt), "step")
            self.overrides(type(opt))
        self.named.append((opt, name, "", _deep(opt), set(_torch_optimizer_entries()), False, OBJECT_DEPTH))

    def cut_short(self, path: str) -> None:
        self.guards.cut_short = path
        if path not in _WARNED:
            _WARNED.add(path)
            log.warning(
                "guards: the step reaches more than %d objects by name; %s and what lies "
                "below it are not guarded, so a change there will not recompile the step "
                "(NOTE: [guards below the walked depth])", NAMED_OBJECTS, path,
            )

    def named_value(
        self, kind: int, container: Any, key: Any, value: Any, path: str, where: str, descend: bool,
        deep: bool | None = None, pin: bool = True,
    ) -> None:
        """A value found by name (``by_name``): guarded if a scalar, and by identity if
        a function (with ``pin``: not a global or closure value, which a link follows);
        functions walked, modules as ``reached_module``; objects and containers walked on
        by name if ``descend``, what they hold too if ``deep`` (default: ``descend``)."""
        if isinstance(value, torch.Tensor):
            return
        if id(value) in self.skipped:
            self.appended_place(kind, key, value, path + where)
            return
        name = path + where
        scalar = is_scalar(value)
        self.parameters_held(kind, key, value, name, scalar)
        if scalar and not self.holds_appended(value):
            self.guards.add(kind, container, key, value, name)
            self.names_held(value)
            return
        if pin and _pinned(value):  # another function put there: torch's ``F.relu`` for
            self.guards.add(kind, container, key, value, name)  # ``F.gelu`` has no code walked
        if self.iterator(value, name):  # the code names it: ``next(self.ticks)``
            self.link(kind, container, key, value)
            return
        if descend and (
            isinstance(value, functools.partial) or (isinstance(value, types.MethodType) and _deep(value.__self__))
        ):  # NOTE: [partials and bound methods found by name]
            self.link(kind, container, key, value)
            self.code_of(value, name)
            return
        functions = list(functions_of(value))
        if not (functions or isinstance(value, torch.nn.Module) or _by_name(value)):
            if _pinned(value):  # a builtin (``ACT = F.gelu``): the link sees it replaced
                self.link(kind, container, key, value)
            return
        self.link(kind, container, key, value)
        if isinstance(value, functools.partial):
            self.partial_keywords(value, name)
        for fn in functions:
            self.function(fn)
        if isinstance(value, torch.nn.Module):
            self.reached_module(value, name)
        elif not functions and descend:
            self.pending.append((value, path, where, (descend if deep is None else deep) and _deep(value)))

    def names_held(self, value: Any) -> None:
        """A guarded string (or tuple / list of them) may be an attribute name the code
        reads by (``self.key = "alpha"``, then ``getattr(self, self.key)``): it names
        that attribute (NOTE: [guards on the names the code reads])."""
        strings = [value] if isinstance(value, str) else value if isinstance(value, (tuple, list)) else ()
        for item in strings:
            if isinstance(item, str) and item.isidentifier():
                self.read_names.add(item)
                self.value_names.add(item)

    def torch_forward(self, cls: type) -> None:
        """The ``forward`` a torch class of the step's modules defines, by identity: one
        replaced (``nn.Tanh.forward = patched``, behind a flag) ran the old program
        silently, in the process and after a restart (the key before capture keyed
        torch's classes by torch's version; parameters 0.35 / 0.63 off eager, a probe).
        A replacement that is not torch's code is walked as the user's."""
        for owner in cls.__mro__:
            d = owner.__dict__
            if not owner.__module__.startswith("torch.") or "forward" not in d:
                continue
            if (id(owner), "forward") not in self.seen_class_attributes:  # by the class: each
                self.seen_class_attributes.add((id(owner), "forward"))  # ``__dict__`` is a new proxy
                value = d["forward"]
                self.guards.add(_DICT, d, "forward", value, f"class {owner.__qualname__}.forward")
                for fn in functions_of(value):  # torch's own code is skipped there
                    self.function(fn, cls)
            return

    def class_attribute(self, cls: type, attribute: str) -> bool:
        """Where a user class (or a base) defines ``attribute``: guarded if a scalar
        (``class Block(nn.Module): scale = 2.0``), walked with ``cls`` if a method, and
        so are the bases' methods of that name (``super().forward(x)``); whether one
        defines it."""
        found = False
        for owner in users_bases(cls):
            d = owner.__dict__
            if attribute not in d:
                continue
            value = d[attribute]
            if not found and is_scalar(value) and (id(owner), attribute) not in self.seen_class_attributes:
                self.seen_class_attributes.add((id(owner), attribute))
                self.guards.add(_DICT, d, attribute, value, f"class {owner.__qualname__}.{attribute}")
            functions = list(functions_of(value))
            if isinstance(_unbound(value), _CACHED_FUNCTION) and not found:  # static / class ones too
                self.guards.cached_in_classes.append((owner, attribute, value))
            if functions and not found and (id(owner), attribute) not in self.seen_class_attributes:
                # a method replaced on the class (``Block.forward = patched``, a notebook's
                # fix) is another program: guarded by identity
                self.seen_class_attributes.add((id(owner), attribute))
                self.guards.add(_DICT, d, attribute, value, f"class {owner.__qualname__}.{attribute}")
            for fn in functions:  # a method the code calls on the object
                self.function(fn, cls)
            found = True
            if not functions:  # a value shadows what the bases define
                self.descriptor(value, f"class {owner.__qualname__}.{attribute}", cls)
                break
        return found

    def descriptor(self, value: Any, name: str, cls: type) -> None:
        """A user's descriptor as a class attribute (``gain = Doubled()``): reading the
        attribute runs its ``__get__``, whose code names what it reads of the object
        (``obj.halved_gain``); what the descriptor holds is walked too."""
        kind = type(value)
        if not plain_object(value) or not users_own_class(kind) or not hasattr(kind, "__get__"):
            return
        for special in ("__get__", "__set__"):
            for fn in functions_of(inspect.getattr_static(kind, special, None)):
                self.function(fn, kind)
        self.whole(value, name, OBJECT_DEPTH)

    def callable(self, func: Any) -> None:
        """The step: a function, a bound method (and the iterators its code names of its
        object), a ``functools.partial`` or an object with ``__call__``."""
        self.code_of(func, None, iterators=True)

    def named_iterators(self, obj: Any, fn: Any, name: str) -> None:
        """The iterator attributes of ``obj`` that ``fn``'s code names (``next(self.ticks)``)."""
        code = getattr(fn, "__code__", None)
        if code is None or not holds_attributes(obj):
            return
        d = attributes(obj)
        for attribute in sorted(set(names_in(code)) & d.keys()):
            if self.iterator(d[attribute], f"{name}.{attribute}"):
                self.link(_DICT, d, attribute, d[attribute])

    def function(self, fn: types.FunctionType, cls: type | None = None) -> None:
        """Walk ``fn``'s code; with ``cls``, the methods of ``cls`` it names too (the
        helpers a ``forward`` calls through ``self``) and the scalar class attributes
        it names (``self.scale`` set on the class)."""
        if skipped_function(fn):  # torch's or the standard library's: a decorator's wrapper
            wrapped = getattr(fn, "__wrapped__", None)  # (``@torch.no_grad()``) runs this
            if isinstance(wrapped, types.FunctionType) and wrapped is not fn:
                self.function(wrapped, cls)
            return
        if id(fn.__code__) in self.seen_code:
            return
        self.seen_code.add(id(fn.__code__))
        self.guards.codes.append(fn.__code__)
        self.guards.code_files.add(fn.__code__.co_filename)
        where = f"{fn.__qualname__} ({fn.__code__.co_filename}:{fn.__code__.co_firstlineno})"
        names = sorted(set(names_in(fn.__code__)))  # sorted: the same walk every time
        # a library's globals (transformers' registries, its logger) are its own: what
        # they hold is not walked, only the values its code names of them
        deep = "-packages" not in fn.__code__.co_filename
        self.read_names.update(names)
        strings = list(strings_in(fn.__code__))
        self.read_names.update(strings)  # getattr(config, "scale"), d["key"]
        self.value_names.update(value_names_in(fn.__code__))
        self.value_names.update(strings)
        if deep:
            self.probed_names.update(probed_names(fn.__code__))
        if deep and reads_computed_attributes(fn.__code__):
            self.computed_reads.append(where)
        if cls is not None:
            for name in names:
                self.class_attribute(cls, name)
        # the names it loads as globals, not every name (an attribute ``self.out`` is no
        # read of a script's global ``out``): NOTE: [globals by the bytecode]
        for name in sorted(global_names_in(fn.__code__)):
            # ``@pytest_ar``, ``@py_builtins``: what pytest's rewritten ``assert`` calls,
            # not the step's (its source cache would be a guard: ``linecache.cache``)
            value = fn.__globals__.get(name, _MISSING) if name.isidentifier() else _MISSING
            if value is not _MISSING:
                self.reach(_DICT, fn.__globals__, name, value, f"global {name}", f" (read by {where})", deep)
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True):
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            self.reach(_CELL, cell, name, value, f"closure value {name}", f" (of {where})", deep)
        if deep:
            self.defaults(fn, where)

    def defaults(self, fn: types.FunctionType, where: str) -> None:
        """NOTE: [default arguments]: the default values of a user's function's parameters,
        guarded like the values its code names (``def loss(x, scale=2.0)`` then
        ``loss.__defaults__ = (4.0,)``; ``def head(x, cfg=CFG)``, whose ``cfg.scale`` the
        walk follows by name). Before 2026-12-02 no default was guarded: a new value, or
        a config object reachable only as a default, ran the old program."""
        parameters = fn.__code__.co_varnames[: fn.__code__.co_argcount]
        positional = fn.__defaults__ or ()
        for position, value in enumerate(positional):
            name = parameters[len(parameters) - len(positional) + position]
            self.named_value(
                _DEFAULT, fn, ("__defaults__", position), value, f"default of {name}", f" (of {where})", True
            )
        for name, value in (fn.__kwdefaults__ or {}).items():
            self.named_value(_DEFAULT, fn, ("__kwdefaults__", name), value, f"default of {name}", f" (of {where})", True)

    def reach(self, kind: int, container: Any, key: Any, value: Any, path: str, where: str, deep: bool) -> None:
        """A global or closure value the code names: a scalar is guarded; functions,
        modules, objects and containers are walked by name (``by_name``), and what
        those hold too if ``deep`` (the user's code names it, not a library's)."""
        if id(value) in self.skipped:
            self.appended_place(kind, key, value, path + where)
            return
        if _torch_module(value):  # NOTE: [torch's functions replaced]: the functions the code names of it
            self.torch_modules.setdefault(id(value), (value, path, set()))
            return
        # torch's and the standard library's modules and classes hold no settings of the
        # step (``linecache.cache``, ``logging``'s state)
        if isinstance(value, types.ModuleType) and (
            skipped_module(value.__name__) or stdlib_module(value.__name__)
        ):
            return
        if isinstance(value, type) and (skipped_module(value.__module__) or stdlib_module(value.__module__)):
            return
        self.named_value(kind, container, key, value, path, where, True, deep, pin=False)

    def appended_place(self, kind: int, key: Any, value: Any, label: str) -> None:
        """A list or deque the step appends to (not guarded: NOTE: [tensors the step
        keeps]) met at ``key`` of a globals dict, an object's attributes, a dict or a
        closure cell: the name by which code reaches it, for NOTE: [lists the step
        appends to and reads]."""
        if isinstance(value, (list, collections.deque)) and isinstance(key, str) and kind in (_DICT, _CELL):
            self.guards.appended.append((key, kind == _CELL, label, type(value).__name__))

    def holds_appended(self, value: Any) -> bool:
        """Whether a container of scalars holds a list the step appends to (``log =
        {"hist": []}``): walked, not guarded whole, so that the list is skipped and
        checked (NOTE: [lists the step appends to and reads])."""
        if not self.skipped or not isinstance(value, (list, tuple, dict, collections.deque)):
            return False
        items = value.values() if isinstance(value, dict) else value
        return any(id(item) in self.skipped or self.holds_appended(item) for item in items)

    def iterator(self, value: Any, label: str) -> bool:
        """Guard where an iterator the step reaches has got to; whether it was one."""
        position = iterator_position(value)
        if position is None:
            return False
        self.guards.add(_ITERATOR, value, None, position, f"the position of iterator {label}")
        return True


# names of code that reads every attribute of an object: a walk that meets one guards
# every entry, as before NOTE: [guards on the names the code reads]
_READS_EVERY_ATTRIBUTE = frozenset(
    {"__dict__", "vars", "asdict", "astuple", "fields", "__getstate__", "getmembers", "dir"}
)
# special methods that make an object or set what it holds (``implicit_methods`` walks
# them only for a class the code names), and a class's own records
_CONSTRUCTION = frozenset({"__init__", "__new__", "__post_init__"})
# the cell ``super()`` reads its class from: not a class the code constructs
_SUPER_CELL = "closure value __class__"
_NOT_CALLED_ON_READ = _CONSTRUCTION | frozenset(
    {"__del__", "__setattr__", "__delattr__", "__set_name__", "__init_subclass__", "__class_getitem__",
     "__setstate__", "__module__", "__qualname__", "__doc__", "__dict__", "__weakref__", "__annotations__",
     "__slots__", "__parameters__", "__orig_bases__", "__abstractmethods__", "__dataclass_fields__",
     "__dataclass_params__", "__match_args__", "__firstlineno__", "__static_attributes__"}
)

# the ``implicit_done`` key of a class whose ``overrides`` were walked
_OVERRIDES = frozenset({"<overrides>"})
# the methods torch's ``Function.apply`` runs of a user's ``autograd.Function`` (the key
# of ``implicit_done`` for one walked too): NOTE: [autograd.Function bodies]
_AUTOGRAD_BODIES = frozenset({"forward", "backward", "setup_context", "jvp", "vjp"})


@functools.cache
def _torch_optimizer_entries() -> frozenset[str]:
    """What torch's ``Optimizer`` keeps on every optimizer object, and what an LR
    scheduler puts there (its wrapper of ``step``, ``_opt_called``)."""
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    return frozenset(vars(probe)) | {"step", "_opt_called"}


# objects the walk by name visits at most (NOTE: [guards below the walked depth])
NAMED_OBJECTS = 10_000
_WARNED: set[str] = set()


_MAPPINGS = (dict, collections.OrderedDict, collections.defaultdict)


_CALLABLES = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, functools.partial)


def _pinned(value: Any) -> bool:
    """A function, builtin, bound method or ``functools.partial`` an object holds: guarded
    by identity (NOTE: [functions an object holds]). Before, putting another one in its
    place (``model.act = F.relu`` for ``F.gelu``) ran the old program silently."""
    return isinstance(value, _CALLABLES)


_VALUE_KINDS = frozenset({_DICT, _CELL, _ARG, _ITEM, _NUMPY_DICT, _DEFAULT})
DEVICE_NAME = re.compile(r"[a-z]+:\d+")  # "cuda:1": a rank's own device, named by a string


def _rank_text(value: Any) -> str | None:
    """``value`` as text that is the same in every process (a set's items and a dict's
    pairs sorted: the order of strings in a set is salted per process), or None where the value holds a
    device (each rank's own)."""
    if isinstance(value, torch.device) or (isinstance(value, str) and DEVICE_NAME.fullmatch(value)):
        return None
    if isinstance(value, (set, frozenset)):  # the stored items (a subclass may read its own way)
        stored = frozenset.__iter__(value) if isinstance(value, frozenset) else set.__iter__(value)
        items = [_rank_text(v) for v in stored]
        return None if None in items else "{" + ", ".join(sorted(str(v) for v in items)) + "}"
    if isinstance(value, (list, tuple, collections.deque)):
        stored = list.__iter__(value) if isinstance(value, list) else tuple.__iter__(value) if isinstance(
            value, tuple
        ) else iter(value)
        items = [_rank_text(v) for v in stored]
        return None if None in items else f"{type(value).__name__}({', '.join(str(v) for v in items)})"
    if isinstance(value, dict):
        pairs = [(_rank_text(k), _rank_text(v)) for k, v in dict.items(value)]
        if any(k is None or v is None for k, v in pairs):
            return None
        # sorted: a dict built from a set of strings is ordered per process; equality
        # ignores order, as the guard's own comparison does
        return "{" + ", ".join(sorted(f"{k}: {v}" for k, v in pairs)) + "}"
    return repr(value)


def _described(value: Any) -> Any:
    """How the key before capture describes a guarded value: a function by where it is
    defined (its source file is part of that key), not by its address."""
    if isinstance(value, functools.partial):
        return ["partial", _described(value.func), list(value.args), dict(value.keywords)]
    if isinstance(value, types.MethodType):
        return ["method", _described(value.__func__), type(value.__self__).__qualname__]
    if isinstance(value, types.FunctionType):  # and its code: two lambdas a config picks
        # between share a module, a qualified name and a file (NOTE: [links in the key
        # before capture])
        return ["function", value.__module__, value.__qualname__, _code_digest(value.__code__)]
    if _pinned(value):
        return ["function", getattr(value, "__module__", None), getattr(value, "__qualname__", None)]
    if isinstance(value, property):  # a config class's properties (transformers' configs)
        return ["property", *[None if f is None else _described(f) for f in (value.fget, value.fset, value.fdel)]]
    if isinstance(value, (staticmethod, classmethod)):
        return [type(value).__name__, _described(value.__func__)]
    cls = type(value)
    if hasattr(cls, "__get__") and hasattr(value, "__dict__") and users_class(cls):
        # a library's descriptor (transformers' ``classproperty``): by its class and what
        # it holds (its functions by where they are defined)
        return ["descriptor", f"{cls.__module__}.{cls.__qualname__}",
                [[k, _described(v)] for k, v in sorted(vars(value).items())]]
    return _frozen(value)


# NOTE: [torch's functions replaced]
# A script may replace one of torch's functions (``F.scaled_dot_product_attention =
# flash_sdpa`` behind a flag, a fix to ``F.silu``): torch's modules are not walked, so
# the program compiled with the old function ran after the change, in the process and
# after a restart (a loss 2.4e-2 off eager, parameters 0.50, a probe). The functions the
# walked code names of a torch module it reads (``F``, ``torch``, ``torch.nn.init``) are
# guarded by identity (their code is torch's, versioned with it), and a replacement that
# is not torch's code is walked as the user's; a torch class's ``forward`` likewise
# (``torch_forward``). The key before capture describes them by where they are defined.


# NOTE: [links in the key before capture]
# The key before capture describes the guards' values; the objects the walk went into
# (links: a global function the forward calls, a module or partial a global holds) were
# followed within the process (a rebound global re-derives the guards) but not
# described, so a job restarted with ``ACT = F.silu`` where the first had ``F.relu``
# (from a config), or a global ``nn.SiLU()`` for ``nn.ReLU()``, loaded the first job's
# program (losses 1.5-3% off, parameters 1.0 relative, a probe). Each link is described
# by where it was found and what it is: a function by where it is defined (its source
# file is in the key), a partial with its arguments, anything else by its class.


def _code_digest(code: types.CodeType) -> str:
    """The bytecode and constants of ``code`` and the code nested in it (no addresses)."""
    digest = hashlib.sha256(code.co_code)
    for const in code.co_consts:
        text = (_code_digest(const) if isinstance(const, types.CodeType)
                else repr(sorted(map(repr, const))) if isinstance(const, frozenset)  # hash-ordered
                else repr(const))
        digest.update(text.encode())
    digest.update(repr(code.co_names).encode())
    return digest.hexdigest()[:16]


def _torch_module(value: Any) -> bool:
    return isinstance(value, types.ModuleType) and (value.__name__ or "").split(".")[0] == "torch"


def _link_key(key: Any) -> Any:
    return key if type(key) in (str, int) else type(key).__name__


def _linked(value: Any) -> Any:
    if _pinned(value) or isinstance(value, (types.FunctionType, functools.partial)):
        return _described(value)
    cls = type(value)
    return ["object", f"{cls.__module__}.{cls.__qualname__}"]


def _module_internal(key: str, value: Any) -> bool:
    """An entry of a module's ``__dict__`` that is torch's bookkeeping (its parameter,
    buffer and hook dicts, what ``nn.Module.__init__`` sets), not a setting: a user's
    ``self.hook_gain`` or ``self._hook_scale = 2.0`` is one."""
    return (
        key in _MODULE_INTERNALS
        or key in _TORCH_MODULE_ENTRIES
        or (key.startswith("_") and "hook" in key and isinstance(value, dict))
    )


# what every module holds from ``nn.Module.__init__`` (``training`` is a setting)
_TORCH_MODULE_ENTRIES = frozenset(vars(torch.nn.Module())) - {"training"}


def _container(value: Any) -> bool:
    """A dict (an ``OrderedDict``, a ``defaultdict``), a list or a tuple (a named tuple
    too). Other subclasses are walked as plain objects: their ``get`` may be their own."""
    cls = type(value)
    return cls in _MAPPINGS or cls in (list, tuple) or (issubclass(cls, tuple) and hasattr(cls, "_fields"))


def _descends(value: Any) -> bool:
    """Whether the walk goes into ``value``: a container of more than scalars, or a
    plain object."""
    return _container(value) or plain_object(value)


# the standard library's classes whose objects hold settings (``args.dropout``)
_NAMESPACES = frozenset({"types.SimpleNamespace", "argparse.Namespace"})


def _by_name(value: Any) -> bool:
    """Whether the walk by name goes into ``value``: a container, a plain object, or a
    module or class that is not torch's (or this compiler's, or a builtin), nor a
    module of the standard library."""
    if _container(value) or plain_object(value):
        return True
    if isinstance(value, types.ModuleType):  # not the standard library's (``linecache``)
        return not skipped_module(value.__name__) and not stdlib_module(value.__name__)
    return isinstance(value, type) and not skipped_module(value.__module__)


def _deep(value: Any) -> bool:
    """Whether the walk by name goes on into what ``value`` holds: not for a library's
    or the standard library's modules (``linecache.cache``, ``os.environ``: only the
    values the code names of them), nor for objects of the standard library's classes
    (a logger, a file) other than namespaces."""
    if _container(value):
        return True
    if isinstance(value, types.ModuleType):
        path = getattr(value, "__file__", None) or ""
        return not stdlib_module(value.__name__) and "-packages" not in path
    cls = value if isinstance(value, type) else type(value)
    return not stdlib_module(cls.__module__) or f"{cls.__module__}.{cls.__qualname__}" in _NAMESPACES


def _class_names(cls: type) -> set[str]:
    """The attribute names the user classes among ``cls`` and its bases define."""
    names: set[str] = set()
    for owner in users_bases(cls):
        names.update(owner.__dict__)
    return names


def _entries(value: Any, name: str) -> Iterator[tuple[int, Any, Any, Any, str]]:
    """(kind, container, key, item, name) for each entry of a dict, list, tuple or
    object's ``__dict__`` (a class's or module's too); first, for all but a tuple,
    (``_LEN``, container, None, None, name of its size)."""
    if type(value) in _MAPPINGS:
        yield _LEN, value, None, None, f"the number of entries of {name}"
        for k, v in list(value.items()):
            yield _DICT, value, k, v, f"{name}[{k!r}]"
    elif _container(value):
        if type(value) is list:
            yield _LEN, value, None, None, f"the number of items of {name}"
        for i, v in enumerate(value):
            yield _ITEM, value, i, v, f"{name}[{i}]"
    else:
        d = attributes(value)
        yield _LEN, d, None, None, f"the number of attributes of {name}"
        for k, v in list(d.items()):
            yield _DICT, d, k, v, f"{name}.{k}"


def _hook_kind(key: str) -> str:
    """``_forward_pre_hooks`` -> ``forward pre-hooks``, ``_optimizer_step_post_hooks``
    -> ``step post-hooks``."""
    words = key.strip("_").removeprefix("optimizer_").split("_")
    if words[-2] in ("pre", "post"):
        return " ".join([*words[:-2], f"{words[-2]}-{words[-1]}"])
    return " ".join(words)


