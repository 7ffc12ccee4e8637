"""The compile cache's key before capture: a restarted job skips the capture too.

NOTE: [cache key before capture]
The program key (NOTE: [persistent compile cache]) hashes the captured graph, so a hit
still pays the capture, half of a ddp compile. A *step entry*, written after a capture
whose program was cached, maps a key computed before capture to that program key and
to the captured step (its graph and signature). A later compile whose pre-capture key
matches, and whose entry's recorded facts still hold, loads the program without
tracing anything. A capture is a function of the code it runs, the Python values that
code reads, the arguments' tensor metadata, and torch. The key and the entry cover:
- Code. The source files of the step and of every function the guard walker reaches
  (NOTE: [guards on Python values]: forwards, helpers, methods) are hashed into the
  key; the classes of every submodule, optimizer and the mode by their source files
  (torch's by torch's version). Every other module loaded when the capture finished
  (a helper a forward imports inside a function, transformers, numpy, ...) is listed
  in the entry and checked on load: by content outside site-packages, by size and
  modification time inside it (what Python's own bytecode cache trusts); the standard
  library and torch by their versions, this compiler by its source digest. A step
  whose code has no source file (a notebook cell, ``python -c``, a ``__main__``
  without a file) gets no pre-capture key.
- Python values. Every guard's name and value (the same walk decides reuse within a
  process); the model's structure (each submodule's FQN and class, parameter and
  buffer names and their tying); every hook the step would run (global, per module,
  per parameter, per optimizer) by its code; the in-process key (``static_key``:
  optimizer hyper-parameters and state keys, training flags, non-tensor arguments);
  the environment variables read while capturing (recorded, compared on load; those
  a user's module read when a capture imported it go into every later entry of the
  process too, since later captures do not import it again).
  Reads made while an installed library's module is imported (networkx scanning the
  environment when torch imports it lazily during the first capture) are not recorded:
  they are that library's settings, versioned with it. Limit, shared with the
  in-process guards: a Python value the guard walker does not reach (a global of a
  module imported by name inside a function, changed by the script) is in neither.
  A file modified after the process started is used only if its module's bytecode
  cache records the same source (mtime and size, or hash): otherwise the code running
  may be older than the file (edited while the job runs) and hashing the file would
  key the old program by the new code; no key or entry is made then.
- Tensors: the metadata of every argument and state tensor.
- Settings: everything the program key holds besides the graph (``settings_parts``),
  the float32 matmul precision and grad mode.
Float arguments the capture made graph inputs are not in the key; floats it baked as
constants are recorded and compared. A capture that changed a guarded value (lazy
set-up in a forward: the state after the first call differs from what the key saw)
writes no step entry, nor does one whose capture iterated the whole environment. What
the key cannot describe exactly (an object argument, a hook that is not a function, a
class without a source file) leaves the step without a pre-capture key: it is cached
by its program key as before (capture, then load). A first call that made the
optimizer state before its program writes its step entry under the key it has with that
state, and a state entry under the key it had without (NOTE: [optimizer state made on a
restart] in ``capture/initial_state.py``). Tests: tests/sim/test_step_key.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.util
import io
import json
import logging
import os
import sys
import sysconfig
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from . import _torch_private as private
from .capture.code_names import names_in
from .capture.containers import holds_containers
from .capture.guards import Guards
from .compile_cache import (
    ProgramCache,
    Uncacheable,
    _class_sources,
    _Decoder,
    _Encoder,
    _meta,
    _ref,
    _signature,
    _state_ref,
    _tensor_meta,
    collector_paused,
    encoded_graph,
    file_digest,
    fingerprint,
    source_digest,
    warn_broken_entry,
)
from .errors import Change, in_installed_package
from .ir.signature import CapturedStep, Kind, TensorMeta, ValueCheck

log = logging.getLogger("spmd_compiler.compile_cache")

FORMAT = 1
_WHOLE_ENVIRONMENT = "<the whole environment>"


def float_positions(flat_args: list[Any]) -> frozenset[int]:
    return frozenset(i for i, a in enumerate(flat_args) if type(a) is float)


def step_key(
    func: Callable[..., Any], bindings: Any, input_metas: list[TensorMeta], guards: Guards,
    settings: list[Any],
) -> str:
    """The pre-capture key of a call (see the NOTE). ``guards`` are built with the float
    arguments as graph inputs; ``settings`` is ``compile_cache.settings_parts(...)``.

    Raises:
        Uncacheable: something the key cannot describe exactly.
    """
    target = func.__func__ if isinstance(func, types.MethodType) else func
    if not isinstance(target, types.FunctionType):
        raise Uncacheable(f"a train step of type {type(func).__qualname__}")
    main = sys.modules.get("__main__")
    if target.__module__ == "__main__" and main is not None and not getattr(main, "__file__", None):
        # an interactive __main__ holding the step (a notebook, ``python -c``); a worker
        # whose __main__ is a launcher's (pytest-xdist's execnet) keys its imported steps
        # as usual: every file they reach is checked below, classes by _class_sources
        raise Uncacheable("an interactive __main__ (code without a source file)")
    _refuse_values_from_outside(guards)
    files = []
    loaded = _loaded_files()
    for path in sorted(guards.code_files | {target.__code__.co_filename}):
        if not os.path.isfile(path):
            raise Uncacheable(f"code without a source file ({path})")
        module = loaded.get(path)
        if module is None:  # named through another path (a symlink)
            real = os.path.realpath(path)
            module = next((m for f, m in loaded.items() if os.path.realpath(f) == real), None)
        if module is None or stale_source(path, module):
            raise Uncacheable(f"{path}, not a loaded module's unchanged source")
        files.append([path, file_digest(path)])
    parts = [
        FORMAT, files, [target.__module__, target.__qualname__],
        [[name, _guarded_value(name, value)] for name, value in guards.described()],
        _structure(bindings),
        [_meta(m) for m in input_metas],
        [[_ref(r), _meta(TensorMeta.of(v))] for r, v in bindings.state_refs()],
        [_ref(r) for r in bindings.hyperparam_refs()],
        fingerprint(list(bindings.static_key()[1:])),
        _treespec(bindings.args_spec),
        _hooks(bindings),
        torch.get_float32_matmul_precision(), torch.is_grad_enabled(),
        *settings,
    ]
    return hashlib.sha256(repr(parts).encode()).hexdigest()


# NOTE: [values from outside Python's objects]
# A value the step's code gets from a file (``open``, ``json.load``, ``Path.read_text``),
# the command line (``sys.argv``) or a cached function (``functools.lru_cache``: a settings
# loader called once) is in no guard: the trace bakes it into the program. The program
# key holds it (the graph's constants), but a hit of the key before capture loads a
# program without tracing: a job restarted with another value in its settings file or on
# its command line ran the first job's program (losses 0.18 off, parameters 0.93
# relative, a probe). Code the walk reaches that names one of those sources, or an
# ``lru_cache`` wrapper the walk went through, leaves the step without a key before
# capture: a restart captures again and loads its program by the program key, which the
# new value changes. (Within one process such a value is read once, at capture: a file
# edited while the job runs is not seen, as in any traced program.)
_OUTSIDE_SOURCES = frozenset({
    "open", "argv", "stdin", "read_text", "read_bytes", "load", "loads", "safe_load",
})


def _refuse_values_from_outside(guards: Guards) -> None:
    for _, _, key, obj in guards.links:
        if type(obj) is functools._lru_cache_wrapper:
            raise Uncacheable(f"a cached function ({key!r}): its results are in no key")
    for code in guards.codes:
        named = _OUTSIDE_SOURCES.intersection(names_in(code))
        if named:
            raise Uncacheable(
                f"{getattr(code, 'co_qualname', code.co_name)} reads {sorted(named)[0]!r} (a file, the command line): "
                "what it reads is in no key"
            )


def _guarded_value(name: str, value: Any) -> Any:
    """A guarded value as the key holds it. Raises Uncacheable naming the guard."""
    try:
        return fingerprint(value)
    except Uncacheable as exc:
        raise Uncacheable(f"a description of {name} ({type(value).__qualname__})") from exc


def _structure(bindings: Any) -> list[Any]:
    classes: dict[type, None] = {}
    modules = []
    for root in bindings.modules:
        for fqn, mod in root.named_modules(remove_duplicate=False):
            modules.append([fqn, f"{type(mod).__module__}.{type(mod).__qualname__}"])
            classes.setdefault(type(mod))
    optimizers = []
    for opt in bindings.optimizers:
        optimizers.append([f"{type(opt).__module__}.{type(opt).__qualname__}",
                           "step" in vars(opt)])  # an LR scheduler's step wrapper
        classes.setdefault(type(opt))
    sources = [s for cls in classes for s in _class_sources(cls)]
    return [modules, optimizers, sources, bindings.module_params, bindings.module_buffers]


def _hooks(bindings: Any) -> list[Any]:
    out = []
    for where, hook in private.step_hooks(bindings.modules, bindings.optimizers):
        fn = hook.__func__ if isinstance(hook, types.MethodType) else hook
        if not isinstance(fn, types.FunctionType) or not os.path.isfile(fn.__code__.co_filename):
            raise Uncacheable(f"the hook {hook!r:.60} ({where})")
        if isinstance(hook, types.MethodType):
            raise Uncacheable(f"the bound-method hook {fn.__qualname__} ({where})")
        out.append([where, fn.__module__, fn.__qualname__,
                    file_digest(fn.__code__.co_filename)])
    return out


def _treespec(spec: Any) -> str:
    try:
        return private.treespec_text(spec)
    except Exception as exc:  # noqa: BLE001 - a pytree type without a serialized name
        raise Uncacheable(f"the step's argument structure ({type(exc).__name__})") from exc


# --------------------------------------------------------------------------- recorded
@contextlib.contextmanager
def record_environment() -> Iterator[dict[str, str | None]]:
    """The environment variables read while the block runs (name -> value, None when
    unset); ``_WHOLE_ENVIRONMENT`` is set when something iterated the environment."""
    reads: dict[str, str | None] = {}
    cls = type(os.environ)
    get, iterate = cls.__getitem__, cls.__iter__

    def getitem(self: Any, key: Any) -> Any:
        try:
            value = get(self, key)
        except KeyError:
            _record(reads, key, None)
            raise
        _record(reads, key, value)
        return value

    def iterate_all(self: Any) -> Any:
        _record(reads, _WHOLE_ENVIRONMENT, "")
        return iterate(self)

    cls.__getitem__, cls.__iter__ = getitem, iterate_all  # type: ignore[method-assign]
    try:
        yield reads
    finally:
        cls.__getitem__, cls.__iter__ = get, iterate  # type: ignore[method-assign]


# Reads made while a user's module was imported during a capture: the module stays
# imported, so later captures in this process do not read them again, yet their
# programs depend on them too; every later step entry records them.
_IMPORT_READS: dict[str, str | None] = {}


def _record(reads: dict[str, str | None], key: Any, value: Any) -> None:
    importing = _importing()
    if importing == "library":
        return
    name, text = _text(key), None if value is None else _text(value)
    reads.setdefault(name, text)
    if importing == "user":
        _IMPORT_READS.setdefault(name, text)


def _importing() -> str:
    """Whether an installed library's module is being imported (its top-level code
    runs): the library reading its own settings once per process (networkx scans the
    environment when torch imports it lazily during a first capture), not the step's
    code ("library"). A user's module read while imported ("user") is recorded, for
    this capture and every later one (``_IMPORT_READS``); "" when nothing is imported."""
    frame: types.FrameType | None = sys._getframe(3)
    module = None  # the innermost module body run on the way to the read
    while frame is not None:
        code = frame.f_code
        if code.co_name == "<module>" and module is None:
            module = code.co_filename
        elif code.co_filename.startswith("<frozen importlib") and module is not None:
            library = module.startswith(_skipped_roots()) or in_installed_package(module)
            return "library" if library else "user"
        frame = frame.f_back
    return ""


def _text(value: Any) -> str:
    return value.decode(errors="surrogateescape") if isinstance(value, bytes) else str(value)


@functools.lru_cache(maxsize=1)
def _skipped_roots() -> tuple[str, ...]:
    import spmd_compiler

    roots = [Path(torch.__file__).parent, Path(sysconfig.get_paths()["stdlib"]),
             Path(spmd_compiler.__file__).parent]
    for name in ("passes", "parallel_modes"):
        module = sys.modules.get(f"spmd_compiler.{name}")
        if module is not None and module.__file__:
            roots.append(Path(module.__file__).parent)
    # as modules name their files, and resolved (a symlinked venv or checkout)
    return tuple({str(p) + os.sep for r in roots for p in (r.absolute(), r.resolve())})


def _loaded_files() -> dict[str, Any]:
    """Source file (as the module names it) -> the module loaded from it. A module named
    inside torch's package is torch's, wherever its file lies: Inductor execs the kernels
    it generates as ``torch._inductor...<key>`` modules (and loads their C++ libraries as
    ``<key>.kernel``, skipped by their directory, ``inductor_cache_roots``), written while
    the process runs; taken for user files edited while loaded, they left every step
    compiled after an Inductor compile without a cache entry."""
    return {f: m for name, m in list(sys.modules.items())
            if isinstance(f := getattr(m, "__file__", None), str) and not name.startswith("torch.")}


def _process_start_ns() -> int:
    """When this process started (Linux), else when this module was imported."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime"))
        return (boot * 1_000_000_000) + ticks * 1_000_000_000 // os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORTED_NS


