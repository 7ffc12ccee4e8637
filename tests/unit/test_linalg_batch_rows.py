"""The batch dimensions of batched linalg ops' operands (NOTE: [linalg batch dimensions]):
aligned from the right, each operand's own matrix / vector dimensions left out."""

from __future__ import annotations

import pytest

from spmd_compiler.linalg_batches import batch_shard_rows, knows

SOLVE_TRIANGULAR = "aten.linalg_solve_triangular.default"
SOLVE_EX = "aten._linalg_solve_ex.default"


@pytest.mark.parametrize(
    ("shapes", "rows"),
    [
        # rows over (result, A, B): the dim each is sharded on, None where replicated
        (((8, 3, 3), (8, 3, 1)), [[0, 0, 0]]),
        # a shared A: replicated (torch's own "A Replicate, B Shard" case)
        (((3, 3), (8, 3, 1)), [[0, None, 0]]),
        # a shared B: its dim 0 is a matrix row, not the batch (torch sharded it)
        (((8, 3, 3), (3, 1)), [[0, 0, None]]),
        # B with a leading sample dim: A's batch is B's dim 1
        (((8, 3, 3), (2, 8, 3, 1)), [[0, None, 0], [1, 0, 1]]),
        # a size-1 batch dim broadcasts: replicated along the other's dimension
        (((8, 1, 3, 3), (5, 3, 1)), [[0, 0, None], [1, None, 0]]),
        # no batch dimensions: nothing to shard
        (((3, 3), (3, 1)), []),
    ],
)
def test_solve_triangular_batch_rows(shapes, rows):
    assert batch_shard_rows(SOLVE_TRIANGULAR, shapes) == rows


def test_solve_with_a_batch_of_vectors():
    # (result, LU, pivots, info, A, B): B (8, 3) is a batch of vectors against A (8, 3, 3)
    assert batch_shard_rows(SOLVE_EX, [(8, 3, 3), (8, 3)]) == [[0, 0, 0, 0, 0, 0]]


def test_solve_with_a_shared_matrix_keeps_its_factorization_replicated():
    # LU, pivots and info are A's own (3, 3) factorization, not the broadcast batch's
    assert batch_shard_rows(SOLVE_EX, [(3, 3), (8, 3, 2)]) == [[0, None, None, None, None, 0]]


def test_determinant_outputs_follow_the_batch():
    # (det, LU, pivots, A)
    assert batch_shard_rows("aten._linalg_det.default", [(4, 8, 3, 3)]) == [[0, 0, 0, 0], [1, 1, 1, 1]]


def test_lu_unpack_outputs_left_empty_are_replicated():
    # (P, L, U, LU, pivots); unpack_data=False leaves L and U empty
    rows = batch_shard_rows("aten.lu_unpack.default", [(8, 3, 3), (8, 3)], skipped_outputs=[1, 2])
    assert rows == [[0, None, None, 0, 0]]


def test_unknown_ops_and_inputs_are_not_answered():
    assert not knows("aten.mm.default")
    assert batch_shard_rows("aten.mm.default", [(3, 3), (3, 3)]) is None
    assert batch_shard_rows(SOLVE_TRIANGULAR, [(8, 3, 3)]) is None  # one input of two
    assert batch_shard_rows(SOLVE_TRIANGULAR, [(8, 3, 3), (5, 3, 1)]) is None  # no broadcast
