#!/usr/bin/env bash
# Build the offline vLLM wheelhouse for the air-gapped GPU host and cut it into
# transfer-sized parts.
#
#   bash benchmarks/gpu/make_wheelhouse.sh                 # download + split
#   bash benchmarks/gpu/make_wheelhouse.sh --from-dir D    # no network: pack D/*
#   bash benchmarks/gpu/make_wheelhouse.sh --skip-download # re-split ./wheelhouse
#   bash benchmarks/gpu/make_wheelhouse.sh --resolve       # only check the pins against PyPI
#
# Outputs (both gitignored):
#   <wheelhouse>/*.whl, SHA256SUMS, requirements-offline.txt, BUILD_INFO
#   <parts>/part-000 ... part-NNN   (tar[.xz] of the wheelhouse cut with split -b)
#   <parts>/SHA256SUMS              (sha256 of every part and of the whole tar[.xz])
#
# Options:
#   --requirements FILE   pinned deps (default: requirements-offline.txt here)
#   --vllm-version VER    vllm wheel to add (default 0.32.0; "" = none)
#   --wheelhouse DIR      default: benchmarks/gpu/wheelhouse
#   --parts-dir DIR       default: benchmarks/gpu/parts
#   --from-dir DIR        copy DIR/* into the wheelhouse instead of downloading
#   --skip-download       keep the wheelhouse as it is (no network)
#   --split-size SIZE     split -b size (default 56m: a part plus the working tree fits
#                         one 64 MiB transfer)
#   --max-part-bytes N    fail if any part is larger (default 58720256 = 56 MiB)
#   --python-version V    target CPython (default 3.12)
#   --no-check            skip the dependency-closure check of the wheels
#   --compress none|xz    default none (a part moves in ~6 s; xz saves ~25 % of
#                         the parts for ~20 min of CPU here and ~1 min on the host);
#                         xz rewrites the wheels with stored (not deflated) members
#                         first, then xz-compresses the tar
#   --xz-level N          xz preset (default 6)
#   --pip CMD             pip command (default: "python3 -m pip")
#   --resolve             resolve vllm==VER for the target with pip (--dry-run, no
#                         wheels downloaded) and compare the pins with it; no build
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REQS="$HERE/requirements-offline.txt"
VLLM_VERSION="0.32.0"
WHEELHOUSE="$HERE/wheelhouse"
PARTS="$HERE/parts"
FROM_DIR=""
SKIP_DOWNLOAD=0
SPLIT_SIZE="56m"
MAX_PART_BYTES=$((56 * 1024 * 1024))
PYVER="3.12"
CHECK=1
COMPRESS="none"
RESOLVE=0
XZ_LEVEL=6
PIP="${PIP:-python3 -m pip}"
TAR_NAME="genlm_wheelhouse.tar"

die() { echo "make_wheelhouse: ERROR: $*" >&2; exit 1; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --requirements) REQS="$2"; shift 2 ;;
    --vllm-version) VLLM_VERSION="$2"; shift 2 ;;
    --wheelhouse) WHEELHOUSE="$2"; shift 2 ;;
    --parts-dir) PARTS="$2"; shift 2 ;;
    --from-dir) FROM_DIR="$2"; shift 2 ;;
    --skip-download) SKIP_DOWNLOAD=1; shift ;;
    --split-size) SPLIT_SIZE="$2"; shift 2 ;;
    --max-part-bytes) MAX_PART_BYTES="$2"; shift 2 ;;
    --python-version) PYVER="$2"; shift 2 ;;
    --no-check) CHECK=0; shift ;;
    --compress) COMPRESS="$2"; shift 2 ;;
    --xz-level) XZ_LEVEL="$2"; shift 2 ;;
    --pip) PIP="$2"; shift 2 ;;
    --resolve) RESOLVE=1; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//;$d'; exit 0 ;;
    *) die "unknown option: $1" ;;
  esac
done

[[ -f "$REQS" ]] || die "requirements file not found: $REQS"
case "$COMPRESS" in
  xz) TAR_NAME="genlm_wheelhouse.tar.xz" ;;
  none) TAR_NAME="genlm_wheelhouse.tar" ;;
  *) die "--compress must be xz or none" ;;