_IMPORTED_NS = time.time_ns()
_START_NS = _process_start_ns()


def stale_source(path: str, module: Any) -> bool:
    """Whether the file on disk may differ from the code this process runs: modified
    after the process started, and not what the module's bytecode was compiled from
    (its ``__pycache__`` header records the source's mtime and size, or its hash, at
    import). Hashing the file would then key the old program by the new code."""
    stat = os.stat(path)
    if stat.st_mtime_ns < _START_NS - 1_000_000_000:  # one second of clock slack
        return False
    cached = getattr(module, "__cached__", None)
    try:
        header = Path(cached).read_bytes()[:16] if cached else b""
    except OSError:
        return True
    if len(header) < 16:
        return True
    flags = int.from_bytes(header[4:8], "little")
    if flags & 1:  # a hash-based pyc
        return header[8:16] != importlib.util.source_hash(Path(path).read_bytes())
    mtime, size = int.from_bytes(header[8:12], "little"), int.from_bytes(header[12:16], "little")
    return (mtime, size) != (int(stat.st_mtime) & 0xFFFFFFFF, stat.st_size & 0xFFFFFFFF)


def module_manifest() -> list[list[Any]]:
    """Every loaded module's source file outside torch, the standard library and this
    compiler: ``[path, "stat", size, mtime_ns]`` inside site-packages, ``[path,
    "sha256", digest]`` elsewhere (see the NOTE).

    Raises:
        Uncacheable: a file changed on disk since its module was loaded.
    """
    skipped = _skipped_roots() + private.inductor_cache_roots()  # torch's generated kernels
    out = []
    for path, module in sorted(_loaded_files().items(), key=lambda item: item[0]):
        if path.startswith(skipped) or not os.path.isfile(path):
            continue
        if stale_source(path, module):
            raise Uncacheable(f"{path}, changed since it was loaded")
        if in_installed_package(path):
            stat = os.stat(path)
            out.append([path, "stat", stat.st_size, stat.st_mtime_ns])
        else:
            out.append([path, "sha256", file_digest(path)])
    return out


