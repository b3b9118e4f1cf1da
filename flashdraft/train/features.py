"""Offline features: dump the target's raw selected-layer features to disk, and read them back.

    flashdraft features dump --target default --dataset data/sharegpt --out features/sharegpt --layers 1,8,14,20,27
    flashdraft train cfg.yaml pipeline.mode=offline pipeline.features_dir=features/sharegpt

What is stored is the raw concatenation `[S, k·H]` of the selected layers' outputs per sample
(not the fused features: `fc` and its norm are trained). SmolLM2 with 5 layers in bf16 is
5 × 576 × 2 bytes ≈ 5.8 KB per token, which is why online is the default.

Layout (every file written to a temp name and renamed: a file that exists is complete):

    OUT/manifest.json                target, layer ids, width, dtype, packing, shards (written first)
    OUT/shard-00000.safetensors      features [T, k·H] (the shard's samples back to back),
                                     offsets [n+1] int64, sample_index [n] int64 (dataset index)

Samples are packed exactly as training packs them (dataset order, `max_length`,
`token_budget`, `pad_multiple`), so an unshuffled offline run with the same packing gets
features bit-identical to the online path. With another packing or a shuffled order a document
sits at another place in another row, and the target sums its attention in a different order:
the features then agree to float rounding (~1e-6 relative in float32), not bit for bit.
A dump is resumable: shards whose file exists are skipped.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import shutil
import sys
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flashdraft.train.batch import FeatureBatch, compute_features, pack_rows, plan_micro_batches
from flashdraft.train.source import InProcessSource

FORMAT = "flashdraft-features/1"
MANIFEST = "manifest.json"
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class FeaturesError(ValueError):
    pass


def lengths_digest(lengths: Sequence[int]) -> str:
    """Identifies the dataset split a dump belongs to (sample count and every length)."""
    return hashlib.sha256(np.asarray(lengths, dtype=np.int64).tobytes()).hexdigest()[:16]


@dataclass
class ShardSpec:
    file: str
    micro_batches: list[int]  # [first, end) indices into the dump's packing plan
    samples: list[int]  # [first, end) dataset indices covered (zero-length samples have no rows)
    tokens: int


@dataclass
class DumpPlan:
    layer_ids: list[int]
    hidden_size: int
    dtype: str
    max_length: int
    token_budget: int
    pad_multiple: int
    num_samples: int
    lengths_digest: str
    tokens: int
    shards: list[ShardSpec]

    @property
    def width(self) -> int:
        return len(self.layer_ids) * self.hidden_size

    @property
    def bytes_per_token(self) -> int:
        return self.width * _DTYPES[self.dtype].itemsize

    @property
    def total_bytes(self) -> int:
        return self.tokens * self.bytes_per_token

    def estimate_line(self) -> str:
        return (
            f"{self.tokens:,} tokens × {len(self.layer_ids)} layers × {self.hidden_size} × "
            f"{_DTYPES[self.dtype].itemsize} bytes = {_human(self.total_bytes)} "
            f"({self.bytes_per_token / 1000:.1f} KB per token) in {len(self.shards)} shard(s)"
        )


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def plan_dump(
    lengths: Sequence[int], *, layer_ids: list[int], hidden_size: int, dtype: str = "bfloat16",
    max_length: int = 3072, token_budget: int = 16384, pad_multiple: int = 1, shard_bytes: int = 1 << 30,
) -> DumpPlan:  # fmt: skip
    """Which micro-batches go into which shard (a pure function of the lengths and settings)."""
    if dtype not in _DTYPES:
        raise FeaturesError(f"features dtype {dtype!r}: use one of {sorted(_DTYPES)}")
    plans = plan_micro_batches(lengths, max_length, token_budget)
    per_token = len(layer_ids) * hidden_size * _DTYPES[dtype].itemsize
    shards: list[ShardSpec] = []
    start, tokens = 0, 0
    total = 0
    for m, plan in enumerate(plans):
        tokens += sum(min(int(lengths[i]), max_length) for i in plan.flat())
        last = m == len(plans) - 1
        if tokens * per_token >= shard_bytes or last:
            first_sample = plans[start].flat()[0]
            end_sample = plan.flat()[-1] + 1 if not last else len(lengths)
            shards.append(
                ShardSpec(
                    f"shard-{len(shards):05d}.safetensors", [start, m + 1], [first_sample, end_sample], tokens
                )
            )
            total += tokens
            start, tokens = m + 1, 0
    return DumpPlan(
        list(layer_ids), int(hidden_size), dtype, max_length, token_budget, pad_multiple,
        len(lengths), lengths_digest(lengths), total, shards,
    )  # fmt: skip


def _manifest(plan: DumpPlan, meta: dict[str, Any]) -> dict[str, Any]:
    d = asdict(plan)
    return {"format": FORMAT, **meta, **d, "width": plan.width, "bytes": plan.total_bytes}


_MUST_MATCH = ("layer_ids", "hidden_size", "dtype", "max_length", "token_budget", "pad_multiple",
               "num_samples", "lengths_digest", "target")  # fmt: skip


@dataclass
class DumpResult:
    out: Path
    written: int  # shards written by this call
    skipped: int  # shards already on disk (resume)
    bytes: int  # bytes of feature data in the whole dump


@torch.no_grad()
def dump_features(
    target: Any,  # TargetModel
    samples: Sequence[Any],  # dataset samples (id, input_ids, loss_mask), indexable
    plan: DumpPlan,
    out: str | os.PathLike[str],
    *,
    meta: dict[str, Any] | None = None,  # provenance: target name, dataset path, split
    progress: bool = True,
) -> DumpResult:
    """Write every shard of `plan` that is not on disk yet (see the module docstring)."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    manifest = _manifest(plan, meta or {})
    mf = out / MANIFEST
    if mf.is_file():
        old = json.loads(mf.read_text())
        for k in _MUST_MATCH:
            if old.get(k) != manifest.get(k):
                raise FeaturesError(
                    f"{mf}: this folder was dumped with {k}={old.get(k)!r}, now {manifest.get(k)!r}: "
                    "use another --out folder, or delete this one to start over"
                )
    _write_json(mf, manifest)
    dtype = _DTYPES[plan.dtype]
    lengths = [
        int(n) for n in getattr(samples, "lengths", [len(samples[i].input_ids) for i in range(len(samples))])
    ]
    if len(lengths) != plan.num_samples or lengths_digest(lengths) != plan.lengths_digest:
        raise FeaturesError(
            "the dataset's sample lengths differ from the plan's: plan and dump the same split"
        )
    micro_plans = plan_micro_batches(lengths, plan.max_length, plan.token_budget)
    todo = [s for s in plan.shards if not (out / s.file).is_file()]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(
            total=sum(s.tokens for s in todo), desc="features", unit="tok", unit_scale=True, file=sys.stderr
        )
    for spec in todo:
        feats: list[torch.Tensor] = []
        index: list[int] = []
        for m in range(*spec.micro_batches):
            rows = [[samples[i] for i in row] for row in micro_plans[m].rows]
            tokens = pack_rows(rows, plan.max_length, plan.pad_multiple)
            fb = compute_features(target, tokens, plan.layer_ids)
            f = fb.features.to(device="cpu", dtype=dtype)  # [R, S, k·H]
            for r, row in enumerate(micro_plans[m].rows):
                at = 0
                for i in row:
                    n = min(lengths[i], plan.max_length)
                    feats.append(f[r, at : at + n])  # [n, k·H]
                    index.append(i)
                    at += n
        offsets = np.concatenate([[0], np.cumsum([len(x) for x in feats])]).astype(np.int64)
        tensors = {
            "features": torch.cat(feats).contiguous(),  # [T, k·H]
            "offsets": torch.from_numpy(offsets),  # [n+1]
            "sample_index": torch.tensor(index, dtype=torch.int64),  # [n]
        }
        tmp = out / f".{spec.file}.tmp"
        save_file(tensors, str(tmp), metadata={"format": FORMAT})
        tmp.replace(out / spec.file)
        if bar is not None:
            bar.update(spec.tokens)
    if bar is not None:
        bar.close()
    return DumpResult(out, len(todo), len(plan.shards) - len(todo), plan.total_bytes)


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    tmp.replace(path)


