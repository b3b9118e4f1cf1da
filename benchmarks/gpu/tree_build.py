"""The DDTree tree phase eager vs compiled (`FastEngine(compile_tree=True)`), as the engine replays it.

    python3 benchmarks/gpu/tree_build.py --out tree_build.json          # CUDA: ~15 s of compilation per budget
    python benchmarks/gpu/tree_build.py --device cpu                    # smoke run: tiny sizes, no graphs

For each budget, two engines on one random SmolLM2-shaped target (1 narrow layer: only the vocabulary and
the block matter here) capture their own tree phase (`FastEngine._tree_inputs`: `draft_top`, the tree, its
visibility and the verify inputs; the compiled engine compiles it in `_Phase`'s warm-up) as a CUDA graph,
over the same draft logits: [15 slots, 49,152] = randn · 4 in the target's dtype (bf16), a peaked
distribution like a trained drafter's. Per budget and engine: the median of `--replays` graph replays
(CUDA events, after 10 unmeasured ones), the kernels one run of the phase launches (torch.profiler), and
the setup time (compilation + capture). Both engines' outputs must be equal — tokens, positions, rows,
mask, parents, depths and the float64 scores — or the row says `equal: false`. On CPU the phases run
eagerly (perf_counter medians, no kernel counts). Writes a JSON (`--out`).

`--variants eager,compiled,compiled_aten_sort` adds a compiled engine whose sorts stay aten's (inductor's
`triton.persistent_reductions` off while it compiles: no Triton sort for lists <= 512 entries), in case
inductor's own float64 sort is the slower or the wrong one.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # phase_timing, however this file is loaded

from phase_timing import median_ms  # noqa: E402  (beside this file)

from flashdraft.decode.device_tree import TREE_COMPILE_LIMIT, DeviceTree, draft_top, write_tree_inputs  # noqa: E402
from flashdraft.decode.engine import FastEngine  # noqa: E402

VARIANTS = ("eager", "compiled", "compiled_aten_sort")


def aten_sort_writer() -> Any:
    """`compile_tree_writer` with inductor's Triton sort off. Its own code object: dynamo caches compilations
    per code object and its guards do not include inductor's config, so the engine's would be reused."""

    def write_tree_inputs_aten_sort(*args: Any) -> DeviceTree:
        return write_tree_inputs(*args)

    compiled = torch.compile(write_tree_inputs_aten_sort, fullgraph=True, dynamic=False)

    def write(*args: Any) -> DeviceTree:
        with (
            torch.no_grad(),
            torch._inductor.config.patch({"triton.persistent_reductions": False}),
            torch._dynamo.config.patch(recompile_limit=TREE_COMPILE_LIMIT),
        ):
            return compiled(*args)

    return write


def build_engines(args: argparse.Namespace, variants: list[str]) -> dict[str, FastEngine]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from flashdraft.drafter import DFlashDrafter
    from flashdraft.target import TargetModel, drafter_config_for

    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=8192,
                      tie_word_embeddings=True)  # fmt: skip
    target = TargetModel(LlamaForCausalLM(cfg).eval().to(args.device, dtype), name="random-smollm2-vocab")
    drafter = DFlashDrafter(drafter_config_for(target, num_layers=1, block_size=args.slots + 1))
    drafter = drafter.eval().to(args.device, dtype)
    cuda = args.device.startswith("cuda")
    return {
        v: FastEngine(
            target,
            drafter,
            max_len=args.max_len,
            max_budget=max(args.budgets),
            cuda_graphs=cuda,
            compile_tree=v == "compiled",
        )
        for v in variants
    }


def count_kernels(fn: Any) -> int:
    """Kernels (and memsets / copies) one eager run of the phase function launches: what its graph replays."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def outputs(engine: FastEngine, budget: int) -> dict[str, torch.Tensor]:
    """The phase's static outputs, and the float64 scores (the writer called once more, outside the graph)."""
    t = engine._tree[budget]
    out = {k: v.clone() for k, v in vars(t["out"]).items()}
    hops = min(engine.block, budget + 1)
    with torch.no_grad():
        tree = t["write"](*draft_top(engine.draft_logits, t["plan"]), t["plan"], engine.seq_len, engine.bonus,
                          engine.kv_idx, hops, t["out"])  # fmt: skip
    out["log_probs"] = tree.log_probs.clone()
    return out


