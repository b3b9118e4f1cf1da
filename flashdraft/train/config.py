"""The training run config: nested dataclasses, loaded strictly by `flashdraft.config`.

    flashdraft train configs/smollm2-b16.yaml optim.lr=3e-4 data.max_anchors=1024

Every default that needs a reason says it in a comment. `validate()` turns impossible
combinations into one-line errors that name the field and the fix.
"""

from __future__ import annotations

import re
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

from flashdraft.config import ConfigError, Removed

COMPILE_PARTS = {"attention", "loss", "model", "target", "target_graph"}
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")  # the devices the trainer runs on (runtime.device)


@dataclass
class ModelConfig:
    target: str = "default"  # HF folder / hub id / .gguf / "default" (embedded SmolLM2-135M-Instruct)
    target_dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU (the target is frozen)
    num_layers: int = 5  # drafter depth; the public b16 drafters use 5 for 8B targets
    block_size: int = 16  # B; the public drafters are b16
    num_attention_heads: int | None = None  # None: copy the target's
    num_key_value_heads: int | None = None  # None: copy the target's
    head_dim: int | None = None  # None: copy the target's
    intermediate_size: int | None = None  # None: copy the target's
    target_layer_ids: list[int] | None = None  # None: docs/method.md §2.2 default (evenly from 1 to L_t − 3)
    mask_token_id: int | None = None  # None: flashdraft.target.default_mask_token_id
    init_std: float = 0.02  # random init of the drafter's linears (the paper trains from scratch)
    init_from: str | None = None  # a DFlash drafter folder to start from instead of random weights
    # none | last | next: copy target layers into the drafter (last L_d, or those after the deepest feature)
    # and start fc as the deepest feature (flashdraft.target.init_drafter_from_target). Off: the paper
    # trains from scratch; the CPU quickstart's briefly trained drafter uses it (benchmarks/RESULTS.md)
    init_from_target: str = "none"
    # with init_from: N new layers after the loaded drafter's, their output projections zero so it starts as the
    # loaded drafter's function (DFlashDrafter.grown); a deeper drafter without giving up the trained layers.
    # The other shape fields (num_layers, heads, …) are the loaded drafter's, whatever this config says
    grow_layers: int = 0

    # keys added after runs stored their config hash, at the value those runs had (`hashed_section`)
    ADDED: ClassVar[dict[str, Any]] = {"grow_layers": 0}


@dataclass
class DataConfig:
    dataset: str = (
        ""  # a flashdraft dataset folder (flashdraft.data), or a .jsonl of {id, input_ids, loss_mask}
    )
    split: str = "train"
    max_length: int = 3072  # paper recipe; longer documents are truncated
    token_budget: int = 16384  # target tokens per micro-batch (rows of max_length); the main memory knob
    max_anchors: int = 512  # per document (paper: 512; 1024 is a common larger setting)
    # where a document or row offers more anchors than it keeps: the weight of an anchor whose next token repeats an
    # earlier 8-gram of its answer (a loop), against 1 for the others; 1 = uniform (flashdraft/train/blocks.py)
    loop_anchor_weight: float = 1.0
    shuffle: bool = True  # a fresh seeded order every epoch
    pad_multiple: int = 64  # pad row length so compiled kernels see few distinct shapes
    # 0: each row gets a block per sampled anchor (shapes vary per batch). N > 0: static shapes — every
    # micro-batch is [token_budget // max_length rows, max_length] with exactly N blocks per row (rows
    # offering more anchors keep a random N); what runtime.compile=model needs to compile once
    blocks_per_row: int = 0

    # keys added after runs stored their config hash, at the value those runs had (`hashed_section`)
    ADDED: ClassVar[dict[str, Any]] = {"loop_anchor_weight": 1.0}
    REMOVED: ClassVar[dict[str, Removed]] = {
        "greedy_labels": Removed(
            "labelling the prompts with the target's greedy tokens measured no better: held-out chain tau 1.480 vs "
            "1.483 and 1.513 vs 1.524 at 2.9x the features cost, 2-core Xeon CPU, 2026-12-05",
            inert=(False,),
        ),
    }


