#!/usr/bin/env bash
# Launch an SGLang server whose parallel groups' collectives go through purlin_sglang.
#
#   examples/launch_server_purlin.sh [flags|yaml|nccl] [MODEL_DIR] [TP] [more sglang flags...]
#
#   flags  --comm-backend purlin --purlin-config configs/purlin.yaml on the command line (default)
#   yaml   the same from SGLang's config file: --config configs/purlin-sglang.yaml
#   nccl   SGLang's own collectives: --config configs/nccl.yaml (the one key switched back)
#
# MODEL_DIR defaults to build/tiny-llama, made by examples/make_tiny_model.py when missing;
# --load-format dummy gives it random weights, so nothing is downloaded. TP defaults to 2.
# PYTHON picks the interpreter (default: python); DRY_RUN=1 prints the command instead.
# Needs a CUDA GPU per TP rank and sglang==0.5.23 with its GPU kernel packages.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODE="${1:-flags}"
MODEL="${2:-$ROOT/build/tiny-llama}"
TP="${3:-2}"
shift $(( $# < 3 ? $# : 3 ))
PY="${PYTHON:-python}"

case "$MODE" in
    flags) BACKEND=(--comm-backend purlin --purlin-config configs/purlin.yaml) ;;
    yaml)  BACKEND=(--config configs/purlin-sglang.yaml) ;;
    nccl)  BACKEND=(--config configs/nccl.yaml) ;;
    *) echo "launch_server_purlin: unknown mode '$MODE'; use flags, yaml or nccl" >&2; exit 2 ;;
esac

[ -f "$MODEL/config.json" ] || "$PY" "$ROOT/examples/make_tiny_model.py" "$MODEL"
cd "$ROOT"  # the configs name configs/purlin.yaml relative to the working directory
CMD=("$PY" -m sglang.launch_server --model-path "$MODEL" --load-format dummy --tp-size "$TP" "${BACKEND[@]}" "$@")
if [ "${DRY_RUN:-0}" = 1 ]; then
    printf '%q ' "${CMD[@]}"; echo
else
    exec "${CMD[@]}"
fi
