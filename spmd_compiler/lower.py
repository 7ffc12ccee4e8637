"""Lower the per-rank program to what runs: the fx interpreter or Inductor kernels.

NOTE: [lowering]
The per-rank program after the passes is one fx graph, identical on every rank: the rank's
process groups (and mesh coordinate) are looked up at run time through DTensor's opaque
mesh objects (``_dtensor.mesh_get_process_group``). To lower it for one real rank, those
rank-local lookups are folded first: each node that computes a non-tensor value from
non-tensor inputs only (the mesh object, integers) is evaluated on this rank and its value
put in the graph as a constant, so the functional collectives take plain group names,
which Inductor keeps as collective kernels in the order the graph gives them. Simulated
ranks (LocalTensorMode) always run the interpreter: one program runs for N ranks at once
there, which a compiled kernel cannot do.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

import torch
import torch.fx

from . import _torch_private as private
from .errors import SPMDCompileError
from .progress import compile_progress

log = logging.getLogger("spmd_compiler.lower")

Backend = Literal["auto", "eager", "inductor"]
BACKENDS: tuple[str, ...] = ("auto", "eager", "inductor")

# NOTE: [default backend]
# backend="auto" (the default) lowers through Inductor on CUDA and interprets on CPU,
# chosen by measurement (step ms interpreted -> Inductor; compile s both programs):
# - CUDA (H100, torch 2.11, world 1, benchmarks/results/lowering_cuda.md): compiled ddp
#   gpt-4x256 28.82 -> 16.42 ms (1.70x -> 0.97x torch DDP), compile 17.1 -> 78.9 s;
#   mlp-2048 3.05 -> 2.24 ms (0.87x DDP), 1.4 -> 3.7 s; compiled fsdp with Inductor
#   0.50x / 0.41x FSDP2. The extra compile pays back after ~5,000 / ~2,800 steps.
# - CPU (2 gloo ranks on 2 cores, quiet, benchmarks/results/cpu.md): the cold C++
#   compile makes each style's compile 40-84 s on the GPT models against 5-12 s
#   interpreted (MLPs: 7-10 s against under 1 s); the step gets faster in 11 of 12 cases,
#   ddp gpt-2x64 16.1 -> 9.5 ms, gpt-4x128 50.6 -> 34.5, mlp-128 7.2 -> 5.3, mlp-512
#   32.1 -> 26.6 (break-even after ~5,500 / ~3,400 / ~4,000 / ~1,300 steps). CPU runs
#   here are tests, debugging and demos of a few to a few hundred steps: eager.
# Simulated ranks always interpret (NOTE: [lowering]), whatever the backend.
AUTO_BACKEND: dict[str, str] = {"cuda": "inductor"}


def resolve_backend(backend: str, device_type: str) -> Backend:
    """The backend that runs: ``backend`` itself, or for "auto" the measured default for
    ``device_type`` (NOTE: [default backend])."""
    chosen = backend if backend != "auto" else AUTO_BACKEND.get(device_type, "eager")
    return cast(Backend, chosen)


@dataclass(frozen=True)
class LoweringOptions:
    """How the per-rank program runs.

    Args:
        backend: "eager" runs the fx graph op by op (the reference); "inductor" compiles it
            to kernels (C++ on CPU, Triton on CUDA) on real ranks; "auto" picks by device
            (NOTE: [default backend]). Simulated ranks always run "eager"
            (NOTE: [lowering]).
        cuda_graphs: replay the whole compiled step as one CUDA graph (static shapes, CUDA
            tensors, backend "inductor", or "auto" on CUDA).
    """

    backend: Backend = "auto"
    cuda_graphs: bool = False

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise SPMDCompileError(
                f"unknown backend {self.backend!r}; choose one of {', '.join(BACKENDS)}."
            )
        if self.cuda_graphs and self.backend == "eager":
            raise SPMDCompileError(
                "cuda_graphs=True needs backend='inductor' (or 'auto' on CUDA): the fx "
                "interpreter cannot be captured into a CUDA graph."
            )

    def for_device(self, device_type: str) -> LoweringOptions:
        """These options with "auto" resolved for a model on ``device_type``."""
        return LoweringOptions(resolve_backend(self.backend, device_type), self.cuda_graphs)


@dataclass
class LoweredGraph:
    """One program graph, lowered on first call with that call's inputs as examples."""

    graph_module: torch.fx.GraphModule
    options: LoweringOptions
    # Inductor's on-disk cache (NOTE: [persistent compile cache]); None: Inductor's default
    inductor_cache_dir: Path | None = None
    compile_seconds: float = 0.0
    _compiled: Callable[..., Sequence[torch.Tensor]] | None = None
    _constants: list[torch.Tensor] = field(default_factory=list)

    def __call__(self, flat: list[torch.Tensor], simulated: bool) -> list[torch.Tensor]:
        if simulated or resolve_backend(self.options.backend, _device_of(flat)) == "eager":
            return list(self.graph_module(*flat))
        if self._compiled is None:
            self._lower(flat)
        assert self._compiled is not None
        return list(self._compiled(*flat, *self._constants))

    def _lower(self, flat: list[torch.Tensor]) -> None:
        if self.options.cuda_graphs and not all(t.is_cuda for t in flat):
            raise SPMDCompileError(
                "cuda_graphs=True needs every input and state tensor on a CUDA device; this "
                "step runs on " + ", ".join(sorted({t.device.type for t in flat})) + ".",
                hint="drop cuda_graphs on CPU, or move the model and batch to CUDA.",
            )
        start = time.perf_counter()
        gm = copy.deepcopy(self.graph_module)
        fold_rank_values(gm)
        self._constants = lift_constants(gm)
        title = f"a {len(gm.graph.nodes)}-node program with inductor"
        with compile_progress(title) as progress, progress.stage("lowering"):
            self._compiled = private.inductor_compile(
                gm, [*flat, *self._constants], cuda_graphs=self.options.cuda_graphs,
                cache_dir=str(self.inductor_cache_dir) if self.inductor_cache_dir else None,
            )
        self.compile_seconds = time.perf_counter() - start
        log.info("lowered a %d-node program with inductor in %.1fs",
                 len(gm.graph.nodes), self.compile_seconds)


