#!/usr/bin/env bash
# The device runner: all GPU work on this repository from one command line (bash tools/gpu.sh --help).
# The helpers the steps share come first, then one function a step (step_NAME), then the main loop.
# It reads nothing outside the repository that its command line does not name.
set -o pipefail

usage() {
  cat <<'EOF'
usage: bash tools/gpu.sh [OPTIONS] STEP [ARGS...] [STEP [ARGS...] ...]

Builds this tree on a machine with a CUDA GPU and runs its GPU tests, benchmarks, SGLang serving
runs and A/B comparisons against a baseline built in the same call. It works in the repository that
holds it, wherever it is called from: relative paths on its command line are taken from the
repository root. Each step prints one line, "STEP  ok|FAIL|skip  SECONDS  what it found" (a failed
step adds the end of its log), and leaves its log and results under --out. The first failing step
ends the run (--keep-going: run the rest). Exit status: 0 when every step went well, 1 when one
failed or did not run, 2 for a command line it cannot use (nothing runs then).

Options (before the first step):
  --wheels DIR     wheels this machine lacks (pydantic, ...; for serve: sglang and the packages it
                   imports), installed by setup into a private site dir; repeatable; default .whl
  --out DIR        logs and results (default: $OUT, else WORK/out)
  --work DIR       scratch: the site dirs and builds (default /tmp/purlin-gpu); on a machine kept
                   between calls, setup and ab rebuild only what changed
  --base REF       the baseline of ab: a git ref, or a .tar.gz made by pack-base (default:
                   base.tar.gz in the first --wheels DIR where pack-base wrote one, else the
                   merge-base of HEAD and main)
  --budget SECONDS no step starts after SECONDS and a running one is stopped then (default: no
                   limit; for a 600 s device call, --budget 540)
  --keep-going     run every step, even after one failed
  --pack           at the end, pack everything under --out into OUT/out.tar.gz (one file to fetch)
  --dry-run        print the commands the steps would run; run nothing, write nothing
  -h, --help       this text

Steps (a step's ARGS are the words up to the next step name, but for ab's MODE; to pass a word that
is a step name, attach it to its option, e.g. -kmoe):
  setup                  install the wheels, build and install this tree (python3 -m pip install
                         --no-build-isolation --no-deps --target WORK/new .), print GPU and driver
  test [PYTEST-ARGS]     the GPU tests, PURLIN_REQUIRE_GPU=1 (a GPU test that skips fails);
                         default tests/gpu; --part K/N: the K-th of N contiguous parts of them
                         (tests/gpu with setup outlasts one 600 s call: --part 1/2, then 2/2)
  demo [ARGS]            purlin-sglang demo [ARGS] -> OUT/demo.json
  collectives [ARGS]     purlin-sglang bench collectives [ARGS] -> OUT/collectives/
  moe [ARGS]             purlin-sglang bench moe [ARGS] -> OUT/moe/
  engine [ARGS]          benchmarks/bench_cuda_engine.py [ARGS] -> OUT/engine.json
  tune [--install] [ARGS]
                         purlin-sglang tune --device cuda [ARGS] -> OUT/tune.json; --install: the
                         built tree's table for this GPU is replaced by it, for the steps after it
  script FILE [ARGS]     a Python file of the repo against the build (e.g. benchmarks/NAME.py);
  script -m MODULE [ARGS]
                         a module of the build (e.g. -m purlin_sglang.bench.moe_parts)
  ncu [--kernel REGEX] [--skip N] [--count N] ARGS
                         Nsight Compute over `purlin-sglang ARGS` (e.g. bench moe --world 1 ...): the
                         kernels whose names match REGEX (default moe_dispatch), COUNT launches
                         (default 2) after SKIP (default 10); sections SpeedOfLight,
                         MemoryWorkloadAnalysis, WarpStateStats, LaunchStats, Occupancy; clocks left
                         alone (--clock-control none) -> OUT/ncu/report.ncu-rep, OUT/ncu/details.txt.
                         ncu runs one kernel at a time: ranks of a virtual world whose kernels wait
                         for each other time out under it, so profile one rank (--world 1). The
                         last step: every word after ncu is its own (bench moe ...)
  serve [OPTIONS]        SGLang servers of configs/models/ with the default backend and with purlin,
                         tokens checked against a reference -> OUT/serve/ (options below)
  ab MODE [--rounds N] [--run-limit SECONDS] [ARGS]
                         this build against the baseline (--base), built in the same call, each in
                         its own processes, alternating, N rounds (default 3); the scripts of this
                         tree time both -> OUT/ab/, the table OUT/ab/table.md (a second ab step of
                         the run: OUT/ab-2/, and so on); --run-limit: each benchmark run is stopped
                         after SECONDS and counts as failed, so one that hangs does not spend the
                         rest of the budget. MODE:
                           graph        benchmarks/bench_graph_ab.py (packet path, CUDA graphs)
                           eager        benchmarks/bench_eager_host.py (host time of an eager call)
                           engine       benchmarks/bench_cuda_engine.py
                           collectives  purlin-sglang bench collectives (each build's own)
                           moe          purlin-sglang bench moe (each build's own)
                           parts        benchmarks/bench_staged_parts.py
                           kernel       collectives --world 8 --sizes 1K,8K,64K,512K --modes graph
                                        --baselines none, then parts --worlds 2,8
                         ARGS go to the benchmark (kernel: to bench collectives)
  pack-base              (where the git history is) write --base as base.tar.gz into the first
                         --wheels DIR, for an ab on a machine that gets no history

serve options:
  --runs LIST            runs or groups of runs, in this order, each run once (default tp1,tp2):
                           core      tp1-nccl tp2-gloo-ref tp2-purlin-eager tp1-purlin-yaml
                                     tp2-purlin-graph
                           tp1       tp1-nccl tp1-purlin-yaml (CUDA graphs on)
                           tp2, tp4  TP ranks on one GPU without NCCL (--purlin-nccl-free): a gloo
                                     reference, purlin eager, purlin with decode graphs; with
                                     --gpu-per-rank: tpN-nccl, tpN-purlin
                           tp1ab     default, purlin (flag), default, purlin (YAML), interleaved
                           tp1pair   the default server and purlin's up at once, driven in turns:
                                     a throughput ratio with its 95% interval
                           det       TP=2 purlin with --enable-deterministic-inference: every
                                     prompt served alone too (batch invariance)
                           moe       configs/models/qwen3-moe-4l at TP=1, TP=2, then EP=2 with
                                     purlin as the MoE dispatcher; moe-ep: the EP=2 pair only
                           moe-graph EP=2 and EP=4 (a gloo reference, then purlin through
                                     --moe-a2a-backend purlin with decode CUDA graphs)
                           fault     TP=2 NCCL-free with purlin (timeout_s 20), eager and with
                                     decode graphs: TP rank 1's scheduler SIGKILLed while decoding;
                                     the server must exit within timeout_s + 15 s, its log naming
                                     purlin's error if it outlived timeout_s, no process left on the
                                     GPU (serve_client.py fault; SGLANG_CUDA_COREDUMP_BEFORE_CRASH=0)
                           offline   purlin-sglang bench offline --compare nccl,purlin, TP=1 and 2
  --model DIR            the dense model (default configs/models/olmo-dense-8l)
  --prompts N  --output-tokens N  --repeats N
                         each run's batch (16 prompts, 32 tokens, 3 timed repeats)
  --wait SECONDS         how long a server may take to be ready (240)
  --ab-rounds N  --ab-prompts N  --ab-output-tokens N
                         tp1pair's rounds and batch (12, 64, 128; tp1ab uses the output tokens)
  --gpu-per-rank         a GPU per rank: tp2 and tp4 run with NCCL, one process per GPU

Environment: CUDA_MODULE_LOADING=EAGER, NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1 and PYTHONUNBUFFERED=1 unless set; PURLIN_* build switches (e.g.
PURLIN_WITH_NVSHMEM=OFF) reach the build and count in its stamp.

Examples:
  bash tools/gpu.sh --budget 540 setup test
  bash tools/gpu.sh setup test tests/gpu/test_packets.py -x collectives --world 8 --sizes 8K,1M
  bash tools/gpu.sh --base main pack-base          # where the history is; then carry .whl
  bash tools/gpu.sh --budget 540 setup ab graph ab eager --rounds 5
  bash tools/gpu.sh --wheels .whl --wheels .serve setup serve --runs core
EOF
}

# ---------------------------------------------------------------- shared helpers

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd) || exit 2
cd "$ROOT" || exit 2
STEPS=(setup test demo collectives moe engine tune script ncu serve ab pack-base)
AB_MODES=(graph eager engine collectives moe parts kernel)
WHEELS=() OUT_DIR="" WORK=/tmp/purlin-gpu BASE="" BUDGET=0 KEEP_GOING=0 PACK=0 DRY=0 RUN_LIMIT=0
T_START=$SECONDS

die_usage() {
  printf 'gpu.sh: %s\n' "$*" >&2
  printf "run 'bash tools/gpu.sh --help' for the steps and their options\n" >&2
  exit 2
}

is_in() { local x=$1 y; shift; for y; do [[ $x == "$y" ]] && return 0; done; return 1; }

count_ok() { [[ $1 =~ ^[1-9][0-9]*$ ]]; }

left() { if ((BUDGET)); then echo $((BUDGET - (SECONDS - T_START))); else echo 999999; fi; }

site() { echo "PYTHONPATH=$WORK/$1:$WORK/deps"; }  # the environment of a build: new, base

last_line() {  # a log's last line that says something (pytest's summary, a bench's "wrote ...")
  grep -v '^[[:space:]]*$' "$1" 2>/dev/null | tail -1 | sed 's/^=* *//; s/ *=*$//' | cut -c1-160
  return 0
}

shell_words() {  # the words as a shell reads them back: quoted only where they need it
  local w
  for w; do if [[ $w =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then printf ' %s' "$w"; else printf ' %q' "$w"; fi; done
}

# run STDOUT STDERR CMD...: CMD with its output appended to the files (the same file twice: both to
# it), stopped when the budget is spent; --dry-run prints it instead
run() {
  local out=$1 err=$2 lim=() secs
  shift 2
  secs=$(left)
  ((RUN_LIMIT && RUN_LIMIT < secs)) && secs=$RUN_LIMIT
  ((BUDGET || RUN_LIMIT)) && lim=(timeout --kill-after=10 "$secs")
  if ((DRY)); then
    printf '+'; shell_words "${lim[@]}" "$@"; printf '  > %s\n' "$out"
    return 0
  fi
  (($(left) > 0)) || { STOPPED=1; return 124; }
  if [[ $out == "$err" ]]; then "${lim[@]}" "$@" >> "$out" 2>&1; else "${lim[@]}" "$@" >> "$out" 2>> "$err"; fi
  local rc=$?
  ((BUDGET && rc >= 124 && $(left) <= 0)) && STOPPED=1  # timeout's 124, or 137 after --kill-after
  return $rc
}

need_build() {
  if ((DRY)) || [[ -d $WORK/new/purlin_sglang ]]; then return 0; fi
  RESULT="no build in $WORK/new: run the setup step first (in this call or an earlier one on this machine)"
  return 1
}

# what a build depends on: its sources and the PURLIN_* build switches
tree_stamp() {
  { env | grep '^PURLIN_' | sort
    find "$1"/pyproject.toml "$1"/CMakeLists.txt "$1"/native "$1"/purlin_sglang -type f \
      \( -name '*.py' -o -name '*.json' -o -name '*.txt' -o -name '*.toml' -o -name '*.cmake' -o -name '*.[ch]' \
         -o -name '*.[ch]pp' -o -name '*.cc' -o -name '*.cu' -o -name '*.cuh' \) -not -path '*/__pycache__/*' \
      -print0 2>/dev/null | sort -z | xargs -0 cat; } | md5sum | cut -c1-16
}

# build_into LABEL SRC STAMP LOG: build and install the tree SRC into WORK/LABEL, unless a build of
# the same STAMP is there already; NOTE says which
build_into() {
  local label=$1 src=$2 stamp=$3 log=$4 t0=$SECONDS
  if ((!DRY)) && [[ -d $WORK/$label/purlin_sglang && $(cat "$WORK/$label.stamp" 2>/dev/null) == "$stamp" ]]; then
    NOTE="build reused"
    return 0
  fi
  ((DRY)) || rm -rf "${WORK:?}/$label" "$WORK/$label.stamp"
  run "$log" "$log" env "PYTHONPATH=$WORK/deps" "CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
    python3 -m pip install --no-build-isolation --no-deps --target "$WORK/$label" "$src" || return 1
  ((DRY)) || echo "$stamp" > "$WORK/$label.stamp"
  NOTE="build $((SECONDS - t0)) s"
}

install_wheels() {
  local files=() d stamp pip
  for d in "${WHEELS[@]}"; do files+=("$d"/*.whl); done
  stamp=$(ls -lL "${files[@]}" | md5sum | cut -c1-16)
  if ((!DRY)) && [[ $(cat "$WORK/deps.stamp" 2>/dev/null) == "$stamp" ]]; then
    NOTE="${#files[@]} wheels reused"
    return 0
  fi
  pip=(python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/deps")
  if ! run "$LOG" "$LOG" "${pip[@]}" "${files[@]}"; then
    # pip refuses a wheel whose platform tag is newer than this glibc (sglang's manylinux_2_34 on an
    # older one); named tags make it install without that check
    local tags=(--only-binary=:all: --implementation cp
                --python-version "$(python3 -c 'import sys; print(*sys.version_info[:2], sep="")')")
    for d in 5 12 17 24 26 27 28 31 34; do tags+=(--platform "manylinux_2_${d}_x86_64"); done
    run "$LOG" "$LOG" "${pip[@]}" "${tags[@]}" --platform manylinux2014_x86_64 "${files[@]}" || return 1
  fi
  ((DRY)) || echo "$stamp" > "$WORK/deps.stamp"
  NOTE="${#files[@]} wheels"
}

# the baseline of ab: BASE_KIND (git or archive), BASE_SRC (a commit or a file), BASE_NAME; else WHY
git_here() { [[ $(git -C "$ROOT" rev-parse --show-toplevel 2>/dev/null) == "$ROOT" ]]; }

resolve_ref() {
  local ref=$BASE what
  what=${BASE:-the merge-base of HEAD and main}
  [[ -n $ref ]] || ref=$(git -C "$ROOT" merge-base HEAD main 2>/dev/null) || {
    WHY="no --base given and no merge-base of HEAD and main here: pass --base REF"; return 1; }
  BASE_SRC=$(git -C "$ROOT" rev-parse --verify -q "$ref^{commit}") || {
    WHY="--base $ref: not a commit here"; return 1; }
  BASE_KIND=git BASE_NAME="${BASE_SRC:0:10} ($what)"
}

base_archive() {  # an archive of git archive names its commit in its header
  BASE_KIND=archive BASE_SRC=$1
  local commit
  commit=$(python3 -c 'import sys, tarfile; print(tarfile.open(sys.argv[1]).pax_headers.get("comment", "?")[:10])' \
    "$1" 2>/dev/null) || commit="not a tar archive"
  BASE_NAME="$1 ($commit)"
}

resolve_base() {  # no --base: a packed base first (the device's copy of the history may name an older main)
  local archive="${WHEELS[0]}/base.tar.gz"
  if [[ -n $BASE && -f $BASE ]]; then base_archive "$BASE"; return 0; fi
  if [[ -z $BASE && -f $archive ]]; then base_archive "$archive"; return 0; fi
  if git_here; then resolve_ref; return; fi
  if [[ -n $BASE ]]; then WHY="--base $BASE: no such file, and no git history here to find it in"
  else WHY="no --base, no git history here and no $archive"; fi
  WHY+="; where the history is, run 'bash tools/gpu.sh --base REF pack-base' (it writes ${WHEELS[0]}/base.tar.gz)"
  WHY+=" and carry ${WHEELS[0]}"
  return 1
}

# ---------------------------------------------------------------- steps
# Each sets RESULT (its line) and returns non-zero when it failed. TAG: its name in OUT; LOG: its log, or
# where a step writes its commands' output elsewhere, the log that tells why it failed (its end is shown).

step_setup() {
  local gpu notes
  if ((DRY)); then gpu="GPU (dry run)"
  elif ! gpu=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -1) || [[ -z $gpu ]]; then
    RESULT="no GPU here: nvidia-smi says '${gpu:-nothing}'"
    return 1
  fi
  install_wheels || { RESULT="the wheels did not install (setup.log)"; return 1; }
  notes=$NOTE
  LOG=$OUT_DIR/build.log
  build_into new "$ROOT" "$(tree_stamp "$ROOT")" "$LOG" || { RESULT="build failed (build.log)"; return 1; }
  notes+="; $NOTE"
  LOG=$OUT_DIR/info.log
  run "$LOG" "$LOG" env "$(site new)" python3 -P -m purlin_sglang info || {
    RESULT="the build does not import (info.log)"; return 1; }
  if ((!DRY)) && ! grep -q "^native library: *built with CUDA" "$LOG"; then
    RESULT="built without CUDA: $(grep '^native library' "$LOG" | tr -s ' ' | cut -c1-120) (build.log)"
    LOG=$OUT_DIR/build.log
    return 1
  fi
  RESULT="$gpu; $notes"
}

step_test() {
  need_build || return 1
  local args=("$@") a paths=0
  for a in "${args[@]}"; do [[ $a != -* && -e ${a%%::*} ]] && paths=1; done
  ((paths)) || args+=(tests/gpu)  # no test path given (none, or options only: -x, --part 1/2): tests/gpu
  local failures=$OUT_DIR/$TAG-failures.log  # written as tests fail (tests/conftest.py): kept by a stop
  ((DRY)) || rm -f "$failures"
  run "$LOG" "$LOG" env PURLIN_REQUIRE_GPU=1 PURLIN_FAILURE_LOG="$failures" "$(site new)" python3 -P -m pytest -q \
    -p no:cacheprovider -rfEs --tb=short "${args[@]}"
  local rc=$?
  RESULT=$(last_line "$LOG")
  if [[ -s $failures ]]; then
    RESULT+="; failed so far: $(grep -c '^FAILED ' "$failures") ($TAG-failures.log: $(grep -m1 '^FAILED ' "$failures" \
      | cut -c8-))"
  fi
  return $rc
}

# a purlin-sglang command of the build: cli_step OUTPUT_OPTION OUTPUT COMMAND...
cli_step() {
  need_build || return 1
  local opt=$1 dst=$2
  shift 2
  run "$LOG" "$LOG" env "$(site new)" python3 -P -m purlin_sglang "$@" "$opt" "$dst"
  local rc=$?
  RESULT=$(last_line "$LOG")
  return $rc
}

step_demo() { cli_step --json "$OUT_DIR/$TAG.json" demo "$@"; }
step_collectives() { cli_step --out "$OUT_DIR/$TAG" bench collectives "$@"; }
step_moe() { cli_step --out "$OUT_DIR/$TAG" bench moe "$@"; }

step_tune() {
  local install=0 args=()
  for a; do if [[ $a == --install ]]; then install=1; else args+=("$a"); fi; done
  cli_step --out "$OUT_DIR/$TAG.json" tune --device cuda "${args[@]}" || return 1
  ((install)) || return 0
  # the table replaces the built tree's shipped table for this GPU and placement (or joins them)
  run "$LOG" "$LOG" env "$(site new)" python3 -P -c 'import os, shutil, sys
from purlin_sglang.snac.table import SHIPPED_DIR, load_table, shipped_tables
new = load_table(sys.argv[1])
same = [p for p in shipped_tables() if (t := load_table(p)).device == new.device and t.placement == new.placement]
dst = same[0] if same else os.path.join(SHIPPED_DIR, "tuned-" + os.path.basename(sys.argv[1]))
shutil.copyfile(sys.argv[1], dst)
print("installed as", dst)' "$OUT_DIR/$TAG.json" || { RESULT="tuned, but not installed ($TAG.log)"; return 1; }
  ((DRY)) || rm -f "$WORK/new.stamp"  # the build differs from its sources now: the next setup rebuilds it
  RESULT=$(last_line "$LOG")
}

# a Python file of the repo run as a script (its folder first on sys.path: benchmarks import siblings), or
# "-m MODULE": a module of the build (python3 -P -m MODULE)
py_step() {
  need_build || return 1
  run "$LOG" "$LOG" env "$(site new)" python3 "$@"
  local rc=$?
  RESULT=$(last_line "$LOG")
  return $rc
}

step_engine() { py_step benchmarks/bench_cuda_engine.py "$@" --json "$OUT_DIR/$TAG.json"; }
step_script() { if [[ $1 == -m ]]; then py_step -P "$@"; else py_step "$@"; fi; }

parse_ncu() {  # NCU_KERNEL NCU_SKIP NCU_COUNT NCU_ARGS from: [--kernel REGEX] [--skip N] [--count N] ARGS
  NCU_KERNEL=moe_dispatch NCU_SKIP=10 NCU_COUNT=2 NCU_ARGS=()
  while (($#)); do
    case $1 in
      --kernel) [[ -n $2 ]] || { WHY="ncu: --kernel needs a regular expression"; return 1; }; NCU_KERNEL=$2 ;;
      --skip) [[ $2 =~ ^[0-9]+$ ]] || { WHY="ncu: --skip needs a count (got '$2')"; return 1; }; NCU_SKIP=$2 ;;
      --count) count_ok "$2" || { WHY="ncu: --count needs a count of 1 or more (got '$2')"; return 1; }; NCU_COUNT=$2 ;;
      *) NCU_ARGS=("$@"); break ;;
    esac
    shift 2
  done
  ((${#NCU_ARGS[@]})) || { WHY="ncu: needs the purlin-sglang command to profile (e.g. bench moe --world 1)"; return 1; }
}

step_ncu() {
  parse_ncu "$@" || { RESULT=$WHY; return 1; }
  need_build || return 1
  local dir=$OUT_DIR/$TAG
  ((DRY)) || mkdir -p "$dir" || return 1
  run "$LOG" "$LOG" env "$(site new)" ncu --clock-control none --target-processes all \
    --kernel-name "regex:$NCU_KERNEL" --launch-skip "$NCU_SKIP" --launch-count "$NCU_COUNT" \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section LaunchStats \
    --section Occupancy --export "$dir/report" --force-overwrite \
    python3 -P -m purlin_sglang "${NCU_ARGS[@]}" || { RESULT="ncu failed: $(last_line "$LOG")"; return 1; }
  run "$dir/details.txt" "$LOG" ncu --import "$dir/report.ncu-rep" --page details || {
    RESULT="ncu could not read its report back"; return 1; }
  RESULT="$NCU_COUNT launches of /$NCU_KERNEL/ -> $TAG/details.txt"
}

step_pack_base() {
  local dir=${WHEELS[0]}
  ((DRY)) || mkdir -p "$dir"
  run "$LOG" "$LOG" git -C "$ROOT" archive --format=tar.gz -o "$dir/base.tar.gz" "$BASE_SRC" || {
    RESULT="git archive failed"; return 1; }
  RESULT="$dir/base.tar.gz: $BASE_NAME; carry $dir to the GPU machine"
}

# ab: the baseline build, then one function a mode: ab_MODE DIR LABEL ROUND [ARGS]
parse_ab() {
  AB_MODE=$1 AB_ROUNDS=3 AB_ARGS=() AB_RUN_LIMIT=0
  [[ -n $AB_MODE ]] || { WHY="ab: needs a MODE first: one of ${AB_MODES[*]}"; return 1; }
  is_in "$AB_MODE" "${AB_MODES[@]}" || { WHY="ab: mode '$AB_MODE' unknown: one of ${AB_MODES[*]}"; return 1; }
  shift
  while (($#)); do
    if [[ $1 == --rounds ]]; then
      count_ok "$2" || { WHY="ab: --rounds needs a count of 1 or more (got '$2')"; return 1; }
      AB_ROUNDS=$2
      shift 2
    elif [[ $1 == --run-limit ]]; then
      count_ok "$2" || { WHY="ab: --run-limit needs seconds, 1 or more (got '$2')"; return 1; }
      AB_RUN_LIMIT=$2
      shift 2
    else
      AB_ARGS+=("$1")
      shift
    fi
  done
}

ab_build_base() {
  local dir=$1 src=$WORK/base-src stamp
  if [[ $BASE_KIND == git ]]; then stamp=$BASE_SRC; else stamp=$(md5sum < "$BASE_SRC" | cut -c1-16); fi
  stamp+=" $(env | grep '^PURLIN_' | sort | md5sum | cut -c1-8)"
  if ((DRY)) || [[ $(cat "$WORK/base.stamp" 2>/dev/null) != "$stamp" ]]; then
    ((DRY)) || { rm -rf "$src" && mkdir -p "$src"; } || return 1
    if [[ $BASE_KIND == git ]]; then
      run "$dir/build-base.log" "$dir/build-base.log" git -C "$ROOT" archive --format=tar -o "$WORK/base-src.tar" \
        "$BASE_SRC" || return 1
      run "$dir/build-base.log" "$dir/build-base.log" tar -xf "$WORK/base-src.tar" -C "$src" || return 1
    else
      run "$dir/build-base.log" "$dir/build-base.log" tar -xzf "$BASE_SRC" -C "$src" || return 1
    fi
  fi
  build_into base "$src" "$stamp" "$dir/build-base.log"
}

ab_jsonl() {  # ab_jsonl NAME SCRIPT DIR LABEL ROUND [ARGS]: rows labelled by build, appended to NAME.jsonl
  local name=$1 script=$2 dir=$3 lab=$4
  shift 5
  run "$dir/$name.jsonl" "$dir/$name.err" env "$(site "$lab")" python3 "$script" --label "$lab" "$@"
}
ab_json() {  # ab_json NAME SCRIPT DIR LABEL ROUND [ARGS]: a JSON file a build and round
  local name=$1 script=$2 dir=$3 lab=$4 r=$5
  shift 5
  run "$dir/$name-$lab-$r.log" "$dir/$name-$lab-$r.log" env "$(site "$lab")" python3 "$script" "$@" \
    --json "$dir/$name-$lab-$r.json"
}
ab_graph() { ab_jsonl graph benchmarks/bench_graph_ab.py "$@"; }
ab_eager() { ab_jsonl eager benchmarks/bench_eager_host.py "$@"; }
ab_engine() { ab_json engine benchmarks/bench_cuda_engine.py "$@"; }
ab_parts() { ab_json parts benchmarks/bench_staged_parts.py "$@"; }
ab_bench() {  # ab_bench KIND DIR LABEL ROUND [ARGS]: each build's own `purlin-sglang bench KIND`
  local kind=$1 dir=$2 lab=$3 r=$4
  shift 4
  run "$dir/$kind-$lab-$r.log" "$dir/$kind-$lab-$r.log" env "$(site "$lab")" python3 -P -m purlin_sglang \
    bench "$kind" "$@" --out "$dir/$kind-$lab-$r"
}
ab_collectives() { ab_bench collectives "$@"; }
ab_moe() { ab_bench moe "$@"; }
ab_kernel() {
  ab_collectives "$1" "$2" "$3" --world 8 --sizes 1K,8K,64K,512K --modes graph --baselines none "${@:4}"
  local rc=$?
  ab_parts "$1" "$2" "$3" --worlds 2,8 && return $rc
}

step_ab() {
  parse_ab "$@" || { RESULT=$WHY; return 1; }
  need_build || return 1
  local dir=$OUT_DIR/$TAG r lab failed=0 kind  # a second ab step of the run: OUT/ab-2/
  if ((!DRY)); then  # this mode's records of an earlier run in the same --out
    mkdir -p "$dir" || return 1
    for kind in $([[ $AB_MODE == kernel ]] && echo collectives parts || echo "$AB_MODE"); do
      rm -rf "$dir/$kind".* "$dir/$kind"-*
    done
    rm -f "$dir/table.md"
  fi
  if ! ab_build_base "$dir"; then
    RESULT="the baseline $BASE_NAME did not build ($TAG/build-base.log)"
    LOG=$dir/build-base.log  # the log whose end the run shows
    return 1
  fi
  RUN_LIMIT=$AB_RUN_LIMIT  # the benchmark runs only, not the builds or the table
  for ((r = 1; r <= AB_ROUNDS; r++)); do
    for lab in $( ((r % 2)) && echo new base || echo base new); do  # the order flips every round
      "ab_$AB_MODE" "$dir" "$lab" "$r" "${AB_ARGS[@]}" || failed=$((failed + 1))
    done
  done
  RUN_LIMIT=0
  run "$dir/table.md" "$dir/table.md" python3 tools/results_table.py "$dir"
  RESULT="$AB_MODE: $AB_ROUNDS rounds, this build against $BASE_NAME; $failed runs failed; table $TAG/table.md"
  ((failed == 0))
}

# serve (the SGLang runs): tools/gpu_serve.sh
source "$ROOT/tools/gpu_serve.sh" || exit 2

# ---------------------------------------------------------------- command line, checks, main loop

parse_options() {
  while (($#)); do
    case $1 in
      -h | --help) usage; exit 0 ;;
      --keep-going) KEEP_GOING=1; shift; continue ;;
      --dry-run) DRY=1; shift; continue ;;
      --pack) PACK=1; shift; continue ;;
      --wheels | --out | --work | --base | --budget) (($# >= 2)) || die_usage "$1 needs a value" ;;
      -*) die_usage "unknown option '$1'" ;;
      *) break ;;
    esac
    case $1 in
      --wheels) WHEELS+=("$2") ;;
      --out) OUT_DIR=$2 ;;
      --work) WORK=$2 ;;
      --base) BASE=$2 ;;
      --budget) count_ok "$2" || die_usage "--budget needs seconds, 1 or more (got '$2')"; BUDGET=$2 ;;
    esac
    shift 2
  done
  ARGV=("$@")
}

# the steps: NAMES[i] with its arguments ARGV[FIRST[i]] .. (COUNT[i] words); the word after ab is its
# MODE, even where it is a step's name too (ab collectives, ab engine); ncu takes every word after it
split_steps() {
  NAMES=() FIRST=() COUNT=()
  local i n
  for i in "${!ARGV[@]}"; do
    n=${#NAMES[@]}
    if ((n)) && [[ ${NAMES[n - 1]} == ab ]] && ((COUNT[n - 1] == 0)); then
      COUNT[n - 1]=1
    elif ((n)) && [[ ${NAMES[n - 1]} == ncu ]]; then  # ncu is last: every word after it is its own
      COUNT[n - 1]=$((COUNT[n - 1] + 1))
    elif is_in "${ARGV[i]}" "${STEPS[@]}"; then
      NAMES+=("${ARGV[i]}") FIRST+=($((i + 1))) COUNT+=(0)
    elif ((n == 0)); then
      die_usage "unknown step '${ARGV[i]}' (steps: ${STEPS[*]})"
    else
      COUNT[n - 1]=$((COUNT[n - 1] + 1))
    fi
  done
  ((${#NAMES[@]})) || die_usage "no step given (steps: ${STEPS[*]})"
}

check_step() {  # check_step NAME ARGS...: what can be known before anything runs
  local name=$1 d
  shift
  case $name in
    setup | pack-base) (($# == 0)) || die_usage "$name takes no arguments (got '$*'; steps: ${STEPS[*]})" ;;&
    setup)
      for d in "${WHEELS[@]}"; do
        [[ -d $d ]] || die_usage "setup: --wheels $d: no such directory (put the wheels this machine lacks there," \
          "or pass --wheels DIR)"
        compgen -G "$d/*.whl" > /dev/null || die_usage "setup: --wheels $d: no .whl file in it"
      done ;;
    pack-base)
      git_here || die_usage "pack-base: needs the git history of this repository, which is not here"
      resolve_ref || die_usage "pack-base: $WHY" ;;
    script) [[ ($1 == *.py && -f $1) || ($1 == -m && $2 == [A-Za-z_]*) ]] ||
      die_usage "script: needs a Python file or -m MODULE first (got '${1:-nothing}')" ;;
    ab) parse_ab "$@" || die_usage "$WHY"; resolve_base || die_usage "ab: $WHY" ;;
    serve) parse_serve "$@" || die_usage "$WHY" ;;
    ncu) parse_ncu "$@" || die_usage "$WHY" ;;
  esac
}

report() {  # report TAG STATUS SECONDS TEXT
  printf '%-14s %-4s %5ss  %s\n' "$1" "$2" "$3" "$4"
}

main() {
  parse_options "$@"
  split_steps
  ((${#WHEELS[@]})) || WHEELS=(.whl)
  OUT_DIR=${OUT_DIR:-${OUT:-$WORK/out}}
  local i name tag t0 step_log failed=0
  for i in "${!NAMES[@]}"; do check_step "${NAMES[i]}" "${ARGV[@]:FIRST[i]:COUNT[i]}"; done
  : "${CUDA_MODULE_LOADING:=EAGER}" "${NCCL_NVLS_ENABLE:=0}" "${TORCH_SYMM_MEM_DISABLE_MULTICAST:=1}"
  : "${NVSHMEM_DISABLE_NVLS:=1}" "${PYTHONUNBUFFERED:=1}"
  export CUDA_MODULE_LOADING NCCL_NVLS_ENABLE TORCH_SYMM_MEM_DISABLE_MULTICAST NVSHMEM_DISABLE_NVLS PYTHONUNBUFFERED
  ((DRY)) || mkdir -p "$OUT_DIR" "$WORK" || exit 1
  declare -A seen=()
  for i in "${!NAMES[@]}"; do
    name=${NAMES[i]}
    seen[$name]=$((${seen[$name]:-0} + 1))
    tag=$name
    ((seen[$name] > 1)) && tag+="-${seen[$name]}"
    if [[ $name == script && ${ARGV[FIRST[i]]} == -m ]]; then tag+="-${ARGV[FIRST[i] + 1]##*.}"
    elif [[ $name == script ]]; then tag+="-$(basename "${ARGV[FIRST[i]]}" .py)"; fi
    if ((failed && !KEEP_GOING)); then report "$tag" skip 0 "not run: a step before it failed"; continue; fi
    if (($(left) <= 0)); then
      report "$tag" skip 0 "not run: the budget (--budget $BUDGET) is spent"
      failed=1
      continue
    fi
    TAG=$tag LOG=$OUT_DIR/$tag.log RESULT="" NOTE="" STOPPED=0 t0=$SECONDS
    step_log=$LOG
    ((DRY)) || : > "$LOG"
    if "step_${name//-/_}" "${ARGV[@]:FIRST[i]:COUNT[i]}"; then
      report "$tag" "$( ((DRY)) && echo dry || echo ok)" $((SECONDS - t0)) "$RESULT"
    else
      failed=1
      ((STOPPED)) && RESULT="stopped: the budget (--budget $BUDGET) is spent${RESULT:+; $RESULT}"
      report "$tag" FAIL $((SECONDS - t0)) "$RESULT"
      [[ -s $LOG ]] && tail -8 "$LOG" | cut -c1-200 | sed 's/^/    | /'
    fi
    [[ -s $step_log ]] || rm -f "$step_log"
  done
  if ((PACK && !DRY)); then
    (cd "$OUT_DIR" && find . -mindepth 1 -maxdepth 1 ! -name out.tar.gz -print0 | xargs -0r tar -czf out.tar.gz &&
      find . -mindepth 1 -maxdepth 1 ! -name out.tar.gz -exec rm -rf {} +) || failed=1
  fi
  exit $failed
}

main "$@"
