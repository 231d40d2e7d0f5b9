#!/bin/bash
# Serve the dummy models of configs/models/ through SGLang 0.5.23 on the GPU machine, with the default
# backend and with --comm-backend purlin; check tokens against a reference; SGLang's offline benchmark.
# One device call: `STEPS="..." bash tools/gpu-serve.sh`, carry [".whl", ".serve"] (built here by
# ../shared/tools/device-wheels.sh and ../shared/tools/serving-wheels.sh). Logs and records under $OUT:
# $OUT/summary.txt, $OUT/serving.json ({"runs": [...]}), $OUT/logs.tgz (every server log, run record and
# offline result), $OUT/offline-tp*.png. Every step has its own timeout and the script goes on after a failure.
#
# STEPS (default "setup tp1 tp2"): the named steps run in this order: setup core tp1ab tp1pair tp1 tp2 tp4
#   tp4ref tp4p det moe offline, whatever their order in STEPS. setup = install the wheels into /tmp/site and build purlin (skipped
#   when the same sources are already installed on a warm machine);
#   core     tp1-nccl, tp2-gloo-ref, tp2-purlin-eager, tp1-purlin-yaml, tp2-purlin-graph (the runs below,
#            most important first, for a short call)
#   tp1ab    TP=1 throughput A/B, interleaved: default, purlin (flag), default, purlin (YAML); 128 output tokens
#   tp1pair  TP=1 throughput A/B with a 95% interval: the default server and purlin's (YAML switch) up at once
#            (A --mem-fraction-static 0.3, then B 0.62 once A is up), AB_ROUNDS (12) rounds of one batch each, the order flipped every
#            round, AB_PROMPTS (64) prompts x AB_OT (128) tokens; verdict within / differs / undecided on the 95%
#            interval of the per-round ratio ($OUT/tp1pair-ab.json; gpu-serve-client.py ab)
#   tp1      TP=1 servers: default backend (flags), then purlin (the YAML switch configs/purlin-sglang.yaml);
#            CUDA graphs on; purlin's tokens checked against the default's
#   tp2      TP=2 on ONE GPU, --purlin-nccl-free: reference = SGLang's collectives on gloo (graphs off,
#            gloo cannot be captured), then purlin with graphs off, then purlin with decode CUDA graphs on
#            (the prefill "breakable" graph, SGLang's CUDA default, stays off there)
#   tp4      TP=4 likewise: gloo reference (graphs off), purlin graphs off, purlin graphs on
#   tp4ref   only the TP=4 gloo reference (e.g. before tp4p in the same call)
#   tp4p     only the two purlin TP=4 runs (the reference from an earlier call, compared afterwards;
#            TP4_EAGER=0: only the decode-graph one, TP4_GRAPH=0: only the eager one)
#   offline  purlin-sglang bench offline --compare nccl,purlin at TP=1, and at TP=2 with --nccl-free
#            (OFFLINE_TP2=0: TP=1 only); each bounded by the time left before DEADLINE
#   det      TP=2 purlin NCCL-free with --enable-deterministic-inference: every prompt also served alone,
#            its tokens compared with the batch's (alone_tokens_match_batch); plugin line "deterministic"
#   moe      TP=1 and TP=2 (--purlin-nccl-free, purlin) of configs/models/qwen3-moe-4l, graphs off; then EP=2:
#            SGLang's MoE path on gloo, and purlin as the MoE dispatcher (MOE_ONLY_EP=1: only the EP pair)
# Knobs: MODEL (configs/models/olmo-dense-8l; the Llama one needs cutlass, see docs/SGLANG.md), PROMPTS (16), OT output tokens (32), REPEATS (3),
#   DEADLINE seconds after which no new step starts (470; give the call 600), WAIT seconds for a server to be ready (240).
# On a machine with a GPU per rank, run the same steps WITHOUT --purlin-nccl-free (one process per GPU, NCCL
# as SGLang sets it up): NCCL_FREE=0 makes tp2/tp4 do that (reference = the default backend, graphs on).
OUT=${OUT:-/tmp/out}; LOGS=/tmp/gpu-serve/logs; RUNS="$LOGS/runs"; rm -rf "$LOGS"; mkdir -p "$RUNS" "$OUT"
STEPS=${STEPS:-"setup tp1 tp2"}; MODEL=${MODEL:-configs/models/olmo-dense-8l}
PROMPTS=${PROMPTS:-16}; OT=${OT:-32}; REPEATS=${REPEATS:-3}; DEADLINE=${DEADLINE:-470}; WAIT=${WAIT:-240}
NCCL_FREE=${NCCL_FREE:-1}
T_START=$(date +%s)
export CUDA_MODULE_LOADING=EAGER NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
# PYTHONSAFEPATH: no process (the benchmark's children neither) puts the working directory first on sys.path,
# so the installed purlin_sglang (with its native library) is imported, not the checkout's sources.
# SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK: sglang 0.5.23 asserts sglang-kernel >= 0.4.9 at launch; the carried
# 0.4.5 is the build that links against the device's torch 2.11 (../shared/tools/serving-wheels.sh).
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK=0 PYTHONSAFEPATH=1
export SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
COMMON=(--attention-backend triton --sampling-backend pytorch --grammar-backend none --random-seed 42
        --disable-radix-cache --cuda-graph-max-bs-decode 16 --host 127.0.0.1 --log-level info)
