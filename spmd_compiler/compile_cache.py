"""A persistent cache of compiled per-rank programs, so a restarted job skips expansion
and the passes.

NOTE: [persistent compile cache]
Key. The step is always captured first (``capture_step``, the single-device trace), and
the key is a SHA-256 of what the rest of the pipeline reads:
- the captured graph: every node's op, target, arguments and the node meta the pipeline
  reads (``val`` as shape / stride / dtype / device, and every ``spmd_*`` key), the bytes
  of its tensor constants, and the step signature (state refs, global metas, outputs);
- the parallel mode's settings after ``prepare`` (its plan, placements, mixed precision,
  every attribute, walked strictly), the mesh (device type, rank layout, dim names: the
  world size), PassOptions plus ``SPMD_DISABLE_PASSES``, the lowering options;
- simulated or real ranks, torch's version and git hash, Python's version, the default
  dtype and deterministic-algorithms flag;
- this package's version and a digest of the source of ``spmd_compiler`` (its ``passes``
  and ``parallel_modes`` included) and of every registered third-party pass's module, so
  an edited compiler never loads a program an older one made.
Anything the key walker cannot encode exactly (a function held by the mode, a SymInt, an
unknown object in node meta) makes the step *uncacheable*: it compiles as without a cache
(logged at INFO). This key costs a capture; a second key, computed before capture, finds
the program without tracing when everything the capture depends on is unchanged (NOTE:
[cache key before capture] in ``step_key.py``: code by source files and a manifest of
loaded modules, guarded values, structure, hooks, environment variables read). Where
that key cannot describe the step, a hit costs one capture plus the load. Guards are
built from the current call either way, so they hold on a hit exactly as on a miss.

The rank is not in the key: the per-rank program is one graph for every rank (NOTE: [one
program for every rank]); its process groups and coordinate are looked up at run time on
the mesh the graph holds, which a loaded graph gets from the current call.

Value. The per-rank graph(s) (the step, or ``first`` / ``steady`` / ``finish`` of a
deferred plan) encoded node by node into plain lists, strings and numbers (no pickled
code): targets as operator names (``aten::mm.default``) or importable functions of
``operator`` / ``torch`` / this package; tensor constants as tensors; the mesh as a
marker re-bound to the current mesh. With the signature as the pipeline left it (padding
changes input metas), the placements, local input metas, padding, and the stats the demo
shows. The file is written by ``torch.save`` to a temporary name then ``os.replace``d,
and read with ``torch.load(weights_only=True)``: a tampered file cannot run code. A file
that fails to load or decode, whose SHA-256 does not match its contents (NOTE: [cache
entries carry their SHA-256]), or whose stored key, format or compiler digest differ, is
ignored with a warning and the step recompiles (and rewrites it).

Where. ``sc.compile(..., cache_dir=...)`` or ``SPMD_COMPILER_CACHE_DIR``; off otherwise.
Off by default, unlike ``torch.compile``: a wrong program is this project's worst bug and
the cache trusts the files under the directory, so a user opts in for long jobs; tests
use their ``tmp_path``. With ``backend="inductor"``, Inductor's own FX graph cache is
pointed at ``<cache_dir>/inductor`` while lowering, so its kernels are reused too.

Ranks. On real ranks with the cache on, the first rank to claim a key on the default
store (``store.add``) compiles; the others wait for its encoded entry on the store and
decode it (no shared filesystem needed), then write it to their own cache directory. A
leader that fails publishes the failure and every waiter compiles itself (and meets the
same error).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import enum
import functools
import gc
import hashlib
import importlib
import inspect
import io
import json
import logging
import os
import sys
import tempfile
import types
import warnings
import weakref
from collections.abc import Iterable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed
import torch.fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement

from . import _torch_private as private
from .errors import SourceLocation
from .expand.retrace import DistributedProgram
from .ir.signature import CapturedStep, Kind, StateRef, TensorMeta

log = logging.getLogger("spmd_compiler.compile_cache")

CACHE_ENV = "SPMD_COMPILER_CACHE_DIR"
FORMAT = 1
# Longest a rank waits for another rank's compile of the same program (the default
# process-group timeout); after it, the rank compiles itself.
WAIT_SECONDS = 1800.0
_STORE_PREFIX = "spmd_compiler/compile_cache"
_PACKAGES = ("spmd_compiler",)
_FUNCTION_MODULES = ("operator", "builtins", "math", "torch", "spmd_compiler")
# Operator namespaces whose implementations and DTensor rules come with torch (its
# version is in the key); a custom operator's sharding rule could change unseen.
# ``device_mesh`` holds the run-time mesh coordinate a 2-D program reads (NOTE: [one
# program for every rank]), registered by torch when a trace first needs it;
# ``spmd_compiler`` our own marks (``capture/gradients.py``), registered on import.
_OP_NAMESPACES = frozenset(
    {"aten", "prims", "_c10d_functional", "c10d_functional", "_dtensor", "device_mesh",
     "spmd_compiler"}
)


class Uncacheable(Exception):
    """Something the key or the entry cannot encode exactly; the step is not cached."""


def resolve_cache_dir(cache_dir: str | os.PathLike[str] | None) -> Path | None:
    """The cache directory: the argument, else ``SPMD_COMPILER_CACHE_DIR``, else None (off)."""
    chosen = cache_dir if cache_dir is not None else os.environ.get(CACHE_ENV) or None
    return Path(chosen).expanduser() if chosen is not None else None


# --------------------------------------------------------------------------- encoding
_PLACEMENT_TYPES: dict[str, type] = private.placement_types()
_DATACLASSES: dict[str, type] = {"SourceLocation": SourceLocation}
_META_KEYS = ("val", "stack_trace")
_IMMUTABLE_LIST = torch.fx.immutable_collections.immutable_list
_IMMUTABLE_DICT = torch.fx.immutable_collections.immutable_dict


_PLACEMENT_FIELDS = {
    "Shard": ("dim",), "Replicate": (), "Partial": ("reduce_op",),
    "_StridedShard": ("dim", "split_factor"), "_NormPartial": ("norm_type",),
}


def _placement_fields(p: Placement) -> dict[str, Any]:
    name = type(p).__name__
    if name not in _PLACEMENT_FIELDS or _PLACEMENT_TYPES.get(name) is not type(p):
        raise Uncacheable(f"the placement {p!r}")
    return {f: getattr(p, f) for f in _PLACEMENT_FIELDS[name]}


class _Encoder:
    """Values -> nested lists / str / numbers / tensors; refuses what it cannot rebuild."""

    def __init__(
        self, constants: list[torch.Tensor] | None = None, mesh: Any = None, passes: tuple[str, ...] = ()
    ) -> None:
        self.constants = constants
        self.mesh = mesh
        self.passes = passes  # whose metadata an entry keeps (NOTE: [pass metadata in entries])

    def value(self, v: Any) -> Any:  # noqa: PLR0911 - one branch per supported type
        if v is None or type(v) in (bool, int, float, str):
            return v
        if type(v) is tuple:
            return ["t", [self.value(x) for x in v]]
        if type(v) in (list, _IMMUTABLE_LIST):
            return ["l", [self.value(x) for x in v]]
        if type(v) in (dict, _IMMUTABLE_DICT):
            return ["d", [[self.value(k), self.value(x)] for k, x in v.items()]]
        if type(v) is torch.fx.Node:
            return ["n", v.name]
        if isinstance(v, torch.dtype):
            return ["dtype", str(v).removeprefix("torch.")]
        if isinstance(v, torch.device):
            return ["device", str(v)]
        if isinstance(v, (torch.layout, torch.memory_format)):
            return ["torch", str(v).removeprefix("torch.")]
        if type(v) is slice:
            return ["slice", [self.value(v.start), self.value(v.stop), self.value(v.step)]]
        if v is Ellipsis:
            return ["ellipsis", 0]
        if isinstance(v, Placement):
            return ["placement", [type(v).__name__, self.value(_placement_fields(v))]]
        if type(v) in _DATACLASSES.values():
            return ["dataclass", [type(v).__name__, self.value(dataclasses.asdict(v))]]
        if isinstance(v, torch.Tensor) and type(v) is not torch.nn.Parameter:
            if private.is_fake(v):
                sizes = (*v.shape, *v.stride())
                if not all(type(s) is int for s in sizes):
                    raise Uncacheable(f"symbolic sizes {tuple(v.shape)}")
                return ["fake", [list(v.shape), list(v.stride()), self.value(v.dtype),
                                 str(v.device), v.requires_grad]]
            if type(v) is torch.Tensor and self.constants is not None:
                self.constants.append(v.detach())
                return ["const", len(self.constants) - 1]
        if self.mesh is not None and isinstance(v, DeviceMesh) and v == self.mesh:
            # the graph's mesh (an equal one traced earlier counts: torch keeps the first
            # mesh object of a layout); a loaded graph gets the current call's mesh
            return ["mesh", 0]
        if isinstance(v, enum.Enum) and type(v) is Kind:
            return ["kind", v.value]
        raise Uncacheable(f"a value of type {type(v).__qualname__} ({v!r:.80})")

    def target(self, node: torch.fx.Node) -> Any:
        t = node.target
        if node.op != "call_function":
            return t
        if private.is_op_overload(t):
            t = cast(Any, t)  # an OpOverload (checked above)
            if t.namespace not in _OP_NAMESPACES:  # a user's op: its rules may change
                raise Uncacheable(f"node {node.name} calls {t}, an operator outside torch")
            return ["op", [t.namespace, t._opname, t._overloadname]]
        module, qualname = getattr(t, "__module__", None), getattr(t, "__qualname__", None)
        if module == "_operator":
            module = "operator"
        if module is None or qualname is None or module.split(".")[0] not in _FUNCTION_MODULES:
            raise Uncacheable(f"node {node.name} calls {t!r}, not an operator or torch function")
        if _resolve(module, qualname) is not t:
            raise Uncacheable(f"node {node.name} calls {module}.{qualname}, not importable by name")
        return ["fn", [module, qualname]]

    def graph(self, gm: torch.fx.GraphModule, meta_keys: bool = True) -> list[Any]:
        if not private.has_plain_codegen(gm):
            raise Uncacheable("a graph with pytree inputs or outputs")
        nodes = []
        attrs: dict[str, Any] = {}
        for node in gm.graph.nodes:
            if node.op == "get_attr":
                attrs[node.target] = self._attribute(gm, str(node.target))
            meta = self._meta(node) if meta_keys else []
            nodes.append([
                node.op, node.name, self.target(node), self.value(tuple(node.args)),
                self.value(dict(node.kwargs)), meta,
            ])
        return [nodes, [[k, v] for k, v in attrs.items()]]

    def _meta(self, node: torch.fx.Node) -> list[Any]:
        """The node meta the pipeline reads. A ``val`` with symbolic sizes (a shard size
        known per rank at run time) is left out: after the passes only the collective
        byte counts read it, and those skip a node without one."""
        out = []
        for k in sorted(node.meta):
            value = node.meta[k]
            if not (k in _META_KEYS or k.startswith("spmd_") or self.by_pass(k)):
                continue
            if isinstance(value, torch.distributed.ProcessGroup):
                continue  # a process group looked up at run time: no value to keep
            if k == "val" and _symbolic(value):
                continue
            out.append([k, self.value(value)])
        return out

    def by_pass(self, key: Any) -> bool:
        """Whether ``key`` is metadata a third-party pass of the program wrote: its name,
        or its name and a dot (``count_collectives.index``)."""
        return isinstance(key, str) and any(key == p or key.startswith(p + ".") for p in self.passes)

    def _attribute(self, gm: torch.fx.GraphModule, target: str) -> Any:
        value = gm
        for part in target.split("."):
            value = getattr(value, part)
        if isinstance(value, torch.fx.GraphModule):
            return ["graph", self.graph(value)]
        if isinstance(value, torch.nn.Parameter):
            value = value.detach()
        return self.value(value)


def _symbolic(value: Any) -> bool:
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return True
    if isinstance(value, torch.Tensor):
        return not all(type(s) is int for s in (*value.shape, *value.stride()))
    if type(value) in (tuple, list):
        return any(_symbolic(v) for v in value)
    return False


@functools.cache
def _resolve(module: str, qualname: str) -> Any:
    obj: Any = sys.modules.get(module) or __import__(module, fromlist=["_"])
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


class _Decoder:
    def __init__(self, constants: list[torch.Tensor], mesh: Any, fake_mode: Any) -> None:
        self.constants = constants
        self.mesh = mesh
        self.fake_mode = fake_mode
        self.fakes: dict[str, torch.Tensor] = {}
        self.env: dict[str, torch.fx.Node] = {}

    def value(self, v: Any) -> Any:  # noqa: PLR0911
        if not isinstance(v, list):
            return v
        tag, payload = v
        if tag == "t":
            return tuple(self.value(x) for x in payload)
        if tag == "l":
            return [self.value(x) for x in payload]
        if tag == "d":
            return {self.value(k): self.value(x) for k, x in payload}
        if tag == "n":
            return self.env[payload]
        if tag in ("dtype", "torch"):
            value = getattr(torch, payload)
            if not isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                raise ValueError(f"not a torch dtype/layout: {payload}")
            return value
        if tag == "device":
            return torch.device(payload)
        if tag == "slice":
            return slice(*(self.value(x) for x in payload))
        if tag == "ellipsis":
            return Ellipsis
        if tag == "placement":
            name, fields = payload
            return _PLACEMENT_TYPES[name](**self.value(fields))
        if tag == "dataclass":
            name, fields = payload
            return _DATACLASSES[name](**self.value(fields))
        if tag == "fake":
            return self._fake(payload)
        if tag == "const":
            return self.constants[payload]
        if tag == "mesh":
            return self.mesh
        if tag == "kind":
            return Kind(payload)
        raise ValueError(f"unknown tag {tag!r}")

    def _fake(self, spec: list[Any]) -> torch.Tensor:
        """A fake tensor of ``spec``; equal specs share one (node meta is read only)."""
        memo = repr(spec)
        if memo not in self.fakes:
            shape, stride, dtype, device, requires_grad = spec
            with self.fake_mode:
                t = torch.empty_strided(shape, stride, dtype=self.value(dtype), device=device)
            self.fakes[memo] = t.requires_grad_(requires_grad) if requires_grad else t
        return self.fakes[memo]

    def target(self, op: str, t: Any) -> Any:
        if op != "call_function":
            return t
        tag, payload = t
        if tag == "op":
            ns, name, overload = payload
            if ns not in _OP_NAMESPACES:
                raise ValueError(f"operator namespace {ns!r}")
            if ns == "device_mesh":  # a process that has not traced yet (a restart)
                private.register_device_mesh_ops()
            return getattr(getattr(getattr(torch.ops, ns), name), overload)
        if tag == "fn" and payload[0].split(".")[0] in _FUNCTION_MODULES:
            return _resolve(*payload)
        raise ValueError(f"unknown target {t!r}")

    def graph(self, data: list[Any]) -> torch.fx.GraphModule:
        nodes, attrs = data
        outer, self.env = self.env, {}
        root: dict[str, Any] = {}
        for name, value in attrs:
            root[name] = self.graph(value[1]) if value[0] == "graph" else self.value(value)
        graph = torch.fx.Graph()
        for op, name, target, args, kwargs, meta in nodes:
            node = graph.create_node(
                op, self.target(op, target), self.value(args), self.value(kwargs), name=name
            )
            if node.name != name:
                raise ValueError(f"node name {name} came back as {node.name}")
            for key, value in meta:
                node.meta[key] = self.value(value)
            self.env[name] = node
        graph.lint()
        self.env = outer
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # a get_attr of the mesh object
            return torch.fx.GraphModule(root, graph)


# --------------------------------------------------------------------------- the key
def _ref(ref: StateRef) -> list[Any]:
    return [ref.kind.value, ref.name, ref.key, ref.optimizer, ref.group, ref.index]


def _meta(meta: TensorMeta) -> list[Any]:
    return [list(meta.shape), str(meta.dtype), str(meta.device), meta.requires_grad]


def _signature(captured: CapturedStep) -> list[Any]:
    return [
        [[_ref(r), _meta(m)] for r, m in captured.inputs],
        [_ref(r) for r in captured.outputs],
        [_meta(m) for m in captured.output_metas],
        [_ref(r) for r in captured.unchanged],
    ]


def fingerprint(obj: Any, depth: int = 6) -> Any:
    """A strict, comparable description of a mode / options object: primitives,
    containers, dtypes, placements, meshes, enums, and objects (their class and every
    attribute) of torch or this package. Raises Uncacheable for anything else."""
    if obj is None or type(obj) in (bool, int, float, str):
        return obj
    if type(obj) in (tuple, list):
        return [type(obj).__name__, [fingerprint(x, depth) for x in obj]]
    if type(obj) in (set, frozenset):
        return ["set", sorted(repr(fingerprint(x, depth)) for x in obj)]
    if type(obj) in (dict, types.MappingProxyType):
        return ["dict", sorted(([repr(fingerprint(k, depth)), fingerprint(v, depth)]
                                for k, v in obj.items()), key=lambda kv: kv[0])]
    if isinstance(obj, (torch.dtype, torch.device)):
        return str(obj)
    if isinstance(obj, enum.Enum):
        return [type(obj).__qualname__, repr(obj.value)]
    if isinstance(obj, Placement):
        return ["placement", type(obj).__name__, fingerprint(_placement_fields(obj))]
    if isinstance(obj, DeviceMesh):
        return ["mesh", obj.device_type, obj.mesh.tolist(), list(obj.mesh_dim_names or ())]
    module = type(obj).__module__ or ""
    ours = module.split(".")[0] in ("torch", *_PACKAGES)
    if depth > 0 and not ours and dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        # a pass's options given as its own dataclass (docs/writing_passes.md allows it):
        # its fields, and its class's code (defaults, checks) by its source file
        return [f"{module}.{type(obj).__qualname__}", _class_sources(type(obj)),
                fingerprint({f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}, depth - 1)]
    if depth > 0 and ours and hasattr(obj, "__dict__"):
        if callable(obj):  # code the key cannot describe (a module, a partial)
            raise Uncacheable(f"a callable {type(obj).__qualname__}")
        return [f"{module}.{type(obj).__qualname__}",
                fingerprint(dict(vars(obj)), depth - 1)]
    raise Uncacheable(f"a {type(obj).__qualname__} in the parallel mode or options")


_FILE_DIGESTS: dict[tuple[str, int, int], str] = {}


def file_digest(path: str | Path) -> str:
    """SHA-256 of a file's bytes (memoized per process while its size and mtime stay)."""
    stat = os.stat(path)
    memo = (str(path), stat.st_size, stat.st_mtime_ns)
    if memo not in _FILE_DIGESTS:
        _FILE_DIGESTS[memo] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return _FILE_DIGESTS[memo]


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """SHA-256 of this package's source (passes and parallel modes included)."""
    root = Path(__file__).resolve().parent
    roots = {root}
    for sub in ("passes", "parallel_modes"):
        module = importlib.import_module(f"spmd_compiler.{sub}")
        assert module.__file__ is not None, f"spmd_compiler.{sub} has no source file"
        roots.add(Path(module.__file__).resolve().parent)
    return _tree_digest(roots)