def _manifest_holds(manifest: list[list[Any]]) -> str | None:
    """The first listed file that changed (or vanished), or None."""
    for path, kind, *expected in manifest:
        try:
            if kind == "stat":
                stat = os.stat(path)
                if [stat.st_size, stat.st_mtime_ns] != expected:
                    return path
            elif [file_digest(path)] != expected:
                return path
        except OSError:
            return path
    return None


# --------------------------------------------------------------------------- entries
def entry_bytes(
    key: str, program_key: str, captured: CapturedStep, bindings: Any,
    environment: dict[str, str | None],
) -> bytes:
    """The step entry of ``key``. Raises Uncacheable."""
    if captured.outside:  # live objects (NOTE: [tensors read from outside the arguments])
        raise Uncacheable(f"guards on tensors read from outside the arguments ({captured.outside[0].label})")
    if captured.kept:  # live Python objects (NOTE: [tensors the step keeps])
        raise Uncacheable(f"the places the step keeps tensors in ({captured.kept[0].label})")
    if captured.counted:  # every rank must capture: NOTE: [rows of one count]
        raise Uncacheable(f"a count per row read from the arguments ({captured.counted[0]})")
    if captured.scheduler_steps:  # their state is no guard (NOTE: [schedulers stepped in the step])
        raise Uncacheable(f"the LR scheduler steps it replays ({captured.scheduler_steps[0].where})")
    if captured.rewound_generators:  # not in the entry (NOTE: [a step's own fork_rng])
        raise Uncacheable("the random-number generators it sets back after every call (fork_rng)")
    if captured.requires_grad_after:  # not in the entry (NOTE: [requires_grad set in the step])
        raise Uncacheable(f"the requires_grad it sets ({captured.requires_grad_after[0][0]})")
    facts = _recorded_facts(captured, bindings, environment)
    encoded, graph_constants = encoded_graph(captured.graph_module)
    constants = list(graph_constants)
    enc = _Encoder(constants)  # return values are encoded after the graph's constants
    graph = json.dumps(encoded, separators=(",", ":"))
    body = {
        "program_key": program_key,
        "signature": _signature(captured),
        "return_spec": _treespec(captured.return_spec),
        "return_leaves": [[kind, enc.value(v)] for kind, v in captured.return_leaves],
        "notes": [str(n) for n in captured.notes],
        "checks": [dataclasses.asdict(c) for c in captured.checks],  # NOTE: [value checks]
        "graph_args": _graph_float_arguments(captured), **facts,
    }
    buffer = io.BytesIO()
    # the graph apart: parsed only when a loaded step's graph is read (LoadedStep)
    torch.save({"format": FORMAT, "key": key, "digest": source_digest(), "graph": graph,
                "entry": json.dumps(body, separators=(",", ":")), "constants": constants}, buffer)
    return buffer.getvalue()


