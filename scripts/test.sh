#!/usr/bin/env bash
# Set up (if needed: the engine and the `test` extras) and run the whole test suite on the real
# vLLM engine. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
exec "${GENLM_VLM_VENV:-.venv}/bin/python" -m pytest "$@"
