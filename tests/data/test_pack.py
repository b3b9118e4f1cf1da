"""A dataset packed into one file and unpacked: the same samples, shards and manifest; damaged packs refused."""

from __future__ import annotations

import lzma

import numpy as np
import pytest

from flashdraft.data.dataset import DatasetError, Sample, open_dataset, write_dataset
from flashdraft.data.pack import pack_dataset, unpack_dataset


def _dataset(path, vocab: int = 1000, n: int = 30):
    """Multi-turn-like samples: two loss runs each (a looping answer repeats its first 8 ids), unicode meta."""
    rng = np.random.default_rng(0)
    samples = []
    for i in range(n):
        loop = rng.integers(0, vocab, 8)
        ids = np.concatenate([rng.integers(0, vocab, 12), np.tile(loop, 4), rng.integers(0, vocab, 6), loop])
        mask = np.zeros(len(ids), bool)
        mask[12:44] = mask[50:] = True
        meta = {"conversation_id": f"c{i}", "prompt": [{"role": "user", "content": f"Übersetze {i} — ✓"}],
                "finish": ["length", "stop"], "turns": [0, 2]}  # fmt: skip
        samples.append(Sample(f"c{i}", ids.astype(np.int32), mask, meta))
    return write_dataset(samples, path, eval_fraction=0.2, contamination_sources=(), shard_size=7)


def _rows(path):
    return {
        split: [(s.id, s.input_ids.tolist(), s.loss_mask.tolist(), s.meta) for s in open_dataset(path, split)]
        for split in ("train", "eval")
    }


@pytest.mark.parametrize("vocab", [1000, 70_000])  # ids that fit uint16, and ids that need uint32
def test_pack_then_unpack_gives_the_same_dataset(tmp_path, vocab):
    m = _dataset(tmp_path / "ds", vocab)
    assert len(m["shards"]["train"]) > 1 and m["counts"]["eval"] > 0
    stats = pack_dataset(tmp_path / "ds", tmp_path / "ds.fdpack")
    assert stats["samples"] == 30 and stats["tokens"] == 30 * 58
    unpack_dataset(tmp_path / "ds.fdpack", tmp_path / "back")
    assert (tmp_path / "back" / "manifest.json").read_bytes() == (
        tmp_path / "ds" / "manifest.json"
    ).read_bytes()
    assert _rows(tmp_path / "back") == _rows(tmp_path / "ds")
    assert sorted(p.name for p in (tmp_path / "back" / "train").iterdir()) == sorted(
        p.name for p in (tmp_path / "ds" / "train").iterdir()
    )


def test_pack_is_smaller_than_the_parquet_shards_on_looping_answers(tmp_path):
    _dataset(tmp_path / "ds", n=200)
    stats = pack_dataset(tmp_path / "ds", tmp_path / "ds.fdpack")
    parquet = sum(p.stat().st_size for p in (tmp_path / "ds").rglob("*.parquet"))
    assert stats["bytes"] == (tmp_path / "ds.fdpack").stat().st_size < parquet / 2


def test_existing_outputs_are_kept_without_overwrite(tmp_path):
    _dataset(tmp_path / "ds")
    pack_dataset(tmp_path / "ds", tmp_path / "ds.fdpack")
    with pytest.raises(DatasetError, match="already exists"):
        pack_dataset(tmp_path / "ds", tmp_path / "ds.fdpack")
    with pytest.raises(DatasetError, match="already exists"):
        unpack_dataset(tmp_path / "ds.fdpack", tmp_path / "ds")
    pack_dataset(tmp_path / "ds", tmp_path / "ds.fdpack", overwrite=True)
    unpack_dataset(tmp_path / "ds.fdpack", tmp_path / "ds", overwrite=True)
    assert open_dataset(tmp_path / "ds").manifest["counts"]["train"] > 0


def test_damaged_packs_are_one_line_errors_and_write_nothing(tmp_path):
    _dataset(tmp_path / "ds")
    pack_dataset(tmp_path / "ds", tmp_path / "ds.fdpack")
    payload = lzma.decompress((tmp_path / "ds.fdpack").read_bytes())
    # one sample's meta made bad JSON (an extra quote), the header's length adjusted
    bad_meta = payload.replace(b'{\\"conversation_id', b'{\\"conversation_id\\"', 1)
    assert bad_meta != payload and len(bad_meta) == len(payload) + 2
    size = int.from_bytes(payload[18:26], "little") + 2
    bad_meta = bad_meta[:18] + size.to_bytes(8, "little") + bad_meta[26:]
    cases = {
        "not-xz": (b"hello", "not an xz-compressed pack"),
        "other-magic": (lzma.compress(b"PK" + payload[2:]), "not a flashdraft pack"),
        "short": (lzma.compress(payload[:-10]), "damaged pack"),
        "bad-meta": (lzma.compress(bad_meta), "damaged pack"),
    }
    for name, (data, msg) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(DatasetError, match=msg):
            unpack_dataset(tmp_path / name, tmp_path / f"out-{name}")
        assert not (tmp_path / f"out-{name}").exists() and not list(tmp_path.glob(f".out-{name}*"))
    with pytest.raises(DatasetError, match="no such pack file"):
        unpack_dataset(tmp_path / "missing.fdpack", tmp_path / "out")


def test_pack_and_unpack_through_the_cli(tmp_path):
    from typer.testing import CliRunner

    from flashdraft.cli import app

    _dataset(tmp_path / "ds")
    runner = CliRunner()
    r = runner.invoke(app, ["data", "pack", str(tmp_path / "ds"), "--out", str(tmp_path / "ds.fdpack")])
    assert r.exit_code == 0 and "30 samples, 1,740 tokens" in r.output
    r = runner.invoke(app, ["data", "unpack", str(tmp_path / "ds.fdpack"), "--out", str(tmp_path / "back")])
    assert r.exit_code == 0 and _rows(tmp_path / "back") == _rows(tmp_path / "ds")
    r = runner.invoke(app, ["data", "unpack", str(tmp_path / "ds.fdpack"), "--out", str(tmp_path / "back")])
    assert r.exit_code == 2 and "already exists" in r.output and "Traceback" not in r.output
