"""Invariants the pass manager checks between passes, and checks passes may declare.

Each check raises ``AssertionError`` with a message a person can act on; the manager turns
it into a ``PassFailure`` that names the pass (see NOTE: [pass contract] in ``manager.py``).

- ``check_program``: graph lint, and every collective waited before any other use.
- ``collective_signature``: the ordered communication of the program, one entry per
  collective: (op, its non-tensor arguments, payload shapes and dtypes). The program is one
  graph that every rank runs, so equal signatures mean every rank still issues the same
  collectives in the same order, with the same groups and sizes.
- ``graph_fingerprint``: the structure of the graph, to hold a pass to its "changed" flag.
- ``check_local_batch``: a data-parallel program holds no value of the global batch
  (NOTE: [local batch only] in ``spmd_compiler/expand/local_rules.py``).
- ``NumericsCheck``: run the program on fixed random inputs on simulated ranks, before and
  after a pass, and compare the outputs.
- ``PassGuard``: all of the above between passes, as NOTE: [pass contract] in
  ``manager.py`` lists them; a failure is a ``CheckFailed`` naming the check.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.fx
from torch.distributed.tensor import Replicate, Shard

from spmd_compiler import _torch_private as private
from spmd_compiler.ir.collectives import is_collective, is_wait
from spmd_compiler.ir.graph_utils import computed_value
from spmd_compiler.ir.node_meta import MODULE_FQN, PLACEMENT, Phase, phase
from spmd_compiler.ir.signature import Kind

if TYPE_CHECKING:
    from spmd_compiler.expand.retrace import DistributedProgram
    from spmd_compiler.runtime.simulate import Simulation

    from .registry import Pass

#: A check a pass declares (``requires=`` / ``ensures=``): raises AssertionError if unmet.
Check = Callable[["DistributedProgram"], None]

CollectiveSignature = list[tuple[str, tuple[str, ...], tuple[str, ...]]]


def short_op_name(node: torch.fx.Node) -> str:
    """``aten.addmm``, ``_c10d_functional.all_reduce``, ``getitem``; other nodes by op."""
    if node.op != "call_function":
        return node.op
    target = node.target
    if hasattr(target, "namespace") and hasattr(target, "_opname"):
        return f"{target.namespace}.{target._opname}"
    return getattr(target, "__name__", None) or str(target)


def check_program(gm: torch.fx.GraphModule) -> None:
    """Graph lint, and every collective's result waited before any other use.

    A collective with one result has exactly one user, its ``wait_tensor``. A coalesced
    collective (a list of results) is read only through ``getitem`` nodes, each of which is
    waited exactly once and used by nothing else.
    """
    gm.graph.lint()
    for node in gm.graph.nodes:
        if not is_collective(node):
            continue
        getitems = [u for u in node.users if u.target is operator.getitem]
        results = getitems if getitems else [node]
        for result in results:
            _check_waited_once(node, result)
        if getitems and len(getitems) != len(node.users):
            other = next(u for u in node.users if u.target is not operator.getitem)
            raise AssertionError(
                f"coalesced collective {node.name} is used by {other.name} directly "
                "(expected getitem nodes, each waited)"
            )


def record_values(nodes: list[torch.fx.Node]) -> None:
    """Give each op node of ``nodes`` (new nodes of a pass, in graph order) that has no
    ``meta["val"]`` one: its op run on its inputs' values (FakeTensors). Later passes
    read shapes, dtypes and bytes there (``live_bytes``, bucketing, the in-place and
    state-donation rewrites), where one that is missing reads as unknown, not as an
    error. Raises AssertionError naming the node where its op fails on those values."""
    for node in nodes:
        if node.op != "call_function" or "val" in node.meta:
            continue
        if any("val" not in arg.meta for arg in node.all_input_nodes):
            continue  # a graph without values (a test's): nothing reads them
        try:
            node.meta["val"] = computed_value(node.target, node.args, dict(node.kwargs))
        except Exception as exc:  # noqa: BLE001 - reported naming the node
            raise AssertionError(
                f"{node.name} ({short_op_name(node)}), which the pass made, has no meta['val'] and "
                f"none could be computed from its inputs' ({type(exc).__name__}: {exc}); set "
                "it to the result's FakeTensor (passes/collective_graph.py: new_node)"
            ) from exc


def _check_waited_once(collective: torch.fx.Node, result: torch.fx.Node) -> None:
    waits = [u for u in result.users if is_wait(u)]
    if len(waits) != 1:
        raise AssertionError(
            f"collective {collective.name} ({short_op_name(collective)}) has {len(waits)} "
            "waits (want exactly 1)"
        )
    others = [u for u in result.users if not is_wait(u)]
    if others:
        raise AssertionError(
            f"collective {collective.name} ({short_op_name(collective)}) is used by "
            f"{others[0].name} without a wait"
        )


def collective_signature(gm: torch.fx.GraphModule) -> CollectiveSignature:
    """The ordered collectives of ``gm``: (op, non-tensor arguments, payloads).

    The first argument of every functional collective is its payload (a tensor or a list of
    tensors), described by the shape and dtype in ``node.meta["val"]``. The other arguments
    (reduce op, group size, the group itself) are described by value; a group computed in the
    graph (``_dtensor.mesh_get_process_group(mesh, dim)``) by the op and its arguments.
    """
    signature: CollectiveSignature = []
    for node in gm.graph.nodes:
        if not is_collective(node):
            continue
        payload = node.args[0] if node.args else None
        payloads = payload if isinstance(payload, (list, tuple)) else [payload]
        rest = list(node.args[1:]) + [f"{k}={v}" for k, v in node.kwargs.items()]
        signature.append(
            (
                short_op_name(node),
                tuple(_describe_argument(a) for a in rest),
                tuple(_describe_payload(p, node) for p in payloads),
            )
        )
    return signature


def _describe_payload(value: Any, collective: torch.fx.Node) -> str:
    val = value.meta.get("val") if isinstance(value, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor):
        val = collective.meta.get("val")  # a payload made by a pass without "val" meta
    if isinstance(val, torch.Tensor):
        return f"{str(val.dtype).removeprefix('torch.')}{list(val.shape)}"
    return "unknown"


def _describe_argument(value: Any, depth: int = 0) -> str:
    if isinstance(value, torch.fx.Node):
        if value.op == "get_attr":
            return f"<{value.target}>"
        if value.op != "call_function" or depth > 3:
            return f"<{value.op} {value.name}>"
        args = ", ".join(_describe_argument(a, depth + 1) for a in value.args)
        return f"{short_op_name(value)}({args})"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_describe_argument(v, depth + 1) for v in value) + "]"
    return repr(value)


def diff_signatures(before: CollectiveSignature, after: CollectiveSignature) -> str:
    """A short description of the first difference between two signatures."""
    if len(before) != len(after):
        return f"{len(before)} collectives before the pass, {len(after)} after"
    for i, (b, a) in enumerate(zip(before, after)):
        if b != a:
            return f"collective #{i} was {_show(b)}, is now {_show(a)}"
    return "no difference"


def _show(entry: tuple[str, tuple[str, ...], tuple[str, ...]]) -> str:
    op, rest, payloads = entry
    return f"{op}({', '.join(payloads + rest)})"


def graph_fingerprint(gm: torch.fx.GraphModule) -> list[tuple[Any, ...]]:
    """The graph's structure (ops, targets, arguments, order); cheap to compare."""
    return [(n.op, n.target, n.args, tuple(n.kwargs.items())) for n in gm.graph.nodes]


