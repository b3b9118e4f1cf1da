"""The trainer's host-side packing, alone: micro-batches planned over a shuffled order (as `InProcessSource` plans
them), their samples read from a dataset folder and packed (`pack_rows`), per decoded-shard cache budget.

    python benchmarks/dataset_reads.py DATASET [--batches 200] [--cache-mib 4096,150]

The trainer's stream idles while the host packs (`pipeline/host_pack_ms` in its metrics): a dataset whose shards do
not all fit the cache decodes a shard for many of a batch's samples. Prints a table: ms per micro-batch, shards
decoded. No GPU, no target.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from flashdraft.data import dataset as dataset_mod
from flashdraft.data.dataset import open_dataset
from flashdraft.train.batch import pack_rows, plan_micro_batches


def run(path: str, cache_mib: float, batches: int, max_length: int, token_budget: int, seed: int) -> dict:
    ds = open_dataset(path)
    ds.cache_bytes = int(cache_mib * 2**20)
    decoded = 0
    real = dataset_mod._read_shard_table

    def counting(f, columns=None):  # noqa: ANN001, ANN202
        nonlocal decoded
        decoded += columns is None
        return real(f, columns)

    dataset_mod._read_shard_table = counting
    try:
        order = np.random.default_rng([seed, 0]).permutation(len(ds))
        plans = plan_micro_batches(ds.lengths[order], max_length, token_budget)[:batches]
        ms = []
        for plan in plans:
            t0 = time.perf_counter()
            pack_rows([[ds[int(order[i])] for i in row] for row in plan.rows], max_length)
            ms.append((time.perf_counter() - t0) * 1e3)
    finally:
        dataset_mod._read_shard_table = real
    return {
        "cache_mib": cache_mib,
        "shards": len(ds.files),
        "batches": len(ms),
        "median_ms": statistics.median(ms),
        "mean_ms": statistics.fmean(ms),
        "decoded": decoded,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dataset")
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--cache-mib", default="4096,150", help="decoded-shard cache budgets to compare, MiB")
    ap.add_argument("--max-length", type=int, default=3072, help="data.max_length (configs/smollm2-b16.yaml)")
    ap.add_argument("--token-budget", type=int, default=16384, help="data.token_budget")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rows = [
        run(args.dataset, float(c), args.batches, args.max_length, args.token_budget, args.seed)
        for c in args.cache_mib.split(",")
    ]
    print("| cache budget MiB | shards | micro-batches | median ms | mean ms | shards decoded |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['cache_mib']:g} | {r['shards']} | {r['batches']} | {r['median_ms']:.1f} | {r['mean_ms']:.1f} "
              f"| {r['decoded']} |")  # fmt: skip


if __name__ == "__main__":
    main()
