#!/usr/bin/env bash
# Install the offline vLLM wheelhouse on the air-gapped GPU host.
#
# Parts arrive one device run at a time (each transfer <= 64 MiB) and are
# accumulated under $GENLM_WH_ROOT (default /tmp/genlm_wheelhouse), which
# survives between runs while the host stays up.
#
#   install_offline.sh add-part DIR   verify DIR/part-* against DIR/SHA256SUMS and
#                                     copy them to $ROOT/parts (idempotent)
#   install_offline.sh status         which parts are present / missing
#   install_offline.sh install [DIR]  (optionally add-part DIR first) verify every
#                                     part, reassemble + verify the tar, untar,
#                                     verify every wheel, pip install --no-index
#                                     --no-deps --target $GENLM_SITE, write
#                                     $ROOT/env.sh, smoke-import vllm
#   install_offline.sh env            print the lines to source (= $ROOT/env.sh)
#   install_offline.sh reset          delete $ROOT (parts, wheelhouse, stamps)
#
# Options (after the mode):
#   --root DIR        state folder        (default $GENLM_WH_ROOT or /tmp/genlm_wheelhouse)
#   --target DIR      install folder      (default $GENLM_SITE or /tmp/genlm_site)
#   --python PY       interpreter         (default $PYTHON or python3)
#   --installer X     pip | unzip | auto  (default auto: pip if `PY -m pip` works)
#   --no-pip          stop after verify + reassemble + untar (no install, no smoke)
#   --no-smoke        skip the `import vllm` smoke test
#   --force           reinstall even if this exact build is already installed
# Any checksum mismatch or missing part aborts with a non-zero exit status.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="${GENLM_WH_ROOT:-/tmp/genlm_wheelhouse}"
TARGET="${GENLM_SITE:-/tmp/genlm_site}"
PY="${PYTHON:-python3}"
INSTALLER="auto"
NO_PIP=0
NO_SMOKE=0
FORCE=0

die() { echo "install_offline: ERROR: $*" >&2; exit 1; }
log() { echo "install_offline: $*"; }

[[ $# -ge 1 ]] || die "usage: install_offline.sh {add-part DIR|status|install [DIR]|env|reset} [options]"
MODE="$1"; shift
ARG=""
if [[ $# -gt 0 && "$1" != --* ]]; then ARG="$1"; shift; fi
while [[ $# -gt 0 ]]; do
  case "$1" in
    --root) ROOT="$2"; shift 2 ;;
    --target) TARGET="$2"; shift 2 ;;
    --python) PY="$2"; shift 2 ;;
    --installer) INSTALLER="$2"; shift 2 ;;
    --no-pip) NO_PIP=1; shift ;;
    --no-smoke) NO_SMOKE=1; shift ;;
    --force) FORCE=1; shift ;;
    *) die "unknown option: $1" ;;
  esac
done
safe_dir() {  # refuse to rm -rf obviously wrong places
  local d="${1%/}"
  [[ -n "$d" && "$d" != "/" && "$d" != "$HOME" && "$d" != "/tmp" && "$d" != "." ]] \
    || die "refusing to use '$1' as a folder this script may delete"
}
safe_dir "$ROOT"
safe_dir "$TARGET"
PARTS="$ROOT/parts"
MANIFEST="$PARTS/SHA256SUMS"
STAMP="$ROOT/INSTALLED"
ENV_FILE="$ROOT/env.sh"

expected_parts() { awk '$2 ~ /^part-[0-9]+$/ {print $2}' "$MANIFEST" | LC_ALL=C sort; }
expected_sha() { awk -v f="$1" '$2 == f {print $1}' "$MANIFEST"; }
# genlm_wheelhouse.tar or genlm_wheelhouse.tar.xz, as named in the manifest
tar_name() { awk '$2 ~ /^genlm_wheelhouse\.tar(\.xz)?$/ {print $2}' "$MANIFEST"; }
untar() {  # $1 = archive, $2 = destination
  case "$1" in
    *.xz)
      if command -v xz >/dev/null 2>&1; then
        xz -dc "$1" | tar -xf - -C "$2"
      else  # Python's lzma module instead of the xz binary
        "$PY" -c 'import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), sys.stdout.buffer, 1 << 20)' "$1" \
          | tar -xf - -C "$2"
      fi ;;
    *) tar -xf "$1" -C "$2" ;;
  esac
}

