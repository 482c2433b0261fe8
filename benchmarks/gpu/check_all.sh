#!/usr/bin/env bash
# The whole GPU check in one prepared command (see CHECK.md), run again and again on the GPU host:
#
#   bash benchmarks/gpu/check_all.sh [--stage 1|2|3|all] [check_all.py options]
#
# 1. If benchmarks/gpu/transfer/ holds kit parts (carried in by this run), add them
#    (install_offline.sh add-part: each is checked against SHA256SUMS first).
# 2. If parts are still missing: say which, and stop (exit 0): stage the next part and run again.
# 3. If the kit is not installed yet: install_offline.sh install (~2 min).
# 4. source the kit's env.sh and run check_all.py: the pending tasks of the plan, in priority
#    order, within this run's budget (GENLM_CHECK_BUDGET, default 570 s counted from this
#    script's start). Results go to $OUT (results.md, results.jsonl, each task's files).
#    "RESUME" at the end: run the same command again; "ALL DONE": finished.
#
# --no-kit: skip 1-4's kit steps (vLLM is already importable, e.g. after pip install genlm-vlm[gpu]).
set -euo pipefail
T0=$(date +%s)
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
WH_ROOT="${GENLM_WH_ROOT:-/tmp/genlm_wheelhouse}"
PY="${PYTHON:-python3}"
KIT=1
ARGS=()
for a in "$@"; do
  if [[ "$a" == "--no-kit" ]]; then KIT=0; else ARGS+=("$a"); fi
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
cd "$ROOT"
BUDGET="${GENLM_CHECK_BUDGET:-570}"
say "$(( $(date +%s) - T0 )) s spent on the kit; running the plan (budget ${BUDGET} s from the start)"
exec "$PY" "$HERE/check_all.py" run --budget "$BUDGET" --t0 "$T0" ${ARGS[@]+"${ARGS[@]}"}
