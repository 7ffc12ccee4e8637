"""What a compiled step does on each rank, as tables for a person (or JSON).

    step(model, optimizer, x, y)             # after the first call
    print(spmd_compiler.tools.explain.explain(step).format())

    python -m spmd_compiler explain --mode fsdp --world-size 4 [--dump] [--json r.json]

For the step's latest program (``CompiledTrainStep.last_program``) it lists every
parameter's placement and what one rank holds of it, its gradient and its optimizer
state; the collectives of one step in program order with kind, bytes (the convention of
``ir.collectives``) and mesh dimension; and the passes applied with their times. Sizes are
per rank, including the padding of unevenly sharded tensors (NOTE: [uneven shards]).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.fx

from ..expand.retrace import DistributedProgram, Placements, format_placements, local_meta
from ..ir.collectives import CommStats, collective_kind, collective_stats, payload_bytes
from ..ir.graph_utils import placeholders
from ..ir.node_meta import bucket_members
from ..ir.signature import Kind, StateRef, TensorMeta

# DTensor's traced process-group lookup: ``mesh_get_process_group(mesh, dim)``, see
# NOTE: [collective groups] in passes/collective_graph.py.
_GROUP_OP_NAME = "mesh_get_process_group"
_REDUCE_OPS = frozenset({"sum", "avg", "max", "min", "product", "premul_sum"})


@dataclass(frozen=True)
class ParamRow:
    """One parameter: global shape, placements and the bytes one rank holds."""

    name: str
    shape: tuple[int, ...]
    placement: str
    local_shape: tuple[int, ...]
    param_bytes: int
    grad_placement: str
    grad_bytes: int
    optimizer_bytes: int


@dataclass(frozen=True)
class CollectiveRow:
    """One collective of the per-rank program, in program order."""

    node: str
    kind: str
    reduce_op: str | None
    bytes: int
    mesh_dim: int | None
    mesh_dim_name: str | None
    # what a bucketed collective carries, one (parameter, else module FQN or node, bytes) per tensor in
    # bucket order (``bucket_collectives``); empty for a collective of one tensor
    members: tuple[tuple[str, int], ...] = ()

    @property
    def tensor_count(self) -> int:
        return len(self.members) or 1


@dataclass
class Explanation:
    """Everything ``format`` prints; ``to_dict`` is its JSON form."""

    mode: str
    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...] | None
    params: list[ParamRow]
    buffer_bytes: int
    collectives: list[CollectiveRow]
    passes: list[tuple[str, float]]
    # parameters whose update runs in the next call (cross_iteration_overlap), by name
    deferred_params: list[str] = field(default_factory=list)
    code: str = field(repr=False, default="")
    # ir.collectives.collective_stats of the same program: the one count the demo, explain
    # and the benchmarks report (collectives issued per step, after the passes)
    stats: CommStats = field(default_factory=CommStats)

    @property
    def totals(self) -> dict[str, int]:
        """Per-rank bytes of parameters, gradients, optimizer state and buffers."""
        return {
            "param_bytes": sum(r.param_bytes for r in self.params),
            "grad_bytes": sum(r.grad_bytes for r in self.params),
            "optimizer_bytes": sum(r.optimizer_bytes for r in self.params),
            "buffer_bytes": self.buffer_bytes,
            "collective_bytes": sum(c.bytes for c in self.collectives),
        }

    def to_dict(self, dump: bool = False) -> dict[str, Any]:
        out = asdict(self)
        out["passes"] = [{"name": n, "seconds": s} for n, s in self.passes]
        out["totals"] = self.totals
        if not dump:
            out.pop("code")
        return out

    def format(self, dump: bool = False) -> str:
        parts = [
            self._header(),
            _param_table(self.params),
            self._totals_line(),
            _collective_table(self.collectives, self.stats),
            self._pass_line(),
        ]
        if dump:
            parts += ["per-rank program:", self.code]
        return "\n\n".join(parts)

    def _header(self) -> str:
        names = f" ({', '.join(self.mesh_dim_names)})" if self.mesh_dim_names else ""
        shape = "x".join(str(n) for n in self.mesh_shape)
        return f"mode {self.mode}; mesh {shape}{names}"

    def _totals_line(self) -> str:
        t = self.totals
        return (
            f"per rank: params {_kib(t['param_bytes'])}, grads {_kib(t['grad_bytes'])}, "
            f"optimizer state {_kib(t['optimizer_bytes'])}, buffers {_kib(t['buffer_bytes'])}"
        )

    def _pass_line(self) -> str:
        done = ", ".join(f"{n} ({s * 1e3:.1f} ms)" for n, s in self.passes) or "none"
        line = f"passes applied: {done}"
        if self.deferred_params:
            line += (
                f"\nupdated in the next call (cross_iteration_overlap; flush() after the "
                f"last step): {', '.join(self.deferred_params)}"
            )
        return line


def explain(compiled_step: Any) -> Explanation:
    """Tables of the latest program of ``compiled_step`` (a ``CompiledTrainStep``).

    Args:
        compiled_step: the object ``spmd_compiler.compile`` returned, called at least once.

    Returns:
        The explanation; ``format()`` renders it for a terminal, ``to_dict()`` for JSON.
    """
    program = getattr(compiled_step, "last_program", None)
    if program is None:
        raise ValueError(
            "explain() needs a compiled step that has run at least once: call it on a "
            "batch first (inside spmd_compiler.simulate() to compile without real ranks)."
        )
    mode, mesh = compiled_step.mode, program.mesh
    return Explanation(
        mode=repr(mode),
        mesh_shape=tuple(mesh.shape),
        mesh_dim_names=tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
        params=_param_rows(program, mode),
        buffer_bytes=_buffer_bytes(program),
        collectives=_collective_rows(program),
        stats=collective_stats(program.graph_module),
        passes=[(n, program.pass_seconds.get(n, 0.0)) for n in program.passes_applied],
        deferred_params=_deferred_params(program),
        code=program.graph_module.code,
    )


def _deferred_params(program: DistributedProgram) -> list[str]:
    if program.deferred is None:
        return []
    refs = [program.captured.outputs[j] for j in program.deferred.positions]
    return sorted({ref.name for ref in refs if ref.kind is Kind.PARAM})


def _local_bytes(meta: TensorMeta, program: DistributedProgram, placements: Placements) -> int:
    local = local_meta(meta, program.mesh, placements, "explain")
    return local.nbytes()


def _optimizer_bytes(program: DistributedProgram) -> dict[str, int]:
    """Per-parameter bytes of optimizer state, read from inputs and (first step) outputs."""
    captured = program.captured
    seen: dict[tuple[int, str, str], int] = {}
    for (ref, _), local in zip(captured.inputs, program.local_inputs, strict=True):
        if ref.kind is Kind.OPTIM_STATE:
            seen[(ref.optimizer, ref.name, ref.key)] = local.nbytes()
    for ref, meta, placements in zip(
        captured.outputs, captured.output_metas, program.output_placements, strict=True
    ):
        key = (ref.optimizer, ref.name, ref.key)
        if ref.kind is Kind.OPTIM_STATE and key not in seen:
            seen[key] = _local_bytes(meta, program, placements)
    out: dict[str, int] = {}
    for (_, name, _), nbytes in seen.items():
        out[name] = out.get(name, 0) + nbytes
    return out


def _param_rows(program: DistributedProgram, mode: Any) -> list[ParamRow]:
    optimizer = _optimizer_bytes(program)
    rows = []
    for (ref, meta), placements, local in zip(
        program.captured.inputs, program.input_placements, program.local_inputs, strict=True
    ):
        if ref.kind is not Kind.PARAM:
            continue
        shape = meta.shape
        if ref.name in program.padded and shape:
            shape = (program.padded[ref.name][0], *shape[1:])
        grad_placements = mode.placement_of(StateRef(Kind.GRAD, ref.name), meta, program.mesh)
        rows.append(
            ParamRow(
                name=ref.name,
                shape=tuple(shape),
                placement=format_placements(placements),
                local_shape=tuple(local.shape),
                param_bytes=local.nbytes(),
                grad_placement=format_placements(grad_placements),
                grad_bytes=_local_bytes(meta, program, grad_placements)
                if meta.requires_grad
                else 0,
                optimizer_bytes=optimizer.get(ref.name, 0),
            )
        )
    return rows


def _buffer_bytes(program: DistributedProgram) -> int:
    return sum(
        local.nbytes()
        for (ref, _), local in zip(program.captured.inputs, program.local_inputs, strict=True)
        if ref.kind is Kind.BUFFER
    )


def _collective_rows(program: DistributedProgram) -> list[CollectiveRow]:
    names = program.mesh.mesh_dim_names
    state_names = {
        node.name: ref.name
        for node, (ref, _) in zip(placeholders(program.graph_module), program.captured.inputs)
        if ref.name
    }
    rows = []
    for node in program.graph_module.graph.nodes:
        kind = collective_kind(node)
        if kind is None:
            continue
        dim = _mesh_dim(node, program)
        reduce_op = next(
            (a for a in node.args[1:] if isinstance(a, str) and a in _REDUCE_OPS), None
        )
        rows.append(
            CollectiveRow(
                node=node.name,
                kind=kind,
                reduce_op=reduce_op,
                bytes=payload_bytes(node),
                mesh_dim=dim,
                mesh_dim_name=names[dim] if names and dim is not None else None,
                members=tuple(
                    (state_names.get(label, label), nbytes)
                    for label, nbytes in bucket_members(node)
                ),
            )
        )
    return rows


def _mesh_dim(node: torch.fx.Node, program: DistributedProgram) -> int | None:
    """The mesh dimension a collective runs over; None if its group is not a mesh dim."""
    group = node.args[-1]
    if isinstance(group, torch.fx.Node) and _GROUP_OP_NAME in str(group.target):
        dim = group.args[1] if len(group.args) > 1 else None
        return dim if isinstance(dim, int) else None
    if isinstance(group, str):
        mesh = program.mesh
        for dim in range(mesh.ndim):
            if mesh.get_group(dim).group_name == group:
                return dim
    return None


def _kib(n: int) -> str:
    return f"{n:,} B" if n < 10 * 1024 else f"{n / 1024:,.1f} KiB"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)
    ]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def _param_table(params: list[ParamRow]) -> str:
    header = [
        "parameter",
        "shape",
        "placement",
        "local shape",
        "param B",
        "grad",
        "grad B",
        "optim B",
    ]
    rows = [
        [
            p.name,
            str(list(p.shape)),
            p.placement,
            str(list(p.local_shape)),
            f"{p.param_bytes:,}",
            p.grad_placement,
            f"{p.grad_bytes:,}",
            f"{p.optimizer_bytes:,}",
        ]
        for p in params
    ]
    return _table(header, rows)


def _collective_table(collectives: list[CollectiveRow], stats: CommStats) -> str:
    """Collectives in issue (program) order; a bucket's tensors are listed below it."""
    header = ["#", "collective", "op", "bytes", "tensors", "mesh dim", "node"]
    rows = [
        [
            str(i),
            c.kind,
            c.reduce_op or "",
            f"{c.bytes:,}",
            str(c.tensor_count),
            "?"
            if c.mesh_dim is None
            else f"{c.mesh_dim}" + (f" ({c.mesh_dim_name})" if c.mesh_dim_name else ""),
            c.node,
        ]
        for i, c in enumerate(collectives)
    ]
    kinds = ", ".join(f"{k}={v}" for k, v in sorted(stats.counts.items())) or "none"
    tensors = sum(c.tensor_count for c in collectives)
    head = (
        f"collectives per step (issue order, after passes): {kinds}; {tensors} tensors; "
        f"{stats.total_bytes:,} bytes"
    )
    buckets = [
        f"  #{i} {c.kind} carries {c.tensor_count} tensors: {_members_text(c.members)}"
        for i, c in enumerate(collectives)
        if c.members
    ]
    return "\n".join([head, _table(header, rows), *buckets])


