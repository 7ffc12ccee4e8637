"""Batch containers pytree does not know: dataclasses, ``UserDict`` s, ``SimpleNamespace`` s.

NOTE: [batch containers]
A step's arguments are flattened with torch's pytree, which opens tuples, lists, dicts,
named tuples and the types registered with it (transformers' ``ModelOutput``). Other
containers were leaves: a Hugging Face ``BatchEncoding`` (a ``UserDict``; what a
tokenizer or a data collator returns, passed as ``model(**batch)``), a ``@dataclass``
batch or a ``SimpleNamespace``. Such a leaf failed every call on hashing it into the
program's key (``TypeError: unhashable type: 'BatchEncoding'``), and the tensors in it
were not inputs of the program at all.

Before flattening, each such container is replaced by an ``Opened`` node (registered
with pytree, under its own name, by this module), whose children are its fields or
items, opened again where they are such containers themselves. The program's inputs are
then the tensors inside; the key holds the container's type and field names. When the
step is traced, each ``Opened`` node is closed again into a container of the user's own
type: a shallow copy of the object passed in, with its fields or items set to the
traced values, so the step's code (``batch.input_ids``, ``model(**batch)``, methods of
the class) runs on the type it was written for. A write into such a copy (a new field or
item, a replaced one) is refused after the trace, as it would never reach the caller's
object; a deletion (``labels = inputs.pop("labels")``) is allowed, as for a dict
argument. Only the types named here are opened: an arbitrary object's attributes are not
a batch by any convention, so a plain class instance stays a leaf and the tensors the
step reads from it are constants of the program (NOTE: [tensors read from outside the
arguments]), checked to agree across real ranks (NOTE: [constants agree across ranks]).
The step's returned value is opened the same way (a returned dataclass came back holding
the trace's fake tensors) and closed, after every call, into a new container of its type
holding the call's values. Cached on disk, an ``Opened`` node names its type by module
and qualified name (a class defined inside a function has no cache entry).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import gc
import importlib
import types
from collections.abc import Callable
from typing import Any

import torch

from .._torch_private import pytree
from ..errors import SPMDCompileError
from .plain_objects import SKIPPED_PACKAGES, attributes, slot_names


class Opened:
    """A container of the NOTE, its children in order; ``original`` is the object it was
    opened from (None after pytree rebuilt it: ``close_containers`` takes the originals,
    in the order ``open_containers`` found them)."""

    __slots__ = ("kind", "names", "original", "values")

    def __init__(self, kind: type, names: tuple[Any, ...], values: list[Any], original: Any = None) -> None:
        self.kind, self.names, self.values, self.original = kind, names, values, original


def _flatten(node: Opened) -> tuple[list[Any], Any]:
    return list(node.values), (node.kind, node.names)


def _flatten_with_keys(node: Opened) -> tuple[list[tuple[Any, Any]], Any]:
    """Children keyed as the step reads them: ``batch['ids']`` in a ``UserDict``,
    ``batch.ids`` in a dataclass or namespace (the argument paths of
    ``bindings.argument_paths``)."""
    key = (
        pytree.MappingKey if issubclass(node.kind, (collections.UserDict, dict))
        else pytree.SequenceKey if issubclass(node.kind, (list, tuple)) else pytree.GetAttrKey
    )
    return [(key(n), v) for n, v in zip(node.names, node.values, strict=True)], (node.kind, node.names)


def _unflatten(values: Any, context: Any) -> Opened:
    kind, names = context
    return Opened(kind, names, list(values))


def _dumpable(context: Any) -> Any:
    kind, names = context
    if "<locals>" in kind.__qualname__:  # not importable by name: no cache entry
        raise TypeError(f"{kind.__qualname__} is defined inside a function")
    if not all(isinstance(n, (str, int)) for n in names):
        raise TypeError(f"{kind.__qualname__} has keys that are not names")
    return [kind.__module__, kind.__qualname__, list(names)]


def _from_dumpable(dumped: Any) -> Any:
    module, qualname, names = dumped
    kind: Any = importlib.import_module(module)
    for part in qualname.split("."):
        kind = getattr(kind, part)
    return kind, tuple(names)


pytree.register_pytree_node(
    Opened, _flatten, _unflatten, serialized_type_name="spmd_compiler.capture.containers.Opened",
    to_dumpable_context=_dumpable, from_dumpable_context=_from_dumpable,
    flatten_with_keys_fn=_flatten_with_keys,
)


# NOTE: [subclasses of dict, list and tuple]
# A batch in a subclass of dict (``class Batch(dict): pass``, what EasyDict-style code
# passes), list or tuple (not a named tuple, which pytree opens) was a leaf: on
# simulated ranks its tensors were constants of the program (the batch not split, a new
# program every call: 4 compiles in 4 calls), on real ranks the call was refused, and a
# list subclass was refused as a tensor read "from a place the compiled step cannot
# watch". Such a container is opened as its base is, its items its children (a dict's by
# key), and closed into a copy of the caller's object of its own type holding the traced
# items; a returned one is rebuilt with each call's values. Only one without attributes
# set on the object (an empty ``__dict__``) is opened: the attributes of one opened by
# its items rode along in the traced copy unguarded, constants of the first call
# (``batch.scale = 1.0 + i``: one program, the losses wrong from the second call), and
# a returned one came back without them; such an object stays a leaf, guarded as before
# (a program per value, exact), and returned holding a traced value is refused.
# That is exact only where the class reads its items as its base does: one that
# overrides item or attribute access (``__getitem__``, ``__getattr__``, ``get``,
# ``__iter__``, ...; EasyDict's ``__setattr__`` storing every item as an attribute too)
# and holds a tensor is refused, naming the class and the method; holding no tensor it
# stays a leaf, guarded as before (a config object).
_ITEM_ACCESS = frozenset({
    "__getitem__", "__setitem__", "__getattr__", "__getattribute__", "__setattr__", "__iter__",
    "__len__", "__contains__", "__missing__", "__reversed__", "__new__", "get", "keys", "items",
    "values", "copy", "__copy__", "__reduce__", "__reduce_ex__", "__getstate__", "__setstate__",
})
_BASES = (dict, list, tuple)
_HEAP_TYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class defined by a class statement


def _subclass_base(x: Any) -> type | None:
    """dict, list or tuple where ``x`` is an object of a subclass of it that pytree keeps
    as a leaf (NOTE: [subclasses of dict, list and tuple])."""
    cls = type(x)
    if not cls.__flags__ & _HEAP_TYPE or str(cls.__module__).split(".")[0] in SKIPPED_PACKAGES:
        return None  # a class written in C (``torch.Size``, a struct sequence) or torch's own
    for base in _BASES:
        if isinstance(x, base) and cls is not base:
            return base
    return None


def _overridden(cls: type, base: type) -> str | None:
    """The first method of item or attribute access ``cls`` defines over ``base``."""
    for owner in cls.__mro__:
        if owner is base or owner is object:
            return None
        for name in sorted(_ITEM_ACCESS):
            if name in owner.__dict__:
                return f"{owner.__qualname__}.{name}"
    return None


def _subclass_openable(x: Any, base: type) -> bool:
    if getattr(x, "__dict__", None):
        # NOTE: [subclasses of dict, list and tuple]: only the items are opened; an
        # attribute set on the object (``batch.scale = 1.0 + i``) rode along in the
        # traced copy unguarded, a constant of the first call's value (losses 1.45,
        # 1.37, 1.33, 1.43 against eager's 1.45, 2.74, 4.05, 5.93): such an object
        # stays a leaf, guarded as before, and a returned one holding a traced value is
        # refused (NOTE: [returned objects holding traced values])
        return False
    method = _overridden(type(x), base)
    if method is None:
        return True
    items = list(dict.values(x)) if base is dict else list(list.__iter__(x) if base is list else tuple.__iter__(x))
    if not any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(items)):
        return False  # a leaf as before: a config object, guarded
    raise SPMDCompileError(
        f"The train step is given (or returns) a {type(x).__qualname__}, a subclass of "
        f"{base.__name__} holding tensors that overrides {method}: a compiled step opens "
        f"such a container as a {base.__name__} and passes the traced step a copy holding "
        f"the traced tensors, which is exact only where the class reads its items as "
        f"{base.__name__} does (NOTE: [subclasses of dict, list and tuple]).",
        hint=f"pass {base.__name__}(batch), or hold the batch in a @dataclass, a "
        "types.SimpleNamespace or a collections.UserDict.",
    )


def _openable(x: Any) -> bool:
    """A container of the NOTE that pytree would keep as a leaf."""
    if isinstance(x, type) or not pytree.tree_is_leaf(x):  # a type pytree opens itself
        return False
    base = _subclass_base(x)
    if base is not None:
        return _subclass_openable(x, base)
    return (
        dataclasses.is_dataclass(x)
        or isinstance(x, collections.UserDict)
        or type(x) is types.SimpleNamespace
    )


def _contents(x: Any) -> tuple[tuple[Any, ...], list[Any]]:
    if isinstance(x, dict) and not isinstance(x, collections.UserDict):  # a subclass
        return tuple(dict.keys(x)), list(dict.values(x))
    if isinstance(x, (list, tuple)):
        return tuple(range(len(x))), list(x)
    if dataclasses.is_dataclass(x):
        names = tuple(f.name for f in dataclasses.fields(x))
        return names, [getattr(x, n) for n in names]
    items = x.data if isinstance(x, collections.UserDict) else vars(x)
    return tuple(items), list(items.values())


def open_containers(tree: Any, is_leaf: Any, found: list[Any] | None = None) -> Any:
    """``tree`` with every container of the NOTE replaced by an ``Opened`` node; ``found``
    collects the objects opened, in the order ``close_containers`` meets their nodes (a
    container before the ones inside it)."""

    def visit(x: Any) -> Any:
        if not _openable(x):
            return x
        if found is not None:
            found.append(x)
        names, values = _contents(x)
        return Opened(type(x), names, [open_containers(v, is_leaf, found) for v in values], original=x)

    return pytree.tree_map(visit, tree, is_leaf=lambda x: is_leaf(x) or _openable(x))


def _entries(x: Any) -> dict[Any, Any]:
    if isinstance(x, dict):
        return dict(dict.items(x))
    if isinstance(x, (list, tuple)):
        return dict(enumerate(x))
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dict(vars(x)) if hasattr(x, "__dict__") else {
            f.name: getattr(x, f.name) for f in dataclasses.fields(x)
        }
    return dict(x.data) if isinstance(x, collections.UserDict) else dict(vars(x))


class Closed:
    """The containers a trace's arguments were closed into, to check after the step ran
    that it did not write into them: a write lands in the copy, which the caller never
    sees (NOTE: [batch containers])."""

    def __init__(self) -> None:
        self.copies: list[tuple[Any, dict[Any, Any]]] = []

    def refuse_writes(self, where: str | None) -> None:
        for copied, entries in self.copies:
            now = _entries(copied)
            # a deletion (``labels = inputs.pop("labels")``, as Hugging Face trainers do)
            # changes nothing the caller reads from the program: allowed, as for a dict
            changed = sorted(str(k) for k in now if k not in entries or now[k] is not entries[k])
            if changed:
                raise SPMDCompileError(
                    f"The train step writes into its {type(copied).__name__} argument "
                    f"({', '.join(changed)}): a compiled step passes such a container to the "
                    "traced step as a copy holding the traced tensors, so the write would "
                    "not reach the object the caller holds.",
                    user_line=where,
                    hint="return the value from the step instead of storing it in the "
                    "batch container; state a later call reads (GradNorm's initial losses) "
                    "goes on an object of a class of your own, which the step may write, or "
                    "in a module buffer registered before the first call and written in place "
                    "in the step (`model.L0.copy_(...)`).",
                )


def _fill(obj: Any, names: tuple[Any, ...], values: list[Any]) -> Any:
    """``obj`` (a fresh copy or instance of a container of the NOTE) holding ``values``."""
    if isinstance(obj, dict):
        dict.clear(obj)
        dict.update(obj, zip(names, values, strict=True))
    elif isinstance(obj, list):
        list.__setitem__(obj, slice(None), values)
    elif dataclasses.is_dataclass(obj):
        for name, value in zip(names, values, strict=True):
            object.__setattr__(obj, name, value)  # frozen dataclasses too
    elif isinstance(obj, collections.UserDict):
        obj.data = dict(zip(names, values, strict=True))
    else:
        obj.__dict__.update(zip(names, values, strict=True))
    return obj


def _close(tree: Any, rebuild: Any) -> Any:
    """``tree`` (rebuilt by pytree) with each ``Opened`` node, inside ones first, made a
    container by ``rebuild(node, closed children)``."""

    def close(x: Any) -> Any:
        if not isinstance(x, Opened):
            return x
        return rebuild(x, [close_tree(v) for v in x.values])

    def close_tree(t: Any) -> Any:
        return pytree.tree_map(close, t, is_leaf=lambda x: isinstance(x, Opened))

    return close_tree(tree)


def close_containers(tree: Any, objects: list[Any], closed: Closed | None = None) -> Any:
    """``tree`` (rebuilt by pytree) with each ``Opened`` node closed into a shallow copy of
    its original object (``objects``, in the order ``open_containers`` found them)
    holding the node's values (NOTE: [batch containers]); ``closed`` records the copies."""
    remaining = iter(objects)

    def rebuild(node: Opened, values: list[Any]) -> Any:
        original = next(remaining)
        if isinstance(original, tuple):  # immutable: a new one, with the attributes
            new = _tuple_of(type(original), values, original)
        else:
            new = _fill(copy.copy(original), node.names, values)
        if closed is not None:
            closed.copies.append((new, _entries(new)))
        return new

    return _close(tree, rebuild)


