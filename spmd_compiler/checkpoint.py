"""``spmd_compiler.checkpoint``: save, load and export the state of compiled training.

The public names of ``spmd_compiler/runtime/checkpoint.py`` (where they are defined and
documented, NOTE: [checkpoint layout]) under the path the README gives, so that
``from spmd_compiler.checkpoint import full_state_dict`` works as ``sc.checkpoint`` does.
"""

from __future__ import annotations

from .runtime.checkpoint import CheckpointError, full_state_dict, load, save

__all__ = ["CheckpointError", "full_state_dict", "load", "save"]
