"""TensorParallel: shard layers' weights across ranks by a plan of module FQN patterns.

NOTE: [tensor parallel as placements]
The plan is the one torch's ``parallelize_module`` takes: module FQN patterns (shell-style
wildcards, matched level by level) to torch's own ``ColwiseParallel``,
``RowwiseParallel`` and ``SequenceParallel`` styles, or ``"replicate"``. A style decides
(a) the placements of its module's parameters: colwise Linear weight/bias Shard(0),
colwise Embedding weight Shard(1), rowwise Linear weight Shard(1) with a Replicate bias,
rowwise Embedding weight Shard(0); and (b) the layout of the module's input and output
activations in forward: an activation entering the module is redistributed to the
style's desired input layout, one leaving it to the style's output layout (Replicate
after a rowwise Linear is an all-reduce, Shard(1) a reduce-scatter for sequence
parallelism). Everything else follows from DTensor's propagation; backward needs no
annotation, its collectives come from the same propagation on global semantics.
"""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
)

from spmd_compiler.bindings import StepBindings
from spmd_compiler.errors import MODULE_FQN, PHASE, SPMDCompileError
from spmd_compiler.expand import Placements, UseHook
from spmd_compiler.graph_utils import placeholders
from spmd_compiler.signature import CapturedStep, Kind, StateRef, TensorMeta

from .base import ParallelMode, replicate

Style = ParallelStyle | str


def validate_plan(plan: Mapping[str, Style]) -> None:
    if not isinstance(plan, Mapping):
        raise ValueError(f"TensorParallel plan must be a dict of FQN pattern -> style, got {type(plan).__name__}")


def match_plan(model: nn.Module, plan: Mapping[str, Style]) -> dict[str, Style]:
    """Module FQN -> style for every module a plan pattern matches (level by level)."""
    matched: dict[str, Style] = {}
    for pattern, style in plan.items():
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"TensorParallel plan keys must be non-empty FQN patterns, got {pattern!r}")
        if not (isinstance(style, (ColwiseParallel, RowwiseParallel, SequenceParallel)) or style == "replicate"):
            raise ValueError(
                f"TensorParallel plan[{pattern!r}] = {style!r}: use ColwiseParallel(), "
                "RowwiseParallel(), SequenceParallel() or 'replicate'."
            )
        atoms = pattern.split(".")
        for fqn, _ in model.named_modules():
            parts = fqn.split(".") if fqn else []
            if len(parts) == len(atoms) and all(fnmatch.fnmatch(p, a) for p, a in zip(parts, atoms)):
                matched[fqn] = style
    return matched


def param_placement(style: Style, module: nn.Module, param_name: str, fqn: str) -> Placement:
    """Placement on the tp mesh dimension of ``module.<param_name>`` under ``style``."""
    if style == "replicate" or isinstance(style, SequenceParallel):
        return Replicate()
    colwise = isinstance(style, ColwiseParallel)
    if isinstance(module, nn.Linear):
        if param_name == "weight":
            return Shard(0) if colwise else Shard(1)
        return Shard(0) if colwise else Replicate()
    _check_module_type(style, module, fqn)
    return Shard(1) if colwise else Shard(0)  # nn.Embedding


def _check_module_type(style: Style, module: nn.Module, fqn: str) -> None:
    if isinstance(style, (ColwiseParallel, RowwiseParallel)) and not isinstance(
        module, (nn.Linear, nn.Embedding)
    ):
        raise SPMDCompileError(
            f"{type(style).__name__} applies to nn.Linear and nn.Embedding; module {fqn!r} "
            f"is a {type(module).__name__}.",
            module_fqn=fqn,
            hint="plan only Linear/Embedding modules with Colwise/Rowwise styles.",
        )


def _layouts(style: Style, module: nn.Module) -> tuple[Placement | None, Placement | None]:
    """(desired input layout, output layout) of a styled module's activations."""
    if style == "replicate":
        return None, None
    if isinstance(style, SequenceParallel):
        return style.sequence_sharding[0], style.sequence_sharding[0]
    if isinstance(style, ColwiseParallel):
        return Replicate(), style.output_layouts[0]
    want_in = Shard(-1) if isinstance(module, nn.Linear) else Replicate()
    return want_in, style.output_layouts[0]