def measure(
    engines: dict[str, FastEngine], logits: torch.Tensor, budget: int, args: argparse.Namespace
) -> dict:
    cuda = args.device.startswith("cuda")
    row: dict[str, Any] = {"budget": budget}
    ref: dict[str, torch.Tensor] | None = None
    for name, eng in engines.items():
        eng.draft_logits.copy_(logits)
        fn = functools.partial(eng._tree_inputs, budget)
        if name == "compiled_aten_sort":
            eng._treebuf(budget)["write"] = aten_sort_writer()
        t0 = time.perf_counter()
        try:  # on CUDA `_phase` warms up (compiles) and captures the phase; on CPU its first call compiles
            phase = eng._phase(("tree", budget), fn)
            eng.seq_len.fill_(args.max_len // 2)  # `_phase` zeroed it: a committed prefix before the tree
            eng.bonus.fill_(7)
            phase()
            if cuda:
                torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 — a variant that fails to compile is reported, the table goes on
            row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:2000]}"
            print(f"budget {budget} {name}: {row[f'{name}_error'][:400]}", flush=True)
            continue
        row[f"{name}_setup_s"] = time.perf_counter() - t0
        row[f"{name}_ms"] = median_ms(phase, args.replays, warmup=10, cuda=cuda)
        if cuda:
            row[f"{name}_kernels"] = count_kernels(fn)
        got = outputs(eng, budget)
        if ref is None:
            ref = got
        else:
            row[f"{name}_equal"] = all(torch.equal(got[k], ref[k]) for k in ref)
    if "eager_ms" in row:
        for name in engines:
            if name != "eager" and f"{name}_ms" in row:
                row[f"{name}_speedup"] = row["eager_ms"] / row[f"{name}_ms"]
    return row


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--budgets", default=None, help="default 8,16,32,64,128,256,512 (CPU: 8,33)")
    ap.add_argument("--variants", default="eager,compiled", help=f"from {', '.join(VARIANTS)}; eager first")
    ap.add_argument("--slots", type=int, default=None, help="draft slots = block - 1 (default 15; CPU: 7)")
    ap.add_argument("--vocab", type=int, default=None, help="default 49152, SmolLM2's (CPU: 97)")
    ap.add_argument("--max-len", type=int, default=None, help="the engine's max_len (default 1024; CPU: 64)")
    ap.add_argument(
        "--dtype", default=None, help="draft logits' and target's dtype (default bfloat16; CPU: float32)"
    )
    ap.add_argument("--replays", type=int, default=None, help="default 100 (CPU: 5)")
    ap.add_argument("--out", default=None, help="JSON path")
    args = ap.parse_args(argv)
    cuda = args.device.startswith("cuda")
    # CPU: the shapes of tests/decode/test_engine.py's compiled-tree tests, so a test run reuses their compilations
    args.budgets = [
        int(b) for b in (args.budgets or ("8,16,32,64,128,256,512" if cuda else "8,33")).split(",")
    ]
    args.slots = args.slots or (15 if cuda else 7)
    args.vocab = args.vocab or (49152 if cuda else 97)
    args.max_len = args.max_len or (1024 if cuda else 64)
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.replays = args.replays or (100 if cuda else 5)
    variants = args.variants.split(",")
    if variants[0] != "eager" or any(v not in VARIANTS for v in variants):
        raise SystemExit(
            f"--variants {args.variants}: start with eager, then any of {', '.join(VARIANTS[1:])}"
        )
    device_name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"# {device_name} | torch {torch.__version__} | {args.slots} slots x {args.vocab} {args.dtype} | "
          f"{'CUDA-graph replays' if cuda else 'eager calls'}, median of {args.replays}", flush=True)  # fmt: skip
    engines = build_engines(args, variants)
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(args.slots, args.vocab, generator=g) * 4.0).to(
        args.device, getattr(torch, args.dtype)
    )
    rows = []
    with torch.no_grad():
        for budget in args.budgets:
            row = measure(engines, logits, budget, args)
            rows.append(row)
            print(
                json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}),
                flush=True,
            )
    print(
        f"\nms per run ({' / '.join(variants)}), speedup over eager, kernels, setup s (compile + capture), equal"
    )
    for r in rows:
        ms = " / ".join(f"{r[v + '_ms']:.3f}" if v + "_ms" in r else "ERR" for v in variants)
        sp = " / ".join(f"{r[v + '_speedup']:.2f}x" if v + "_speedup" in r else "-" for v in variants[1:])
        kern = " / ".join(str(r.get(v + "_kernels", "-")) for v in variants)
        setup = " / ".join(f"{r[v + '_setup_s']:.1f}" if v + "_setup_s" in r else "-" for v in variants)
        eq = " / ".join(str(r.get(v + "_equal", "-")) for v in variants[1:])
        print(f"budget {r['budget']:4d} | {ms} ms | {sp} | kernels {kern} | setup {setup} s | equal {eq}")
    if args.out:
        meta = {"device": device_name, "torch": torch.__version__, "slots": args.slots, "vocab": args.vocab,
                "dtype": args.dtype, "max_len": args.max_len, "replays": args.replays, "variants": variants,
                "timing": "CUDA graph replay median (ms)" if cuda else "eager call median (ms, CPU)",
                "logits": "randn * 4"}  # fmt: skip
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        print("wrote", args.out)
    return rows


if __name__ == "__main__":
    main()
