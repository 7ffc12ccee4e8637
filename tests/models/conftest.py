"""The model-zoo tier: transformers models in small random-init configs.

Needs the ``models`` extra (``pip install -e .[models]``, i.e. transformers); skipped
without it. Cases marked ``slow`` run only with ``SPMD_SLOW_TESTS=1``:

    SPMD_SLOW_TESTS=1 python -m pytest tests/models
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("transformers")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("SPMD_SLOW_TESTS") == "1":
        return
    skip = pytest.mark.skip(reason="slow model-zoo case; run with SPMD_SLOW_TESTS=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
