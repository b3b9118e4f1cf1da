"""Where regeneration's decode step goes, and which attention kernel makes it fastest, in one run.

    python3 benchmarks/gpu/regen_step.py $WORK/smollm2-bf16 --out $OUT/regen_step.json
    python benchmarks/gpu/regen_step.py random-tiny --device cpu --rows 4 --spans 256 --prompts 6 --new 8 \
        --out s.json                                                                          # smoke run

The native regeneration engine (`flashdraft.data.native.BatchedNativeTarget`) decodes `--rows` sequences per step
over a static cache; under continuous batching the rows' lengths spread between their prompt's and the longest
row's (the span the step reads). For each span in `--spans`, rows at lengths drawn uniformly from [span / 8, span)
(the longest at span − 1), the cache filled with random K/V, the median time of one step (a CUDA-graph replay, as
regeneration runs it) for each attention variant:
- `sdpa`: one mask over the span (`BatchedNativeTarget(attention="sdpa")`; SDPA picks its kernel), and SDPA pinned to
  each of its backends (`sdpa:efficient`, `sdpa:cudnn`, `sdpa:math`, where they run);
- `varlen`: flash attention over the packed cache with each row's own key count (`attention="varlen"`, the engine's
  default where it runs): the columns past a row's length are not read;
- `flex`: flex_attention's decoding kernel over a BlockMask of each row's own KV blocks (`flex_attention_step`, this
  file's, step only: slower than SDPA on an H100, benchmarks/RESULTS.md);
- `no-attention`: the step with attention replaced by a copy of the query: what the rest of the step costs;
- `--compiled A,…`: also attention A with the step through torch.compile inside its graph (`A+compile`,
  `BatchedNativeTarget(compile=True)`: norms, RoPE, SwiGLU and residuals fused; one compilation per span), step only.
Each variant's logits against `sdpa`'s at the same state: max |Δlogit| and argmax agreement.
Then end to end: `native_generate` on `--prompts` random-token prompts (lengths uniform in [32, --max-prompt]),
`--new` tokens each, no stop token, for `sdpa` and `varlen`: generated tokens/s and whether the ids agree.
`pick` in the JSON: the faster attention end to end (`pick`). Prints a table; writes JSON after each stage (a run
cut by `timeout` keeps what it measured).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # phase_timing
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # random_targets

from phase_timing import median_ms  # noqa: E402
from random_targets import SHAPES, random_target  # noqa: E402

import flashdraft.data.native as native  # noqa: E402
from flashdraft.data.loop import GenerationParams  # noqa: E402
from flashdraft.data.native import BatchedNativeTarget, native_generate  # noqa: E402
from flashdraft.target import load_target  # noqa: E402


def log(msg: str) -> None:
    print(msg, flush=True)


def sdpa_backend(name: str) -> Any:
    """A context pinning SDPA to one backend ("" = SDPA's own choice)."""
    if not name:
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([{"efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                         "math": SDPBackend.MATH}[name]])  # fmt: skip


def no_attention(self: BatchedNativeTarget, lengths: torch.Tensor, span: int, dtype: torch.dtype) -> Any:
    """`BatchedNativeTarget._attention` replaced by a copy of the query: the rest of the step."""
    return lambda q, k, v, scale: q[:, :, 0].clone()


FLEX_KV_BLOCK = 128  # columns per KV block of the decode BlockMask; span buckets are multiples of it


def decode_block_mask(lengths: torch.Tensor, span: int) -> Any:
    """A flex_attention BlockMask for one query per row over `span` cache columns, row r attending columns
    <= lengths[r]: its KV blocks are the first lengths[r] // FLEX_KV_BLOCK + 1, the last one masked inside. Built
    from tensors alone (no create_block_mask vmap), so a CUDA graph can replay it. The block table must be
    contiguous: flex's kernels index it by their own strides (an expanded view: an illegal memory access)."""
    from torch.nn.attention.flex_attention import BlockMask

    n_blocks = -(-span // FLEX_KV_BLOCK)
    rows = lengths.shape[0]
    kv_num = (lengths // FLEX_KV_BLOCK + 1).clamp(max=n_blocks).to(torch.int32)[:, None, None]  # [rows, 1, 1]
    kv_idx = torch.arange(n_blocks, dtype=torch.int32, device=lengths.device)
    kv_idx = kv_idx[None, None, None].expand(rows, 1, 1, n_blocks).contiguous()  # [rows, 1, 1, blocks]

    def causal_to_length(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return kv <= lengths[b]

    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, BLOCK_SIZE=FLEX_KV_BLOCK, mask_mod=causal_to_length, seq_lengths=(1, span)
    )  # fmt: skip


_FLEX: dict[str, Any] = {}


def flex_attention_step(
    self: BatchedNativeTarget, lengths: torch.Tensor, span: int, dtype: torch.dtype
) -> Any:
    """`BatchedNativeTarget._attention` as flex_attention over each row's own KV blocks (`decode_block_mask`):
    the columns past a row's length are not read. Compiled on CUDA (eager it materialises the scores)."""
    from torch.nn.attention.flex_attention import flex_attention

    if "fn" not in _FLEX:
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False) if lengths.is_cuda else flex_attention
    block_mask = decode_block_mask(lengths, span)
    gqa = self.n_heads > self.n_kv

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        k, v = k[:, :span].transpose(1, 2), v[:, :span].transpose(1, 2)  # [rows, kv, span, hd]
        return _FLEX["fn"](q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)[:, :, 0]

    return attend


PATCHED = {"flex": flex_attention_step, "no-attention": no_attention}  # the others: BatchedNativeTarget's own


def time_variant(
    target: Any, variant: str, rows: int, span: int, lengths: torch.Tensor, ids: torch.Tensor, reps: int
) -> tuple[float, torch.Tensor]:
    """The median ms of one step at this state, and the step's logits (float32, on the host)."""
    kind, _, backend = variant.partition(":")
    compiled = kind.endswith("+compile")
    kind = kind.removesuffix("+compile")
    net = BatchedNativeTarget(
        target, rows, span, compile=compiled, attention="varlen" if kind == "varlen" else "sdpa"
    )
    if kind in PATCHED:
        net._attention = PATCHED[kind].__get__(net)  # type: ignore[method-assign]
    gen = torch.Generator(device=net.cache.device).manual_seed(0)
    net.cache.normal_(generator=gen).mul_(0.5)
    cuda = target.device.type == "cuda"
    with sdpa_backend(backend):
        run = (
            (lambda: net.step_graphed(ids, lengths, span)) if cuda else (lambda: net.step(ids, lengths, span))
        )
        logits = run().float().cpu()
        ms = median_ms(run, reps, warmup=3, cuda=cuda)
    return ms, logits  # the net (its cache and graphs) goes with this frame


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", help="a target folder, or random-smollm2 / random-tiny (random weights)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--spans", default="512,1024,1536")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=2048, help="end to end: random-token prompts (0: skip)")
    ap.add_argument("--max-prompt", type=int, default=768)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument(
        "--compiled", default="", help="attentions also timed with the step compiled, e.g. varlen"
    )
    ap.add_argument("--out", required=True)
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    args = ap.parse_args(argv)
    if Path(args.out).exists() and not args.overwrite:
        raise SystemExit(f"--out {args.out} exists: pass --overwrite to replace it")
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    target = (
        random_target(args.target, dev, dtype) if args.target in SHAPES
        else load_target(args.target, device=str(dev), dtype=dtype)
    )  # fmt: skip
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({os.cpu_count()} cores)",
        "torch": torch.__version__, "target": args.target, "dtype": str(dtype), "rows": args.rows,
        "date": time.strftime("%Y-%m-%d"), "steps": [], "generate": [],
    }  # fmt: skip
    save = lambda: Path(args.out).write_text(json.dumps(out, indent=1))  # noqa: E731
    why_not = native.varlen_support_error(dev, dtype, native.attention_geometry(target)[2])
    if why_not:
        log(f"varlen left out: {why_not}")
    end_to_end = ["sdpa"] + ([] if why_not else ["varlen"])
    pinned = ["sdpa:efficient", "sdpa:cudnn", "sdpa:math"] if dev.type == "cuda" else []
    compiled = [f"{a}+compile" for a in args.compiled.split(",") if a and a in end_to_end]
    variants = [*end_to_end, *compiled, *pinned, "flex", "no-attention"]
    g = torch.Generator().manual_seed(0)
    vocab = target.model.config.vocab_size
    log(f"{out['device']}, {args.target}, {dtype}, {args.rows} rows")
    log(f"{'span':>5} {'variant':<15} {'ms/step':>8} {'× sdpa':>7} {'max|Δlogit|':>11} {'argmax =':>8}")
    for span in [int(s) for s in args.spans.split(",")]:
        lengths = torch.randint(span // 8, span, (args.rows,), generator=g)
        lengths[0] = span - 1
        ids = torch.randint(0, vocab, (args.rows,), generator=g)
        lengths, ids = lengths.to(dev), ids.to(dev)
        base_ms, base = None, None
        for variant in variants:
            try:
                ms, logits = time_variant(target, variant, args.rows, span, lengths, ids, args.reps)
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            except Exception as e:  # a backend that does not take these shapes: say so, go on
                log(f"{span:>5} {variant:<15} failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
                out["steps"].append(
                    {"span": span, "variant": variant, "error": f"{type(e).__name__}: {e}"[:500]}
                )
                continue
            if base is None:
                base_ms, base = ms, logits
            row = {"span": span, "variant": variant, "ms": round(ms, 3), "vs_sdpa": round(ms / base_ms, 3)}
            if variant != "no-attention":
                row["max_abs_dlogit"] = float((logits - base).abs().max())
                row["argmax_agree"] = float((logits.argmax(-1) == base.argmax(-1)).float().mean())
            out["steps"].append(row)
            save()
            log(f"{span:>5} {variant:<15} {ms:>8.3f} {ms / base_ms:>7.2f} {row.get('max_abs_dlogit', float('nan')):>11.3g} "
                f"{row.get('argmax_agree', float('nan')):>8.3f}")  # fmt: skip
    if args.prompts:
        lens = torch.randint(32, args.max_prompt + 1, (args.prompts,), generator=g).tolist()
        prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]
        params = GenerationParams(max_new_tokens=args.new, stop_ids=[])
        ids_by: dict[str, list[list[int]]] = {}
        log(f"end to end: {args.prompts} prompts of 32–{args.max_prompt} tokens, {args.new} new tokens each")
        for attention in end_to_end:
            run = partial(native_generate, target, params=params, seed=0, rows=args.rows, attention=attention)
            run(prompts[: args.rows])  # warm-up
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            gens = run(prompts)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            s = time.perf_counter() - t0
            ids_by[attention] = [gen.ids for gen in gens]
            n = sum(len(x) for x in ids_by[attention])
            row = {"attention": attention, "tokens": n, "s": round(s, 2), "tok_s": round(n / s)}
            if attention != "sdpa":
                row["same_ids_as_sdpa"] = sum(
                    a == b for a, b in zip(ids_by["sdpa"], ids_by[attention], strict=True)
                )
            out["generate"].append(row)
            save()
            log(f"  {attention:<6} {n:,} tokens in {s:.1f} s: {n / s:,.0f} tok/s"
                + (f"; {row['same_ids_as_sdpa']} of {args.prompts} sequences equal sdpa's" if attention != "sdpa" else ""))  # fmt: skip
    out["pick"] = pick(out)
    save()
    log(
        f"pick: {out['pick']} (end to end fastest of the attentions whose step argmax agreed with sdpa's as often as "
        "SDPA's other exact kernels did, less one point)"
    )
    log(f"wrote {args.out}")
    return out


# SDPA's other exact kernels: bf16 rounding alone sets them apart from its own choice
EXACT_KERNELS = ("sdpa:efficient", "sdpa:math")


def pick(out: dict[str, Any]) -> str:
    """The attention for regeneration: the fastest end to end (by 5% at least, else sdpa) among those whose step
    logits chose sdpa's token as often as SDPA's own other exact kernels do, less one point, at every span
    measured (random weights in bf16 leave many rows at near-ties, so even two exact kernels disagree on ~8% of
    them: H100, 2026-12-07); 99% where no other kernel ran."""

    def floor(span: int) -> float:
        exact = [r["argmax_agree"] for r in out["steps"]
                 if r["span"] == span and r["variant"] in EXACT_KERNELS and "argmax_agree" in r]  # fmt: skip
        return min(exact) - 0.01 if exact else 0.99

    varlen = [r for r in out["steps"] if r["variant"] == "varlen"]
    ok = {"sdpa"} | (
        {"varlen"} if varlen and all(r.get("argmax_agree", 0) >= floor(r["span"]) for r in varlen) else set()
    )
    rate = {r["attention"]: r["tok_s"] for r in out["generate"] if r["attention"] in ok}
    best = max(rate, key=rate.__getitem__, default="sdpa")
    return best if best == "sdpa" or rate[best] >= 1.05 * rate.get("sdpa", 0) else "sdpa"


if __name__ == "__main__":
    main()