def no_dead_nodes(program: DistributedProgram) -> None:
    """Ensures-check: no pure node computes a value nothing uses."""
    for node in program.graph_module.graph.nodes:
        if node.op == "call_function" and not node.users and not node.is_impure():
            raise AssertionError(f"node {node.name} ({short_op_name(node)}) is unused")


# --------------------------------------------------------------------------- local batch


def global_batch_sizes(program: DistributedProgram) -> dict[int, set[int]]:
    """Mesh dim -> the global sizes of the step arguments' dimensions sharded on it
    (the global batch of a data-parallel mode; empty when no argument is sharded)."""
    sizes: dict[int, set[int]] = {}
    if getattr(program, "captured", None) is None:  # a hand-built program: no signature
        return sizes
    for (ref, meta), placements, local in zip(
        program.captured.inputs, program.input_placements, program.local_inputs, strict=True
    ):
        if ref.kind is not Kind.INPUT:
            continue
        for mesh_dim, p in enumerate(placements):
            if type(p) is Shard and meta.shape[p.dim] != local.shape[p.dim]:
                sizes.setdefault(mesh_dim, set()).add(meta.shape[p.dim])
    return sizes


def check_local_batch(program: DistributedProgram) -> None:
    """No rank makes a value of the global batch where its local batch would do.

    The values that expansion keeps local (NOTE: [local batch only]) are the ones this
    holds it to: a filled factory (``ones``, ``zeros``, ``full``, ``empty``) or an
    ``expand`` that makes a dimension of a global batch size, and every value computed
    from one up to a collective. Such a value fails when it is Replicate on the batch's
    mesh dimension and has a global batch size in a dimension, unless it is an
    optimizer-update value or shaped like a state tensor. Values the program gathers on
    purpose (an all-gather for an op without a batch-sharded rule) and values made by
    other factories (``arange``, random ops) are not judged. A no-op for programs that
    shard no step argument (tensor parallel).
    """
    sizes = global_batch_sizes(program)
    if not sizes:
        return
    every_size = set().union(*sizes.values())
    state_shapes = _state_shapes(program)
    made: set[torch.fx.Node] = set()
    for node in program.graph_module.graph.nodes:
        if node.op != "call_function" or is_collective(node) or is_wait(node):
            continue
        if not (_makes_batch_sized(node, every_size) or any(a in made for a in node.all_input_nodes)):
            continue
        if not _has_size(node, every_size):
            # a value with no dimension of a batch size (the loss's scalar gradient)
            # carries no batch: what it meets later is judged by its own origin (a
            # contrastive loss's gathered logits are gathered on purpose)
            continue
        made.add(node)
        problem = _holds_global_batch(node, sizes, state_shapes)
        if problem:
            raise AssertionError(problem)


