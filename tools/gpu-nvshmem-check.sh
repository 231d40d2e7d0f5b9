#!/bin/bash
# One-call GPU check of the nvshmem provider on the device machine: build (non-editable, no build
# isolation, so CMake sees the installed nvidia-nvshmem wheel), show what was built and linked, run
# the nvshmem CPU and GPU tests (two processes on one GPU) and the ipc provider test beside them.
# Logs under $OUT. Needs pydantic wheels in .whlp/ (see tools/gpu-check.sh), or WHEELS=dir, carried.
#   SKIP_BUILD=1   the wheels (in /tmp/site) and the build are already there
#   PT=seconds     pytest time limit (default 300)
#   NVSHMEM_DEBUG  passed through (default WARN: NVSHMEM's own warnings land in the pytest log)
export PURLIN_REQUIRE_GPU=1  # a GPU test that skips for want of a GPU fails here (tests/conftest.py)
W=${WHEELS:-.whlp}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export CUDA_MODULE_LOADING=EAGER NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 NVSHMEM_DEBUG=${NVSHMEM_DEBUG:-WARN}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u
python3 -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__, 'cuda', torch.version.cuda)"
python3 -m pip list 2>/dev/null | grep -i nvshmem
if [ -z "$SKIP_BUILD" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $W/*.whl \
    || exit 1
  T0=$(date +%s)
  python3 -m pip install -v --no-build-isolation --no-deps . > "$OUT/build.log" 2>&1
  echo "build rc=$? secs=$(( $(date +%s) - T0 ))"
  grep -E "purlin: nvshmem|purlin: CUDA|error" "$OUT/build.log" | head -10
fi
export PYTHONPATH=/tmp/site

# What was built: the build info's nvshmem entry, the provider's status, the shim's links.
python3 -P - > "$OUT/status.log" 2>&1 <<'EOF'
import json, os, subprocess
from purlin_sglang import native
from purlin_sglang.memory.nvshmem import nvshmem_status
print("build_info.nvshmem:", json.dumps(native.build_info().get("nvshmem")))
st = nvshmem_status()
print("nvshmem_status:", json.dumps(st))
if st["library"] and os.path.exists(st["library"]):
    print(subprocess.run(["ldd", st["library"]], capture_output=True, text=True).stdout)
    print(subprocess.run(["readelf", "-d", st["library"]], capture_output=True, text=True).stdout)
EOF
echo "status rc=$?"; grep -E "^build_info|^nvshmem_status|nvshmem_host|RUNPATH|RPATH" "$OUT/status.log" | cut -c1-400

T0=$(date +%s)
PYTHONUNBUFFERED=1 timeout ${PT:-300} python3 -P -m pytest -q -p no:cacheprovider -rfs --tb=short -s \
  tests/memory/test_nvshmem_cpu.py tests/gpu/test_nvshmem_provider.py tests/gpu/test_ipc_provider.py \
  > "$OUT/pytest_nvshmem.log" 2>&1
echo "nvshmem tests rc=$? secs=$(( $(date +%s) - T0 ))"
grep -E "passed|failed|^FAILED|^SKIPPED|^ERROR|round trip" "$OUT/pytest_nvshmem.log" | head -40
grep -E "NVSHMEM (WARN|ERROR|ABORT)" "$OUT/pytest_nvshmem.log" | sort | uniq -c | sort -rn | head -10 | cut -c1-300
