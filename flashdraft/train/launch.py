"""Build a training run from a TrainConfig: run folder, target, drafter, data source, trainer.

    flashdraft train configs/smollm2-b16.yaml [key=value ...] [--resume]
    result = train(load_config(TrainConfig, path, overrides), resume=False)

Device and precision policy (runtime.dtype=auto): on CUDA the target runs in bf16 and the
drafter keeps fp32 master weights under bf16 autocast; on CPU everything is float32.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flashdraft.config import ConfigError, save_config, to_dict
from flashdraft.train.checkpoint import architecture_mismatch, latest_checkpoint, resume_checkpoint
from flashdraft.train.config import TrainConfig
from flashdraft.train.distributed import DistributedTrainer, init_distributed, shutdown, wrap_drafter
from flashdraft.train.lifecycle import Heartbeat, RunSignals
from flashdraft.train.pipeline import FrozenHeads, build_source, resolve_target_device
from flashdraft.train.telemetry import GpuStats, TelemetryLogger
from flashdraft.train.trainer import Trainer, TrainResult

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


@dataclass
class Precision:
    target: torch.dtype  # the frozen target's weights (and so the features)
    params: torch.dtype  # the drafter's master weights (what the optimizer updates)
    compute: torch.dtype | None  # autocast dtype, None = no autocast


def compile_parts(
    model: Any, parts: set[str], device: torch.device, attention: str, mode: str = "default"
) -> Any:
    """Apply runtime.compile on CUDA (CPU runs stay eager): returns the forward to call.

    `mode` (runtime.compile_mode) is torch.compile's mode for the whole drafter ("model")."""
    if device.type != "cuda":
        return model
    if "loss" in parts:
        from flashdraft.train.loss import compile_loss

        compile_loss()
    if "model" in parts:
        # static shapes (data.blocks_per_row): one graph, no dynamic-shape recompiles — the dynamic
        # path hit an assertion in inductor's optional coalesced-tiling analysis after step 80 on
        # torch 2.11 (benchmarks/RESULTS.md); that heuristic stays off as well
        import torch._inductor.config as inductor_config

        if hasattr(inductor_config.triton, "coalesce_tiling_analysis"):
            inductor_config.triton.coalesce_tiling_analysis = False
        # FlexAttention is compiled inside the graph; "reduce-overhead" replays it as CUDA graphs
        return torch.compile(model, dynamic=False, mode=None if mode == "default" else mode)
    if "attention" in parts and attention == "flex":
        from flashdraft.drafter import compile_flex_attention

        compile_flex_attention()
    return model


def resolve_device(cfg: TrainConfig) -> torch.device:
    if cfg.runtime.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(cfg.runtime.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"runtime.device={cfg.runtime.device!r} but CUDA is not available: use runtime.device=cpu"
        )
    return dev


def resolve_precision(cfg: TrainConfig, device: torch.device) -> Precision:
    dt = cfg.runtime.dtype
    if dt == "auto":
        dt = "bfloat16" if device.type == "cuda" else "float32"
    if dt == "bfloat16":
        prec = Precision(torch.bfloat16, torch.float32, torch.bfloat16)  # fp32 master weights, bf16 compute
    else:
        prec = Precision(_DTYPES[dt], _DTYPES[dt], None)
    if cfg.model.target_dtype != "auto":
        if cfg.model.target_dtype not in _DTYPES:
            raise ConfigError(
                f"model.target_dtype {cfg.model.target_dtype!r}: use auto, float32, float64 or bfloat16"
            )
        prec.target = _DTYPES[cfg.model.target_dtype]
    return prec


