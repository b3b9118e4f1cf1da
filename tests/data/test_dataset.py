"""Dataset on disk: round trip, split determinism, dedup, truncation, contamination, atomic writes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from flashdraft.data.dataset import (
    DatasetError,
    Sample,
    open_dataset,
    split_of,
    truncate_sample,
    write_dataset,
)


def _sample(
    i: int, n: int = 40, loss_from: int = 10, prompt: str | None = None, conv: str | None = None
) -> Sample:
    rng = np.random.default_rng(i)
    ids = rng.integers(0, 1000, n).astype(np.int32)
    mask = np.zeros(n, bool)
    mask[loss_from:] = True
    meta = {"conversation_id": conv or f"c{i}"}
    if prompt is not None:
        meta["prompt"] = [{"role": "user", "content": prompt}]
    return Sample(f"s{i}", ids, mask, meta)


def test_round_trip_and_lengths(tmp_path):
    samples = [_sample(i, n=20 + i) for i in range(30)]
    m = write_dataset(
        samples,
        tmp_path / "ds",
        eval_fraction=0.2,
        contamination_sources=(),
        shard_size=7,
        manifest_extra={"target": "tiny"},
    )
    assert m["counts"]["train"] + m["counts"]["eval"] == 30
    assert m["target"] == "tiny"
    by_id = {s.id: s for s in samples}
    for split in ("train", "eval"):
        ds = open_dataset(tmp_path / "ds", split)
        assert len(ds) == m["counts"][split]
        assert ds.lengths.tolist() == [len(ds[i].input_ids) for i in range(len(ds))]
        assert int(ds.lengths.sum()) == m["tokens"][split]["total"]
        for s in ds:
            ref = by_id[s.id]
            np.testing.assert_array_equal(s.input_ids, ref.input_ids)
            np.testing.assert_array_equal(s.loss_mask, ref.loss_mask)
            assert s.meta == ref.meta
    assert json.loads((tmp_path / "ds" / "manifest.json").read_text())["format"] == "flashdraft-dataset/1"


def test_split_is_deterministic_and_order_independent(tmp_path):
    samples = [_sample(i) for i in range(200)]
    a = write_dataset(
        samples, tmp_path / "a", eval_fraction=0.1, contamination_sources=(), check_eval_split_overlap=False
    )
    write_dataset(
        samples[::-1][:150],
        tmp_path / "b",
        eval_fraction=0.1,
        contamination_sources=(),
        check_eval_split_overlap=False,
    )
    ev_a = {s.id for s in open_dataset(tmp_path / "a", "eval")}
    ev_b = {s.id for s in open_dataset(tmp_path / "b", "eval")}
    assert 5 <= a["counts"]["eval"] <= 40  # ~10% of 200
    assert ev_b == {i for i in ev_a if int(i[1:]) >= 50}  # same rule, regardless of order and subset
    assert split_of("x", 0.0) == "train" and split_of("x", 1.0) == "eval"
    # all samples of one conversation land on the same side
    many = [_sample(i, conv=f"conv{i % 5}") for i in range(40)]
    write_dataset(
        many, tmp_path / "c", eval_fraction=0.5, contamination_sources=(), check_eval_split_overlap=False
    )
    for split in ("train", "eval"):
        convs = {s.conversation_id for s in open_dataset(tmp_path / "c", split)}
        assert all(split_of(c, 0.5) == split for c in convs)


def test_dedup_counts(tmp_path):
    base = [_sample(i) for i in range(10)]
    dups = [
        Sample(f"d{i}", base[i].input_ids.copy(), base[i].loss_mask.copy(), {"conversation_id": f"x{i}"})
        for i in range(4)
    ]
    m = write_dataset(base + dups, tmp_path / "ds", eval_fraction=0.0, contamination_sources=())
    assert m["counts"]["train"] == 10
    assert m["dropped"]["duplicate"] == 4


def test_truncation_never_leaves_few_loss_tokens(tmp_path):
    s = _sample(0, n=100, loss_from=60)
    t = truncate_sample(s, 80, 16)
    assert t is not None and len(t.input_ids) == 80 and int(t.loss_mask.sum()) == 20 and t.meta["truncated"]
    assert truncate_sample(s, 70, 16) is None  # 10 loss tokens left < 2·B with B = 8
    assert truncate_sample(s, 200, 16) is s
    m = write_dataset(
        [s, _sample(1, n=100, loss_from=20)],
        tmp_path / "ds",
        eval_fraction=0.0,
        max_length=70,
        min_loss_tokens=16,
        contamination_sources=(),
    )
    assert m["counts"]["train"] == 1 and m["dropped"]["too_few_loss_tokens"] == 1
    assert open_dataset(tmp_path / "ds").lengths.tolist() == [70]


def test_contamination_humaneval_and_eval_split(tmp_path):
    from flashdraft.data.sources import load_conversations

    he = load_conversations("humaneval", limit=1)[0].turns[0].content
    clean = [
        _sample(i, prompt=f"tell me a story about a dragon number {i} in a castle far away")
        for i in range(40)
    ]
    leak = _sample(100, prompt="please solve this:\n" + he)
    m = write_dataset(clean + [leak], tmp_path / "ds", eval_fraction=0.0)
    assert m["dropped"].get("contaminated_humaneval") == 1
    assert "s100" not in {s.id for s in open_dataset(tmp_path / "ds")}
    # a train prompt copying a held-out prompt's 13-gram is dropped
    texts = [
        f"unique words alpha{i} beta{i} gamma{i} delta{i} eps{i} zeta{i} eta{i} theta{i} iota{i} kappa{i} "
        f"lambda{i} mu{i} nu{i} xi{i}"
        for i in range(60)
    ]
    samples = [_sample(i, prompt=t) for i, t in enumerate(texts)]
    ev = [s for s in samples if split_of(s.conversation_id, 0.3) == "eval"]
    assert ev
    copy = _sample(999, prompt="see: " + prompt_of(ev[0]))
    assert split_of(copy.conversation_id, 0.3) == "train"
    m = write_dataset(samples + [copy], tmp_path / "ds2", eval_fraction=0.3, contamination_sources=())
    assert m["dropped"] == {"contaminated_eval_split": 1}
    assert m["counts"]["train"] + m["counts"]["eval"] == 60


def prompt_of(s: Sample) -> str:
    return s.meta["prompt"][0]["content"]


def test_atomic_write_and_refuse_overwrite(tmp_path):
    out = tmp_path / "ds"
    write_dataset([_sample(0)], out, eval_fraction=0.0, contamination_sources=())
    with pytest.raises(DatasetError, match="already exists"):
        write_dataset([_sample(1)], out, eval_fraction=0.0, contamination_sources=())
    assert [s.id for s in open_dataset(out)] == ["s0"]

    def boom():
        yield _sample(2)
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        write_dataset(boom(), out, eval_fraction=0.0, contamination_sources=(), overwrite=True)
    assert [s.id for s in open_dataset(out)] == ["s0"]  # the old dataset is untouched
    write_dataset([_sample(3)], out, eval_fraction=0.0, contamination_sources=(), overwrite=True)
    assert [s.id for s in open_dataset(out)] == ["s3"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]  # no temp folders left behind


def test_split_key_keeps_conversation_parts_together(tmp_path):
    # ShareGPT cut long chats into parts "<id>_<k>": parts share meta["split_key"] and land on one side
    parts = [
        Sample(f"g{g}_{k}", np.arange(100 * g + k, 100 * g + k + 20, dtype=np.int32), np.ones(20, bool),
               {"conversation_id": f"g{g}_{k}", "split_key": f"g{g}"})
        for g in range(30) for k in range(3)
    ]  # fmt: skip
    write_dataset(
        parts, tmp_path / "ds", eval_fraction=0.3, contamination_sources=(), check_eval_split_overlap=False
    )
    ev = {s.id.split("_")[0] for s in open_dataset(tmp_path / "ds", "eval")}
    tr = {s.id.split("_")[0] for s in open_dataset(tmp_path / "ds", "train")}
    assert ev and tr and not ev & tr
    assert ev == {f"g{g}" for g in range(30) if split_of(f"g{g}", 0.3) == "eval"}


def test_shuffled_reads_decode_each_shard_once_within_the_cache_budget(tmp_path, monkeypatch):
    """Training reads samples in a shuffled order: every shard decoded once while they fit the cache's byte budget
    (a cache of a fixed 4 shards re-decoded a shard for nearly every sample of a 5-shard dataset); past the budget
    the least recently used shard goes, and the samples read stay right."""
    from flashdraft.data import dataset as dataset_mod

    samples = [_sample(i, n=30) for i in range(60)]
    write_dataset(samples, tmp_path / "ds", eval_fraction=0.0, contamination_sources=(), shard_size=6)
    decoded: list[str] = []
    real = dataset_mod._read_shard_table

    def counting(f, columns=None):  # noqa: ANN001, ANN202
        if columns is None:
            decoded.append(f.name)
        return real(f, columns)

    monkeypatch.setattr(dataset_mod, "_read_shard_table", counting)
    ds = open_dataset(tmp_path / "ds")
    assert len(ds.files) == 10
    order = np.random.default_rng(0).permutation(len(ds))
    by_id = {s.id: s for s in samples}
    for i in order:
        np.testing.assert_array_equal(ds[int(i)].input_ids, by_id[ds[int(i)].id].input_ids)
    assert sorted(decoded) == sorted(f.name for f in ds.files)  # once each
    decoded.clear()
    small = open_dataset(tmp_path / "ds")
    small.cache_bytes = 1  # room for the shard in use only
    for i in order[:20]:
        s = small[int(i)]
        np.testing.assert_array_equal(s.input_ids, by_id[s.id].input_ids)
    assert len(small._cache) == 1 and len(decoded) > len(set(decoded))
