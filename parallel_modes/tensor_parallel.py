"""TensorParallel: shard layers' weights across ranks by a plan of module FQN patterns.

NOTE: [tensor parallel as placements]
The plan is the one torch's ``parallelize_module`` takes: module FQN patterns (shell-style
wildcards, matched level by level) to torch's own ``ColwiseParallel``,
``RowwiseParallel`` and ``SequenceParallel`` styles, ``PrepareModuleInput`` /
``PrepareModuleOutput`` / ``PrepareModuleInputOutput`` (activation layouts only, NOTE:
[prepare styles]), or ``"replicate"``. A style decides
(a) the placements of its module's parameters: colwise Linear weight/bias Shard(0),
colwise Embedding weight Shard(1), rowwise Linear weight Shard(1) with a Replicate bias,
rowwise Embedding weight Shard(0); and (b) the layout of the module's input and output
activations in forward: an activation entering the module is redistributed to the
style's desired input layout, one leaving it to the style's output layout (Replicate
after a rowwise Linear is an all-reduce, Shard(1) a reduce-scatter for sequence
parallelism). Everything else follows from DTensor's propagation; backward needs no
annotation, its collectives come from the same propagation on global semantics.

Beyond torch's styles:
- transposed linears (transformers' ``Conv1D``: weight (in, out), ``y = x @ W + b``)
  take the same styles with the weight's dimensions swapped (colwise Shard(1),
  rowwise Shard(0));
- ``FusedColwiseParallel(chunks=k)`` shards a fused projection (q, k, v made by one
  layer and split after) so that each rank holds block r of each of the k parts
  (NOTE: [fused projections] in spmd_compiler/expand/local_rules.py);
- a parameter shared by two planned modules (tied input and output embeddings) must
  get the same placement from both styles, or the plan is refused;
- a sharded dimension that does not divide the mesh is padded (NOTE: [uneven tensor
  parallel]).

NOTE: [uneven tensor parallel]
One program serves every rank, so every rank's shard must have one shape. A parameter
whose sharded dimension does not divide the ranks (a Linear of 70 outputs over 4 ranks)
is padded like fully_shard's (NOTE: [uneven shards] in padding.py): its state is the
zero-padded tensor, Shard(d) evenly, and compute reads the true slice. Reading that
slice gathers the parameter, so a module with a padded parameter computes on whole
(Replicate) activations: its input and output layouts become Replicate. Its state and
optimizer update stay sharded; its activations are not, and a warning says so.
"""

from __future__ import annotations

import difflib
import fnmatch
import warnings
from collections.abc import Mapping
from typing import Any, cast

import torch
import torch.fx
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)
from torch.nn.utils import parametrize

from spmd_compiler import _torch_private as private
from spmd_compiler.capture.bindings import StepBindings
from spmd_compiler.errors import SPMDCompileError
from spmd_compiler.expand.retrace import DistributedProgram, Placements
from spmd_compiler.ir.graph_utils import placeholders
from spmd_compiler.ir.node_meta import MODULE_FQN, OPTIMIZER_PHASE, PHASE
from spmd_compiler.ir.signature import CapturedStep, Kind, StateRef, TensorMeta
from spmd_compiler.ir.use_step import UseGroup, UseHook, UseStep

from .base import ParallelMode, replicate
from .padding import pad_uneven_state

Style = ParallelStyle | str


class FusedColwiseParallel(ColwiseParallel):
    """Column-wise sharding of a fused projection whose output is ``chunks`` equal parts.

    One Linear (or transposed ``Conv1D``) computing q, k and v concatenated, split after
    (``q, k, v = qkv(x).split(width, dim=-1)``), is planned ``FusedColwiseParallel(chunks=3)``:
    each of the three blocks of the output dimension is split over the ranks, so rank r
    holds rows r of q, of k and of v (``_StridedShard(dim, split_factor=3)``), computes
    whole heads, and the split after the layer is local. Plain ``ColwiseParallel`` on a
    fused layer is also exact but gives rank 0 all of q and part of k: the split then
    gathers the activation.

    Args:
        chunks: the number of equal parts the output is split into (3 for q, k, v).
        input_layouts / output_layouts / use_local_output: as ``ColwiseParallel``; the
            output keeps its strided layout unless ``output_layouts`` is given.

    Compiled steps only: torch's eager ``parallelize_module`` does not know this style.
    """

    def __init__(self, chunks: int = 3, *, output_layouts: Placement | None = None, **kwargs: Any) -> None:
        if not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"FusedColwiseParallel(chunks=...) takes a positive int, got {chunks!r}")
        super().__init__(output_layouts=output_layouts, **kwargs)
        self.chunks = chunks
        self.keep_output_layout = output_layouts is None

    def __repr__(self) -> str:
        return f"FusedColwiseParallel(chunks={self.chunks})"


