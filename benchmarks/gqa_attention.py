"""The decode engine's grouped-query attention over its static cache: query groups folded into the query axis
(`flashdraft.decode.native._attend`) against the cache copied to one K/V per query head (what the engine did
before 2026-12-07), per cache capacity and query length, SmolLM2-135M's geometry by default (9 query heads, 3 KV
heads, head dim 64). Microseconds of one attention call (a CPU's median; on CUDA the mean over `--reps` calls timed
with events, no CUDA graph: the kernels' own cost plus their launches), the two outputs' largest difference.

    python benchmarks/gqa_attention.py --device cpu --threads 2
    python benchmarks/gqa_attention.py --device cuda --dtypes bfloat16 --out gqa_attention.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from flashdraft.decode.native import _attend, additive_mask, gqa_mask
from flashdraft.files import atomic_write_text


def copied_cache(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """The cache expanded to one K/V per query head, then SDPA: a copy of the whole capacity per call."""
    rep = q.shape[1] // k.shape[1]
    b, kv, s, hd = k.shape
    k = k[:, :, None].expand(b, kv, rep, s, hd).reshape(b, kv * rep, s, hd)
    v = v[:, :, None].expand(b, kv, rep, s, hd).reshape(b, kv * rep, s, hd)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None], scale=scale)


def time_us(fn: Callable[[], torch.Tensor], device: torch.device, reps: int) -> float:
    for _ in range(3):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) * 1e3 / reps
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def measure(
    dt: torch.dtype, cap: int, q_len: int, a: argparse.Namespace, device: torch.device, g: torch.Generator
) -> dict[str, float]:
    q = torch.randn(1, q_len, a.heads, a.head_dim, generator=g).transpose(1, 2).to(device, dt)
    k, v = (torch.randn(1, a.kv_heads, cap, a.head_dim, generator=g).to(device, dt) for _ in range(2))
    # the prompt and earlier tokens fill about 3/4 of the cache; each query sees its prefix
    allowed = torch.arange(cap)[None] < (cap * 3 // 4 - q_len + torch.arange(q_len) + 1)[:, None]
    mask = additive_mask(allowed.to(device), dt)
    folded = gqa_mask(mask, a.heads // a.kv_heads)
    scale = a.head_dim**-0.5

    def copied() -> torch.Tensor:
        return copied_cache(q, k, v, mask, scale)

    def fold() -> torch.Tensor:
        return _attend(q, k, v, folded, scale)

    return {
        "copied_us": time_us(copied, device, a.reps),
        "folded_us": time_us(fold, device, a.reps),
        "max_abs_diff": (copied() - fold()).abs().max().item(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--capacities", default="384,2048")
    ap.add_argument("--queries", default="1,16,33,129", help="query lengths: AR, chain verify, DDTree-32/128")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=0, help="torch threads on a CPU (0: torch's default)")
    ap.add_argument("--out", type=Path, default=None, help="also write the rows as JSON here")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    a = ap.parse_args()
    if a.out is not None and a.out.exists() and not a.overwrite:
        raise SystemExit(f"--out {a.out} exists: pass --overwrite to replace it")
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    g = torch.Generator().manual_seed(0)
    rows = []
    print(f"{a.heads} query heads, {a.kv_heads} KV heads, head dim {a.head_dim}, {device}")
    print("| dtype | capacity | queries | copied cache µs | folded µs | × | largest |Δ| |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for dt_name in a.dtypes.split(","):
        for cap in map(int, a.capacities.split(",")):
            for q_len in map(int, a.queries.split(",")):
                row = measure(getattr(torch, dt_name), cap, q_len, a, device, g)
                rows.append({"dtype": dt_name, "capacity": cap, "queries": q_len, **row})
                print(
                    f"| {dt_name} | {cap} | {q_len} | {row['copied_us']:.1f} | {row['folded_us']:.1f} "
                    f"| {row['copied_us'] / row['folded_us']:.2f} | {row['max_abs_diff']:.1e} |"
                )
    if a.out:
        atomic_write_text(
            a.out, json.dumps({"device": str(device), "torch": torch.__version__, "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
