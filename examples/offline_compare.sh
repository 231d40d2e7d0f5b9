#!/usr/bin/env bash
# SGLang's offline throughput benchmark, once with NCCL and once with purlin, on the same prompts.
#
#   examples/offline_compare.sh [MODEL_DIR] [TP] [more 'bench offline' options...]
#
# MODEL_DIR defaults to build/tiny-llama (made by examples/make_tiny_model.py when missing; run
# with --load-format dummy: random weights, nothing downloaded). TP defaults to 2. Prompts are
# generated locally. Prints the side-by-side table and writes offline.json and offline.png under
# --out (default bench-results/offline-<timestamp>). PYTHON picks the interpreter (default: python).
# Add --dry-run to see the two runs' commands without a GPU. A real run needs a CUDA GPU per TP
# rank and sglang==0.5.23 with its GPU kernel packages.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODEL="${1:-$ROOT/build/tiny-llama}"
TP="${2:-2}"
shift $(( $# < 2 ? $# : 2 ))
PY="${PYTHON:-python}"

[ -f "$MODEL/config.json" ] || "$PY" "$ROOT/examples/make_tiny_model.py" "$MODEL"
cd "$ROOT"
exec "$PY" -m purlin_sglang.bench offline --compare nccl,purlin --model-path "$MODEL" --load-format dummy \
    --tp-size "$TP" --purlin-config configs/purlin.yaml "$@"
