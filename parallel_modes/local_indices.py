"""Index-valued arguments numbered from 0 on each rank: ``DataParallel(input_index_of=...)``.

NOTE: [indices into the global batch]
A data-parallel mode reads each rank's tensor arguments as its share of ONE global batch:
rank r's ``x`` of ``n`` rows is rows ``r*n .. r*n+n-1`` of the global ``x``. An argument
whose values index the batch dimension of another split argument (a graph's
``edge_index`` into the node features, a ``batch`` vector of graph ids per node into the
labels, ``ptr`` offsets, token positions) therefore holds ids into the GLOBAL batch. A
torch-DDP script collates each rank's own graphs (DistributedSampler + PyG's collate), so
its ids start at 0 on every rank, and rank 1's ids pointed at rank 0's nodes and graphs:
a GNN trained 0.199 relative off eager on the global batch after 3 Adam steps on 2 gloo
ranks (losses 1.183 / 0.932 / 0.829 against 1.132 / 0.864 / 0.705), without a word
(sixty-first session). ``input_index_of={'ei': 'x', 'batch': 'y'}`` says the values of
``ei`` index the batch dimension of ``x``, numbered from 0 on each rank: on real ranks
the runtime feeds ``ei + rank * (x's local size along its batch dimension)`` (a new
tensor; the caller's is left as it is). Every rank passes shares of equal shapes (the
modes require it), so that offset is the global id exactly. In simulation the caller
passes the global batch, whose ids are global already: nothing is added. Values must lie
in ``[0, local size)``: a negative id (a padding ``-1``) would be moved as well.

Both names are argument paths as ``input_batch_dim`` spells them (``data.edge_index``,
``batch['ptr']``), each naming one tensor argument of the call. Refused: a name that
names no tensor argument, an index argument that is not of an integer dtype, and an
index or target argument the mode does not split (0-d, or ``input_batch_dim`` None):
an offset on a tensor every rank passes whole would make the ranks' copies differ.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from spmd_compiler.errors import SPMDCompileError

from .batch_dims import _spelled

IndexOf = Mapping[str, str]

_INTEGER = (torch.int32, torch.int64)  # the index dtypes of torch's index ops


def checked_index_of(index_of: IndexOf | None) -> dict[str, str]:
    """``index_of`` as a mode keeps it (names spelled as argument paths are); raises
    TypeError / ValueError on anything else."""
    if index_of is None:
        return {}
    if not isinstance(index_of, Mapping):
        raise TypeError(
            "input_index_of must be a dict from the name of an index argument to the name of "
            f"the argument whose batch dimension its values index, got {index_of!r}"
        )
    out: dict[str, str] = {}
    for name, target in index_of.items():
        if not isinstance(name, str) or not name or not isinstance(target, str) or not target:
            raise TypeError(f"input_index_of maps argument names to argument names, got {name!r}: {target!r}")
        spelled, aim = _spelled(name), _spelled(target)
        if spelled in out:
            raise ValueError(f"input_index_of names {spelled!r} twice (as {name!r} too)")
        if spelled == aim:
            raise ValueError(f"input_index_of[{name!r}] names the argument itself")
        out[spelled] = aim
    return out


def index_inputs(
    index_of: dict[str, str], names: Sequence[str], tensors: Sequence[torch.Tensor],
    placements: Sequence[Sequence[object]], where: str | None = None,
) -> list[tuple[int, int, int]]:
    """``(index argument, target argument, target's split dimension)`` positions among
    the call's tensor arguments for each entry of ``input_index_of`` (NOTE: [indices
    into the global batch]); ``names``, ``tensors``, ``placements``: the call's tensor
    arguments as ``input_batch_dim`` names them, and their placements.

    Raises:
        SPMDCompileError: a name names no tensor argument, an index argument is not of an
            integer dtype, or either argument is not split over the ranks.
    """
    position = {name: k for k, name in enumerate(names)}
    shown = ", ".join(names[:12]) + (f" and {len(names) - 12} more" if len(names) > 12 else "")
    out = []
    for name, target in index_of.items():
        for label in (name, target):
            if label not in position:
                raise SPMDCompileError(
                    f"input_index_of names {label!r} ({name!r}: {target!r}), but no tensor argument "
                    f"of this call is {label!r}. The tensor arguments, as input_batch_dim and "
                    f"input_index_of name them: {shown or 'none'}.",
                    user_line=where,
                    hint="name the index argument and the argument whose batch dimension it indexes "
                    "as the step reads them: input_index_of={'edge_index': 'x', 'batch': 'y'}.",
                )
        k, t = position[name], position[target]
        dtype = tensors[k].dtype
        if dtype not in _INTEGER:
            raise SPMDCompileError(
                f"input_index_of names {name!r} as holding ids into {target!r}, but {name!r} is a "
                f"{dtype} tensor: only an int64 or int32 tensor's values are ids (torch's index "
                "ops take those) that can be moved to the global batch.",
                user_line=where,
                hint=f"pass {name!r} as an integer tensor (torch.long), or leave it out of input_index_of.",
            )
        for label, j in ((name, k), (target, t)):
            split = [p for p in placements[j] if isinstance(p, Shard)]
            if not split or tensors[j].dim() == 0:
                raise SPMDCompileError(
                    f"input_index_of maps {name!r} to {target!r}, but the mode does not split "
                    f"{label!r} over the ranks (every rank passes it whole): ids numbered from 0 "
                    "on each rank are only meaningful between arguments each rank passes its "
                    "own share of.",
                    user_line=where,
                    hint=f"drop {name!r} from input_index_of, or give {label!r} its batch dimension "
                    f"in input_batch_dim instead of None.",
                )
        out.append((k, t, next(p.dim for p in placements[t] if isinstance(p, Shard))))
    return out


def global_ids(
    entries: list[tuple[int, int, int]], tensors: list[torch.Tensor], mesh: DeviceMesh
) -> list[torch.Tensor]:
    """``tensors`` with each index argument of ``entries`` moved from this rank's ids to
    the global batch's: plus rank * the target's local size along its batch dimension
    (NOTE: [indices into the global batch]). New tensors: the caller's are not written."""
    rank = mesh.get_local_rank(0) if mesh.ndim > 1 else mesh.get_local_rank()
    if rank == 0 or not entries:
        return tensors
    out = list(tensors)
    for k, t, dim in entries:
        out[k] = tensors[k] + rank * tensors[t].shape[dim]
    return out
