"""Every private torch API the project uses, in one place.

NOTE: [private torch APIs]
torch 2.13 offers no public entry point for a few things the pipeline needs: swapping a
module's parameters for traced values, the simulated-rank machinery (LocalTensorMode and
the fake process group), the DTensor redistribution hook we memoize, the proxy tracer of
an active ``make_fx`` trace, and DTensor's local-tensor slot. Each is wrapped here, so a
torch upgrade touches this file only. Nothing else in the package imports a module or
attribute whose name starts with an underscore from torch.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

# ---------------------------------------------------------------------------- capture


def reparametrize_module(module: torch.nn.Module, tensors: dict[str, torch.Tensor]):
    """Context manager: ``module``'s parameters and buffers are ``tensors`` inside it."""
    from torch.nn.utils.stateless import _reparametrize_module

    return _reparametrize_module(module, tensors, tie_weights=True, strict=False)


@contextlib.contextmanager
def optimizer_capturable_path() -> Iterator[None]:
    """Make torch.optim take its graph-capturable path while we trace ``step()``.

    The capturable path keeps the step counter and the learning rate as tensors (no
    ``.item()``), but on CPU it asserts unless torch believes it is compiling, so
    ``torch.compiler.is_compiling`` is patched for the duration of ``optimizer.step()``.
    State the optimizer creates gets float64 step counters (see NOTE: [float64 step
    counters] in capture.py), by patching each optimizer module's ``_get_scalar_dtype``.
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch("torch.compiler.is_compiling", lambda: True))
        for name, module in list(sys.modules.items()):
            if name.startswith("torch.optim") and hasattr(module, "_get_scalar_dtype"):
                stack.enter_context(
                    mock.patch.object(module, "_get_scalar_dtype", lambda *a, **k: torch.float64)
                )
        yield


def register_stack_trace_anchor(fn: Callable[..., Any]) -> None:
    """Keep the frames of ``fn`` (the user's train step) in recorded stack traces."""
    from torch.fx.proxy import _register_stack_trace_anchor

    _register_stack_trace_anchor(fn)


def current_trace_graph() -> torch.fx.Graph | None:
    """The graph that the active ``make_fx`` trace is writing to, if any."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    mode = get_proxy_mode()
    return None if mode is None else mode.tracer.graph


def traced_node_of(t: torch.Tensor) -> torch.fx.Node | None:
    """The node of the active ``make_fx`` trace that produced ``t``, if any."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot

    mode = get_proxy_mode()
    if mode is None:
        return None
    slot = get_proxy_slot(t, mode.tracer, None)
    return None if slot is None else slot.proxy.node


def data_dependent_error_types() -> tuple[type[BaseException], ...]:
    """Exceptions fake tensors raise when Python code reads a tensor's value."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
    )
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    return (DataDependentOutputException, DynamicOutputShapeException, GuardOnDataDependentSymNode)


def is_real_tensor_constant(t: torch.Tensor) -> bool:
    """True for a real (not fake) tensor met while a fake trace runs: a graph constant."""
    from torch._subclasses.fake_tensor import FakeTensor, maybe_get_fake_mode

    return not isinstance(t, FakeTensor) and maybe_get_fake_mode(t) is None


def lift_constant(t: torch.Tensor) -> torch.Tensor:
    """A real tensor constant as a value of the active ``make_fx`` trace.

    The trace records it as a ``get_attr`` constant followed by ``lift_fresh_copy``; the
    result is a fake tensor the trace tracks, which DTensor can wrap.
    """
    return torch.ops.aten.lift_fresh_copy.default(t)


def fake_tensor_mode(with_shape_env: bool = False) -> Any:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    return FakeTensorMode(
        allow_non_fake_inputs=False, shape_env=ShapeEnv() if with_shape_env else None
    )


# ---------------------------------------------------------------------------- DTensor


def local_tensor_of(dtensor: DTensor) -> torch.Tensor:
    """The local shard of ``dtensor`` without going through autograd."""
    return dtensor._local_tensor


def set_local_tensor(dtensor: DTensor, local: torch.Tensor) -> None:
    """Swap the local shard of ``dtensor`` for ``local`` (same shape, dtype, device)."""
    dtensor._local_tensor = local


class RedistributionCache(dict):
    """The memo of ``memoized_redistribution``; ``bypass()`` turns it off for a while
    (a mode that asks for a fresh gather, e.g. FSDP's backward re-gather)."""

    bypassed = False

    @contextlib.contextmanager
    def bypass(self) -> Iterator[None]:
        self.bypassed = True
        try:
            yield
        finally:
            self.bypassed = False


def _replicate_between_shards(current_spec: Any, target_spec: Any) -> Any:
    """An intermediate spec with Replicate wherever a mesh dimension goes from one shard
    to another (``Shard(a) -> Shard(b)``), or None.

    torch 2.13 gap: on CPU such a step is an all-to-all emulated by all-gather + chunk,
    and under ``compile_on_one_rank`` that chunk is rank 0's, baked into the program
    (every rank keeps rank 0's rows). Going through Replicate uses the same all-gather
    and then the run-time coordinate to keep this rank's slice.
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    hops = [
        Replicate() if cur.is_shard() and tgt.is_shard() and cur != tgt else cur
        for cur, tgt in zip(current_spec.placements, target_spec.placements, strict=True)
    ]
    if tuple(hops) == tuple(current_spec.placements):
        return None
    return DTensorSpec(current_spec.mesh, tuple(hops), tensor_meta=current_spec.tensor_meta)


@contextlib.contextmanager
def memoized_redistribution() -> Iterator[RedistributionCache]:
    """Redistribute each (value, source spec, target spec) at most once.

    DTensor redistributes an argument separately at every use (a Partial gradient used by
    three optimizer ops is all-reduced three times). Inside this context the dispatcher's
    redistribution goes through a cache keyed by the local tensor's identity and both
    specs. The cache keeps its keys alive, so identities are never reused while it lives.
    It is only sound for functional graphs (no value is mutated after it was
    redistributed), which is what the expander runs.
    """
    import torch.distributed.tensor._dispatch as dispatch_module
    import torch.distributed.tensor._redistribute as redistribute_module

    original = redistribute_module.redistribute_local_tensor
    cache = RedistributionCache()

    def redistribute(local_tensor, current_spec, target_spec, *args, **kwargs):
        hop = _replicate_between_shards(current_spec, target_spec)
        if hop is not None:
            local_tensor = original(local_tensor, current_spec, hop, *args, **kwargs)
            current_spec = hop
        return original(local_tensor, current_spec, target_spec, *args, **kwargs)

    def cached(local_tensor, current_spec, target_spec, *args, **kwargs):
        if cache.bypassed:
            return redistribute(local_tensor, current_spec, target_spec, *args, **kwargs)
        key = (id(local_tensor), current_spec, target_spec)
        hit = cache.get(key)
        if hit is not None and hit[0] is local_tensor:
            return hit[1]
        out = redistribute(local_tensor, current_spec, target_spec, *args, **kwargs)
        cache[key] = (local_tensor, out)
        return out

    modules = (dispatch_module, redistribute_module)
    for module in modules:
        module.redistribute_local_tensor = cached
    try:
        yield cache
    finally:
        for module in modules:
            module.redistribute_local_tensor = original


class PropagationBudgetExceeded(Exception):
    """DTensor's decomposition-based sharding propagation for ``op`` ran out of time.

    Not a RuntimeError / NotImplementedError on purpose: DTensor's search loop skips
    those and goes on trying placements."""

    def __init__(self, op: Any, seconds: float, attempts: int) -> None:
        super().__init__(
            f"sharding propagation of {op} through its decomposition did not finish "
            f"within {seconds:g} s ({attempts} placement combinations tried)"
        )
        self.op, self.seconds, self.attempts = op, seconds, attempts


@contextlib.contextmanager
def bounded_decomposition_propagation(seconds: float) -> Iterator[None]:
    """Bound DTensor's decomposition-based sharding propagation to ``seconds`` per op.

    torch 2.13 gap: for an op without a sharding rule, DTensor traces the op's
    decomposition once per combination of candidate input placements, and every op of
    that decomposition without a rule does the same, nested; for attention with a 4-D
    mask this ran for more than ten minutes. Here the outermost propagation starts a
    clock; every attempt (nested ones included) checks it, and when it runs out the
    outermost call raises ``PropagationBudgetExceeded`` (DTensor then reports the op as
    having no sharding strategy, with this as the cause).
    """
    from torch.distributed.tensor._decompositions import DecompShardingStrategy

    original_propagate = DecompShardingStrategy.propagate_strategy
    original_attempt = DecompShardingStrategy._propagate_through_decomp
    state: dict[str, Any] = {"deadline": None, "op": None, "attempts": 0, "exceeded": False}

    def propagate_strategy(self, op_schema):
        outermost = state["deadline"] is None
        if outermost:
            state.update(deadline=time.monotonic() + seconds, op=op_schema.op, attempts=0, exceeded=False)
        try:
            result = original_propagate(self, op_schema)
            if outermost and state["exceeded"]:
                raise PropagationBudgetExceeded(state["op"], seconds, state["attempts"])
            return result
        finally:
            if outermost:
                state["deadline"] = None

    def attempt(self, op_schema, placement, mesh):
        state["attempts"] += 1
        if state["exceeded"] or time.monotonic() > state["deadline"]:
            state["exceeded"] = True
            raise PropagationBudgetExceeded(state["op"], seconds, state["attempts"])
        return original_attempt(self, op_schema, placement, mesh)

    with mock.patch.object(DecompShardingStrategy, "propagate_strategy", propagate_strategy), \
            mock.patch.object(DecompShardingStrategy, "_propagate_through_decomp", attempt):
        yield


def budget_exceeded_in(exc: BaseException) -> PropagationBudgetExceeded | None:
    """The ``PropagationBudgetExceeded`` among the causes of ``exc``, if any."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, PropagationBudgetExceeded):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


@contextlib.contextmanager
def compile_on_one_rank() -> Iterator[None]:
    """Trace mesh coordinates as run-time values (torch.distributed.config).

    torch 2.13 gap, closed here: ``_StridedShard._local_shard_size`` (reached whenever a
    view splits a sharded dimension, e.g. attention heads) indexes the list of shards
    with the rank, which is symbolic here and fails as a data-dependent guard. When every
    shard has the same size the answer does not depend on the rank, so it is returned
    directly; uneven strided shards still fail (and the caller falls back).
    """
    import torch.distributed.config as dconfig
    from torch.distributed.tensor.placement_types import _StridedShard

    original = _StridedShard._local_shard_size
    original_select = _StridedShard._replicate_to_strided_shard
    original_size_and_offset = _StridedShard.local_shard_size_and_offset

    def local_shard_size_and_offset(self, curr_local_size, num_chunks, rank, offset_mode=0):
        # Even strided shards: rank r holds piece r of each of the split_factor blocks.
        pieces = self.split_factor * num_chunks
        if not isinstance(rank, int) and isinstance(curr_local_size, int) and curr_local_size % pieces == 0:
            piece = curr_local_size // pieces
            block = curr_local_size // self.split_factor
            if int(offset_mode) == 2:  # NONE
                return curr_local_size // num_chunks, None
            if int(offset_mode) == 0:  # FIRST
                return curr_local_size // num_chunks, rank * piece
            return curr_local_size // num_chunks, [
                i * block + rank * piece + j for i in range(self.split_factor) for j in range(piece)
            ]
        return original_size_and_offset(self, curr_local_size, num_chunks, rank, offset_mode)

    def local_shard_size(sharded_indices, rank):
        sizes = {len(s) for s in sharded_indices}
        if not isinstance(rank, int) and len(sizes) == 1:
            return sizes.pop()
        return original(sharded_indices, rank)

    def replicate_to_strided_shard(self, local_tensor, mesh, mesh_dim, shard_index):
        # Same gap in Replicate -> _StridedShard: with even pieces, rank r's shard is
        # piece r of every one of the split_factor blocks, a select on a reshaped view.
        n = mesh.size(mesh_dim)
        size = local_tensor.shape[self.dim]
        if not isinstance(shard_index, int) and size % (self.split_factor * n) == 0:
            blocks = local_tensor.unflatten(self.dim, (self.split_factor, n, -1))
            return blocks.select(self.dim + 1, shard_index).flatten(self.dim, self.dim + 1).clone()
        return original_select(self, local_tensor, mesh, mesh_dim, shard_index)

    with dconfig.patch(compile_on_one_rank=True), mock.patch.object(
        _StridedShard, "_local_shard_size", staticmethod(local_shard_size)
    ), mock.patch.object(
        _StridedShard, "_replicate_to_strided_shard", replicate_to_strided_shard
    ), mock.patch.object(_StridedShard, "local_shard_size_and_offset", local_shard_size_and_offset):
        yield


def mesh_coordinates(mesh: Any) -> list[tuple[int, ...]]:
    """Every coordinate of ``mesh``, in rank order."""
    import itertools

    return list(itertools.product(*(range(n) for n in mesh.shape)))


@contextlib.contextmanager
def fixed_mesh_coordinate(mesh: Any, coordinate: tuple[int, ...]) -> Iterator[None]:
    """Trace as the rank at ``coordinate`` of ``mesh`` (its 1-D sub-meshes included)."""
    saved = mesh._coordinate_on_dim
    mesh._coordinate_on_dim = list(coordinate)
    try:
        yield
    finally:
        mesh._coordinate_on_dim = saved


def all_gather_along(local: torch.Tensor, tensor_dim: int, mesh: Any, mesh_dim: int) -> torch.Tensor:
    """Functional all-gather of ``local`` along ``tensor_dim`` over one mesh dimension."""
    from torch.distributed import _functional_collectives as funcol

    return funcol.wait_tensor(funcol.all_gather_tensor(local, tensor_dim, (mesh, mesh_dim)))


def reduce_scatter_along(
    local: torch.Tensor, reduce_op: str, tensor_dim: int, mesh: Any, mesh_dim: int
) -> torch.Tensor:
    """Functional reduce-scatter of ``local`` along ``tensor_dim`` over one mesh dimension."""
    from torch.distributed import _functional_collectives as funcol

    return funcol.wait_tensor(
        funcol.reduce_scatter_tensor(local, reduce_op, tensor_dim, (mesh, mesh_dim))
    )


def root_mesh(mesh: Any) -> Any:
    """The parent (root) mesh a sub-mesh was sliced from (itself for a root mesh)."""
    return mesh._get_root_mesh()


def is_strided_shard(placement: Any) -> bool:
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(placement, _StridedShard)


def strided_shard(dim: int, split_factor: int) -> Any:
    """DTensor's placement for a right-to-left nested shard (NOTE: [parent-mesh sharding])."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=split_factor)


def chunk_at_coordinate(local: torch.Tensor, mesh: Any, mesh_dim: int, tensor_dim: int) -> torch.Tensor:
    """This rank's ``torch.chunk`` piece of ``local`` along ``tensor_dim`` for ``mesh_dim``.

    Works on real ranks (the rank's own coordinate) and on simulated ranks (a per-rank
    value holds each rank's piece).
    """
    n = mesh.size(mesh_dim)

    def piece(t: torch.Tensor, coordinate: int) -> torch.Tensor:
        chunks = list(torch.chunk(t, n, dim=tensor_dim))
        if coordinate < len(chunks):
            return chunks[coordinate].contiguous()
        shape = list(t.shape)
        shape[tensor_dim] = 0
        return t.new_empty(shape)

    from torch.distributed._local_tensor import enabled_local_tensor_mode

    mode = enabled_local_tensor_mode()
    if mode is not None and not isinstance(local, local_tensor_type()):
        with mode.disable():
            local = make_local_tensor({rank: local for rank in mode.ranks})
    if isinstance(local, local_tensor_type()):
        coordinates = {
            rank: [int(c) for c in (mesh.mesh == rank).nonzero()[0]]
            for rank in per_rank_tensors(local)
        }
        ctx = mode.disable() if mode is not None else contextlib.nullcontext()
        with ctx:
            return make_local_tensor({
                rank: piece(t, coordinates[rank][mesh_dim])
                for rank, t in per_rank_tensors(local).items()
            })
    return piece(local, mesh.get_coordinate()[mesh_dim])


# ---------------------------------------------------------------------------- simulation


def local_tensor_mode(world_size: int) -> Any:
    from torch.distributed._local_tensor import LocalTensorMode

    return LocalTensorMode(world_size)


def local_tensor_type() -> type:
    from torch.distributed._local_tensor import LocalTensor

    return LocalTensor


def make_local_tensor(per_rank: dict[int, torch.Tensor]) -> torch.Tensor:
    from torch.distributed._local_tensor import LocalTensor

    return LocalTensor(per_rank)


def per_rank_tensors(t: torch.Tensor) -> dict[int, torch.Tensor]:
    """The per-rank values of a simulated tensor (a LocalTensor)."""
    return dict(t._local_tensors)


def init_fake_process_group(world_size: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)


def is_fake_process_group() -> bool:
    return dist.is_initialized() and dist.get_backend() == "fake"
