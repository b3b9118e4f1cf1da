"""Validation τ inside the trainer: `flashdraft eval`'s replay over fixed held-out references, every N steps.

    flashdraft train configs/smollm2-b16.yaml eval.every=500 eval.dataset=humaneval eval.limit=32
    flashdraft train ... eval.every=500 eval.dataset= eval.references=benchmarks/yardstick/humaneval-164.jsonl

The training metrics' `train_streak_tau` is a streak over *every* anchor of the training batches, on
training answers: it read 6.95 where held-out chain τ was 3–4. This module measures what `flashdraft eval`
measures, with its own code: the references (`flashdraft.eval.references`, or a frozen reference file: the
format of benchmarks/yardstick/ and of the RUN/val_references.jsonl a run with eval.dataset writes), each
checked by one teacher-forced target pass and cut at its first disagreement with the target's argmax
(`flashdraft.eval.evaluate._checked_item`, done once at start-up and kept), then at every validation the
drafter's replay (`flashdraft.eval.offline.replay_batch`) summarised by `flashdraft.eval.evaluate.summarize`.
So val/chain_tau, val/ddtree_tau (the best budget's τ) and val/topk_streak equal `flashdraft eval
--references FILE`'s numbers on the same file, target dtype and drafter weights (tests/train/test_validation.py,
float64). On CUDA the trainer's target is bf16 and its drafter fp32 master weights (the EMA's averages when
optim.ema_decay > 0: what checkpoints hold), so the figures sit close to, not exactly on, a float32
`flashdraft eval`; a float32 yardstick read by a bf16 target gets a one-line warning (another fingerprint) and
is cut where bf16's argmax differs.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from flashdraft.config import ConfigError
from flashdraft.eval.evaluate import ReferenceStats, _checked_item, standard_error, summarize
from flashdraft.eval.offline import ReplayItem, TeacherForced, replay_batch
from flashdraft.eval.references import Reference, read_frozen, write_frozen
from flashdraft.eval.replay import Method, methods_for
from flashdraft.target import target_fingerprint
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
    # the chain τ's standard error over the prompts (sample sd / √n; None under two prompts): how far apart two
    # validations must be to mean anything — unpaired, across runs, more apart still
    chain_tau_se: float | None = None

    def values(self) -> dict[str, float]:
        """The metrics line's val/* keys."""
        out = {
            "val/chain_tau": self.chain_tau, "val/ddtree_tau": self.ddtree_tau,
            "val/ddtree_budget": float(self.ddtree_budget), "val/slot1_acc": self.slot1_acc,
            "val/seconds": self.seconds,
        }  # fmt: skip
        if self.topk_streak is not None:
            out["val/topk_streak"] = self.topk_streak
        if self.chain_tau_se is not None:
            out["val/chain_tau_se"] = self.chain_tau_se
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


def _is_legacy(path: Path) -> bool:
    """A RUN/val_references.jsonl written before 2026-12-06: one `asdict(Reference)` per line, no format tag."""
    with path.open(errors="replace") as f:
        first = next((line for line in f if line.strip()), "")
    try:
        rec = json.loads(first)
    except json.JSONDecodeError:
        return False
    return isinstance(rec, dict) and "format" not in rec and {f.name for f in fields(Reference)} <= rec.keys()


def _read_legacy(path: Path, limit: int | None) -> list[Reference]:
    """The legacy per-Reference lines, kept as written (their `source`, so a resumed run cuts exactly as before)."""
    out: list[Reference] = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            ref = Reference(**rec)
            ref.prompt_ids, ref.tokens = [int(i) for i in ref.prompt_ids], [int(i) for i in ref.tokens]
            if float(ref.temperature) != 0:
                raise ValueError(f"temperature {ref.temperature}: validation references are greedy")
        except (json.JSONDecodeError, TypeError, ValueError) as e:
            raise ConfigError(
                f"{path}:{n}: not a validation reference line ({e}): fix or delete the line"
            ) from None
        out.append(ref)
        if limit is not None and len(out) >= limit:
            break
    return out