_FILLED_FACTORIES = {
    torch.ops.aten.ones.default,
    torch.ops.aten.zeros.default,
    torch.ops.aten.full.default,
    torch.ops.aten.empty.memory_format,
}


def _has_size(node: torch.fx.Node, sizes: set[int]) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and any(int(s) in sizes for s in val.shape)


def _makes_batch_sized(node: torch.fx.Node, sizes: set[int]) -> bool:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return False
    if node.target in _FILLED_FACTORIES:
        return any(int(s) in sizes for s in val.shape)
    if node.target is torch.ops.aten.expand.default:
        source = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
        if not isinstance(source, torch.Tensor):
            return False
        offset = val.dim() - source.dim()
        return any(
            int(s) in sizes and (d < offset or source.shape[d - offset] == 1)
            for d, s in enumerate(val.shape)
        )
    return False


def _state_shapes(program: DistributedProgram) -> set[tuple[int, ...]]:
    shapes = set()
    for (ref, meta), local in zip(program.captured.inputs, program.local_inputs, strict=True):
        if ref.kind is not Kind.INPUT:
            shapes.update({tuple(meta.shape), tuple(local.shape)})
    return shapes


def _holds_global_batch(
    node: torch.fx.Node, sizes: dict[int, set[int]], state_shapes: set[tuple[int, ...]]
) -> str | None:
    val, placements = node.meta.get("val"), node.meta.get(PLACEMENT)
    if not isinstance(val, torch.Tensor) or placements is None or phase(node) is Phase.OPTIMIZER:
        return None
    shape = tuple(int(s) for s in val.shape)
    if shape in state_shapes:
        return None
    for mesh_dim, globals_ in sizes.items():
        if mesh_dim >= len(placements) or not isinstance(placements[mesh_dim], Replicate):
            continue
        for dim, size in enumerate(shape):
            if size in globals_:
                from spmd_compiler.expand.retrace import format_placements

                where = node.meta.get(MODULE_FQN) or "the loss or the step outside modules"
                return (
                    f"node {node.name} ({short_op_name(node)}, in {where}) holds the global "
                    f"batch on every rank: local shape {list(shape)} has the global size "
                    f"{size} in dimension {dim}, placement {format_placements(placements)} on "
                    f"mesh dimension {mesh_dim}; a data-parallel rank must hold only its local "
                    "batch (NOTE: [local batch only] in spmd_compiler/expand/local_rules.py)"
                )
    return None


# ------------------------------------------------------------------------------ numerics

NUMERICS_RTOL = 1e-4
NUMERICS_ATOL = 1e-6
NUMERICS_SEED = 0