def _tree_digest(folders: Iterable[Path]) -> str:
    """SHA-256 over every ``.py`` file under ``folders``: its relative path and content."""
    digest = hashlib.sha256()
    for folder in sorted(folders):
        for path in sorted(folder.rglob("*.py")):
            digest.update(str(path.relative_to(folder)).encode())
            digest.update(file_digest(path).encode())
    return digest.hexdigest()


def _plugin_digest() -> list[str]:
    """The code of every third-party pass: the source files of the package (or the lone
    module) that defines it. The installed plugins are imported first: a key computed
    before the first pipeline was built (the pre-capture key of a fresh process) left a
    plugin out, so a changed pass reused the program the old one wrote (NOTE: [pass
    plugins in the key])."""
    from spmd_compiler.passes.registry import load_plugins, registered_passes

    load_plugins()
    digests = []
    for name, spec in sorted(registered_passes().items()):
        module = sys.modules.get(getattr(spec.fn, "__module__", "") or "")
        if module is None:
            raise Uncacheable(f"pass {name}'s module is unknown")
        if not _third_party_pass(spec):
            continue
        source = getattr(module, "__file__", None)
        if not source:
            raise Uncacheable(f"pass {name}'s module has no source file")
        top = sys.modules.get(module.__name__.split(".")[0], module)
        folders = [Path(f) for f in getattr(top, "__path__", ())]
        digests.append(name + ":" + (_tree_digest(folders) if folders else file_digest(source)))
    return digests


