# The serve step of tools/gpu.sh (sourced by it; it uses the helpers there: run, left, site, need_build):
# SGLang servers of configs/models/ with the default backend and with purlin, each run driven by
# tools/serve_client.py, its tokens compared with its reference run at the end. SV_* is the step's state.

SERVE_GROUPS=(core tp1 tp2 tp4 tp1ab tp1pair det moe moe-ep moe-graph fault offline)
SERVE_RUNS=(tp1-nccl tp1-purlin-yaml tp2-gloo-ref tp2-purlin-eager tp2-purlin-graph tp4-gloo-ref tp4-purlin-eager
            tp4-purlin-graph tp2-nccl tp2-purlin tp4-nccl tp4-purlin tp1-nccl-a tp1-purlin-flag-a tp1-nccl-b
            tp1-purlin-yaml-b tp1pair det-tp2-purlin moe-tp1-nccl moe-tp2-gloo-ref moe-tp2-purlin-eager
            moe-ep2-gloo-ref moe-ep2-purlin-dispatch moe-ep2-purlin-graph moe-ep4-gloo-ref moe-ep4-purlin-graph
            fault-tp2-eager fault-tp2-graph offline-tp1 offline-tp2)
SERVE_COMMON=(--attention-backend triton --sampling-backend pytorch --grammar-backend none --random-seed 42
              --disable-radix-cache --cuda-graph-max-bs-decode 16 --host 127.0.0.1 --log-level info)
READY="The server is fired up and ready to roll"

serve_expand() {
  case $1 in
    core) echo tp1-nccl tp2-gloo-ref tp2-purlin-eager tp1-purlin-yaml tp2-purlin-graph ;;
    tp1) echo tp1-nccl tp1-purlin-yaml ;;
    tp2 | tp4)
      if ((SV_PER_RANK)); then echo "$1-nccl $1-purlin"; else echo "$1-gloo-ref $1-purlin-eager $1-purlin-graph"; fi ;;
    tp1ab) echo tp1-nccl-a tp1-purlin-flag-a tp1-nccl-b tp1-purlin-yaml-b ;;
    det) echo det-tp2-purlin ;;
    moe) echo moe-tp1-nccl moe-tp2-gloo-ref moe-tp2-purlin-eager moe-ep2-gloo-ref moe-ep2-purlin-dispatch ;;
    moe-ep) echo moe-ep2-gloo-ref moe-ep2-purlin-dispatch ;;
    moe-graph) echo moe-ep2-gloo-ref moe-ep2-purlin-graph moe-ep4-gloo-ref moe-ep4-purlin-graph ;;
    fault) echo fault-tp2-eager fault-tp2-graph ;;
    offline) echo offline-tp1 offline-tp2 ;;
    *) echo "$1" ;;
  esac
}