class NumericsCheck:
    """Outputs of the program on fixed random inputs, compared across passes.

    Inputs follow ``program.local_inputs`` (local shapes and dtypes): floats uniform in
    [0.5, 1.5) (positive, so square roots and logarithms of optimizer state stay finite),
    integers and booleans in {0, 1} (valid class indices and token ids for any model).
    Replicated inputs hold the same values on every simulated rank, sharded ones differ.
    Random ops in the program draw from the same seed in every run.
    """

    def __init__(self, program: DistributedProgram, sim: Simulation) -> None:
        self.program = program
        self.sim = sim
        self.inputs = self._random_inputs()
        self.reference = self.run()

    def _random_inputs(self) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(NUMERICS_SEED)
        world = self.sim.world_size
        inputs = []
        for meta, placements in zip(
            self.program.local_inputs, self.program.input_placements, strict=True
        ):
            same_everywhere = all(isinstance(p, Replicate) for p in placements)
            first = _random_tensor(meta.shape, meta.dtype, generator)
            per_rank = {
                r: first
                if same_everywhere or r == 0
                else _random_tensor(meta.shape, meta.dtype, generator)
                for r in range(world)
            }
            inputs.append(private.make_local_tensor(per_rank))
        return inputs

    def run(self) -> list[dict[int, torch.Tensor]]:
        """Each output of the program as ``{rank: value}``."""
        self.program.graph_module.recompile()
        with torch.random.fork_rng(), self.sim.ranks():
            torch.manual_seed(NUMERICS_SEED)
            outputs = self.program.graph_module(*self.inputs)
        return [self.sim.per_rank(out) for out in outputs]

    def compare(self) -> None:
        """Run again; raise if any output differs from the first run; keep the new one."""
        outputs = self.run()
        if len(outputs) != len(self.reference):
            raise AssertionError(
                f"the program returns {len(outputs)} values, {len(self.reference)} before"
            )
        for index, (new, old) in enumerate(zip(outputs, self.reference, strict=True)):
            for rank in old:
                a, b = new[rank], old[rank]
                if a.shape != b.shape or not torch.allclose(
                    a, b, rtol=NUMERICS_RTOL, atol=NUMERICS_ATOL, equal_nan=True
                ):
                    raise AssertionError(
                        f"output {index} on simulated rank {rank} changed: "
                        f"{_numbers_differ(a, b)} (random inputs, seed {NUMERICS_SEED})"
                    )
        self.reference = outputs


def _random_tensor(
    shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator
) -> torch.Tensor:
    if dtype.is_floating_point:
        return (torch.rand(shape, generator=generator, dtype=torch.float64) + 0.5).to(dtype)
    if dtype.is_complex:
        return torch.rand(shape, generator=generator, dtype=dtype) + 0.5
    return torch.randint(0, 2, shape, generator=generator).to(dtype)


def _numbers_differ(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape:
        return f"shape {tuple(b.shape)} became {tuple(a.shape)}"
    diff = (a.double() - b.double()).abs()
    scale = b.double().abs().max().item()
    return f"max abs difference {diff.max().item():.3g} (values up to {scale:.3g})"


# --------------------------------------------------------------------------------- guard


class CheckFailed(Exception):
    """A check between passes failed; the manager names the pass."""

    def __init__(self, check: str, problem: str) -> None:
        super().__init__(f"{check}: {problem}")
        self.check, self.problem = check, problem


class PassGuard:
    """The checks run before and after every pass (see NOTE: [pass contract]).

    Args:
        program: the program the passes change.
        check: run the checks at all (otherwise ``before``/``after`` return at once).
        simulation: where to compare numbers (``verify_numerics``); None: not compared.
    """

    def __init__(
        self, program: DistributedProgram, check: bool, simulation: Simulation | None = None
    ) -> None:
        self.program = program
        self.active = check
        self.signature = collective_signature(program.graph_module) if check else []
        if check:
            _run("local batch only (the program expansion made)", lambda: check_local_batch(program))
        self.numerics: NumericsCheck | None = None
        if check and simulation is not None:
            self.numerics = _run(
                "numbers of the program before any pass",
                lambda: NumericsCheck(program, simulation),
            )

    def before(self, spec: Pass) -> None:
        """The pass's ``requires``."""
        if not self.active:
            return
        for check in spec.requires:
            _run(
                f"requires {_check_name(check)} (before the pass)", functools.partial(check, self.program)
            )

    def after(self, spec: Pass, changed: Any, fingerprint: Any) -> None:
        """The changed flag, lint and waits, collectives, ``ensures``, numbers."""
        if not self.active:
            return
        gm = self.program.graph_module
        if not isinstance(changed, bool):
            raise CheckFailed("changed flag", f"the pass returned {changed!r}, not True or False")
        if not changed and graph_fingerprint(gm) != fingerprint:
            raise CheckFailed("changed flag", "the pass returned False but changed the graph")
        _run("graph lint, collectives waited before use", lambda: check_program(gm))
        signature = collective_signature(gm)
        if not spec.changes_collectives and signature != self.signature:
            raise CheckFailed(
                "collective sequence unchanged",
                diff_signatures(self.signature, signature)
                + " (a pass that changes communication declares changes_collectives=True)",
            )
        self.signature = signature
        _run("local batch only", lambda: check_local_batch(self.program))
        for check in spec.ensures:
            _run(f"ensures {_check_name(check)}", functools.partial(check, self.program))
        if self.numerics is not None and changed:
            _run("same numbers as before the pass", self.numerics.compare)


def _run(check: str, fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - re-raised naming the check
        problem = str(exc) if isinstance(exc, AssertionError) else f"{type(exc).__name__}: {exc}"
        raise CheckFailed(check, problem) from exc


def _check_name(check: Any) -> str:
    return getattr(check, "__qualname__", None) or repr(check)
