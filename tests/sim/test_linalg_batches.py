"""Per-sample batched matrices (B, D, D) through linalg ops under ddp and fsdp, float64,
3 steps against one device (NOTE: [linalg batch dimensions]).

``MultivariateNormal(mu, scale_tril=L).log_prob`` with L predicted per sample, and a bare
``torch.linalg.solve_triangular(L, r)``, were refused under ddp and fsdp at 2 and 4 ranks
("Attempting to broadcast a dimension of length 8 at -1", op
``aten.linalg_solve_triangular.default``): torch's rule offered a replicated L against a
sharded r, valid only for an L shared by the batch.

Survey (sixty-seventh session, torch 2.13, 33 cases; ddp and fsdp,
worlds 2 and 4, float64, 3 SGD steps on a loss of the mean square of the op's output;
worst relative difference of the returned losses and the parameters against eager;
"refused": the error above, at every one of the 4 configurations):

================================================  ========  ========
case (M, v predicted per sample, D = 3)           before    after
================================================  ========  ========
linalg.solve_triangular left lower / right upper  refused   5.6e-17
solve_triangular, B (D, 2) shared by the batch    refused   5.6e-17
solve_triangular, B (2, batch, D, 1)              refused   2.2e-16
MVN(scale_tril) log_prob, log_prob(rsample((2,))) refused   2.0e-16
MVN(precision_matrix) log_prob                    refused   4.8e-16
triangular_solve, cholesky, cholesky_solve,       1.1e-14   1.1e-14
cholesky_inverse, linalg.solve (vector, matrix,
shared A), inv, det, slogdet, logdet, lu_factor +
lu_solve, eigh, qr, svdvals, matrix_exp
MVN(scale_tril) rsample / entropy,                2.1e-16   2.1e-16
MVN(covariance_matrix) log_prob / rsample /
entropy, MVN(precision_matrix) rsample / entropy,
LowRankMVN log_prob / entropy, Wishart log_prob
================================================  ========  ========

(1.1e-14: det, whose squared value grows large; every other case is under 1e-15.) No
case gave a silent wrong result, before or after. eigh, qr, svd, tril and triu have only
DTensor's replicated rule: their per-sample matrices are gathered (exact, not scaled).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributions as D
import torch.nn as nn

from spmd_compiler.parallel_modes import make_mode
from spmd_compiler.tools.demo.steps import squared_output_train_step

TOLERANCE = 1e-12
DIM = 3


def _lower(m: torch.Tensor) -> torch.Tensor:
    return torch.tril(m, -1) + 1.5 * torch.eye(DIM, dtype=m.dtype)


def _positive_definite(m: torch.Tensor) -> torch.Tensor:
    return m @ m.mT + DIM * torch.eye(DIM, dtype=m.dtype)


CASES = {
    # refused before (torch's replicated-A layout against a sharded B)
    "solve_triangular": lambda m, v: torch.linalg.solve_triangular(_lower(m), v[..., None], upper=False),
    "solve_triangular_right_upper": lambda m, v: torch.linalg.solve_triangular(
        _lower(m).mT, v[:, None, :], upper=True, left=False
    ),
    "solve_triangular_shared_rhs": lambda m, v: torch.linalg.solve_triangular(
        _lower(m), torch.ones(DIM, 2, dtype=m.dtype), upper=False
    ) * v[..., None],
    "solve_triangular_rhs_with_more_dims": lambda m, v: torch.linalg.solve_triangular(
        _lower(m), torch.stack([v, 2 * v])[..., None], upper=False
    ),
    "mvn_scale_tril_log_prob": lambda m, v: D.MultivariateNormal(v, scale_tril=_lower(m)).log_prob(
        torch.ones(DIM, dtype=m.dtype)
    ),
    "mvn_precision_log_prob": lambda m, v: D.MultivariateNormal(
        v, precision_matrix=_positive_definite(m)
    ).log_prob(torch.ones(DIM, dtype=m.dtype)),
    # exact before too: kept so
    "mvn_covariance_log_prob": lambda m, v: D.MultivariateNormal(
        v, covariance_matrix=_positive_definite(m)
    ).log_prob(torch.ones(DIM, dtype=m.dtype)),
    "cholesky_solve": lambda m, v: torch.cholesky_solve(v[..., None], torch.linalg.cholesky(_positive_definite(m))),
    "solve_vector": lambda m, v: torch.linalg.solve(_positive_definite(m), v),
    "lu_factor_solve": lambda m, v: torch.linalg.lu_solve(*torch.linalg.lu_factor(_positive_definite(m)), v[..., None]),
    "slogdet": lambda m, v: torch.linalg.slogdet(_positive_definite(m)).logabsdet,
}


class _PerSample(nn.Module):
    """Predicts a (D, D) matrix and a D-vector for each sample."""

    def __init__(self, case: str) -> None:
        super().__init__()
        self.case = case
        self.matrix = nn.Linear(5, DIM * DIM, dtype=torch.float64)
        self.vector = nn.Linear(5, DIM, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return CASES[self.case](self.matrix(x).view(-1, DIM, DIM), self.vector(x))


def _batches(batch_size: int) -> list[tuple[torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(batch_size, 5, generator=gen, dtype=torch.float64),) for _ in range(3)]


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.parametrize("case", list(CASES))
def test_per_sample_matrices_match_eager(run_parity, case, mode):
    result = run_parity(
        lambda: _PerSample(case), lambda m: torch.optim.SGD(m.parameters(), lr=1e-2),
        2, _batches(8), step=squared_output_train_step, mode=make_mode(mode),
    )
    result.assert_close(TOLERANCE)


@pytest.mark.parametrize("world_size", [4])
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_multivariate_normal_at_four_ranks(run_parity, mode, world_size):
    result = run_parity(
        lambda: _PerSample("mvn_scale_tril_log_prob"), lambda m: torch.optim.SGD(m.parameters(), lr=1e-2),
        world_size, _batches(8), step=squared_output_train_step, mode=make_mode(mode),
    )
    result.assert_close(TOLERANCE)


def test_one_sample_per_rank(run_parity):
    """A local batch of 1: torch's replicated L against a sharded r broadcast there, and
    was refused by the local shape check ("computed this op's local result with shape
    (2, 3, 1), where its placement [S(0)] ... means (1, 3, 1)")."""
    result = run_parity(
        lambda: _PerSample("solve_triangular"), lambda m: torch.optim.SGD(m.parameters(), lr=1e-2),
        2, _batches(2), step=squared_output_train_step, mode=make_mode("ddp"),
    )
    result.assert_close(TOLERANCE)
