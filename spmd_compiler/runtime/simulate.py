"""N simulated ranks in one process (torch's LocalTensorMode + the fake process group).

    with spmd_compiler.simulate(world_size=4):
        loss = train_step(model, optimizer, global_batch, global_target)

Inside the context a compiled step receives the *global* batch and hands each simulated
rank its share according to the mode's input placements, runs the same per-rank program
on all ranks at once (each tensor holds one value per rank), and computes collectives
across the simulated ranks. Replicated results come back as plain tensors (checked equal
on every rank). The model's parameters become DTensors whose local values are per-rank.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.fx
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Placement, distribute_tensor

from .. import _torch_private as private
from .one_thread import enter, leave

_ACTIVE: contextvars.ContextVar[Simulation | None] = contextvars.ContextVar(
    "spmd_simulation", default=None
)


class RanksDisagree(AssertionError):
    """Simulated ranks hold different values for a tensor that should be replicated:
    the program is wrong (a pass that changed it, most likely), not the user's step."""


class Simulation:
    """An active simulation of ``world_size`` ranks. Use ``simulate()`` to make one."""

    def __init__(self, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self._owns_group = False
        self._token: contextvars.Token | None = None
        self._mode = None
        self._exit_hooks: list[Callable[[], object]] = []
        self._fresh_meshes: dict[tuple, DeviceMesh] = {}
        self._excepthook = sys.excepthook

    def at_exit(self, hook: Callable[[], object]) -> None:
        """Run ``hook`` when the simulation ends, while its ranks still exist (compiled
        steps finish a deferred update there)."""
        self._exit_hooks.append(hook)

    def __enter__(self) -> Simulation:
        enter("simulate() is entered")  # NOTE: [one thread at a time]
        try:
            return self._enter()
        except BaseException:
            leave()
            raise

    def _enter(self) -> Simulation:
        if dist.is_initialized():
            if not private.is_fake_process_group():
                raise RuntimeError(
                    "simulate() needs its own (fake) process group, but a real one is "
                    "initialized; run simulations in a process without torch.distributed."
                )
            dist.destroy_process_group()
        # init_process_group wraps sys.excepthook in one that prefixes "[rank0]: " to every
        # line, again on each call: after N simulations an uncaught error printed N prefixes
        self._excepthook = sys.excepthook
        private.init_fake_process_group(self.world_size)
        self._owns_group = True
        self._mode = private.local_tensor_mode(self.world_size)
        self._token = _ACTIVE.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        hooks, self._exit_hooks = self._exit_hooks, []
        try:
            if exc[0] is None:  # on an error, leave the error alone
                for hook in hooks:
                    hook()
        finally:
            try:
                self._close()
            finally:
                leave()

    def _close(self) -> None:
        if self._token is not None:
            _ACTIVE.reset(self._token)
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
        if self._owns_group:
            sys.excepthook = self._excepthook

    @contextlib.contextmanager
    def ranks(self) -> Iterator[None]:
        """Run the enclosed tensor code on every simulated rank."""
        assert self._mode is not None, "use the Simulation as a context manager"
        with self._mode:
            yield

    def shard(self, tensor: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> DTensor:
        """The global ``tensor`` as a DTensor whose local values are each rank's share.

        Every simulated rank gets a tensor of its own. torch's ``distribute_tensor``
        leaves a replicated value as one plain tensor (the caller's own storage) that
        all simulated ranks read and write: an in-place update by per-rank values (an
        eager ``optimizer.step()`` on a parameter whose gradient a program wrote, a
        replicated optimizer state loaded back into live objects and then updated) ran
        once per rank on it, where each real rank updates its own copy (Rprop's step
        sizes 44% off after a reload, a parameter 5.5e-2 off).

        Every rank's value is contiguous (NOTE: [contiguous simulated shards]).

        NOTE: [plain tensor subclasses simulated]
        A buffer or tensor argument of a Tensor subclass of the user's that overrides
        nothing (``class Tagged(torch.Tensor): pass``; ``register_buffer("mask",
        t.as_subclass(Tagged))``, a batch ``x.as_subclass(Tagged)``) crashed here:
        LocalTensorMode answers no op of a tensor type it does not know ("Multiple
        dispatch failed for 'aten.detach.default'"; the caller must not enter the mode
        around this call either). Real ranks place it as a DTensor whose local tensor is
        the subclass (2 gloo ranks: float64 losses equal to eager's, the full tensor a
        ``Tagged``). Here it is placed as its plain value, and each rank's value is made
        the subclass again, as on real ranks. The program was traced on plain stand-ins
        and runs no code of the class: right for a class that overrides nothing, which
        computes as a plain tensor eagerly too. A class that defines
        ``__torch_function__`` or ``__torch_dispatch__`` would compute otherwise in
        eager, and is refused before it gets here (NOTE: [tensor subclasses that
        override torch], in api.py)."""
        subclass = _plain_subclass(tensor)  # NOTE: [plain tensor subclasses simulated]
        if subclass is not None:
            tensor = tensor.detach().as_subclass(torch.Tensor)

        def own_value(t: torch.Tensor) -> torch.Tensor:
            return t.contiguous() if subclass is None else t.contiguous().as_subclass(subclass)

        with self.ranks():
            placed = distribute_tensor(tensor.detach(), mesh, list(placements), src_data_rank=None)
        local = private.local_tensor_of(placed)
        if isinstance(local, private.local_tensor_type()):
            per_rank = private.per_rank_tensors(local)
            if subclass is None and all(t.is_contiguous() for t in per_rank.values()):
                return placed
            own = private.make_local_tensor({r: own_value(t) for r, t in per_rank.items()})
        else:
            own = private.make_local_tensor(
                {r: own_value(local.clone(memory_format=torch.contiguous_format)) for r in range(self.world_size)}
            )
        with self.ranks():
            return DTensor.from_local(
                own, mesh, list(placements), run_check=False, shape=placed.shape, stride=placed.stride()
            )

    def full_tensor(self, value: torch.Tensor) -> torch.Tensor:
        """A plain tensor holding the full value of ``value`` (DTensor or per-rank)."""
        if isinstance(value, DTensor):
            # through the redistribution gap fills (NOTE: [DTensor gap fills]): torch 2.11
            # cannot gather a _StridedShard its planner does not read as a shard order
            live = self._on_live_mesh(value)
            with self.ranks(), private.memoized_redistribution():
                value = live.full_tensor()
        return self.reconcile(value)

    def _on_live_mesh(self, value: DTensor) -> DTensor:
        """``value`` on a mesh whose process groups exist in this simulation: itself, or
        the same local values on a new mesh of the same shape (NOTE: [state after a
        simulation])."""
        mesh = value.device_mesh
        if mesh_is_live(mesh):
            return value
        key = (mesh.device_type, tuple(mesh.mesh.flatten().tolist()), tuple(mesh.shape),
               mesh.mesh_dim_names)
        fresh = self._fresh_meshes.get(key)
        if fresh is None:
            if key[1] != tuple(range(self.world_size)):
                raise RuntimeError(
                    f"the state lives on {mesh}, a mesh of a simulation that has ended and not "
                    f"over ranks 0..{self.world_size - 1} in order; read it inside that "
                    "simulation (spmd_compiler.checkpoint.full_state_dict)"
                )
            fresh = init_device_mesh(mesh.device_type, key[2], mesh_dim_names=key[3])
            self._fresh_meshes[key] = fresh
        with self.ranks():
            return DTensor.from_local(
                private.local_tensor_of(value), fresh, value.placements, run_check=False,
                shape=value.shape, stride=value.stride(),
            )

    def reconcile(self, value: torch.Tensor) -> torch.Tensor:
        """The value every simulated rank holds; raises if the ranks disagree."""
        if isinstance(value, private.local_tensor_type()):
            per_rank = private.per_rank_tensors(value)
            first = per_rank[min(per_rank)]
            for rank, t in per_rank.items():
                if not same_value(t, first):
                    raise RanksDisagree(
                        f"simulated rank {rank} holds a different value than rank "
                        f"{min(per_rank)} for a tensor that should be replicated"
                    )
            return first.detach().clone()
        return value

    def per_rank_tensor(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` as a simulated tensor (one value per rank; a plain tensor is the same
        on every rank). Rank-dependent ops in a program (slices at the rank's offset)
        need every input to carry its ranks."""
        if isinstance(value, private.local_tensor_type()):
            return value
        return private.make_local_tensor({r: value for r in range(self.world_size)})

    @contextlib.contextmanager
    def constants_per_rank(self, program: Any) -> Iterator[None]:
        """Let ``program``'s tensor constants (``get_attr``) be simulated tensors while it
        runs: a slice of a constant at the rank's offset (a Replicate constant used with
        a shard) needs the constant to carry its ranks. See NOTE: [tensor constants]."""
        if not isinstance(program, torch.fx.GraphModule):
            yield
            return
        saved: dict[str, torch.Tensor] = {}
        for node in program.graph.nodes:
            if node.op != "get_attr" or node.target in saved or not _is_lifted_constant(node):
                continue
            value = getattr(program, node.target, None)
            if isinstance(value, torch.Tensor) and not isinstance(
                value, (torch.nn.Parameter, private.local_tensor_type())
            ):
                saved[node.target] = value
                setattr(program, node.target, self.per_rank_tensor(value))
        try:
            yield
        finally:
            for name, value in saved.items():
                setattr(program, name, value)

    def per_rank(self, value: torch.Tensor) -> dict[int, torch.Tensor]:
        """Each simulated rank's local value."""
        if isinstance(value, DTensor):
            value = private.local_tensor_of(value)
        if isinstance(value, private.local_tensor_type()):
            return private.per_rank_tensors(value)
        return {r: value for r in range(self.world_size)}


# NOTE: [contiguous simulated shards]
# A simulated tensor holds one value per rank but runs a composite op's decisions once
# for all of them: ``reshape`` asks whether a view fits the strides and then views every
# rank's value. ``distribute_tensor`` leaves a shard of a non-contiguous tensor (a
# transposed parameter, ``nn.Parameter(w.T)``, or the ``Vh[:r]`` a low-rank
# parametrization's ``right_inverse`` returns) with the whole tensor's strides, and a
# rank whose uneven shard is zero-padded (NOTE: [uneven shards]) gets a contiguous copy,
# so the ranks disagreed: fully_shard of 3 such rows over 2 ranks failed on the first
# call with "view size is not compatible with input tensor's size and stride" (rank 0's
# shard strides (1, 2), rank 1's padded one (16, 1)); tensor parallel over 4 ranks with
# 30 columns the same. Real ranks each decide on their own strides and trained it
# exactly. The programs are traced on contiguous local values (``retrace``), so every
# simulated rank's shard is made contiguous where the state enters the simulation.


def same_value(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch.equal``, except that NaN equals NaN at the same position: a replicated
    NaN (a NaN input, or the mean of an empty batch) is the same value on every rank,
    as in eager, where ``torch.equal`` would call the ranks different."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not (a.is_floating_point() or a.is_complex()):
        return torch.equal(a, b)
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def mesh_is_live(mesh: DeviceMesh) -> bool:
    """Whether ``mesh``'s process groups exist and are the ones it was made with: those
    of a mesh made in a simulation end with it, and a later simulation may give their
    names to groups of other ranks (NOTE: [state after a simulation])."""
    if not dist.is_initialized():
        return False
    coordinate = private.mesh_coordinate(mesh, dist.get_rank())
    if coordinate is None:  # not in the mesh: nothing to tell by
        return True
    try:
        for dim in range(mesh.ndim):
            index: list[Any] = list(coordinate)
            index[dim] = slice(None)
            members = mesh.mesh[tuple(index)].tolist()
            if dist.get_process_group_ranks(mesh.get_group(dim)) != members:
                return False
    except (RuntimeError, ValueError, KeyError):
        return False
    return True


def _is_lifted_constant(node: torch.fx.Node) -> bool:
    """A constant of the user's step (expansion reads it through ``lift_fresh_copy``),
    not one of DTensor's own (the mesh tensor its coordinate op reads as a plain tensor)."""
    return "." not in str(node.target) and any(
        user.target is torch.ops.aten.lift_fresh_copy.default for user in node.users
    )


def simulate(world_size: int) -> Simulation:
    """Context manager: run compiled steps on ``world_size`` simulated ranks."""
    return Simulation(world_size)


def simulated_world_size(tensors: Iterable[Any]) -> int | None:
    """The number of simulated ranks the first simulated tensor among ``tensors`` holds
    values for (a DTensor over one, or one itself); None when none is simulated."""
    local_type = private.local_tensor_type()
    for t in tensors:
        if isinstance(t, DTensor):
            t = private.local_tensor_of(t)
        if isinstance(t, torch.Tensor) and isinstance(t, local_type):
            return len(private.per_rank_tensors(t))
    return None


@contextlib.contextmanager
def simulation_for(tensors: Iterable[Any]) -> Iterator[Simulation | None]:
    """The simulation that ``tensors`` can be read in: the active one; or, after the
    ``with simulate(...)`` block that trained them has ended, a new one of their world
    size (NOTE: [state after a simulation]); None for real ranks and plain tensors.

    NOTE: [state after a simulation]
    A model trained inside ``simulate`` keeps DTensor parameters whose local values are
    simulated tensors, so that a later simulation continues it. Once the block has ended
    their mesh's (fake) process group is gone: gathering a sharded one fails in torch
    ("Could not resolve the process group registered under the name 0"), and a simulated
    tensor has no storage ``torch.save`` can write. The checkpoint functions read such
    state in a new simulation of the same world size and hand back plain tensors. A 1-D
    mesh over every rank is the default group's, which the new simulation has again; a
    2-D one had groups of its own, so ``Simulation.full_tensor`` puts the same local
    values on a new mesh of the same shape there before gathering. A compiled step called
    in a later simulation makes its mesh again and compiles again (its programs name the
    old groups), and its first call moves the state onto the new mesh (``rehome``).
    """
    sim = active_simulation()
    if sim is not None or dist.is_initialized():
        yield sim
        return
    world = simulated_world_size(tensors)
    if world is None:
        yield None
        return
    with simulate(world) as sim:
        yield sim


def active_simulation() -> Simulation | None:
    return _ACTIVE.get()


def _plain_subclass(tensor: torch.Tensor) -> type | None:
    """The class of ``tensor`` where it is a subclass of torch.Tensor of the user's with no
    ``__torch_dispatch__`` of its own (``t.as_subclass(Tagged)``; one that overrides
    torch's hooks is refused before: NOTE: [tensor subclasses that override torch]), else
    None."""
    cls = type(tensor)
    if cls is torch.Tensor or isinstance(tensor, (DTensor, torch.nn.Parameter)):
        return None
    if getattr(cls, "__torch_dispatch__", None) is not torch.Tensor.__torch_dispatch__:
        return None
    return cls
