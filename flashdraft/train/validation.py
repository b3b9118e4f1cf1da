"""Validation τ inside the trainer: `flashdraft eval`'s replay over fixed held-out references, every N steps.

    flashdraft train configs/smollm2-b16.yaml eval.every=500 eval.dataset=humaneval eval.limit=32
    flashdraft train ... eval.every=500 eval.references=refs/humaneval-256.jsonl   # {"id", "prompt_ids", "tokens"}

The training metrics' `train_streak_tau` is a streak over *every* anchor of the training batches, on
training answers: it read 6.95 where held-out chain τ was 3–4. This module measures what `flashdraft eval`
measures, with its own code: the references (`flashdraft.eval.references`, or a file of them), each checked
by one teacher-forced target pass (`flashdraft.eval.evaluate._checked_item`, done once at start-up and kept),
then at every validation the drafter's replay (`flashdraft.eval.offline.replay_batch`) summarised by
`flashdraft.eval.evaluate.summarize`. So val/chain_tau, val/ddtree_tau (the best budget's τ) and
val/topk_streak equal `flashdraft eval`'s numbers on the same references, target dtype and drafter weights
(tests/train/test_validation.py, float64). On CUDA the trainer's target is bf16 and its drafter fp32 master
weights (the EMA's averages when optim.ema_decay > 0: what checkpoints hold), so the figures sit close to,
not exactly on, a float32 `flashdraft eval`.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from flashdraft.config import ConfigError
from flashdraft.eval.evaluate import ReferenceStats, _checked_item, summarize
from flashdraft.eval.offline import ReplayItem, TeacherForced, replay_batch
from flashdraft.eval.references import Reference
from flashdraft.eval.replay import Method, methods_for
from flashdraft.files import atomic_write_text
from flashdraft.train.config import EvalConfig

REFERENCES_FILE = "val_references.jsonl"  # in the run folder: the references a run validated on


@dataclass
class ValidationResult:
    chain_tau: float
    ddtree_tau: float  # the best budget's
    ddtree_budget: int
    topk_streak: float | None  # None when eval.topk = 0
    slot1_acc: float  # chain rounds' slot-1 accuracy (every 4th round, as the eval counts it)
    seconds: float

    def values(self) -> dict[str, float]:
        """The metrics line's val/* keys."""
        out = {
            "val/chain_tau": self.chain_tau, "val/ddtree_tau": self.ddtree_tau,
            "val/ddtree_budget": float(self.ddtree_budget), "val/slot1_acc": self.slot1_acc,
            "val/seconds": self.seconds,
        }  # fmt: skip
        if self.topk_streak is not None:
            out["val/topk_streak"] = self.topk_streak
        return out


@dataclass
class _Heads:
    """What the replay reads of the target, on the drafter's device (runtime.target_device may put the target
    elsewhere)."""

    embed_tokens: Any
    lm_head: Any
    device: torch.device
    dtype: torch.dtype
    hidden_size: int


# ----------------------------------------------------------------------------- reference files


def read_references(path: str | Path, limit: int | None = None) -> list[Reference]:
    """The first `limit` references of a JSONL of {"id"?, "prompt_ids": [ints], "tokens": [ints], ...}: `tokens`
    is the target's continuation (new tokens only). Fields a line leaves out default to an exact local greedy
    reference (never cut at a disagreement)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(
            f"eval.references {p}: no such file (write one with eval.dataset: RUN/{REFERENCES_FILE})"
        )
    out: list[Reference] = []
    for n, line in enumerate(p.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            prompt, tokens = [int(i) for i in rec["prompt_ids"]], [int(i) for i in rec["tokens"]]
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ConfigError(
                f'{p}:{n}: expected {{"prompt_ids": [ints], "tokens": [ints]}} ({type(e).__name__}: {e}); '
                "fix the line or point eval.references at another file"
            ) from None
        out.append(
            Reference(
                str(rec.get("id", f"{p.stem}-{n}")), prompt, tokens, str(rec.get("template", "token ids")),
                str(rec.get("source", "local")), float(rec.get("temperature", 0.0)), rec.get("seed"),
                str(rec.get("stop_reason", "")), str(rec.get("key", "")),
            )
        )  # fmt: skip
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise ConfigError(f"eval.references {p}: no references in the file")
    return out


def write_references(refs: list[Reference], path: str | Path) -> None:
    """One JSON line per reference (all its fields), written atomically."""
    atomic_write_text(path, "".join(json.dumps(asdict(r)) + "\n" for r in refs))


def compute_validation_references(
    cfg: EvalConfig, target: Any, run_dir: Path, progress: bool = True
) -> list[Reference]:
    """eval.references read, or eval.dataset's references as `flashdraft eval` computes them (its cache, its
    batching default), saved to RUN/val_references.jsonl; a resumed run reads that file instead."""
    if cfg.references:
        return read_references(cfg.references, cfg.limit)
    saved = run_dir / REFERENCES_FILE
    if saved.is_file():
        return read_references(saved, cfg.limit)
    from flashdraft.eval.prompts import load_eval_prompts
    from flashdraft.eval.references import ReferenceSettings, compute_references, default_ref_batch

    try:
        prompts = load_eval_prompts(cfg.dataset, target, cfg.limit)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"eval.dataset: {e}") from None
    rs = compute_references(
        target, prompts, ReferenceSettings(cfg.max_new_tokens), progress=progress,
        batch_size=default_ref_batch(target.device),
    )  # fmt: skip
    write_references(rs.references, saved)
    return rs.references


# ----------------------------------------------------------------------------- the validation


@contextlib.contextmanager
def averaged_weights(ema: Any | None) -> Iterator[None]:
    """The drafter holds the EMA's averages inside the block (what checkpoints hold), its trained weights after."""
    if ema is None:
        yield
        return
    trained = [p.detach().clone() for p in ema.params]
    with torch.no_grad():
        torch._foreach_copy_(ema.params, ema.shadow)
    try:
        yield
    finally:
        with torch.no_grad():
            torch._foreach_copy_(ema.params, trained)


