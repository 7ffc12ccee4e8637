"""The typed contract of ``ParallelMode.placement_at_use``: what one use of a value needs.

A mode's hook ``(consumer, arg) -> [UseStep, ...] | None`` says how ``arg`` must look
where ``consumer`` reads it; ``expand`` applies the steps in order. One redistribution
is traced per (value, ``UseStep.key``), at the first use with that key; later uses with
the same key reuse it (FSDP gathers a parameter once for all of forward's uses).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch.fx
from torch.distributed.tensor import DTensor, Placement


class UseGroup(enum.Enum):
    """Which uses of one value share a redistribution."""

    COMPUTE = "compute"  # every use outside the optimizer
    FORWARD = "forward"  # forward's uses (gathered again in backward)
    BACKWARD = "backward"  # backward's uses
    REDUCE = "reduce"  # a gradient on its way into the optimizer
    MODULE_OUTPUT = "out of"  # an activation leaving ``UseStep.module``
    MODULE_INPUT = "into"  # an activation entering ``UseStep.module``


_MODULE_GROUPS = (UseGroup.MODULE_OUTPUT, UseGroup.MODULE_INPUT)


@dataclass(frozen=True)
class UseStep:
    """One redistribution a use needs: to ``placements``, or by the mode's ``redistribute``.

    Args:
        group: the uses that share this redistribution.
        placements: one per mesh dimension; None keeps the value's current placement
            on that dimension.
        redistribute: the mode's own collective, ``DTensor -> DTensor`` (instead of
            ``placements``).
        module: the module FQN of a ``MODULE_OUTPUT`` / ``MODULE_INPUT`` step.
    """

    group: UseGroup
    placements: tuple[Placement | None, ...] | None = None
    redistribute: Callable[[DTensor], DTensor] | None = None
    module: str = ""

    def __post_init__(self) -> None:
        if (self.placements is None) == (self.redistribute is None):
            raise ValueError("a UseStep takes either placements or redistribute, not both or neither")
        if self.placements is not None:
            object.__setattr__(self, "placements", tuple(self.placements))
        if (self.group in _MODULE_GROUPS) != bool(self.module):
            raise ValueError(f"UseStep group {self.group.name} {'needs' if self.module == '' else 'takes no'} module")

    @property
    def key(self) -> tuple[UseGroup, str]:
        """Uses whose steps have one key share one redistribution."""
        return self.group, self.module

    def __str__(self) -> str:
        return f"{self.group.value} {self.module}" if self.module else self.group.value


# (consumer, arg) -> the steps ``arg`` goes through where ``consumer`` reads it; None or
# an empty sequence: read it as it is
UseHook = Callable[[torch.fx.Node, torch.fx.Node], "Sequence[UseStep] | None"]