def build_drafter(cfg: TrainConfig, target: Any, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A fresh drafter shaped for the target (or `model.init_from`), seeded by runtime.seed: random, or
    started from the target's layers (`model.init_from_target`)."""
    from flashdraft.drafter import DFlashDrafter
    from flashdraft.target import INIT_FROM_TARGET, check_pair, drafter_config_for, init_drafter_from_target

    m = cfg.model
    if m.init_from_target not in INIT_FROM_TARGET:
        raise ConfigError(
            f"model.init_from_target {m.init_from_target!r}: use one of {', '.join(INIT_FROM_TARGET)}"
        )
    if m.init_from and m.init_from_target != "none":
        raise ConfigError("model.init_from and model.init_from_target both set: pick one starting point")
    if m.init_from:
        drafter = DFlashDrafter.from_pretrained(m.init_from, dtype=dtype, device=device)
        if drafter.config.block_size != m.block_size:
            raise ConfigError(
                f"model.init_from {m.init_from} has block_size {drafter.config.block_size}, the config says "
                f"{m.block_size}: set model.block_size={drafter.config.block_size}"
            )
        if m.grow_layers:
            torch.manual_seed(cfg.runtime.seed)
            drafter = drafter.grown(m.grow_layers, std=m.init_std)
    else:
        try:
            dcfg = drafter_config_for(
                target, num_layers=m.num_layers, block_size=m.block_size, target_layer_ids=m.target_layer_ids,
                mask_token_id=m.mask_token_id, num_attention_heads=m.num_attention_heads,
                num_key_value_heads=m.num_key_value_heads, head_dim=m.head_dim, intermediate_size=m.intermediate_size,
            )  # fmt: skip
        except ValueError as e:
            raise ConfigError(f"model: {e}") from None
        torch.manual_seed(cfg.runtime.seed)
        drafter = DFlashDrafter(dcfg)
        drafter.reset_parameters(std=m.init_std)
        try:
            init_drafter_from_target(drafter, target, m.init_from_target)
        except ValueError as e:
            raise ConfigError(f"model: {e}") from None
        drafter = drafter.to(device=device, dtype=dtype)
    try:
        check_pair(target, drafter.config)
    except ValueError as e:
        raise ConfigError(f"model: {e}") from None
    return drafter.train()


def open_samples(cfg: TrainConfig) -> tuple[Any, list[int]]:
    """(samples, lengths) of the training split (a flashdraft dataset folder)."""
    from flashdraft.data.dataset import open_dataset

    path = Path(cfg.data.dataset)
    if not path.exists():
        raise ConfigError(f"data.dataset {path}: not found (build one with `flashdraft data regenerate`)")
    ds = open_dataset(path, cfg.data.split)
    return ds, [int(n) for n in ds.lengths]


def prepare_run_dir(cfg: TrainConfig, resume: bool, command: str | None) -> Path:
    run = Path(cfg.run_dir)
    held = sorted(p.name for p in run.iterdir()) if run.is_dir() else []
    if not resume and held:
        shown = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
        raise ConfigError(
            f"run_dir {run} is not empty ({shown}): pass --resume to continue it, move it aside with "
            f"`flashdraft runs archive {run}`, or set run_dir to a new folder"
        )
    if resume and latest_checkpoint(run) is None:
        raise ConfigError(
            f"--resume: {run}/checkpoints has no complete checkpoint: move the run aside with "
            f"`flashdraft runs archive {run}` and start without --resume"
        )
    run.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run / "config.yaml")
    line = command if command is not None else " ".join(sys.argv)
    with (run / "command.txt").open("a") as f:
        f.write(("resume: " if resume else "") + line + "\n")
    return run


def train(
    cfg: TrainConfig,
    *,
    resume: bool = False,
    command: str | None = None,
    target: Any | None = None,  # an already loaded TargetModel (tests); default: load model.target
    samples: Any | None = None,  # in-memory samples (tests); default: open data.dataset
    on_step_end: Any | None = None,
) -> TrainResult:
    if samples is None:
        cfg.validate()
    elif not cfg.data.dataset:
        cfg.data.dataset = "<in-memory>"
        cfg.validate()
    # SIGUSR1/SIGINT/SIGTERM handled from start-up: a request while loading waits for the first step
    with RunSignals() as signals:
        return _train(cfg, signals, resume=resume, command=command, target=target, samples=samples,
                      on_step_end=on_step_end)  # fmt: skip


