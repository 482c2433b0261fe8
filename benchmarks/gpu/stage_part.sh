#!/usr/bin/env bash
# Stage ONE part for a transfer to the GPU host: empties the (gitignored) transfer folder
# and copies parts/part-NNN plus parts/SHA256SUMS into it, so that copying that folder
# moves < 60 MiB.
#
#   bash benchmarks/gpu/stage_part.sh 3                 # -> transfer/part-003
#   bash benchmarks/gpu/stage_part.sh 003 --parts-dir D --transfer-dir T
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PARTS="$HERE/parts"
TRANSFER="$HERE/transfer"
die() { echo "stage_part: ERROR: $*" >&2; exit 1; }

[[ $# -ge 1 ]] || die "usage: stage_part.sh N [--parts-dir DIR] [--transfer-dir DIR]"
N="$1"; shift
while [[ $# -gt 0 ]]; do
  case "$1" in
    --parts-dir) PARTS="$2"; shift 2 ;;
    --transfer-dir) TRANSFER="$2"; shift 2 ;;
    *) die "unknown option: $1" ;;
  esac
done
[[ "$N" =~ ^[0-9]+$ ]] || die "part index must be a number: $N"
NAME="part-$(printf '%03d' "$((10#$N))")"
[[ -f "$PARTS/$NAME" ]] || die "no such part: $PARTS/$NAME"
[[ -f "$PARTS/SHA256SUMS" ]] || die "missing $PARTS/SHA256SUMS"

mkdir -p "$TRANSFER"
find "$TRANSFER" -mindepth 1 -maxdepth 1 -type f -delete
cp "$PARTS/$NAME" "$PARTS/SHA256SUMS" "$TRANSFER"/
total=$(du -cb "$TRANSFER"/* | tail -1 | cut -f1)
echo "staged $NAME ($total bytes with SHA256SUMS) in $TRANSFER"
n=$(find "$PARTS" -maxdepth 1 -name 'part-*' | wc -l)
echo "parts in this build: $n (part-000 .. part-$(printf '%03d' $((n - 1))))"
