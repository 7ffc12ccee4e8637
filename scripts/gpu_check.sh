#!/usr/bin/env bash
# The GPU checks of one lent device call, in priority order, each bounded by what is left.
#
#   OUT=/some/dir scripts/gpu_check.sh [BUDGET_S]      (default budget 560 s)
#
# Installs this checkout (editable, no deps: the GPU machine's torch stays), runs tests/gpu,
# then `python -m benchmarks.lowering --device cuda` one model at a time and
# `benchmarks.gpu_profile` (the list is below), starting each only while enough of the
# budget is left for it. Everything lands in $OUT as it is made (log.txt, gpu_tests.xml,
# lowering_<model>.json, profile_<model>.json; the device tool returns at most 8 files),
# so a call cut off at its limit still returns what finished.
# GPU_CHECK_TESTS=0 skips tests/gpu; GPU_CHECK_RUNS="kind:model:seconds[:runs] ..." picks
# the runs; GPU_CHECK_LOWERING_RUNS="run,run" is the lowering benchmark's --runs wherever a
# spec names none.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-check}
BUDGET=${1:-560}
mkdir -p "$OUT"
START=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - START))); }
exec > >(tee "$OUT/log.txt") 2>&1
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
$PY -m pip install -q --no-deps --no-build-isolation --no-index -e . || exit 1

if [ "${GPU_CHECK_TESTS:-1}" != 0 ]; then
  echo "== tests/gpu ($(left) s left)"
  timeout 200 $PY -m pytest tests/gpu -q -rA -p no:cacheprovider -n 7 \
    --junitxml="$OUT/gpu_tests.xml"
  echo "tests/gpu rc=$? at $(( $(date +%s) - START )) s"
fi

# what to run after the tests, in order, as KIND:MODEL:SECONDS[:RUNS] (the seconds a run
# needs, estimated from the H200 calls of 2026-11-27: on gpt-8x512 each compiled Inductor
# run costs ~90 s of compile (capture ~17, lowering ~74), torch.compile ~30 s, and three runs
# took 155 s; every run at once did not finish in 470 s; a run starts only while that much
# is left; RUNS: the lowering benchmark's or the profile's --runs, comma-separated, default
# all of them).
# lowering: python -m benchmarks.lowering; profile: python -m benchmarks.gpu_profile.
# The default order is what the fifth call (2026-11-27, 27th session) left open: it found
# gpt-8x512 launch bound (5.6 ms of kernels in a 16-24 ms step) and cuda_graphs=True at
# 8.32 ms against torch.compile's reduce-overhead 6.48 (two machine starts); so the larger
# GPT with CUDA graphs on both sides in one process, then gpt-12x768's fsdp runs.
DEFAULT_RUNS="lowering:gpt-12x768:300:torch_compile_1dev+cudagraphs,compiled_ddp@inductor+cudagraphs"
DEFAULT_RUNS="$DEFAULT_RUNS lowering:gpt-12x768:300:torch_fsdp2,compiled_fsdp@inductor"
for spec in ${GPU_CHECK_RUNS:-$DEFAULT_RUNS}; do
  IFS=: read -r kind model need runs <<<"$spec"
  runs=${runs:-${GPU_CHECK_LOWERING_RUNS:-}}
  if [ "$(left)" -lt "$need" ]; then
    echo "== $kind $model skipped: $(left) s left, needs ~$need"
    continue
  fi
  echo "== $kind $model ($(left) s left)"
  if [ "$kind" = profile ]; then
    timeout "$(left)" $PY -m benchmarks.gpu_profile --device cuda --case "$model" \
      ${runs:+--runs "$runs"} --out "$OUT/profile_$model"
  else
    timeout "$(left)" $PY -m benchmarks.lowering --device cuda --cases "$model" \
      ${runs:+--runs "$runs"} --out "$OUT/${kind}_$model"
  fi
  echo "$kind $model rc=$? at $(( $(date +%s) - START )) s"
  rm -f "$OUT/${kind}_$model.md"  # printed in the log; the json holds it all
done
echo "== done at $(( $(date +%s) - START )) s"
