#!/usr/bin/env bash
# Set up (if needed: the engine only, no test dependencies) and run the demo on the embedded
# model. Extra args go to `python -m genlm_vlm demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh demo
exec "${GENLM_VLM_VENV:-.venv}/bin/python" -m genlm_vlm demo "$@"