def read_validation_references(
    path: str | Path, cfg: EvalConfig, target: Any, warn: Callable[[str], None] | None = None
) -> list[Reference]:
    """The first eval.limit references of a frozen reference file (`flashdraft.eval.references.read_frozen`:
    benchmarks/yardstick/*.jsonl, RUN/val_references.jsonl), source "frozen:<name>", so each is checked against
    this target's teacher-forced argmax and cut at its first disagreement as `flashdraft eval --references`
    does. `warn` gets one line when the file was written by another target or dtype. A legacy
    RUN/val_references.jsonl (before 2026-12-06) is read as written."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(
            f"eval.references {p}: no such file (benchmarks/yardstick/make_references.py writes one; "
            f"a run with eval.dataset writes RUN/{REFERENCES_FILE})"
        )
    if _is_legacy(p):
        return _read_legacy(p, cfg.limit)
    try:
        frozen = read_frozen(p, cfg.limit)
    except ValueError as e:
        raise ConfigError(f"{e}: fix it, or point eval.references at a frozen reference file") from None
    if cfg.max_new_tokens > frozen.max_new_tokens:
        raise ConfigError(
            f"eval.max_new_tokens {cfg.max_new_tokens} > the {frozen.max_new_tokens} tokens of {p}: "
            f"set eval.max_new_tokens={frozen.max_new_tokens} or less"
        )
    mine = target_fingerprint(target)
    if frozen.fingerprint != mine and warn is not None:
        warn(
            f"warning: validation references {p} were written by {frozen.target} ({frozen.dtype}, fingerprint "
            f"{frozen.fingerprint}), not this target ({str(target.dtype).removeprefix('torch.')}, fingerprint "
            f"{mine}): each reference is cut at its first disagreement with this target's argmax"
        )
    return frozen.references


def compute_validation_references(
    cfg: EvalConfig,
    target: Any,
    run_dir: Path,
    progress: bool = True,
    warn: Callable[[str], None] | None = None,
) -> list[Reference]:
    """eval.references read, or eval.dataset's references as `flashdraft eval` computes them (its cache, its
    batching default), saved as a frozen reference file to RUN/val_references.jsonl; a resumed run reads that
    file instead. Greedy only (validation has no temperature). Computed references are batched ones
    (`default_ref_batch` > 1), cut at their first disagreement like the frozen file's: a resumed run replays
    the same tokens as the fresh one."""
    if cfg.references:
        return read_validation_references(cfg.references, cfg, target, warn)
    saved = run_dir / REFERENCES_FILE
    if saved.is_file():
        return read_validation_references(saved, cfg, target, warn)
    from flashdraft.eval.prompts import load_eval_prompts
    from flashdraft.eval.references import ReferenceSettings, compute_references, default_ref_batch

    try:
        prompts = load_eval_prompts(cfg.dataset, target, cfg.limit)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"eval.dataset: {e}") from None
    settings = ReferenceSettings(cfg.max_new_tokens)
    rs = compute_references(
        target, prompts, settings, progress=progress, batch_size=default_ref_batch(target.device)
    )  # fmt: skip
    if not _other_rank():  # one writer; every rank computed the same references
        write_frozen(saved, rs.references, target, settings)
    return rs.references


def _other_rank() -> bool:
    """A torchrun rank other than 0."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_rank() != 0


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

    def due(self, step: int, total_steps: int, stopping: bool = False) -> bool:
        """Every eval.every steps, at the schedule's last step, and at a step the run stops at (its time limit)."""
        return self.cfg.every > 0 and (stopping or step % self.cfg.every == 0 or step == total_steps)

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
        chains = [float(s["tau"]["chain"]) for s in report.per_sample if "chain" in s["tau"]]
        self.last = ValidationResult(
            report.methods["chain"].tau, trees[best], best, topk[0] if topk else None,
            report.slot_accuracy[0], time.perf_counter() - t0, standard_error(chains),
        )  # fmt: skip
        return self.last


def build_validation(
    cfg: EvalConfig, target: Any, drafter: torch.nn.Module, run_dir: str | Path, *, heads: Any | None = None,
    progress: bool = True,
) -> Validation:  # fmt: skip
    """References and their teacher-forced passes, once. `target`: the full target (any device); `heads`: its
    embedding and head on the drafter's device when the target runs elsewhere (FrozenHeads)."""
    warn = None if _other_rank() else (lambda line: print(line, file=sys.stderr))
    refs = compute_validation_references(cfg, target, Path(run_dir), progress, warn)
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
