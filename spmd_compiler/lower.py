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

NOTE: [compute regions]
Inductor keeps the collectives' order among themselves but not their place among the
compute: it schedules fused kernels, and a collective whose input it fused into a later
kernel is issued late. Seen on the MLP's ddp step (2 gloo ranks): the loss's total-weight
all-reduce, which ``schedule_overlap`` issues before forward, was issued after it (its
``ne``/``sum`` fused with the loss's reduction). ``inductor_regions=True`` holds Inductor
to the passes' schedule: the program is split at its collectives and waits
(``torch.fx.passes.split_module``), an outer graph runs each collective and wait itself
where the passes put them, and calls one Inductor-compiled submodule per stretch of
compute between them (a stretch of views only runs as it is); Inductor fuses within a
stretch, never across a collective. Measured against the whole program as one Inductor
graph (2 gloo ranks, same launch, medians of 25 steps, ms whole / regions): MLP-128 ddp
5.86 / 7.72, fsdp 6.12 / 6.66, tp 2.56 / 3.16; MLP-512 ddp 20.46 / 26.46, fsdp
27.46 / 26.79, tp 8.35 / 11.87; demo GPT 2x64 ddp 9.22 / 12.85, fsdp 13.00 / 15.15
(10 regions). Each region pays its own AOTAutograd runtime wrapper
(input mutations, output aliases) and a Python call, and on 2 cores a collective issued
early runs its gloo thread against the compute it was meant to overlap. So the whole graph
is the default on CPU; on CUDA, where collectives run on their own stream, only the whole
graph has been measured, and it stays the default there too. ``cuda_graphs`` needs the
whole graph (one graph to capture).

NOTE: [programs that run once]
A step compiles a first program for the call that creates the optimizer state (torch's
optimizers create it lazily, in their first ``step()``) and a second for every call after,
which reads it. The first runs once per optimizer, yet Inductor compiled it as long as the
second (the CPU suite: "2 programs" per compile). So a program that creates optimizer
state (it writes optimizer state it does not read) runs in the interpreter even when the
backend is Inductor: its one step costs an interpreted step instead of a whole Inductor
compile, and the steady program is lowered as before. Its numbers are the interpreter's,
which is the reference the lowered program is checked against. Since NOTE: [optimizer
state made before the first program] (``capture/initial_state.py``) most steps compile no
such program: only those whose optimizer makes its state from the first gradient or the
learning rate (SGD's momentum, ASGD, Rprop), those with an ``if`` on a tensor value,
and those compiled with the persistent cache.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import operator
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, cast

import torch
import torch.distributed as dist
import torch.fx
from torch.fx.passes.split_module import split_module

from . import _torch_private as private
from .bool_collectives import gather_bools_as_bytes
from .cuda_graph_outputs import Replayed, gradients_not_read_back
from .errors import SPMDCompileError, exception_summary
from .ir.collectives import is_collective, is_wait
from .ir.graph_utils import output_args, pure_op
from .ir.signature import Kind
from .leading_reductions import (
    NOTHING_SENT,
    LeadingSplit,
    split_leading_reductions,
    world_all_reduces,
)
from .progress import compile_progress
from .reduction_aliasing import bucket_part_read_elsewhere
from .reinplace import reinplace
from .scalar_prologue import WithScalarPrologue, split_scalar_prologue
from .state_donation import (
    WRITES,
    Donating,
    Pairs,
    StateWrites,
    StatusCheck,
    StatusIssue,
    StatusRider,
    donatable,
    donate,
    donate_in_order,
    donation_pairs,
    insert_status,
    not_copies_of_inputs,
    not_read_by,
)

log = logging.getLogger("spmd_compiler.lower")


class CallStatus(Protocol):
    """The ranks' status round of one call (NOTE: [a rank whose program fails alone] in
    ``runtime/rank_failures.py``): issued right after the program's last collective,
    waited for before its first state write."""

    def issue(self) -> None: ...

    def ride(self) -> None: ...

    def check(self, summed: torch.Tensor) -> None: ...

    def finish(self) -> None: ...


_Interpreted = tuple[
    Callable[..., Sequence[torch.Tensor]], "StateWrites | None", "StatusIssue | None",
    "StatusRider | None", "StatusCheck | None",
]


@functools.cache
def _say_simulation_interprets() -> None:
    """Once per process: backend="inductor" asked for, simulated ranks interpret (NOTE:
    [lowering]). Before, nothing said so, and a parity check in simulation seemed to
    cover Inductor's kernels."""
    log.warning(
        'backend="inductor" under sc.simulate: simulated ranks run the program in the '
        "interpreter (one program for all ranks at once); Inductor's kernels run on real "
        "ranks (torchrun, sc.launch)."
    )

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
# Compute regions or the whole graph (NOTE: [compute regions]): whole, by measurement on
# CPU; on CUDA the only lowering measured.
AUTO_REGIONS: dict[str, bool] = {}


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
        inductor_regions: with Inductor, compile each stretch of compute between
            collectives as its own graph and run the collectives between them where the
            passes put them (True), or the whole program as one graph (False); None: by
            device (NOTE: [compute regions]). ``cuda_graphs`` needs the whole graph.
    """

    backend: Backend = "auto"
    cuda_graphs: bool = False
    inductor_regions: bool | None = None

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
        if self.cuda_graphs and self.inductor_regions:
            raise SPMDCompileError(
                "cuda_graphs=True captures the whole program as one CUDA graph; it cannot "
                "be split into compute regions (inductor_regions=True).",
                hint="drop inductor_regions (or set it to False) with cuda_graphs.",
            )

    def for_device(self, device_type: str) -> LoweringOptions:
        """These options with "auto" resolved for a model on ``device_type``."""
        return LoweringOptions(
            resolve_backend(self.backend, device_type), self.cuda_graphs, self.regions(device_type)
        )

    def regions(self, device_type: str) -> bool:
        """Whether Inductor compiles compute regions (NOTE: [compute regions])."""
        if self.cuda_graphs:
            return False
        if self.inductor_regions is not None:
            return self.inductor_regions
        return AUTO_REGIONS.get(device_type, False)


@dataclass
class LoweredGraph:
    """One program graph, lowered on first call with that call's inputs as examples."""

    graph_module: torch.fx.GraphModule
    options: LoweringOptions
    # Inductor's on-disk cache (NOTE: [persistent compile cache]); None: Inductor's default
    inductor_cache_dir: Path | None = None
    compile_seconds: float = 0.0
    # state this program may update in place once lowered (NOTE: [state donation])
    donations: Pairs = ()
    # positions of the step's tensor arguments among the inputs (NOTE: [reductions that
    # ride the input check])
    batch_inputs: tuple[int, ...] = ()
    # the program runs once (it creates optimizer state): interpreted on every backend
    # (NOTE: [programs that run once])
    runs_once: bool = False
    # outputs a CUDA-graph replay may leave in the graphs' pool: gradients the program
    # does not read back (NOTE: [CUDA graphs and the program's outputs])
    pool_outputs: tuple[int, ...] = ()
    _compiled: Callable[..., Sequence[torch.Tensor]] | None = None
    _donated: Pairs = ()
    _constants: list[torch.Tensor] = field(default_factory=list)
    # the program without its leading all-reduces (NOTE: [reductions that ride the input
    # check]), decided on the first call on a real rank; folded for Inductor
    _leading: LeadingSplit | None = None
    _prepared: bool = False
    _early_compiled: Callable[..., Sequence[torch.Tensor]] | None = None
    # the interpreted program, whole (False) or after the round (True), donating
    # by (cut, simulated): the program, its StateWrites, and on real ranks what carries
    # the ranks' status (NOTE: [a rank whose program fails alone])
    _interpreted: dict[tuple[bool, bool], _Interpreted] = field(default_factory=dict)
    _writes: StateWrites | None = None  # the last interpreted call's, if it donates

    def __call__(
        self, flat: list[torch.Tensor], simulated: bool, opened: Sequence[torch.Tensor] = (),
        status: CallStatus | None = None,
    ) -> list[torch.Tensor]:
        """Run the program on ``flat``. On a real rank whose program was cut at the input
        check's round (``leading``), this runs the rest: ``opened`` holds the round's sums,
        then what ``early`` returned (NOTE: [reductions that ride the input check]).
        ``status``: an interpreted program calls its ``issue`` right after its last
        collective and its ``finish`` just before its first write into the state (NOTE: [a
        rank whose program fails alone])."""
        cut = not simulated and self._leading is not None
        if simulated or self._eager(flat):
            if simulated and self.options.backend == "inductor":
                _say_simulation_interprets()
            return self._interpret(flat, opened, cut, status, simulated)
        if self._compiled is None:
            return self._lower_and_run(flat, opened)
        return list(self._compiled(*flat, *opened, *self._constants))

    def _interpret(
        self, flat: list[torch.Tensor], opened: Sequence[torch.Tensor], cut: bool,
        status: CallStatus | None = None, simulated: bool = False,
    ) -> list[torch.Tensor]:
        """Run the program (``main`` after the input check's round when ``cut``) op by op,
        updating the donated state in place (NOTE: [interpreted programs update state in
        place]); prepared on the first call, whose inputs say what may be donated. On real
        ranks the program carries the ranks' status (NOTE: [a rank whose program fails
        alone])."""
        prepared = self._interpreted.get((cut, simulated))
        if prepared is None:
            source = self._leading.main if cut else self.graph_module  # type: ignore[union-attr]
            outputs = len(output_args(source))
            made: list[Pairs] = []

            def donating() -> torch.fx.GraphModule:
                gm = copy.deepcopy(source)
                made.append(donate_in_order(gm, self.donations, [*flat, *opened]))
                return gm

            # NOTE: [interpreted programs reuse their temporaries]; a retry starts afresh
            gm, _ = reinplace(donating(), donating)
            pairs = made[-1]
            run: Callable[..., Sequence[torch.Tensor]] = (
                Donating(gm, pairs, outputs) if pairs else gm
            )
            carriers = (None, None, None) if simulated else insert_status(gm)
            prepared = self._interpreted[(cut, simulated)] = (run, getattr(gm, WRITES, None), *carriers)
        run, self._writes, issue, rider, check = prepared
        if self._writes is not None:
            self._writes.began = False
            self._writes.hook = status.finish if status is not None else None
        if issue is not None:
            issue.hook = status.issue if status is not None else None
        if rider is not None and check is not None:
            rider.hook = status.ride if status is not None else None
            check.hook = status.check if status is not None else None
        try:
            out = list(run(*flat, *opened))
        finally:
            for module in (issue, rider, check, self._writes):
                if module is not None:
                    module.hook = None
        if self._writes is not None:
            self._writes.began = False  # a later failure before the program runs: intact
        return out

    def interprets(self, flat: list[torch.Tensor]) -> bool:
        """Whether a real rank runs this program in the interpreter (NOTE: [default
        backend]), whose failing node the runtime can find (NOTE: [a rank whose program
        fails alone])."""
        return self._eager(flat)

    def program_after_round(self) -> torch.fx.GraphModule:
        """The graph a real rank's interpreter runs after the input check's round (the
        whole program when nothing rides the round): the collectives a rank whose
        ``early`` part failed still goes through (NOTE: [a rank whose program fails
        alone])."""
        cut = self._leading is not None
        prepared = self._interpreted.get((cut, False))
        if prepared is not None:
            run = prepared[0]
            gm = run.inner if isinstance(run, Donating) else run
            if isinstance(gm, torch.fx.GraphModule):
                return gm
        # not prepared yet (the first call): its collectives as the peers' prepared
        # program issues them, the status carried the same way
        gm = copy.deepcopy(self._leading.main if self._leading is not None else self.graph_module)
        insert_status(gm)
        return gm

    @property
    def _cache_dir(self) -> str | None:
        return str(self.inductor_cache_dir) if self.inductor_cache_dir else None

    def _eager(self, flat: list[torch.Tensor]) -> bool:
        return self.runs_once or resolve_backend(self.options.backend, _device_of(flat)) == "eager"

    def leading(self, flat: list[torch.Tensor]) -> tuple[str, list[torch.Tensor]]:
        """What this program sends in the input check's round on a real rank: a description
        of the values, and the values (NOTE: [reductions that ride the input check])."""
        if not self._prepared:
            self._prepared = True
            self._leading = self._split_leading(flat)
        if self._leading is None:
            return NOTHING_SENT, []
        return self._leading.signature, list(self._leading.prefix(*flat))

    def early(self, flat: list[torch.Tensor]) -> list[torch.Tensor]:
        """Run what needs neither the round's sums nor a collective (after ``leading``,
        while the round is in flight); returns what the rest of the program reads."""
        split = self._leading
        if split is None or split.early is None:
            return []
        if self._eager(flat):
            return list(split.early(*flat))
        if self._early_compiled is None:
            start = time.perf_counter()
            title = f"the {len(split.early.graph.nodes)}-node opening of a program"
            with compile_progress(title) as progress, progress.stage("lowering"), _lowering(title):
                self._early_compiled = private.inductor_compile(
                    split.early, flat, cache_dir=self._cache_dir
                )
            self.compile_seconds += time.perf_counter() - start
        return list(self._early_compiled(*flat))

    def _split_leading(self, flat: list[torch.Tensor]) -> LeadingSplit | None:
        if _device_of(flat) != "cpu" or self.options.cuda_graphs:
            return None  # NOTE: [reductions that ride the input check]: CPU only
        folded = copy.deepcopy(self.graph_module)
        fold_rank_values(folded)
        eligible = world_all_reduces(folded, private.process_group_size, dist.get_world_size())
        # the interpreter runs the program as captured; Inductor lowers the folded one
        program = self.graph_module if self._eager(flat) else folded
        return split_leading_reductions(program, eligible, set(self.batch_inputs))

    @property
    def updates_in_place(self) -> bool:
        """Whether the last call may have written part of its update into the state: the
        lowered program writes some state into its inputs (NOTE: [state donation]), or the
        interpreted one had begun to (NOTE: [interpreted programs update state in
        place])."""
        return bool(self._donated) or (self._writes is not None and self._writes.began)

    def _lower_and_run(self, flat: list[torch.Tensor], opened: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Lower the program on its first call and run it. Whole-graph: compile, then run.
        Regions (NOTE: [compute regions]): split, then run; each region compiles on its
        first call with its real inputs, so this first step compiles as it goes (its
        stage time includes the step itself)."""
        if self.options.cuda_graphs and not all(t.is_cuda for t in flat):
            raise SPMDCompileError(
                "cuda_graphs=True needs every input and state tensor on a CUDA device; this "
                "step runs on " + ", ".join(sorted({t.device.type for t in flat})) + ".",
                hint="drop cuda_graphs on CPU, or move the model and batch to CUDA.",
            )
        start = time.perf_counter()
        if self._leading is not None:
            gm = self._leading.main  # folded already: the program after the round
        else:
            gm = copy.deepcopy(self.graph_module)
            fold_rank_values(gm)
        self._constants = lift_constants(gm)
        cache_dir = self._cache_dir
        nodes = len(gm.graph.nodes)
        inputs = [*flat, *opened, *self._constants]
        outputs = len(output_args(gm))
        device = _device_of(flat)
        graphs = self.options.cuda_graphs
        donating = private.inductor_updates_inputs_safely()
        in_place = donatable(gm, self.donations, inputs)
        pairs = not_copies_of_inputs(gm, in_place)
        if donating and private.inductor_called_out_reads_may_follow_input_updates():
            pairs = not_read_by(gm, pairs, private.inductor_calls_out)
        self._donated = donate(gm, pairs, inputs) if donating else ()
        # NOTE: [CUDA graphs and the program's outputs]: the rest copied in after a replay
        copied_back = tuple(p for p in in_place if p not in self._donated) if graphs else ()
        static = [i for i, _ in (*self._donated, *copied_back)]
        static += range(len(inputs) - len(self._constants), len(inputs))
        out: list[torch.Tensor] | None = None  # the first step's results, when it ran here
        regions = self.options.regions(device)
        hazard = None if regions or graphs else bucket_part_read_elsewhere(gm)
        if hazard is not None:  # NOTE: [buckets reduced in place by Inductor]
            log.info("lowering by compute regions: %s's bucket has a part read elsewhere", hazard.name)
            regions = True
        title = f"a {nodes}-node program with inductor"
        program = f"this rank's {nodes}-node program"
        with compile_progress(title) as progress:
            # NOTE: [scalar prologue]: measured on CPU; CUDA keeps the one graph
            split = split_scalar_prologue(gm) if device == "cpu" else None
            prologue: Callable[..., Sequence[torch.Tensor]] | None = None
            if split is not None:
                with progress.stage(f"scalar prologue ({split.moved} nodes)"), _lowering(program):
                    prologue = private.inductor_compile(
                        split.prologue, [inputs[i] for i in split.prologue_inputs],
                        cache_dir=cache_dir,
                    )
                    gm = split.main
                    inputs += list(prologue(*(inputs[i] for i in split.prologue_inputs)))
            compiled: Callable[..., Sequence[torch.Tensor]]
            if regions:
                outer, count = split_at_collectives(gm, cache_dir)
                with progress.stage(f"lowering {count} compute regions (first step)"):
                    out = list(outer(*inputs))
                compiled = outer
            else:
                skips = private.cudagraph_skips()
                gather_bools_as_bytes(gm)  # NOTE: [bool collectives as bytes]
                with progress.stage("lowering"), _lowering(program):
                    compiled = private.inductor_compile(
                        gm, inputs, cuda_graphs=graphs, cache_dir=cache_dir,
                        static_inputs=static if graphs else (),
                    )
                if graphs and private.cudagraph_skips() > skips:
                    warnings.warn(
                        f"cuda_graphs=True: Inductor compiled this {nodes}-node program but "
                        "will run it without CUDA graphs (TORCH_LOGS=cudagraphs says why); "
                        "its results are the same, its step is not replayed.",
                        stacklevel=2,
                    )
            if split is not None and prologue is not None:
                compiled = WithScalarPrologue(prologue, compiled, split.prologue_inputs)
            if self._donated:
                donating_program = Donating(compiled, self._donated, outputs)
                if out is not None:
                    out = donating_program.restore(out, inputs)
                compiled = donating_program
            if graphs:
                compiled = Replayed(compiled, copied_back, self.pool_outputs)
        self._compiled = compiled
        lowered = time.perf_counter() - start
        self.compile_seconds += lowered  # beside the opening's (``early``), which ran first
        log.info("lowered a %d-node program with inductor in %.1fs", nodes, lowered)
        return out if out is not None else list(self._compiled(*flat, *opened, *self._constants))


@contextlib.contextmanager
def _lowering(what: str) -> Iterator[None]:
    """Inside: Inductor compiles ``what`` before any of it runs, so a failure is the
    compiler's, on every rank alike, not the data's nor a peer's, and it leaves the state
    as it was. Raised as such (it read as a failed step, "may hold part of this step's
    update", and blamed no other rank while every rank failed the same way)."""
    try:
        yield
    except SPMDCompileError:
        raise
    except Exception as exc:
        raise SPMDCompileError(
            f"Inductor failed to compile {what}: {exception_summary(exc)}. None of it ran: "
            "the model and optimizer hold the state of the last completed step.",
            hint='backend="eager" runs the same per-rank program interpreted; the failure '
            "is Inductor's (TORCH_LOGS=output_code shows the code it generated).",
        ) from exc


def split_at_collectives(
    gm: torch.fx.GraphModule, cache_dir: str | None = None
) -> tuple[torch.fx.GraphModule, int]:
    """``gm`` as an outer graph that runs its collectives and waits where they are and
    calls one Inductor-compiled submodule per stretch of compute between them (NOTE:
    [compute regions]); returns it and how many regions compile. ``gm`` has been folded
    for this rank and its constants lifted (no ``get_attr``)."""
    partition: dict[torch.fx.Node, int] = {}
    communication: set[int] = set()
    region = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "call_function" and (is_collective(node) or is_wait(node)):
            region += 1
            communication.add(region)
            partition[node] = region
            region += 1
        elif node.target is operator.getitem and node.args[0] in partition:
            partition[node] = partition[node.args[0]]  # a list never crosses regions
        else:
            partition[node] = region
    outer = split_module(
        gm, gm, partition.__getitem__, keep_original_order=True, keep_original_node_name=True
    )
    compiled = 0
    for name, module in list(outer.named_children()):
        index = int(name.rsplit("_", 1)[-1])
        if not isinstance(module, torch.fx.GraphModule):
            continue
        if index in communication or not _computes(module):
            continue
        setattr(outer, name, _CompiledRegion(module, cache_dir))
        compiled += 1
    return outer, compiled


def _computes(gm: torch.fx.GraphModule) -> bool:
    """Whether a region has an op other than views and ``getitem`` (worth compiling)."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        schema = getattr(node.target, "_schema", None)
        returns = schema.returns if schema is not None else ()
        if not returns or any(r.alias_info is None for r in returns):
            return True
    return False


class _CompiledRegion(torch.nn.Module):
    """One compute region, compiled by Inductor on its first call with that call's
    inputs as examples."""

    def __init__(self, region: torch.fx.GraphModule, cache_dir: str | None) -> None:
        super().__init__()
        self.region = region
        self.cache_dir = cache_dir
        self.compiled: Callable[..., Any] | None = None

    def forward(self, *args: Any) -> Any:
        if self.compiled is None:
            self.compiled = private.inductor_compile(
                copy.deepcopy(self.region), list(args), cache_dir=self.cache_dir
            )
        out = self.compiled(*args)
        # split_module's regions return a tuple, or one value where they make one
        output = next(n for n in reversed(self.region.graph.nodes) if n.op == "output")
        single = not isinstance(output.args[0], (tuple, list))
        return out[0] if single and isinstance(out, (tuple, list)) else out


def creates_optimizer_state(captured: Any) -> bool:
    """Whether a captured step writes optimizer state it does not read: the call that
    creates it, which runs once per optimizer (NOTE: [programs that run once])."""
    if captured is None:
        return False
    read = {ref for ref, _ in captured.inputs}
    return any(ref.kind is Kind.OPTIM_STATE and ref not in read for ref in captured.outputs)


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
    """``pure_op``: safe to evaluate ahead of time on constant tensors. ``detach_`` changes
    autograd metadata only (the capture puts it after ``lift_fresh_copy`` of a traced
    constant)."""
    return node.target is torch.ops.aten.detach_.default or pure_op(node)


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

        captured = getattr(program, "captured", None)
        batch = tuple(
            i for i, (ref, _) in enumerate(getattr(captured, "inputs", ()))
            if ref.kind is Kind.INPUT
        )

        def lowered(
            gm: torch.fx.GraphModule, donations: Pairs = (), runs_once: bool = False,
            pool_outputs: tuple[int, ...] = (),
        ) -> LoweredGraph:
            return LoweredGraph(
                gm, options, inductor_cache_dir, donations=donations, batch_inputs=batch,
                runs_once=runs_once, pool_outputs=pool_outputs,
            )

        once = creates_optimizer_state(captured)
        step = lowered(
            program.graph_module, donation_pairs(program), once,  # type: ignore[attr-defined]
            gradients_not_read_back(captured),
        )
        if plan is None:
            return cls(step)
        return cls(
            step, lowered(plan.first, runs_once=once), lowered(plan.steady, runs_once=once),
            lowered(plan.finish, runs_once=once),
        )

    def for_call(self, with_carry: bool) -> LoweredGraph:
        """The program one call runs: ``steady`` with a carry from the previous call,
        ``first`` without one, or the plain step when nothing is deferred."""
        if self.first is None:
            return self.step
        return self.steady if with_carry else self.first  # type: ignore[return-value]

    @property
    def compile_seconds(self) -> float:
        return sum(g.compile_seconds for g in (self.step, self.first, self.steady, self.finish) if g)