class MultiheadAttentionParallel(ParallelStyle):
    """Megatron-style tensor parallelism of torch's ``nn.MultiheadAttention``.

    The packed ``in_proj_weight`` (3E, E) and ``in_proj_bias`` hold q, k and v stacked;
    they are sharded like ``FusedColwiseParallel(chunks=3)`` (rank r holds rows r of each
    of q, k, v: whole heads), ``out_proj`` row-wise (weight Shard(1), bias Replicate).
    The module takes and returns Replicate activations: one all-reduce leaves it in
    forward (and, with ``need_weights=True``, one for the head-averaged weights).

    For ``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer`` plan their
    ``self_attn`` (and ``multihead_attn``) with this style, ``linear1`` with
    ``ColwiseParallel()`` and ``linear2`` with ``RowwiseParallel()``.

    Needs the packed projection (equal q, k, v widths), no ``add_bias_kv``, and a head
    count divisible by the tp size; other configurations are refused. Compiled steps
    only: torch's eager ``parallelize_module`` does not know this style.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        raise NotImplementedError(
            "MultiheadAttentionParallel is a plan style for spmd_compiler's TensorParallel "
            "(compiled steps); torch's parallelize_module cannot apply it."
        )

    def __repr__(self) -> str:
        return "MultiheadAttentionParallel()"


def _check_attention(module: nn.Module, fqn: str, tp_size: int | None = None) -> None:
    """Refuse the attention configurations ``MultiheadAttentionParallel`` cannot shard."""
    if not isinstance(module, nn.MultiheadAttention):
        raise SPMDCompileError(
            f"MultiheadAttentionParallel applies to nn.MultiheadAttention; module {fqn!r} "
            f"is a {_class_path(module)}.",
            module_fqn=fqn,
            hint="plan Linear layers with ColwiseParallel() / RowwiseParallel().",
        )
    packed = module.kdim == module.embed_dim and module.vdim == module.embed_dim
    if not packed or module.bias_k is not None:
        raise SPMDCompileError(
            f"MultiheadAttentionParallel: {fqn!r} has separate q/k/v projections (kdim / "
            "vdim differ from embed_dim) or add_bias_kv=True; only the packed in_proj "
            "without extra key/value biases is sharded.",
            module_fqn=fqn,
            hint="leave this module out of the plan (it stays replicated).",
        )
    if tp_size is not None and module.num_heads % tp_size:
        raise SPMDCompileError(
            f"MultiheadAttentionParallel: {fqn!r} has {module.num_heads} heads, which do "
            f"not split over the {tp_size} tensor-parallel ranks.",
            module_fqn=fqn,
            hint="use a head count divisible by the tp size, or leave the module out of "
            "the plan (it stays replicated).",
        )


def _attention_placements(module: nn.Module) -> dict[str, Placement]:
    """Parameter (relative FQN) -> placement under ``MultiheadAttentionParallel``."""
    out: dict[str, Placement] = {"in_proj_weight": private.strided_shard(0, 3)}
    if module.in_proj_bias is not None:
        out["in_proj_bias"] = private.strided_shard(0, 3)
    out["out_proj.weight"] = Shard(1)
    out_proj = cast(nn.Module, module.out_proj)
    if out_proj.bias is not None:
        out["out_proj.bias"] = Replicate()
    return out


def is_transposed_linear(module: nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2 and relatives): weight (in, out), ``y = x @ W + b``.
    The weight is read as stored: reading a parametrized one computes it, and
    ``spectral_norm``'s computation advances its power iteration in the model's buffers
    (once more than eager per compile, silently: 2e-2 off after 3 steps)."""
    if type(module).__name__ != "Conv1D":
        return False
    if parametrize.is_parametrized(module, "weight"):
        weight = getattr(cast(Any, module).parametrizations["weight"], "original", None)
    else:
        weight = getattr(module, "weight", None)
    return (
        isinstance(getattr(module, "nf", None), int)
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 2
        and weight.shape[1] == module.nf
    )


