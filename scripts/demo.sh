#!/usr/bin/env bash
# Set up (if needed) and run the demo on the embedded model. Extra args go to `python -m genlm_vlm demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m genlm_vlm demo "$@"
