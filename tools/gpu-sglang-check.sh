#!/bin/bash
# One-call GPU check of the SGLang plugin on CUDA groups: install the carried wheels (sglang 0.5.23
# --no-deps plus what importing its distributed layer needs, and pydantic), build purlin, check the
# imports (printing why, if one fails), run tests/gpu/test_sglang_cuda.py. Logs under $OUT.
# Carry [".whl"]; the wheel list and how to fetch it: docs/SGLANG.md ("CUDA groups" section).
#   PT=seconds for pytest (default 360)
export PURLIN_REQUIRE_GPU=1  # a GPU test that skips for want of a GPU fails here (tests/conftest.py)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export CUDA_MODULE_LOADING=EAGER NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u
python3 -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__, 'cuda', torch.version.cuda)"
ldd --version 2>&1 | head -1
ls .whl > "$OUT/wheels.txt" 2>&1; echo "wheels carried: $(ls .whl/*.whl 2>/dev/null | wc -l) ($(du -sh .whl 2>/dev/null | cut -f1))"

# 1. the wheels, into /tmp/site (first as given; if pip refuses a wheel's platform tag, e.g. sglang's
#    manylinux_2_34 on an older glibc, again with the tags named: pip then installs without checking)
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  > "$OUT/wheels.log" 2>&1
rc=$?
if [ $rc -ne 0 ]; then
  echo "wheel install rc=$rc:"; grep -iE "error|not a supported" "$OUT/wheels.log" | head -5
  echo "retrying with the manylinux tags named (cp312)"
  plat=(); for n in 5 12 17 24 26 27 28 31 34; do plat+=(--platform "manylinux_2_${n}_x86_64"); done
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
    --platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64 \
    .whl/*.whl >> "$OUT/wheels.log" 2>&1
  rc=$?
fi
echo "wheels rc=$rc secs=$(( $(date +%s) - T0 ))"
[ $rc -eq 0 ] || { tail -30 "$OUT/wheels.log"; exit 1; }
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}

# 2. purlin (native library with CUDA)
T0=$(date +%s)
python3 -m pip install --no-build-isolation --no-deps . > "$OUT/build.log" 2>&1; brc=$?
echo "build rc=$brc secs=$(( $(date +%s) - T0 ))"
[ $brc -eq 0 ] || { tail -40 "$OUT/build.log"; exit 1; }

# 3. the imports the test needs, one by one, with the reason of any failure
python3 -P - > "$OUT/imports.log" 2>&1 <<'EOF'
import importlib, importlib.metadata as md, time, traceback
ok = True
for name in ("numpy", "cuda", "triton", "pydantic", "yaml", "zmq", "PIL", "IPython.display", "aiohttp", "tvm_ffi",
             "sglang", "sglang.srt.server_args", "sglang.srt.plugins", "sglang.srt.distributed.parallel_state",
             "purlin_sglang", "purlin_sglang.sglang.plugin"):
    t0 = time.time()
    try:
        m = importlib.import_module(name)
        print(f"ok   {name:40s} {time.time() - t0:5.1f}s  {getattr(m, '__file__', '')}")
    except BaseException as e:  # noqa: BLE001
        ok = False
        print(f"FAIL {name}: {type(e).__name__}: {e}")
        traceback.print_exc()
for dist in ("sglang", "torch", "numpy", "pydantic", "cuda-python", "cuda-bindings", "triton", "purlin-sglang"):
    try:
        print(f"version {dist} {md.version(dist)}")
    except Exception as e:  # noqa: BLE001
        print(f"version {dist} -: {type(e).__name__}")
eps = [ep.value for ep in md.entry_points(group="sglang.srt.plugins")]
print("sglang.srt.plugins entry points:", eps)
try:
    from purlin_sglang import native
    print("purlin native:", native.build_info())
    from purlin_sglang.engines import cuda_engine_status
    print("cuda engine:", cuda_engine_status() or "ready")
    from sglang.srt.plugins import load_plugins
    from purlin_sglang.sglang import plugin
    load_plugins()
    print("hooks missing:", plugin.missing_hooks())
except BaseException as e:  # noqa: BLE001
    ok = False
    print(f"FAIL plugin check: {type(e).__name__}: {e}")
    traceback.print_exc()
print("IMPORTS", "OK" if ok else "FAILED")
EOF
grep -E "^(FAIL|version|IMPORTS|hooks|cuda engine|sglang.srt.plugins)" "$OUT/imports.log"
grep -q "IMPORTS OK" "$OUT/imports.log" || { echo "--- imports.log tail"; tail -40 "$OUT/imports.log";
  python3 -m pip list > "$OUT/pip-list.txt" 2>&1; }

# 4. the test (it skips, naming the reason, when sglang does not import)
T0=$(date +%s)
timeout ${PT:-360} python3 -P -m pytest -q tests/gpu/test_sglang_cuda.py -p no:cacheprovider -rfs --tb=long \
  > "$OUT/pytest_sglang_cuda.log" 2>&1; echo "sglang cuda test rc=$? secs=$(( $(date +%s) - T0 ))"
grep -E "passed|failed|skipped|^FAILED|^SKIPPED|^ERROR" "$OUT/pytest_sglang_cuda.log" | head -20
grep -qE "[0-9]+ passed" "$OUT/pytest_sglang_cuda.log" && ! grep -qE "failed|error" "$OUT/pytest_sglang_cuda.log" \
  || { echo "--- pytest log tail"; tail -60 "$OUT/pytest_sglang_cuda.log"; }