add_parts() {
  local src="$1"
  [[ -d "$src" ]] || die "add-part: not a directory: $src"
  [[ -f "$src/SHA256SUMS" ]] || die "add-part: $src/SHA256SUMS missing (stage_part.sh copies it)"
  mkdir -p "$PARTS"
  if [[ -f "$MANIFEST" ]] && ! cmp -s "$MANIFEST" "$src/SHA256SUMS"; then
    die "add-part: $src/SHA256SUMS is from a different build than $MANIFEST; run 'install_offline.sh reset' first to start over"
  fi
  cp "$src/SHA256SUMS" "$MANIFEST.tmp" || die "cannot write $MANIFEST"
  mv "$MANIFEST.tmp" "$MANIFEST"
  local n=0 f name want got
  for f in "$src"/part-*; do
    [[ -e "$f" ]] || continue
    name="$(basename "$f")"
    want="$(expected_sha "$name")"
    [[ -n "$want" ]] || die "add-part: $name is not listed in SHA256SUMS"
    got="$(sha256sum "$f" | cut -d' ' -f1)"
    [[ "$got" == "$want" ]] || die "add-part: checksum mismatch for $name (got $got, want $want)"
    cp "$f" "$PARTS/$name.tmp" || die "cannot copy $name to $PARTS"
    mv "$PARTS/$name.tmp" "$PARTS/$name"
    n=$((n + 1))
    log "added $name (sha256 ok)"
  done
  [[ $n -gt 0 ]] || die "add-part: no part-* files in $src"
  show_status || true
}

