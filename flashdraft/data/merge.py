"""`flashdraft data merge`: one training set from several regenerated with the same target and template.

Regeneration is the expensive part of the data, and it arrives in pieces: a GPU call that answered
every conversation's first turn, a later one that answered the first two turns of some of them,
another machine's run on a second source. Merging keeps every distinct sample once:

    flashdraft data merge --out data/all data/turn1 data/turns2

- the inputs must agree on what makes samples comparable: dataset format, target, chat template
  fingerprint (template, stop ids, thinking) and the train/eval split (salt, eval fraction), so a
  conversation held out in one input is held out in the merge;
- a sample id present in several inputs is kept once, the longest version (the earlier input's on a
  tie). The manifest counts why the others went: `merge_identical`, `merge_superseded_by_longer` (the
  same conversation answered for fewer turns: a strict prefix) and `merge_divergent` (the answers
  differ — bf16 regenerations in different batches can split at a near-tie; both are the target's);
- `write_dataset` then dedups, re-splits (by the same hash, so nothing moves) and re-checks
  contamination, and writes the merge atomically with a manifest that lists its inputs.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from flashdraft.data.dataset import SPLITS, DatasetError, Sample, open_dataset, write_dataset
from flashdraft.data.template import rendering_key


def _same(manifests: list[tuple[Path, dict[str, Any]]], what: str, get: Any) -> Any:
    """The value `get(manifest)` shared by every input, or a DatasetError naming the first that differs."""
    (p0, m0), *rest = manifests
    want = get(m0)
    for p, m in rest:
        got = get(m)
        if got != want:
            raise DatasetError(
                f"{p}/manifest.json: {what} {got!r} differs from {p0}'s {want!r}: cannot merge"
            )
    return want


def _extends(long: Sample, short: Sample) -> bool:
    """True when `short` is a strict prefix of `long` (token ids and loss mask)."""
    n = len(short.input_ids)
    return (
        len(long.input_ids) > n
        and np.array_equal(long.input_ids[:n], short.input_ids)
        and np.array_equal(long.loss_mask[:n], short.loss_mask)
    )


def _why_dropped(kept: Sample, dropped: Sample) -> str:
    if _extends(kept, dropped):
        return "merge_superseded_by_longer"
    if np.array_equal(kept.input_ids, dropped.input_ids) and np.array_equal(
        kept.loss_mask, dropped.loss_mask
    ):
        return "merge_identical"
    return "merge_divergent"


def merge_datasets(
    inputs: list[str | Path],
    out: str | Path,
    *,
    contamination_sources: list[str] | tuple[str, ...] = ("humaneval",),
    overwrite: bool = False,
    command: str | None = None,
) -> dict[str, Any]:
    """Merge the datasets at `inputs` into `out` (see the module docstring); returns the new manifest."""
    if len(inputs) < 2:
        raise DatasetError("merge needs at least two input datasets")
    paths = [Path(p) for p in inputs]
    if len(set(p.resolve() for p in paths)) < len(paths):
        raise DatasetError("the same input dataset is named twice")
    manifests = [(p, open_dataset(p, "train").manifest) for p in paths]
    target = _same(manifests, "target", lambda m: m.get("target"))
    _same(manifests, "template", lambda m: rendering_key(m.get("template")))
    template = manifests[0][1].get("template")
    fraction = _same(manifests, "split eval_fraction", lambda m: m.get("split", {}).get("eval_fraction"))
    salt = _same(manifests, "split salt", lambda m: m.get("split", {}).get("salt"))
    if fraction is None or salt is None:
        raise DatasetError(f"{paths[0]}/manifest.json: no split.eval_fraction / split.salt: cannot merge")

    kept: dict[str, tuple[Sample, Path]] = {}  # sample id → (the version kept, its input)
    drops: Counter[str] = Counter()
    for p in paths:
        for split in SPLITS:
            for s in open_dataset(p, split):
                if s.id not in kept:
                    kept[s.id] = (s, p)
                    continue
                old, _ = kept[s.id]
                if len(s.input_ids) > len(old.input_ids):
                    kept[s.id] = (s, p)
                    old, s = s, old  # `old` is the one kept, `s` the one dropped
                drops[_why_dropped(old, s)] += 1
    extra = {
        "target": target,
        "template": template,
        "merged_from": [
            {
                "path": str(p),
                "created": m.get("created"),
                "counts": m.get("counts"),
                "command": m.get("command"),
            }
            for p, m in manifests
        ],
        **({"command": command} if command else {}),
    }
    return write_dataset(
        (s for s, _ in kept.values()), out, manifest_extra=extra, eval_fraction=float(fraction), split_salt=str(salt),
        contamination_sources=list(contamination_sources), dropped=dict(drops), overwrite=overwrite,
    )  # fmt: skip


def describe(manifest: dict[str, Any]) -> str:
    """One line for the CLI: counts, loss tokens, what was dropped."""
    c, t = manifest["counts"], manifest["tokens"]
    return (
        f"{c['train']} train / {c['eval']} eval samples, {t['train']['loss']:,} train loss tokens; "
        f"dropped {json.dumps(manifest.get('dropped', {}))}"
    )