def _warn_parametrized(module: nn.Module, fqn: str) -> None:
    """A planned module's parametrized tensors (``spectral_norm``, ``weight_norm``,
    ``orthogonal``: their ``original`` parameters live in ``module.parametrizations``) are
    not placed by its style: they stay replicated, so the layer computes exactly, on its
    full weight on every rank, and holds it whole. Said once per compile, not silently."""
    if not parametrize.is_parametrized(module):
        return
    names = sorted(cast(Any, module).parametrizations.keys())
    warnings.warn(
        f"TensorParallel: {fqn!r} has parametrized {', '.join(names)} (spectral_norm, "
        "weight_norm or another nn.utils.parametrize parametrization); the plan does not "
        "shard those: they stay replicated on every rank (the results are exact; the "
        "memory and compute of that weight are not split).",
        stacklevel=4,
    )


def _is_linear_like(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_transposed_linear(module)


# NOTE: [a style for the whole model]
# torch's ``parallelize_module(model, mesh, ColwiseParallel())`` takes a bare style for the
# module it is given; a model that is itself one Linear has no submodule to name. A bare
# style is the plan ``{"": style}``, and the key ``""`` names the root module (the model
# the step is given): its parameters are placed by the style and its input and output
# laid out as the style says, like any styled module's.
def as_plan(plan: Mapping[str, Style] | ParallelStyle) -> Mapping[str, Style]:
    """``plan``, with a bare style read as the style of the root module (NOTE: [a style
    for the whole model]); anything else that is not a dict is refused."""
    if isinstance(plan, ParallelStyle):
        return {"": plan}
    validate_plan(plan)
    return plan


def validate_plan(plan: Mapping[str, Style]) -> None:
    if not isinstance(plan, Mapping):
        raise ValueError(
            f"TensorParallel plan must be a dict of FQN pattern -> style (the key '' for the "
            f"whole model), or one style for the whole model, got {type(plan).__name__}"
        )


# NOTE: [transformers' plan names]
# transformers models carry their own tensor-parallel plan (``model.tp_plan``: full FQN
# patterns, with ``*`` for the layer index, to style names). The names that mean one of
# torch's styles are read as that style, with the layouts transformers gives it
# (transformers/distributed/tensor_parallel.py): "colwise" / "rowwise" are torch's
# defaults, "colwise_gather_output" / "colwise_rep" gather the output, "rowwise_split_input"
# / "rowwise_rep" split a replicated input, "embedding_rowwise" shards the vocabulary
# (input replicated), "embedding_colwise" the hidden dim (output gathered). "replicate" and
# "replicated_with_grad_allreduce" (a norm after column-split heads) keep the module's
# parameters whole: here every gradient is the global one whatever the layout, so no
# style is needed. The rest (packed and MoE expert styles, MLA, sequence parallel, local
# parameters) have no torch counterpart this mode implements and are refused by name:
# leave them out of the plan and those modules stay replicated.
_TRANSFORMERS_STYLES: dict[str, Any] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_colwise": lambda: ColwiseParallel(output_layouts=Replicate()),
    "replicate": lambda: "replicate",
    "replicated_with_grad_allreduce": lambda: "replicate",
}


def plan_styles(plan: Mapping[str, Style]) -> dict[str, Style]:
    """``plan`` with transformers' style names read as torch's styles (NOTE:
    [transformers' plan names]); a name without a counterpart is refused."""
    validate_plan(plan)
    out: dict[str, Style] = {}
    refused: dict[str, str] = {}
    for pattern, style in plan.items():
        if isinstance(style, str):
            make = _TRANSFORMERS_STYLES.get(style)
            if make is None:
                refused[pattern] = style
                continue
            style = make()
        out[pattern] = style
    if refused:
        raise ValueError(
            f"TensorParallel plan entries {refused} name styles this mode does not implement "
            f"(it reads {sorted(_TRANSFORMERS_STYLES)} from transformers' plans, and torch's "
            "styles). Leave those entries out of the plan: their modules stay replicated."
        )
    return out


