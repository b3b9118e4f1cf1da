"""data.greedy_labels: every document position labelled with the target's greedy next token (DESIGN.md §2).

The rule (flashdraft.train.blocks): slot k of the block at anchor a is trained on g[a+k−1], the target's greedy
choice after x[a+k−1], and only while x[a+j] = g[a+j−1] for 1 ≤ j < k. On the target's own greedy answers that
is exactly the response-token rule; on the prompt it adds positions whose labels are still the target's.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from flashdraft.config import load_config
from flashdraft.train.batch import compute_features, pack_rows
from flashdraft.train.blocks import IGNORE, Anchors, AnchorSampler, build_blocks
from flashdraft.train.config import TrainConfig
from flashdraft.train.features import FeaturesError, FeatureStore, OfflineSource, dump_features, plan_dump
from flashdraft.train.launch import train
from flashdraft.train.metrics import read_metrics
from flashdraft.train.source import InProcessSource
from tests.conftest import tiny_target
from tests.train.helpers import fake_features, make_docs

MASK = 96
B = 4


def _all_anchors(batch) -> Anchors:  # type: ignore[no-untyped-def]
    """Every position of row 0 as an anchor (document 0 starts at 0)."""
    s = batch.input_ids.shape[1]
    pos = torch.arange(s - 1)[None]
    return Anchors(pos, torch.zeros_like(pos), torch.ones_like(pos, dtype=torch.bool))


def test_on_greedy_answers_the_labels_are_the_response_tokens():
    """A document that is the target's greedy answer: g[p] = x[p+1] everywhere. The greedy rule then labels the
    response exactly as the token rule does, and adds the prompt's positions with the same tokens."""
    doc = make_docs([30], seed=3, prompt_frac=0.4)[0]
    fb = fake_features(pack_rows([[doc]], 32))
    g = torch.roll(fb.input_ids, -1, dims=1)  # g[p] = x[p+1] (the last one never becomes a label)
    gb = dataclasses.replace(fb, greedy=g)
    anchors = _all_anchors(fb)
    tokens = build_blocks(fb, anchors, B, MASK).labels.view(-1, B)
    greedy = build_blocks(gb, anchors, B, MASK).labels.view(-1, B)
    labelled = tokens != IGNORE
    assert labelled.sum() > 20 and torch.equal(greedy[labelled], tokens[labelled])
    prompt_len = int((~torch.as_tensor(doc.loss_mask)).sum())
    assert (greedy[: prompt_len - 1, 1:] != IGNORE).all()  # prompt anchors: every slot inside the document
    for a in range(prompt_len - 1):  # the token rule labels only the slots that stand for response tokens
        assert all((tokens[a, k] != IGNORE) == (a + k >= prompt_len) for k in range(1, B))
    x = fb.input_ids[0]
    for a in range(prompt_len - 1):
        assert greedy[a, 1:].tolist() == x[a + 1 : a + B].tolist()


def test_a_slot_is_labelled_only_while_the_text_follows_the_greedy_path():
    doc = make_docs([24], seed=5, prompt_frac=0.0)[0]
    fb = fake_features(pack_rows([[doc]], 24))
    x = fb.input_ids[0]
    g = torch.roll(fb.input_ids, -1, dims=1).clone()
    g[0, 10] = (x[11] + 1) % 90 + 3  # after x[10] the target would say something else than the text's x[11]
    labels = build_blocks(dataclasses.replace(fb, greedy=g), _all_anchors(fb), B, MASK).labels.view(-1, B)
    # anchor 10: slot 1 is the target's choice g[10] (not the text's x[11]); the chain is off the text after it
    assert labels[10].tolist() == [IGNORE, int(g[0, 10]), IGNORE, IGNORE]
    # anchor 9: slot 1 = x[10] (on the path), slot 2 = g[10], slot 3 needs x[11] = g[10]: no
    assert labels[9].tolist() == [IGNORE, int(x[10]), int(g[0, 10]), IGNORE]
    # anchor 8: slots 1-2 on the path, slot 3 = g[10]
    assert labels[8].tolist() == [IGNORE, int(x[9]), int(x[10]), int(g[0, 10])]
    assert labels[11].tolist() == [IGNORE, *x[12:15].tolist()]  # past the divergence: on the path again


def test_greedy_labels_anchor_anywhere_in_a_document_but_never_across_documents():
    docs = make_docs([12, 9], seed=2, prompt_frac=0.5)
    fb = fake_features(pack_rows([docs], 24))
    gb = dataclasses.replace(fb, greedy=torch.roll(fb.input_ids, -1, dims=1))
    anchors = AnchorSampler(seed=0).sample(gb, max_anchors=100)
    got = anchors.positions[anchors.valid].tolist()
    assert got == [*range(0, 11), *range(12, 20)]  # every position with a next one in its own document
    labels = build_blocks(gb, anchors, B, MASK)
    assert not (labels.labels.view(-1, B)[10, 2:] != IGNORE).any()  # anchor 10: slot 1 is doc 0's last token


