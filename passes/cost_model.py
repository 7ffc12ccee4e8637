"""A simple cost model passes use to decide (bucket sizes, what to overlap).

The time of one collective is ``alpha + bytes / beta``: a fixed launch and synchronization
latency plus the payload over a bandwidth. Bytes follow the convention of
``spmd_compiler.ir.collectives`` (all_reduce: tensor bytes; all_gather: gathered output;
reduce_scatter: full input). The defaults are of the right order for one GPU node;
``benchmarks/cpu_suite.calibrate_collectives`` measures alpha and beta on the machine it
runs on (the benchmark timelines use that), and ``PassOptions(cost_model=...)`` gives a
compile calibrated constants. Passes take them from ``context.cost_model`` and never
hard-code them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx

from spmd_compiler.ir.collectives import collective_kind, payload_bytes


@dataclass(frozen=True)
class CostModel:
    """Alpha-beta cost of collectives.

    Args:
        alpha_seconds: fixed cost of one collective (launch and synchronization).
        beta_bytes_per_second: bandwidth of the payload.
    """

    alpha_seconds: float = 20e-6
    beta_bytes_per_second: float = 10e9

    def collective_bytes(self, node: torch.fx.Node) -> int:
        """Payload bytes of a collective node (0 for any other node)."""
        if collective_kind(node) is None:
            return 0
        return payload_bytes(node)

    def seconds_for_bytes(self, nbytes: int) -> float:
        """Estimated time of one collective moving ``nbytes``."""
        return self.alpha_seconds + nbytes / self.beta_bytes_per_second

    def collective_seconds(self, node: torch.fx.Node) -> float:
        """Estimated time of a collective node (0 for any other node)."""
        if collective_kind(node) is None:
            return 0.0
        return self.seconds_for_bytes(self.collective_bytes(node))