esac
PYABI="cp${PYVER/./}"
# Every manylinux tag a glibc>=2.28 host accepts (the vllm wheel itself needs
# 2.28). pip does not expand manylinux_2_28 to older tags on its own.
# A requirement line whose comment contains "[glibc>=2.NN]" is fetched in its
# own pass with tags up to manylinux_2_NN (see llguidance in the requirements).
platform_args() {  # $1 = highest glibc minor
  local minor
  for minor in $(seq "$1" -1 5); do echo "--platform manylinux_2_${minor}_x86_64"; done
  echo "--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64"
}
BASE_GLIBC_MINOR=28

if [[ "$RESOLVE" == 1 ]]; then
  REPORT="$(mktemp "${TMPDIR:-/tmp}/genlm_resolve.XXXXXX.json")"
  echo "== pip install --dry-run --report: vllm==$VLLM_VERSION for CPython $PYVER (metadata only)"
  # shellcheck disable=SC2046
  $PIP install --dry-run --ignore-installed --quiet --report "$REPORT" --only-binary=:all: \
    --python-version "$PYVER" --implementation cp --abi "$PYABI" $(platform_args 31) \
    --target "$(dirname "$REPORT")/genlm_resolve_target" "vllm==$VLLM_VERSION"
  python3 "$HERE/wheelhouse_tool.py" pins --report "$REPORT" --requirements "$REQS"
  exit $?
fi

# ---------------------------------------------------------------- 1. collect
mkdir -p "$WHEELHOUSE"
if [[ -n "$FROM_DIR" ]]; then
  [[ -d "$FROM_DIR" ]] || die "--from-dir: not a directory: $FROM_DIR"
  echo "== using files from $FROM_DIR (no download)"
  find "$WHEELHOUSE" -mindepth 1 -maxdepth 1 -type f -delete
  cp -p "$FROM_DIR"/* "$WHEELHOUSE"/
elif [[ "$SKIP_DOWNLOAD" == 1 ]]; then
  echo "== --skip-download: using $WHEELHOUSE as is"
else
  DL=(download --only-binary=:all: --no-deps --python-version "$PYVER"
    --implementation cp --abi "$PYABI" --dest "$WHEELHOUSE")
  # shellcheck disable=SC2207
  BASE_PLAT=($(platform_args "$BASE_GLIBC_MINOR"))
  # Start clean so stale versions from an earlier pin set cannot linger.
  find "$WHEELHOUSE" -mindepth 1 -maxdepth 1 -type f -delete
  if [[ -n "$VLLM_VERSION" ]]; then
    echo "== pip download vllm==$VLLM_VERSION (~250 MB)"
    $PIP "${DL[@]}" "${BASE_PLAT[@]}" "vllm==$VLLM_VERSION"
  fi
  MAIN_REQS="$(mktemp "${TMPDIR:-/tmp}/genlm_reqs.XXXXXX")"
  grep -v -E '\[glibc>=2\.[0-9]+\]' "$REQS" >"$MAIN_REQS" || true
  echo "== pip download -r $REQS (manylinux <= 2.$BASE_GLIBC_MINOR)"
  $PIP "${DL[@]}" "${BASE_PLAT[@]}" -r "$MAIN_REQS"
  rm -f "$MAIN_REQS"
  while IFS= read -r line; do
    req="$(echo "${line%%#*}" | xargs)"
    minor="$(echo "$line" | sed -E 's/.*\[glibc>=2\.([0-9]+)\].*/\1/')"
    echo "== pip download $req (manylinux <= 2.$minor)"
    # shellcheck disable=SC2046
    $PIP "${DL[@]}" $(platform_args "$minor") "$req"
  done < <(grep -E '^[[:space:]]*[^#[:space:]][^#]*#.*\[glibc>=2\.[0-9]+\]' "$REQS" || true)
fi
compgen -G "$WHEELHOUSE/*" >/dev/null || die "wheelhouse is empty: $WHEELHOUSE"

if [[ "$CHECK" == 1 ]]; then
  echo "== dependency closure check"
  python3 "$HERE/wheelhouse_tool.py" closure --wheelhouse "$WHEELHOUSE" \
    --requirements "$REQS" --python-version "$PYVER" \
    || die "closure check failed (see above); fix $REQS or pass --no-check"
fi