say() { echo "[$(( $(date +%s) - T_START ))s] $*" | tee -a "$OUT/summary.txt"; }
left() { echo $(( DEADLINE - ($(date +%s) - T_START) )); }
has() { [[ " $STEPS " == *" $1 "* ]]; }
offline_timeout() { local t=$(( $(left) + 40 )); echo $(( t > 560 ? 560 : t )); }  # an offline step's own limit

finish() {
  python3 tools/gpu-serve-client.py compare --runs "$RUNS" --out "$OUT/serving.json" >> "$OUT/summary.txt" 2>&1
  tar -czf "$OUT/logs.tgz" -C "$(dirname "$LOGS")" logs 2>/dev/null
  say "done (STEPS=$STEPS)"
}
trap finish EXIT

say "$(nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader)"
if has setup; then
  T0=$(date +%s)
  if [ ! -d /tmp/site/sglang ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .serve/*.whl .whl/*.whl \
      > "$LOGS/wheels.log" 2>&1; say "wheels rc=$? secs=$(( $(date +%s) - T0 ))"
  else say "wheels: /tmp/site already has sglang"; fi
  STAMP=$(cat pyproject.toml CMakeLists.txt $(find native purlin_sglang -type f -name '*.[ch]*' -o -type f -name '*.py' -o -type f -name '*.cu*' | sort) 2>/dev/null | md5sum | cut -c1-16)
  build_and_check() {  # in the background, while the first (default-backend) server starts
    if [ "$(cat /tmp/purlin-build.stamp 2>/dev/null)" != "$STAMP" ]; then
      local T0=$(date +%s)
      timeout 300 env -u PYTHONSAFEPATH python3 -m pip install --no-build-isolation --no-deps . > "$LOGS/build.log" 2>&1
      local rc=$?; say "purlin build rc=$rc secs=$(( $(date +%s) - T0 ))"
      [ $rc -eq 0 ] && echo "$STAMP" > /tmp/purlin-build.stamp || tail -30 "$LOGS/build.log" >> "$OUT/summary.txt"
    else say "purlin: already built from these sources"; fi
    timeout 120 python3 -P - > "$LOGS/imports.log" 2>&1 <<'EOF'
import importlib.metadata as md, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())
for d in ("sglang", "sglang-kernel", "transformers", "purlin-sglang", "triton"):
    try: print("version", d, md.version(d))
    except Exception as e: print("version", d, "-", type(e).__name__)
from sglang.srt.plugins import load_plugins
from purlin_sglang.sglang import plugin
load_plugins()
print("hooks missing:", plugin.missing_hooks())
from purlin_sglang.engines import cuda_engine_status
print("cuda engine:", cuda_engine_status() or "ready")
EOF
    say "imports rc=$?: $(grep -E '^(torch|version|hooks|cuda engine)' "$LOGS/imports.log" | tr '\n' ' ')"
  }
  build_and_check & BUILD_PID=$!
fi
SGLANG_V=$(python3 -c "import importlib.metadata as m; print(m.version('sglang'))" 2>/dev/null)
TORCH_V=$(python3 -c "import torch; print(torch.__version__)" 2>/dev/null)
echo "{\"sglang\": \"$SGLANG_V\", \"torch\": \"$TORCH_V\"}" > "$LOGS/versions.json"

free_gpu() {  # wait until no process holds the GPU (a server's workers exit a little after it)
  for _ in $(seq 30); do [ -z "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader)" ] && return; sleep 1; done
  say "warning: GPU still in use: $(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | tr '\n' ' ')"
}

# serve NAME TP BACKEND GRAPH REFERENCE -- SGLANG FLAGS...: one server, the client's run, then stop it.
EXITS=0  # servers in a row that exited before they were ready: after 2, the rest is skipped (same cause)
serve() {
  local name=$1 tp=$2 backend=$3 graph=$4 ref=$5; shift 6
  if [ "$(left)" -lt 60 ]; then say "$name: skipped (deadline: $(left) s left)"; return; fi
  if [ "$EXITS" -ge 2 ]; then say "$name: skipped (the last $EXITS servers exited before they were ready)"; return; fi
  local port=$(( 31000 + RANDOM % 2000 )) log="$LOGS/server-$name.log" extra=()
  [ "$graph" = true ] || extra+=(--disable-cuda-graph)
  local cmd=(python3 -m sglang.launch_server --model-path "$MODEL" --load-format dummy --tp-size "$tp" --port "$port"
             "${COMMON[@]}" "${extra[@]}" "$@")
  # a server that uses purlin needs the build finished before it starts (the plugin is imported at start-up,
  # and its flags, e.g. --purlin-nccl-free of the gloo references, are unknown to SGLang without it)
  if [ -n "$BUILD_PID" ] && { [ "$backend" = purlin ] || [[ " $* " == *purlin* ]]; }; then wait $BUILD_PID; BUILD_PID=""; fi
  say "$name: ${cmd[*]}"
  setsid "${cmd[@]}" > "$log" 2>&1 &
  local pid=$! wait_s=$WAIT
  if [ -n "$BUILD_PID" ]; then wait $BUILD_PID; BUILD_PID=""; fi  # the build: not while a server is measured
  [ "$(left)" -lt "$wait_s" ] && wait_s=$(left)
  timeout $(( wait_s + 200 )) python3 tools/gpu-serve-client.py run --url "http://127.0.0.1:$port" --log "$log" \
    --pid $pid --name "$name" --out "$RUNS/$name.json" --backend "$backend" --tp "$tp" --model "$(basename "$MODEL")" \
    --cuda-graph "$graph" --reference "$ref" --prompts "$PROMPTS" --output-tokens "$OT" --repeats "$REPEATS" \
    --wait "$wait_s" --timeout 150 --command "${cmd[*]}" $([[ " $* " == *nccl-free* ]] && echo --nccl-free) \
    ${CLIENT_EXTRA:-} 2>&1 | tee -a "$OUT/summary.txt"
  kill -TERM -- -$pid 2>/dev/null; for _ in $(seq 6); do kill -0 $pid 2>/dev/null || break; sleep 1; done
  kill -KILL -- -$pid 2>/dev/null; wait $pid 2>/dev/null
  grep -q "server process exited" "$RUNS/$name.json" 2>/dev/null && EXITS=$((EXITS + 1)) || EXITS=0
  grep -E "Error|error|Traceback" "$log" | grep -v "INFO" | tail -4 >> "$OUT/summary.txt"
  free_gpu
}

if has core; then  # the shortest path through the issue's runs, most important first
  serve tp1-nccl 1 nccl true "" -- --mem-fraction-static 0.6
  serve tp2-gloo-ref 2 nccl false "" -- --mem-fraction-static 0.25 --purlin-nccl-free
  serve tp2-purlin-eager 2 purlin false tp2-gloo-ref -- --mem-fraction-static 0.25 \
    --config configs/purlin-sglang-nccl-free.yaml
  serve tp1-purlin-yaml 1 purlin true tp1-nccl -- --mem-fraction-static 0.6 --config configs/purlin-sglang.yaml
  serve tp2-purlin-graph 2 purlin true tp2-gloo-ref -- --mem-fraction-static 0.25 \
    --config configs/purlin-sglang-nccl-free.yaml --disable-prefill-cuda-graph
fi
if has tp1ab; then  # TP=1 throughput A/B, interleaved (the first server on a fresh machine ran slow): default,
  # purlin by flag, default, purlin by YAML; longer batches (TP1AB_OT output tokens, 5 repeats)
  OT0=$OT R0=$REPEATS; OT=${TP1AB_OT:-128}; REPEATS=5
  serve tp1-nccl-a 1 nccl true "" -- --mem-fraction-static 0.6
  serve tp1-purlin-flag-a 1 purlin true tp1-nccl-a -- --mem-fraction-static 0.6 --comm-backend purlin \
    --purlin-config configs/purlin.yaml
  serve tp1-nccl-b 1 nccl true "" -- --mem-fraction-static 0.6
  serve tp1-purlin-yaml-b 1 purlin true tp1-nccl-b -- --mem-fraction-static 0.6 --config configs/purlin-sglang.yaml
  OT=$OT0 REPEATS=$R0
fi
if has tp1pair; then  # TP=1, default vs purlin (YAML switch), both servers up at once, driven in turns
  if [ "$(left)" -lt 150 ]; then say "tp1pair: skipped (deadline: $(left) s left)"; else
    if [ -n "$BUILD_PID" ]; then wait $BUILD_PID; BUILD_PID=""; fi
    pa=$(( 33000 + RANDOM % 1000 )); pb=$(( pa + 1000 ))
    la="$LOGS/server-tp1pair-nccl.log"; lb="$LOGS/server-tp1pair-purlin.log"
    ca=(python3 -m sglang.launch_server --model-path "$MODEL" --load-format dummy --tp-size 1 --port $pa "${COMMON[@]}"
        --mem-fraction-static 0.3)
    # B starts once A is up: SGLang's --mem-fraction-static counts every process's use of the GPU, so B's
    # fraction adds A's share (about 0.32 with its graphs) to the 0.3 of its own (PAIR_FRAC_B). Started at
    # once, whichever loads second may find no memory for its KV cache (fifth session, call 5-6).
    cb=(python3 -m sglang.launch_server --model-path "$MODEL" --load-format dummy --tp-size 1 --port $pb "${COMMON[@]}"
        --mem-fraction-static "${PAIR_FRAC_B:-0.62}" --config configs/purlin-sglang.yaml)
    say "tp1pair: A ${ca[*]}"; say "tp1pair: B ${cb[*]}"
    setsid "${ca[@]}" > "$la" 2>&1 & pida=$!
    for _ in $(seq "$WAIT"); do grep -q "The server is fired up and ready to roll" "$la" 2>/dev/null && break
      kill -0 $pida 2>/dev/null || break; sleep 1; done
    setsid "${cb[@]}" > "$lb" 2>&1 & pidb=$!
    timeout $(( $(left) + 100 )) python3 tools/gpu-serve-client.py ab --urls "http://127.0.0.1:$pa,http://127.0.0.1:$pb" \
      --names nccl,purlin --logs "$la,$lb" --pids "$pida,$pidb" --out "$LOGS/tp1pair-ab.json" \
      --prompts "${AB_PROMPTS:-64}" --output-tokens "${AB_OT:-128}" --rounds "${AB_ROUNDS:-12}" --wait "$WAIT" \
      --command "STEPS=tp1pair bash tools/gpu-serve.sh: A = ${ca[*]} | B = ${cb[*]}" 2>&1 | tee -a "$OUT/summary.txt"
    cp "$LOGS/tp1pair-ab.json" "$OUT/" 2>/dev/null
    for pid in $pida $pidb; do kill -TERM -- -$pid 2>/dev/null; done; sleep 6
    for pid in $pida $pidb; do kill -KILL -- -$pid 2>/dev/null; wait $pid 2>/dev/null; done
    free_gpu
  fi
fi
if has tp1; then
  serve tp1-nccl 1 nccl true "" -- --mem-fraction-static 0.6
  serve tp1-purlin-yaml 1 purlin true tp1-nccl -- --mem-fraction-static 0.6 --config configs/purlin-sglang.yaml
fi
for tp in 2 4; do
  has tp$tp || continue
  mem=$([ $tp = 2 ] && echo 0.25 || echo 0.14)
  if [ "$NCCL_FREE" = 1 ]; then
    serve tp$tp-gloo-ref $tp nccl false "" -- --mem-fraction-static $mem --purlin-nccl-free
    serve tp$tp-purlin-eager $tp purlin false tp$tp-gloo-ref -- --mem-fraction-static $mem \
      --config configs/purlin-sglang-nccl-free.yaml
    serve tp$tp-purlin-graph $tp purlin true tp$tp-gloo-ref -- --mem-fraction-static $mem \
      --config configs/purlin-sglang-nccl-free.yaml --disable-prefill-cuda-graph  # decode graphs
  else  # one process per GPU, NCCL present
    serve tp$tp-nccl $tp nccl true "" -- --mem-fraction-static 0.6
    serve tp$tp-purlin $tp purlin true tp$tp-nccl -- --mem-fraction-static 0.6 --config configs/purlin-sglang.yaml
  fi
done
if has tp4ref; then  # the TP=4 reference alone
  serve tp4-gloo-ref 4 nccl false "" -- --mem-fraction-static 0.14 --purlin-nccl-free
fi
if has tp4p; then  # the purlin TP=4 runs alone (their gloo reference from an earlier call; compare locally)
  [ "${TP4_EAGER:-1}" = 1 ] && serve tp4-purlin-eager 4 purlin false tp4-gloo-ref -- --mem-fraction-static 0.14 \
    --config configs/purlin-sglang-nccl-free.yaml
  [ "${TP4_GRAPH:-1}" = 1 ] && serve tp4-purlin-graph 4 purlin true tp4-gloo-ref -- --mem-fraction-static 0.14 \
    --config configs/purlin-sglang-nccl-free.yaml --disable-prefill-cuda-graph
fi
if has det; then  # batch invariance under --enable-deterministic-inference, all-reduces through purlin
  CLIENT_EXTRA="--alone $PROMPTS" serve det-tp2-purlin 2 purlin false tp2-gloo-ref -- --mem-fraction-static 0.25 \
    --config configs/purlin-sglang-nccl-free.yaml --enable-deterministic-inference
fi
if has moe; then
  M0=$MODEL; MODEL=configs/models/qwen3-moe-4l
  if [ "${MOE_ONLY_EP:-0}" != 1 ]; then
    serve moe-tp1-nccl 1 nccl false "" -- --mem-fraction-static 0.5
    serve moe-tp2-gloo-ref 2 nccl false "" -- --mem-fraction-static 0.25 --purlin-nccl-free
    serve moe-tp2-purlin-eager 2 purlin false moe-tp2-gloo-ref -- --mem-fraction-static 0.25 \
      --config configs/purlin-sglang-nccl-free.yaml
  fi
  # expert parallelism: SGLang's own MoE path on gloo (reference: EP shards differ from TP shards), then
  # purlin as the MoE dispatcher (configs/purlin-sglang-moe-nccl-free.yaml: --moe-a2a-backend none + moe:)
  serve moe-ep2-gloo-ref 2 nccl false "" -- --mem-fraction-static 0.25 --purlin-nccl-free --ep-size 2 \
    --moe-a2a-backend none
  serve moe-ep2-purlin-dispatch 2 purlin false moe-ep2-gloo-ref -- --mem-fraction-static 0.25 \
    --config configs/purlin-sglang-moe-nccl-free.yaml --ep-size 2
  MODEL=$M0
fi
if has offline; then
  OFF=(python3 -m purlin_sglang bench offline --model-path "$MODEL" --load-format dummy --num-prompts ${OFF_PROMPTS:-64}
       --random-input-len 128 --random-output-len ${OFF_OT:-64} --seed 42 --timeout 240)
  SG=(-- --attention-backend triton --sampling-backend pytorch --grammar-backend none --disable-radix-cache
      --cuda-graph-max-bs-decode 16 --random-seed 42)
  if [ "$(left)" -gt 120 ]; then
    say "offline tp1: ${OFF[*]} --tp 1 --compare nccl,purlin --purlin-config configs/purlin.yaml"
    timeout "$(offline_timeout)" "${OFF[@]}" --tp 1 --compare nccl,purlin --purlin-config configs/purlin.yaml --out "$LOGS/offline-tp1" \
      "${SG[@]}" --mem-fraction-static 0.6 > "$LOGS/offline-tp1.txt" 2>&1; say "offline tp1 rc=$?"
    tail -14 "$LOGS/offline-tp1.txt" >> "$OUT/summary.txt"; cp "$LOGS/offline-tp1/offline.png" "$OUT/offline-tp1.png" 2>/dev/null
  else say "offline tp1: skipped (deadline)"; fi
  if [ "${OFFLINE_TP2:-1}" = 1 ] && [ "$(left)" -gt 120 ]; then
    say "offline tp2: ${OFF[*]} --tp 2 --nccl-free --compare nccl,purlin --purlin-config configs/purlin-nccl-free.yaml"
    timeout "$(offline_timeout)" "${OFF[@]}" --tp 2 --nccl-free --compare nccl,purlin --purlin-config configs/purlin-nccl-free.yaml \
      --out "$LOGS/offline-tp2" "${SG[@]}" --mem-fraction-static 0.25 --disable-cuda-graph > "$LOGS/offline-tp2.txt" 2>&1
    say "offline tp2 rc=$?"; tail -14 "$LOGS/offline-tp2.txt" >> "$OUT/summary.txt"
    cp "$LOGS/offline-tp2/offline.png" "$OUT/offline-tp2.png" 2>/dev/null
  else say "offline tp2: skipped (deadline)"; fi
fi
