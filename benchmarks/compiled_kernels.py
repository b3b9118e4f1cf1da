"""The kernels of the engine's compiled target forward, per query length: what inductor generates for one
forward of q tokens (its fused kernels and the library calls beside them), read from the generated code.

    python benchmarks/compiled_kernels.py --device cpu --layers 2            # random SmolLM2-shaped layers
    python3 benchmarks/compiled_kernels.py --device cuda --dtype bfloat16 --layers 30 --q 1,16,33

A verify of q tokens launched more kernels than an AR step (benchmarks/RESULTS.md, "Decode speed"); this lists
the kernels one forward has that the first q's has not, by name (inductor names a fused kernel after the ops in
it, numbered: the number is dropped), counted per layer. Random weights: kernels depend on shapes, not weights.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path

import torch
from random_targets import random_target  # benchmarks/ (the script folder)

from flashdraft.decode.native import NativeTarget

# a launch in inductor's generated `call`: a fused kernel (cpp_fused_… on CPU, triton_… on CUDA, with .run on
# CUDA) or a library call (extern_kernels.mm, torch.ops.aten.…)
LAUNCH = re.compile(
    r"^\s+(?:\w+(?:, \w+)* = )?((?:cpp_fused|triton)_\w+|extern_kernels\.\w+|torch\.ops\.\w+\.\w+(?:\.\w+)?)(?:\.run)?\(",
    re.M,
)  # (a library call may be assigned: `buf3 = torch.ops.aten._scaled_dot_product_efficient_attention.default(...)`)


def kernel_name(call: str) -> str:
    """A fused kernel's name without inductor's running number (`…_view_2` → `…_view`)."""
    return re.sub(r"_\d+$", "", call)


def launches(native: NativeTarget, q: int, span: int) -> Counter[str]:
    """The launches of one compiled forward of q tokens attending over `span` cache rows."""
    from torch._inductor.utils import run_and_get_code

    dev = native.target.device
    ids = torch.randint(0, 1000, (q,), device=dev)
    pos = torch.arange(10, 10 + q, device=dev)
    allowed = torch.ones(q, span, dtype=torch.bool, device=dev).tril(diagonal=span - q)
    torch._dynamo.reset()
    native._compiled = None  # a fresh compilation: its code is what run_and_get_code returns
    _, codes = run_and_get_code(lambda: native.compiled_forward(ids, pos, pos.clone(), allowed))
    return Counter(kernel_name(c) for c in LAUNCH.findall("\n".join(codes)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument(
        "--layers", type=int, default=2, help="decoder layers of the random SmolLM2-shaped target"
    )
    ap.add_argument("--q", default="1,16", help="query lengths, comma-separated; the first is the baseline")
    ap.add_argument("--span", type=int, default=64, help="cache rows attended to")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    target = random_target("random-smollm2", args.device, getattr(torch, args.dtype), layers=args.layers)
    native = NativeTarget(target, capacity=args.span + 64)
    qs = [int(x) for x in args.q.split(",")]
    per_q = {q: launches(native, q, args.span) for q in qs}
    base = per_q[qs[0]]
    print(f"{args.layers} layers, {args.device} {args.dtype}, span {args.span}")
    print(f"| q | launches | fused kernels | library calls | more than q = {qs[0]} (name: count a layer) |")
    print("|---:|---:|---:|---:|---|")
    for q, c in per_q.items():
        fused = sum(n for k, n in c.items() if k.startswith(("cpp_fused", "triton")))
        extra = {k: (n - base.get(k, 0)) / args.layers for k, n in c.items() if n > base.get(k, 0)}
        more = "; ".join(f"{k}: {v:g}" for k, v in sorted(extra.items())) or "—"
        print(f"| {q} | {sum(c.values())} | {fused} | {sum(c.values()) - fused} | {more} |")
    if args.json:
        args.json.write_text(json.dumps({"layers": args.layers, "device": args.device, "dtype": args.dtype,
                                         "span": args.span, "launches": {q: dict(c) for q, c in per_q.items()}},
                                        indent=1) + "\n")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
