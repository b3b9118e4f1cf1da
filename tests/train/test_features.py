"""Offline features: size estimate, dump → read back bit-identical to the online path, resume, CLI."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from flashdraft.config import load_config
from flashdraft.train.config import TrainConfig
from flashdraft.train.features import FeaturesError, FeatureStore, OfflineSource, dump_features, plan_dump
from flashdraft.train.launch import train
from flashdraft.train.metrics import read_metrics
from flashdraft.train.source import InProcessSource
from tests.conftest import tiny_target
from tests.train.helpers import make_docs

LAYERS = [1, 3, 4]
PACK = dict(max_length=48, token_budget=96, pad_multiple=8)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):  # noqa: ANN201
    from flashdraft.data.dataset import Sample, open_dataset, write_dataset

    root = tmp_path_factory.mktemp("feat")
    t = tiny_target("llama", dtype=torch.float32)
    docs = make_docs([40, 30, 20, 45, 25, 33, 38, 27, 60, 22, 31], seed=7)  # 60 > max_length: truncated
    write_dataset(
        [Sample(d.id, d.input_ids, d.loss_mask) for d in docs], root / "data",
        eval_fraction=0.0, contamination_sources=(), check_eval_split_overlap=False,
    )  # fmt: skip
    ds = open_dataset(root / "data", "train")
    plan = plan_dump(list(ds.lengths), layer_ids=LAYERS, hidden_size=t.hidden_size, dtype="float32",
                     shard_bytes=20_000, **PACK)  # fmt: skip
    res = dump_features(t, ds, plan, root / "feats", meta={"target": "tiny"}, progress=False)
    return t, ds, plan, res, root


def test_size_estimate_smollm2_is_5_8_kb_per_token():
    plan = plan_dump([1000, 2000], layer_ids=[1, 8, 14, 20, 27], hidden_size=576, dtype="bfloat16")
    assert plan.bytes_per_token == 5 * 576 * 2 == 5760
    assert plan.total_bytes == 3000 * 5760
    assert "5.8 KB per token" in plan.estimate_line() and "17.3 MB" in plan.estimate_line()


def test_offline_batches_equal_online_batches_bit_for_bit(setup):
    t, ds, plan, res, root = setup
    assert res.written == len(plan.shards) > 1 and res.skipped == 0
    kw = dict(epochs=1, seed=0, shuffle=False, lengths=list(ds.lengths), **PACK)
    online = list(InProcessSource(ds, t, LAYERS, **kw))
    offline = list(OfflineSource(ds, FeatureStore(root / "feats"), LAYERS, **kw))
    assert len(online) == len(offline) > 2
    for a, b in zip(online, offline, strict=True):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        assert torch.equal(a.position_ids, b.position_ids) and torch.equal(a.doc_ids, b.doc_ids)
        real = a.doc_ids >= 0  # padding features: the target's output online, zeros offline (never attended)
        assert a.features.dtype == b.features.dtype == torch.float32
        assert torch.equal(a.features[real], b.features[real])
        assert (b.features[~real] == 0).all()


def test_shuffled_offline_batches_match_online_to_float_rounding(setup):
    t, ds, _plan, _res, root = setup
    kw = dict(epochs=1, seed=3, shuffle=True, lengths=list(ds.lengths), **PACK)
    for a, b in zip(
        InProcessSource(ds, t, LAYERS, **kw), OfflineSource(ds, FeatureStore(root / "feats"), LAYERS, **kw),
        strict=True,
    ):  # fmt: skip
        real = a.doc_ids >= 0
        torch.testing.assert_close(a.features[real], b.features[real], rtol=1e-5, atol=1e-5)


def test_dump_resumes_and_refuses_other_settings(setup):
    t, ds, plan, _res, root = setup
    before = (root / "feats" / plan.shards[0].file).read_bytes()
    (root / "feats" / plan.shards[1].file).unlink()
    with pytest.raises(FeaturesError, match="shards missing"):
        FeatureStore(root / "feats")
    res = dump_features(t, ds, plan, root / "feats", meta={"target": "tiny"}, progress=False)
    assert (res.written, res.skipped) == (1, len(plan.shards) - 1)
    assert (root / "feats" / plan.shards[0].file).read_bytes() == before
    other = plan_dump(list(ds.lengths), layer_ids=[1, 2], hidden_size=t.hidden_size, dtype="float32", **PACK)
    with pytest.raises(FeaturesError, match="layer_ids"):
        dump_features(t, ds, other, root / "feats", meta={"target": "tiny"}, progress=False)
    with pytest.raises(FeaturesError, match="target layers"):
        OfflineSource(ds, FeatureStore(root / "feats"), [1, 2], epochs=1, **PACK)
    with pytest.raises(FeaturesError, match="data.max_length"):
        OfflineSource(ds, FeatureStore(root / "feats"), LAYERS, epochs=1, max_length=64, token_budget=96)


def test_a_dump_written_with_the_removed_greedy_option_still_resumes_and_reads(setup, tmp_path):
    """`features dump --greedy` (removed) wrote "greedy": true in the manifest and a greedy tensor per shard; the
    features are the same, so such a dump resumes without the option and trains as any other."""
    import json
    import shutil

    t, ds, plan, _res, root = setup
    old = tmp_path / "feats"
    shutil.copytree(root / "feats", old)
    mf = json.loads((old / "manifest.json").read_text())
    (old / "manifest.json").write_text(json.dumps({**mf, "greedy": True}))
    (old / plan.shards[-1].file).unlink()
    res = dump_features(t, ds, plan, old, meta={"target": "tiny"}, progress=False)
    assert (res.written, res.skipped) == (1, len(plan.shards) - 1)
    kw = dict(epochs=1, seed=0, shuffle=False, lengths=list(ds.lengths), **PACK)
    for a, b in zip(
        OfflineSource(ds, FeatureStore(root / "feats"), LAYERS, **kw), OfflineSource(ds, FeatureStore(old), LAYERS, **kw),
        strict=True,
    ):  # fmt: skip
        assert torch.equal(a.features, b.features)


def test_training_losses_identical_online_and_offline(setup, tmp_path):
    t, _ds, _plan, _res, root = setup
    losses = {}
    for mode in ("online", "offline"):
        cfg = load_config(
            TrainConfig, None,
            [f"run_dir={tmp_path / mode}", f"data.dataset={root / 'data'}", "model.num_layers=1",
             "model.block_size=8", f"model.target_layer_ids=[{','.join(map(str, LAYERS))}]",
             "data.max_length=48", "data.token_budget=96", "data.pad_multiple=8", "data.max_anchors=6",
             "data.shuffle=false", "telemetry.log_every=1", "telemetry.tensorboard=false",
             "telemetry.progress=false", "runtime.dtype=float32", "optim.max_steps=4", "optim.lr=3e-3",
             f"pipeline.mode={mode}", f"pipeline.features_dir={root / 'feats'}"],
        )  # fmt: skip
        train(cfg, target=t)
        losses[mode] = [m["loss"] for m in read_metrics(tmp_path / mode)]
    assert len(losses["online"]) == 4 and losses["online"] == losses["offline"]


def test_cli_prints_the_estimate_first_and_asks_for_large_dumps(setup, tmp_path):
    from flashdraft.cli import app

    t, _ds, _plan, _res, root = setup
    t.model.save_pretrained(tmp_path / "target")
    args = ["features", "dump", "--target", str(tmp_path / "target"), "--dataset", str(root / "data"),
            "--out", str(tmp_path / "out"), "--layers", "1,3,4", "--max-length", "48", "--token-budget", "96",
            "--pad-multiple", "8", "--device", "cpu", "--dtype", "bfloat16"]  # fmt: skip
    r = CliRunner().invoke(app, [*args, "--confirm-gb", "0"])
    assert r.exit_code == 2, r.output
    assert "tokens × 3 layers × 32 × 2 bytes" in r.output and "--yes" in r.output
    assert not list((tmp_path / "out").glob("shard-*")) if (tmp_path / "out").exists() else True
    r = CliRunner().invoke(app, [*args, "--confirm-gb", "0", "--yes"])
    assert r.exit_code == 0, r.output
    store = FeatureStore(tmp_path / "out")
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["dtype"] == "bfloat16"
    assert store.get(0).dtype == torch.bfloat16 and store.get(0).shape == (40, 3 * 32)