def _new(node: Opened, values: list[Any]) -> Any:
    """A new container of ``node``'s type holding ``values`` (a returned container: there
    is no object of the caller's to copy)."""
    kind: Any = node.kind
    if issubclass(kind, tuple):
        return _tuple_of(kind, values)
    if kind is types.SimpleNamespace:
        return types.SimpleNamespace(**dict(zip(node.names, values, strict=True)))
    if issubclass(kind, collections.UserDict):
        try:
            return kind(dict(zip(node.names, values, strict=True)))
        except Exception:  # noqa: BLE001 - a constructor of another shape
            pass
    return _fill(kind.__new__(kind), node.names, values)  # fields set as __init__ would


def _tuple_of(kind: type, values: list[Any], original: Any = None) -> Any:
    """An object of ``kind``, a tuple subclass, holding ``values`` (and the attributes of
    ``original``): made as ``tuple`` makes one (NOTE: [subclasses of dict, list and
    tuple]: a class overriding ``__new__`` is refused)."""
    new: Any = tuple.__new__(kind, values)  # type: ignore[type-var]
    if original is not None and hasattr(original, "__dict__"):
        vars(new).update(vars(original))
    return new


def holds_containers(spec: pytree.TreeSpec) -> bool:
    """Whether a return value of this pytree spec holds an ``Opened`` node (its calls
    then rebuild the value with ``close_returned``; others skip that walk)."""
    return spec.type is Opened or any(holds_containers(c) for c in spec.children())


