"""The DDTree device tree build: the sort-based build it replaced vs `build_tree_device`, eager and compiled.

    python benchmarks/gpu/tree_build.py                      # CUDA: equality + CUDA-graph replay timings
    python benchmarks/gpu/tree_build.py --device cpu         # dry run here: equality + eager timings

For each budget (8 … 512) and draft-logit case ([15, 49152] float32: `peaky` = randn·4, `ties` =
integer logits 0..3, so nearly every score ties, `masked` = 3 finite logits a slot, so -inf nodes),
every variant's tree is checked against
`flashdraft.tree.build_tree` (the host heap: tokens, parents, depths, float32 scores) and against
the old build (float64 scores bit for bit), then timed as the engine runs it: captured once in a
CUDA graph, the median of `--replays` replays (CUDA events) after warm-up. On CPU the variants run
eagerly (perf_counter median). A variant that fails is reported and the table goes on. Writes
$OUT/tree_build.json when OUT is set (or --out).

Variants: `old` (the sort-based build, kept below as the baseline); `new` (`build_tree_device`
eager: sort-free on CUDA, sorts on CPU); `new_sorts` (`select_nodes` with sorts: the old algorithm
in the new code); `compiled` / `compiled_sorts` (`compiled_tree_builder(sort_free=True/False)`, the
engine's CUDA path is `compiled`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flashdraft.decode.engine import (  # noqa: E402
    DeviceTree,
    TreePlan,
    build_tree_device,
    compiled_tree_builder,
)
from flashdraft.tree import build_tree  # noqa: E402

Builder = Callable[[torch.Tensor, TreePlan], DeviceTree]


def old_build_tree_device(draft_logits: torch.Tensor, plan: TreePlan) -> DeviceTree:
    """The build before the sort-free one (engine.py at 728dc8c): a stable float64 sort per depth,
    then a stable sort of all depths' lists."""
    n = plan.budget
    num_slots = min(plan.num_slots, n)
    device = draft_logits.device
    logp = torch.log_softmax(draft_logits[:num_slots].float(), dim=-1)
    top_lp, top_ids = logp.topk(plan.k, dim=-1)
    lq = top_lp.double()
    scores = torch.full((num_slots, n), float("-inf"), dtype=torch.float64, device=device)
    chosen = torch.zeros(num_slots, n, dtype=torch.long, device=device)
    scores[0, : plan.k] = lq[0] + 0.0
    for d in range(1, num_slots):
        cand = scores[d - 1, plan.pair_r] + lq[d, plan.pair_t]
        best = torch.sort(cand, descending=True, stable=True)
        scores[d] = best.values[:n]
        chosen[d] = best.indices[:n]
    flat = torch.sort(scores.view(-1), descending=True, stable=True).indices[:n]
    return _assemble(flat, scores, chosen, top_ids, plan)


def _assemble(flat, scores, chosen, top_ids, plan) -> DeviceTree:
    n = plan.budget
    device = flat.device
    depth0 = flat // n
    pair = chosen.view(-1)[flat]
    rank = torch.where(depth0 == 0, flat, plan.pair_t[pair])
    node_of_flat = torch.zeros(scores.numel(), dtype=torch.long, device=device)
    node_of_flat[flat] = torch.arange(1, n + 1, device=device)
    parent_flat = (depth0 - 1).clamp(min=0) * n + plan.pair_r[pair]
    parents = torch.where(depth0 == 0, torch.zeros_like(flat), node_of_flat[parent_flat])
    zero = torch.zeros(1, dtype=torch.long, device=device)
    return DeviceTree(
        tokens=top_ids[depth0, rank],
        parents=torch.cat([zero, parents]),
        depths=torch.cat([zero, depth0 + 1]),
        log_probs=scores.view(-1)[flat],
    )


