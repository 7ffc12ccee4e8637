"""Warnings: none of ours (torch 2.13's deprecated funcol names), and DTensor's
sequential-collective message dropped only while we expand (NOTE: [DTensor's
sequential-collective warning])."""

from __future__ import annotations

import logging
import warnings

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import _redistribute

import spmd_compiler as sc
from spmd_compiler import _torch_private as private


class _Mesh:
    mesh_dim_names = ("dp", "tp")


# torch warns once per (hash(mesh), dims, reason), and the hash of a plain object is its
# id: every mesh stays alive to the end of the session, so that no later one reuses the
# address (and the hash) of an earlier one and finds its warning already given.
_MESHES: list[_Mesh] = []


def _torch_warns_sequential() -> None:
    mesh = _Mesh()
    _MESHES.append(mesh)
    _redistribute._warn_flatten_optimization_not_possible(
        mesh, (0, 1), "(S(0), S(0))", "(R, R)", 2, "all_gather", "no_flattened_mesh"
    )


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_sequential_collective_message_is_dropped_only_inside_expansion():
    # torch's loggers do not propagate to the root logger: listen on the logger itself
    logger = logging.getLogger(private._REDISTRIBUTE_LOGGER)
    records = _Records()
    logger.addHandler(records)
    try:
        with private.quiet_sequential_collective_warning():
            _torch_warns_sequential()
        assert not [m for m in records.messages if "suboptimal" in m]
        _torch_warns_sequential()  # outside: the user's own DTensor code still sees it
        assert [m for m in records.messages if "suboptimal" in m]
    finally:
        logger.removeHandler(records)


def test_gather_and_scatter_helpers_raise_no_future_warning():
    with sc.simulate(world_size=2) as sim:
        mesh = init_device_mesh("cpu", (2,))
        with sim.ranks(), warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            x = torch.arange(4.0)
            gathered = private.all_gather_along(x, 0, mesh, 0)
            scattered = private.reduce_scatter_along(gathered, "sum", 0, mesh, 0)
        assert sim.reconcile(gathered).shape == (8,)
        assert torch.equal(sim.reconcile(scattered), 2 * torch.arange(4.0))
