"""Shared by the unit tests of the collective passes: compile a small step with extra
passes, run it on simulated ranks beside the eager single-device step, and compare."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler import _torch_private as private
from spmd_compiler.parallel_modes import DataParallel
from spmd_compiler.passes import PassOptions, run_pipeline
from spmd_compiler.tools.parity import (
    compare_models,
    compare_optimizers,
    max_difference,
    relative_difference,
)

TOL = 1e-5

Setup = tuple[nn.Module, torch.optim.Optimizer, list[tuple[torch.Tensor, ...]]]


# the optimization passes of the default pipeline; the harness runs exactly the ones a
# test names, so "off" really is off
OPTIMIZATION_PASSES = (
    "remove_noop_reshapes",
    "remove_duplicate_collectives",
    "bucket_collectives",
    "merge_regathers",
    "schedule_overlap",
    "fuse_optimizer_updates",
)


class DataParallelWithPasses(DataParallel):
    """DataParallel whose program runs the default pipeline without its optimization
    passes, then ``passes`` (explicitly) with ``pass_options`` bound."""

    def __init__(
        self,
        style: str,
        passes: Sequence[str],
        pass_options: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(style, **kwargs)
        self.passes = tuple(passes)
        self.pass_options = {k: v for k, v in (pass_options or {}).items() if k in self.passes}

    def transform_and_compile(self, program, options=None):
        base = PassOptions(disabled=frozenset(OPTIMIZATION_PASSES))
        program = super().transform_and_compile(program, base)
        return run_pipeline(
            program, PassOptions(pass_options=self.pass_options), pipeline=self.passes
        )


def classification_step(model, optim, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def mlp_setup(steps: int = 2) -> Setup:
    """A 4-parameter MLP with LayerNorm, AdamW, and ``steps`` global batches of 16."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 8))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-5)
    gen = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(16, 8, generator=gen), torch.randint(0, 8, (16,), generator=gen))
        for _ in range(steps)
    ]
    return model, optim, batches


@dataclass
class Run:
    step: sc.CompiledTrainStep
    model: nn.Module
    losses: list[float]
    max_loss_difference: float
    max_state_difference: float

    @property
    def graph(self) -> torch.fx.Graph:
        return self.step.last_program.graph_module.graph


def train(
    mode: DataParallel,
    setup: Callable[[], Setup] = mlp_setup,
    *,
    world_size: int = 4,
    step_fn: Callable[..., torch.Tensor] = classification_step,
) -> Run:
    """The compiled step on ``world_size`` simulated ranks beside the eager step on one
    device (``setup`` is called once for each, and must build the same thing twice)."""
    model, optim, batches = setup()
    reference, ref_optim, _ = setup()
    compiled = sc.compile(mode)(step_fn)
    losses, loss_diffs = [], []
    with sc.simulate(world_size) as sim:
        for batch in batches:
            loss = compiled(model, optim, *batch)
            losses.append(loss.item())
            loss_diffs.append(relative_difference(loss, step_fn(reference, ref_optim, *batch)))
        diff = max_difference(
            compare_models(model, reference, sim), compare_optimizers(optim, ref_optim, sim)
        )
    return Run(compiled, model, losses, max(loss_diffs), diff)


def ops(graph: torch.fx.Graph, name: str) -> list[torch.fx.Node]:
    """The call_function nodes whose target's name contains ``name``, in graph order."""
    return [n for n in graph.nodes if n.op == "call_function" and name in str(n.target)]


class TinyProgram:
    """The slice of DistributedProgram the pass manager and these passes touch."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        self.graph_module = gm
        self.passes_applied: list[str] = []
        self.pass_seconds: dict[str, float] = {}

    @property
    def graph(self) -> torch.fx.Graph:
        return self.graph_module.graph

    def names(self) -> list[str]:
        """Node names in order, without placeholders and the output."""
        return [n.name for n in self.graph.nodes if n.op not in ("placeholder", "output")]


class TinyGraph:
    """Builds small per-rank graphs by hand, with fake ``meta['val']`` on every tensor
    node and process groups made the way expansion makes them (``get_attr`` of the mesh,
    then ``mesh_get_process_group``)."""

    def __init__(self, world_size: int = 4) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.graph = torch.fx.Graph()
        self.fake = FakeTensorMode()
        self.world_size = world_size

    def input(self, name: str, *shape: int) -> torch.fx.Node:
        node = self.graph.placeholder(name)
        with self.fake:
            node.meta["val"] = torch.empty(shape)
        return node

    def op(self, name: str, target: Any, *args: Any) -> torch.fx.Node:
        node = self.graph.create_node("call_function", target, args, name=name)
        node.meta["val"] = target(*torch.fx.node.map_arg(args, lambda n: n.meta["val"]))
        return node

    def collective(
        self,
        name: str,
        target: Any,
        x: torch.fx.Node,
        *args: Any,
        shape: Sequence[int] | None = None,
    ) -> torch.fx.Node:
        """Nodes ``{name}_mesh``, ``{name}_group``, ``{name} = target(x, *args, group)`` and
        ``{name}_wait``; returns the wait."""
        mesh = self.graph.create_node("get_attr", "mesh", name=f"{name}_mesh")
        group = self.graph.create_node(
            "call_function",
            private.mesh_group_op(),
            (mesh, 0),
            name=f"{name}_group",
        )
        group.meta["val"] = "0"  # a group, no tensor (as expansion records it)
        node = self.graph.create_node("call_function", target, (x, *args, group), name=name)
        node.meta["val"] = x.meta["val"].new_empty(
            shape if shape is not None else x.meta["val"].shape
        )
        wait = self.graph.create_node(
            "call_function",
            torch.ops._c10d_functional.wait_tensor.default,
            (node,),
            name=f"{name}_wait",
        )
        wait.meta["val"] = node.meta["val"]
        return wait

    def all_reduce(self, name: str, x: torch.fx.Node, reduce_op: str = "sum") -> torch.fx.Node:
        return self.collective(name, torch.ops._c10d_functional.all_reduce.default, x, reduce_op)

    def all_gather(self, name: str, x: torch.fx.Node) -> torch.fx.Node:
        shape = [self.world_size * x.meta["val"].shape[0], *x.meta["val"].shape[1:]]
        return self.collective(
            name,
            torch.ops._c10d_functional.all_gather_into_tensor.default,
            x,
            self.world_size,
            shape=shape,
        )

    def program(self, *outputs: torch.fx.Node) -> TinyProgram:
        self.graph.output(tuple(outputs))
        root = nn.Module()
        root.mesh = "mesh"  # never run: any object stands in for the DeviceMesh
        return TinyProgram(torch.fx.GraphModule(root, self.graph))
