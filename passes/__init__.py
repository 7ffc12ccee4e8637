"""Graph passes over the per-rank program, and the API pass authors use.

The default pipeline is ``DEFAULT_PIPELINE`` below: one ordered list, the table of
contents of what runs after expansion (the manager may move a pass to honor its
``after``/``before``; see NOTE: [pass contract] in ``manager.py``). Third-party passes
register through the entry-point group ``spmd_compiler.passes`` and run when named in
``extra_passes``. ``describe_pipeline(options)`` returns the list as text; ``docs/writing_passes.md``
shows how to write one.
"""

from spmd_compiler.ir.collectives import collective_kind

from . import bucket_collectives as _bucket_collectives  # noqa: F401  (registers the pass)
from . import cross_iteration_overlap as _cross_iteration  # noqa: F401  (registers, off by default)
from . import fuse_optimizer_updates as _fuse_optimizer_updates  # noqa: F401  (registers)
from . import merge_regathers as _merge_regathers  # noqa: F401  (registers the pass)
from . import remove_dead_nodes as _remove_dead_nodes  # noqa: F401  (registers the pass)
from . import remove_duplicate_collectives as _remove_duplicate  # noqa: F401  (registers)
from . import remove_noop_reshapes as _remove_noop_reshapes  # noqa: F401  (registers)
from . import schedule_overlap as _schedule_overlap  # noqa: F401  (registers the pass)
from .bucket_collectives import BucketOptions
from .checks import (
    Check,
    check_program,
    collective_signature,
    is_collective,
    is_wait,
    no_dead_nodes,
    short_op_name,
)
from .cost_model import CostModel
from .cross_iteration_overlap import CrossIterationOptions
from .manager import (
    BoundPass,
    PassContext,
    PassFailure,
    PassOptions,
    build_pipeline,
    describe_pipeline,
    run_pipeline,
)
from .registry import (
    ENTRY_POINT_GROUP,
    Pass,
    PipelineError,
    load_plugins,
    register_pass,
    registered_passes,
)
from .schedule_overlap import OverlapOptions

DEFAULT_PIPELINE: tuple[str, ...] = (
    "remove_dead_nodes",
    "remove_noop_reshapes",
    "remove_duplicate_collectives",
    "fuse_optimizer_updates",
    "bucket_collectives",
    "merge_regathers",
    "schedule_overlap",
)

__all__ = [
    "DEFAULT_PIPELINE",
    "BucketOptions",
    "CrossIterationOptions",
    "OverlapOptions",
    "ENTRY_POINT_GROUP",
    "BoundPass",
    "Check",
    "CostModel",
    "Pass",
    "PassContext",
    "PassFailure",
    "PassOptions",
    "PipelineError",
    "build_pipeline",
    "check_program",
    "collective_kind",
    "collective_signature",
    "describe_pipeline",
    "is_collective",
    "is_wait",
    "load_plugins",
    "no_dead_nodes",
    "register_pass",
    "registered_passes",
    "run_pipeline",
    "short_op_name",
]
