#!/usr/bin/env bash
# Install spmd_compiler and its test dependencies into the current Python.
# Keeps an existing supported torch (2.11 to 2.14, e.g. a CUDA build on a GPU machine); otherwise installs
# the CPU build (torch==2.13.0) on machines without an NVIDIA driver, so that pip never
# pulls the multi-gigabyte CUDA wheels onto a CPU-only machine.
set -euo pipefail
PY=${PYTHON:-python3}
cd "$(dirname "$0")/.."

has_torch() {
  "$PY" - <<'PYEOF' 2>/dev/null
import sys
import torch
major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
sys.exit(0 if (2, 11) <= (major, minor) < (2, 15) else 1)
PYEOF
}

if ! has_torch; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    "$PY" -m pip install --quiet "torch>=2.13,<2.15"
  else
    "$PY" -m pip install --quiet "torch==2.13.0"
  fi
fi
# Always (re)install: an editable install made from another checkout would shadow this one.
"$PY" -m pip install --quiet --disable-pip-version-check -e ".[test]"