def _third_party_pass(spec: Any) -> bool:
    """Whether a registered pass is defined outside this compiler's packages."""
    return (getattr(spec.fn, "__module__", "") or "").split(".")[0] not in _PACKAGES


# NOTE: [pass plugins in the key]
# A third-party pass decides the program as much as the graph does, so the key holds its
# code: every ``.py`` file of the top-level package its function's module belongs to (a
# helper module the pass imports changes the program too), or the module's own file when
# it is not in a package. Code it imports from another package is not covered (as a
# user's step importing an installed library by name is checked by version, not content).


def _class_sources(cls: type) -> list[str]:
    """Digests of the source files of ``cls`` and its bases that are neither torch's nor
    this package's (a user's ParallelMode subclass): its code decides placements."""
    out = []
    for klass in cls.__mro__:
        top = (klass.__module__ or "").split(".")[0]
        if top in ("torch", "builtins", "abc", *_PACKAGES):
            continue
        try:
            source = inspect.getsourcefile(klass)
        except TypeError:
            source = None
        if not source or not Path(source).is_file():
            raise Uncacheable(f"the class {klass.__qualname__} without a source file")
        out.append(f"{klass.__module__}.{klass.__qualname__}:" + file_digest(source))
    return out


def _tensor_bytes(t: torch.Tensor) -> bytes:
    flat = t.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def settings_parts(mode: Any, mesh: Any, options: Any, lowering: Any, simulated: bool) -> list[Any]:
    """Everything of a key besides the step itself: the mode after ``prepare``, the
    mesh, the pass and lowering options, simulated or real ranks, torch, Python and this
    compiler (see the NOTE). Raises Uncacheable."""
    from spmd_compiler import __version__

    mode_state = {k: v for k, v in vars(mode).items() if k != "_mesh"}
    return [
        [f"{type(mode).__module__}.{type(mode).__qualname__}", fingerprint(mode_state),
         _class_sources(type(mode))],
        fingerprint(mesh), bool(simulated),
        fingerprint(options), os.environ.get("SPMD_DISABLE_PASSES", ""),
        fingerprint(lowering),
        torch.__version__, torch.version.git_version, sys.version,
        str(torch.get_default_dtype()), torch.are_deterministic_algorithms_enabled(),
        __version__, source_digest(), _plugin_digest(),
    ]


