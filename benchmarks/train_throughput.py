"""Training throughput: target features computed in the loop (online, in-process), drafter step timed apart.

    python benchmarks/train_throughput.py                                  # SmolLM2-135M + 5-layer b16 drafter, CUDA
    python benchmarks/train_throughput.py --json benchmarks/results/train_throughput.json
    python benchmarks/train_throughput.py --device cpu --tiny --steps 3    # a CPU smoke run of the same code path
    python benchmarks/train_throughput.py --queue-depth 4                  # online pipeline: target in a producer thread
    python benchmarks/train_throughput.py --queue-depth 4 --device cuda:1 --target-device cuda:0
    python benchmarks/train_throughput.py --feature-pass hf,native,native-compiled   # feature passes, one process

Each measured step runs the trainer's own code (`InProcessSource` → `Trainer.optimizer_step`),
with a device sync around the target pass and around the drafter step so the split is exact
(the trainer itself does not sync there). Reported:

- target tokens/s: packed target tokens per second of (target + drafter) time;
- drafter-step MFU: model FLOPs / drafter-step time / peak, model FLOPs counted as the trainer
  counts them (`flashdraft.train.flops.step_flops`: parameters, frozen lm_head and attention over
  unmasked query–key pairs, valid blocks only); the trainer's own `mfu` divides by the whole
  interval's wall time instead (target and waits included);
- time split target / drafter, peak memory (CUDA allocator);
- per timed step, inside the drafter-step window: the host's pauses in Python's cyclic GC
  (`gc_ms_per_step`, the highest generation collected in `gc_max_generation_per_step`) and the
  host time spent sampling anchors and building blocks (`host_blocks_ms_per_step`).
  `--host-threads N` applies runtime.host_threads (torch's
  intra-op CPU threads, `flashdraft.train.host`; unset: the config's auto, 1 on CUDA); the result's
  `host_threads` records the resolved setting and torch.get_num_threads() during the steps.

With `--queue-depth N` the target runs in the pipeline's producer thread (its own CUDA
stream, `flashdraft.train.pipeline.QueuedSource`), N batches ahead, as `flashdraft train`
runs it; then "target_s" is the time the trainer waited for features (consumer wait), and
the consumer wait fraction, mean queue depth and producer time per batch are reported.
Only the trainer's stream is synchronised around the drafter step, so the producer keeps
running underneath it.
With `--inline-ahead` (queue depth 0) the target pass of the next batch is launched on a side stream before
the trainer takes the current one, from the trainer's own thread (`pipeline.inline_ahead=1`, the way to overlap
the native pass, which may not run in a producer thread on CUDA); timed the same way.
`--feature-pass hf,native,native-compiled` runs the steps once per variant — runtime.feature_pass=hf
(transformers' forward), =native (the packed pass of `flashdraft.train.target_pass`), and native with
runtime.compile's "target" part (its whole forward compiled), and native-graph (that compiled pass replayed as a
CUDA graph: runtime.compile's "target_graph" part too) — over the same target, documents and seeds, a
fresh drafter each, and prints each variant's target pass time and target tokens/s against the first's.
Documents are synthetic (random ids, the first `--prompt-frac` of each outside the loss
mask) unless `--dataset` names a flashdraft dataset: throughput depends on lengths, not ids.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from random_targets import SHAPES, random_target  # benchmarks/ (the script folder)

from flashdraft.config import load_config
from flashdraft.train import trainer as trainer_module
from flashdraft.train.config import TrainConfig
from flashdraft.train.flops import block_tokens, step_flops
from flashdraft.train.host import HostThreads, resolve_host_threads
from flashdraft.train.launch import build_drafter, compile_parts, resolve_precision
from flashdraft.train.metrics import MetricsLogger
from flashdraft.train.pipeline import FrozenHeads, QueuedSource, resolve_target_device
from flashdraft.train.source import InProcessSource
from flashdraft.train.trainer import Interval, Trainer


@dataclass
class Doc:
    id: str
    input_ids: np.ndarray
    loss_mask: np.ndarray


def synthetic_docs(
    n: int, mean_len: int, max_len: int, vocab: int, prompt_frac: float, seed: int
) -> list[Doc]:
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(n):
        length = int(min(max_len, max(16, rng.integers(mean_len // 2, mean_len * 3 // 2 + 1))))
        p = int(length * prompt_frac)
        docs.append(
            Doc(f"s{i}", rng.integers(0, vocab, length), np.r_[np.zeros(p, bool), np.ones(length - p, bool)])
        )
    return docs


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sync_stream(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class GCPauses:
    """Host time inside Python's cyclic GC (`gc.callbacks`), summed until `take()`; collections per generation."""

    def __init__(self) -> None:
        self.ms = 0.0
        self.max_gen: int | None = None
        self.by_gen: dict[int, list[float]] = {}  # generation -> [collections, ms] over the whole run
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        ms = 1e3 * (time.perf_counter() - self._t0)
        g = info["generation"]
        self.ms += ms
        self.max_gen = g if self.max_gen is None else max(self.max_gen, g)
        n_ms = self.by_gen.setdefault(g, [0, 0.0])
        n_ms[0] += 1
        n_ms[1] += ms

    def take(self) -> tuple[float, int | None]:
        out = (self.ms, self.max_gen)
        self.ms, self.max_gen = 0.0, None
        return out