# Prints present/missing; returns 1 if any part is missing.
show_status() {
  [[ -f "$MANIFEST" ]] || { log "no parts yet under $PARTS"; return 1; }
  local have=0 total=0 missing=() p
  while read -r p; do
    total=$((total + 1))
    if [[ -f "$PARTS/$p" ]]; then have=$((have + 1)); else missing+=("$p"); fi
  done < <(expected_parts)
  log "parts present: $have / $total under $PARTS"
  if [[ ${#missing[@]} -gt 0 ]]; then
    log "missing: ${missing[*]}"
    return 1
  fi
  if [[ -f "$STAMP" ]]; then
    local stamp
    stamp="$(cat "$STAMP")"
    log "installed: build ${stamp%% *} -> ${stamp#* }"
  fi
  return 0
}

write_env() {
  mkdir -p "$ROOT"
  cat >"$ENV_FILE" <<EOF
# Generated by benchmarks/gpu/install_offline.sh -- source this before using vLLM.
export GENLM_SITE="$TARGET"
export PYTHONPATH="$TARGET\${PYTHONPATH:+:\$PYTHONPATH}"
export PATH="$TARGET/bin:\$PATH"
# flashinfer is not shipped; vLLM's sampler would import it at engine start.
export VLLM_USE_FLASHINFER_SAMPLER=0
# Air-gapped host: no usage-stats upload, no Hugging Face Hub lookups.
export VLLM_NO_USAGE_STATS=1
export DO_NOT_TRACK=1
export HF_HUB_OFFLINE=1
EOF
}

pick_installer() {
  if [[ "$INSTALLER" == auto ]]; then
    if "$PY" -m pip --version >/dev/null 2>&1; then INSTALLER=pip; else INSTALLER=unzip; fi
  fi
  [[ "$INSTALLER" == pip || "$INSTALLER" == unzip ]] || die "--installer must be pip, unzip or auto"
}

smoke() {
  log "smoke test: import vllm with PYTHONPATH=$TARGET"
  # shellcheck disable=SC1090
  (source "$ENV_FILE" && "$PY" - <<'PYEOF'
import sys

import os

import torch

site = os.environ.get("GENLM_SITE", "")
print("torch", torch.__version__, "from", torch.__file__, "cuda", torch.version.cuda,
      "available", torch.cuda.is_available())
if os.path.isdir(os.path.join(site, "torch")) and not torch.__file__.startswith(site):
    sys.exit(f"torch was imported from {torch.__file__}, not from the kit's {site}: PYTHONPATH order")
if torch.cuda.is_available():
    x = torch.ones(256, 256, device="cuda")
    print("cuda matmul ok:", float((x @ x)[0, 0]), "on", torch.cuda.get_device_name(0))
import vllm  # noqa: E402

print("vllm", vllm.__version__, "from", vllm.__file__)
from vllm import LLM, SamplingParams  # noqa: E402,F401  (the offline entrypoint)

try:
    import vllm._C  # noqa: F401  (the CUDA extension: fails here if torch's ABI does not match)
except ImportError as e:
    sys.exit(f"vllm._C does not load: {e}")
sys.exit(0)
PYEOF
  ) || die "smoke test failed: 'import vllm' / 'from vllm import LLM' raised (see traceback above)"
  # Triton (used by vLLM kernels and torch.compile) builds a small C launcher at
  # first use: it needs a C compiler and Python.h on the host.
  command -v gcc >/dev/null 2>&1 || command -v cc >/dev/null 2>&1 \
    || log "WARNING: no gcc/cc on PATH: triton kernels cannot JIT (try enforce_eager=True; some vLLM triton ops may still fail)"
  "$PY" -c 'import os,sysconfig,sys; sys.exit(0 if os.path.exists(os.path.join(sysconfig.get_paths()["include"],"Python.h")) else 1)' \
    || log "WARNING: Python.h not found: triton cannot build its launcher"
  log "smoke test OK"
}

do_install() {
  if [[ -n "$ARG" ]]; then add_parts "$ARG"; fi
  [[ -f "$MANIFEST" ]] || die "no $MANIFEST: add parts first (install_offline.sh add-part DIR)"
  show_status || die "parts missing; add them with install_offline.sh add-part DIR"

  log "verifying every part"
  (cd "$PARTS" && grep -E '  part-[0-9]+$' SHA256SUMS | sha256sum -c --quiet --strict -) \
    || die "part checksum mismatch (see above); re-transfer the bad part(s)"
  local tar_sha TAR_NAME
  TAR_NAME="$(tar_name)"
  [[ -n "$TAR_NAME" ]] || die "$MANIFEST names no genlm_wheelhouse.tar[.xz]"
  tar_sha="$(expected_sha "$TAR_NAME")"

  if [[ "$FORCE" == 0 && "$NO_PIP" == 0 && -f "$STAMP" && -d "$TARGET" ]] \
    && [[ "$(cat "$STAMP")" == "$tar_sha $TARGET" ]]; then
    log "build $tar_sha already installed in $TARGET (use --force to reinstall)"
  else
    log "reassembling $TAR_NAME"
    local tmp_tar="$ROOT/tmp.$TAR_NAME"
    expected_parts | (cd "$PARTS" && xargs cat) >"$tmp_tar"
    local got
    got="$(sha256sum "$tmp_tar" | cut -d' ' -f1)"
    if [[ "$got" != "$tar_sha" ]]; then
      rm -f "$tmp_tar"
      die "reassembled tar checksum mismatch (got $got, want $tar_sha)"
    fi
    rm -rf "$ROOT/wheelhouse"
    untar "$tmp_tar" "$ROOT" || die "could not unpack $TAR_NAME"
    rm -f "$tmp_tar"
    [[ -f "$ROOT/wheelhouse/SHA256SUMS" ]] || die "tar has no wheelhouse/SHA256SUMS"
    log "verifying every file in the wheelhouse"
    (cd "$ROOT/wheelhouse" && sha256sum -c --quiet --strict SHA256SUMS) \
      || die "wheel checksum mismatch inside the tar"
    local n_whl
    n_whl=$(find "$ROOT/wheelhouse" -maxdepth 1 -name '*.whl' | wc -l)
    log "wheelhouse ready: $ROOT/wheelhouse ($n_whl wheels)"

    if [[ "$NO_PIP" == 1 ]]; then
      log "--no-pip: not installing"
      return 0
    fi
    [[ $n_whl -gt 0 ]] || die "no wheels in $ROOT/wheelhouse"
    pick_installer
    local staging="$TARGET.staging"
    rm -rf "$staging"
    mkdir -p "$(dirname "$TARGET")"
    local all_wheels=("$ROOT"/wheelhouse/*.whl) wheels=() stubs=() line whl base
    # Wheels whose platform tag this host rejects (e.g. manylinux_2_31 on a
    # glibc 2.28 host): stub the known import-only ones, abort on anything else.
    while IFS= read -r line; do
      whl="${line#* }"
      if [[ "$line" == OK\ * ]]; then wheels+=("$whl"); continue; fi
      base="$(basename "$whl")"
      case "$base" in
        llguidance-*) stubs+=(llguidance)
          log "WARNING: $base is not installable here (glibc $(ldd --version 2>/dev/null | head -1 | awk '{print $NF}')); using an import-only stub" ;;
        *) die "$base is not installable on this host (python/platform tags); rebuild the wheelhouse for it" ;;
      esac
    done < <("$PY" "$HERE/wheelhouse_tool.py" supported "${all_wheels[@]}" || true)
    [[ ${#wheels[@]} -gt 0 ]] || die "no installable wheels"
    log "installing ${#wheels[@]} wheels into $TARGET with $INSTALLER"
    local t_install=$SECONDS
    if [[ "$INSTALLER" == pip ]]; then
      "$PY" -m pip install --no-index --no-deps --disable-pip-version-check --no-compile \
        --no-warn-script-location --target "$staging" "${wheels[@]}" \
        || die "pip install failed"
    else
      "$PY" "$HERE/wheelhouse_tool.py" install --target "$staging" "${wheels[@]}" \
        || die "unzip install failed"
    fi
    for base in ${stubs[@]+"${stubs[@]}"}; do
      "$PY" "$HERE/wheelhouse_tool.py" stub --target "$staging" "$base" || die "stub $base failed"
    done
    log "installed in $((SECONDS - t_install)) s"
    rm -f "$STAMP"
    rm -rf "$TARGET"
    mv "$staging" "$TARGET"
    echo "$tar_sha $TARGET" >"$STAMP"
  fi
  if [[ "$NO_PIP" == 1 ]]; then log "--no-pip: not installing"; return 0; fi

  write_env
  if [[ -f "$ROOT/wheelhouse/requirements-offline.txt" ]]; then
    log "host-provided packages:"
    "$PY" "$HERE/wheelhouse_tool.py" host-check \
      --requirements "$ROOT/wheelhouse/requirements-offline.txt" || true
  fi
  [[ "$NO_SMOKE" == 1 ]] || smoke
  echo
  echo "== To use vLLM on this host, start every command with:"
  echo "   source $ENV_FILE"
  echo "== i.e."
  sed -n 's/^export /   export /p' "$ENV_FILE"
}

case "$MODE" in
  add-part) [[ -n "$ARG" ]] || die "usage: install_offline.sh add-part DIR"; add_parts "$ARG" ;;
  status) show_status ;;
  install) do_install ;;
  env) [[ -f "$ENV_FILE" ]] || write_env; cat "$ENV_FILE" ;;
  reset) rm -rf "$ROOT"; log "removed $ROOT" ;;
  *) die "unknown mode: $MODE (add-part|status|install|env|reset)" ;;
esac