def check_disk(out: str | os.PathLike[str], needed: int) -> None:
    probe = Path(out)
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if needed > free:
        raise FeaturesError(
            f"the dump needs {_human(needed)}, {probe} has {_human(free)} free: free space or use online mode"
        )


# ----------------------------------------------------------------------------- reading


class FeatureStore:
    """Random access to a dump: `store.get(dataset_index)` → [n, k·H] (CPU, the stored dtype)."""

    def __init__(self, path: str | os.PathLike[str], max_open: int = 8) -> None:
        self.path = Path(path)
        mf = self.path / MANIFEST
        if not mf.is_file():
            raise FeaturesError(
                f"{mf}: not found; write a dump with `flashdraft features dump --out {self.path}`"
            )
        self.manifest: dict[str, Any] = json.loads(mf.read_text())
        if self.manifest.get("format") != FORMAT:
            raise FeaturesError(f"{mf}: format {self.manifest.get('format')!r} is not {FORMAT!r}")
        self.shards = [ShardSpec(**s) for s in self.manifest["shards"]]
        missing = [s.file for s in self.shards if not (self.path / s.file).is_file()]
        if missing:
            raise FeaturesError(
                f"{self.path}: {len(missing)} of {len(self.shards)} shards missing (first {missing[0]}): "
                "the dump did not finish; run the same `flashdraft features dump` again to complete it"
            )
        self._starts = [s.samples[0] for s in self.shards]
        self._open: OrderedDict[int, tuple[Any, np.ndarray, np.ndarray]] = OrderedDict()
        self.max_open = max_open

    @property
    def layer_ids(self) -> list[int]:
        return list(self.manifest["layer_ids"])

    @property
    def width(self) -> int:
        return int(self.manifest["width"])

    @property
    def max_length(self) -> int:
        return int(self.manifest["max_length"])

    def _shard(self, k: int) -> tuple[Any, np.ndarray, np.ndarray]:
        from safetensors import safe_open

        if k in self._open:
            self._open.move_to_end(k)
            return self._open[k]
        if len(self._open) >= self.max_open:
            self._open.popitem(last=False)
        f = safe_open(str(self.path / self.shards[k].file), framework="pt")  # memory-mapped
        entry = (f, f.get_tensor("offsets").numpy(), f.get_tensor("sample_index").numpy())
        self._open[k] = entry
        return entry

    def get(self, index: int) -> torch.Tensor:
        """[n, k·H] the sample's features."""
        f, lo, hi = self._locate(index)
        return f.get_slice("features")[lo:hi]

    def _locate(self, index: int) -> tuple[Any, int, int]:
        k = bisect.bisect_right(self._starts, index) - 1
        if k < 0 or index >= self.shards[k].samples[1]:
            raise FeaturesError(
                f"{self.path}: sample {index} is not in the dump ({self.manifest['num_samples']} samples)"
            )
        f, offsets, sample_index = self._shard(k)
        j = int(np.searchsorted(sample_index, index))
        if j >= len(sample_index) or sample_index[j] != index:
            raise FeaturesError(f"{self.path}: sample {index} has no features (an empty sample?)")
        return f, int(offsets[j]), int(offsets[j + 1])


