"""Kernels per decode phase of the fast engine: the number a CUDA graph replays each round.

    python benchmarks/engine_op_count.py                 # SmolLM2-135M's depth (30 + 5 layers), narrow widths, CPU

On the H200 a 135M target's AR step costs ~3.1 ms where reading its weights takes ~0.06 ms
(measured 2026-12-03): the step is bound by how many small kernels it launches,
not by bandwidth. This counts them: every aten op dispatched by one eager run of each phase,
minus the ones that only make a view (no kernel). Widths do not change the count, so the
models are narrow; depths and head counts are SmolLM2's and the public drafter's.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

VIEWS = {
    "view", "_unsafe_view", "_reshape_alias", "transpose", "expand", "slice", "select", "unsqueeze", "squeeze",
    "as_strided", "t", "split", "split_with_sizes", "chunk", "narrow", "permute", "alias", "detach", "unbind",
    "lift_fresh", "_local_scalar_dense",
}  # fmt: skip


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if name not in VIEWS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def build(layers: int, drafter_layers: int, block: int) -> tuple[Any, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from flashdraft.drafter import DFlashDrafter
    from flashdraft.target import TargetModel, drafter_config_for

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=72, intermediate_size=192, num_hidden_layers=layers,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=8, max_position_embeddings=4096,
                      tie_word_embeddings=True)  # fmt: skip
    target = TargetModel(LlamaForCausalLM(cfg).eval())
    # the default layer picks of docs/method.md §2.2
    dcfg = drafter_config_for(target, num_layers=drafter_layers, block_size=block)
    return target, DFlashDrafter(dcfg).eval()


def count(engine: Any, method: str, budget: int | None) -> dict[str, int]:
    from flashdraft.decode.engine import SamplingParams

    engine.generate(list(range(3, 40)), max_new_tokens=8, method=method, budget=budget)  # a live state
    out = {}
    for name, fn in engine._round_phases(method, budget, SamplingParams(temperature=0.0)):
        with torch.no_grad(), OpCounter() as c:
            fn()
        out[name] = sum(c.ops.values())
    out["round"] = sum(out.values())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--drafter-layers", type=int, default=5)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from flashdraft.decode.engine import FastEngine

    target, drafter = build(args.layers, args.drafter_layers, args.block)
    engine = FastEngine(target, drafter, max_len=256, max_budget=64, cuda_graphs=False)
    rows = {"ar": count(engine, "ar", None), "chain": count(engine, "chain", None)}
    rows["ddtree-32"] = count(engine, "ddtree", 32)
    print(
        f"kernels (non-view aten ops) per phase; target {args.layers} layers, drafter {args.drafter_layers}"
    )
    print("| method | draft | tree | verify | commit | round |")
    print("|---|---:|---:|---:|---:|---:|")
    for m, r in rows.items():
        print(
            f"| {m} | "
            + " | ".join(str(r.get(k, "–")) for k in ("draft", "tree", "verify", "commit", "round"))
            + " |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"layers": args.layers, "drafter_layers": args.drafter_layers, "ops": rows}, f, indent=1
            )


if __name__ == "__main__":
    main()
