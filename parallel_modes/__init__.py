"""Parallel modes: how a captured train step is spread over a device mesh."""

from .base import ParallelMode
from .dtensor_expand import DTensorExpandMode

__all__ = ["DTensorExpandMode", "ParallelMode"]