@dataclass
class LossConfig:
    gamma: float | None = None  # None: 7 / 5 / 4 for B = 16 / 10 / 8 (paper)
    chunk_tokens: int = 4096  # labelled tokens per lm_head chunk: bounds the [chunk, V] float32 logits
    # two passes over each chunk's logits (max/argmax/Σexp, then the gradient) in the matmul dtype instead of
    # log_softmax's float32 passes; same values (tests/train/test_loss.py). None: on exactly where the loss is
    # compiled (CUDA with "loss" in runtime.compile) — there the drafter step took 0.745x the time (H200,
    # 2026-12-03, RESULTS.md "Training throughput and MFU"); eager on CPU it is slower (0.41 vs 0.25 s a quickstart step), so off there
    fused_ce: bool | None = None
    # 0: the CE's softmax runs over the whole vocabulary (paper). N > 0: over the N most frequent label tokens of
    # the training split (labels outside carry no loss): a cheaper step where the head dominates it (a small
    # drafter on a CPU); decoding still drafts from every token (flashdraft.train.vocab)
    softmax_vocab: int = 0

    REMOVED: ClassVar[dict[str, Removed]] = {
        key: Removed(
            "Gaussian input noise never moved held-out chain tau: 1.286 / 1.283 vs 1.285 at noise 0.1 (H200, "
            "2026-12-03) and 1.42 vs 1.42 at feature noise 0.15 (2-core CPU, 2026-12-03)",
            inert=(0.0, 0),
        )
        for key in ("feature_noise", "embedding_noise")
    }


@dataclass
class OptimConfig:
    lr: float = 6e-4  # paper recipe
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # common for transformer pretraining
    # the paper does not report decay; 0.1 measured no better (held-out chain tau 1.295 vs 1.285, H200, 2026-12-03)
    weight_decay: float = 0.0
    warmup_ratio: float = 0.04  # paper: 4% warmup
    min_lr_ratio: float = 0.0  # cosine decays to lr × this
    grad_clip: float = 1.0  # paper recipe
    epochs: int = 6  # paper: ~6 epochs
    max_steps: int | None = None  # overrides epochs when set (optimizer steps)
    grad_accum: int = 1  # micro-batches per optimizer step
    max_bad_steps: int = 5  # stop after this many NaN/inf steps in a row
    # > 0: checkpoints hold an exponential moving average of the weights with this decay per step (warmed up
    # as min(decay, (1 + step) / (10 + step)); flashdraft/train/ema.py). 0: off (the paper's recipe)
    ema_decay: float = 0.0
    # one LR schedule spread over several runs, each starting from the last one's weights (a campaign's stints):
    # its warmup (warmup_ratio of it) and cosine span schedule_steps optimizer steps, and this run takes its steps
    # from schedule_start on, ending at its end at the latest. A run starting past 0 has fresh optimizer moments,
    # so it ramps up to the schedule's rate over its own first warmup_ratio × its steps (at most 100). None: the
    # schedule is this run's own
    schedule_steps: int | None = None
    schedule_start: int = 0

    # keys added after runs stored their config hash, at the value those runs had (`hashed_section`)
    ADDED: ClassVar[dict[str, Any]] = {"schedule_steps": None, "schedule_start": 0}