def match_plan(model: nn.Module, plan: Mapping[str, Style]) -> dict[str, Style]:
    """Module FQN -> style for every module a plan pattern matches (level by level); a
    module two patterns give different styles is refused (the last one won, silently)."""
    matched: dict[str, Style] = {}
    by: dict[str, str] = {}
    for pattern, style in plan.items():
        if not isinstance(pattern, str):
            raise ValueError(f"TensorParallel plan keys must be FQN patterns ('' for the whole model), got {pattern!r}")
        styles = (ColwiseParallel, RowwiseParallel, SequenceParallel, MultiheadAttentionParallel, *_PREPARE)
        if not (isinstance(style, styles) or style == "replicate"):
            raise ValueError(
                f"TensorParallel plan[{pattern!r}] = {style!r}: use ColwiseParallel(), "
                "FusedColwiseParallel(chunks), RowwiseParallel(), SequenceParallel(), "
                "MultiheadAttentionParallel(), PrepareModuleInput / PrepareModuleOutput / "
                "PrepareModuleInputOutput, or 'replicate'."
            )
        atoms = pattern.split(".") if pattern else []  # '': the root module
        for fqn, _ in model.named_modules():
            parts = fqn.split(".") if fqn else []
            if len(parts) == len(atoms) and all(fnmatch.fnmatch(p, a) for p, a in zip(parts, atoms)):
                if fqn in matched and not _same_style(matched[fqn], style):
                    raise ValueError(
                        f"TensorParallel plan: module {fqn or '<root>'} matches {by[fqn]!r} "
                        f"({matched[fqn]!r}) and {pattern!r} ({style!r}); a module takes one "
                        "style. Make the patterns disjoint (name the layers each one covers)."
                    )
                matched[fqn], by[fqn] = style, pattern
    return matched


def _same_style(a: Style, b: Style) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    return type(a) is type(b) and vars(a) == vars(b)


def param_placement(style: Style, module: nn.Module, param_name: str, fqn: str) -> Placement:
    """Placement on the tp mesh dimension of ``module.<param_name>`` under ``style``."""
    if style == "replicate" or isinstance(style, (SequenceParallel, *_PREPARE)):
        return Replicate()
    _check_module_type(style, module, fqn)
    colwise = isinstance(style, ColwiseParallel)
    if _is_linear_like(module):
        # the weight's output dimension: 0 for nn.Linear (out, in), 1 for Conv1D (in, out)
        out_dim = 1 if is_transposed_linear(module) else 0
        if param_name == "weight":
            dim = out_dim if colwise else 1 - out_dim
        elif colwise:
            dim = 0
        else:
            return Replicate()
        if isinstance(style, FusedColwiseParallel) and style.chunks > 1:
            return private.strided_shard(dim, style.chunks)
        return Shard(dim)
    if isinstance(style, FusedColwiseParallel):
        raise SPMDCompileError(
            f"FusedColwiseParallel applies to a fused Linear or Conv1D; module {fqn!r} is a "
            f"{_class_path(module)}.",
            module_fqn=fqn,
            hint="plan the fused projection layer itself, or use ColwiseParallel().",
        )
    return Shard(1) if colwise else Shard(0)  # nn.Embedding


def _check_module_type(style: Style, module: nn.Module, fqn: str) -> None:
    if isinstance(style, MultiheadAttentionParallel):
        _check_attention(module, fqn)
        return
    if isinstance(module, nn.MultiheadAttention) and isinstance(style, (ColwiseParallel, RowwiseParallel)):
        raise SPMDCompileError(
            f"{type(style).__name__} cannot shard {fqn!r}, an nn.MultiheadAttention: its "
            "q/k/v projection is one packed in_proj_weight parameter, not a Linear.",
            module_fqn=fqn,
            hint="plan it MultiheadAttentionParallel() (heads split over the tp ranks, "
            "out_proj row-wise).",
        )
    if isinstance(style, (ColwiseParallel, RowwiseParallel)) and not _styled_layer(module):
        child = _wrapped_layer(module)
        # what to do instead, not only what is allowed (sixty-fifth session: an
        # EmbeddingBag was told "plan only Linear/Conv1D/Embedding" and nothing more)
        hint = (
            "plan only Linear/Conv1D/Embedding modules with Colwise/Rowwise styles; a module "
            "left out of the plan stays replicated (whole on every tp rank) and trains as on "
            "one device."
        )
        if isinstance(module, nn.EmbeddingBag):
            hint += (
                " To shard the bag's table, write it as an nn.Embedding over the 2-D ids "
                "(batch, bag) followed by .sum(1) / .mean(1) / .amax(1) over the bag "
                "dimension (per_sample_weights: multiply the rows by the weights before the "
                "sum; padding ids masked out): that compiles exactly under ColwiseParallel "
                "and RowwiseParallel (docs/modes/tensor_parallel.md, EmbeddingBag)."
            )
        if child is not None:
            hint = (
                f"plan the layer it wraps instead: '{fqn}.{child}' (a "
                f"{_class_path(module.get_submodule(child))}) with {type(style).__name__}()."
            )
        raise SPMDCompileError(
            f"{type(style).__name__} applies to nn.Linear, transformers' Conv1D and "
            f"nn.Embedding; module {fqn!r} is a {_class_path(module)}.",
            module_fqn=fqn,
            hint=hint,
        )