class Validation:
    """Replay items (references + their teacher-forced passes) kept for the run; `run` replays the drafter."""

    def __init__(
        self, cfg: EvalConfig, heads: Any, items: list[ReplayItem], stats: ReferenceStats, group: int = 16
    ) -> None:  # fmt: skip
        self.cfg, self.heads, self.items, self.stats, self.group = cfg, heads, items, stats, group
        self.methods: list[Method] = methods_for(sorted(set(cfg.budgets)), cfg.topk or None)
        self.last: ValidationResult | None = None

    def due(self, step: int, total_steps: int) -> bool:
        return self.cfg.every > 0 and (step % self.cfg.every == 0 or step == total_steps)

    @torch.no_grad()
    def run(self, drafter: torch.nn.Module, ema: Any | None = None) -> ValidationResult:
        """τ of the drafter's current weights (the EMA's averages when `ema`), as `flashdraft eval` reports it."""
        t0 = time.perf_counter()
        was_training = drafter.training
        drafter.eval()
        results = []
        try:
            with averaged_weights(ema):
                for a in range(0, len(self.items), self.group):
                    results += replay_batch(self.heads, drafter, self.items[a : a + self.group], self.methods)  # type: ignore[arg-type]
        finally:
            drafter.train(was_training)
        report = summarize("validation", "", drafter, results, self.methods, 0.0)  # type: ignore[arg-type]
        trees = {m.size: report.methods[m.name].tau for m in self.methods if m.kind == "ddtree"}
        best = max(trees, key=lambda b: (trees[b], -b))  # the smallest budget among equals
        topk = [report.methods[m.name].tau for m in self.methods if m.kind == "topk"]
        self.last = ValidationResult(
            report.methods["chain"].tau, trees[best], best, topk[0] if topk else None,
            report.slot_accuracy[0], time.perf_counter() - t0,
        )  # fmt: skip
        return self.last


def build_validation(
    cfg: EvalConfig, target: Any, drafter: torch.nn.Module, run_dir: str | Path, *, heads: Any | None = None,
    progress: bool = True,
) -> Validation:  # fmt: skip
    """References and their teacher-forced passes, once. `target`: the full target (any device); `heads`: its
    embedding and head on the drafter's device when the target runs elsewhere (FrozenHeads)."""
    refs = compute_validation_references(cfg, target, Path(run_dir), progress)
    stats = ReferenceStats(len(refs), refs[0].source, 0.0, 0, 0, len(refs), 0.0, 0, 0, None, 0)
    layer_ids = list(drafter.config.target_layer_ids)  # type: ignore[union-attr]
    items = [_checked_item(target, r, cfg.max_new_tokens, layer_ids, stats) for r in refs]
    device = next(drafter.parameters()).device
    if torch.device(target.device) == device:
        replay_target = target
    else:
        h = heads if heads is not None else target
        replay_target = _Heads(h.embed_tokens, h.lm_head, device, target.dtype, target.hidden_size)
        # the features move to the drafter once; the target's argmax and margins are not replayed
        for it in items:
            tf = it.tf
            it.tf = TeacherForced(
                tf.tokens.to(device), tf.features.to(device), tf.layer_ids, tf.choice, tf.margin
            )
    return Validation(cfg, replay_target, items, stats)