# --------------------------------------------------- 2. manifest + metadata
if [[ "$COMPRESS" == xz ]]; then
  echo "== rewriting wheels with stored members (so xz sees raw bytes)"
  python3 "$HERE/wheelhouse_tool.py" store "$WHEELHOUSE"/*.whl
fi
cp "$REQS" "$WHEELHOUSE/requirements-offline.txt" 2>/dev/null || true
{
  echo "built_utc=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "vllm_version=${VLLM_VERSION:-none}"
  echo "python_version=$PYVER"
  echo "compress=$COMPRESS"
  echo "abi=$PYABI"
} >"$WHEELHOUSE/BUILD_INFO"
(
  cd "$WHEELHOUSE"
  find . -maxdepth 1 -type f ! -name SHA256SUMS -printf '%f\n' | LC_ALL=C sort \
    | xargs -d '\n' sha256sum >SHA256SUMS
)

# --------------------------------------------------------- 3. tar and split
mkdir -p "$PARTS"
find "$PARTS" -mindepth 1 -maxdepth 1 -type f \( -name 'part-*' -o -name SHA256SUMS \
  -o -name 'genlm_wheelhouse.tar*' \) -delete
WORK="$(mktemp -d "${TMPDIR:-/tmp}/genlm_wh.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
# Fixed owner/mtime/order keep the layout deterministic. Members are always
# stored as wheelhouse/<file>, whatever --wheelhouse is.
(
  cd "$WHEELHOUSE"
  find . -maxdepth 1 -type f -printf '%f\0' | LC_ALL=C sort -z \
    | tar --owner=0 --group=0 --numeric-owner --mtime='2000-01-01 00:00Z' \
      --transform 's,^,wheelhouse/,' --null -T - -cf "$WORK/genlm_wheelhouse.tar"
)
if [[ "$COMPRESS" == xz ]]; then
  echo "== xz -$XZ_LEVEL (slow: ~10-20 min for ~850 MB on 2 cores)"
  xz -T0 "-$XZ_LEVEL" "$WORK/genlm_wheelhouse.tar"
fi
split -b "$SPLIT_SIZE" -d -a 3 "$WORK/$TAR_NAME" "$PARTS/part-"
(
  cd "$PARTS"
  sha256sum part-* >SHA256SUMS
  (cd "$WORK" && sha256sum "$TAR_NAME") >>SHA256SUMS
)

# -------------------------------------------------------------- 4. report
n_parts=0
for f in "$PARTS"/part-*; do
  size=$(stat -c %s "$f")
  ((size <= MAX_PART_BYTES)) || die "$(basename "$f") is $size bytes > $MAX_PART_BYTES"
  n_parts=$((n_parts + 1))
done
tar_bytes=$(stat -c %s "$WORK/$TAR_NAME")
n_wheels=$(find "$WHEELHOUSE" -maxdepth 1 -name '*.whl' | wc -l)
last=$(printf '%03d' $((n_parts - 1)))

echo
echo "== wheelhouse: $WHEELHOUSE ($n_wheels wheels)"
echo "== tar: $tar_bytes bytes ($((tar_bytes / 1048576)) MiB); parts: $n_parts in $PARTS"
ls -l "$PARTS"
cat <<EOF

== Moving the parts to the GPU host (each transfer <= 64 MiB) ==
For each N in 000 .. $last, one device run per part:
  1. here:   bash benchmarks/gpu/stage_part.sh N
             (empties benchmarks/gpu/transfer/, copies part-N + SHA256SUMS there;
              transfer/ is gitignored: copy it to the GPU host by any means)
  2. GPU host: bash benchmarks/gpu/install_offline.sh add-part benchmarks/gpu/transfer
             (verifies the part's sha256 and appends it to /tmp/genlm_wheelhouse/parts/)
After the last part (same host session, /tmp survives between runs):
  GPU host: bash benchmarks/gpu/install_offline.sh install
          -> verifies, reassembles, untars, pip-installs into /tmp/genlm_site,
             smoke-imports vllm and writes /tmp/genlm_wheelhouse/env.sh
  then every later command on the GPU host starts with: source /tmp/genlm_wheelhouse/env.sh
Check progress at any time with: bash benchmarks/gpu/install_offline.sh status
EOF