@dataclass
class RuntimeConfig:
    device: str = "auto"  # auto: cuda if available, else cpu
    dtype: str = "auto"  # auto: bf16 autocast with fp32 master weights on CUDA, float32 on CPU
    seed: int = 0
    deterministic: bool = False  # torch.use_deterministic_algorithms; CPU runs are reproducible either way
    # what runs through torch.compile on CUDA (ignored on CPU), comma-separated: "attention" (the
    # FlexAttention kernel; the drafter eager, any batch shape), "loss" (the lm_head + cross-entropy
    # chunk, padded to a fixed chunk shape), "model" (the whole drafter, FlexAttention included: needs
    # data.blocks_per_row > 0 so it compiles once), "target" (the native feature pass's whole forward, every
    # micro-batch padded to [token_budget // max_length rows, max_length]: one graph; needs runtime.feature_pass=native),
    # "target_graph" (with target: that compiled pass and its block mask replayed as one CUDA graph, the host's
    # kernel launches gone; not yet measured on a GPU); or "none"
    compile: str = "attention,loss"
    # stop (with a checkpoint) after this many minutes; the LR schedule still follows max_steps /
    # epochs, so `--resume` continues it (fixed device budgets, preemptible slots)
    time_limit_min: float | None = None
    # with time_limit_min: after the first ~100 steps, shorten the run (max_steps / epochs and the LR schedule
    # with them) to the steps the time limit holds at the measured pace, so the schedule decays to its end
    # instead of being cut off by the limit (one budget, machines of different speeds)
    fit_steps_to_time_limit: bool = False
    attention: str = "auto"  # auto: flex on CUDA, dense bool mask on CPU; or "flex" / "dense"
    # how the online target computes features: "hf" = transformers' forward with a dense [R, 1, S, S] document mask
    # (any target); "native" = the target's own layers without it (flashdraft/train/target_pass.py: FlexAttention
    # document mask on CUDA, no layer after the deepest feature; Llama / Qwen2 / Qwen3 / Mistral, others refused at
    # start-up). Same features (float64 tests). On an H100 (2026-12-06, benchmarks/train_throughput.py --feature-pass
    # hf,native,native-compiled) the target pass took 50.6 ms (hf), 34.2 ms (native) and 21.6 ms (native with
    # runtime.compile=...,target) per 16,384-token micro-batch. On CUDA the native pass runs in the trainer's thread
    # (no producer thread: flashdraft.train.pipeline.inline_reason). The default stays hf because it takes any
    # target. A runtime field, not a model one: the pass does not change the training problem, so config_hash (and
    # resuming) ignores it
    feature_pass: str = "hf"
    # the FlexAttention BlockMask's (Q, KV) tile; torch's default 128 × 128 is partial at the edges of every
    # run of 16-token blocks (flashdraft/train/blocks.py). Powers of two in 16..128; kernel tiles follow. Compiled,
    # tiles below 128 need runtime.compile=model with compile_mode max-autotune-no-cudagraphs: under the default
    # mode [64, 64]'s backward found no kernel (NoValidChoicesError; torch 2.11, H200 sm90, head dim 64,
    # benchmarks/gpu/mfu_ab.sh, 2026-12-03): the default backward tiles are 128 wide and must divide these
    flex_block_size: list[int] = field(default_factory=lambda: [128, 128])
    # torch.compile mode for runtime.compile=model: default or max-autotune-no-cudagraphs (its extra kernel
    # configs, what flex tiles below 128 need; long compile)
    compile_mode: str = "default"
    # where the target (the feature producer) runs: "same" = the drafter's device, "cuda:1", or one
    # device per local rank under torchrun, comma-separated ("cuda:4,cuda:5,cuda:6,cuda:7")
    target_device: str = "same"
    # torch's intra-op CPU threads during Trainer.run (flashdraft/train/host.py). None = auto: 1 when the drafter
    # runs on CUDA (the host only queues kernels and builds small index tensors; with torch's one thread per core
    # a descheduled thread stalls every tiny op's barrier: the H200's slow steps of 2026-12-04, 0 with one thread), torch's
    # default on CPU (the CPU trains with those threads); 0 = leave torch's setting alone; N >= 1 = N threads
    # (torch.set_num_threads, the previous count restored on exit)
    host_threads: int | None = None

    REMOVED: ClassVar[dict[str, Removed]] = {
        # any value: the collection schedule never changed what a run computes
        "gc_every": Removed(
            "the slow training steps were host threads in block building, not GC pauses (no GC pause in the "
            "drafter-step windows; H200, benchmarks/gpu/mfu_ab.sh, 2026-12-04): runtime.host_threads fixes them",
            inert=None,
        ),
    }

    @property
    def compile_parts(self) -> set[str]:
        """runtime.compile as a set ("none" → empty)."""
        return {p.strip() for p in self.compile.split(",") if p.strip() and p.strip() != "none"}