def _styled_layer(module: nn.Module) -> bool:
    """A module ``ColwiseParallel`` / ``RowwiseParallel`` shard."""
    return _is_linear_like(module) or isinstance(module, nn.Embedding)


def _class_path(module: nn.Module) -> str:
    """The module's class with the module defining it: an adapter's wrapper (peft's
    ``peft.tuners.lora.layer.Linear``) is no ``nn.Linear``, whatever its name. Before
    2026-12-05 the refusal named the class alone ("... is a Linear")."""
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def _wrapped_layer(module: nn.Module) -> str | None:
    """The path (relative to ``module``) of the one layer ``module`` wraps that the
    Colwise / Rowwise styles shard: its ``base_layer`` (peft's adapter layers wrap the
    model's Linear there), or its only such child; None where there is none or several."""
    base = getattr(module, "base_layer", None)
    if isinstance(base, nn.Module) and _styled_layer(base):
        for name, child in module.named_children():
            if child is base:
                return name
    styled = [name for name, child in module.named_children() if _styled_layer(child)]
    return styled[0] if len(styled) == 1 else None


# NOTE: [prepare styles]
# torch's PrepareModuleInput / PrepareModuleOutput (torchtitan's plans put them on
# attention and feed-forward blocks around their colwise / rowwise Linears) only lay out a
# module's activations; they shard no parameter. Here a module's boundary has one layout
# for every floating tensor entering it from outside (the boundary is found by module
# FQN, not by argument position), so a prepare style contributes its desired layout when
# its positional and keyword entries agree (None entries: left as they are); where they
# differ, the module's inputs keep the layouts propagation gives them. A layout never
# changes a result here (every value has global semantics), only where it is split.
_PREPARE = (PrepareModuleInput, PrepareModuleOutput, PrepareModuleInputOutput)


def _one_layout(layouts: Any) -> Placement | None:
    wanted = {p for p in (layouts or ()) if p is not None}
    return wanted.pop() if len(wanted) == 1 else None


def _prepare_layouts(style: Any) -> tuple[Placement | None, Placement | None]:
    if isinstance(style, PrepareModuleInputOutput):
        return _prepare_layouts(style.prepare_module_input)[0], _prepare_layouts(style.prepare_module_output)[1]
    if isinstance(style, PrepareModuleInput):
        positional = cast(tuple, style.desired_input_layouts)  # a tuple after __init__
        return _one_layout([*positional, *style.desired_input_kwarg_layouts.values()]), None
    return None, _one_layout(style.desired_output_layouts)


def _layouts(style: Style, module: nn.Module) -> tuple[Placement | None, Placement | None]:
    """(desired input layout, output layout) of a styled module's activations."""
    if style == "replicate":
        return None, None
    if isinstance(style, _PREPARE):
        return _prepare_layouts(style)
    if isinstance(style, MultiheadAttentionParallel):
        return Replicate(), Replicate()
    if isinstance(style, SequenceParallel):
        return style.sequence_sharding[0], style.sequence_sharding[0]
    if isinstance(style, FusedColwiseParallel) and style.keep_output_layout:
        return Replicate(), None
    if isinstance(style, ColwiseParallel):
        return Replicate(), style.output_layouts[0]
    want_in = Shard(-1) if _is_linear_like(module) else Replicate()
    return want_in, cast(RowwiseParallel, style).output_layouts[0]  # match_plan checked the style