_ENCODED: weakref.WeakKeyDictionary[torch.fx.GraphModule, tuple[list[Any], list[torch.Tensor]]] = (
    weakref.WeakKeyDictionary()
)


def encoded_graph(gm: torch.fx.GraphModule) -> tuple[list[Any], list[torch.Tensor]]:
    """``gm`` encoded with its node meta, and its tensor constants; computed once per
    graph (the program key and the step entry both encode the captured graph). The
    pipeline rewrites the captured graph in place (padding), after the key: the step
    entry, written after it, gets the graph as captured from here (NOTE: [the traced
    step as captured]). Raises Uncacheable."""
    hit = _ENCODED.get(gm)
    if hit is None:
        constants: list[torch.Tensor] = []
        hit = _ENCODED[gm] = (_Encoder(constants).graph(gm), constants)
    return hit


def program_key(
    captured: CapturedStep, mode: Any, mesh: Any, options: Any, lowering: Any, simulated: bool
) -> str:
    """The cache key of the program compiled from ``captured`` (see the NOTE).

    Raises:
        Uncacheable: something the key cannot describe exactly.
    """
    graph, constants = encoded_graph(captured.graph_module)
    parts = [FORMAT, graph, _signature(captured),
             *settings_parts(mode, mesh, options, lowering, simulated)]
    digest = hashlib.sha256(repr(parts).encode())
    for t in constants:
        digest.update(f"{t.dtype}{tuple(t.shape)}".encode())
        digest.update(_tensor_bytes(t))
    return digest.hexdigest()


