"""Greedy regeneration with the native engine, one variant against another: tokens/s, the native engine's line (rows
generating, prefills, reused cache) and whether the datasets are identical. Each variant runs `flashdraft data
regenerate` in a process of its own:
- stream: today's path (every shard through one call; a conversation's next turn keeps its row's cache);
- shard: the generator's follow-ups off: one call per shard, each draining its rows before the next starts (for first
  turns only, `--max-turns 1`, the per-shard path exactly; later turns then go turn by turn);
- no-reuse: streamed, but every next turn prefilled from scratch in a free row.

    source benchmarks/gpu/env.sh
    python3 benchmarks/gpu/regen_ab.py --target $WORK/smollm2-bf16 --input sharegpt:$STAGE/sharegpt_compact.json.gz \
        --limit 4096 --variants stream,shard --out $OUT/regen_stream_ab.log
    python3 benchmarks/gpu/regen_ab.py ... --max-turns 3 --limit 2048 --variants stream,no-reuse --out $OUT/regen_reuse_ab.log
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

RUN = """
import sys
from flashdraft.data import generate
if sys.argv[1] == "shard":  # one native_generate call per shard, as before streaming
    generate.LocalGenerator.follows_up = property(lambda self: False)
if sys.argv[1] == "no-reuse":  # every follow-up prefilled from scratch
    from flashdraft.data import native
    native.native_generate.__wrapped__.__kwdefaults__["reuse_cache"] = False  # under inference_mode's wrapper
from flashdraft.cli import app
sys.argv = ["flashdraft", *sys.argv[2:]]
app()
"""


def dump(path: Path) -> dict:
    from flashdraft.data.dataset import open_dataset

    return {
        (split, s.id): (s.input_ids.tobytes(), s.loss_mask.tobytes())
        for split in ("train", "eval")
        for s in open_dataset(path, split)
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--input", required=True)
    ap.add_argument("--limit", type=int, default=4096)
    ap.add_argument("--shard-size", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=512)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-turns", type=int, default=1)
    ap.add_argument("--variants", default="stream,shard", help="two or more of stream, shard, no-reuse")
    ap.add_argument("--device", default="cuda", help="cpu: a small check that the script runs")
    ap.add_argument(
        "--out", type=Path, required=True, help="the log: each run's summary lines, then the verdict"
    )
    a = ap.parse_args()
    lines: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        variants = a.variants.split(",")
        for mode in variants:
            cmd = [
                sys.executable, "-c", RUN, mode, "data", "regenerate", "--target", a.target, "--out",
                f"{tmp}/{mode}", "--device", a.device, "--dtype", "bfloat16", "--engine", "native", "--batch-size",
                str(a.batch_size), "--max-new-tokens", str(a.max_new_tokens), "--shard-size", str(a.shard_size),
                "--max-turns", str(a.max_turns), "--limit", str(a.limit), "--input", a.input, "--contamination", "none",
            ]  # fmt: skip
            t0 = time.perf_counter()
            res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
            out = (res.stdout + res.stderr).replace("\r", "\n").splitlines()
            lines += [x for x in out if x.startswith(("wrote ", "native engine", "error"))]
            lines.append(f"[{mode}: exit {res.returncode}, {time.perf_counter() - t0:.0f} s]")
            print("\n".join(lines[-3:]), flush=True)
        first = dump(Path(tmp) / variants[0])
        for mode in variants[1:]:
            other = dump(Path(tmp) / mode)
            lines.append(
                f"samples {len(first)} {len(other)} identical datasets ({variants[0]}, {mode}): {first == other}"
            )
    print(lines[-1])
    a.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