def _train(
    cfg: TrainConfig, signals: RunSignals, *, resume: bool, command: str | None, target: Any, samples: Any,
    on_step_end: Any,
) -> TrainResult:  # fmt: skip
    ctx = init_distributed(cfg.distributed.backend, cfg.runtime.device)  # torchrun: one rank per process
    heartbeat: Heartbeat | None = None
    try:
        device = ctx.device if ctx.device is not None else resolve_device(cfg)
        if device.type == "cuda" and device.index is None:  # "cuda" == "cuda:0" for placement comparisons
            device = torch.device("cuda", torch.cuda.current_device())
        prec = resolve_precision(cfg, device)
        if cfg.runtime.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        if ctx.is_main:
            run = prepare_run_dir(cfg, resume, command)
            heartbeat = Heartbeat(run).start()
        ctx.barrier()
        run = Path(cfg.run_dir)
        try:
            target_device = resolve_target_device(cfg.runtime.target_device, device, ctx.local_rank)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if cfg.pipeline.mode == "offline":
            target_device = device  # only the frozen embedding and head are used
        if target is None:
            from flashdraft.target import load_target

            target = load_target(cfg.model.target, dtype=prec.target, device=target_device)
        drafter = build_drafter(cfg, target, device, prec.params)
        if samples is None:
            samples, lengths = open_samples(cfg)
        else:
            lengths = [len(s.input_ids) for s in samples]
        layer_ids = drafter.config.target_layer_ids
        try:
            source = build_source(
                cfg, samples, lengths, target, layer_ids, device, rank=ctx.rank, world_size=ctx.world_size
            )
        except ValueError as e:  # FeaturesError: a dump that does not fit this run
            raise ConfigError(str(e)) from None
        # the drafter step reads the target's embedding and head on the drafter's device
        heads: Any = target if torch.device(target.device) == device else FrozenHeads(target, device)
        attention = cfg.runtime.attention
        if attention == "auto":
            attention = "flex" if device.type == "cuda" else "dense"
        model: Any = wrap_drafter(drafter, cfg.distributed.strategy, ctx)  # before the optimizer (FSDP2)
        model = compile_parts(model, cfg.runtime.compile_parts, device, attention, cfg.runtime.compile_mode)
        providers: list[Any] = [source.take_stats]
        if cfg.telemetry.gpu and device.type == "cuda" and ctx.is_main:
            providers.append(GpuStats(device))
        logger = TelemetryLogger(
            run, providers=providers, tensorboard=cfg.telemetry.tensorboard,
            wandb_project=cfg.telemetry.wandb_project, config=to_dict(cfg), enabled=ctx.is_main,
        )  # fmt: skip
        vocab = None
        if cfg.loss.softmax_vocab > 0:
            from flashdraft.train.vocab import label_vocab

            vocab = label_vocab(samples, target.vocab_size, cfg.loss.softmax_vocab)
            if ctx.is_main:
                print(f"loss.softmax_vocab={vocab.size}: {vocab.coverage:.2%} of the training labels are inside it",
                      file=sys.stderr)  # fmt: skip
        validation = None
        if cfg.eval.every > 0:  # held-out references and the target's pass over them, once
            from flashdraft.train.validation import build_validation

            progress = cfg.telemetry.progress
            validation = build_validation(cfg.eval, target, drafter, run, heads=heads, progress=progress)
        kw: dict[str, Any] = dict(
            run_dir=run, model=model, logger=logger, device=device, compute_dtype=prec.compute,
            attention=attention, on_step_end=on_step_end, vocab=vocab, signals=signals, validation=validation,
        )  # fmt: skip
        if ctx.active:
            trainer: Trainer = DistributedTrainer(cfg, heads, drafter, source, ctx=ctx, **kw)
        else:
            trainer = Trainer(cfg, heads, drafter, source, **kw)
        if resume:
            resume_from(trainer, run, verbose=ctx.is_main)
        if heartbeat is not None:
            heartbeat.progress = lambda: {
                "step": trainer.step, "total_steps": trainer.total_steps,
                "checkpoint": str(trainer.last_checkpoint) if trainer.last_checkpoint else None,
            }  # fmt: skip
        result = trainer.run()
        if heartbeat is not None:
            signalled = result.stopped in ("SIGINT", "SIGTERM")
            heartbeat.finish("stopped" if signalled else "finished", result.stopped)
        return result
    except BaseException as e:
        if heartbeat is not None:
            if isinstance(e, SystemExit):  # a stop signal outside the steps, or a second one
                heartbeat.finish("stopped", f"exited at once on a signal (exit {e.code})")
            else:
                heartbeat.finish("failed", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        raise
    finally:
        shutdown(ctx)


def resume_from(trainer: Trainer, run: Path, *, verbose: bool) -> Path:
    """Restore the newest intact checkpoint (a broken newer one is skipped with a warning); a checkpoint of
    another drafter architecture is refused with the setting that differs."""
    warn = (lambda line: print(line, file=sys.stderr)) if verbose else None
    ckpt = resume_checkpoint(run, warn)
    if ckpt is None:
        raise ConfigError(
            f"--resume: no intact checkpoint in {run}/checkpoints (each one is missing or truncated): move the "
            f"run aside with `flashdraft runs archive {run}` and start without --resume"
        )
    mismatch = architecture_mismatch(ckpt, trainer.drafter.config)
    if mismatch is not None:
        raise ConfigError(mismatch)
    trainer.restore(ckpt)
    if verbose:
        print(f"resumed from {ckpt} (step {trainer.step})", file=sys.stderr)
    return ckpt