def same_program(a: CapturedStep, b: CapturedStep) -> bool:
    """Whether two captures of a step traced the same program: the graph, its constants
    and signature as the key reads them, and what the runtime does around it (returns,
    checks, kept tensors, schedulers); False where the key cannot describe them."""
    try:
        (graph_a, constants_a), (graph_b, constants_b) = encoded_graph(a.graph_module), encoded_graph(b.graph_module)
    except Uncacheable:
        return False
    around = ("return_spec", "return_leaves", "checks", "kept", "outside", "scheduler_steps", "counted",
              "returns_containers", "rewound_generators", "requires_grad_after")
    return (
        graph_a == graph_b
        and _signature(a) == _signature(b)
        and all(repr(getattr(a, name)) == repr(getattr(b, name)) for name in around)
        and len(constants_a) == len(constants_b)
        and all(x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
                for x, y in zip(constants_a, constants_b, strict=True))
    )


# --------------------------------------------------------------------------- entries
_GRAPHS = ("step", "first", "steady", "finish")


def encode_program(program: DistributedProgram) -> dict[str, Any]:
    """The entry of ``program``: plain data and tensors (see the NOTE). Raises
    Uncacheable."""
    constants: list[torch.Tensor] = []
    enc = _Encoder(constants, mesh=program.mesh, passes=_third_party(program.passes_applied))
    plan = program.deferred
    graphs = {"step": enc.graph(program.graph_module)}
    if plan is not None:
        graphs |= {name: enc.graph(getattr(plan, name)) for name in _GRAPHS[1:]}
    fields = {
        "signature": _signature(program.captured),
        "input_placements": enc.value(program.input_placements),
        "output_placements": enc.value(program.output_placements),
        "local_inputs": [_meta(m) for m in program.local_inputs],
        "padded": enc.value(program.padded),
        "padded_dims": enc.value(program.padded_dims),
        "collectives_before_passes": enc.value(program.collectives_before_passes),
        "passes_applied": enc.value(program.passes_applied),
        "pass_seconds": enc.value(program.pass_seconds),
        "expand_seconds": program.expand_seconds,
        "graph_meta": enc.value({k: v for k, v in program.graph_module.meta.items() if enc.by_pass(k)}),
        "deferred": None if plan is None else enc.value(
            [list(plan.positions), plan.carry_count, plan.deferred_nodes]
        ),
    }
    return {"graphs": graphs, "fields": fields, "constants": constants}


