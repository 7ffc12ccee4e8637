#!/usr/bin/env bash
# Install spmd_compiler and its test dependencies.
#
# By default (what `make demo` / `make test` do) everything goes into a virtual environment
# of its own, $VENV (default .venv, ignored by git), created here with the base interpreter
# $BASE_PYTHON (default python3): nothing installed by hand on the machine can then hide a
# missing dependency. With PYTHON=/path/to/python set, that interpreter is used as it is
# (e.g. a GPU image whose torch cannot be replaced).
#
# torch: an existing torch in the supported range (2.11 to 2.14) is kept, e.g. a CUDA build
# on a GPU machine; otherwise machines without an NVIDIA driver get the CPU build
# torch==2.13.0, so pip never pulls the multi-gigabyte CUDA wheels onto a CPU-only machine.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
BASE_PYTHON=${BASE_PYTHON:-python3}
PY=${PYTHON:-$VENV/bin/python}

say() { echo "setup: $*"; }

if [ ! -x "$PY" ]; then
  if [ -n "${PYTHON:-}" ]; then
    echo "setup: PYTHON=$PYTHON is not an executable interpreter" >&2
    exit 2
  fi
  say "[1/3] creating the virtual environment $VENV with $BASE_PYTHON"
  "$BASE_PYTHON" -m venv "$VENV"
else
  say "[1/3] using $PY"
fi

has_supported_torch() {
  "$PY" - <<'PYEOF' 2>/dev/null
import sys
import torch
major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
sys.exit(0 if (2, 11) <= (major, minor) < (2, 15) else 1)
PYEOF
}

if has_supported_torch; then
  say "[2/3] keeping torch $("$PY" -c 'import torch; print(torch.__version__)')"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
  say "[2/3] installing a CUDA build of torch (several GB; pip shows its progress)"
  "$PY" -m pip install --disable-pip-version-check "torch>=2.11,<2.15"
else
  say "[2/3] installing the CPU build torch==2.13.0"
  "$PY" -m pip install --disable-pip-version-check "torch==2.13.0"
fi
# Always (re)install: an editable install made from another checkout would shadow this one.
say "[3/3] installing spmd_compiler (editable) with its test extras"
"$PY" -m pip install --disable-pip-version-check --progress-bar off -e ".[test]" \
  | grep -v -E "^(Requirement already satisfied|  Using cached|WARNING: Location)" || true
"$PY" -c "import spmd_compiler, torch, numpy; print('setup: done,', 'torch', torch.__version__)"
