#!/usr/bin/env bash
# The whole GPU check in one prepared command (see CHECK.md), run again and again on the GPU host:
#
#   bash benchmarks/gpu/check_all.sh [--no-kit] [--only TASK...]
#
# 1. If benchmarks/gpu/transfer/ holds kit parts (carried in by this run), add them
#    (install_offline.sh add-part: each is checked against SHA256SUMS first).
# 2. If parts are still missing: say which, and stop (exit 0): stage the next part and run again.
# 3. If the kit is not installed yet: install_offline.sh install (~2 min).
# 4. The pending tasks below, in order, while the budget holds (GENLM_CHECK_BUDGET seconds from
#    this script's start, default 570): the environment, the controller step on CUDA, the
#    Qwen3-0.6B-shaped model (random weights, built here), rows against transformers float32
#    under both runners, then `python -m genlm_vlm bench` under both runners with CUDA graphs and
#    eager, and lm.smc's experimental requests path (--engine-path requests) under both runners. A task whose estimate no longer fits ends this run with "RESUME": run the same
#    command again. State lives in $GENLM_CHECK_STATE (default /tmp/genlm_gpu_check); after every
#    task each finished task's files are copied to $OUT/<task>/ with summary.txt. "ALL DONE":
#    finished. --no-kit: vLLM is importable already (e.g. pip install genlm-vlm[gpu]).
set -euo pipefail
T0=$(date +%s)
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
WH_ROOT="${GENLM_WH_ROOT:-/tmp/genlm_wheelhouse}"
STATE="${GENLM_CHECK_STATE:-/tmp/genlm_gpu_check}"
OUT="${OUT:-$STATE/out}"
BUDGET="${GENLM_CHECK_BUDGET:-570}"
PY="${PYTHON:-python3}"
KIT=1
ONLY=()
for a in "$@"; do
  case "$a" in
    --no-kit) KIT=0 ;;
    --only) ;;
    *) ONLY+=("$a") ;;
  esac
done
say() { echo "check_all: $*"; }

if [[ "$KIT" == 1 ]]; then
  if compgen -G "$HERE/transfer/part-*" >/dev/null; then
    bash "$HERE/install_offline.sh" add-part "$HERE/transfer" --root "$WH_ROOT"
  fi
  if ! bash "$HERE/install_offline.sh" status --root "$WH_ROOT"; then
    say "kit parts still missing (above): stage the next one (bash benchmarks/gpu/stage_part.sh N) and run this command again"
    exit 0
  fi
  if [[ ! -f "$WH_ROOT/INSTALLED" || ! -f "$WH_ROOT/env.sh" ]]; then
    bash "$HERE/install_offline.sh" install --root "$WH_ROOT"
  fi
  # shellcheck disable=SC1091
  source "$WH_ROOT/env.sh"
fi
export VLLM_USE_FLASHINFER_SAMPLER="${VLLM_USE_FLASHINFER_SAMPLER:-0}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export GENLM_VLM_CACHE="${GENLM_VLM_CACHE:-/tmp/genlm_gpu_models}"
cd "$ROOT"
mkdir -p "$STATE" "$OUT"

