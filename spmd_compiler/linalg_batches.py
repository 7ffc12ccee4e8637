"""Which dimensions of a batched linear-algebra op's tensors are batch dimensions.

NOTE: [linalg batch dimensions]
DTensor's rule for the batched linear-algebra kernels (torch 2.13's
``linalg_batch_dim_strategy``: ``linalg_solve_triangular``, ``cholesky_solve``,
``linalg_lu_solve``, ``_linalg_solve_ex``, ``_linalg_det``, ...) shards every tensor of
the op on the same dimension number, counted on the first argument, and for
``linalg_solve_triangular`` also offers "result Shard(d), A Replicate, B Shard(d)", meant
for a matrix shared by the batch. Both are wrong where the operands' batch dimensions
differ: the batch dimensions of a linalg op broadcast from the right, and each operand
has its own number of matrix (2) or vector (1) dimensions at the end. With A per sample
(B, D, D), as ``MultivariateNormal(mu, scale_tril=L).log_prob`` has when L is predicted
for each sample, the replicated-A layout ran each rank's half of the batch of right-hand
sides against the whole batch of matrices: under ddp and fsdp the step was refused
("Attempting to broadcast a dimension of length 8", with advice about input_batch_dim
that did not apply), and where a rank's share is one sample it would have broadcast
instead. A shared B (D, 1) against a per-sample A was given B's matrix rows as its
"batch" dimension.

So for these ops the layouts that shard are ours (``batch_shard_rows``): per aligned
batch dimension k of the broadcast batch shape, every tensor that has dimension k at its
full size is sharded on it and every tensor that broadcasts along it (has none, or size
1) is replicated. Outputs follow the broadcast batch shape, except ``_linalg_solve_ex``'s
LU, pivots and info (A's own) and ``lu_unpack``'s outputs it was told not to compute
(empty, replicated). torch's other layouts (replicated, and the ``Partial`` ones of the
ops linear in their right-hand side) are kept. Installed by ``_torch_private``
(``_install_linalg_batch_rows``); tested by tests/sim/test_linalg_batches.py and
tests/unit/test_linalg_batch_rows.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# op -> (number of trailing non-batch dims of each output, of each tensor input), in the
# order of DTensor's single-dim strategy rows (outputs first). None: the right-hand side
# of ``_linalg_solve_ex``, a vector (1) or a matrix (2) as torch decides.
_CORE_DIMS: dict[str, tuple[tuple[int | None, ...], tuple[int | None, ...]]] = {
    "aten.cholesky.default": ((2,), (2,)),
    "aten.cholesky_inverse.default": ((2,), (2,)),
    "aten.linalg_matrix_exp.default": ((2,), (2,)),
    "aten.cholesky_solve.default": ((2,), (2, 2)),  # (B, L)
    "aten.linalg_householder_product.default": ((2,), (2, 1)),  # (A, tau)
    "aten.linalg_solve_triangular.default": ((2,), (2, 2)),  # (A, B)
    "aten.linalg_ldl_solve.default": ((2,), (2, 1, 2)),  # (LD, pivots, B)
    "aten.linalg_lu_solve.default": ((2,), (2, 1, 2)),  # (LU, pivots, B)
    "aten.ormqr.default": ((2,), (2, 1, 2)),  # (A, tau, C)
    "aten.geqrf.default": ((2, 1), (2,)),
    "aten.linalg_cholesky_ex.default": ((2, 0), (2,)),
    "aten.linalg_eig.default": ((1, 2), (2,)),
    "aten.linalg_inv_ex.default": ((2, 0), (2,)),
    "aten.triangular_solve.default": ((2, 2), (2, 2)),  # (B, A) -> (X, A broadcast)
    "aten._linalg_det.default": ((0, 2, 1), (2,)),
    "aten.linalg_ldl_factor_ex.default": ((2, 1, 0), (2,)),
    "aten.linalg_lu.default": ((2, 2, 2), (2,)),
    "aten.linalg_lu_factor_ex.default": ((2, 1, 0), (2,)),
    "aten.lu_unpack.default": ((2, 2, 2), (2, 1)),
    "aten._linalg_slogdet.default": ((0, 0, 2, 1), (2,)),
    "aten._linalg_solve_ex.default": ((None, 2, 1, 0), (2, None)),  # (A, B)
    "aten._linalg_check_errors.default": ((), (0,)),
}
# outputs whose batch shape is one input's own, not the broadcast one: output -> input
_OWN_BATCH = {"aten._linalg_solve_ex.default": {1: 0, 2: 0, 3: 0}}


def knows(op_name: str) -> bool:
    """Whether ``batch_shard_rows`` answers for the op (``str(op)``: ``aten.cholesky.default``)."""
    return op_name in _CORE_DIMS


def batch_shard_rows(
    op_name: str, shapes: Sequence[Sequence[int]], skipped_outputs: Sequence[int] = ()
) -> list[list[int | None]] | None:
    """Every layout that shards a batch dimension, one row per broadcast batch dimension.

    Args:
        op_name: ``str(op)`` of an op ``knows`` answers for.
        shapes: the shapes of its tensor inputs, in order.
        skipped_outputs: outputs the op leaves empty (``lu_unpack`` told not to unpack).

    Returns:
        Rows over the outputs then the inputs: the dimension each tensor is sharded on,
        or None where it is replicated (NOTE: [linalg batch dimensions]); None where the
        op is not known or its inputs are not what it takes.
    """
    if op_name not in _CORE_DIMS:
        return None
    output_cores, input_cores = _CORE_DIMS[op_name]
    if len(shapes) != len(input_cores):
        return None
    rhs_core = _solve_rhs_core(shapes) if op_name == "aten._linalg_solve_ex.default" else 2
    inputs = [_batch(shape, rhs_core if core is None else core) for shape, core in zip(shapes, input_cores)]
    if any(b is None for b in inputs):
        return None
    batches = [b for b in inputs if b is not None]
    try:
        broadcast = tuple(torch.broadcast_shapes(*[torch.Size(b) for b in batches]))
    except RuntimeError:
        return None
    own = _OWN_BATCH.get(op_name, {})
    outputs: list[tuple[int, ...] | None] = [
        None if i in skipped_outputs else batches[own[i]] if i in own else broadcast
        for i in range(len(output_cores))
    ]
    rows = []
    for k in range(len(broadcast)):
        row = [_dim_at(batch, k, broadcast) for batch in [*outputs, *batches]]
        rows.append(row)
    return rows


def _solve_rhs_core(shapes: Sequence[Sequence[int]]) -> int:
    """1 where ``linalg.solve`` reads B as a (batch of) vector(s), else 2 (torch's
    ``linalg_solve_is_vector_rhs``)."""
    a, b = shapes
    return 1 if len(b) == 1 or (len(a) - 1 == len(b) and tuple(b) == tuple(a[:-1])) else 2


def _batch(shape: Sequence[int], core: int) -> tuple[int, ...] | None:
    return tuple(shape[: len(shape) - core]) if len(shape) >= core else None


def _dim_at(batch: tuple[int, ...] | None, k: int, broadcast: tuple[int, ...]) -> int | None:
    """The dimension of a tensor with batch shape ``batch`` aligned with broadcast batch
    dimension ``k``, where it has it at full size; None where it broadcasts (replicated)."""
    if batch is None:
        return None
    d = k - (len(broadcast) - len(batch))
    return d if d >= 0 and batch[d] == broadcast[k] else None
