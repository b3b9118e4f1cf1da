#!/usr/bin/env bash
# split15.sh FILE OUTDIR: 15 MiB parts (files come back from the GPU machine at <= 16 MiB each);
# join them here with /work/shared/scripts/join-parts, which checks the sha256 written beside them.
set -euo pipefail
f=$1; out=$2
split -b 15m -d -a 2 "$f" "$out/$(basename "$f").part"
sha256sum "$f" | awk -v b="$(basename "$f")" '{print $1"  "b}' > "$out/SHA256"