def fused_ce_on(loss: LossConfig, runtime: RuntimeConfig, device_type: str) -> bool:
    """loss.fused_ce, resolved: unset means on exactly where the loss is compiled (CUDA, "loss" compiled)."""
    if loss.fused_ce is not None:
        return loss.fused_ce
    return device_type == "cuda" and "loss" in runtime.compile_parts


@dataclass
class CheckpointConfig:
    every: int = 1000  # optimizer steps between checkpoints (SIGUSR1 writes one at the next step)
    keep_last: int = 3  # older ones are deleted, except the best by eval (eval/log.jsonl)
    best_metric: str = "tau_chain"  # eval/log.jsonl field that picks the checkpoint kept as best


@dataclass
class PipelineConfig:
    """Where features come from (flashdraft/train/pipeline.py, flashdraft/train/features.py)."""

    mode: str = "online"  # online: the target computes features during training; offline: read features_dir
    features_dir: str = ""  # offline: a `flashdraft features dump` folder (~5.8 KB per token)
    queue_depth: int = 4  # feature batches computed ahead in a background thread; 0 = inline, no thread
    # inline (queue_depth 0, or forced: runtime.feature_pass=native on CUDA): 1 = launch the next batch's target
    # pass on a side CUDA stream before handing over this one, so it runs under the drafter step (off until timed)
    inline_ahead: int = 0
    starve_threshold: float = 0.05  # warn when the trainer waits for features more than this fraction ...
    starve_window: int = 50  # ... of the time over the last this-many micro-batches


@dataclass
class DistributedConfig:
    """Data parallelism under torchrun (flashdraft/train/distributed.py); ignored in one process."""

    strategy: str = "ddp"  # ddp (replicated drafter) or fsdp2 (sharded drafter, torch fully_shard)
    backend: str = "auto"  # auto: nccl on CUDA, gloo on CPU


@dataclass
class TelemetryConfig:
    log_every: int = 10  # steps per logged line: metrics are read off the device once per interval
    tensorboard: bool = True
    wandb_project: str | None = None  # Weights & Biases when set (needs `wandb`; never required)
    progress: bool = True  # a tqdm bar on stderr
    gpu: bool = True  # on CUDA: NVML (util, power, temperature) and allocator stats in every line
    # dense bf16 TFLOP/s of one device (H200: 790 measured): every line then has mfu = model_tflops_per_s / this.
    # None: no mfu (the ceiling depends on the device and dtype; not guessed)
    peak_tflops: float | None = None


@dataclass
class EvalConfig:
    """Validation τ inside the trainer (flashdraft/train/validation.py): every `every` optimizer steps the replay of
    `flashdraft eval` over fixed held-out references — chain τ, the best DDTree budget's τ, the top-k streak — logged
    as val/* (metrics.jsonl, TensorBoard, the progress bar). The target's pass over the references runs once at
    start-up; each validation costs the drafter's replay only."""

    every: int = 0  # optimizer steps between validations (and the schedule's last step); 0: off
    # a frozen reference file (benchmarks/yardstick/*.jsonl, or the RUN/val_references.jsonl a run with `dataset`
    # writes): the first `limit` lines, each cut at its first disagreement with this target's argmax, as
    # `flashdraft eval --references` does; or leave empty and name `dataset`
    references: str = ""
    # an eval prompt set (humaneval, sharegpt-heldout, humaneval:PATH, a dataset folder): its references are computed
    # once at start-up as `flashdraft eval` computes them (cached) and saved to RUN/val_references.jsonl
    dataset: str = ""
    limit: int | None = 32  # the first N prompts (or reference lines); None: all
    max_new_tokens: int = 256  # reference tokens replayed per prompt (the eval's length)
    # DDTree budgets (one tree walk at the largest serves them all); val/ddtree_tau is the best budget's τ
    budgets: list[int] = field(default_factory=lambda: [8, 16, 32, 64, 128, 256, 512])
    topk: int = 8  # the top-k streak's k (val/topk_streak); 0: none