# NOTE: [pass metadata in entries]
# A third-party pass may leave its findings as metadata (docs/writing_passes.md: the
# example's ``graph_module.meta["count_collectives"]`` and ``node.meta[
# "count_collectives.index"]``). On a cache hit no pass runs, so an entry keeps what the
# program's third-party passes wrote under their own name (the key, or the name and a
# dot), graph and node alike; a value the entry cannot hold (not plain data) leaves the
# program uncached, as any other. Built-in passes keep theirs under ``spmd_``.


def _third_party(passes: list[str]) -> tuple[str, ...]:
    from spmd_compiler.passes.registry import registered_passes

    registered = registered_passes()
    return tuple(p for p in passes if p in registered and _third_party_pass(registered[p]))


def _tensor_meta(data: list[Any]) -> TensorMeta:
    shape, dtype, device, requires_grad = data
    return TensorMeta(tuple(shape), getattr(torch, dtype.removeprefix("torch.")),
                      torch.device(device), requires_grad)


def _state_ref(data: list[Any]) -> StateRef:
    kind, name, key, optimizer, group, index = data
    return StateRef(Kind(kind), name, key, optimizer, group, index)


def decode_program(
    entry: dict[str, Any], captured: CapturedStep, mesh: Any
) -> DistributedProgram:
    """Rebuild the program of ``entry`` on ``mesh``, around the fresh ``captured`` step
    (its graph, return structure and code stay; its signature becomes the one the
    pipeline left, e.g. padded)."""
    from .runtime.cross_iteration import DeferredPlan

    dec = _Decoder(entry["constants"], mesh, private.fake_tensor_mode())
    graphs = {name: dec.graph(data) for name, data in entry["graphs"].items()}
    f = entry["fields"]
    inputs, outputs, output_metas, unchanged = f["signature"]
    # a copy, not dataclasses.replace: a step loaded without capture decodes its graph
    # only when read (step_key.LoadedStep), and nothing here reads it
    captured = copy.copy(captured)
    captured.inputs = [(_state_ref(r), _tensor_meta(m)) for r, m in inputs]
    captured.outputs = [_state_ref(r) for r in outputs]
    captured.output_metas = [_tensor_meta(m) for m in output_metas]
    captured.unchanged = [_state_ref(r) for r in unchanged]
    deferred = None
    if f["deferred"] is not None:
        positions, carry_count, deferred_nodes = dec.value(f["deferred"])
        deferred = DeferredPlan(
            graphs["first"], graphs["steady"], graphs["finish"], tuple(positions),
            carry_count, deferred_nodes,
        )
    graphs["step"].meta.update(dec.value(f["graph_meta"]))  # NOTE: [pass metadata in entries]
    return DistributedProgram(
        graph_module=graphs["step"], captured=captured, mesh=mesh,
        input_placements=[tuple(p) for p in dec.value(f["input_placements"])],
        output_placements=[tuple(p) for p in dec.value(f["output_placements"])],
        local_inputs=[_tensor_meta(m) for m in f["local_inputs"]],
        padded=dec.value(f["padded"]), padded_dims=dec.value(f["padded_dims"]),
        collectives_before_passes=dec.value(f["collectives_before_passes"]),
        expand_seconds=f["expand_seconds"], passes_applied=dec.value(f["passes_applied"]),
        pass_seconds=dec.value(f["pass_seconds"]), deferred=deferred,
    )


def entry_bytes(key: str, program: DistributedProgram) -> bytes:
    """The file content of ``program``'s entry. Raises Uncacheable."""
    encoded = encode_program(program)
    constants = encoded.pop("constants")
    body = {
        "format": FORMAT, "key": key, "digest": source_digest(),
        # one JSON string: torch.load(weights_only=True) unpickles it at C speed
        "program": json.dumps(encoded, separators=(",", ":")), "constants": constants,
    }
    buffer = io.BytesIO()
    torch.save(body, buffer)
    return buffer.getvalue()


def program_from_bytes(
    data: bytes, key: str, captured: CapturedStep, mesh: Any
) -> DistributedProgram:
    """Load an entry (``torch.load(weights_only=True)``) and rebuild its program.

    Raises:
        ValueError: the entry is of another format, key or compiler.
    """
    body = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    if not isinstance(body, dict):
        raise ValueError("not a cache entry")
    for field_name, expected in (("format", FORMAT), ("key", key), ("digest", source_digest())):
        if body.get(field_name) != expected:
            raise ValueError(f"its {field_name} is {body.get(field_name)!r:.20}, not {expected!r:.20}")
    device = captured.inputs[0][1].device if captured.inputs else torch.device("cpu")
    entry = json.loads(body["program"])
    entry["constants"] = [t.to(device) for t in body["constants"]]
    return decode_program(entry, captured, mesh)


