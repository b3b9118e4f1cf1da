"""`flashdraft data merge`: every sample once, the longest version kept, splits unchanged, bad inputs refused."""

from __future__ import annotations

import numpy as np
import pytest
from typer.testing import CliRunner

from flashdraft.cli import app
from flashdraft.data.dataset import DatasetError, Sample, open_dataset, write_dataset
from flashdraft.data.merge import merge_datasets

TEMPLATE = {"chat_template_sha256": "abc", "stop_ids": [2], "enable_thinking": None}


def _sample(i: int, ids: np.ndarray, loss_from: int = 4) -> Sample:
    mask = np.zeros(len(ids), bool)
    mask[loss_from:] = True
    return Sample(f"s{i}", ids.astype(np.int32), mask, {"conversation_id": f"c{i}"})


def _ids(i: int, n: int = 24) -> np.ndarray:
    return np.random.default_rng(i).integers(3, 1000, n)


def _write(path, samples, *, template=TEMPLATE, eval_fraction=0.3, target="tiny"):
    write_dataset(samples, path, eval_fraction=eval_fraction, contamination_sources=(),
                  manifest_extra={"target": target, "template": template})  # fmt: skip
    return path


def _all(path) -> dict[str, tuple[Sample, str]]:
    return {s.id: (s, split) for split in ("train", "eval") for s in open_dataset(path, split)}


def test_merge_keeps_each_sample_once_longest_wins(tmp_path):
    a = [_sample(i, _ids(i)) for i in range(10)]
    b = [
        _sample(5, np.concatenate([_ids(5), _ids(105, 8)])),  # extends a's s5 (a second turn)
        _sample(6, np.concatenate([_ids(6), _ids(106, 3)])),  # extends a's s6
        _sample(7, _ids(7)),  # identical to a's s7
        _sample(8, np.concatenate([_ids(8)[:10], _ids(208, 14)])),  # same length, diverges: a's s8 stays
        _sample(9, np.concatenate([_ids(9)[:10], _ids(209, 20)])),  # diverges and is longer: b's s9 wins
        *[_sample(i, _ids(i)) for i in range(10, 15)],
    ]
    pa, pb = _write(tmp_path / "a", a), _write(tmp_path / "b", b)
    m = merge_datasets([pa, pb], tmp_path / "m", contamination_sources=())
    got = _all(tmp_path / "m")
    assert sorted(got) == sorted(f"s{i}" for i in range(15))
    want = (
        {s.id: s for s in a} | {s.id: s for s in b if s.id in ("s5", "s6", "s9")} | {s.id: s for s in b[5:]}
    )
    for sid, (s, split) in got.items():
        np.testing.assert_array_equal(s.input_ids, want[sid].input_ids)
        np.testing.assert_array_equal(s.loss_mask, want[sid].loss_mask)
        src = _all(tmp_path / "a").get(sid) or _all(tmp_path / "b")[sid]
        assert split == src[1], f"{sid} moved from {src[1]} to {split}"
    assert m["dropped"] == {"merge_divergent": 2, "merge_identical": 1, "merge_superseded_by_longer": 2}
    assert m["target"] == "tiny" and m["template"] == TEMPLATE
    assert [x["path"] for x in m["merged_from"]] == [str(pa), str(pb)]
    assert m["counts"]["train"] + m["counts"]["eval"] == 15


def test_merge_takes_stop_ids_in_any_order(tmp_path):
    # two hosts list the same stop ids in different orders: the same rendering, so they merge
    two = dict(TEMPLATE, stop_ids=[1, 2])
    pa = _write(tmp_path / "a", [_sample(0, _ids(0))], template=two)
    pb = _write(tmp_path / "b", [_sample(1, _ids(1))], template=dict(two, stop_ids=[2, 1]))
    m = merge_datasets([pa, pb], tmp_path / "m", contamination_sources=())
    assert m["template"] == two and len(_all(tmp_path / "m")) == 2


@pytest.mark.parametrize(
    ("kwargs", "what"),
    [
        ({"template": dict(TEMPLATE, stop_ids=[2, 7])}, "template"),
        ({"eval_fraction": 0.1}, "eval_fraction"),
        ({"target": "other"}, "target"),
    ],
)
def test_merge_refuses_incomparable_inputs(tmp_path, kwargs, what):
    pa = _write(tmp_path / "a", [_sample(0, _ids(0))])
    pb = _write(tmp_path / "b", [_sample(1, _ids(1))], **kwargs)
    with pytest.raises(DatasetError, match=rf"b/manifest.json: .*{what}"):
        merge_datasets([pa, pb], tmp_path / "m", contamination_sources=())
    assert not (tmp_path / "m").exists()


def test_merge_cli_writes_then_refuses_to_overwrite(tmp_path):
    pa = _write(tmp_path / "a", [_sample(i, _ids(i)) for i in range(4)])
    pb = _write(tmp_path / "b", [_sample(i, _ids(i)) for i in range(2, 6)])
    runner = CliRunner()
    args = ["data", "merge", str(pa), str(pb), "--out", str(tmp_path / "m"), "--contamination", "none"]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "merge_identical" in r.output
    assert len(_all(tmp_path / "m")) == 6
    r = runner.invoke(app, args)
    assert r.exit_code == 2 and "already exists" in r.output
    r = runner.invoke(app, ["data", "merge", str(pa), str(tmp_path / "nope"), "--out", str(tmp_path / "n")])
    assert r.exit_code == 2 and "no manifest" in r.output
