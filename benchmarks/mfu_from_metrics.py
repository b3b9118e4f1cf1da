"""Drafter-step throughput and MFU from a training run's metrics.jsonl.

    python benchmarks/mfu_from_metrics.py benchmarks/results/h200-2026-12-03-shipped-drafter/train_metrics.jsonl \
        --params 19361152 --hidden 576 --vocab 49152 --block-size 16 --from-step 100

FLOPs counted: 6 × trainable drafter parameters × block tokens + 4 × H × V × block tokens (the
frozen lm_head: forward and input gradient). Attention FLOPs are left out, so this is a lower
bound on the MFU; benchmarks/train_throughput.py counts them exactly.

Runs that logged `model_tflops_per_s` (the trainer counts model FLOPs, attention included:
flashdraft/train/flops.py) also get its mean and the MFU from it (against --peak-tflops); it is
rank 0's device under torchrun. Older files print the lower bound only.
"""

from __future__ import annotations

import argparse
import json
import statistics


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("metrics")
    ap.add_argument("--params", type=int, required=True, help="trainable drafter parameters")
    ap.add_argument("--hidden", type=int, required=True)
    ap.add_argument("--vocab", type=int, required=True)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--from-step", type=int, default=20, help="skip warm-up/compile steps before this")
    ap.add_argument("--last-run", action="store_true", help="only the rows after the last step-counter reset")
    ap.add_argument("--peak-tflops", type=float, default=790.0)
    a = ap.parse_args()
    rows = [json.loads(line) for line in open(a.metrics) if line.strip()]
    if a.last_run:
        start = max(i for i, r in enumerate(rows) if i == 0 or r["step"] <= rows[i - 1]["step"])
        rows = rows[start:]
    rows = [r for r in rows if r["step"] >= a.from_step]
    if not rows:
        raise SystemExit(f"{a.metrics}: no rows at step >= {a.from_step}")
    mean = lambda k: statistics.mean(r[k] for r in rows)  # noqa: E731
    block_tok = mean("anchors_per_s") * a.block_size
    flops = (6 * a.params + 4 * a.hidden * a.vocab) * block_tok
    head = "| steps | target tok/s | anchors/s | block tok/s | step s | consumer wait (max) | peak alloc GB | TFLOP/s (no attn) | MFU lower bound |"
    line = (
        f"| {rows[0]['step']}–{rows[-1]['step']} | {mean('tokens_per_s'):,.0f} | {mean('anchors_per_s'):,.0f} | "
        f"{block_tok:,.0f} | {mean('step_time_s'):.3f} | {max(r.get('pipeline/consumer_wait_frac', 0) for r in rows):.4%} | "
        f"{max(r.get('cuda/peak_allocated_gb', 0) for r in rows):.1f} | {flops / 1e12:.1f} | {flops / (a.peak_tflops * 1e12):.1%} |"
    )
    if all(isinstance(r.get("model_tflops_per_s"), (int, float)) for r in rows):  # logged by the trainer
        model = mean("model_tflops_per_s")
        head += " model TFLOP/s (with attn) | MFU |"
        line += f" {model:.1f} | {model / a.peak_tflops:.1%} |"
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    print(line)


if __name__ == "__main__":
    main()
