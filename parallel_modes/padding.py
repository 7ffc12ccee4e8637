"""Pad unevenly sharded state so one program serves every rank.

NOTE: [uneven shards]
Shard(0) of a tensor whose first dimension d is not a multiple of the N ranks gives
ranks different row counts (torch.chunk: ceil(d/N) rows each, the last ranks fewer or
none), so their programs would differ. Like FSDP2, every rank instead holds a padded
shard of c = ceil(d/N) rows: the program sees the parameter and its optimizer state as
Shard(0) of a zero-padded global tensor of N*c rows. On the single-device graph, before
expansion:
- compute reads a parameter through ``slice(P_padded, 0, 0, d)`` (one slice per reader,
  so FSDP still gathers per forward/backward group);
- the gradient (d rows) is zero-padded where the optimizer reads it;
- the optimizer updates the padded parameter and state where its ops are element-wise
  (NOTE: [what the optimizer computes on padded rows]); any other op of the step's
  ``optimizer.step()`` reads true-row slices, and padding rows stay zero;
- a gradient that outlives the step (``zero_grad`` at the start of the step, or
  accumulation) leaves it zero-padded (the optimizer's pad: NOTE: [a kept gradient leaves
  at its pad]); one the next call reads (accumulation) is padded state, read through a
  slice (fully_shard only: tensor parallel refuses it), and one it drops or zeroes first
  is no input at all (NOTE: [a kept gradient the step does not read] in
  capture/gradients.py);
- a value the optimizer computed (the updated weight, its state) read again later in the
  step (a validation forward after ``optimizer.step()``, an EMA of the weights) is read
  through a slice too, and state updated outside the optimizer (the EMA) is written back
  zero-padded. Expansion checks every value's global shape against the single-device
  graph's, padded where ``node.meta[PADDED]`` says so (NOTE: [local shape check]): a read
  this rewrite missed is refused, not computed with the padding rows.
The DTensors the user sees keep the true shape; the runtime feeds each rank's rows plus
zero padding and keeps the real rows of the results (``DistributedProgram.padded``).

NOTE: [what the optimizer computes on padded rows]
Every op traced inside ``optimizer.step()`` is tagged optimizer phase: the optimizer's own
update, but also its step pre- and post-hooks (an EMA, a weight centering, a logged
statistic) and whatever a hand-written ``step`` computes (a row mean, a Newton-Schulz
iteration). Keying the rule on the phase (or untagging hooks) would not cover the last,
so the rule is keyed on what each op does (``_padded_values``). An optimizer-phase op
reads a padded value as is only where the padding rows cannot reach the true rows:
- an element-wise op (``torch.Tag.pointwise``, or a copy/cast) whose other inputs hold no
  rows (scalars, the learning rate, a tensor broadcast along the padded dimension): its
  result is held padded too. It keeps padding rows zero where the op maps zero to zero
  (``_padding_stays_zero``: ``0 * x``, ``0 / x``, ``lerp(0, 0, w)``, ``sqrt(0)``, ...);
  otherwise (Adam's ``sqrt(v) + eps``) the padding rows hold other values, which only
  element-wise ops read: a state written back from such a value has its padding rows
  zeroed (``_zero_padding_rows``: a ``where`` on each rank's shard, no collective; Adamax's
  ``max(|g| + eps, ...)``). torch's Adam, AdamW, SGD (momentum, nesterov), RMSprop,
  Adagrad, NAdam, RAdam and Adadelta end in zero-preserving ops: no added op at all.
Every other op (a mean or variance counts the padding rows, a matrix product or a view
moves rows, an element-wise op combining a padded value with one holding the true rows,
such as an EMA buffer; also a norm or sum, which zero rows would not change, but whose
partial result on a padded tensor-parallel shard came out wrong stacked with other
statistics) reads ``slice(value, dim, 0, true size)``, like compute outside the
optimizer, and its result is unpadded; written back to padded state it is zero-padded.
Before this rule a post-hook centering the 3 rows of a weight over 2 ranks counted the
padding row (2.18e-01 off eager) and wrote its mean into that row.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx

from spmd_compiler import _torch_private as private
from spmd_compiler.capture.gradients import drop_unread_gradient_inputs
from spmd_compiler.errors import SPMDCompileError, node_error, node_op
from spmd_compiler.ir.graph_utils import output_args, placeholders, set_outputs
from spmd_compiler.ir.node_meta import (
    BACKWARD_PHASE,
    OPTIMIZER_PHASE,
    PADDED,
    PHASE,
    set_padded_gradient,
)
from spmd_compiler.ir.signature import PADDED_KINDS, CapturedStep, Kind, StateRef, TensorMeta


def padded_rows(rows: int, world: int) -> int:
    return -(-rows // world) * world


def pad_uneven_state(
    captured: CapturedStep, world: int, dims: dict[str, int] | None = None
) -> dict[str, tuple[int, int]]:
    """Rewrite ``captured`` so every sharded parameter dimension is a multiple of ``world``.

    Args:
        dims: parameter name -> the dimension it is sharded on (tensor parallel); None:
            every parameter on dimension 0 (fully_shard).

    Returns ``{param name: (true size, padded size)}`` of the padded dimension; empty (and
    nothing changed) when every parameter divides evenly.
    """
    dim_of = dims if dims is not None else {}
    plan = {
        ref.name: (meta.shape[dim], padded_rows(meta.shape[dim], world))
        for ref, meta in captured.inputs
        if ref.kind is Kind.PARAM and meta.shape and (dims is None or ref.name in dims)
        for dim in [dim_of.get(ref.name, 0)]
        if meta.shape[dim] % world
    }
    if not plan:
        return plan
    _refuse_state_shaped_otherwise(captured, plan)
    # NOTE: [a kept gradient the step does not read] in capture/gradients.py
    drop_unread_gradient_inputs(captured, plan)
    _refuse_kept_tp_gradients(captured, plan, dim_of, world)
    gm = captured.graph_module
    pads = _pad_gradients(captured, plan, dim_of)
    padded_values, reads_padded, nonzero = _padded_values(captured, plan, dim_of, pads)
    _match_outputs(captured, plan, dim_of, padded_values, nonzero, reads_padded, pads)
    for node, (rows, padded, dim) in padded_values.items():
        node.meta[PADDED] = (rows, padded, dim)
        _slice_for_compute(gm.graph, node, rows, dim, reads_padded)
    captured.inputs = [(ref, _padded_meta(ref, meta, plan, dim_of)) for ref, meta in captured.inputs]
    captured.output_metas = [
        _padded_meta(ref, meta, plan, dim_of)
        for ref, meta in zip(captured.outputs, captured.output_metas, strict=True)
    ]
    gm.recompile()
    return plan


def _refuse_kept_tp_gradients(
    captured: CapturedStep, plan: dict[str, tuple[int, int]], dims: dict[str, int], world: int
) -> None:
    """A gradient kept from the previous call that the step reads (backward accumulates
    into it) of a parameter padded on a dimension other than 0 (tensor parallel) is
    refused, naming the first op that reads it; fully_shard (dimension 0) keeps it as
    padded state."""
    for ref, node in zip(captured.input_refs(), placeholders(captured.graph_module), strict=True):
        if ref.kind is not Kind.GRAD or ref.name not in plan or not dims.get(ref.name, 0):
            continue
        reader = next((u for u in node.users if u.op != "output"), None)
        how = (
            "it is returned as it came" if reader is None
            else "backward accumulates into it: the gradient was not None"
            if reader.meta.get(PHASE) == BACKWARD_PHASE else f"{node_op(reader)} reads its value"
        )
        message = (
            f"{ref} is kept from the previous call and this step reads it ({how}), but "
            f"parameter {ref.name!r} is sharded on dimension {dims[ref.name]} of size "
            f"{plan[ref.name][0]}, not a multiple of {world} ranks; a padded tensor-parallel "
            "gradient cannot be kept between steps."
        )
        hint = (
            "call optimizer.zero_grad() before loss.backward() in the step (first, as "
            "torchdiffeq's examples do; set_to_none=True or False), or end the step with "
            "optimizer.zero_grad() with set_to_none=True (its default): "
            "zero_grad(set_to_none=False) at the end keeps zeroed gradients, which the "
            "next call's backward reads. To accumulate over calls, accumulate inside one "
            f"step instead. Or give the dimension a size the {world} ranks divide."
        )
        if reader is None:
            raise SPMDCompileError(message, hint=hint)
        raise node_error(message, reader, hint=hint)


def _refuse_state_shaped_otherwise(captured: CapturedStep, plan: dict[str, tuple[int, int]]) -> None:
    """Padding rows stay zero for state shaped like its parameter (the NOTE); state of
    another shape (Adafactor's row and column factors) is computed across the rows, where
    zero rows would change it: refused, naming it."""
    params = {name: meta.shape for name, meta in captured.param_metas().items()}
    pairs = list(captured.inputs) + list(zip(captured.outputs, captured.output_metas, strict=True))
    for ref, meta in pairs:
        if (
            ref.kind is Kind.OPTIM_STATE and ref.name in plan and meta.shape
            and tuple(meta.shape) != tuple(params.get(ref.name, meta.shape))
        ):
            rows = plan[ref.name][0]
            raise SPMDCompileError(
                f"{ref} has shape {tuple(meta.shape)}, unlike its parameter's "
                f"{tuple(params[ref.name])}; the parameter's {rows} rows do not divide the "
                "ranks, and the zero rows that pad its shard (NOTE: [uneven shards]) would "
                "enter this state, which the optimizer computes across rows.",
                hint="give this parameter a size the ranks divide, or run this optimizer "
                "where its state is replicated (ddp).",
            )


def _padded_meta(
    ref: StateRef, meta: TensorMeta, plan: dict[str, tuple[int, int]], dims: dict[str, int]
) -> TensorMeta:
    if ref.kind not in PADDED_KINDS or ref.name not in plan:
        return meta
    rows, padded = plan[ref.name]
    dim = dims.get(ref.name, 0)
    if len(meta.shape) <= dim or meta.shape[dim] != rows:
        return meta
    shape = list(meta.shape)
    shape[dim] = padded
    return dataclasses.replace(meta, shape=tuple(shape))


def _is_optimizer(node: torch.fx.Node) -> bool:
    return node.meta.get(PHASE) == OPTIMIZER_PHASE


def _slice_for_compute(
    graph: torch.fx.Graph, param: torch.fx.Node, rows: int, dim: int, reads_padded: set[torch.fx.Node]
) -> None:
    """Every reader of the padded value ``param`` but those in ``reads_padded`` (NOTE:
    [what the optimizer computes on padded rows]) and the outputs reads its true rows."""
    for user in list(param.users):
        if user in reads_padded or user.op == "output":
            continue
        if user.target is torch.ops.aten._to_copy.default and not _is_optimizer(user):
            # mixed precision or autocast: cast the padded shard, slice the cast (gathered
            # low-precision); the cast holds the padding rows too (NOTE: [local shape check])
            user.meta[PADDED] = param.meta[PADDED]
            _slice_for_compute(graph, user, rows, dim, reads_padded)
            continue
        with graph.inserting_before(user):
            view = graph.call_function(torch.ops.aten.slice.Tensor, (param, dim, 0, rows))
        view.meta = {k: v for k, v in user.meta.items() if k != "val"}
        user.replace_input_with(param, view)


def _gradients_by_parameter(captured: CapturedStep) -> dict[str, list[torch.fx.Node]]:
    """Values computed outside the optimizer and read by it, grouped by parameter.

    In a single-tensor optimizer each parameter's update is its own chain; nodes
    connected through optimizer ops (not through the shared learning-rate inputs)
    belong to one parameter, found by the parameter or state placeholder in the chain.
    """
    gm = captured.graph_module
    refs = dict(zip(placeholders(gm), captured.input_refs(), strict=True))
    parent: dict[torch.fx.Node, torch.fx.Node] = {}

    def find(n: torch.fx.Node) -> torch.fx.Node:
        while parent.setdefault(n, n) is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    # hyper-parameters and what is computed from them alone (``1 - beta1``, AdamW's beta1
    # cast once to the parameters' dtype and read by every update) join no chains
    shared = {n for n, ref in refs.items() if ref.kind is Kind.HYPERPARAM}
    for node in gm.graph.nodes:
        if _is_optimizer(node) and node.all_input_nodes and all(a in shared for a in node.all_input_nodes):
            shared.add(node)
    boundary: list[tuple[torch.fx.Node, torch.fx.Node]] = []
    for node in gm.graph.nodes:
        if not _is_optimizer(node) or node in shared:
            continue
        for arg in node.all_input_nodes:
            if arg in shared:
                continue
            ref = refs.get(arg)
            if ref is None and not _is_optimizer(arg):
                boundary.append((arg, node))
                continue
            parent[find(arg)] = find(node)
    owner = {find(n): ref.name for n, ref in refs.items()
             if ref.kind in (Kind.PARAM, Kind.OPTIM_STATE) and n in parent}
    grads: dict[str, list[torch.fx.Node]] = {}
    for value, reader in boundary:
        name = owner.get(find(reader))
        if name is not None and value not in grads.setdefault(name, []):
            grads[name].append(value)
    return grads


def _pad_gradients(
    captured: CapturedStep, plan: dict[str, tuple[int, int]], dims: dict[str, int]
) -> dict[torch.fx.Node, str]:
    """Zero-pad each gradient where the optimizer reads it; returns pad node -> name."""
    graph = captured.graph_module.graph
    pads: dict[torch.fx.Node, str] = {}
    for name, values in _gradients_by_parameter(captured).items():
        if name not in plan:
            continue
        rows, padded = plan[name]
        dim = dims.get(name, 0)
        for grad in values:
            if not _has_rows(grad, rows, dim):
                continue
            readers = [u for u in grad.users if _is_optimizer(u)]
            pad = _zero_pad_after(graph, grad, rows, padded, dim)
            # the gradient as the update reads it: settled here, once (NOTE: [padded
            # gradients settle at their pad] in expand/retrace.py)
            set_padded_gradient(pad, name)
            for reader in readers:
                reader.replace_input_with(grad, pad)
            pads[pad] = name
    return pads


def _has_rows(node: torch.fx.Node, rows: int, dim: int) -> bool:
    """Whether ``node``'s single-device value has ``rows`` along ``dim``."""
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dim() > dim and val.shape[dim] == rows


def _zero_pad_after(
    graph: torch.fx.Graph, value: torch.fx.Node, rows: int, padded: int, dim: int
) -> torch.fx.Node:
    ndim = value.meta["val"].dim()
    # constant_pad_nd lists (before, after) pairs from the last dimension back
    pad_spec = [0, 0] * (ndim - 1 - dim) + [0, padded - rows]
    with graph.inserting_after(value):
        pad = graph.call_function(torch.ops.aten.constant_pad_nd.default, (value, pad_spec, 0.0))
    pad.meta = {PHASE: OPTIMIZER_PHASE}
    return pad


def _padded_values(
    captured: CapturedStep,
    plan: dict[str, tuple[int, int]],
    dims: dict[str, int],
    pads: dict[torch.fx.Node, str],
) -> tuple[dict[torch.fx.Node, tuple[int, int, int]], set[torch.fx.Node], set[torch.fx.Node]]:
    """Every value the program holds padded: node -> (true size, padded size, dim); the
    ops that read padded values as they are; the padded values whose padding rows may be
    nonzero.

    The padded state placeholders, the gradients' pads, and the optimizer's element-wise
    values computed from them (NOTE: [what the optimizer computes on padded rows]).
    Every other value is computed from slices and is never padded.
    """
    gm = captured.graph_module
    info: dict[torch.fx.Node, tuple[int, int, int]] = {}
    for ref, node in zip(captured.input_refs(), placeholders(gm), strict=True):
        if ref.kind in PADDED_KINDS and ref.name in plan:
            dim = dims.get(ref.name, 0)
            if _has_rows(node, plan[ref.name][0], dim):
                info[node] = (*plan[ref.name], dim)
    for pad, name in pads.items():
        info[pad] = (*plan[name], dims.get(name, 0))
    reads: set[torch.fx.Node] = set()
    nonzero: set[torch.fx.Node] = set()
    for node in gm.graph.nodes:
        if node in info or not _is_optimizer(node):
            continue
        padded_inputs = [a for a in node.all_input_nodes if a in info]
        if not padded_inputs:
            continue
        spec = info[padded_inputs[0]]
        if _row_local(node, spec, info):
            info[node] = spec
            reads.add(node)
            if not _padding_stays_zero(node, {a for a in padded_inputs if a not in nonzero}):
                nonzero.add(node)
    return info, reads, nonzero


# element-wise ops torch does not tag pointwise
_ROW_LOCAL_COPIES = frozenset({
    torch.ops.aten._to_copy.default, torch.ops.aten.copy.default,
    torch.ops.aten.alias.default, torch.ops.aten.detach.default,
})


def elementwise_op(target: object) -> bool:
    """Whether op ``target`` computes each element from the same element of its inputs:
    torch's pointwise ops and the copies it does not tag so (``_ROW_LOCAL_COPIES``)."""
    return target in _ROW_LOCAL_COPIES or torch.Tag.pointwise in getattr(target, "tags", ())


def _row_local(
    node: torch.fx.Node, spec: tuple[int, int, int], info: dict[torch.fx.Node, tuple[int, int, int]]
) -> bool:
    """Whether ``node`` is element-wise over the padded rows of its inputs: an element-wise
    op whose padded inputs share ``spec`` and whose other inputs hold no rows (they
    broadcast along the padded dimension), with a result of the padded inputs' shape."""
    target = node.target
    if not private.is_op_overload(target):
        return False
    if not elementwise_op(target):
        return False
    rows, _, dim = spec
    out = node.meta.get("val")
    if not isinstance(out, torch.Tensor) or not _has_rows(node, rows, dim):
        return False
    for arg in node.all_input_nodes:
        val = _true_value(arg)
        if arg in info:
            if info[arg] != spec or not isinstance(val, torch.Tensor) or val.dim() != out.dim():
                return False
            continue
        if not isinstance(val, torch.Tensor):
            continue
        aligned = dim - (out.dim() - val.dim())
        if aligned >= 0 and val.shape[aligned] != 1:
            return False
    return True


def _true_value(node: torch.fx.Node) -> object:
    """The single-device value of ``node``; a gradient's zero pad (made here, without
    one) stands for the gradient's."""
    if "val" not in node.meta and node.target is torch.ops.aten.constant_pad_nd.default:
        source = node.args[0]
        return source.meta.get("val") if isinstance(source, torch.fx.Node) else None
    return node.meta.get("val")


def _padding_stays_zero(node: torch.fx.Node, zero: set[torch.fx.Node]) -> bool:
    """Whether the element-wise ``node`` maps padding rows to zero, given the inputs in
    ``zero`` (padded, padding rows zero). ``0 * x`` and ``0 / x`` count as zero where ``x``
    is not itself zero-padded (``0 / 0``): its padding rows are finite and nonzero where
    torch's optimizers compute them (Adam's denominator holds ``eps`` there)."""
    aten = torch.ops.aten
    packet = getattr(node.target, "overloadpacket", None)
    args = list(node.args)

    def is_zero(k: int) -> bool:
        return k < len(args) and isinstance(args[k], torch.fx.Node) and args[k] in zero

    if packet is aten.mul:
        return is_zero(0) or is_zero(1)
    if packet is aten.div:
        return is_zero(0) and not is_zero(1)
    if packet in (aten.neg, aten.sqrt, aten.abs, aten.sign, aten.sgn, aten.relu,
                  aten.clone, aten._to_copy, aten.alias, aten.detach, aten.conj_physical):
        return is_zero(0)
    if packet is aten.pow and node.target is aten.pow.Tensor_Scalar:
        return is_zero(0) and isinstance(args[1], (int, float)) and args[1] > 0
    if packet in (aten.add, aten.sub, aten.maximum, aten.minimum, aten.lerp):
        return is_zero(0) and is_zero(1)
    if packet is aten.copy:
        return is_zero(1)
    if packet is aten.where:
        return is_zero(1) and is_zero(2)
    if packet is aten.addcmul:
        return is_zero(0) and (is_zero(1) or is_zero(2))
    if packet is aten.addcdiv:
        return is_zero(0) and is_zero(1) and not is_zero(2)
    return False


# NOTE: [a kept gradient leaves at its pad]
# A gradient the step leaves on its parameter (``zero_grad`` first, or none) is an output,
# padded like the parameter. It was zero-padded a second time for the output, beside the
# pad the optimizer reads (``_pad_gradients``); under fully_shard each pad settled the
# partial gradient on its own (NOTE: [padded gradients settle at their pad] in
# expand/retrace.py), so every uneven gradient was reduce-scattered twice (a 6-wide MLP
# on 4 ranks, zero_grad first: 832 reduce-scattered bytes per step, 416 with zero_grad at
# the end). The output is now the optimizer's pad where it pads the same value: the one
# reduce-scatter serves both.


def _match_outputs(
    captured: CapturedStep,
    plan: dict[str, tuple[int, int]],
    dims: dict[str, int],
    padded_values: dict[torch.fx.Node, tuple[int, int, int]],
    nonzero: set[torch.fx.Node],
    reads_padded: set[torch.fx.Node],
    pads: dict[torch.fx.Node, str],
) -> None:
    """Each output in the form its signature gives it: padded state leaves padded (a
    value computed outside the optimizer, such as a gradient kept between steps or an
    EMA of the weights updated under ``no_grad``, or computed from slices, is
    zero-padded; a padded value whose padding rows may be nonzero has them zeroed,
    ``_zero_padding_rows``); every other output (what the step returns, unpadded state)
    leaves with its true size (a padded value is sliced)."""
    gm = captured.graph_module
    graph = gm.graph
    outputs = list(output_args(gm))
    pad_of = {(pad.args[0], name): pad for pad, name in pads.items()}
    for k, (ref, value) in enumerate(zip(captured.outputs, outputs, strict=True)):
        if not isinstance(value, torch.fx.Node):
            continue
        wants_padding = ref.kind in PADDED_KINDS and ref.name in plan
        if wants_padding and value in nonzero:
            grads = [pad.args[0] for pad, name in pads.items() if name == ref.name]
            outputs[k] = _zero_padding_rows(
                graph, value, padded_values, reads_padded, plan[ref.name][1], grads
            )
        elif wants_padding and value not in padded_values:
            rows, padded = plan[ref.name]
            dim = dims.get(ref.name, 0)
            if ref.kind is Kind.GRAD and (value, ref.name) in pad_of:
                outputs[k] = pad_of[value, ref.name]  # NOTE: [a kept gradient leaves at its pad]
            elif _has_rows(value, rows, dim):
                outputs[k] = _zero_pad_after(graph, value, rows, padded, dim)
        elif not wants_padding and value in padded_values:
            rows, _, dim = padded_values[value]
            with graph.inserting_before(graph.output_node()):
                outputs[k] = graph.call_function(
                    torch.ops.aten.slice.Tensor, (value, dim, 0, rows)
                )
    set_outputs(gm, outputs)


def _zero_padding_rows(
    graph: torch.fx.Graph,
    value: torch.fx.Node,
    padded_values: dict[torch.fx.Node, tuple[int, int, int]],
    reads_padded: set[torch.fx.Node],
    padded: int,
    grads: list,
) -> torch.fx.Node:
    """``value`` (held padded) with its padding rows zeroed, for a padded state output
    (NOTE: [what the optimizer computes on padded rows]).

    Where the parameter has a gradient of ``value``'s shape, a mask of its padded rows,
    ``constant_pad_nd(ones_like(gradient))``, is laid out like the gradient's pad: an
    element-wise ``where`` on each rank's shard (Adamax's ``max(|g| + eps, ...)``). Otherwise
    the true rows are sliced (gathered) and zero-padded."""
    rows, _, dim = padded_values[value]
    val = value.meta["val"]
    grad = next(
        (g for g in grads if isinstance(g, torch.fx.Node)
         and isinstance(g.meta.get("val"), torch.Tensor) and g.meta["val"].shape == val.shape),
        None,
    )
    aten = torch.ops.aten
    meta = {PHASE: OPTIMIZER_PHASE}
    with graph.inserting_before(value.next):
        if grad is None:
            true_rows = graph.call_function(aten.slice.Tensor, (value, dim, 0, rows))
            true_rows.meta = {"val": val, **meta}
            reads_padded.add(true_rows)
            return _zero_pad_after(graph, true_rows, rows, padded, dim)
        ones = graph.call_function(aten.ones_like.default, (grad,), {"dtype": torch.bool})
        pad_spec = [0, 0] * (val.dim() - 1 - dim) + [0, padded - rows]
        mask = graph.call_function(aten.constant_pad_nd.default, (ones, pad_spec, 0.0))
        zero = graph.call_function(
            aten.scalar_tensor.default, (0.0,), {"dtype": val.dtype, "device": val.device}
        )
        kept = graph.call_function(aten.where.self, (mask, value, zero))
    for node in (ones, mask, zero, kept):
        node.meta = dict(meta)
    for node in (mask, kept):
        padded_values[node] = padded_values[value]
        reads_padded.add(node)
    return kept
