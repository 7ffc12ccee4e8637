"""What the step's Python does once at capture that eager does every call.

NOTE: [Python effects at capture]
A compiled step runs its Python once, while it is traced, on tensors that hold no
values; later calls run only the program. Three effects would silently differ:
- ``print`` of a traced tensor shows ``FakeTensor(...)`` once and never the numbers.
  While the step is traced, such a ``print`` prints nothing and logs a warning naming
  its line, once per line and step. A ``print`` of Python values prints at capture and
  warns, once per line, that later calls will not print it (before the fifty-fourth
  session it printed on the first call alone, silently; a progress bar's ``update()``
  in the step has the same fate and cannot be seen).
- ``torch.manual_seed`` / ``torch.seed`` / ``torch.set_rng_state`` inside the step would
  reseed once, at capture, while eager reseeds every call (the same dropout masks every
  step). Refused, naming the line; torch's own calls (activation checkpointing's
  ``fork_rng``) go through.
- A random op given its own ``torch.Generator`` (``torch.randn(..., generator=g)``) is
  recorded with that generator object, whose state the program neither advances as eager
  does nor shares across ranks (checked on the first graph: every node with a
  ``generator`` argument is refused, naming the op and line). The default generator,
  seeded outside the step, is the supported way (NOTE: [random numbers] in random_draws.py).
- A draw from Python's ``random`` or NumPy's global generator: NOTE: [host random
  numbers at capture].
- A memoized function that makes tensors (transformers' ``compile_compatible_method_lru_cache``
  on BEiT's relative position index, DETR's and DINOv3's position embeddings, ~30
  architectures) would keep the fake tensor of the trace in its cache, for the next
  trace and for eager calls after it (BEiT was refused as a tensor read from a place the
  step cannot watch). While the step is traced, transformers' wrapper calls the function
  through, as it does under ``torch.compile``: the function's ops are traced into the
  program (index arithmetic on sizes), and the cache is left as it was. The user's own
  ``functools.lru_cache`` / ``functools.cache`` functions are called through too: NOTE:
  [the user's cached functions at capture].
- ``module.to(dtype)`` / ``.float()`` / ``.half()`` / ``.cuda()`` (``Module._apply``)
  inside the step (SwitchTransformers' router: ``self.classifier =
  self.classifier.to(self.dtype)`` in its forward) would swap the traced parameters
  for new ones, which fails inside the trace. Where the conversion changes nothing
  (every parameter, buffer and gradient already has that dtype and device: eager's
  ``param.data = param``) it does nothing, as eager's does; where it would change one,
  it is refused naming the module, the tensor and the line: the program's state keeps
  the dtype and device it was compiled with.
- A clock read (``time.perf_counter()``): NOTE: [host clock at capture].
- A value drawn from the OS's entropy (an unseeded ``np.random.default_rng()`` made in
  the step, ``secrets``, ``os.urandom``): NOTE: [host entropy at capture].
- ``torch.distributed`` calls in the step: NOTE: [torch.distributed inside the step].
Tensors the step stores in Python objects are NOTE: [tensors the step keeps].
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import linecache
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any, NoReturn
from unittest import mock

import torch
import torch.fx

from .. import _torch_private as private
from ..errors import (
    SourceLocation,
    SPMDCompileError,
    innermost_model_frame_of_stack,
    installed_package_of,
    node_error,
    warn_once_per_line,
)
from .callers import from_stdlib, from_torch, refusing
from .distributed_calls import distributed_calls_as_one_device
from .host_clock import refuse_clock_reads
from .host_entropy import refuse_entropy_reads
from .kept_tensors import is_traced

_RNG_SETTERS = ("manual_seed", "seed", "set_rng_state")


def _shows_traced(value: Any, depth: int = 2) -> bool:
    if is_traced(value):
        return True
    if depth > 0 and isinstance(value, (tuple, list)):
        return any(_shows_traced(v, depth - 1) for v in value)
    if depth > 0 and isinstance(value, dict):
        return any(_shows_traced(v, depth - 1) for v in value.values())
    return False


@contextlib.contextmanager
def python_effects(step_code: Any, roots: tuple[Any, ...] = ()) -> Iterator[None]:
    """While the step is traced: ``print`` of traced values warns instead, reseeding
    the random-number generator is refused (see the NOTE). ``roots``: the step function
    and what it is called with, where NumPy generator objects are looked for (NOTE:
    [host random generator objects at capture])."""
    real_print = builtins.print

    def traced_print(*args: Any, **kwargs: Any) -> None:
        if not any(_shows_traced(a) for a in args):
            real_print(*args, **kwargs)
            caller = sys._getframe(1).f_code.co_filename
            # the stdlib's prints are not the step's (traceback.print_exception under a log
            # handler was blamed on the user's step)
            if not from_torch(caller) and not from_stdlib(caller):
                warn_once_per_line(
                    (step_code, "print once"),
                    "print() at {line} runs while the step is traced, at its first call; "
                    "later compiled calls run the program, which holds tensor ops only, and "
                    "print nothing (a progress bar's update() or a counter kept in Python "
                    "is the same: it happens at capture only). Print, log and count outside "
                    "the compiled step. (NOTE: [Python effects at capture])",
                )
            return
        warn_once_per_line(
            (step_code, "print"),
            "print() at {line} shows a tensor the compiled program computes: it runs once, "
            "while the step is traced, when tensors hold no values, so compiled calls "
            "print nothing there. Return the value (return {'loss': loss.item()}) and "
            "print it outside the compiled step. (NOTE: [Python effects at capture])",
        )

    def refuse_reseed(name: str, real: Any) -> Any:
        def refuse() -> NoReturn:
            where = innermost_model_frame_of_stack()
            package = installed_package_of(where)
            # NOTE: [a reseed in a library's code]: transformers' Reformer reseeds in its
            # reversible layers whenever it trains (``torch.seed()`` in forward, replayed
            # by ``manual_seed`` in its hand-written backward), whatever its dropout: no
            # configuration turns it off, so "seed once outside" cannot be followed there
            hint = (
                f"the reseed is in the code of the installed package {package!r}, which no setting of the step "
                "changes: a model whose forward or backward reseeds the generator (transformers' "
                "Reformer with its reversible layers does whenever it trains) cannot be "
                "compiled; train it eagerly, or choose a model that does not reseed."
            ) if package is not None and package != "spmd_compiler" else (
                "seed once before the first call (torch.manual_seed(s) outside the "
                "compiled step); the program draws from the default generator every call."
            )
            raise SPMDCompileError(
                f"The train step calls torch.{name}(): a compiled step runs its Python once, "
                "at capture, so the generator would be reset once instead of every call, and "
                "the program's random draws would differ from eager's.",
                user_line=where,
                hint=hint,
                library_note=package is None,
            )
        # torch's own calls (checkpoint's fork_rng, ...) go through
        return refusing(real, refuse, lambda filename: not from_torch(filename))

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(builtins, "print", traced_print))
        for name in _RNG_SETTERS:
            for owner in (torch, torch.random):
                if hasattr(owner, name):
                    real = getattr(owner, name)
                    stack.enter_context(mock.patch.object(owner, name, refuse_reseed(name, real)))
        stack.enter_context(_refuse_host_random_draws())
        stack.enter_context(_refuse_generator_object_draws(step_code, roots))
        stack.enter_context(refuse_clock_reads())
        stack.enter_context(refuse_entropy_reads())
        stack.enter_context(_library_caches_called_through())
        stack.enter_context(mock.patch.object(torch.nn.Module, "_apply", _conversion_that_changes_nothing))
        stack.enter_context(distributed_calls_as_one_device(step_code))
        stack.enter_context(private.quiet_meta_failure_log())  # NOTE: [torch's log of a failed meta kernel]
        yield


def _conversion_that_changes_nothing(module: torch.nn.Module, fn: Any, recurse: bool = True) -> torch.nn.Module:
    """``Module._apply`` (``to`` / ``float`` / ``half`` / ``cuda`` ...) while the step is
    traced: nothing to do where ``fn`` returns every tensor itself; refused otherwise
    (see the NOTE)."""
    owners = module.named_modules() if recurse else [("", module)]
    with torch.no_grad():
        for prefix, owner in owners:
            named = [*owner._parameters.items(), *owner._buffers.items()]
            for name, tensor in named:
                for what, t in ((name, tensor), (f"{name}.grad", getattr(tensor, "grad", None))):
                    if t is None or fn(t) is t:
                        continue
                    converted = fn(t)
                    where = f"{type(owner).__name__}.{what}" + (f" ({prefix})" if prefix else "")
                    raise SPMDCompileError(
                        f"The train step converts a module's tensors (Module.to / float / half "
                        f"/ cuda ...): {where} would go from {t.dtype} on {t.device.type} to "
                        f"{converted.dtype} on {converted.device.type}. A compiled step's "
                        "parameters and buffers keep the dtype and device it was compiled with.",
                        user_line=innermost_model_frame_of_stack(),
                        hint="convert the model once before the first call (model.to(dtype)), "
                        "or cast activations inside the step (x.to(dtype), torch.autocast).",
                    )
    return module


@contextlib.contextmanager
def _library_caches_called_through() -> Iterator[None]:
    """transformers' tensor-making lru caches bypassed while the step is traced (the NOTE);
    nothing when transformers is not imported."""
    utils = sys.modules.get("transformers.pytorch_utils")
    if utils is None or not hasattr(utils, "is_torchdynamo_compiling"):
        yield
        return
    with mock.patch.object(utils, "is_torchdynamo_compiling", lambda: True):
        yield


# NOTE: [the user's cached functions at capture]
# A ``functools.lru_cache`` / ``functools.cache`` function of the user's own that makes a
# tensor (``class_weights(c)`` returning ``torch.linspace(0.5, 1.5, c)``, a mask by
# length) called in the step kept the trace's FakeTensor in its cache, until the
# sixty-third session: eager code after the compile got the fake
# (DataDependentOutputException), a smaller last batch's capture was refused as "a tensor
# that is neither an argument nor part of a module" (which the user had made inside the
# step), and where eager had filled the cache first the first compiled call was refused
# so. Now, while each trace of a capture runs (``trace.traces_start_from``), every such
# function the guard walk reached (held in a module's globals, an object's ``__dict__``,
# a closure cell or a user class: ``Guards.cached_functions``) is replaced where it is
# held by one that calls the function itself, as eager's first call computes it: its ops
# are the program's, and its cache is neither read nor written (``cache_info()`` as
# found); the functions are put back when the trace ends, before the guards are
# checked. A cached function held where the walk does not go (deeper than it walks, a
# library's) is not called through.


def _called_through(cached: Any) -> Any:
    """A function calling ``cached``'s own function, not its cache; its ``cache_info``,
    ``cache_clear`` and ``cache_parameters`` are ``cached``'s. A ``staticmethod`` /
    ``classmethod`` over a cached function (as a class's dict holds it) stays one (until
    the sixty-fourth session such a cache was not called through: its FakeTensor was
    refused as a tensor from outside the arguments)."""
    if isinstance(cached, (staticmethod, classmethod)):
        return type(cached)(_called_through(cached.__func__))
    wrapped = cached.__wrapped__

    def through(*args: Any, **kwargs: Any) -> Any:
        return wrapped(*args, **kwargs)

    functools.update_wrapper(through, cached)
    for name in ("cache_info", "cache_clear", "cache_parameters"):
        setattr(through, name, getattr(cached, name))
    return through


def _hold(holder: Any, key: Any, value: Any) -> None:
    """Put ``value`` at ``holder[key]`` (a dict), in a closure cell (``key`` None) or as a
    class attribute."""
    if isinstance(holder, types.CellType):
        holder.cell_contents = value
    elif isinstance(holder, type):
        setattr(holder, key, value)
    else:
        holder[key] = value


@contextlib.contextmanager
def user_caches_called_through(places: list[tuple[Any, Any, Any]]) -> Iterator[None]:
    """The user's cached functions at ``places`` ((holder, key, function):
    ``Guards.cached_functions``) called through while the step is traced (the NOTE)."""
    done: list[tuple[Any, Any, Any]] = []
    try:
        for holder, key, cached in places:
            _hold(holder, key, _called_through(cached))
            done.append((holder, key, cached))
        yield
    finally:
        for holder, key, cached in reversed(done):
            _hold(holder, key, cached)


# NOTE: [host random numbers at capture]
# Python's ``random`` module and NumPy's global generator are drawn from on the host, in
# Python: a step that draws its mixup weight with ``np.random.beta(a, a)`` or a coin with
# ``random.random()`` would draw once, at capture, and every compiled call would reuse
# that number (found by a probe: the same mixup weight every step, silently). While the
# step is traced, the module functions of both generators (``random.random``,
# ``np.random.beta``, ...) refuse, naming the line; a draw through another reference
# (``from random import random`` imported earlier) is caught afterwards by comparing
# each generator's state with the one before the trace. Either way each generator's
# state is put back as it was before the trace. Calls from torch's own files and from
# other threads (a data-loading thread drawing augmentations) go through; while other
# Python threads run (but ours and tqdm's monitor), states are neither compared nor put
# back (their draws would look like the step's), so a draw through another reference
# is then not seen. NumPy's ``Generator`` objects: the NOTE below; one made in the
# step without a seed: NOTE: [host entropy at capture].
# NOTE: not torch.distributions.Beta(a, a).sample() for np.random.beta: its
# aten._sample_dirichlet reads a tensor and is refused too (refuse_shard_local_draws)
_HOST_DRAW_HINT = (
    "draw it with torch inside the step (torch.rand(()), torch.randn(()), "
    "torch.randint), which the program draws anew every call, or draw it outside the "
    "step (a mixup weight from np.random.beta(a, a), say) and pass it as a float or 0-d "
    "tensor argument (a graph input, NOTE: [float arguments as graph inputs])."
)


def _host_generators() -> list[tuple[str, Any, list[tuple[Any, str]], Any, Any]]:
    """(name, the generator, its module functions (owner, attribute), get state, set
    state) of Python's ``random`` module and, where imported, NumPy's global generator."""
    import random

    out: list[tuple[str, Any, list[tuple[Any, str]], Any, Any]] = [(
        "Python's random module", random._inst,  # type: ignore[attr-defined]
        [(random, n) for n in random.__all__],
        random.getstate, random.setstate,
    )]
    np = sys.modules.get("numpy")
    if np is not None and hasattr(np.random, "mtrand"):
        global_state = np.random.mtrand._rand
        out.append((
            "NumPy's global generator (numpy.random)", global_state,
            [(np.random, n) for n in getattr(np.random, "__all__", ())],
            global_state.get_state, global_state.set_state,
        ))
    return out


# Threads known not to draw random numbers: ours (the progress heartbeat) and tqdm's
# monitor, which training scripts start with their first progress bar.
_QUIET_THREADS = ("spmd-", "tqdm_monitor")


def _other_threads() -> bool:
    """Python threads other than this one that might draw random numbers."""
    me = threading.current_thread()
    return any(t is not me and not t.name.startswith(_QUIET_THREADS) for t in threading.enumerate())


def _same_state(a: Any, b: Any) -> bool:
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b))
    if hasattr(a, "tobytes") and hasattr(b, "tobytes"):
        return bool(a.tobytes() == b.tobytes())
    return bool(a == b)


@contextlib.contextmanager
def _refuse_host_random_draws() -> Iterator[None]:
    """See NOTE: [host random numbers at capture]."""
    generators = _host_generators()
    # another thread (a data-loading thread drawing augmentations) may draw meanwhile:
    # then states are neither compared nor put back
    alone = not _other_threads()
    before = [get() for _, _, _, get, _ in generators] if alone else []

    def refused(name: str, attribute: str, real: Any) -> Any:
        def refuse() -> NoReturn:
            raise SPMDCompileError(
                f"The train step draws a random number from {name} ({attribute}()): a "
                "compiled step runs its Python once, at capture, so every call would reuse "
                "the number drawn then.",
                user_line=innermost_model_frame_of_stack(),
                hint=_HOST_DRAW_HINT,
            )
        return refusing(real, refuse, lambda filename: not from_torch(filename))

    try:
        with contextlib.ExitStack() as stack:
            for name, generator, functions, _, _ in generators:
                for owner, attribute in functions:
                    real = getattr(owner, attribute, None)
                    if getattr(real, "__self__", None) is generator:
                        stack.enter_context(
                            mock.patch.object(owner, attribute, refused(name, attribute, real))
                        )
            yield
    finally:
        changed: list[str] = []
        if alone and not _other_threads():
            for (name, _, _, get, set_state), state in zip(generators, before, strict=True):
                if not _same_state(get(), state):
                    changed.append(name)
                set_state(state)
    if changed:
        raise SPMDCompileError(
            f"The train step draws random numbers from {changed[0]}: a compiled step runs "
            "its Python once, at capture, so every call would reuse the numbers drawn then.",
            user_line=innermost_model_frame_of_stack(),
            hint=_HOST_DRAW_HINT,
        )


# NOTE: [host random generator objects at capture]
# The objects of those generators drew once too: an augmentation object holding its own
# ``random.Random(seed)`` or ``np.random.default_rng(seed)`` / ``np.random.RandomState``
# drew at capture, and every compiled call reused that number (found by a probe: losses
# equal to eager's with the first draw reused, silently; before the fifty-eighth
# session only the module functions were refused). While the step is traced:
# - ``random.Random``'s drawing methods (``random``, ``uniform``, ``gauss``, ``choice``,
#   ...), patched on the class, refuse, naming the method and the line, for every
#   instance (the module functions are bound to its own instance before, and are
#   refused by the NOTE above).
# - NumPy's ``Generator`` and ``RandomState`` are extension types whose methods cannot
#   be patched: the ones the step can reach (its closure and the globals its code names,
#   a few levels into the objects found there, and the attributes of its modules) have
#   their states taken before the trace and compared after it; a moved one is refused,
#   naming its type and where it was found, and every state is put back. One reachable
#   otherwise (through a library's module) is not seen.
# Calls from torch's files and the standard library's (``tempfile`` names files with a
# ``random.Random`` of its own), and other threads' (while they run, states are not
# compared), go through. A generator made inside the step with a fixed seed draws the same numbers
# every call eagerly, as the program reuses: such NumPy draws are not refused.
_GENERATOR_OBJECT_HINT = (
    "draw with torch ops inside the step (torch.rand(()) and the like, from the default "
    "generator seeded outside the step), which the program draws anew every call, or "
    "draw outside the step and pass the value as a tensor argument."
)
_RANDOM_METHODS = (
    "random", "uniform", "triangular", "randint", "randrange", "choice", "choices",
    "shuffle", "sample", "randbytes", "getrandbits", "gauss", "normalvariate",
    "lognormvariate", "expovariate", "vonmisesvariate", "gammavariate", "betavariate",
    "paretovariate", "weibullvariate", "binomialvariate",
)
_SCAN_DEPTH = 3
_SCAN_WIDTH = 256  # entries of one container looked at


def _numpy_generator_kinds() -> tuple[type, ...]:
    np = sys.modules.get("numpy")
    if np is None or not hasattr(np.random, "Generator"):
        return ()
    return (np.random.Generator, np.random.RandomState)


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _reachable_numpy_generators(roots: tuple[Any, ...]) -> list[tuple[str, Any]]:
    """(where found, generator) of the NumPy generator objects ``roots`` reach (see the
    NOTE); NumPy's global one is the module functions' NOTE's."""
    kinds = _numpy_generator_kinds()
    if not kinds:
        return []
    global_one = getattr(getattr(sys.modules["numpy"].random, "mtrand", None), "_rand", None)
    seen: set[int] = set()
    found: list[tuple[str, Any]] = []

    def visit(where: str, obj: Any, depth: int) -> None:
        if id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None), torch.Tensor)):
            return
        seen.add(id(obj))
        if isinstance(obj, kinds):
            if obj is not global_one:
                found.append((where, obj))
            return
        if depth <= 0 or isinstance(obj, (type, types.ModuleType)):
            return
        if isinstance(obj, torch.nn.Module):
            for name, sub in obj.named_modules():
                for key, value in vars(sub).items():
                    if not key.startswith("_"):
                        visit(f"{where}.{name}.{key}" if name else f"{where}.{key}", value, depth - 1)
            return
        if isinstance(obj, types.MethodType):
            visit(where, obj.__self__, depth)
            visit(where, obj.__func__, depth)
            return
        if isinstance(obj, types.FunctionType):
            for name, cell in zip(obj.__code__.co_freevars, obj.__closure__ or (), strict=False):
                try:
                    visit(name, cell.cell_contents, depth - 1)
                except ValueError:  # an empty cell
                    continue
            for name in _code_names(obj.__code__):
                if name in obj.__globals__:
                    visit(name, obj.__globals__[name], depth - 1)
            return
        # NOTE: only what is stored, read without the objects' own code (a lazy registry's
        # items() imports every model class; a proxy's __getattr__ may do anything)
        if isinstance(obj, dict):
            for key, value in list(dict.items(obj))[:_SCAN_WIDTH]:
                visit(f"{where}[{key!r}]", value, depth - 1)
        elif isinstance(obj, (list, tuple)):
            for i, value in enumerate(list.__iter__(obj) if isinstance(obj, list) else tuple.__iter__(obj)):
                if i >= _SCAN_WIDTH:
                    break
                visit(f"{where}[{i}]", value, depth - 1)
        else:
            try:
                attributes = object.__getattribute__(obj, "__dict__")
            except Exception:  # noqa: BLE001 - no plain attributes
                attributes = None
            if isinstance(attributes, dict):
                for key, value in list(attributes.items())[:_SCAN_WIDTH]:
                    visit(f"{where}.{key}", value, depth - 1)
            call = vars(type(obj)).get("__call__")
            if isinstance(call, types.FunctionType):  # a callable object's code
                visit(where, call, depth - 1)

    for i, root in enumerate(roots):
        visit(getattr(root, "__name__", f"argument {i}"), root, _SCAN_DEPTH)
    return found