class TensorParallel(ParallelMode):
    """Tensor (and sequence) parallelism following a ``parallelize_module``-style plan.

    Args:
        plan: ``{fqn_pattern: style}`` with torch's ``ColwiseParallel``,
            ``RowwiseParallel``, ``SequenceParallel`` or ``"replicate"`` (the pattern
            ``""`` names the model itself; a bare style is ``{"": style}``, NOTE: [a
            style for the whole model]); a transformers
            model's own ``model.tp_plan`` is read as torch's styles (NOTE:
            [transformers' plan names]).
        mesh: a 1-D mesh over every rank of the default process group (the default).
            A sub-mesh of an N-D mesh (``mesh["tp"]``) spans part of the ranks and is
            refused: tensor parallel inside data parallel is ``FSDPTensorParallel``
            (``"fsdp_tp"``) on the 2-D mesh.

    Inputs are Replicate (every tensor-parallel rank sees the whole batch); parameters not
    covered by the plan are Replicate.
    """

    name = "tp"

    def __init__(self, plan: Mapping[str, Style] | ParallelStyle, *, mesh: DeviceMesh | None = None) -> None:
        plan = as_plan(plan)
        if mesh is not None and mesh.ndim != 1:
            raise ValueError(f"TensorParallel takes a 1-D (sub-)mesh, got {mesh.ndim}-D {mesh}")
        super().__init__(mesh)
        self.plan = plan_styles(plan)
        self.styles: dict[str, Style] = {}
        self.layouts: dict[str, tuple[Placement | None, Placement | None]] = {}
        self.param_placements: dict[str, Placement] = {}
        self.param_modules: dict[str, list[str]] = {}
        self.attention_modules: dict[str, nn.Module] = {}

    def prepare(self, bindings: StepBindings) -> None:
        self.styles, self.layouts, self.param_placements = {}, {}, {}
        self.param_modules, self.attention_modules = {}, {}
        for mi, model in enumerate(bindings.modules):
            prefix = "" if len(bindings.modules) == 1 else f"{mi}."
            matched = match_plan(model, self.plan)
            for fqn, style in matched.items():
                module = model.get_submodule(fqn)
                # the display FQN of the capture (a root module of several: "1", not "1.")
                shown = (prefix + fqn).rstrip(".")
                _check_module_type(style, module, shown)
                self.styles[shown] = style
                self.layouts[shown] = _layouts(style, module)
                if isinstance(style, MultiheadAttentionParallel):
                    self._place_attention(bindings, mi, model, fqn, prefix)
                    continue
                _warn_parametrized(module, shown)
                for pname, _ in module.named_parameters(recurse=False):
                    full = f"{fqn}.{pname}" if fqn else pname
                    name = bindings.module_params[mi].get(full)
                    if name is not None:
                        self._place(name, param_placement(style, module, pname, fqn), prefix + full)
                        self.param_modules.setdefault(name, []).append(shown)
        if not self.plan or not self.styles:
            warnings.warn(
                f"TensorParallel plan {list(self.plan) or '{}'} matches no module; every "
                "parameter stays replicated.",
                stacklevel=3,
            )
            return
        unmatched = [
            pattern for pattern, style in self.plan.items()
            if not any(match_plan(model, {pattern: style}) for model in bindings.modules)
        ]
        if unmatched:  # a typo leaves its modules replicated: correct, but not what was asked
            paths = [fqn for model in bindings.modules for fqn, _ in model.named_modules() if fqn]
            near = [difflib.get_close_matches(p, paths, n=1, cutoff=0.6) for p in unmatched]
            close = {p: m[0] for p, m in zip(unmatched, near, strict=True) if m}
            shown = "; the closest module paths: " + ", ".join(f"{p!r} -> {m!r}" for p, m in close.items()) if close else ""
            example = paths[-1] if paths else "layers.0.attn.q_proj"
            warnings.warn(
                f"TensorParallel plan entries {unmatched} match no module of the step (module "
                f"paths such as {example!r}, '*' for one path segment){shown}; those modules "
                "stay replicated.",
                stacklevel=3,
            )

    def _place_attention(
        self, bindings: StepBindings, mi: int, model: nn.Module, fqn: str, prefix: str
    ) -> None:
        for pname, placement in _attention_placements(model.get_submodule(fqn)).items():
            full = f"{fqn}.{pname}" if fqn else pname
            name = bindings.module_params[mi].get(full)
            if name is not None:
                self._place(name, placement, prefix + full)
                self.param_modules.setdefault(name, []).append((prefix + fqn).rstrip("."))
        self.attention_modules[(prefix + fqn).rstrip(".")] = model.get_submodule(fqn)

    def _place(self, name: str, placement: Placement, fqn: str) -> None:
        """Record ``name``'s placement; a tied parameter must get one placement."""
        earlier = self.param_placements.get(name)
        if earlier is not None and earlier != placement:
            raise SPMDCompileError(
                f"Parameter {name!r} is shared (tied) with {fqn!r}, and the plan gives it "
                f"two placements: {earlier} from the module owning {name!r} and "
                f"{placement} from {fqn!r}'s style.",
                module_fqn=fqn,
                hint="give tied modules styles that shard the shared weight the same way, "
                "e.g. RowwiseParallel() on the input embedding (vocabulary sharded, "
                "Shard(0)) with ColwiseParallel() on the tied output Linear (Shard(0)).",
            )
        self.param_placements[name] = placement

    def placement_of(self, ref: StateRef, meta: TensorMeta, mesh: DeviceMesh) -> Placements:
        if ref.kind in (Kind.PARAM, Kind.GRAD, Kind.OPTIM_STATE) and meta.shape:
            placement = self.param_placements.get(ref.name)
            if placement is not None:
                return (_normalize(placement, len(meta.shape)),)
        return replicate(mesh)

    def placement_at_use(self, captured: CapturedStep, mesh: DeviceMesh) -> UseHook | None:
        state = {
            node for node, ref in zip(placeholders(captured.graph_module), captured.input_refs(), strict=True)
            if ref.kind is not Kind.INPUT
        }
        strided = any(private.is_strided_shard(p) for p in self.param_placements.values())

        def at_use(consumer: torch.fx.Node, arg: torch.fx.Node) -> list[UseStep] | None:
            steps = self.layout_at_boundary(consumer, arg, state) if self.layouts else None
            gradient = (
                consumer.meta.get(PHASE) == OPTIMIZER_PHASE
                and arg not in state and arg.meta.get(PHASE) != OPTIMIZER_PHASE
            )
            if steps is None and strided and gradient:
                # NOTE: [two readings of a strided shard] in _torch_private.py
                return [UseStep(UseGroup.REDUCE, redistribute=private.as_state_strided_shard)]
            return steps

        return at_use if self.layouts or strided else None

    def partition(self, captured: CapturedStep, mesh: DeviceMesh) -> DistributedProgram:
        """Pad parameters whose sharded dimension does not divide the ranks
        (NOTE: [uneven tensor parallel]), then expand."""
        for fqn, module in self.attention_modules.items():
            _check_attention(module, fqn, mesh.size())
        dims = self._uneven_dims(captured, mesh.size())
        padded = pad_uneven_state(captured, mesh.size(), dims) if dims else {}
        self.compute_whole(
            {name: rows for name, (rows, _) in padded.items()},
            f"TensorParallel: {{modules}} shard(s) a dimension that does not divide the "
            f"{mesh.size()} ranks ({{sizes}}); the parameters are padded and stay sharded, but "
            "these modules compute on gathered weights and whole activations.",
        )
        program = super().partition(captured, mesh)
        program.padded = padded
        program.padded_dims = {name: dims[name] for name in padded}
        return program

    def compute_whole(self, sizes: Mapping[str, int], message: str) -> None:
        """The modules of parameters ``sizes`` (name -> the size that does not divide)
        take and return whole activations; ``message`` (with ``{modules}`` and
        ``{sizes}``) warns about it."""
        modules = sorted({m for name in sizes for m in self.param_modules.get(name, [])})
        for fqn in modules:
            self.layouts[fqn] = (Replicate(), Replicate())
        if modules:
            listed = ", ".join(f"{n}: {size}" for n, size in sizes.items())
            warnings.warn(
                message.format(modules=", ".join(modules), sizes=listed)
                + " Use sizes divisible by the tp size for tensor-parallel compute.",
                stacklevel=3,
            )

    def _uneven_dims(self, captured: CapturedStep, world: int) -> dict[str, int]:
        dims: dict[str, int] = {}
        for ref, meta in captured.inputs:
            placement = self.param_placements.get(ref.name)
            if ref.kind is not Kind.PARAM or placement is None or not meta.shape:
                continue
            placement = _normalize(placement, len(meta.shape))
            if private.is_strided_shard(placement):
                if meta.shape[placement.dim] % (world * placement.split_factor):
                    fqn = ", ".join(self.param_modules.get(ref.name, []))
                    raise SPMDCompileError(
                        f"Parameter {ref.name!r} of {fqn} has {meta.shape[placement.dim]} "
                        f"in its fused dimension {placement.dim}: {placement.split_factor} "
                        f"parts of it do not each split over the {world} ranks.",
                        module_fqn=fqn,
                        hint="use part sizes (e.g. the head count) divisible by the tp size, "
                        "or plan the layer ColwiseParallel() (exact, but it gathers at the split).",
                    )
            elif isinstance(placement, Shard) and meta.shape[placement.dim] % world:
                dims[ref.name] = placement.dim
        return dims

    def layout_at_boundary(
        self, consumer: torch.fx.Node, arg: torch.fx.Node, state: set[torch.fx.Node]
    ) -> list[UseStep] | None:
        # forward: module inputs and outputs; backward derives its own collectives from
        # propagation, but reads a module's output as it left the module (the same
        # redistribution, shared: a vocabulary-sharded embedding's masked partial can
        # be reduced only once)
        if arg in state:
            return None
        val = arg.meta.get("val")
        if not isinstance(val, torch.Tensor) or not val.is_floating_point():
            return None
        if PHASE in consumer.meta:
            return self._module_output_in_backward(arg, val)
        consumer_fqn, arg_fqn = consumer.meta.get(MODULE_FQN), arg.meta.get(MODULE_FQN)
        steps: list[UseStep] = []
        # the value leaves every styled module holding its producer but not its reader
        # (innermost first), then enters every one holding the reader (outermost first):
        # a parent's prepare style and its Linears' styles both apply (NOTE: [prepare styles])
        for left in _styled_modules(arg_fqn, self.layouts):
            layout = self.layouts[left][1]
            if not _within(consumer_fqn, left) and layout is not None:
                steps.append(UseStep(UseGroup.MODULE_OUTPUT, (_normalize(layout, val.dim()),), module=_use_module(left)))
        for entered in reversed(_styled_modules(consumer_fqn, self.layouts)):
            layout = self.layouts[entered][0]
            if not _within(arg_fqn, entered) and layout is not None:
                steps.append(UseStep(UseGroup.MODULE_INPUT, (_normalize(layout, val.dim()),), module=_use_module(entered)))
        return steps or None

    def _module_output_in_backward(
        self, arg: torch.fx.Node, val: torch.Tensor
    ) -> list[UseStep] | None:
        outer = _styled_module(arg.meta.get(MODULE_FQN), self.layouts)
        if outer is None or self.layouts[outer][1] is None:
            return None
        leaves = any(
            PHASE not in user.meta and not _within(user.meta.get(MODULE_FQN), outer)
            for user in arg.users
        )
        if not leaves:
            return None
        layout = _normalize(cast(Placement, self.layouts[outer][1]), val.dim())
        return [UseStep(UseGroup.MODULE_OUTPUT, (layout,), module=_use_module(outer))]

    def __repr__(self) -> str:
        return f"TensorParallel(plan={self.plan})"


def _use_module(fqn: str) -> str:
    """A styled module as a ``UseStep`` names it: the root module (FQN '') by a name no
    submodule has."""
    return fqn or "<root module>"


def _within(fqn: str | None, module: str) -> bool:
    """Whether a node of module ``fqn`` runs inside ``module`` ('': the root module, which
    holds every node of the model; the step's own code has no module, None)."""
    return fqn is not None and (fqn == module or not module or fqn.startswith(module + "."))


def _styled_modules(fqn: str | None, layouts: Mapping[str, Any]) -> list[str]:
    """Every styled module containing ``fqn``, innermost first."""
    if fqn is None:
        return []
    return sorted((m for m in layouts if _within(fqn, m)), key=len, reverse=True)


def _styled_module(fqn: str | None, layouts: Mapping[str, Any]) -> str | None:
    """The innermost styled module containing ``fqn``."""
    return next(iter(_styled_modules(fqn, layouts)), None)


def _normalize(placement: Placement, ndim: int) -> Placement:
    if isinstance(placement, Shard) and placement.dim < 0:
        return Shard(placement.dim % ndim)
    return placement
