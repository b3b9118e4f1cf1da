"""Data parallelism for the drafter under torchrun: DDP or FSDP2, one data shard per rank.

    torchrun --nproc_per_node 8 -m flashdraft.cli train cfg.yaml distributed.strategy=fsdp2
    torchrun --nproc_per_node 4 -m flashdraft.cli train cfg.yaml runtime.target_device=cuda:4,cuda:5,cuda:6,cuda:7

The model code knows nothing of this (STYLE.md §4): `init_distributed` reads torchrun's
environment, `wrap_drafter` applies DDP or `fully_shard` afterwards, and `DistributedTrainer`
adds what a data-parallel run needs on top of the one-process Trainer:

- every rank reads its own micro-batches (`InProcessSource(rank=, world_size=)`: the epoch's
  plan dealt round-robin, the same number to every rank), and the loss is divided by Σw of
  the global batch (`loss.loss_denominator` all-reduces it), so a 2-rank run equals a
  1-rank run with the same global batch;
- logged sums (loss, slot accuracy, τ proxy, tokens) are all-reduced once per log line;
- checkpoints: FSDP2 gathers the full weights and optimizer state, rank 0 writes; each rank's
  RNG and anchor-sampler state is gathered too, so a resumed run continues exactly;
- a SIGUSR1 on any rank makes every rank checkpoint at the same step (a flag all-reduced on
  a CPU (gloo) group each step: no GPU sync).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from flashdraft.train.checkpoint import (
    StateDictDrafter,
    TrainerState,
    load_trainer_state,
    prune_checkpoints,
    save_checkpoint,
    step_of,
)
from flashdraft.train.trainer import Trainer, config_hash


@dataclass
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device | None = None  # this rank's drafter device (None in one process: config decides)
    control: Any = None  # a gloo process group for host-side flags (no GPU sync)

    @property
    def active(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.active:
            dist.barrier(group=self.control)


def init_distributed(backend: str = "auto", device: str = "auto") -> DistContext:
    """Join the process group torchrun describes (WORLD_SIZE > 1); a no-op context otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistContext()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() and device != "cpu"
    if backend == "auto":
        backend = "nccl" if use_cuda else "gloo"
    if use_cuda:
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, rank=rank, world_size=world)
    control = dist.new_group(backend="gloo") if backend != "gloo" else None
    return DistContext(rank, world, local_rank, dev, control)


def wrap_drafter(drafter: torch.nn.Module, strategy: str, ctx: DistContext) -> torch.nn.Module:
    """The module the trainer calls: DDP(drafter), or the drafter sharded in place by FSDP2.

    Build the optimizer after this (FSDP2 replaces the parameters with sharded DTensors).
    """
    if not ctx.active:
        return drafter
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [ctx.device.index] if ctx.device is not None and ctx.device.type == "cuda" else None
        return DDP(drafter, device_ids=ids)
    if strategy == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in drafter.layers:  # type: ignore[union-attr]  # one all-gather per decoder layer
            fully_shard(layer)
        fully_shard(drafter)
        return drafter
    raise ValueError(f"distributed.strategy {strategy!r}: use ddp or fsdp2")


def is_sharded(module: torch.nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP2 grad norm) as a plain replicated tensor; other tensors unchanged."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