class TensorParallel(ParallelMode):
    """Tensor (and sequence) parallelism following a ``parallelize_module``-style plan.

    Args:
        plan: ``{fqn_pattern: style}`` with torch's ``ColwiseParallel``,
            ``RowwiseParallel``, ``SequenceParallel`` or ``"replicate"``.
        mesh: a 1-D mesh, or a named 1-D sub-mesh of an N-D mesh (``mesh["tp"]``); by
            default all ranks of the default process group.

    Inputs are Replicate (every tensor-parallel rank sees the whole batch); parameters not
    covered by the plan are Replicate.
    """

    name = "tp"

    def __init__(self, plan: Mapping[str, Style], *, mesh: DeviceMesh | None = None) -> None:
        validate_plan(plan)
        if not isinstance(plan, Mapping):
            raise ValueError(f"TensorParallel plan must be a dict of FQN pattern -> style, got {type(plan).__name__}")
        if mesh is not None and mesh.ndim != 1:
            raise ValueError(f"TensorParallel takes a 1-D (sub-)mesh, got {mesh.ndim}-D {mesh}")
        super().__init__(mesh)
        self.plan = dict(plan)
        self.styles: dict[str, Style] = {}
        self.layouts: dict[str, tuple[Placement | None, Placement | None]] = {}
        self.param_placements: dict[str, Placement] = {}

    def prepare(self, bindings: StepBindings) -> None:
        self.styles, self.layouts, self.param_placements = {}, {}, {}
        for mi, model in enumerate(bindings.modules):
            prefix = "" if len(bindings.modules) == 1 else f"{mi}."
            matched = match_plan(model, self.plan)
            for fqn, style in matched.items():
                module = model.get_submodule(fqn)
                _check_module_type(style, module, prefix + fqn)
                self.styles[prefix + fqn] = style
                self.layouts[prefix + fqn] = _layouts(style, module)
                for pname, _ in module.named_parameters(recurse=False):
                    full = f"{fqn}.{pname}" if fqn else pname
                    name = bindings.module_params[mi].get(full)
                    if name is not None:
                        self.param_placements[name] = param_placement(style, module, pname, fqn)
        if not self.plan or not self.styles:
            warnings.warn(
                f"TensorParallel plan {list(self.plan) or '{}'} matches no module; every "
                "parameter stays replicated.",
                stacklevel=3,
            )

    def placement_of(self, ref: StateRef, meta: TensorMeta, mesh: DeviceMesh) -> Placements:
        if ref.kind in (Kind.PARAM, Kind.GRAD, Kind.OPTIM_STATE) and meta.shape:
            placement = self.param_placements.get(ref.name)
            if placement is not None:
                return (_normalize(placement, len(meta.shape)),)
        return replicate(mesh)

    def placement_at_use(self, captured: CapturedStep, mesh: DeviceMesh) -> UseHook | None:
        if not self.layouts:
            return None
        state = {
            node for node, ref in zip(placeholders(captured.graph_module), captured.input_refs(), strict=True)
            if ref.kind is not Kind.INPUT
        }
        return lambda consumer, arg: self.layout_at_boundary(consumer, arg, state)

    def layout_at_boundary(
        self, consumer: torch.fx.Node, arg: torch.fx.Node, state: set[torch.fx.Node]
    ) -> list[tuple[Placements, str]] | None:
        # only forward: module inputs and outputs are forward values; backward derives
        # its own collectives from propagation
        if PHASE in consumer.meta or arg in state:
            return None
        val = arg.meta.get("val")
        if not isinstance(val, torch.Tensor) or not val.is_floating_point():
            return None
        inner = _styled_module(consumer.meta.get(MODULE_FQN), self.layouts)
        outer = _styled_module(arg.meta.get(MODULE_FQN), self.layouts)
        if inner == outer:
            return None
        steps = []
        if outer is not None and not _within(consumer.meta.get(MODULE_FQN), outer):
            layout = self.layouts[outer][1]
            if layout is not None:
                steps.append(((_normalize(layout, val.dim()),), f"out of {outer}"))
        if inner is not None and not _within(arg.meta.get(MODULE_FQN), inner):
            layout = self.layouts[inner][0]
            if layout is not None:
                steps.append(((_normalize(layout, val.dim()),), f"into {inner}"))
        return steps or None

    def __repr__(self) -> str:
        return f"TensorParallel(plan={self.plan})"


def _within(fqn: str | None, module: str) -> bool:
    return fqn is not None and (fqn == module or fqn.startswith(module + "."))


def _styled_module(fqn: str | None, layouts: Mapping[str, Any]) -> str | None:
    """The innermost styled module containing ``fqn``."""
    if fqn is None:
        return None
    best = None
    for styled in layouts:
        if styled and _within(fqn, styled):
            if best is None or len(styled) > len(best):
                best = styled
    return best


def _normalize(placement: Placement, ndim: int) -> Placement:
    if isinstance(placement, Shard) and placement.dim < 0:
        return Shard(placement.dim % ndim)
    return placement