parse_serve() {
  SV_RUNS=tp1,tp2 SV_MODEL=configs/models/olmo-dense-8l SV_PROMPTS=16 SV_OT=32 SV_REPEATS=3 SV_WAIT=240
  SV_AB_ROUNDS=12 SV_AB_PROMPTS=64 SV_AB_OT=128 SV_PER_RANK=0 SV_LIST=()
  local opt var name
  while (($#)); do
    opt=$1
    case $opt in
      --gpu-per-rank) SV_PER_RANK=1; shift; continue ;;
      --runs) var=SV_RUNS ;;
      --model) var=SV_MODEL ;;
      --prompts) var=SV_PROMPTS ;;
      --output-tokens) var=SV_OT ;;
      --repeats) var=SV_REPEATS ;;
      --wait) var=SV_WAIT ;;
      --ab-rounds) var=SV_AB_ROUNDS ;;
      --ab-prompts) var=SV_AB_PROMPTS ;;
      --ab-output-tokens) var=SV_AB_OT ;;
      *) WHY="serve: unknown option '$opt' (the serve options: bash tools/gpu.sh --help)"; return 1 ;;
    esac
    (($# >= 2)) || { WHY="serve: $opt needs a value"; return 1; }
    if [[ $var != SV_RUNS && $var != SV_MODEL ]] && ! count_ok "$2"; then
      WHY="serve: $opt needs a count of 1 or more (got '$2')"; return 1
    fi
    printf -v "$var" '%s' "$2"
    shift 2
  done
  [[ -f $SV_MODEL/config.json ]] || {
    WHY="serve: --model $SV_MODEL: no config.json there (see configs/models/)"; return 1; }
  for name in $(for g in ${SV_RUNS//,/ }; do serve_expand "$g"; done); do
    is_in "$name" "${SERVE_RUNS[@]}" || {
      WHY="serve: run '$name' unknown; groups: ${SERVE_GROUPS[*]}; runs: ${SERVE_RUNS[*]}"; return 1; }
    is_in "$name" "${SV_LIST[@]}" || SV_LIST+=("$name")
  done
  ((${#SV_LIST[@]})) || { WHY="serve: --runs names no run"; return 1; }
}

sv_say() { ((DRY)) || echo "[$((SECONDS - T_START))s] $*" >> "$SV_DIR/summary.txt"; }

free_gpu() {  # until no process holds the GPU (a server's workers exit a little after it)
  ((DRY)) && return
  for _ in $(seq 30); do [[ -z $(nvidia-smi --query-compute-apps=pid --format=csv,noheader) ]] && return; sleep 1; done
  sv_say "warning: GPU still in use: $(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader |
    tr '\n' ' ')"
}

stop_servers() {  # the process groups of the servers started here (setsid: the pid is the group)
  local pid
  for pid; do kill -TERM -- "-$pid" 2>/dev/null; done
  for _ in $(seq 6); do kill -0 "$@" 2>/dev/null || break; sleep 1; done
  for pid; do kill -KILL -- "-$pid" 2>/dev/null; wait "$pid" 2>/dev/null; done
  free_gpu
}

# start_server NAME LOG CMD...: SV_PID (--dry-run: prints CMD)
start_server() {
  local name=$1 log=$2
  shift 2
  sv_say "$name: $*"
  if ((DRY)); then printf '+ %s &  > %s\n' "$*" "$log"; SV_PID=PID; return; fi
  setsid "${SV_ENV[@]}" "$@" > "$log" 2>&1 &
  SV_PID=$!
}

# serve_one NAME TP BACKEND GRAPH REFERENCE [SGLANG FLAGS]: one server, the client's run on it, stop it.
# RUN_MODEL, RUN_OT, RUN_REPEATS, RUN_EXTRA (client options) set for one call change that run only.
serve_one() {
  local name=$1 tp=$2 backend=$3 graph=$4 ref=$5 model=${RUN_MODEL:-$SV_MODEL} wait_s=$SV_WAIT extra=() nccl_free=()
  shift 5
  if (($(left) < 60)); then sv_say "$name: skipped (budget: $(left) s left)"; SV_SKIPPED+=("$name"); return; fi
  if ((SV_EXITS >= 2)); then
    sv_say "$name: skipped (the last $SV_EXITS servers exited before they were ready)"; SV_SKIPPED+=("$name"); return
  fi
  [[ $graph == true ]] || extra=(--disable-cuda-graph)
  [[ " $* " == *nccl-free* ]] && nccl_free=(--nccl-free)
  (($(left) < wait_s)) && wait_s=$(left)
  local port=$((31000 + RANDOM % 2000)) log=$SV_LOGS/server-$name.log
  local cmd=(python3 -m sglang.launch_server --model-path "$model" --load-format dummy --tp-size "$tp" --port "$port"
             "${SERVE_COMMON[@]}" "${extra[@]}" "$@")
  start_server "$name" "$log" "${cmd[@]}"
  local client=(python3 tools/serve_client.py run --url "http://127.0.0.1:$port" --log "$log" --pid "$SV_PID"
                --name "$name" --out "$SV_RUNS_DIR/$name.json" --backend "$backend" --tp "$tp"
                --model "$(basename "$model")" --cuda-graph "$graph" --reference "$ref" --prompts "$SV_PROMPTS"
                --output-tokens "${RUN_OT:-$SV_OT}" --repeats "${RUN_REPEATS:-$SV_REPEATS}" --wait "$wait_s"
                --timeout 150 --command "${cmd[*]}" "${nccl_free[@]}")
  # shellcheck disable=SC2086  # RUN_EXTRA: client options, one word each
  run "$SV_DIR/summary.txt" "$SV_DIR/summary.txt" timeout $((wait_s + 200)) "${SV_ENV[@]}" "${client[@]}" ${RUN_EXTRA}
  ((DRY)) && return
  stop_servers "$SV_PID"
  SV_EXITS=$((SV_EXITS + 1))
  grep -q "server process exited" "$SV_RUNS_DIR/$name.json" 2>/dev/null || SV_EXITS=0
  grep -E "Error|error|Traceback" "$log" | grep -v "INFO" | tail -4 >> "$SV_DIR/summary.txt"
}

# serve_fault NAME GRAPH: TP=2 NCCL-free with purlin (timeout_s FAULT_TIMEOUT_S), TP rank 1's scheduler SIGKILLed
# while it decodes (serve_client.py fault); the record goes to SV_DIR/NAME.json, not among the token runs.
FAULT_TIMEOUT_S=20
serve_fault() {
  local name=$1 graph=$2 extra=()
  if (($(left) < 150)); then sv_say "$name: skipped (budget: $(left) s left)"; SV_SKIPPED+=("$name"); return; fi
  local cfg=$SV_LOGS/purlin-fault.yaml port=$((35000 + RANDOM % 1000)) log=$SV_LOGS/server-$name.log
  ((DRY)) || sed "s/^timeout_s:.*/timeout_s: $FAULT_TIMEOUT_S/" configs/purlin-nccl-free.yaml > "$cfg"
  if [[ $graph == true ]]; then extra=(--disable-prefill-cuda-graph); else extra=(--disable-cuda-graph); fi
  local cmd=(python3 -m sglang.launch_server --model-path "$SV_MODEL" --load-format dummy --tp-size 2 --port "$port"
             "${SERVE_COMMON[@]}" "${extra[@]}" --mem-fraction-static 0.25 --comm-backend purlin --purlin-config "$cfg"
             --purlin-nccl-free)
  # SGLang's crash handler waits 60 s for CUDA core dumps before it exits (a debugging aid): off here
  SV_ENV+=(SGLANG_CUDA_COREDUMP_BEFORE_CRASH=0)
  start_server "$name" "$log" "${cmd[@]}"
  unset 'SV_ENV[-1]'
  local client=(python3 tools/serve_client.py fault --url "http://127.0.0.1:$port" --log "$log" --pid "$SV_PID"
                --name "$name" --out "$SV_DIR/$name.json" --tp 2 --victim 1 --cuda-graph "$graph"
                --timeout-s "$FAULT_TIMEOUT_S" --wait "$SV_WAIT" --command "${cmd[*]}")
  run "$SV_DIR/summary.txt" "$SV_DIR/summary.txt" timeout $((SV_WAIT + 300)) "${SV_ENV[@]}" "${client[@]}" ||
    SV_FAULT_FAILED+=("$name")
  ((DRY)) && return
  stop_servers "$SV_PID"
}

# TP=1, the default server and purlin's (YAML switch) up at once, driven in turns (serve_client.py ab)
serve_pair() {
  if (($(left) < 150)); then sv_say "tp1pair: skipped (budget: $(left) s left)"; SV_SKIPPED+=(tp1pair); return; fi
  local pa=$((33000 + RANDOM % 1000)) la=$SV_LOGS/server-tp1pair-nccl.log lb=$SV_LOGS/server-tp1pair-purlin.log
  local pb=$((pa + 1000)) pida pidb
  local ca=(python3 -m sglang.launch_server --model-path "$SV_MODEL" --load-format dummy --tp-size 1 --port "$pa"
            "${SERVE_COMMON[@]}" --mem-fraction-static 0.3)
  # B starts once A is up: --mem-fraction-static counts every process's use of the GPU, so B's 0.62 is
  # A's share (about 0.32 with its graphs) and 0.3 of its own; started together, the second to load
  # may find no memory left for its KV cache
  local cb=(python3 -m sglang.launch_server --model-path "$SV_MODEL" --load-format dummy --tp-size 1 --port "$pb"
            "${SERVE_COMMON[@]}" --mem-fraction-static 0.62 --config configs/purlin-sglang.yaml)
  start_server tp1pair-A "$la" "${ca[@]}"
  pida=$SV_PID
  if ((!DRY)); then
    for _ in $(seq "$SV_WAIT"); do
      grep -q "$READY" "$la" 2>/dev/null && break
      kill -0 "$pida" 2>/dev/null || break
      sleep 1
    done
  fi
  start_server tp1pair-B "$lb" "${cb[@]}"
  pidb=$SV_PID
  local client=(python3 tools/serve_client.py ab --urls "http://127.0.0.1:$pa,http://127.0.0.1:$pb" --names nccl,purlin
                --logs "$la,$lb" --pids "$pida,$pidb" --out "$SV_DIR/tp1pair-ab.json" --prompts "$SV_AB_PROMPTS"
                --output-tokens "$SV_AB_OT" --rounds "$SV_AB_ROUNDS" --wait "$SV_WAIT"
                --command "A = ${ca[*]} | B = ${cb[*]}")
  run "$SV_DIR/summary.txt" "$SV_DIR/summary.txt" timeout $(($(left) + 100)) "${SV_ENV[@]}" "${client[@]}"
  ((DRY)) || stop_servers "$pida" "$pidb"
}

# purlin-sglang bench offline --compare nccl,purlin at TP 1 or 2
serve_offline() {
  local tp=$1 out=$SV_LOGS/offline-tp$1 lim=$(($(left) + 40)) purlin sglang
  if (($(left) < 120)); then
    sv_say "offline-tp$tp: skipped (budget: $(left) s left)"; SV_SKIPPED+=("offline-tp$tp"); return
  fi
  ((lim > 560)) && lim=560
  purlin=(--model-path "$SV_MODEL" --load-format dummy --num-prompts 64 --random-input-len 128 --random-output-len 64
          --seed 42 --timeout 240 --tp "$tp" --compare nccl,purlin --out "$out")
  sglang=(--attention-backend triton --sampling-backend pytorch --grammar-backend none --disable-radix-cache
          --cuda-graph-max-bs-decode 16 --random-seed 42)
  if ((tp == 1)); then purlin+=(--purlin-config configs/purlin.yaml); sglang+=(--mem-fraction-static 0.6)
  else purlin+=(--nccl-free --purlin-config configs/purlin-nccl-free.yaml)
       sglang+=(--mem-fraction-static 0.25 --disable-cuda-graph); fi
  sv_say "offline-tp$tp"
  run "$out.txt" "$out.txt" timeout "$lim" "${SV_ENV[@]}" python3 -m purlin_sglang bench offline "${purlin[@]}" -- \
    "${sglang[@]}"
  sv_say "offline-tp$tp rc=$?"
  ((DRY)) && return
  tail -14 "$out.txt" >> "$SV_DIR/summary.txt"
  cp "$out/offline.png" "$SV_DIR/offline-tp$tp.png" 2>/dev/null
}

serve_run() {  # one named run
  local name=$1 tp=${1:2:1} mem=0.25 moe=configs/models/qwen3-moe-4l
  [[ $tp == 4 ]] && mem=0.14
  case $name in
    tp1-nccl) serve_one "$name" 1 nccl true "" --mem-fraction-static 0.6 ;;
    tp1-purlin-yaml)
      serve_one "$name" 1 purlin true tp1-nccl --mem-fraction-static 0.6 --config configs/purlin-sglang.yaml ;;
    tp?-gloo-ref) serve_one "$name" "$tp" nccl false "" --mem-fraction-static $mem --purlin-nccl-free ;;
    tp?-purlin-eager) serve_one "$name" "$tp" purlin false "tp$tp-gloo-ref" --mem-fraction-static $mem \
      --config configs/purlin-sglang-nccl-free.yaml ;;
    tp?-purlin-graph) serve_one "$name" "$tp" purlin true "tp$tp-gloo-ref" --mem-fraction-static $mem \
      --config configs/purlin-sglang-nccl-free.yaml --disable-prefill-cuda-graph ;;  # decode graphs
    tp?-nccl) serve_one "$name" "$tp" nccl true "" --mem-fraction-static 0.6 ;;
    tp?-purlin) serve_one "$name" "$tp" purlin true "tp$tp-nccl" --mem-fraction-static 0.6 \
      --config configs/purlin-sglang.yaml ;;
    tp1-nccl-?) RUN_OT=$SV_AB_OT RUN_REPEATS=5 serve_one "$name" 1 nccl true "" --mem-fraction-static 0.6 ;;
    tp1-purlin-flag-a) RUN_OT=$SV_AB_OT RUN_REPEATS=5 serve_one "$name" 1 purlin true tp1-nccl-a \
      --mem-fraction-static 0.6 --comm-backend purlin --purlin-config configs/purlin.yaml ;;
    tp1-purlin-yaml-b) RUN_OT=$SV_AB_OT RUN_REPEATS=5 serve_one "$name" 1 purlin true tp1-nccl-b \
      --mem-fraction-static 0.6 --config configs/purlin-sglang.yaml ;;
    tp1pair) serve_pair ;;
    det-tp2-purlin) RUN_EXTRA="--alone $SV_PROMPTS" serve_one "$name" 2 purlin false tp2-gloo-ref \
      --mem-fraction-static 0.25 --config configs/purlin-sglang-nccl-free.yaml --enable-deterministic-inference ;;
    moe-tp1-nccl) RUN_MODEL=$moe serve_one "$name" 1 nccl false "" --mem-fraction-static 0.5 ;;
    moe-tp2-gloo-ref) RUN_MODEL=$moe serve_one "$name" 2 nccl false "" --mem-fraction-static 0.25 --purlin-nccl-free ;;
    moe-tp2-purlin-eager) RUN_MODEL=$moe serve_one "$name" 2 purlin false moe-tp2-gloo-ref \
      --mem-fraction-static 0.25 --config configs/purlin-sglang-nccl-free.yaml ;;
    # expert parallelism: SGLang's own MoE path on gloo (EP shards differ from TP shards: its own
    # reference), then purlin as the MoE dispatcher (the YAML's moe-a2a-backend: purlin)
    moe-ep2-gloo-ref) RUN_MODEL=$moe serve_one "$name" 2 nccl false "" --mem-fraction-static 0.25 \
      --purlin-nccl-free --ep-size 2 --moe-a2a-backend none ;;
    moe-ep2-purlin-dispatch) RUN_MODEL=$moe serve_one "$name" 2 purlin false moe-ep2-gloo-ref \
      --mem-fraction-static 0.25 --config configs/purlin-sglang-moe-nccl-free.yaml --ep-size 2 ;;
    # decode CUDA graphs with purlin as the MoE dispatcher through SGLang's own flag
    moe-ep2-purlin-graph) RUN_MODEL=$moe serve_one "$name" 2 purlin true moe-ep2-gloo-ref --mem-fraction-static 0.25 \
      --config configs/purlin-sglang-moe-nccl-free.yaml --ep-size 2 --moe-a2a-backend purlin --disable-prefill-cuda-graph ;;
    moe-ep4-gloo-ref) RUN_MODEL=$moe serve_one "$name" 4 nccl false "" --mem-fraction-static 0.14 \
      --purlin-nccl-free --ep-size 4 --moe-a2a-backend none ;;
    moe-ep4-purlin-graph) RUN_MODEL=$moe serve_one "$name" 4 purlin true moe-ep4-gloo-ref --mem-fraction-static 0.14 \
      --config configs/purlin-sglang-moe-nccl-free.yaml --ep-size 4 --moe-a2a-backend purlin --disable-prefill-cuda-graph ;;
    fault-tp2-eager) serve_fault "$name" false ;;
    fault-tp2-graph) serve_fault "$name" true ;;
    offline-tp?) serve_offline "${name#offline-tp}" ;;
  esac
}

