#!/bin/bash
# One-call GPU check on the device machine: build, every GPU test, a demo run. Logs under $OUT.
# Needs pydantic wheels in .whl/ (../shared/tools/device-wheels.sh) carried with the call.
export PURLIN_REQUIRE_GPU=1  # a GPU test that skips for want of a GPU fails here (tests/conftest.py)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit 1
export CUDA_MODULE_LOADING=EAGER
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u
T0=$(date +%s)
python3 -m pip install --no-build-isolation --no-deps . > "$OUT/build.log" 2>&1; echo "build rc=$? secs=$(( $(date +%s) - T0 ))"
T0=$(date +%s)
PYTHONUNBUFFERED=1 timeout ${PT:-170} python3 -P -m pytest -q tests/gpu -p no:cacheprovider -rfs --tb=short \
  > "$OUT/pytest_gpu.log" 2>&1; echo "gpu tests rc=$? secs=$(( $(date +%s) - T0 ))"
grep -E "passed|failed|^FAILED|^SKIPPED|^ERROR" "$OUT/pytest_gpu.log" | head -40
PYTHONUNBUFFERED=1 timeout ${DT:-40} python3 -P -m purlin_sglang demo --max-world 4 --iters 2 > "$OUT/demo.log" 2>&1
echo "demo rc=$?"; tail -4 "$OUT/demo.log"
