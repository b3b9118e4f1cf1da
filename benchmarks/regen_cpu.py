"""One regeneration batch of the default target on the CPU: prefill and decode-step times, the loop engine's calls.

    python benchmarks/regen_cpu.py                       # bf16, 64 rows × 150 prompt tokens, sdpa
    python benchmarks/regen_cpu.py --strided-head        # as before the lm_head fix (flashdraft/target.py)
    python benchmarks/regen_cpu.py --attn eager

Random prompt ids (the times do not depend on the values), half the rows left-padded to half the width as in
`loop_generate`; `TargetModel.forward(..., logits="last")` with a DynamicCache, as regeneration calls it.
Prints one JSON line: prefill seconds (the fastest of 3), mean decode-step ms (10 steps after 3 warm-up steps), settings.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashdraft.cache import new_cache  # noqa: E402
from flashdraft.target import load_target  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--attn", default="sdpa")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=150)
    ap.add_argument("--strided-head", action="store_true", help="drop the lm_head's contiguous-input hook")
    a = ap.parse_args()
    t = load_target("default", dtype=a.dtype, attn_implementation=a.attn)
    if a.strided_head:
        t.lm_head._forward_pre_hooks.clear()
    b, p = a.rows, a.prompt
    ids = torch.randint(100, 40000, (b, p))
    attn = torch.ones(b, p + 16, dtype=torch.long)  # [b, P + steps]
    attn[: b // 2, : p // 2] = 0  # left padding
    pos = (attn[:, :p].cumsum(-1) - 1).clamp(min=0)  # [b, P]
    with torch.inference_mode():
        prefills = []
        for _ in range(3):  # the first call also sets up the CPU kernels: the minimum is reported
            cache = new_cache()
            t0 = time.perf_counter()
            out = t.forward(ids, attention_mask=attn[:, :p], position_ids=pos, cache=cache, logits="last")
            prefills.append(time.perf_counter() - t0)
        prefill = min(prefills)
        nxt = out.logits[:, -1].argmax(-1)[:, None]  # [b, 1]
        times = []
        for k in range(13):
            t0 = time.perf_counter()
            out = t.forward(nxt, attention_mask=attn[:, : p + k + 1], position_ids=pos[:, -1:] + k + 1, cache=cache,
                            logits="last")  # fmt: skip
            nxt = out.logits[:, -1].argmax(-1)[:, None]
            times.append(time.perf_counter() - t0)
    print(json.dumps({
        "prefill_s": round(prefill, 2), "decode_step_ms": round(sum(times[3:]) / 10 * 1e3, 1), "rows": b,
        "prompt_tokens": p, "dtype": a.dtype, "attn": a.attn, "strided_head": a.strided_head,
        "threads": torch.get_num_threads(),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