class HostBlockTimer:
    """Wall time of the trainer's host-side block building (anchor sampling + build_blocks), summed until
    `take()`: wraps the trainer's sampler and the trainer module's build_blocks (this process only)."""

    def __init__(self, trainer: Trainer) -> None:
        self.s = 0.0
        trainer.anchor_sampler.sample = self._timed(trainer.anchor_sampler.sample)  # type: ignore[method-assign]
        trainer_module.build_blocks = self._timed(trainer_module.build_blocks)  # type: ignore[assignment]

    def _timed(self, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.s += time.perf_counter() - t0

        return timed

    def take(self) -> float:
        out, self.s = self.s, 0.0
        return out


def profile_steps(
    trainer: Trainer, batches: Any, steps: int, grad_accum: int, device: torch.device, block: int
) -> None:
    """Where an optimizer step's time goes: torch.profiler over `steps` steps, the top rows by device
    time (CUDA) or CPU time, printed as a table (the lever for the drafter step's MFU)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            trainer.optimizer_step([next(batches) for _ in range(grad_accum)], Interval(block, device))
        sync(device)
        wall = time.perf_counter() - t0
    avg = prof.key_averages()
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(avg.table(sort_by=key, row_limit=25, max_name_column_width=60), flush=True)
    # kernel time as the table's "Self CUDA time total" counts it; the rest of the wall is the GPU waiting
    kernels = sum(e.self_device_time_total for e in avg if e.device_type == DeviceType.CUDA) / 1e6
    gpu = f", kernels {1e3 * kernels / steps:.1f} ms/step, GPU idle {max(0.0, 1 - kernels / wall):.1%}"
    print(f"profiled {steps} optimizer steps (target pass included): wall {1e3 * wall / steps:.1f} ms/step"
          + (gpu if device.type == "cuda" else ""))  # fmt: skip
    for e in sorted((e for e in avg if e.key.startswith("step/")), key=lambda e: e.key):  # Trainer phases
        print(f"  {e.key:<20} host {e.cpu_time_total / 1e3 / steps:8.2f} ms/step   "
              f"device {e.device_time_total / 1e3 / steps:8.2f} ms/step")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--target", default="default", help="target for load_target (ignored with --tiny)")
    ap.add_argument("--tiny", action="store_true", help="a tiny random target and drafter (CPU smoke run)")
    ap.add_argument(
        "--dataset", default=None, help="a flashdraft dataset folder instead of synthetic documents"
    )
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-length", type=int, default=3072)
    ap.add_argument("--token-budget", type=int, default=16384)
    ap.add_argument("--max-anchors", type=int, default=512)
    ap.add_argument("--doc-length", type=int, default=1024, help="mean synthetic document length")
    ap.add_argument("--prompt-frac", type=float, default=0.2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument(
        "--warmup-steps", type=int, default=5, help="untimed steps first (compilation, autotuning)"
    )
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--compile", default="attention,loss",
                    help="as the train config's runtime.compile (none, or a subset of attention,loss,model)")  # fmt: skip
    ap.add_argument("--blocks-per-row", type=int, default=0,
                    help="as data.blocks_per_row (> 0: static shapes; needed by --compile model)")  # fmt: skip
    ap.add_argument("--compile-mode", default="default",
                    help="as runtime.compile_mode: default or max-autotune-no-cudagraphs")  # fmt: skip
    ap.add_argument("--fused-ce", action="store_true", help="loss.fused_ce=true: the two-pass CE chunk")
    ap.add_argument("--chunk-tokens", type=int, default=4096, help="as loss.chunk_tokens")
    ap.add_argument(
        "--flex-block", default="128,128", help="as runtime.flex_block_size: the BlockMask's Q,KV tile"
    )
    ap.add_argument("--peak-tflops", type=float, default=790.0, help="bf16 ceiling of the device (H200: 790)")
    ap.add_argument("--queue-depth", type=int, default=0, help="> 0: online pipeline with this queue depth")
    ap.add_argument("--inline-ahead", action="store_true",
                    help="queue depth 0 with pipeline.inline_ahead=1: each target pass launched one batch ahead on "
                         "a side stream from the trainer's thread")  # fmt: skip
    ap.add_argument("--target-device", default="same", help="the target's device (pipeline), e.g. cuda:0")
    ap.add_argument("--host-threads", type=int, default=None,
                    help="as runtime.host_threads: 0 = torch's thread count, N >= 1 = torch.set_num_threads(N) "
                         "during the steps (unset: the config's auto, 1 on CUDA, torch's default on CPU)")  # fmt: skip
    ap.add_argument("--feature-pass", default="hf",
                    help="comma-separated variants measured one after the other in this process (same target, "
                         "data, seeds; a fresh drafter each): hf, native (runtime.feature_pass), native-compiled "
                         "(native with runtime.compile's target part) and native-graph (target_graph too)")  # fmt: skip
    ap.add_argument("--json", default=None, help="write the results here (a list of them for several passes)")
    ap.add_argument("--profile", type=int, default=0,
                    help="profile this many optimizer steps after the timed ones: print the top kernels / ops")  # fmt: skip
    args = ap.parse_args()

    device = torch.device(args.device)
    if args.tiny:
        args.max_length, args.token_budget = min(args.max_length, 256), min(args.token_budget, 512)
        args.doc_length, args.max_anchors = min(args.doc_length, 96), min(args.max_anchors, 32)
    variants = [v.strip() for v in args.feature_pass.split(",") if v.strip()]
    if not variants or not set(variants) <= {"hf", "native", "native-compiled", "native-graph"}:
        ap.error(f"--feature-pass {args.feature_pass!r}: comma-separated hf, native, native-compiled, native-graph")
    cfgs = [config_for(args, device, v) for v in variants]
    prec = resolve_precision(cfgs[0], device)
    target_device = resolve_target_device(args.target_device, device)
    t_load = time.perf_counter()
    if args.tiny or args.target in SHAPES:
        target = random_target("random-tiny" if args.tiny else args.target, target_device, prec.target)
    else:
        from flashdraft.target import load_target

        target = load_target(args.target, dtype=prec.target, device=target_device)
    load_s = time.perf_counter() - t_load
    if args.dataset:
        from flashdraft.data.dataset import open_dataset

        docs = open_dataset(args.dataset, "train")
        lengths = [int(n) for n in docs.lengths]
    else:
        n_docs = (
            4
            * (args.steps + args.warmup_steps)
            * args.grad_accum
            * max(1, args.token_budget // args.doc_length)
        )
        docs = synthetic_docs(
            n_docs, args.doc_length, args.max_length, target.vocab_size, args.prompt_frac, 0
        )
        lengths = [len(d.input_ids) for d in docs]
    results = []
    for variant, cfg in zip(variants, cfgs, strict=True):
        result = {"variant": variant, **measure(args, cfg, target, target_device, docs, lengths)}
        result["target_load_s"] = load_s
        results.append(result)
        w = max(len(k) for k in result)
        print(
            f"== {variant}: runtime.feature_pass={cfg.runtime.feature_pass} runtime.compile={cfg.runtime.compile}"
        )
        for k, v in result.items():
            shown = f"{v:,.4g}" if isinstance(v, float) and math.isfinite(v) else v
            print(f"{k:<{w}}  {shown}")
    if len(results) > 1:
        base = results[0]
        for r in results[1:]:
            print(f"{r['variant']} / {base['variant']}: target pass time "
                  f"{r['target_s'] / base['target_s']:.3f}x, target tokens/s {r['target_tokens_per_s'] / base['target_tokens_per_s']:.3f}x, "
                  f"first-step loss {r['loss_first_step']:.4f} vs {base['loss_first_step']:.4f}")  # fmt: skip
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(out.suffix + ".tmp")
        tmp.write_text(json.dumps(results[0] if len(results) == 1 else results, indent=2) + "\n")
        tmp.replace(out)
        print(f"wrote {out}")


def config_for(args: argparse.Namespace, device: torch.device, variant: str) -> TrainConfig:
    """The benchmark's TrainConfig for one --feature-pass variant: runtime.compile is --compile, with the "target"
    part added for native-compiled (and "target_graph" for native-graph) and dropped for hf (it compiles the native
    pass only); native leaves --compile as it is."""
    feature_pass = "hf" if variant == "hf" else "native"
    parts = [p.strip() for p in args.compile.split(",") if p.strip() not in ("", "none")]
    if variant == "hf":
        parts = [p for p in parts if p not in ("target", "target_graph")]
    if variant in ("native-compiled", "native-graph") and "target" not in parts:
        parts.append("target")
    if variant == "native-graph" and "target_graph" not in parts:
        parts.append("target_graph")
    compile_ = ",".join(parts) or "none"
    return load_config(
        TrainConfig, None,
        [f"model.num_layers={2 if args.tiny else args.layers}", f"model.block_size={args.block_size}",
         f"data.max_length={args.max_length}", f"data.token_budget={args.token_budget}",
         f"data.max_anchors={args.max_anchors}", f"optim.grad_accum={args.grad_accum}",
         f"data.blocks_per_row={args.blocks_per_row}",
         f"optim.max_steps={args.steps + args.warmup_steps}", f"runtime.device={device}",
         f"runtime.compile={compile_}", "data.dataset=<benchmark>", "telemetry.progress=false",
         f"runtime.feature_pass={feature_pass}",
         f"runtime.compile_mode={args.compile_mode}", f"loss.fused_ce={str(args.fused_ce).lower()}",
         f"loss.chunk_tokens={args.chunk_tokens}", f"runtime.flex_block_size=[{args.flex_block}]",
         *([f"runtime.host_threads={args.host_threads}"] if args.host_threads is not None else [])],
    )  # fmt: skip


def measure(
    args: argparse.Namespace,
    cfg: TrainConfig,
    target: Any,
    target_device: torch.device,
    docs: Any,
    lengths: list[int],
) -> dict[str, Any]:
    """Warm-up and timed optimizer steps with one feature pass and a fresh drafter (seeded: every pass starts
    from the same weights); returns the result dict."""
    device = torch.device(cfg.runtime.device)
    prec = resolve_precision(cfg, device)
    drafter = build_drafter(cfg, target, device, prec.params)
    compile_target = "target" in cfg.runtime.compile_parts and target_device.type == "cuda"
    source = InProcessSource(
        docs, target, drafter.target_layer_ids, max_length=args.max_length, token_budget=args.token_budget,
        epochs=None, seed=0, pad_multiple=cfg.data.pad_multiple, lengths=lengths,
        feature_pass=cfg.runtime.feature_pass, compile_target=compile_target,
    )  # fmt: skip
    queued = args.queue_depth > 0 or args.inline_ahead
    if args.queue_depth > 0:
        source = QueuedSource(source, depth=args.queue_depth, device=device, source_device=target_device)
    elif args.inline_ahead:  # pipeline.inline_ahead=1: the next target pass on a side stream, same thread
        source = QueuedSource(source, depth=0, ahead=1, device=device, source_device=target_device)
    heads = target if target_device == device else FrozenHeads(target, device)
    attention = "flex" if device.type == "cuda" else "dense"
    model: Any = compile_parts(
        drafter, cfg.runtime.compile_parts, device, attention, cfg.runtime.compile_mode
    )
    run_dir = tempfile.mkdtemp(prefix="train-throughput-")
    trainer = Trainer(
        cfg, heads, drafter, source, run_dir=run_dir, model=model,
        logger=MetricsLogger(run_dir, enabled=False), device=device, compute_dtype=prec.compute, attention=attention,
    )  # fmt: skip
    hcfg = drafter.config
    params = trainer.trainable_params
    batches = iter(source)
    rows = []
    step_losses = []  # device scalars, read after the timed loop: variants must train alike (same seeds)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    # queued: sync the trainer's stream only (a device-wide sync would wait for the producer too)
    wait = (lambda: sync_stream(device)) if queued else (lambda: sync(device))  # noqa: E731
    gc_pauses, host_blocks = GCPauses(), HostBlockTimer(trainer)
    gc.callbacks.append(gc_pauses)
    # as Trainer.run applies runtime.host_threads (warm-up steps included: the run compiles inside them too)
    threads = resolve_host_threads(cfg.runtime.host_threads, device)
    with HostThreads(threads):
        torch_threads = torch.get_num_threads()
        for i in range(args.warmup_steps + args.steps):
            wait()
            t0 = time.perf_counter()
            micro = [next(batches) for _ in range(args.grad_accum)]
            wait()
            t1 = time.perf_counter()
            gc_pauses.take()  # the drafter-step window starts here: drop what came before
            host_blocks.take()
            iv = Interval(hcfg.block_size, device)
            drafts = trainer.optimizer_step(micro, iv)
            step_losses.append(iv.loss_sum)
            wait()
            t2 = time.perf_counter()
            gc_ms, gc_gen = gc_pauses.take()
            if i == args.warmup_steps - 1 and queued:
                source.take_stats()  # pipeline stats cover the timed steps only
            if i < args.warmup_steps:
                continue
            rows.append(
                {
                    "target_s": t1 - t0,
                    "drafter_s": t2 - t1,
                    "gc_ms": gc_ms,
                    "gc_gen": gc_gen,
                    "host_blocks_s": host_blocks.take(),
                    "tokens": sum(fb.num_tokens for fb in micro),
                    "padded_tokens": sum(fb.input_ids.numel() for fb in micro),
                    "block_tokens": sum(block_tokens(d) for d in drafts),
                    "padded_block_tokens": sum(d.block_ids.numel() for d in drafts),
                    "flops": step_flops(drafts, hcfg, params),
                }
            )
    gc.callbacks.remove(gc_pauses)
    if args.profile:
        profile_steps(trainer, batches, args.profile, args.grad_accum, device, hcfg.block_size)
    tot = {k: sum(r[k] for r in rows) for k in rows[0] if k != "gc_gen"}
    step_s = tot["target_s"] + tot["drafter_s"]
    mfu = tot["flops"] / tot["drafter_s"] / (args.peak_tflops * 1e12)
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "target": target.name,
        "feature_pass": cfg.runtime.feature_pass,
        "drafter_layers": hcfg.num_hidden_layers,
        "drafter_params": params,
        "block_size": hcfg.block_size,
        "max_length": args.max_length,
        "token_budget": args.token_budget,
        "max_anchors": args.max_anchors,
        "grad_accum": args.grad_accum,
        "compile": cfg.runtime.compile if device.type == "cuda" else "none",
        "compile_mode": cfg.runtime.compile_mode,
        "fused_ce": cfg.loss.fused_ce,
        "chunk_tokens": cfg.loss.chunk_tokens,
        "flex_block_size": list(cfg.runtime.flex_block_size),
        "blocks_per_row": args.blocks_per_row,
        "attention": attention,
        "precision": {"target": str(prec.target), "params": str(prec.params), "compute": str(prec.compute)},
        "steps": args.steps,
        "target_tokens_per_s": tot["tokens"] / step_s,
        "drafter_only_target_tokens_per_s": tot["tokens"] / tot["drafter_s"],
        "block_tokens_per_s": tot["block_tokens"] / step_s,
        "step_s": step_s / len(rows),
        "target_s": tot["target_s"] / len(rows),
        "drafter_s": tot["drafter_s"] / len(rows),
        "target_fraction": tot["target_s"] / step_s,
        "row_padding_fraction": 1 - tot["tokens"] / tot["padded_tokens"],
        "block_padding_fraction": 1 - tot["block_tokens"] / tot["padded_block_tokens"],
        "drafter_tflops_per_s": tot["flops"] / tot["drafter_s"] / 1e12,
        "drafter_mfu": mfu,
        # per timed step: the mean hides drift (on the H200 25 timed steps gave 85-90 ms, 50 steps 108 ms)
        "drafter_ms_per_step": [round(1e3 * r["drafter_s"], 2) for r in rows],
        "drafter_mfu_per_step": [
            round(r["flops"] / r["drafter_s"] / (args.peak_tflops * 1e12), 4) for r in rows
        ],
        # the host inside each drafter-step window: cyclic GC pauses (a slow-step hypothesis) and block
        # building (anchors + build_blocks); the highest GC generation collected there, null for none
        # runtime.host_threads resolved (0 = torch's count left alone) and torch's intra-op threads during the steps
        "host_threads": {"setting": threads, "torch_threads": torch_threads},
        "gc_ms_per_step": [round(r["gc_ms"], 2) for r in rows],
        "gc_max_generation_per_step": [r["gc_gen"] for r in rows],
        # every collection in the process, warm-up and target pass included: generation -> [count, ms]
        "gc_collections": {str(g): [n, round(ms, 2)] for g, (n, ms) in sorted(gc_pauses.by_gen.items())},
        "host_blocks_ms_per_step": [round(1e3 * r["host_blocks_s"], 2) for r in rows],
        # the same seeds, data and anchors in every run: a lever that changes the maths shows up here
        "loss_first_step": float(step_losses[0]),
        "loss_last_step": float(step_losses[-1]),
        "peak_tflops": args.peak_tflops,
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30
        if device.type == "cuda"
        else None,
        "queue_depth": args.queue_depth,
        "inline_ahead": bool(args.inline_ahead),
        "target_device": str(target_device),
    }
    if queued:
        stats = source.take_stats()
        source.close()
        result["consumer_wait_fraction"] = tot["target_s"] / step_s  # trainer time spent waiting for features
        result["mean_queue_depth"] = stats["pipeline/queue_depth"]  # batches ready when the trainer asked
        result["producer_s_per_batch"] = stats["pipeline/producer_s_per_batch"]
    return result


if __name__ == "__main__":
    main()