def _device_of(flat: list[torch.Tensor]) -> str:
    return next((t.device.type for t in flat if isinstance(t, torch.Tensor)), "cpu")


def fold_rank_values(gm: torch.fx.GraphModule) -> int:
    """Evaluate this rank's process-group and coordinate lookups into constants.

    Why: NOTE: [lowering]. A node is evaluated when its inputs are all known on this rank:
    non-tensor values (DTensor's opaque mesh object, ints) or the program's constant
    tensors and pure ops on them (the mesh tensor DTensor reads this rank's mesh
    coordinate from, ``device_mesh._runtime_compute_coordinate_on_dim``). A node whose
    value holds no tensor is folded: a process group becomes its registered name, which
    the functional collectives accept; a coordinate becomes a plain int (left in the
    graph, Inductor's tracer would make it an unbacked symbol it cannot resolve). Tensor
    values are only evaluated for their users. Returns how many nodes were folded; 0
    (nothing done) for a program without such lookups.
    """
    graph = gm.graph
    known: dict[torch.fx.Node, Any] = {}
    folded = 0
    for node in list(graph.nodes):
        if node.op == "get_attr":
            known[node] = getattr(gm, str(node.target))
            continue
        if node.op != "call_function" or not node.all_input_nodes:
            continue
        if not all(a in known for a in node.all_input_nodes):
            continue
        tensor_inputs = any(isinstance(known[a], torch.Tensor) for a in node.all_input_nodes)
        if tensor_inputs and not _pure_op(node):
            continue
        args = torch.fx.node.map_arg(node.args, lambda a: known[a])
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda a: known[a])
        value = node.target(*args, **kwargs)  # type: ignore[operator]
        known[node] = value
        if _holds_tensor(value):
            continue
        value = getattr(value, "group_name", value)
        known[node] = value
        _replace_with_constant(node, value)
        graph.erase_node(node)
        folded += 1
    for node in reversed(list(graph.nodes)):  # evaluated constant chains nothing reads
        if node in known and not node.users:
            graph.erase_node(node)
            if node.op == "get_attr" and hasattr(gm, str(node.target)):
                delattr(gm, str(node.target))
    graph.lint()
    gm.recompile()
    return folded