def close_returned(tree: Any) -> Any:
    """A returned value rebuilt by pytree, its ``Opened`` nodes made new containers of
    their types (NOTE: [batch containers])."""
    return _close(tree, _new)


# Objects the walk of ``traced_inside`` does not enter: what they hold is no value
# the step made (a model's parameters are its real ones again once the trace ends).
_ATOMS = (str, bytes, bytearray, int, float, complex, bool, type(None), type, types.ModuleType,
          types.CodeType, types.FrameType, types.TracebackType, torch.nn.Module, torch.optim.Optimizer,
          torch.dtype, torch.device)
_WALK_BUDGET = 10_000


def traced_inside(value: Any, traced: Callable[[Any], bool]) -> str | None:
    """NOTE: [returned objects holding traced values]
    The path (``StepOutput.loss``, ``<closure>.l``) of a value ``traced`` holds to be
    one of the trace's (a fake tensor, a traced ``.item()``) inside ``value``, a leaf of
    the step's result that pytree and ``open_containers`` do not open; None if none is.
    Such a leaf is returned as it is, a constant of the program: before 2026-12-06 a
    step returning ``StepOutput(loss.detach(), out)`` of a plain class got, on every
    call, the same object holding the trace's fake tensors (``float(r.loss)`` raised
    torch's bare ``DataDependentOutputException``), as did a returned generator, closure
    or set. Rebuilding such an object on each call would have to guess how (its
    ``__init__``, its ``__slots__``, what its methods capture), so the step is refused
    instead. The walk follows containers, attributes, closure cells, defaults, bound
    ``self``, a generator's locals and, for other objects, ``gc.get_referents``; it
    does not enter modules, classes, models, optimizers, the globals of a function or
    torch's own objects, and stops after 10,000 objects (a leaf that holds no traced
    value, a string, a config object, the model itself, stays a constant, as before)."""
    seen: set[int] = set()
    root = value.__qualname__ if isinstance(value, (types.FunctionType, types.GeneratorType)) else None
    stack: list[tuple[Any, str]] = [(value, root or type(value).__qualname__)]
    while stack and len(seen) < _WALK_BUDGET:
        x, path = stack.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if traced(x):
            return path
        if isinstance(x, (torch.Tensor, *_ATOMS)) or (
            not isinstance(x, (dict, list, tuple, set, frozenset))
            and str(type(x).__module__).split(".")[0] in SKIPPED_PACKAGES
            and not distribution_object(x)
        ):
            continue
        children: list[tuple[Any, str]] = []
        if isinstance(x, dict):
            children = [(v, f"{path}[{k!r}]") for k, v in x.items()] + [(k, f"{path} key") for k in x]
        elif isinstance(x, (list, tuple, set, frozenset, collections.deque)):
            children = [(v, f"{path}[{i}]") for i, v in enumerate(x)]
        elif isinstance(x, types.FunctionType):
            names = x.__code__.co_freevars
            children = [(c.cell_contents, f"{path}.{n}") for n, c in zip(names, x.__closure__ or (), strict=False)
                        if _filled(c)]
            children += [(d, f"{path} default") for d in (x.__defaults__ or ())]
            children += [(d, f"{path}.{k}") for k, d in (x.__kwdefaults__ or {}).items()]
        elif isinstance(x, types.MethodType):
            children = [(x.__self__, f"{path}.__self__"), (x.__func__, path)]
        elif isinstance(x, types.GeneratorType):
            frame = x.gi_frame
            local = frame.f_locals if frame is not None else {}
            children = [(v, f"{path}.{'<iterable>' if k == '.0' else k}") for k, v in local.items()]
        elif hasattr(x, "__dict__") or slot_names(type(x)):
            children = [(v, f"{path}.{k}") for k, v in attributes(x).items()]
        else:  # an iterator, a functools.partial, a cell: what the collector sees in it
            children = [(v, path) for v in gc.get_referents(x)]
        stack.extend(reversed(children))
    return None


def distribution_object(x: Any) -> bool:
    """NOTE: [returned distributions]
    An object of ``torch.distributions`` (a ``Categorical``, a ``Normal``, an
    ``Independent`` or ``TransformedDistribution`` with its base and transforms, a
    constraint) is walked by ``traced_inside`` though torch's own: it holds the values
    it was built from (``logits``, ``_param``, ``loc``, ``scale``, a cached ``probs``) in
    its ``__dict__``. Until 2026-12-06 the walk skipped every torch object, so a step
    returning ``loss, Categorical(logits=out)`` got, every call, the same distribution
    holding the trace's fake tensors (``d.entropy()`` gave a ``FakeTensor``, silently).
    Refused instead, naming the attribute: rebuilding one with each call's values would
    have to know how each class derives its attributes (``Categorical`` keeps
    ``_param`` as the same tensor as ``logits``; a lazily cached ``probs`` may be there
    or not), so the step returns the tensors and the caller builds the distribution."""
    return str(type(x).__module__).startswith("torch.distributions.")


def _filled(cell: Any) -> bool:
    try:
        _ = cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True


__all__ = [
    "Closed", "Opened", "close_containers", "close_returned", "distribution_object", "holds_containers",
    "open_containers", "traced_inside",
]