class ProgramCache:
    """Entries under ``<root>/programs/<key>.pt``, step entries (NOTE: [cache key before
    capture] in ``step_key.py``) under ``<root>/steps/<key>.pt``, state entries (NOTE:
    [optimizer state made on a restart]) under ``<root>/states/<key>.pt``; Inductor's
    cache under ``<root>/inductor``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.programs = root / "programs"
        self.steps = root / "steps"
        self.states = root / "states"

    @property
    def inductor_dir(self) -> Path:
        return self.root / "inductor"

    def path(self, key: str) -> Path:
        return self.programs / f"{key}.pt"

    def step_path(self, key: str) -> Path:
        return self.steps / f"{key}.pt"

    def state_path(self, key: str) -> Path:
        return self.states / f"{key}.pt"

    def read(self, key: str) -> bytes | None:
        return _read(self.path(key), "compile-cache entry")

    def read_state(self, key: str) -> bytes | None:
        return _read(self.state_path(key), "state entry")

    def write_state(self, key: str, data: bytes) -> None:
        _write_atomically(self.state_path(key), data)

    def read_step(self, key: str) -> bytes | None:
        return _read(self.step_path(key), "step entry")

    def write(self, key: str, data: bytes) -> None:
        _write_atomically(self.path(key), data)

    def write_step(self, key: str, data: bytes) -> None:
        _write_atomically(self.step_path(key), data)

    def load(self, key: str, captured: CapturedStep, mesh: Any) -> DistributedProgram | None:
        """The program stored under ``key``, or None (missing, or unusable: warned)."""
        data = self.read(key)
        if data is None:
            return None
        return _decode_or_warn(data, key, captured, mesh, str(self.path(key)))


# NOTE: [cache entries carry their SHA-256]
# torch.save's zip stores its members uncompressed and torch.load does not check their
# CRC: one flipped bit in a digit of a constant of the program JSON (0.01 -> 0.00) loaded
# without a warning and trained another program (sixtieth session). Every entry file
# (program, step and state entries) now starts with one line, ``_SUM_TAG`` and the
# SHA-256 of the rest, written with it in one atomic replace and checked on every read;
# a file whose sum differs, or that has none (an older compiler's), warns once (NOTE:
# [one warning per broken entry]) and is a miss: the step compiles and rewrites it.
# Measured (a shared 2-core CPU, hashlib): 3.1 ms per MB read, 0.27 ms for the 115 KB
# program entry of a 2-layer MLP under ddp, whose whole load took 54 ms; entries hold
# graphs and small constants, not the model's weights, so the sum stays a small part.
_SUM_TAG = b"spmd-compile-cache sha256 "
_SUM_LINE = len(_SUM_TAG) + 64 + 1


def _with_sum(data: bytes) -> bytes:
    """``data`` behind its checksum line (see the NOTE)."""
    return _SUM_TAG + hashlib.sha256(data).hexdigest().encode() + b"\n" + data


def _checked(data: bytes) -> bytes:
    """The payload of an entry file, its checksum line checked (see the NOTE).

    Raises:
        ValueError: the file has no checksum line, or its contents do not match it.
    """
    if not data.startswith(_SUM_TAG) or data[_SUM_LINE - 1 : _SUM_LINE] != b"\n":
        raise ValueError("it has no checksum line (truncated, or written by an older compiler)")
    payload = data[_SUM_LINE:]
    if hashlib.sha256(payload).hexdigest().encode() != data[len(_SUM_TAG) : _SUM_LINE - 1]:
        raise ValueError("its contents do not match its SHA-256: the file was damaged")
    return payload


def _read(path: Path, kind: str) -> bytes | None:
    """An entry's bytes, its checksum checked; None when it is missing, cannot be read or
    is damaged (warned: the cache only saves time, so an unusable entry is a miss, not a
    failed step)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:  # another user's entry, a directory where a file should be, ...
        warnings.warn(f"spmd_compiler: could not read the compile cache entry {path} ({exc}); "
                      "treated as missing.", stacklevel=3)
        return None
    try:
        return _checked(data)
    except ValueError as exc:  # NOTE: [cache entries carry their SHA-256]
        warn_broken_entry(f"{kind} {path}", data, exc, stacklevel=4)
        return None