def _pure_op(node: torch.fx.Node) -> bool:
    """An ATen-style op that neither mutates its inputs' values nor draws random numbers:
    safe to evaluate ahead of time on constant tensors. ``detach_`` changes autograd
    metadata only (the capture puts it after ``lift_fresh_copy`` of a traced constant)."""
    if node.target is torch.ops.aten.detach_.default:
        return True
    schema = getattr(node.target, "_schema", None)
    if schema is None or schema.is_mutable:
        return False
    return torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ())


def _holds_tensor(value: object) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    return False


def _replace_with_constant(node: torch.fx.Node, value: object) -> None:
    def substitute(a: torch.fx.Node) -> object:
        return value if a is node else a

    for user in list(node.users):
        user.args = torch.fx.node.map_arg(user.args, substitute)  # type: ignore[arg-type]
        user.kwargs = torch.fx.node.map_arg(user.kwargs, substitute)  # type: ignore[arg-type]


def lift_constants(gm: torch.fx.GraphModule) -> list[torch.Tensor]:
    """Turn the program's tensor constants into trailing inputs; returns their values.

    Why: AOTAutograd (inside Inductor) lifts a module's registered buffers itself and the
    expanded program registers its constants as buffers; as explicit inputs they are fed
    in one known order instead.
    """
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    anchor = placeholders[-1] if placeholders else None
    values: list[torch.Tensor] = []
    for node in list(graph.nodes):
        if node.op != "get_attr":
            continue
        value = getattr(gm, str(node.target))
        if not isinstance(value, torch.Tensor):
            raise SPMDCompileError(
                f"the per-rank program holds a non-tensor constant {node.target!r} that "
                "could not be folded for this rank; it cannot be lowered.",
                hint="run with backend='eager'.",
            )
        if anchor is None:
            with graph.inserting_before(next(iter(graph.nodes))):
                placeholder = graph.placeholder(f"constant_{node.target}")
        else:
            with graph.inserting_after(anchor):
                placeholder = graph.placeholder(f"constant_{node.target}")
        placeholder.meta.update(node.meta)
        anchor = placeholder
        node.replace_all_uses_with(placeholder)
        graph.erase_node(node)
        values.append(value)
    for name in [n for n, _ in gm.named_buffers()]:
        delattr(gm, name)
    graph.lint()
    gm.recompile()
    return values


@dataclass
class Executable:
    """What a compiled step runs: the step's program, lowered, or with a deferred part
    (NOTE: [cross-iteration overlap]) its ``first`` / ``steady`` / ``finish`` programs."""

    step: LoweredGraph
    first: LoweredGraph | None = None
    steady: LoweredGraph | None = None
    finish: LoweredGraph | None = None

    @classmethod
    def of(
        cls, program: object, options: LoweringOptions, inductor_cache_dir: Path | None = None
    ) -> Executable:
        """Lower ``program`` (a ``DistributedProgram``): lazily, on each graph's first
        call on a real rank, where its real inputs serve as examples."""
        plan = getattr(program, "deferred", None)

        def lowered(gm: torch.fx.GraphModule) -> LoweredGraph:
            return LoweredGraph(gm, options, inductor_cache_dir)

        step = lowered(program.graph_module)  # type: ignore[attr-defined]
        if plan is None:
            return cls(step)
        return cls(step, lowered(plan.first), lowered(plan.steady), lowered(plan.finish))

    def for_call(self, with_carry: bool) -> LoweredGraph:
        """The program one call runs: ``steady`` with a carry from the previous call,
        ``first`` without one, or the plain step when nothing is deferred."""
        if self.first is None:
            return self.step
        return self.steady if with_carry else self.first  # type: ignore[return-value]

    @property
    def compile_seconds(self) -> float:
        return sum(g.compile_seconds for g in (self.step, self.first, self.steady, self.finish) if g)