def make_logits(case: str, slots: int, vocab: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if case == "peaky":  # softmax peaked like a trained drafter's
        x = torch.randn(slots, vocab, generator=g) * 4.0
    elif case == "ties":  # four distinct logits per slot: scores tie everywhere
        x = torch.randint(0, 4, (slots, vocab), generator=g).float()
    elif case == "masked":  # 3 finite logits per slot: the trees past 3 + 9 + 27 + … nodes hold -inf nodes
        x = torch.randn(slots, vocab, generator=g) * 4.0
        x[:, 3:] = float("-inf")
    else:
        raise ValueError(f"unknown case {case!r}: use peaky, ties or masked")
    return x.to(device)


def mismatch(got: DeviceTree, ref_heap, ref_old: DeviceTree | None) -> str | None:
    """None when `got` is the heap's tree (and the old build's, float64 bit for bit)."""
    if got.tokens.tolist() != ref_heap.tokens.tolist():
        return "tokens differ from build_tree"
    if got.parents.tolist() != [0] + ref_heap.parents[1:]:
        return "parents differ from build_tree"
    if got.depths.tolist() != [0] + ref_heap.depths.tolist():
        return "depths differ from build_tree"
    if not torch.equal(got.log_probs.float().cpu(), ref_heap.log_probs.cpu()):
        return "float32 scores differ from build_tree"
    if ref_old is not None and not torch.equal(got.log_probs, ref_old.log_probs):
        return "float64 scores differ from the old build"
    return None


def time_cuda_graph(fn: Builder, logits: torch.Tensor, plan: TreePlan, replays: int) -> float:
    """Median ms of one graph replay of fn (captured as the engine's `_Phase` does)."""
    static = logits.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture (compiles a compiled variant)
        for _ in range(3):
            fn(static, plan)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(static, plan)
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_eager(fn: Builder, logits: torch.Tensor, plan: TreePlan, replays: int) -> float:
    fn(logits, plan)
    times = []
    for _ in range(replays):
        t0 = time.perf_counter()
        fn(logits, plan)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--budgets", default="8,16,32,64,128,256,512")
    ap.add_argument("--cases", default="peaky,ties,masked")
    ap.add_argument(
        "--variants",
        default=None,
        help="default old,new,compiled (CPU: old,new; each compiled one compiles per budget, "
        "~15 s each on the H200 host, ~40 s here); also new_sorts, compiled_sorts",
    )
    ap.add_argument("--slots", type=int, default=15, help="draft slots 1..B-1 (block 16)")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--replays", type=int, default=None, help="default 100 on CUDA, 5 on CPU")
    ap.add_argument("--out", default=None, help="JSON path (default $OUT/tree_build.json when OUT is set)")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    replays = args.replays or (100 if cuda else 5)
    budgets = [int(b) for b in args.budgets.split(",")]
    builders: dict[str, Callable[[], Builder]] = {
        "old": lambda: old_build_tree_device,
        "new": lambda: build_tree_device,
        "compiled": compiled_tree_builder,
        "compiled_sorts": lambda: compiled_tree_builder(sort_free=False),
        "new_sorts": lambda: lambda x, plan: build_tree_device(x, plan, sort_free=False),
    }
    variants = (args.variants or ("old,new,compiled" if cuda else "old,new")).split(",")
    if cuda:
        print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__}", flush=True)
    else:
        print(f"# CPU dry run ({torch.get_num_threads()} threads), eager timings | torch {torch.__version__}")
    # one compiled graph per (variant, budget): past dynamo's default limit of 8 it would run eagerly
    torch._dynamo.config.recompile_limit = 64
    made: dict[str, Builder | str] = {}
    for v in variants:
        try:
            made[v] = builders[v]()
        except Exception as e:  # noqa: BLE001 — a variant that cannot be built is reported, not fatal
            made[v] = f"{type(e).__name__}: {e}"
    rows: list[dict[str, Any]] = []
    for case in args.cases.split(","):
        logits = make_logits(case, args.slots, args.vocab, args.device)
        for budget in budgets:
            plan = TreePlan.make(budget, args.slots, args.vocab, logits.device)
            row: dict[str, Any] = {"case": case, "budget": budget, "pairs": int(plan.pair_r.numel())}
            ref_heap = build_tree(logits, budget)
            ref_old = None
            for v in variants:
                fn = made[v]
                try:
                    if isinstance(fn, str):
                        raise RuntimeError(fn)
                    got = fn(logits, plan)
                    if v == "old":
                        ref_old = got
                    bad = mismatch(got, ref_heap, ref_old)
                    row[f"{v}_equal"] = bad is None
                    if bad is not None:
                        row[f"{v}_error"] = bad
                    timer = time_cuda_graph if cuda else time_eager
                    row[f"{v}_ms"] = timer(fn, logits, plan, replays)
                except Exception as e:  # noqa: BLE001 — keep the table going
                    row[f"{v}_error"] = f"{type(e).__name__}: {e}"
                    row.setdefault(f"{v}_equal", None)
                    traceback.print_exc(limit=3)
            for v in variants:
                if v != "old" and row.get("old_ms") and row.get(f"{v}_ms"):
                    row[f"{v}_speedup"] = row["old_ms"] / row[f"{v}_ms"]
            rows.append(row)
            cells = []
            for v in variants:
                ms = row.get(f"{v}_ms")
                ok = {True: "", False: " WRONG", None: " ERR"}[row.get(f"{v}_equal")]
                cells.append(f"{v} {ms:7.3f} ms{ok}" if ms is not None else f"{v}     ERR")
            ratios = " ".join(f"{v} {row[f'{v}_speedup']:.2f}x" for v in variants if f"{v}_speedup" in row)
            print(f"{case:6s} budget {budget:4d} (M={row['pairs']:5d}) | " + " | ".join(cells) + f" | old/x: {ratios}",
                  flush=True)  # fmt: skip
    print(f"\n{'case':6s} {'budget':>6s} " + " ".join(f"{v + ' ms':>15s}" for v in variants) + "  old/engine")
    engine = "compiled" if "compiled" in variants else "new"  # what FastEngine runs on CUDA (CPU: new)
    for r in rows:
        cells = " ".join(f"{r[v + '_ms']:15.3f}" if r.get(v + "_ms") else f"{'ERR':>15s}" for v in variants)
        ratio = r.get(f"{engine}_speedup")
        print(f"{r['case']:6s} {r['budget']:6d} {cells}  {f'{ratio:.2f}x' if ratio else '-'}")
    errors = [(r["case"], r["budget"], k, r[k]) for r in rows for k in r if k.endswith("_error")]
    for e in errors:
        print("error:", *e)
    out = args.out or (os.path.join(os.environ["OUT"], "tree_build.json") if os.environ.get("OUT") else None)
    if out:
        meta = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                "timing": "CUDA graph replay median" if cuda else "eager median (CPU)", "replays": replays,
                "slots": args.slots, "vocab": args.vocab}  # fmt: skip
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        print("wrote", out)
    all_equal = all(r.get(f"{v}_equal") for r in rows for v in variants)
    print("all variants equal to build_tree:", all_equal)


if __name__ == "__main__":
    main()
