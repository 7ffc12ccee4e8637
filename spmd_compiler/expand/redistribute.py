"""Redistribute a DTensor, eagerly or inside a traced program, with our fixes applied.

Eager redistribution is DTensor's own. Traced redistribution (what the expander emits)
runs under ``compile_on_one_rank`` with the shard-to-shard and strided-shard fixes of
``_torch_private`` (NOTE: [one program for every rank] in expand/retrace.py), so the property
tests exercise exactly the code path compiled programs use.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement
from torch.fx.experimental.proxy_tensor import make_fx

from .. import _torch_private as private
from ..ir.signature import contiguous_stride


def redistribute(tensor: DTensor, placements: Sequence[Placement]) -> DTensor:
    """``tensor`` with ``placements`` on its mesh (eager)."""
    return tensor.redistribute(tensor.device_mesh, tuple(placements))


def traced_redistribution(
    mesh: DeviceMesh,
    shape: Sequence[int],
    dtype: torch.dtype,
    source: Sequence[Placement],
    target: Sequence[Placement],
    local_shape: Sequence[int],
) -> torch.fx.GraphModule:
    """The per-rank program that takes a local shard in ``source`` layout to ``target``.

    ``local_shape`` is the (rank-independent) local shape of the source shard.
    """
    size, stride = torch.Size(shape), contiguous_stride(shape)

    def program(local: torch.Tensor) -> torch.Tensor:
        dt = DTensor.from_local(local, mesh, tuple(source), run_check=False, shape=size, stride=stride)
        with private.memoized_redistribution():
            out = dt.redistribute(mesh, tuple(target))
        return private.local_tensor_of(out)

    with private.fake_tensor_mode(with_shape_env=True):
        fake = torch.empty(tuple(local_shape), dtype=dtype)
    with private.compile_on_one_rank():
        gm = make_fx(program, tracing_mode="fake")(fake)
    private.lift_group_names(gm, mesh)
    return gm