def test_compute_features_greedy_is_the_argmax_of_the_target_logits(family):
    t = tiny_target(family, dtype=torch.float64)
    docs = make_docs([20, 13, 17], vocab=t.vocab_size, seed=4)
    tb = pack_rows([[docs[0], docs[1]], [docs[2]]], 40)
    plain = compute_features(t, tb, [1, 3])
    fb = compute_features(t, tb, [1, 3], greedy=True)
    assert plain.greedy is None and fb.greedy is not None and fb.greedy.device.type == "cpu"
    assert torch.equal(plain.features, fb.features)  # the same features, whatever else the pass computes
    for ri, row in enumerate([[docs[0], docs[1]], [docs[2]]]):
        at = 0
        for d in row:
            ids = torch.as_tensor(d.input_ids, dtype=torch.long)[None]
            want = t.model(input_ids=ids).logits[0].argmax(-1)  # the document run alone
            assert torch.equal(fb.greedy[ri, at : at + len(d.input_ids)], want)
            at += len(d.input_ids)


PACK = dict(max_length=48, token_budget=96, pad_multiple=8)
LAYERS = [1, 3]


@pytest.fixture(scope="module")
def dumped(tmp_path_factory):  # noqa: ANN201
    from flashdraft.data.dataset import Sample, open_dataset, write_dataset

    root = tmp_path_factory.mktemp("greedy")
    t = tiny_target("llama", dtype=torch.float32)
    docs = make_docs([40, 30, 20, 45, 25, 33, 38], vocab=t.vocab_size, seed=9)
    write_dataset(
        [Sample(d.id, d.input_ids, d.loss_mask) for d in docs], root / "data",
        eval_fraction=0.0, contamination_sources=(), check_eval_split_overlap=False,
    )  # fmt: skip
    ds = open_dataset(root / "data", "train")
    for greedy in (False, True):
        plan = plan_dump(list(ds.lengths), layer_ids=LAYERS, hidden_size=t.hidden_size, dtype="float32",
                         shard_bytes=8_000, greedy=greedy, **PACK)  # fmt: skip
        dump_features(t, ds, plan, root / f"feats-{greedy}", meta={"target": "tiny"}, progress=False)
    return t, ds, root


def test_offline_greedy_tokens_equal_online(dumped):
    t, ds, root = dumped
    kw = dict(epochs=1, seed=0, shuffle=False, lengths=list(ds.lengths), greedy=True, **PACK)
    online = list(InProcessSource(ds, t, LAYERS, **kw))
    offline = list(OfflineSource(ds, FeatureStore(root / "feats-True"), LAYERS, **kw))
    assert len(online) == len(offline) > 2
    for a, b in zip(online, offline, strict=True):
        real = a.doc_ids >= 0
        assert a.greedy is not None and b.greedy is not None
        assert torch.equal(a.greedy[real], b.greedy[real]) and torch.equal(a.features[real], b.features[real])
    with pytest.raises(FeaturesError, match="--greedy"):
        OfflineSource(ds, FeatureStore(root / "feats-False"), LAYERS, **kw)
    assert np.array_equal(
        FeatureStore(root / "feats-True").get(2).numpy(), FeatureStore(root / "feats-False").get(2).numpy()
    )


def test_training_with_greedy_labels_online_equals_offline_and_adds_the_prompt(dumped, tmp_path):
    t, _ds, root = dumped
    runs = {}
    for name, mode, greedy in (
        ("online", "online", True),
        ("offline", "offline", True),
        ("tokens", "online", False),
    ):
        cfg = load_config(
            TrainConfig, None,
            [f"run_dir={tmp_path / name}", f"data.dataset={root / 'data'}", "model.num_layers=1",
             "model.block_size=4", "loss.gamma=4", f"model.target_layer_ids=[{','.join(map(str, LAYERS))}]",
             "data.max_length=48", "data.token_budget=96", "data.pad_multiple=8", "data.max_anchors=64",
             "data.shuffle=false", "telemetry.log_every=1", "telemetry.tensorboard=false",
             "telemetry.progress=false", "runtime.dtype=float32", "optim.max_steps=3", "optim.lr=3e-3",
             f"pipeline.mode={mode}", f"pipeline.features_dir={root / 'feats-True'}",
             f"data.greedy_labels={str(greedy).lower()}"],
        )  # fmt: skip
        train(cfg, target=t)
        runs[name] = read_metrics(tmp_path / name)
    loss = {k: [m["loss"] for m in v] for k, v in runs.items()}
    assert len(loss["online"]) == 3 and loss["online"] == loss["offline"] and loss["online"] != loss["tokens"]
    anchors = {k: round(v[0]["anchors_per_s"] * v[0]["step_time_s"]) for k, v in runs.items()}
    assert anchors["online"] > anchors["tokens"] > 0  # the prompts' positions are anchors too


def test_a_dump_from_before_greedy_existed_resumes_and_a_greedy_one_is_refused(dumped):
    import json

    t, ds, root = dumped
    mf = root / "feats-False" / "manifest.json"
    old = json.loads(mf.read_text())
    old.pop("greedy")  # what dumps written before `--greedy` existed hold
    mf.write_text(json.dumps(old))
    plan = plan_dump(list(ds.lengths), layer_ids=LAYERS, hidden_size=t.hidden_size, dtype="float32",
                     shard_bytes=8_000, **PACK)  # fmt: skip
    res = dump_features(t, ds, plan, root / "feats-False", meta={"target": "tiny"}, progress=False)
    assert res.written == 0 and res.skipped == len(plan.shards)
    with pytest.raises(FeaturesError, match="greedy=False, now True"):
        dump_features(t, ds, dataclasses.replace(plan, greedy=True), root / "feats-False", meta={"target": "tiny"},
                      progress=False)  # fmt: skip