class OfflineSource(InProcessSource):
    """InProcessSource whose features come from a FeatureStore instead of a target pass.

    Same plan, order and state as the online source, so resume and data parallelism work alike.
    Padding positions hold zeros (online: whatever the target computes there; never attended).
    """

    def __init__(self, samples: Sequence[Any], store: FeatureStore, layer_ids: list[int], **kw: Any) -> None:
        super().__init__(samples, None, layer_ids, **kw)
        if list(layer_ids) != store.layer_ids:
            raise FeaturesError(
                f"{store.path} holds target layers {store.layer_ids}, the drafter reads {list(layer_ids)}: "
                f"set model.target_layer_ids={store.layer_ids} or dump again with --layers "
                + ",".join(map(str, layer_ids))
            )
        if self.max_length > store.max_length:
            raise FeaturesError(
                f"data.max_length {self.max_length} > the dump's max_length {store.max_length}: "
                f"set data.max_length={store.max_length} or dump again with --max-length {self.max_length}"
            )
        if int(store.manifest["num_samples"]) != len(self.lengths) or store.manifest["lengths_digest"] != lengths_digest(self.lengths):  # fmt: skip
            raise FeaturesError(f"{store.path} was dumped from another dataset/split (sample lengths differ)")
        self.store = store

    def features(self, rows: list[list[int]]) -> FeatureBatch:
        t0 = time.perf_counter()
        docs = [[self.samples[i] for i in row] for row in rows]
        tb = pack_rows(docs, self.max_length, self.pad_multiple)
        t1 = time.perf_counter()
        r, s = tb.input_ids.shape
        out = torch.zeros(r, s, self.store.width, dtype=_DTYPES[self.store.manifest["dtype"]])  # [R, S, k·H]
        for ri, row in enumerate(rows):
            at = 0
            for i in row:
                n = min(int(self.lengths[i]), self.max_length)
                out[ri, at : at + n] = self.store.get(i)[:n]
                at += n
        self.last_host_s = {"pack": t1 - t0, "read": time.perf_counter() - t1}
        return FeatureBatch(tb.input_ids, out, tb.loss_mask, tb.position_ids, tb.doc_ids, tb.sample_ids)