@dataclass
class TrainConfig:
    run_dir: str = "runs/default"  # the run folder (layout: flashdraft/train/checkpoint.py)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def validate(self) -> None:
        """Field-level checks that do not need the target (check_pair covers the rest)."""
        d, o, m = self.data, self.optim, self.model
        if not d.dataset:
            raise ConfigError("data.dataset is empty: set it to a dataset folder or a .jsonl file")
        if d.max_length < 2:
            raise ConfigError(f"data.max_length {d.max_length} must be >= 2")
        if d.token_budget < 1:
            raise ConfigError(f"data.token_budget {d.token_budget} must be >= 1")
        if d.max_anchors < 1:
            raise ConfigError(f"data.max_anchors {d.max_anchors} must be >= 1")
        if not d.loop_anchor_weight > 0:
            raise ConfigError(f"data.loop_anchor_weight {d.loop_anchor_weight} must be > 0 (1 = uniform)")
        if m.block_size < 2:
            raise ConfigError(f"model.block_size {m.block_size} must be >= 2 (slot 0 is the anchor)")
        if m.num_layers < 1:
            raise ConfigError(f"model.num_layers {m.num_layers} must be >= 1")
        if m.grow_layers < 0:
            raise ConfigError(f"model.grow_layers {m.grow_layers} must be >= 0")
        if m.grow_layers and not m.init_from:
            raise ConfigError(
                f"model.grow_layers {m.grow_layers} adds layers to a loaded drafter: set model.init_from"
            )
        if self.loss.gamma is None and m.block_size not in (16, 10, 8):
            raise ConfigError(
                f"model.block_size {m.block_size} has no default loss decay: set loss.gamma (e.g. loss.gamma=5)"
            )
        if self.loss.gamma is not None and self.loss.gamma <= 0:
            raise ConfigError(f"loss.gamma {self.loss.gamma} must be > 0")
        if not o.lr > 0:
            raise ConfigError(f"optim.lr {o.lr} must be > 0")
        if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
            raise ConfigError(f"optim.betas {o.betas} must be two numbers in [0, 1)")
        if not 0 <= o.warmup_ratio < 1:
            raise ConfigError(f"optim.warmup_ratio {o.warmup_ratio} must be in [0, 1)")
        if not 0 <= o.ema_decay < 1:
            raise ConfigError(f"optim.ema_decay {o.ema_decay} must be in [0, 1) (0: off)")
        if o.grad_accum < 1:
            raise ConfigError(f"optim.grad_accum {o.grad_accum} must be >= 1")
        if o.max_steps is None and o.epochs < 1:
            raise ConfigError(f"optim.epochs {o.epochs} must be >= 1 (or set optim.max_steps)")
        if o.max_steps is not None and o.max_steps < 1:
            raise ConfigError(f"optim.max_steps {o.max_steps} must be >= 1")
        if o.schedule_steps is None and o.schedule_start != 0:
            raise ConfigError(
                f"optim.schedule_start {o.schedule_start} needs optim.schedule_steps (the whole schedule)"
            )
        if o.schedule_steps is not None and not 0 <= o.schedule_start < o.schedule_steps:
            raise ConfigError(
                f"optim.schedule_start {o.schedule_start} must be in [0, optim.schedule_steps {o.schedule_steps})"
            )
        if not _DEVICE.fullmatch(self.runtime.device):
            raise ConfigError(f"runtime.device {self.runtime.device!r}: use auto, cpu, cuda or cuda:N")
        td = self.runtime.target_device
        tds = [x.strip() for x in td.split(",") if x.strip()]
        if td != "same" and (not tds or not all(_DEVICE.fullmatch(x) and x != "auto" for x in tds)):
            raise ConfigError(
                f"runtime.target_device {td!r}: use same, cpu, cuda, cuda:N, or one cuda:N per rank, comma-separated"
            )
        if self.runtime.dtype not in ("auto", "float32", "float64", "bfloat16"):
            raise ConfigError(f"runtime.dtype {self.runtime.dtype!r}: use auto, float32, float64 or bfloat16")
        parts = self.runtime.compile_parts
        if not parts <= COMPILE_PARTS or (self.runtime.compile.strip() != "none" and not parts):
            raise ConfigError(
                f"runtime.compile {self.runtime.compile!r}: use none or a comma-separated subset of "
                f"{', '.join(sorted(COMPILE_PARTS))} (e.g. attention,loss)"
            )
        if "model" in parts and d.blocks_per_row <= 0:
            raise ConfigError(
                "runtime.compile=model needs static shapes: set data.blocks_per_row (blocks per packed row, "
                "e.g. 1024 for 3072-token rows)"
            )
        if d.blocks_per_row < 0:
            raise ConfigError(
                f"data.blocks_per_row {d.blocks_per_row} must be >= 0 (0: shapes vary per batch)"
            )
        if self.runtime.time_limit_min is not None and self.runtime.time_limit_min <= 0:
            raise ConfigError(f"runtime.time_limit_min {self.runtime.time_limit_min} must be > 0 (or unset)")
        if self.loss.softmax_vocab < 0:
            raise ConfigError(
                f"loss.softmax_vocab {self.loss.softmax_vocab} must be >= 0 (0: the whole vocabulary)"
            )
        if self.runtime.fit_steps_to_time_limit and self.runtime.time_limit_min is None:
            raise ConfigError("runtime.fit_steps_to_time_limit needs runtime.time_limit_min")
        fb = self.runtime.flex_block_size
        if len(fb) != 2 or any(x not in (16, 32, 64, 128) for x in fb):
            raise ConfigError(
                f"runtime.flex_block_size {fb}: two tile sizes (Q, KV), each 16, 32, 64 or 128 (e.g. [128, 128])"
            )
        if self.runtime.compile_mode == "reduce-overhead":
            raise ConfigError(
                "runtime.compile_mode 'reduce-overhead' was removed (CUDA-graph replay measured slower: 109-119 vs "
                "85-90 ms a drafter step, H200, 2026-12-03): use default or max-autotune-no-cudagraphs"
            )
        if self.runtime.compile_mode not in ("default", "max-autotune-no-cudagraphs"):
            raise ConfigError(
                f"runtime.compile_mode {self.runtime.compile_mode!r}: use default or max-autotune-no-cudagraphs"
            )
        flex_compiled = bool(parts & {"attention", "model"})
        tuned = "model" in parts and self.runtime.compile_mode == "max-autotune-no-cudagraphs"
        if min(fb) < 128 and flex_compiled and not tuned:
            raise ConfigError(
                f"runtime.flex_block_size {fb}: compiled FlexAttention with tiles below 128 has no backward kernel "
                "under the default compile mode (torch 2.11, H200): set runtime.compile=model with "
                "runtime.compile_mode=max-autotune-no-cudagraphs, runtime.compile=none, or keep [128, 128]"
            )
        if self.runtime.host_threads is not None and self.runtime.host_threads < 0:
            raise ConfigError(
                f"runtime.host_threads {self.runtime.host_threads} must be >= 0 (or unset: 1 on CUDA): "
                "0 keeps torch's thread count, N >= 1 sets it"
            )
        if self.runtime.feature_pass not in ("hf", "native"):
            raise ConfigError(f"runtime.feature_pass {self.runtime.feature_pass!r}: use hf or native")
        if "target" in parts and self.runtime.feature_pass != "native":
            raise ConfigError(
                "runtime.compile=target compiles the native feature pass: set runtime.feature_pass=native "
                "or drop target from runtime.compile"
            )
        if "target_graph" in parts and "target" not in parts:
            raise ConfigError(
                "runtime.compile=target_graph replays the compiled feature pass: add target to runtime.compile"
            )
        if self.runtime.attention not in ("auto", "flex", "dense"):
            raise ConfigError(f"runtime.attention {self.runtime.attention!r}: use auto, flex or dense")
        if self.checkpoint.every < 1 or self.checkpoint.keep_last < 1:
            raise ConfigError("checkpoint.every and checkpoint.keep_last must be >= 1")
        if self.telemetry.log_every < 1:
            raise ConfigError(f"telemetry.log_every {self.telemetry.log_every} must be >= 1")
        peak = self.telemetry.peak_tflops
        if peak is not None and not peak > 0:
            raise ConfigError(
                f"telemetry.peak_tflops {peak} must be > 0: one device's dense bf16 TFLOP/s "
                "(e.g. 790 for an H200), or unset it for no mfu"
            )
        p = self.pipeline
        if p.mode not in ("online", "offline"):
            raise ConfigError(f"pipeline.mode {p.mode!r}: use online or offline")
        if p.mode == "offline" and not p.features_dir:
            raise ConfigError(
                "pipeline.mode=offline needs pipeline.features_dir (write one with `flashdraft features dump`)"
            )
        if p.queue_depth < 0 or p.starve_window < 1 or not 0 <= p.starve_threshold <= 1:
            raise ConfigError("pipeline: queue_depth >= 0, starve_window >= 1, 0 <= starve_threshold <= 1")
        if p.inline_ahead not in (0, 1):
            raise ConfigError(f"pipeline.inline_ahead {p.inline_ahead}: use 0 or 1")
        if self.distributed.strategy not in ("ddp", "fsdp2"):
            raise ConfigError(f"distributed.strategy {self.distributed.strategy!r}: use ddp or fsdp2")
        if self.distributed.backend not in ("auto", "nccl", "gloo"):
            raise ConfigError(f"distributed.backend {self.distributed.backend!r}: use auto, nccl or gloo")
        e = self.eval
        if e.every < 0:
            raise ConfigError(f"eval.every {e.every} must be >= 0 (0: no validation)")
        if e.every and bool(e.references) == bool(e.dataset):
            raise ConfigError(
                "eval.every > 0 needs exactly one of eval.references (a frozen reference file) and "
                "eval.dataset (e.g. humaneval), or eval.every=0"
            )
        if e.limit is not None and e.limit < 1:
            raise ConfigError(f"eval.limit {e.limit} must be >= 1 (or null: all)")
        if e.max_new_tokens < 2 or not e.budgets or any(b < 1 for b in e.budgets) or e.topk < 0:
            raise ConfigError(
                "eval: max_new_tokens >= 2, budgets a non-empty list of DDTree budgets >= 1 (e.g. [8, 64, 512]), "
                "topk >= 0"
            )


def hashed_section(section: str, values: dict[str, Any]) -> dict[str, Any]:
    """What config_hash hashes of TrainConfig section `section` (its `to_dict` values): the keys added since runs
    stored their hash left out while at the value those runs had (`ADDED`), the removed keys put back at their off
    value as configs saved before the removal hold them (`REMOVED`), so a run started before either change
    resumes as the same run."""
    cls = typing.get_type_hints(TrainConfig).get(section)
    added: dict[str, Any] = getattr(cls, "ADDED", {})
    removed: dict[str, Removed] = getattr(cls, "REMOVED", {})
    kept = {k: v for k, v in values.items() if not (k in added and v == added[k])}
    return {**kept, **{k: r.inert[0] for k, r in removed.items() if r.inert}}