def _graph_float_arguments(captured: CapturedStep) -> list[int]:
    """The float arguments the program reads as graph inputs (NOTE: [float arguments as
    graph inputs])."""
    return sorted(r.index for r in captured.input_refs() if r.kind is Kind.HYPERPARAM and r.optimizer < 0)


def _recorded_facts(
    captured: CapturedStep, bindings: Any, environment: dict[str, str | None]
) -> dict[str, Any]:
    """What an entry records for ``_first_change`` to compare on load: the floats the
    program baked in, the environment variables the capture read, the loaded modules.
    Raises Uncacheable for a capture that read the whole environment."""
    environment = {**_IMPORT_READS, **environment}
    if _WHOLE_ENVIRONMENT in environment:
        raise Uncacheable("a capture that read the whole environment")
    graph_args = set(_graph_float_arguments(captured))
    return {
        "baked": [[i, float.hex(bindings.flat_args[i])]
                  for i in sorted(float_positions(bindings.flat_args) - graph_args)],
        "environment": sorted([k, v] for k, v in environment.items()),
        "manifest": module_manifest(),
    }


def state_entry_bytes(
    key: str, recipe: list[list[Any]], captured: CapturedStep, bindings: Any,
    environment: dict[str, str | None],
) -> bytes:
    """The state entry of ``key`` (NOTE: [optimizer state made on a restart] in
    ``capture/initial_state.py``): the made state's recipe and the facts the capture
    that made it read, as its step entry records them (a float the program reads as an
    input cannot reach the made state: only factory ops make it). Raises Uncacheable."""
    body = {"made_state": recipe, **_recorded_facts(captured, bindings, environment)}
    buffer = io.BytesIO()
    torch.save({"format": FORMAT, "key": key, "digest": source_digest(),
                "entry": json.dumps(body, separators=(",", ":"))}, buffer)
    return buffer.getvalue()


