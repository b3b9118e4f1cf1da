#!/usr/bin/env bash
# Cut a large file into numbered parts with its sha256 beside them, and put it back together (checked).
# For moving a file through a channel that limits file size (e.g. to or from an air-gapped host):
#   bash benchmarks/gpu/parts.sh split FILE OUTDIR [MIB]     # OUTDIR/FILE.part00 ... + OUTDIR/SHA256; MIB default 15
#   bash benchmarks/gpu/parts.sh join OUTFILE PART...        # checks OUTFILE against the SHA256 beside the parts
set -euo pipefail
case ${1:-} in
  split)
    f=$2; out=$3; mib=${4:-15}; base=$(basename "$f")
    mkdir -p "$out"
    split -b "${mib}m" -d -a 2 "$f" "$out/$base.part"
    sha256sum "$f" | awk -v b="$base" '{print $1"  "b}' > "$out/SHA256" ;;
  join)
    o=$2; shift 2
    cat $(printf '%s\n' "$@" | sort) > "$o.tmp"
    s=$(dirname "$1")/SHA256
    if [ -f "$s" ]; then
      want=$(awk '{print $1}' "$s"); got=$(sha256sum "$o.tmp" | awk '{print $1}')
      [ "$want" = "$got" ] || { echo "parts.sh: checksum mismatch for $o: $s says $want" >&2; rm -f "$o.tmp"; exit 1; }
    fi
    mv "$o.tmp" "$o"; echo "joined $o ($(stat -c %s "$o") bytes)" ;;
  *) echo "usage: parts.sh split FILE OUTDIR [MIB] | parts.sh join OUTFILE PART..." >&2; exit 2 ;;
esac
