"""The training loop: micro-batches in, optimizer steps, metrics, checkpoints, exact resume, guards.

    trainer = Trainer(cfg, target, drafter, source, run_dir="runs/x")
    trainer.restore(latest_checkpoint("runs/x"))    # optional: --resume
    result = trainer.run()

The loop does not care where batches come from (`FeatureSource`) or whether the drafter is
wrapped (DDP/FSDP/compile: pass the wrapper as `model`, the plain module as `drafter`).
Host syncs happen once per log interval (`_log`), never inside a step: non-finite steps are
skipped on the device (fused AdamW's `found_inf`), and their count is read at log time.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from flashdraft.config import to_dict
from flashdraft.train.batch import pad_feature_batch
from flashdraft.train.blocks import AnchorSampler, DraftBatch, build_blocks
from flashdraft.train.checkpoint import (
    StateDictDrafter,
    TrainerState,
    load_drafter_weights,
    load_trainer_state,
    prune_checkpoints,
    save_checkpoint,
    step_of,
)
from flashdraft.train.config import OptimConfig, TrainConfig, fused_ce_on, hashed_section
from flashdraft.train.ema import WeightEMA
from flashdraft.train.flops import step_flops, trainable_params
from flashdraft.train.host import HostThreads, resolve_host_threads
from flashdraft.train.lifecycle import RunSignals
from flashdraft.train.loss import loss_denominator, slot_weights
from flashdraft.train.metrics import MetricsLogger
from flashdraft.train.source import FeatureSource
from flashdraft.train.step import micro_step
from flashdraft.train.vocab import LabelVocab, restrict_labels

if TYPE_CHECKING:  # the validation's eval imports load only where eval.every is on (launch.py)
    from flashdraft.train.validation import Validation

# named step phases in torch.profiler tables (benchmarks/train_throughput.py)
_phase = torch.profiler.record_function

TARGET_OOM_HINT = (
    "out of memory in the target feature pass: lower data.token_budget (target tokens per micro-batch; raise "
    "optim.grad_accum to keep the global batch) or data.max_length"
)
OOM_HINT = (
    "out of memory in the drafter step: lower data.token_budget (target tokens per micro-batch; raise "
    "optim.grad_accum to keep the global batch), data.max_anchors (blocks per document) or data.max_length"
)


class TrainingError(RuntimeError):
    pass


# runtime.fit_steps_to_time_limit: steps before the pace is first timed, steps timed for the first fit, and the
# fractions of the time limit at which the fit is redone from the pace since the previous fit (the first epoch of
# an offline run reads its features from disk: the pace drifts, 0.10–0.14 s a step in one CPU run). Not later: a
# late refit that adds steps raises an annealed LR again; a pace that slows after it meets the time limit, which
# then cuts a schedule whose LR is already small
FIT_SKIP, FIT_STEPS, REFIT_AT = 10, 100, (0.25, 0.5)


@dataclass
class LRSchedule:
    """Linear warmup to `peak`, then cosine down to `peak × min_ratio` at `total_steps`. A run that is one part of
    a longer schedule (optim.schedule_steps) starts at its step `offset` and ramps linearly up to the schedule's
    rate over its own first `ramp_steps` steps."""

    peak: float
    total_steps: int
    warmup_steps: int
    min_ratio: float = 0.0
    offset: int = 0
    ramp_steps: int = 0

    def __call__(self, step: int) -> float:  # step: optimizer steps this run has taken
        ramp = (step + 1) / self.ramp_steps if step < self.ramp_steps else 1.0
        step += self.offset
        if step < self.warmup_steps:
            return ramp * (self.peak * (step + 1) / self.warmup_steps)
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        lr = self.peak * (self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
        return ramp * lr  # ramp 1.0 (a run's own schedule): the rate as it always was, to the bit


# a part of a longer LR schedule that starts past its step 0 ramps up over at most this many steps: its fresh Adam
# moments settle well within it (β2 0.95: a horizon of ~20 steps), and it ends before runtime.fit_steps_to_time_limit
# first refits the run's length (FIT_SKIP + FIT_STEPS), so a refit never moves a ramp under way
PART_RAMP_MAX = 100


def lr_schedule(o: OptimConfig, run_steps: int) -> LRSchedule:
    """The LR of a run of `run_steps` optimizer steps: its own warmup and cosine, or its part of the schedule
    optim.schedule_steps long (from optim.schedule_start; ramped up over its first warmup_ratio × run_steps, at
    most PART_RAMP_MAX, when that is past 0)."""
    if o.schedule_steps is None:
        return LRSchedule(o.lr, run_steps, math.ceil(o.warmup_ratio * run_steps), o.min_lr_ratio)
    ramp = min(PART_RAMP_MAX, math.ceil(o.warmup_ratio * run_steps)) if o.schedule_start > 0 else 0
    warmup = math.ceil(o.warmup_ratio * o.schedule_steps)
    return LRSchedule(o.lr, o.schedule_steps, warmup, o.min_lr_ratio, o.schedule_start, ramp)


@dataclass
class TrainResult:
    steps: int
    epoch: int
    stopped: str  # "max_steps" | "data_exhausted" | "time_limit" | "SIGINT" | "SIGTERM" (checkpointed, then stopped)
    last_checkpoint: Path | None
    last_metrics: dict[str, Any] = field(default_factory=dict)


def config_hash(cfg: TrainConfig) -> str:
    """Hash of what defines the training problem (not run_dir, checkpoint or telemetry settings)."""
    d = to_dict(cfg)
    key = {k: hashed_section(k, d[k]) for k in ("model", "data", "loss", "optim")}
    key["seed"] = d["runtime"]["seed"]
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


class Interval:
    """Device-side sums over one log interval (read once, at log time)."""

    def __init__(self, block_size: int, device: torch.device) -> None:
        z = lambda *s: torch.zeros(s, dtype=torch.float64, device=device)  # noqa: E731
        self.loss_sum, self.grad_norm_sum, self.good_steps = z(), z(), z()
        self.slot_correct, self.slot_count = z(block_size), z(block_size)
        self.streak_sum, self.blocks = z(), z()
        self.bad_steps, self.max_bad_streak = z(), z()
        self.steps = 0
        self.tokens = 0  # host ints: known from the CPU-side batches, no sync
        self.anchors = 0
        self.flops = 0  # model FLOPs (flashdraft/train/flops.py), from the CPU-side blocks
        self.start = time.perf_counter()


class Trainer:
    def __init__(
        self,
        cfg: TrainConfig,
        target: Any,  # TargetModel (frozen embed_tokens, lm_head)
        drafter: torch.nn.Module,  # the plain DFlashDrafter (parameters, checkpoints)
        source: FeatureSource,
        *,
        run_dir: str | Path,
        model: Callable[..., torch.Tensor]
        | None = None,  # the forward to call (wrapped drafter); default drafter
        logger: MetricsLogger | None = None,
        device: torch.device | str | None = None,
        compute_dtype: torch.dtype | None = None,  # bf16 autocast; None = the parameters' dtype
        attention: str = "dense",  # "dense" | "flex"
        rank: int = 0,
        on_step_end: Callable[[Trainer, int], None] | None = None,  # test hook, called after each step
        vocab: LabelVocab | None = None,  # loss.softmax_vocab: the label tokens the loss's softmax runs over
        signals: RunSignals
        | None = None,  # installed by the caller at start-up; None: run() installs its own
        validation: Validation | None = None,  # eval.every: held-out τ every N steps (train/validation.py)
    ) -> None:
        self.cfg = cfg
        self.target, self.drafter, self.source = target, drafter, source
        self.model = model if model is not None else drafter
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.logger = logger or MetricsLogger(self.run_dir, tensorboard=False, enabled=rank == 0)
        self.device = torch.device(device) if device is not None else next(drafter.parameters()).device
        self.compute_dtype = compute_dtype
        self.attention = attention
        self.fused_ce = fused_ce_on(cfg.loss, cfg.runtime, self.device.type)
        fb = cfg.runtime.flex_block_size
        self.flex_block_size = (fb[0], fb[1])  # the BlockMask's (Q, KV) tile
        self.on_step_end = on_step_end
        self.validation = validation
        self._val_values: dict[str, float] = {}  # the last validation's val/* keys, until logged
        b = drafter.config.block_size
        self.block_size, self.mask_token_id = b, drafter.config.mask_token_id
        self.weights = slot_weights(b, cfg.loss.gamma)
        self.vocab = vocab
        self.head_weight = None  # [N, H]: the head's rows for `vocab` (frozen, gathered once)
        if vocab is not None:
            self.head_weight = target.lm_head.weight.detach()[vocab.ids.to(target.lm_head.weight.device)]
        self.anchor_sampler = AnchorSampler(cfg.runtime.seed * 1_000_003 + rank)
        params = [p for p in drafter.parameters() if p.requires_grad]
        # the full count on every rank: `drafter` is the module itself (FSDP2 shards it in place into
        # DTensors, whose numel() is global), never a DDP or compile wrapper
        self.trainable_params = trainable_params(drafter)
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(
            params, lr=o.lr, betas=(o.betas[0], o.betas[1]), weight_decay=o.weight_decay, fused=True
        )
        # the weights' moving average (optim.ema_decay > 0): what checkpoints' drafter/ folders hold
        self.ema = WeightEMA(drafter, o.ema_decay) if o.ema_decay > 0 else None
        self.total_steps = self._total_steps()
        self.schedule = lr_schedule(o, self.total_steps)
        self.step = 0
        self.tokens_seen = 0
        self.anchors_seen = 0
        self._bad_streak = torch.zeros((), dtype=torch.float64, device=self.device)
        self.signals = signals
        self._lr = self.schedule(0)
        self.last_checkpoint: Path | None = None
        self._fitted = False  # runtime.fit_steps_to_time_limit: total_steps fitted (or restored fitted)
        self._asked_steps = self.total_steps

    # ------------------------------------------------------------------ setup

    def _total_steps(self) -> int:
        o = self.cfg.optim
        if o.max_steps is not None:
            steps = o.max_steps
        else:
            steps = max(1, math.ceil(self.source.micro_batches_per_epoch() * o.epochs / o.grad_accum))
        if o.schedule_steps is not None:  # a part of a longer schedule ends with it at the latest
            steps = min(steps, o.schedule_steps - o.schedule_start)
        return steps

    def _agree(self, flags: list[bool]) -> list[bool]:
        """Control flags as every rank sees them (one process: as they are)."""
        return flags

    def _agree_min(self, value: int) -> int:
        """The smallest of every rank's `value` (one process: `value`)."""
        return value

    def _set_total_steps(self, total: int) -> None:
        o = self.cfg.optim
        self.total_steps = total
        self.schedule = lr_schedule(o, total)

    def _fit_total_steps(self, left_s: float, pace_s: float) -> str | None:
        """runtime.fit_steps_to_time_limit: the steps `left_s` holds at `pace_s` a step (less 3% for checkpoints
        and drift), at most what the config asks for; the LR schedule is rebuilt for them (its warmup too; a
        part of a longer schedule, optim.schedule_steps, keeps that schedule and only ends elsewhere). Returns a
        line for the log when the total changed."""
        self._fitted = True
        if pace_s <= 0:
            return None
        fitted = min(self._asked_steps, self._agree_min(self.step + max(1, int(0.97 * left_s / pace_s))))
        if fitted == self.total_steps:
            return None
        self._set_total_steps(fitted)
        o = self.cfg.optim
        then = (
            f"the LR schedule now ends at step {fitted}"
            if o.schedule_steps is None
            else f"the run ends at step {o.schedule_start + fitted} of its {o.schedule_steps}-step LR schedule"
        )
        return f"train: {pace_s:.3f} s a step, the time limit holds {fitted} of {self._asked_steps} steps: {then}"  # fmt: skip

    # ------------------------------------------------------------------ checkpoints

    def _state(self) -> TrainerState:
        rng: dict[str, Any] = {"torch_cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["torch_cuda"] = list(torch.cuda.get_rng_state_all())
        info = {
            "epoch": self.source.epoch,
            "data": self.source.state_dict(),
            "tokens_seen": self.tokens_seen,
            "anchors_seen": self.anchors_seen,
            "total_steps": self.total_steps,
            "config_hash": config_hash(self.cfg),
            "time": time.time(),
        }
        state = {
            "optimizer": self.optimizer.state_dict(),
            "rng": rng,
            "anchor_sampler": self.anchor_sampler.state_dict(),
        }
        if self.ema is not None:  # drafter/ holds the averages; resume needs the weights being trained
            state["train_weights"] = self.ema.train_weights()
            info["ema_decay"] = self.ema.decay
        return TrainerState(info=info, state=state)

    def _checkpoint_drafter(self) -> Any:
        """What a checkpoint's drafter/ folder is written from: the EMA's averages when on, else the drafter."""
        return self.drafter if self.ema is None else StateDictDrafter(self.drafter, self.ema.state_dict())

    def _restore_train_weights(self, ts: TrainerState) -> None:
        """After drafter/'s weights were loaded into the drafter: with EMA they are the averages, and the
        weights being trained come from the trainer state (a checkpoint without EMA: they are the same)."""
        if self.ema is not None:
            self.ema.reset_to_weights()
        train_weights = ts.state.get("train_weights")
        if train_weights is not None:
            with torch.no_grad():
                params = dict(self.drafter.named_parameters())
                for name, w in train_weights.items():
                    params[name].copy_(w)

    def save(self) -> Path:
        path = save_checkpoint(self.run_dir, self.step, self._checkpoint_drafter(), self._state())
        prune_checkpoints(self.run_dir, self.cfg.checkpoint.keep_last, self.cfg.checkpoint.best_metric)
        self.last_checkpoint = path
        return path

    def _save(self, why: str, bar: Any) -> Path:
        """save() (periodic, SIGUSR1, time limit, signal, final), announced in one line."""
        path = self.save()
        if self.rank == 0:
            (bar.write if bar is not None else print)(
                f"checkpoint ({why}) at step {self.step}: {path}", file=sys.stderr
            )
        return path

    def restore(self, checkpoint: str | Path) -> None:
        """Continue exactly from a checkpoint: weights, optimizer, RNG, data position, anchor sampler."""
        ts = load_trainer_state(checkpoint)
        if ts.info.get("config_hash") != config_hash(self.cfg):
            print(
                f"warning: {checkpoint} was written with a different model/data/loss/optim config "
                "(config_hash differs): the resumed run is not the same run",
                file=sys.stderr,
            )
        load_drafter_weights(checkpoint, self.drafter)
        self._restore_train_weights(ts)
        self.optimizer.load_state_dict(ts.state["optimizer"])
        torch.set_rng_state(ts.state["rng"]["torch_cpu"])
        if "torch_cuda" in ts.state["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(ts.state["rng"]["torch_cuda"])
        self.anchor_sampler.load_state_dict(ts.state["anchor_sampler"])
        self.source.load_state_dict(ts.info["data"])
        self.step = step_of(checkpoint)
        self.tokens_seen = int(ts.info.get("tokens_seen", 0))
        self.anchors_seen = int(ts.info.get("anchors_seen", 0))
        if self.cfg.runtime.fit_steps_to_time_limit and ts.info.get("total_steps"):  # the fitted schedule
            self._set_total_steps(int(ts.info["total_steps"]))
            self._fitted = True
        self.logger.truncate_after(self.step)
        self.last_checkpoint = Path(checkpoint)

    # ------------------------------------------------------------------ the loop

    def run(self) -> TrainResult:
        cfg = self.cfg
        own_signals = self.signals is None
        signals = RunSignals().install() if self.signals is None else self.signals
        batches = iter(self.source)
        stopped = "max_steps"
        last: dict[str, Any] = {}
        saved_at = -1
        started = time.perf_counter()
        limit_s = cfg.runtime.time_limit_min * 60 if cfg.runtime.time_limit_min else None
        bar = None
        if cfg.telemetry.progress and self.rank == 0:
            from tqdm import tqdm

            bar = tqdm(total=self.total_steps, initial=self.step, desc="train", unit="step", file=sys.stderr)
        # runtime.fit_steps_to_time_limit: the pace is first timed over steps fit_start .. fit_start + FIT_STEPS
        fit_start = self.step + FIT_SKIP
        fit_t0, fit_s0, refits = started, self.step, list(REFIT_AT)
        interval = Interval(self.block_size, self.device)
        # torch's intra-op threads (runtime.host_threads; auto: 1 on CUDA), restored in `finally`
        threads = HostThreads(resolve_host_threads(cfg.runtime.host_threads, self.device))
        try:
            threads.start()
            signals.armed = True  # from here a stop signal ends in a checkpoint
            while self.step < self.total_steps:
                micro = []
                for _ in range(cfg.optim.grad_accum):
                    try:
                        fb = next(batches, None)  # in-process sources run the target here
                    except torch.OutOfMemoryError as e:
                        raise TrainingError(f"step {self.step + 1}: {TARGET_OOM_HINT}") from e
                    if fb is None:
                        break
                    micro.append(fb)
                if not micro:
                    stopped = "data_exhausted"
                    break
                try:
                    self.optimizer_step(micro, interval)
                except torch.OutOfMemoryError as e:
                    raise TrainingError(f"step {self.step + 1}: {OOM_HINT}") from e
                self.step += 1
                if bar is not None:
                    bar.update(1)
                if self.on_step_end is not None:
                    self.on_step_end(self, self.step)
                if limit_s is not None and cfg.runtime.fit_steps_to_time_limit:
                    now = time.perf_counter()
                    if self.step == fit_start and not self._fitted:
                        fit_t0, fit_s0 = now, self.step
                    elif (self.step == fit_start + FIT_STEPS and not self._fitted) or (
                        self._fitted and refits and now - started >= refits[0] * limit_s
                    ):
                        while refits and now - started >= refits[0] * limit_s:
                            refits.pop(0)
                        pace = (now - fit_t0) / max(1, self.step - fit_s0)
                        line = self._fit_total_steps(limit_s - (now - started), pace)
                        fit_t0, fit_s0 = now, self.step
                        if bar is not None:
                            bar.total = self.total_steps
                            bar.refresh()
                        if line is not None and self.rank == 0:
                            (bar.write if bar is not None else print)(line, file=sys.stderr)
                # every rank must take the same decision at the same step (one all-reduce under torchrun)
                asked, out_of_time, stop = self._agree(
                    [
                        signals.take_checkpoint_request(),
                        limit_s is not None and time.perf_counter() - started > limit_s,
                        signals.stop_signal is not None,
                    ]
                )
                # validated also at the step the time limit stops the run: the last validation is of its last weights
                val = self.validation
                if val is not None and val.due(self.step, self.total_steps, stopping=out_of_time):
                    self._val_values = val.run(self.drafter, self.ema).values()
                    interval.start += self._val_values["val/seconds"]  # not training: out of the throughput
                logged = self.step % cfg.telemetry.log_every == 0 or self.step == self.total_steps
                if logged or self._val_values:
                    last = self._log(interval, bar)
                    interval = Interval(self.block_size, self.device)
                # a signal on another rank only: every rank stops with the same name
                stop_name = (signals.stop_name or "SIGTERM") if stop else None
                periodic = self.step % cfg.checkpoint.every == 0
                if periodic or asked or out_of_time or stop:
                    why = stop_name or ("time limit" if out_of_time else "SIGUSR1" if asked else "periodic")
                    self._save(why, bar)
                    saved_at = self.step
                if (
                    stop_name is not None and self.step < self.total_steps
                ):  # at the last step: finished anyway
                    stopped = stop_name
                    break
                if out_of_time:
                    stopped = "time_limit"
                    break
            if interval.steps:
                last = self._log(interval, bar)
            if saved_at != self.step and self.step > 0:
                self._save("final", bar)
        finally:
            signals.armed = False  # a stop signal from here on exits at once (nothing is left to save)
            threads.stop()
            if bar is not None:
                bar.close()
            if own_signals:
                signals.restore()
            self.logger.close()
        return TrainResult(self.step, self.source.epoch, stopped, self.last_checkpoint, last)

    def optimizer_step(self, micro: list[Any], interval: Interval) -> list[DraftBatch]:
        """One optimizer step over the micro-batches; returns their (CPU) blocks, e.g. for FLOP counts."""
        cfg = self.cfg
        d = cfg.data
        if d.blocks_per_row > 0:  # static shapes: every micro-batch [rows, length] with blocks_per_row blocks
            length = -(-d.max_length // d.pad_multiple) * d.pad_multiple
            micro = [pad_feature_batch(fb, max(1, d.token_budget // d.max_length), length) for fb in micro]
        # else pad the query length N·B to a multiple of data.pad_multiple (few shapes for compiled kernels)
        blocks_multiple = max(1, d.pad_multiple // self.block_size)
        drafts_cpu = []
        with _phase("step/blocks"):  # host work: anchors, blocks, Σw (profiler rows; no cost without one)
            for fb in micro:
                anchors = self.anchor_sampler.sample(
                    fb, d.max_anchors, blocks_multiple, d.blocks_per_row, d.loop_anchor_weight
                )
                draft = build_blocks(fb, anchors, self.block_size, self.mask_token_id)
                drafts_cpu.append(draft if self.vocab is None else restrict_labels(draft, self.vocab))
            # ≥ 1 whenever any slot has a label
            denom = loss_denominator(drafts_cpu, self.weights).clamp_min(1.0)
            interval.flops += step_flops(drafts_cpu, self.drafter.config, self.trainable_params)
        lr = self.schedule(self.step)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        weights = self.weights.to(self.device)
        step_ce = torch.zeros((), dtype=torch.float64, device=self.device)
        for i, (fb, d_cpu) in enumerate(zip(micro, drafts_cpu, strict=True)):
            draft = d_cpu.to(self.device)
            last = i == len(micro) - 1
            no_sync = getattr(self.model, "no_sync", None)
            ctx = no_sync() if (no_sync is not None and not last) else contextlib.nullcontext()
            with ctx:
                with _phase("step/forward_loss"):
                    out = micro_step(
                        self.model, self.target, fb, draft, weights, denom,
                        attention=self.attention, chunk_tokens=cfg.loss.chunk_tokens,
                        fused_ce=self.fused_ce, flex_block_size=self.flex_block_size,
                        compute_dtype=self.compute_dtype, head_weight=self.head_weight,
                    )  # fmt: skip
                with _phase("step/backward"):
                    out.loss.backward()
            step_ce += out.weighted_ce.double()
            interval.slot_correct += out.slot_correct.double()
            interval.slot_count += out.slot_count.double()
            interval.streak_sum += out.streak_sum.double()
            interval.blocks += out.num_blocks.double()
            interval.tokens += fb.num_tokens
            interval.anchors += int(d_cpu.valid.sum())
            self.tokens_seen += fb.num_tokens
            self.anchors_seen += int(d_cpu.valid.sum())
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        with _phase("step/optimizer"):
            grad_norm = self._clip_grad_norm(params).double()
            step_loss = step_ce / float(denom)
            bad = ~(torch.isfinite(grad_norm) & torch.isfinite(step_loss))
            # a non-finite step is skipped on the device: fused AdamW leaves weights and moments alone
            self.optimizer.found_inf = bad.float()  # type: ignore[attr-defined]
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            if self.ema is not None:  # a skipped step left the weights alone: the average moves toward them
                self.ema.update(self.step + 1)
        self._bad_streak = torch.where(bad, self._bad_streak + 1, torch.zeros_like(self._bad_streak))
        interval.max_bad_streak = torch.maximum(interval.max_bad_streak, self._bad_streak)
        interval.bad_steps += bad.double()
        good = (~bad).double()
        interval.good_steps += good
        interval.loss_sum += torch.where(bad, torch.zeros_like(step_loss), step_loss)
        interval.grad_norm_sum += torch.where(bad, torch.zeros_like(grad_norm), grad_norm)
        interval.steps += 1
        self._lr = lr
        return drafts_cpu

    def _clip_grad_norm(self, params: list[torch.Tensor]) -> torch.Tensor:
        """Clip to optim.grad_clip; the total norm (a hook: FSDP2 returns it as a DTensor)."""
        return torch.nn.utils.clip_grad_norm_(params, self.cfg.optim.grad_clip, foreach=True)

    def _log(self, iv: Interval, bar: Any) -> dict[str, Any]:
        """Read the interval's device sums (the one host sync), log them, apply the NaN guard."""
        good = float(iv.good_steps)  # host sync: every step of the interval has finished on the device
        # the interval's wall time, read after that sync (the host may run steps ahead of the device): all the
        # trainer spent since the last log, waits for features and checkpoint writes included
        elapsed = max(time.perf_counter() - iv.start, 1e-9)
        bad = int(iv.bad_steps)
        count = iv.slot_count.clamp_min(1)
        slot_acc = (iv.slot_correct / count).tolist()[1:]  # slots 1..B−1 (slot 0 has no label)
        labelled = float(iv.slot_count.sum())
        values: dict[str, Any] = {
            "epoch": self.source.epoch,
            "loss": float(iv.loss_sum) / good if good else float("nan"),
            "lr": self._lr,
            "grad_norm": float(iv.grad_norm_sum) / good if good else float("nan"),
            "acc": float(iv.slot_correct.sum()) / labelled if labelled else 0.0,
            "slot_acc": slot_acc,
            # 1 + the mean streak of correct slots over *every* anchor of the interval's training blocks: not a
            # decoding τ (chain rounds start where the last one stopped, on held-out text) — val/* are (eval.every)
            "train_streak_tau": float(iv.streak_sum) / max(float(iv.blocks), 1.0) + 1.0,
            "tokens_per_s": iv.tokens / elapsed,
            "anchors_per_s": iv.anchors / elapsed,
            "step_time_s": elapsed / max(iv.steps, 1),
            # model FLOPs over the same wall time (incl. waiting), so a run-level figure, below the drafter-step
            # MFU of benchmarks/train_throughput.py. Per rank: unlike tokens_per_s, not all-reduced under
            # torchrun (rank 0 logs its own), as telemetry.peak_tflops is one device's
            "model_tflops_per_s": iv.flops / elapsed / 1e12,
            "tokens_seen": self.tokens_seen,
            "skipped_steps": bad,
        }
        peak = self.cfg.telemetry.peak_tflops
        if peak is not None:
            values["mfu"] = values["model_tflops_per_s"] / peak  # this rank's device
        values.update(self._val_values)
        self._val_values = {}
        self.logger.log(self.step, values)
        if bar is not None:
            post = {"loss": f"{values['loss']:.3f}", "streak_tau": f"{values['train_streak_tau']:.2f}"}
            if self.validation is not None and self.validation.last is not None:
                post["val_chain_tau"] = f"{self.validation.last.chain_tau:.2f}"
            bar.set_postfix(post, refresh=False)
        if bad:
            print(
                f"warning: step {self.step}: skipped {bad} step(s) with a non-finite loss or gradient",
                file=sys.stderr,
            )
        m = self.cfg.optim.max_bad_steps
        if float(iv.max_bad_streak) >= m:
            raise TrainingError(
                f"stopped at step {self.step}: {m} optimizer steps in a row had a non-finite loss or gradient "
                f"(optim.max_bad_steps={m}). Lower optim.lr, check the data, or resume from "
                f"{self.last_checkpoint or 'a checkpoint'}"
            )
        return values