def _umask() -> int:
    """The process umask, read without changing it where Linux tells it."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # elsewhere: the only portable read sets it, so set it back
    os.umask(mask)
    return mask


def _write_atomically(path: Path, data: bytes) -> None:
    """A temporary file in the same directory, then ``os.replace``. The entry gets the
    mode a plain ``open`` would give it (mkstemp's 0600 would hide a cache shared by
    several users, ``/scratch/spmd-cache``, from all but its writer)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem[:16]}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_with_sum(data))  # NOTE: [cache entries carry their SHA-256]
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# NOTE: [no collector while an entry is decoded]
# Decoding an entry makes a few hundred thousand small objects in a fraction of a second
# (its JSON's lists, then the fx nodes and their meta), and each burst of allocations
# sets off CPython's cyclic collector, whose oldest generation walks every object of the
# process (torch's included). Measured on the demo's restart (process CPU seconds, two
# programs each, three runs): loads took ddp 0.52-0.58 s with the collector and
# 0.20-0.23 s without it, fsdp_tp 2x2 0.86-0.94 and 0.45-0.48 s. So loads run with the
# collector paused; they make no garbage cycles worth collecting at once (the objects
# live on in the program), and it runs again, as it was, after.
@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Inside: no cyclic garbage collection (see the NOTE); restored after."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _decode_or_warn(
    data: bytes, key: str, captured: CapturedStep, mesh: Any, where: str
) -> DistributedProgram | None:
    try:
        with collector_paused():  # NOTE: [no collector while an entry is decoded]
            return program_from_bytes(data, key, captured, mesh)
    except Exception as exc:  # noqa: BLE001 - any broken entry is ignored, never used
        warn_broken_entry(f"compile-cache entry {where}", data, exc, stacklevel=5)
        return None


# NOTE: [one warning per broken entry]
# A call reads the same program entry twice when it is broken: once by the key before
# capture (NOTE: [cache key before capture]) and once after capturing; each warned, from a
# different line, so Python's own once-per-location filter showed both. The entry's path
# and bytes are remembered: the same broken file warns once per process (a rewritten entry
# that breaks again warns again). The error is its first line, cut at a sentence end (or
# a space) within _REASON_CHARS: torch's zip reader says "... your checkpoint file is
# corrupted ..." in one long line, which a cut at 200 characters ended at "file is".
_WARNED_BROKEN: set[tuple[str, str]] = set()
_REASON_CHARS = 240


def short_reason(exc: BaseException) -> str:
    """``Type: message`` of ``exc``: the message's first line, cut at a sentence end (or
    else a space, with "...") when longer than _REASON_CHARS."""
    text = str(exc).strip().split("\n", 1)[0].strip()
    if len(text) > _REASON_CHARS:
        head = text[:_REASON_CHARS]
        end = head.rfind(". ")
        if end > 0:
            text = head[: end + 1]
        else:
            text = head[: head.rfind(" ")].rstrip(",;:") + " ..." if " " in head else head + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def warn_broken_entry(what: str, data: bytes, exc: BaseException, stacklevel: int) -> None:
    """Warn once per process that the broken cache entry ``what`` (its kind and path) is
    ignored (NOTE: [one warning per broken entry])."""
    seen = (what, hashlib.sha256(data).hexdigest())
    if seen in _WARNED_BROKEN:
        log.info("ignoring the %s again: %s", what, short_reason(exc))
        return
    _WARNED_BROKEN.add(seen)
    reason = short_reason(exc)
    end = "" if reason.endswith((".", "...")) else "."
    warnings.warn(
        f"spmd_compiler: ignoring the {what}: {reason}{end} Compiling the step again.",
        stacklevel=stacklevel,
    )


# --------------------------------------------------------------------------- ranks
class RankShare:
    """One compile per key across real ranks, through the default store (see the NOTE).

    ``claim()`` returns True on the rank that compiles the key; that rank must call
    ``publish`` (with b"" when it failed or the program is uncacheable). ``receive()``
    on the others waits for the published entry and returns its bytes (b"": compile here).
    """

    def __init__(self, key: str) -> None:
        self.store = private.default_store()
        self.base = f"{_STORE_PREFIX}/{key}"

    def claim(self) -> bool:
        return self.store.add(f"{self.base}/claim", 1) == 1

    def publish(self, data: bytes) -> None:
        self.store.set(f"{self.base}/entry", data)
        self.store.set(f"{self.base}/done", b"1")

    def receive(self) -> bytes:
        try:
            self.store.wait([f"{self.base}/done"], timedelta(seconds=WAIT_SECONDS))
            return bytes(self.store.get(f"{self.base}/entry"))
        except Exception as exc:  # noqa: BLE001 - a timeout or a lost store: compile here
            log.warning("waited for another rank's compile of the same program (%s); "
                        "compiling it on this rank", exc)
            return b""


def entry_or_none(key: str, program: DistributedProgram) -> bytes:
    """``entry_bytes``, or b"" (logged) for a program the cache cannot hold."""
    try:
        return entry_bytes(key, program)
    except Uncacheable as exc:
        log.info("the compiled program is not cached: it holds %s", exc)
    except Exception as exc:  # noqa: BLE001 - a compiled program must not fail on its entry
        warnings.warn(f"spmd_compiler: the compiled program could not be written to the "
                      f"compile cache ({type(exc).__name__}: {exc}); it runs uncached.",
                      stacklevel=3)
    return b""


def write_or_warn(cache: ProgramCache, key: str, data: bytes) -> None:
    if not data:
        return
    try:
        cache.write(key, data)
    except OSError as exc:
        warnings.warn(f"spmd_compiler: could not write the compile cache: {exc}", stacklevel=3)


def decode_or_warn(
    data: bytes, key: str, captured: CapturedStep, mesh: Any, where: str
) -> DistributedProgram | None:
    """The program of an entry, or None with a warning when it cannot be used."""
    return _decode_or_warn(data, key, captured, mesh, where)
