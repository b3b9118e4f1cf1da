"""The native packed feature pass (runtime.feature_pass=native) against transformers' pass, on tiny random targets."""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from flashdraft.config import ConfigError, load_config
from flashdraft.train import target_pass as tp
from flashdraft.train.batch import TokenBatch, compute_features, pack_rows
from flashdraft.train.config import TrainConfig
from flashdraft.train.launch import train
from flashdraft.train.metrics import read_metrics
from flashdraft.train.source import InProcessSource
from flashdraft.train.target_pass import PackedTargetPass
from flashdraft.train.trainer import config_hash
from tests.conftest import tiny_target
from tests.train.helpers import make_docs

# eager flex_attention on CPU warns that it is unfused (it is exact; the test runs it for its values)
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

LAYER_LISTS = [
    [1, 3],
    [5, 0, 2],
    [5],
]  # 6-layer targets: listed order kept, the last layer (final-normed) included


def packed_rows() -> TokenBatch:
    """Three rows: three documents, two, and one short row (padding at its end and in the others' tails)."""
    docs = make_docs([20, 13, 31, 7, 25, 9], seed=0)
    return pack_rows([[docs[0], docs[1], docs[2]], [docs[3], docs[4]], [docs[5]]], 80, pad_multiple=16)


@pytest.mark.parametrize("attention", ["dense", "flex"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_native_features_equal_transformers_in_float64(family, attention):
    t = tiny_target(family)
    tb = packed_rows()
    assert (tb.doc_ids == -1).any() and len(tb.sample_ids) == 6
    native = PackedTargetPass(t, attention=attention)
    for layers in LAYER_LISTS:
        ref = compute_features(t, tb, layers).features
        got = compute_features(t, tb, layers, native).features
        assert got.shape == ref.shape == (3, 64, 32 * len(layers))
        assert (got - ref).abs().max().item() <= 1e-10, (layers, attention)


def test_documents_do_not_see_each_other_and_positions_restart():
    """The packed features of a document are those of the document alone (no leak across documents)."""
    t = tiny_target("llama")
    tb = packed_rows()
    native = PackedTargetPass(t, attention="dense")
    packed = compute_features(t, tb, [2, 5], native).features
    docs = make_docs([20, 13, 31, 7, 25, 9], seed=0)
    solo = compute_features(
        t, pack_rows([[docs[1]]], 80), [2, 5], native
    ).features  # doc 1 at 20..33 of row 0
    assert (packed[0, 20:33] - solo[0]).abs().max().item() <= 1e-10


def test_only_the_layers_up_to_the_deepest_requested_one_run(monkeypatch):
    t = tiny_target("llama")
    tb = packed_rows()
    calls: list[str] = []
    for i, layer in enumerate(t.layers):  # every layer's MLP runs once per forward
        layer.mlp.down_proj.register_forward_pre_hook(lambda *_, i=i: calls.append(f"layer{i}"))
    real_norm = tp.rms_norm

    def spy(norm, x):  # noqa: ANN001, ANN202
        if norm is t.final_norm:
            calls.append("final norm")
        return real_norm(norm, x)

    monkeypatch.setattr(tp, "rms_norm", spy)
    native = PackedTargetPass(t, attention="dense")
    native(tb.input_ids, tb.position_ids, tb.doc_ids, [3, 1])
    assert calls == ["layer0", "layer1", "layer2", "layer3"]  # no later layer, no final norm
    calls.clear()
    native(tb.input_ids, tb.position_ids, tb.doc_ids, [5])
    assert calls == [f"layer{i}" for i in range(6)] + ["final norm"]
    with pytest.raises(ValueError, match="target layer id 6 does not exist"):
        native(tb.input_ids, tb.position_ids, tb.doc_ids, [6])


@pytest.mark.parametrize("attention", ["dense", "flex"])
def test_the_compiled_forward_is_one_graph_and_pads_to_its_shape(attention, monkeypatch):
    """compile_shape: the whole forward traces as one graph (fullgraph: a graph break would raise), and
    batches of other shapes, padded to it, reuse that graph; the features are still transformers'.
    torch.compile runs with the eager backend here (the tracing is what a CPU can check; inductor runs on CUDA)."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    torch._dynamo.reset()
    t = tiny_target("qwen3")
    docs = make_docs([30, 17], seed=1)
    native = PackedTargetPass(t, attention=attention, compile_shape=(4, 96))
    with torch._dynamo.config.patch(error_on_recompile=True):
        for tb in (
            packed_rows(),
            pack_rows([[docs[0], docs[1]]], 80, pad_multiple=16),
        ):  # [3, 64], then [1, 48]
            ref = compute_features(t, tb, [1, 5]).features
            got = compute_features(t, tb, [1, 5], native).features
            assert got.shape == ref.shape and (got - ref).abs().max().item() <= 1e-10
    with pytest.raises(ValueError, match=r"\[3, 112\] tokens does not fit the compiled shape \[4, 96\]"):
        native(*(torch.zeros(3, 112, dtype=torch.long) for _ in range(3)), [1])
    torch._dynamo.reset()


def test_an_unsupported_target_is_refused_in_one_line():
    t = tiny_target("llama")
    t.config.hidden_act = "gelu"
    docs = make_docs([20, 13], seed=0)
    with pytest.raises(ValueError) as e:
        InProcessSource(docs, t, [1], max_length=48, token_budget=96, feature_pass="native")
    msg = str(e.value)
    assert "\n" not in msg and "hidden_act 'gelu'" in msg and "set runtime.feature_pass=hf" in msg
    InProcessSource(docs, t, [1], max_length=48, token_budget=96, feature_pass="hf")  # hf takes any target


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["runtime.feature_pass=fast"], "runtime.feature_pass 'fast': use hf or native"),
        (["runtime.compile=attention,target"], "runtime.compile=target compiles the native feature pass"),
        (
            ["runtime.feature_pass=native", "runtime.compile=attention,target_graph"],
            "runtime.compile=target_graph replays the compiled feature pass: add target",
        ),
    ],
)
def test_config_errors(overrides, message):
    cfg = load_config(TrainConfig, None, ["data.dataset=x", *overrides])
    with pytest.raises(ConfigError, match=message):
        cfg.validate()


def test_the_feature_pass_does_not_change_the_run_identity():
    """A run started with one pass resumes with the other: the features are the same."""
    hf, native = (
        load_config(TrainConfig, None, ["data.dataset=x", f"runtime.feature_pass={p}"])
        for p in ("hf", "native")
    )
    assert config_hash(hf) == config_hash(native)


def test_training_losses_are_the_same_with_either_pass(tmp_path, monkeypatch):
    """flashdraft train with runtime.feature_pass=native (features made in the pipeline's producer thread) logs
    the losses of the transformers pass, step for step, in float64."""
    t = tiny_target("qwen3")
    docs = make_docs([40, 30, 20, 45, 25, 33, 38, 27], seed=0)
    losses, native_calls = {}, []
    real = PackedTargetPass.forward
    monkeypatch.setattr(
        PackedTargetPass, "forward", lambda self, *a: native_calls.append(1) or real(self, *a)
    )
    for p in ("hf", "native"):
        native_calls.clear()
        cfg = load_config(TrainConfig, None, [
            f"run_dir={tmp_path / p}", "model.num_layers=1", "model.block_size=8", "model.target_layer_ids=[1,5]",
            "data.max_length=64", "data.token_budget=128", "data.max_anchors=6", "data.pad_multiple=16",
            "data.dataset=<in-memory>", "optim.max_steps=3", "optim.lr=3e-3", "runtime.device=cpu",
            "runtime.dtype=float64", "pipeline.queue_depth=2", "telemetry.log_every=1",
            "telemetry.tensorboard=false", "telemetry.progress=false", f"runtime.feature_pass={p}",
        ])  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            train(cfg, target=t, samples=docs)
        losses[p] = [m["loss"] for m in read_metrics(tmp_path / p)]
        assert bool(native_calls) == (p == "native")  # the config reached the pipeline
    assert len(losses["hf"]) == 3 and all(math.isfinite(x) for x in losses["hf"])
    assert losses["native"] == pytest.approx(losses["hf"], abs=1e-10)


def _cuda_target_and_batches() -> tuple[Any, list[TokenBatch]]:
    """A tiny bf16 target on CUDA and three packed batches of 320-token rows (two rows, one, two)."""
    t = tiny_target("llama", dtype=torch.bfloat16, hidden=64)
    t.model.to("cuda")
    docs = make_docs([150, 90, 200, 120, 60, 170], seed=0)
    return t, [
        pack_rows([[docs[0], docs[1]], [docs[2], docs[3]]], 320, pad_multiple=64),
        pack_rows([[docs[4], docs[5]]], 320, pad_multiple=64),
        pack_rows([[docs[3], docs[0]], [docs[5]]], 320, pad_multiple=64),
    ]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_native_pass_on_cuda_matches_transformers_in_bf16():
    """On CUDA: the FlexAttention pass (compiled kernel) and the compiled whole forward (inductor) against
    transformers' dense-mask pass, bf16, on batches of two shapes."""
    torch._dynamo.reset()
    t, batches = _cuda_target_and_batches()
    batches = batches[:2]
    eager = PackedTargetPass(t)
    compiled = PackedTargetPass(t, compile_shape=(2, 320))
    for tb in batches:
        ref = compute_features(t, tb, [1, 5]).features.float()
        for native in (eager, compiled):
            got = compute_features(t, tb, [1, 5], native).features.float()
            real = tb.doc_ids >= 0
            err = (got - ref)[real.cuda()].abs().max().item()
            assert err <= 0.05 * ref[real.cuda()].abs().max().item()
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_compiled_pass_replayed_as_a_cuda_graph_gives_its_features():
    """`cuda_graph=True`: the block mask and the compiled forward captured once, replayed with each batch copied into
    its static buffers: the compiled pass's features, batch after batch, and a batch's features are its own after the
    next replay (cloned out of the graph's memory)."""
    torch._dynamo.reset()
    t, batches = _cuda_target_and_batches()
    compiled = PackedTargetPass(t, compile_shape=(2, 320))
    graphed = PackedTargetPass(t, compile_shape=(2, 320), cuda_graph=True)
    kept = []
    for tb in batches:
        ref = compute_features(t, tb, [1, 5], compiled).features
        got = compute_features(t, tb, [1, 5], graphed).features
        assert torch.equal(got, ref)
        kept.append((got, ref.clone()))
    assert all(torch.equal(a, b) for a, b in kept) and len(graphed._graphs) == 1
    with pytest.raises(ValueError, match="needs CUDA and a compiled static shape"):
        PackedTargetPass(t, cuda_graph=True)
    torch._dynamo.reset()


# ----------------------------------------------------------------------------- benchmarks/train_throughput.py


def _throughput_script(monkeypatch):  # noqa: ANN001, ANN202
    """benchmarks/train_throughput.py as a module, imported as `python benchmarks/train_throughput.py` runs it."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "train_throughput.py"
    monkeypatch.syspath_prepend(str(path.parent))
    spec = importlib.util.spec_from_file_location("_train_throughput", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def test_throughput_variants_set_the_feature_pass_and_the_target_compile(tmp_path, monkeypatch, capsys):
    script = _throughput_script(monkeypatch)
    seen = []

    def fake_measure(args, cfg, *_):  # noqa: ANN001, ANN202
        seen.append((cfg.runtime.feature_pass, cfg.runtime.compile_parts))
        cfg.validate()
        return {"target_s": 1.0 + len(seen), "target_tokens_per_s": 1.0, "loss_first_step": 0.5}

    monkeypatch.setattr(script, "measure", fake_measure)
    out = tmp_path / "r.json"
    argv = ["x", "--device", "cpu", "--tiny", "--compile", "attention,loss,target", "--json", str(out),
            "--feature-pass", "hf,native,native-compiled,native-graph"]  # fmt: skip
    monkeypatch.setattr("sys.argv", argv)
    script.main()
    assert seen == [
        ("hf", {"attention", "loss"}),  # target compile is the native pass's: dropped
        ("native", {"attention", "loss", "target"}),
        ("native", {"attention", "loss", "target"}),
        ("native", {"attention", "loss", "target", "target_graph"}),
    ]
    variants = [r["variant"] for r in json.loads(out.read_text())]
    assert variants == ["hf", "native", "native-compiled", "native-graph"]
    assert "native / hf: target pass time 1.500x" in capsys.readouterr().out
    seen.clear()
    monkeypatch.setattr("sys.argv", ["x", "--device", "cpu", "--tiny", "--feature-pass", "native-compiled"])
    script.main()
    assert seen == [("native", {"attention", "loss", "target"})]


def test_throughput_runs_both_passes_on_cpu_with_the_same_losses(tmp_path, monkeypatch):
    """The tiny CPU smoke run of the real steps, both passes in one process: same first-step loss (float32)."""
    script = _throughput_script(monkeypatch)
    out = tmp_path / "r.json"
    argv = ["x", "--device", "cpu", "--tiny", "--steps", "1", "--warmup-steps", "0", "--json", str(out),
            "--feature-pass", "hf,native"]  # fmt: skip
    monkeypatch.setattr("sys.argv", argv)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        script.main()
    hf, native = json.loads(out.read_text())
    assert (hf["feature_pass"], native["feature_pass"]) == ("hf", "native")
    assert native["loss_first_step"] == pytest.approx(hf["loss_first_step"], rel=1e-5)
    assert native["target_tokens_per_s"] > 0