def _step_line(step_code: Any) -> SourceLocation | None:
    """The ``def`` line of the step."""
    if not isinstance(step_code, types.CodeType):
        return None
    return SourceLocation(step_code.co_filename, step_code.co_firstlineno,
                          linecache.getline(step_code.co_filename, step_code.co_firstlineno).strip())


@contextlib.contextmanager
def _refuse_generator_object_draws(step_code: Any, roots: tuple[Any, ...]) -> Iterator[None]:
    """See NOTE: [host random generator objects at capture]."""
    import random

    def refused(name: str, real: Any) -> Any:
        def refuse() -> NoReturn:
            raise SPMDCompileError(
                f"The train step draws a random number from a random.Random object "
                f"(random.Random.{name}()): a compiled step runs its Python once, at capture, "
                "so every call would reuse the number drawn then.",
                user_line=innermost_model_frame_of_stack(),
                hint=_GENERATOR_OBJECT_HINT,
            )
        # the standard library's own instances (tempfile's names) go through too
        return refusing(real, refuse, lambda filename: not from_torch(filename) and not from_stdlib(filename))

    objects = _reachable_numpy_generators(roots) if roots and not _other_threads() else []
    before = [g.bit_generator.state if hasattr(g, "bit_generator") else g.get_state() for _, g in objects]
    with contextlib.ExitStack() as stack:
        for name in _RANDOM_METHODS:
            real = random.Random.__dict__.get(name) or getattr(random.Random, name, None)
            if real is not None:
                stack.enter_context(mock.patch.object(random.Random, name, refused(name, real)))
        try:
            yield
        finally:
            changed: list[tuple[str, Any]] = []
            if not _other_threads():
                for (where, g), state in zip(objects, before, strict=True):
                    if hasattr(g, "bit_generator"):
                        if not _same_state(g.bit_generator.state, state):
                            changed.append((where, g))
                        g.bit_generator.state = state
                    else:
                        if not _same_state(g.get_state(), state):
                            changed.append((where, g))
                        g.set_state(state)
    if changed:
        where, g = changed[0]
        raise SPMDCompileError(
            f"The train step draws random numbers from a NumPy {type(g).__name__} object "
            f"({where}): a compiled step runs its Python once, at capture, so every call "
            "would reuse the numbers drawn then.",
            user_line=_step_line(step_code),  # the draw's line is not known: the step's
            hint=_GENERATOR_OBJECT_HINT,
        )


OWN_GENERATOR = (
    "A random op of the train step draws from its own torch.Generator; the compiled "
    "program could neither advance it as eager does nor share its draws across ranks."
)
OWN_GENERATOR_HINT = (
    "draw from the default generator (drop generator=...) and seed it with "
    "torch.manual_seed outside the compiled step."
)


def refuse_explicit_generators(gm: torch.fx.GraphModule) -> None:
    """Refuse random ops given their own ``torch.Generator`` (see the NOTE). (torch 2.11's
    make_fx fails on such an op itself; the capture names it the same way.)"""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.kwargs.get("generator") is not None:
            raise node_error(OWN_GENERATOR, node, hint=OWN_GENERATOR_HINT)


def is_own_generator_failure(exc: BaseException) -> bool:
    """torch 2.11's make_fx on an op given a ``torch.Generator``."""
    return isinstance(exc, NotImplementedError) and "torch._C.Generator" in str(exc)


__all__ = [
    "OWN_GENERATOR", "OWN_GENERATOR_HINT", "is_own_generator_failure", "python_effects",
    "refuse_explicit_generators",
]