def load_state_recipe(cache: ProgramCache, key: str, bindings: Any) -> list[list[Any]] | None:
    """The recipe of the state entry under ``key``, or None: no entry, a recorded fact
    that no longer holds (logged), or a broken entry (warned)."""
    data = cache.read_state(key)
    applying = None if data is None else _applying(data, key, cache.state_path(key), "state entry", bindings)
    return None if applying is None else applying[1]["made_state"]


def _applying(
    data: bytes, key: str, path: Path, kind: str, bindings: Any
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The stored dict and its JSON entry, where the format, key and compiler digest are
    this process's (else warned) and the facts it recorded still hold (else logged);
    None otherwise."""
    try:
        with collector_paused():  # NOTE: [no collector while an entry is decoded]
            body = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
        for name, expected in (("format", FORMAT), ("key", key), ("digest", source_digest())):
            if body.get(name) != expected:
                raise ValueError(f"its {name} is {body.get(name)!r:.20}, not {expected!r:.20}")
        entry = json.loads(body["entry"])
    except Exception as exc:  # noqa: BLE001 - a broken entry is ignored, never used
        warn_broken_entry(f"{kind} {path}", data, exc, stacklevel=5)
        return None
    change = _first_change(entry, bindings)
    if change is not None:
        log.info("the %s %s does not apply: %s", kind, path, change)
        return None
    return body, entry


def load(
    cache: ProgramCache, key: str, func: Callable[..., Any], bindings: Any
) -> tuple[str, CapturedStep, frozenset[int]] | None:
    """The program key, captured step and float graph arguments stored under ``key``,
    or None: no entry, a recorded fact that no longer holds (logged), or a broken
    entry (warned)."""
    data = cache.read_step(key)
    if data is None:
        return None
    with collector_paused():  # NOTE: [no collector while an entry is decoded]
        return _loaded(cache, key, data, func, bindings)


def _loaded(
    cache: ProgramCache, key: str, data: bytes, func: Callable[..., Any], bindings: Any
) -> tuple[str, CapturedStep, frozenset[int]] | None:
    applying = _applying(data, key, cache.step_path(key), "step entry", bindings)
    if applying is None:
        return None
    body, entry = applying
    try:
        captured = _captured(entry, body["graph"], body["constants"], func, bindings)
    except Exception as exc:  # noqa: BLE001
        warn_broken_entry(f"step entry {cache.step_path(key)}", data, exc, stacklevel=5)
        return None
    return entry["program_key"], captured, frozenset(entry["graph_args"])


def _first_change(entry: dict[str, Any], bindings: Any) -> Change | None:
    for index, value in entry["baked"]:
        arg = bindings.flat_args[index]
        if type(arg) is not float or float.hex(arg) != value:
            return Change(f"float argument {index}", repr(float.fromhex(value)), repr(arg))
    for name, value in entry["environment"]:
        if os.environ.get(name) != value:
            return Change(f"environment variable {name}", repr(value), repr(os.environ.get(name)))
    path = _manifest_holds(entry["manifest"])
    return None if path is None else Change(f"{path} changed")


class LoadedStep(CapturedStep):
    """A captured step read from a step entry. Its graph (the single-device program)
    is decoded when first read: a loaded per-rank program never reads it, and decoding
    it cost a third of a restart's load."""

    _decode_graph: Callable[[], torch.fx.GraphModule] | None = None

    @property  # type: ignore[override]
    def graph_module(self) -> torch.fx.GraphModule:
        if self.__dict__.get("_graph") is None and self._decode_graph is not None:
            self.__dict__["_graph"] = self._decode_graph()
        return self.__dict__["_graph"]

    @graph_module.setter
    def graph_module(self, value: torch.fx.GraphModule | None) -> None:
        self.__dict__["_graph"] = value


def _captured(
    entry: dict[str, Any], graph: str, constants: list[torch.Tensor], func: Callable[..., Any],
    bindings: Any,
) -> CapturedStep:
    device = next(iter(bindings.params.values())).device
    dec = _Decoder([t.to(device) for t in constants], None, private.fake_tensor_mode())
    inputs, outputs, output_metas, unchanged = entry["signature"]
    code = func.__func__.__code__ if isinstance(func, types.MethodType) else func.__code__
    return_spec = private.treespec_from_text(entry["return_spec"])
    step = LoadedStep(
        graph_module=None,  # type: ignore[arg-type]  # decoded when read
        inputs=[(_state_ref(r), _tensor_meta(m)) for r, m in inputs],
        outputs=[_state_ref(r) for r in outputs],
        return_spec=return_spec,
        returns_containers=holds_containers(return_spec),
        return_leaves=[(kind, dec.value(v)) for kind, v in entry["return_leaves"]],
        step_code=code,
        output_metas=[_tensor_meta(m) for m in output_metas],
        unchanged=[_state_ref(r) for r in unchanged],
        notes=list(entry["notes"]),
        checks=[ValueCheck(**c) for c in entry.get("checks", [])],
    )
    step._decode_graph = lambda: dec.graph(json.loads(graph))
    return step