SHAPE=qwen3-0.6b
BENCH=(-m genlm_vlm bench --model-shape "$SHAPE" --workloads smc rows --n 64 256 1024 --reps 3 --no-progress --overwrite)
# lm.smc(engine_path="requests") against the default path, vLLM decode and structured outputs, every
# particle live (no resampling); the requests path needs synchronous scheduling, and every system
# gets the same option.
SMC_REQ=(-m genlm_vlm bench --model-shape "$SHAPE" --workloads smc --constraint steady --engine-path requests --n 64 256 1024 --max-tokens 48 --reps 3 --dtype bfloat16 --engine-opts async_scheduling=false --no-progress --overwrite)
# lm.smc(engine_path="requests", mask_overlap=True) beside the same path without it: the JSON schema's
# xgrammar masks computed on a worker thread during the forward (issue 47, item 7).
SMC_MASKS=(-m genlm_vlm bench --model-shape "$SHAPE" --workloads smc --constraint json --engine-path requests --mask-overlap --n 64 256 --max-tokens 48 --reps 3 --dtype bfloat16 --engine-opts async_scheduling=false --no-progress --overwrite)
# name | estimated seconds | VLLM_USE_V2_MODEL_RUNNER ("" = vLLM's choice) | python arguments (DIR: the task's folder)
TASKS=(
  "env|10||-c import genlm_vlm.bench.systems as s, torch, vllm, json; print(json.dumps({'torch': torch.__version__, 'vllm': vllm.__version__, 'cuda': torch.version.cuda, 'gpu': torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}))"
  "controller|60||benchmarks/gpu/controller_check.py --device cuda --out DIR"
  "model|240||-c from genlm_vlm.testing import tiny_model_path; print(tiny_model_path('qwen3-0.6b-shape'))"
  "rows-v2|120|1|benchmarks/gpu/rows_check.py --model-shape $SHAPE --out DIR"
  "rows-v1|120|0|benchmarks/gpu/rows_check.py --model-shape $SHAPE --eager --out DIR"
  "rows-v2-bf16|120|1|benchmarks/gpu/rows_check.py --model-shape $SHAPE --dtype bfloat16 --atol 0.3 --out DIR"
  "bench-v2-graphs|420|1|${BENCH[*]} --dtype bfloat16 --out DIR"
  "bench-v1-graphs|420|0|${BENCH[*]} --dtype bfloat16 --out DIR"
  "smc-requests-v2|420|1|${SMC_REQ[*]} --out DIR"
  "smc-requests-v1|420|0|${SMC_REQ[*]} --out DIR"
  "smc-mask-overlap-v1|420|0|${SMC_MASKS[*]} --out DIR"
  "bench-v2-eager|420|1|${BENCH[*]} --dtype bfloat16 --engine-opts enforce_eager=true --out DIR"
  "bench-v1-eager|420|0|${BENCH[*]} --dtype bfloat16 --engine-opts enforce_eager=true --out DIR"
  "bench-more|420|1|-m genlm_vlm bench --model-shape $SHAPE --workloads scoring lm-eval control --n 64 256 --reps 3 --dtype bfloat16 --no-progress --overwrite --out DIR"
)

publish() {  # every finished task's files to $OUT, and one summary
  local t n
  : > "$OUT/summary.txt"
  for t in "${TASKS[@]}"; do
    n="${t%%|*}"
    if [[ -f "$STATE/$n.status" ]]; then
      mkdir -p "$OUT/$n" && cp -r "$STATE/$n/." "$OUT/$n/" 2>/dev/null || true
      echo "$n: $(cat "$STATE/$n.status")" >> "$OUT/summary.txt"
    else
      echo "$n: pending" >> "$OUT/summary.txt"
    fi
  done
}

for t in "${TASKS[@]}"; do
  IFS='|' read -r name est runner args <<< "$t"
  if [[ ${#ONLY[@]} -gt 0 && ! " ${ONLY[*]} " =~ " $name " ]]; then continue; fi
  [[ -f "$STATE/$name.status" ]] && continue
  left=$(( BUDGET - ($(date +%s) - T0) ))
  if (( left < est )); then
    publish; say "$name needs ~${est} s, ${left} s left: RESUME (run the same command again)"; exit 0
  fi
  dir="$STATE/$name"; mkdir -p "$dir"
  say "task $name (~${est} s, ${left} s left)"
  env_runner=()
  [[ -n "$runner" ]] && env_runner=(env "VLLM_USE_V2_MODEL_RUNNER=$runner")
  set +e
  # shellcheck disable=SC2086  # the task's arguments are split on spaces on purpose
  if [[ "$args" == -c* ]]; then
    ${env_runner[@]+"${env_runner[@]}"} timeout "$left" "$PY" -c "${args#-c }" > "$dir/log.txt" 2>&1
  else
    ${env_runner[@]+"${env_runner[@]}"} timeout "$left" "$PY" ${args//DIR/$dir} > "$dir/log.txt" 2>&1
  fi
  rc=$?
  set -e
  if (( rc == 124 )); then
    publish; say "$name ran out of this run's budget (log: $OUT/summary.txt): RESUME"; exit 0
  fi
  if (( rc == 0 )); then echo "ok" > "$STATE/$name.status"; else echo "FAILED (exit $rc; see $name/log.txt)" > "$STATE/$name.status"; fi
  tail -n 20 "$dir/log.txt"
  publish
done
publish
say "ALL DONE ($(( $(date +%s) - T0 )) s); summary in $OUT/summary.txt"
