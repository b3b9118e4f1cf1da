#!/usr/bin/env bash
# Slim the working tree for a device call: a call carries the whole tree (tracked and untracked files) within its
# 64 MiB, and the campaign's tree outgrew that with models/ and benchmarks/results/ in it (gpu README, "A stint on a
# fresh machine"). Run from the repository root.
#
#   bash benchmarks/gpu/slim_tree.sh aside DIR [PART...]   # models/ and benchmarks/results/ moved into DIR (new or
#                                                          # empty), then the PARTs copied back into the tree
#   bash benchmarks/gpu/slim_tree.sh back DIR              # the tree as it was: the copies dropped, DIR moved back
#
# PART: `models` (the shipped drafter, --init-from), `packs` (every results/campaign/stint-K/new-data.fdpack, for
# --prev-data), `yardstick` (the shipped stint's yardstick reports, for REUSE=), or a path under benchmarks/results/.
# Between `aside` and `back` the tree lacks tracked files: commit nothing (`git status` shows them deleted).
set -euo pipefail
cmd=${1:-}
dir=${2:-}
[ -n "$cmd" ] && [ -n "$dir" ] || { sed -n '2,13p' "$0"; exit 2; }
shift 2
[ -d .git ] || { echo "slim_tree: run from the repository root" >&2; exit 2; }
mark=.git/slim_tree_aside  # where the tree is aside, while it is
case $cmd in
aside)
  [ ! -e "$mark" ] || { echo "slim_tree: the tree is already aside in $(cat "$mark"): run 'back' first" >&2; exit 1; }
  if [ -e "$dir" ] && [ -n "$(ls -A "$dir")" ]; then
    echo "slim_tree: $dir is not empty (an earlier aside?): run 'back' first" >&2
    exit 1
  fi
  [ -d models ] && [ -d benchmarks/results ] || { echo "slim_tree: models/ or benchmarks/results/ is not in the tree (aside already?)" >&2; exit 1; }
  for part in "$@"; do  # every PART checked before anything moves
    case $part in
    models | packs | yardstick) ;;
    *) [ -e "benchmarks/results/${part#benchmarks/results/}" ] || { echo "slim_tree: no benchmarks/results/${part#benchmarks/results/}" >&2; exit 1; } ;;
    esac
  done
  mkdir -p "$dir"
  realpath "$dir" > "$mark"
  mv models "$dir/models"
  mv benchmarks/results "$dir/results"
  for part in "$@"; do
    case $part in
    models) cp -r "$dir/models" models ;;
    packs)
      (cd "$dir" && find results/campaign -name new-data.fdpack) | while read -r f; do
        mkdir -p "benchmarks/$(dirname "$f")"
        cp "$dir/$f" "benchmarks/$f"
      done
      ;;
    yardstick)  # the shipped drafter's: the last stint stints.jsonl marks promoted (call7's REUSE=)
      last=$(python3 -c 'import json, sys
rows = [json.loads(x) for x in open(sys.argv[1]) if x.strip()]
print(max((r["stint"] for r in rows if r.get("promoted")), default=""))' "$dir/results/campaign/stints.jsonl")
      last=stint-$last/yardstick
      [ -d "$dir/results/campaign/$last" ] || { echo "slim_tree: no yardstick reports of the shipped stint ($last)" >&2; exit 1; }
      mkdir -p "benchmarks/results/campaign/$(dirname "$last")"
      cp -r "$dir/results/campaign/$last" "benchmarks/results/campaign/$last"
      ;;
    *)
      rel=${part#benchmarks/results/}
      mkdir -p "benchmarks/results/$(dirname "$rel")"
      cp -r "$dir/results/$rel" "benchmarks/results/$rel"
      ;;
    esac
  done
  du -sh --exclude=.git --exclude=.venv --exclude=.stage --exclude=.data --exclude='*.egg-info' . |
    sed 's/\t.*/ in the tree (what a call carries besides its carry paths)/'
  ;;
back)
  [ -e "$mark" ] && [ "$(cat "$mark")" = "$(realpath "$dir")" ] || { echo "slim_tree: the tree is not aside in $dir" >&2; exit 1; }
  # the tree's copies go only when they are copies: a file written or changed since `aside` stops it
  changed=""
  for pair in "models:$dir/models" "benchmarks/results:$dir/results"; do
    here=${pair%%:*} there=${pair#*:}
    [ -e "$here" ] || continue
    changed+=$(diff -rq "$here" "$there" | grep -v "^Only in $there" || true)
  done
  if [ -n "$changed" ]; then
    printf 'slim_tree: the tree changed since aside; move these into %s first:\n%s\n' "$dir" "$changed" >&2
    exit 1
  fi
  rm -rf models benchmarks/results
  mv "$dir/models" models
  mv "$dir/results" benchmarks/results
  rmdir "$dir" 2>/dev/null || true
  rm -f "$mark"
  git status --short -- models benchmarks/results | head -5
  ;;
*)
  sed -n '2,13p' "$0"
  exit 2
  ;;
esac
