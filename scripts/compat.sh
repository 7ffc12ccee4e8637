#!/usr/bin/env bash
# Run the test suite against one torch release, in its own virtual environment.
#
#   scripts/compat.sh VERSION [TIER...]      e.g.  scripts/compat.sh 2.11.0 unit sim
#
# Builds (once) or reuses a venv outside the repository, ${SPMD_COMPAT_DIR:-~/.cache/spmd_compiler}/
# venv-torch-VERSION, with torch==VERSION and the test dependencies, installs this checkout
# into it (editable, no deps) and runs tests/<tier> for each tier (default: unit sim dist),
# printing passed / failed / errors / skipped / xfailed per tier. Exits non-zero if any test
# failed. Tests are selected with `-m "$COMPAT_MARKERS"` (default "not slow", as `make test`;
# COMPAT_MARKERS= runs everything). The `models` tier installs transformers into the venv.
# Each tier's pytest log and junit report stay in $SPMD_COMPAT_DIR/reports-torch-VERSION/.
#
# torch==VERSION comes from pip's configured index; set TORCH_INDEX_URL to use another one
# (e.g. https://download.pytorch.org/whl/cpu for a CPU-only build). Releases without a CPU
# build on the default index download a multi-gigabyte CUDA build: do it once per machine,
# never in CI (CI stays on one version).
set -euo pipefail
if [ $# -lt 1 ]; then
  sed -n '2,17p' "$0"
  exit 2
fi
VERSION=$1
shift
TIERS=("$@")
[ ${#TIERS[@]} -gt 0 ] || TIERS=(unit sim dist)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${SPMD_COMPAT_DIR:-$HOME/.cache/spmd_compiler}/venv-torch-$VERSION
PY=${PYTHON:-python3}

has_version() {
  "$VENV/bin/python" - "$VERSION" <<'PYEOF' 2>/dev/null
import sys
import torch
sys.exit(0 if torch.__version__.split("+")[0] == sys.argv[1] else 1)
PYEOF
}

if [ ! -x "$VENV/bin/python" ] || ! has_version; then
  echo "compat: building $VENV (torch==$VERSION)"
  "$PY" -m venv "$VENV"
  INDEX=()
  [ -z "${TORCH_INDEX_URL:-}" ] || INDEX=(--index-url "$TORCH_INDEX_URL" --extra-index-url https://pypi.org/simple)
  "$VENV/bin/pip" install --quiet --disable-pip-version-check "${INDEX[@]}" "torch==$VERSION"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check numpy networkx pytest hypothesis tqdm
fi
for tier in "${TIERS[@]}"; do
  if [ "${tier%%/*}" = models ] && ! "$VENV/bin/python" -c "import transformers" 2>/dev/null; then
    "$VENV/bin/pip" install --quiet --disable-pip-version-check transformers
  fi
done
"$VENV/bin/pip" install --quiet --disable-pip-version-check --no-deps -e "$ROOT"

cd "$ROOT"
REPORTS=${SPMD_COMPAT_DIR:-$HOME/.cache/spmd_compiler}/reports-torch-$VERSION
mkdir -p "$REPORTS"
MARKERS=${COMPAT_MARKERS-not slow}
PYTEST_ARGS=()
[ -z "$MARKERS" ] || PYTEST_ARGS=(-m "$MARKERS")
status=0
for tier in "${TIERS[@]}"; do
  name=${tier//\//_}
  rm -f "$REPORTS/$name.xml"
  nice -n "${COMPAT_NICE:-10}" "$VENV/bin/python" -m pytest "tests/$tier" -p no:cacheprovider \
    "${PYTEST_ARGS[@]}" --junitxml="$REPORTS/$name.xml" >"$REPORTS/$name.log" 2>&1 || status=1
  echo "compat: tests/$tier done ($(tail -n 1 "$REPORTS/$name.log"))"
done
"$VENV/bin/python" - "$REPORTS" "$VERSION" "${TIERS[@]}" <<'PYEOF'
import sys
import xml.etree.ElementTree as ET

import torch

reports, version, tiers = sys.argv[1], sys.argv[2], sys.argv[3:]
print(f"torch {torch.__version__} (asked {version})")
print(f"{'tier':28} {'passed':>7} {'failed':>7} {'errors':>7} {'skipped':>8} {'xfailed':>8}")
for tier in tiers:
    try:
        suite = ET.parse(f"{reports}/{tier.replace('/', '_')}.xml").getroot()
    except (OSError, ET.ParseError):
        print(f"{tier:28} no report (see the pytest output)")
        continue
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    total, failed, errors, skipped = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
    # junit reports an xfail as a skip of type pytest.xfail
    xfailed = sum(1 for s in suite.iter("skipped") if s.get("type") == "pytest.xfail")
    passed = total - failed - errors - skipped
    print(f"{tier:28} {passed:7} {failed:7} {errors:7} {skipped - xfailed:8} {xfailed:8}")
PYEOF
if [ $status -ne 0 ]; then
  for tier in "${TIERS[@]}"; do
    grep -E "^(FAILED|ERROR) " "$REPORTS/${tier//\//_}.log" || true
  done
fi
exit $status
