#!/usr/bin/env bash
# Install sglang==0.5.23 WITHOUT its GPU kernel packages, plus purlin_sglang (editable), into a
# separate venv, so that the SGLang plugin tests (tests/sglang) run on a CPU-only machine.
#
#   tools/install-sglang-cpu.sh [VENV]        (default VENV: build/venv-sgl, git-ignored)
#   VENV/bin/python -m pytest -q tests/sglang
#
# Idempotent: re-running only checks what is there. Needs PyPI and nothing else. torch==2.14.1
# is what sglang 0.5.23 pins; its PyPI wheel needs the CUDA runtime wheels just to import (they
# come with it), even on a machine without a GPU. sglang itself is installed with --no-deps and
# only the pure-Python packages needed to import its distributed layer, server args and plugin
# framework are added (found by importing; see docs/SGLANG.md). The purlin native library is
# built host-only unless PURLIN_DISABLE_CUDA=0 is set (the plugin tests use the CPU engine).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/build/venv-sgl}"
PY="$VENV/bin/python"
PIP=("$PY" -m pip install -q --disable-pip-version-check)

[ -x "$PY" ] || python3 -m venv "$VENV"

# 1. torch as sglang pins it (with its CUDA runtime wheels: libtorch_cuda links them).
"${PIP[@]}" "torch==2.14.1"

# 2. What `import sglang.srt.distributed.parallel_state, sglang.srt.server_args,
#    sglang.srt.plugins` and building a GroupCoordinator on gloo need; plus, for the offline
#    benchmark and example tests, transformers and tokenizers (at sglang's pins) and matplotlib
#    (with python-dateutil kept below 3, as sglang asks).
"${PIP[@]}" orjson psutil pybase64 requests pillow starlette msgspec pyzmq tqdm ipython aiohttp \
    "apache-tvm-ffi==0.1.11" "transformers==5.19.0" "tokenizers==0.23.2" matplotlib "python-dateutil<3"
# 2b. What importing SGLang's MoE layer (layers/moe/fused_moe_triton/layer.py, the MoE dispatcher hook's
#     target) adds, found by importing; sglang's pins where it has them (torchvision: the one built for
#     torch 2.14.1).
"${PIP[@]}" "torchvision==0.29.1" dill "sentencepiece==0.2.1" einops "compressed-tensors==0.18.0" loguru gguf \
    "openai==2.8.0" partial-json-parser

# 3. purlin_sglang (editable) with its own runtime and test dependencies and the build backend.
"${PIP[@]}" numpy pydantic pyyaml cuda-python pytest hypothesis "scikit-build-core>=0.10"
command -v cmake >/dev/null 2>&1 || "${PIP[@]}" "cmake>=3.18"
PURLIN_DISABLE_CUDA="${PURLIN_DISABLE_CUDA:-1}" "${PIP[@]}" --no-build-isolation --no-deps -e "$ROOT"

# 4. sglang without any of its dependencies (its kernel packages are GPU-only and very large). Last, so
#    that pip's dependency check in the steps above never sees its missing dependencies.
"${PIP[@]}" --no-deps "sglang==0.5.23"

# 5. Check: the imports the plugin tests need, and the plugin's entry point.
"$PY" - <<'EOF'
import importlib.metadata as md
import sglang.srt.distributed.parallel_state, sglang.srt.plugins.hook_registry, sglang.srt.server_args  # noqa: F401
import sglang.srt.layers.moe.fused_moe_triton.layer  # noqa: F401  (the MoE dispatcher hook's target)
import purlin_sglang.sglang.plugin  # noqa: F401
eps = [ep.value for ep in md.entry_points(group="sglang.srt.plugins") if ep.name == "purlin_sglang"]
if eps != ["purlin_sglang.sglang.plugin:register"]:
    raise SystemExit(f"install-sglang-cpu: purlin_sglang entry point not found in sglang.srt.plugins: {eps}")
print(f"install-sglang-cpu: ok (sglang {md.version('sglang')}, torch {md.version('torch')})")
EOF
