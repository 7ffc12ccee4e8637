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
from typing import Any, Literal

import torch
import torch.fx

from . import _torch_private as private
from .errors import SPMDCompileError
from .progress import compile_progress

log = logging.getLogger("spmd_compiler.lower")

Backend = Literal["eager", "inductor"]
BACKENDS: tuple[str, ...] = ("eager", "inductor")


@dataclass(frozen=True)
class LoweringOptions:
    """How the per-rank program runs.

    Args:
        backend: "eager" runs the fx graph op by op (the reference); "inductor" compiles it
            to kernels (C++ on CPU, Triton on CUDA) on real ranks. Simulated ranks always
            run "eager" (NOTE: [lowering]).
        cuda_graphs: replay the whole compiled step as one CUDA graph (static shapes, CUDA
            tensors, backend "inductor" only).
    """

    backend: Backend = "eager"
    cuda_graphs: bool = False

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise SPMDCompileError(
                f"unknown backend {self.backend!r}; choose one of {', '.join(BACKENDS)}."
            )
        if self.cuda_graphs and self.backend != "inductor":
            raise SPMDCompileError(
                "cuda_graphs=True needs backend='inductor': the fx interpreter cannot be "
                "captured into a CUDA graph."
            )


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
        if simulated or self.options.backend == "eager":
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


def fold_rank_values(gm: torch.fx.GraphModule) -> int:
    """Evaluate this rank's process-group and coordinate lookups into constants.

    Why: NOTE: [lowering]. A node is folded when it computes a non-tensor value from
    non-tensor inputs only (DTensor's opaque mesh object, ints); a process group becomes
    its registered name, which the functional collectives accept. Returns how many nodes
    were folded; 0 (nothing done) for a program without such lookups.
    """
    graph = gm.graph
    known: dict[torch.fx.Node, Any] = {}
    folded = 0
    for node in list(graph.nodes):
        if node.op == "get_attr":
            value = getattr(gm, str(node.target))
            if not isinstance(value, torch.Tensor):
                known[node] = value
            continue
        if node.op != "call_function" or not node.all_input_nodes:
            continue
        if not all(a in known for a in node.all_input_nodes):
            continue
        args = torch.fx.node.map_arg(node.args, lambda a: known[a])
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda a: known[a])
        value = node.target(*args, **kwargs)  # type: ignore[operator]
        if isinstance(value, torch.Tensor):
            continue
        value = getattr(value, "group_name", value)
        known[node] = value
        _replace_with_constant(node, value)
        graph.erase_node(node)
        folded += 1
    for node in list(graph.nodes):
        if node.op == "get_attr" and not node.users:
            graph.erase_node(node)
            if hasattr(gm, str(node.target)):
                delattr(gm, str(node.target))
    graph.lint()
    gm.recompile()
    return folded


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