step_serve() {
  parse_serve "$@" || { RESULT=$WHY; return 1; }
  need_build || return 1
  SV_DIR=$OUT_DIR/$TAG SV_LOGS=$WORK/serve-logs SV_EXITS=0 SV_SKIPPED=() SV_FAULT_FAILED=()
  SV_RUNS_DIR=$SV_LOGS/runs
  # PYTHONSAFEPATH: no process (nor the benchmark's children) puts the working directory first on
  # sys.path, so the build is imported and not this checkout's sources. The sglang-kernel wheel that
  # links against this machine's torch may be older than the one sglang asks for: its check is off.
  SV_ENV=(env "$(site new)" "PATH=$WORK/deps/bin:$PATH" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONSAFEPATH=1
          SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK=0 SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1)
  ((DRY)) || { rm -rf "$SV_LOGS" && mkdir -p "$SV_RUNS_DIR" "$SV_DIR"; } || return 1
  run "$SV_LOGS/imports.log" "$SV_LOGS/imports.log" "${SV_ENV[@]}" python3 -c 'import importlib.metadata as md, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())
for d in ("sglang", "sglang-kernel", "transformers", "purlin-sglang", "triton"):
    try:
        print("version", d, md.version(d))
    except md.PackageNotFoundError:
        print("version", d, "not installed")
from sglang.srt.plugins import load_plugins
from purlin_sglang.sglang import plugin
load_plugins()
print("hooks missing:", plugin.missing_hooks())' || {
    cp "$SV_LOGS/imports.log" "$SV_DIR/" 2>/dev/null
    RESULT="sglang or the plugin does not import ($TAG/imports.log)"; return 1; }
  local name
  for name in "${SV_LIST[@]}"; do serve_run "$name"; done
  RESULT="runs: ${SV_LIST[*]}"
  run "$SV_DIR/summary.txt" "$SV_DIR/summary.txt" "${SV_ENV[@]}" python3 tools/serve_client.py compare \
    --runs "$SV_RUNS_DIR" --out "$SV_DIR/serving.json"
  local rc=$?
  ((DRY)) || tar -czf "$SV_DIR/logs.tgz" -C "$WORK" serve-logs 2>/dev/null
  ((DRY)) || RESULT="$(grep '^compare:' "$SV_DIR/summary.txt" | tail -1)"
  ((${#SV_FAULT_FAILED[@]})) && RESULT+="; fault runs failed: ${SV_FAULT_FAILED[*]}" && rc=1
  ((${#SV_SKIPPED[@]})) && RESULT+="; not run: ${SV_SKIPPED[*]}" && rc=1
  return $rc
}
