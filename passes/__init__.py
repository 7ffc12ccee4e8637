"""Graph passes over the per-rank program, and the API pass authors use.

The default pipeline, in order (see NOTE: [pass contract] in ``manager.py``):
"""

from . import remove_dead_nodes as _remove_dead_nodes  # noqa: F401  (registers the pass)
from .manager import (
    Pass,
    PassContext,
    PassFailure,
    PassOptions,
    register_pass,
    registered_passes,
    run_pipeline,
)

DEFAULT_PIPELINE: tuple[str, ...] = ("remove_dead_nodes",)

__all__ = [
    "DEFAULT_PIPELINE",
    "Pass",
    "PassContext",
    "PassFailure",
    "PassOptions",
    "register_pass",
    "registered_passes",
    "run_pipeline",
]