def _members_text(members: tuple[tuple[str, int], ...]) -> str:
    """``a x2, b, c``: consecutive tensors of one module (weight and bias) folded."""
    runs: list[list] = []
    for label, _ in members:
        if runs and runs[-1][0] == label:
            runs[-1][1] += 1
        else:
            runs.append([label, 1])
    return ", ".join(label if n == 1 else f"{label} x{n}" for label, n in runs)


def create_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give an optimizer that has not stepped its state, leaving parameters unchanged.

    Why: a compiled step's first program also creates the optimizer state; with the state
    present the first compile is already the steady-state program, so ``explain_demo``
    compiles once. One eager step at ``lr=0`` on zero gradients (as DCP's state-dict
    helpers do); a no-op when the optimizer has state.
    """
    if optimizer.state:
        return
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    lrs = [g["lr"] for g in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs, strict=True):
        g["lr"] = lr
    for p in params:
        p.grad = None


def explain_demo(config: Any) -> tuple[Explanation, Any]:
    """Compile the demo GPT step once on simulated ranks and explain it.

    Args:
        config: a ``spmd_compiler.tools.demo.run.DemoConfig`` (mode, world size, model sizes).

    Returns:
        The explanation and the compiled step.
    """
    from ..api import compile as spmd_compile
    from ..runtime.simulate import simulate
    from .demo.gpt import gpt_train_step
    from .demo.run import build, demo_mode

    model, optimizer, data = build(config)
    create_optimizer_state(optimizer)
    step = spmd_compile(parallel_mode=demo_mode(config))(gpt_train_step)
    x, y = data[0]
    with simulate(world_size=config.world_size):
        step(model, optimizer, x, y)
    return explain(step), step


def write_json(explanation: Explanation, path: str, dump: bool = False) -> None:
    with open(path, "w") as f:
        json.dump(explanation.to_dict(dump=dump), f, indent=2)
