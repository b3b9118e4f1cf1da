"""The training dataset on disk: Parquet shards of token ids + loss masks + provenance, and a manifest.

Written by `flashdraft data regenerate` (see regenerate.py); read by training and eval:

    ds = open_dataset("data/sharegpt-smollm2", split="train")
    len(ds), ds.lengths, ds.manifest["target"]
    s = ds[0]                      # Sample(id, input_ids [S] int32, loss_mask [S] bool, meta)

Layout of a dataset folder (written to a temp folder, then renamed: never half-written):

    DIR/manifest.json              format, target, template, counts, token totals, dropped counts and why
    DIR/train/part-00000.parquet   one row per sample
    DIR/eval/part-00000.parquet    the held-out split (same columns)

Columns of every shard:

    id               string       unique sample id ("<conversation id>" or "<conversation id>#t<turn>")
    conversation_id  string       the source conversation; the train/eval split is a hash of it
    input_ids        list<int32>  the exact token ids the target saw and generated (never re-tokenized)
    loss_mask        list<bool>   True on tokens the target generated (stop token included)
    num_tokens       int32        len(input_ids), for length-sorted packing without reading the ids
    num_loss_tokens  int32        loss_mask.sum()
    meta             string       JSON provenance: source, prompt messages, finish reasons, ...

Shards are read through a memory map (`pyarrow.memory_map`), one shard at a time, on first use.
The split is deterministic: a sample goes to eval iff blake2b(split_salt + split_key) / 2^64 <
eval_fraction, where split_key = meta["split_key"] (the ShareGPT parts "X_0", "X_1" of one chat share
"X") or else the conversation id; so all samples of a conversation land on the same side and the split never depends on
the order or number of samples. Exact duplicates (same input_ids) are removed, and training samples
whose prompt shares a word n-gram with an evaluation set (HumanEval, the held-out split) are dropped;
every drop is counted by reason in the manifest.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "flashdraft-dataset/1"
SPLITS = ("train", "eval")
DEFAULT_SPLIT_SALT = "flashdraft-split-v1"


class DatasetError(ValueError):
    pass


@dataclass
class Sample:
    id: str
    input_ids: np.ndarray  # [S] int32 or int64: exact token ids
    loss_mask: np.ndarray  # [S] bool: True on tokens the target generated
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def conversation_id(self) -> str:
        return str(self.meta.get("conversation_id", self.id))

    @property
    def split_key(self) -> str:
        """What the train/eval split hashes: the conversation group (ShareGPT parts of one chat) or id."""
        return str(self.meta.get("split_key", self.conversation_id))

    def __post_init__(self) -> None:
        self.input_ids = np.asarray(self.input_ids)
        self.loss_mask = np.asarray(self.loss_mask, dtype=bool)
        if self.input_ids.ndim != 1 or self.input_ids.shape != self.loss_mask.shape:
            raise DatasetError(
                f"sample {self.id!r}: input_ids {self.input_ids.shape} and loss_mask {self.loss_mask.shape} "
                "must be 1-D and of equal length"
            )


def loss_runs(mask: Any) -> list[tuple[int, int]]:
    """[start, end) of each run of True in a loss mask: one per answered turn, in order."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], np.asarray(mask, np.int8), [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True))


# --------------------------------------------------------------------------------------------- reading


@dataclass
class _Shard:
    ids: np.ndarray  # [T] int32, all samples' tokens back to back
    mask: np.ndarray  # [T] bool
    offsets: np.ndarray  # [n+1] int64
    sample_ids: list[str]
    metas: list[str]
    nbytes: int = field(init=False)  # the decoded shard's size: its arrays and strings

    def __post_init__(self) -> None:
        strings = sum(len(x) for x in self.sample_ids) + sum(len(x or "") for x in self.metas)
        self.nbytes = self.ids.nbytes + self.mask.nbytes + self.offsets.nbytes + strings