class DistributedTrainer(Trainer):
    """Trainer + the data-parallel parts listed in the module docstring."""

    def __init__(self, *args: Any, ctx: DistContext, **kw: Any) -> None:
        self.ctx = ctx
        super().__init__(*args, rank=ctx.rank, **kw)
        self.sharded = is_sharded(self.drafter)
        if self.sharded and self.ema is not None:
            raise ValueError(
                "optim.ema_decay is not supported with distributed.strategy=fsdp2 (the averages would be "
                "sharded); use ddp or optim.ema_decay=0"
            )

    # a SIGUSR1 or a time limit may fire on one rank only: every rank must checkpoint / stop at the same step
    def _agree(self, flags: list[bool]) -> list[bool]:
        t = torch.tensor([1 if f else 0 for f in flags])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.ctx.control)
        return [bool(x) for x in t.tolist()]

    def _agree_min(self, value: int) -> int:
        t = torch.tensor([int(value)])
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.ctx.control)
        return int(t.item())

    def _clip_grad_norm(self, params: list[torch.Tensor]) -> torch.Tensor:
        return full_tensor(super()._clip_grad_norm(params))

    def _gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.ctx.world_size
        dist.all_gather_object(out, obj, group=self.ctx.control)
        return out

    def _state(self) -> TrainerState:
        ts = super()._state()
        mine: dict[str, Any] = {
            "torch_cpu": torch.get_rng_state(),
            "anchor_sampler": self.anchor_sampler.state_dict(),
            "tokens_seen": self.tokens_seen,
            "anchors_seen": self.anchors_seen,
        }
        if self.device.type == "cuda":
            mine["torch_cuda"] = torch.cuda.get_rng_state(self.device)
        ranks = self._gather(mine)
        ts.state["ranks"] = ranks
        ts.info["world_size"] = self.ctx.world_size
        ts.info["tokens_seen"] = sum(r["tokens_seen"] for r in ranks)
        ts.info["anchors_seen"] = sum(r["anchors_seen"] for r in ranks)
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

            opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
            ts.state["optimizer"] = get_optimizer_state_dict(self.drafter, self.optimizer, options=opts)
        return ts

    def save(self) -> Path:
        state = self._state()  # collective: every rank
        drafter: Any = self._checkpoint_drafter()
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
            drafter = StateDictDrafter(self.drafter, get_model_state_dict(self.drafter, options=opts))
        from flashdraft.train.checkpoint import checkpoint_dir

        path = checkpoint_dir(self.run_dir, self.step)
        if self.ctx.is_main:
            path = save_checkpoint(self.run_dir, self.step, drafter, state)
            prune_checkpoints(self.run_dir, self.cfg.checkpoint.keep_last, self.cfg.checkpoint.best_metric)
        self.ctx.barrier()  # no rank runs ahead of a checkpoint that is not on disk yet
        self.last_checkpoint = path
        return path

    def restore(self, checkpoint: str | Path) -> None:
        ts = load_trainer_state(checkpoint)
        world = int(ts.info.get("world_size", 1))
        if world != self.ctx.world_size:
            raise ValueError(
                f"{checkpoint} was written by {world} rank(s), this run has {self.ctx.world_size}: the data "
                f"shards differ; resume with --nproc_per_node {world} (or start a new run from its drafter "
                "with model.init_from)"
            )
        if ts.info.get("config_hash") != config_hash(self.cfg) and self.ctx.is_main:
            print(f"warning: {checkpoint} was written with a different model/data/loss/optim config")
        from safetensors.torch import load_file

        weights = load_file(str(Path(checkpoint) / "drafter" / "model.safetensors"))
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_model_state_dict,
                set_optimizer_state_dict,
            )

            opts = StateDictOptions(full_state_dict=True)
            set_model_state_dict(self.drafter, weights, options=opts)
            set_optimizer_state_dict(self.drafter, self.optimizer, ts.state["optimizer"], options=opts)
        else:
            self.drafter.load_state_dict(weights, strict=True)
            self._restore_train_weights(ts)
            self.optimizer.load_state_dict(ts.state["optimizer"])
        mine = ts.state["ranks"][self.ctx.rank]
        torch.set_rng_state(mine["torch_cpu"])
        if "torch_cuda" in mine and self.device.type == "cuda":
            torch.cuda.set_rng_state(mine["torch_cuda"], self.device)
        self.anchor_sampler.load_state_dict(mine["anchor_sampler"])
        self.tokens_seen, self.anchors_seen = int(mine["tokens_seen"]), int(mine["anchors_seen"])
        self.source.load_state_dict(ts.info["data"])
        self.step = step_of(checkpoint)
        self.logger.truncate_after(self.step)
        self.last_checkpoint = Path(checkpoint)

    def _log(self, iv: Any, bar: Any) -> dict[str, Any]:
        """All-reduce the interval's per-rank sums, then log as one process would."""
        for t in (iv.loss_sum, iv.slot_correct, iv.slot_count, iv.streak_sum, iv.blocks):
            dist.all_reduce(t)  # per-rank shares of global quantities (loss: local Σw·CE / global Σw)
        # grad_norm, good/bad steps are already global (gradients are all-reduced before the norm);
        # iv.flops stays this rank's own: model_tflops_per_s and mfu are per device
        counts = torch.tensor([iv.tokens, iv.anchors, self.tokens_seen], dtype=torch.int64)
        dist.all_reduce(counts, group=self.ctx.control)
        iv.tokens, iv.anchors = int(counts[0]), int(counts[1])
        local_seen = self.tokens_seen
        self.tokens_seen = int(counts[2])  # logged as the global count; restored below
        try:
            return super()._log(iv, bar)
        finally:
            self.tokens_seen = local_seen


def shutdown(ctx: DistContext) -> None:
    """Leave the process group. A gloo worker thread frees each finished collective's tensors, which takes the GIL;
    a process group whose last reference goes in a Python dealloc (the DDP reducer's, after this) holds the GIL while
    it joins those threads, so one still freeing deadlocks the rank at exit (seen once on a 2-core CPU, 2026-12-06:
    a rank stuck in ~ProcessGroupGloo, its worker in ~AsyncBarrierWork). Sleeping first lets the workers finish."""
    if ctx.active and dist.is_initialized():
        time.sleep(0.2)  # the GIL released: workers free what they hold
        dist.destroy_process_group()