# decoded shards a Dataset keeps (`Dataset.cache_bytes`): a 10,000-sample shard of long chat samples decodes to
# tens of MB, so this holds every shard of the datasets training reads
SHARD_CACHE_BYTES = 4 << 30


def _read_shard_table(f: Path, columns: list[str] | None = None) -> Any:
    """A shard's table; a truncated or corrupt shard is a DatasetError that names it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not f.is_file():
        raise DatasetError(f"{f}: shard missing (listed in the manifest): write the dataset again")
    try:
        with pa.memory_map(str(f), "r") as src:
            return pq.read_table(src, columns=columns)
    except pa.ArrowException as e:
        raise DatasetError(
            f"{f}: unreadable shard, truncated or corrupt ({e}): write the dataset again"
        ) from None


class Dataset:
    """One split of a dataset folder; random access by index, shards loaded on first use."""

    def __init__(self, path: str | Path, split: str = "train") -> None:
        self.path = Path(path)
        self.split = split
        mf = self.path / "manifest.json"
        if not mf.is_file():
            raise DatasetError(
                f"{mf}: no manifest; is {self.path} a dataset written by `flashdraft data regenerate`?"
            )
        try:
            self.manifest: dict[str, Any] = json.loads(mf.read_bytes())
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
            raise DatasetError(f"{mf}: not a JSON manifest ({e}): write the dataset again") from None
        if self.manifest.get("format") != FORMAT:
            raise DatasetError(f"{mf}: format {self.manifest.get('format')!r} is not {FORMAT!r}")
        if split not in SPLITS:
            raise DatasetError(f"unknown split {split!r}: use one of {list(SPLITS)}")
        self.files = [self.path / f for f in self.manifest["shards"][split]]
        counts = []
        lengths = []
        for f in self.files:
            t = _read_shard_table(f, columns=["num_tokens"])
            counts.append(t.num_rows)
            lengths.append(t.column("num_tokens").to_numpy())
        self._starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)  # [n_shards+1]
        self.lengths: np.ndarray = (np.concatenate(lengths) if lengths else np.zeros(0)).astype(
            np.int64
        )  # [N]
        self._cache: dict[int, _Shard] = {}  # decoded shards, least recently used first
        self.cache_bytes = SHARD_CACHE_BYTES

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _shard(self, k: int) -> _Shard:
        if k in self._cache:
            self._cache[k] = self._cache.pop(k)  # most recently used last
        else:
            t = _read_shard_table(self.files[k])
            ids_col = t.column("input_ids").combine_chunks()
            mask_col = t.column("loss_mask").combine_chunks()
            self._cache[k] = _Shard(
                ids=ids_col.values.to_numpy(zero_copy_only=False),
                mask=mask_col.values.to_numpy(zero_copy_only=False).astype(bool),
                offsets=ids_col.offsets.to_numpy(),
                sample_ids=t.column("id").to_pylist(),
                metas=t.column("meta").to_pylist(),
            )
            # bounded memory: the least recently used shards go once the decoded ones pass the budget. A budget,
            # not a count: training reads samples in a shuffled order, so a dataset whose shards do not all fit
            # decodes a shard (tens of ms) for nearly every sample (a count of 4 starved a 5-shard run's trainer)
            while len(self._cache) > 1 and sum(sh.nbytes for sh in self._cache.values()) > self.cache_bytes:
                self._cache.pop(next(iter(self._cache)))
        return self._cache[k]

    def __getitem__(self, i: int) -> Sample:
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {i} out of range for {n} samples")
        k = int(np.searchsorted(self._starts, i, side="right") - 1)
        sh = self._shard(k)
        r = i - int(self._starts[k])
        a, b = int(sh.offsets[r]), int(sh.offsets[r + 1])
        return Sample(
            sh.sample_ids[r], sh.ids[a:b].copy(), sh.mask[a:b].copy(), json.loads(sh.metas[r] or "{}")
        )

    def __iter__(self) -> Iterator[Sample]:
        for i in range(len(self)):
            yield self[i]


def open_dataset(path: str | Path, split: str = "train") -> Dataset:
    return Dataset(path, split)


# --------------------------------------------------------------------------------------------- filters


def split_of(conversation_id: str, eval_fraction: float, salt: str = DEFAULT_SPLIT_SALT) -> str:
    """ "eval" or "train", from a hash of the conversation id only (order- and size-independent)."""
    h = hashlib.blake2b((salt + conversation_id).encode(), digest_size=8).digest()
    return "eval" if int.from_bytes(h, "big") / 2**64 < eval_fraction else "train"


def _content_key(s: Sample) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(np.ascontiguousarray(s.input_ids, dtype=np.int64).tobytes())
    h.update(np.packbits(s.loss_mask).tobytes())
    return h.digest()


_WORD = re.compile(r"\w+")


def word_ngrams(text: str, n: int) -> set[int]:
    """Hashed word n-grams of lower-cased text (punctuation and whitespace ignored)."""
    words = _WORD.findall(text.lower())
    return {hash(" ".join(words[i : i + n])) for i in range(len(words) - n + 1)}


def source_ngrams(spec: str, n: int) -> set[int]:
    """The hashed word n-grams of every turn of a prompt source (an evaluation set to keep out of training)."""
    from flashdraft.data.sources import load_conversations

    grams: set[int] = set()
    for conv in load_conversations(spec):
        for turn in conv.turns:
            grams |= word_ngrams(turn.content, n)
    return grams


def prompt_text(s: Sample) -> str | None:
    """The user/system text of a sample (from meta["prompt"]), used for contamination checks."""
    msgs = s.meta.get("prompt")
    if not msgs:
        return None
    return "\n".join(m.get("content", "") for m in msgs if m.get("role") in ("user", "system"))


def truncate_sample(s: Sample, max_length: int, min_loss_tokens: int) -> Sample | None:
    """Cut to `max_length` tokens; None when fewer than `min_loss_tokens` loss tokens would remain."""
    if len(s.input_ids) > max_length:
        s = Sample(s.id, s.input_ids[:max_length], s.loss_mask[:max_length], dict(s.meta, truncated=True))
    if int(s.loss_mask.sum()) < min_loss_tokens:
        return None
    return s


# --------------------------------------------------------------------------------------------- writing


def _write_parquet(samples: list[Sample], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    offsets = np.zeros(len(samples) + 1, dtype=np.int32)
    offsets[1:] = np.cumsum([len(s.input_ids) for s in samples])
    flat_ids = (
        np.concatenate([s.input_ids for s in samples]).astype(np.int32) if samples else np.zeros(0, np.int32)
    )
    flat_mask = np.concatenate([s.loss_mask for s in samples]) if samples else np.zeros(0, bool)
    table = pa.table({
        "id": pa.array([s.id for s in samples], pa.string()),
        "conversation_id": pa.array([s.conversation_id for s in samples], pa.string()),
        "input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat_ids, pa.int32())),
        "loss_mask": pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat_mask, pa.bool_())),
        "num_tokens": pa.array([len(s.input_ids) for s in samples], pa.int32()),
        "num_loss_tokens": pa.array([int(s.loss_mask.sum()) for s in samples], pa.int32()),
        "meta": pa.array([json.dumps(s.meta, ensure_ascii=False) for s in samples], pa.string()),
    })  # fmt: skip
    pq.write_table(table, path, compression="zstd", row_group_size=1024)


def _replace_dir(tmp: Path, out: Path, overwrite: bool) -> None:
    """Move the finished temp folder into place; the old folder (if allowed) is removed only after."""
    if out.exists():
        if not overwrite:
            shutil.rmtree(tmp)
            raise DatasetError(
                f"{out} already exists: pass overwrite=True (--overwrite) or choose another --out"
            )
        trash = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, trash)
        os.replace(tmp, out)
        shutil.rmtree(trash)
    else:
        os.replace(tmp, out)


def write_dataset(
    samples: Iterable[Sample],
    out_dir: str | Path,
    *,
    manifest_extra: dict[str, Any] | None = None,
    eval_fraction: float = 0.02,
    split_salt: str = DEFAULT_SPLIT_SALT,
    max_length: int | None = None,
    min_loss_tokens: int = 1,
    contamination_sources: Iterable[str] = ("humaneval",),
    contamination_ngram: int = 13,
    check_eval_split_overlap: bool = True,
    dropped: dict[str, int] | None = None,
    shard_size: int = 10_000,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Dedup, truncate, split, filter contamination, then write shards + manifest atomically.

    `dropped` carries counts from earlier stages (bad input records, ...) into the manifest.
    `min_loss_tokens` should be 2·B for training data (a sample with fewer cannot hold two blocks).
    All samples are held in memory (fine for ~10^6 samples of a few K tokens on a big host).
    Returns the manifest.
    """
    out = Path(out_dir)
    drops: Counter[str] = Counter(dropped or {})
    seen: set[bytes] = set()
    kept: dict[str, list[Sample]] = {"train": [], "eval": []}
    ids_seen: set[str] = set()
    for s in samples:
        if s.id in ids_seen:
            raise DatasetError(f"duplicate sample id {s.id!r}: sample ids must be unique")
        ids_seen.add(s.id)
        if max_length is not None:
            t = truncate_sample(s, max_length, min_loss_tokens)
            if t is None:
                drops["too_few_loss_tokens"] += 1
                continue
            s = t
        elif int(s.loss_mask.sum()) < min_loss_tokens:
            drops["too_few_loss_tokens"] += 1
            continue
        key = _content_key(s)
        if key in seen:
            drops["duplicate"] += 1
            continue
        seen.add(key)
        kept[split_of(s.split_key, eval_fraction, split_salt)].append(s)

    # contamination: training prompts sharing a word n-gram with an evaluation set are dropped
    refs: dict[str, set[int]] = {}
    for name in contamination_sources or []:
        refs[name] = source_ngrams(name, contamination_ngram)
    if check_eval_split_overlap:
        grams = set()
        for s in kept["eval"]:
            grams |= word_ngrams(prompt_text(s) or "", contamination_ngram)
        refs["eval_split"] = grams
    unchecked = 0
    if refs:
        clean = []
        for s in kept["train"]:
            text = prompt_text(s)
            if text is None:
                unchecked += 1  # no prompt text in meta: kept, and counted in the manifest
                clean.append(s)
                continue
            g = word_ngrams(text, contamination_ngram)
            hit = next((name for name, ref in refs.items() if g & ref), None)
            if hit is None:
                clean.append(s)
            else:
                drops[f"contaminated_{hit}"] += 1
        kept["train"] = clean

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    shards: dict[str, list[str]] = {}
    tokens: dict[str, dict[str, int]] = {}
    for split in SPLITS:
        (tmp / split).mkdir(parents=True)
        rows = kept[split]
        shards[split] = []
        for k in range(0, max(len(rows), 1), shard_size):
            rel = f"{split}/part-{k // shard_size:05d}.parquet"
            _write_parquet(rows[k : k + shard_size], tmp / rel)
            shards[split].append(rel)
        tokens[split] = {
            "total": int(sum(len(s.input_ids) for s in rows)),
            "loss": int(sum(int(s.loss_mask.sum()) for s in rows)),
        }
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **(manifest_extra or {}),
        "counts": {split: len(kept[split]) for split in SPLITS},
        "tokens": tokens,
        "dropped": {k: v for k, v in sorted(drops.items()) if v},
        "split": {
            "eval_fraction": eval_fraction,
            "salt": split_salt,
            "key": "blake2b(salt + split_key)",
        },
        "filters": {
            "max_length": max_length,
            "min_loss_tokens": min_loss_tokens,
            "dedup": "exact input_ids + loss_mask",
            "contamination": {
                "sources": list(refs),
                "word_ngram": contamination_ngram,
                "unchecked": unchecked,
            },
        },
        "shards": shards,
    }
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")
    _replace_dir(tmp, out, overwrite)
    return manifest
