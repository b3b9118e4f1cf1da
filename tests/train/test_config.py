"""TrainConfig: YAML + overrides, strict keys, errors that name the field and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from flashdraft.config import ConfigError, load_config, save_config
from flashdraft.train.config import TrainConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_defaults_are_the_paper_recipe():
    cfg = TrainConfig()
    assert cfg.optim.lr == 6e-4 and cfg.optim.warmup_ratio == 0.04 and cfg.optim.grad_clip == 1.0
    assert cfg.data.max_anchors == 512 and cfg.data.max_length == 3072 and cfg.model.block_size == 16


def test_yaml_and_overrides_round_trip(tmp_path):
    p = tmp_path / "run.yaml"
    p.write_text("run_dir: runs/x\nmodel:\n  num_layers: 3\ndata:\n  dataset: d\n")
    cfg = load_config(TrainConfig, p, ["optim.lr=3e-4", "model.target_layer_ids=[1,2]", "optim.max_steps=10"])
    assert cfg.model.num_layers == 3 and cfg.optim.lr == 3e-4 and cfg.model.target_layer_ids == [1, 2]
    assert cfg.optim.max_steps == 10
    cfg.validate()
    save_config(cfg, tmp_path / "saved.yaml")
    assert load_config(TrainConfig, tmp_path / "saved.yaml") == cfg


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["optim.lrr=1"], "did you mean 'lr'"),
        (["modle.num_layers=2"], "did you mean 'model'"),
        (["optim.lr=fast"], "optim.lr: expected a number"),
        (["data.max_anchors=1.5"], "data.max_anchors: expected an integer"),
    ],
)
def test_unknown_keys_and_bad_values_are_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TrainConfig, None, overrides)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ([], "data.dataset is empty"),
        (["data.dataset=x", "model.block_size=12"], "set loss.gamma"),
        (["data.dataset=x", "optim.betas=[0.9]"], "optim.betas"),
        (["data.dataset=x", "data.max_anchors=0"], "data.max_anchors 0 must be >= 1"),
        (["data.dataset=x", "data.loop_anchor_weight=0"], "data.loop_anchor_weight 0.0 must be > 0"),
        (["data.dataset=x", "model.grow_layers=2"], "model.grow_layers 2 adds layers to a loaded drafter: set model.init_from"),
        (["data.dataset=x", "model.init_from=d", "model.grow_layers=-1"], "model.grow_layers -1 must be >= 0"),
        (["data.dataset=x", "runtime.attention=magic"], "runtime.attention"),
        (["data.dataset=x", "runtime.compile=true"], "runtime.compile 'True': use none or a comma-separated"),
        (["data.dataset=x", "runtime.compile=attention,lossy"], "runtime.compile 'attention,lossy'"),
        (
            ["data.dataset=x", "runtime.compile=model,loss"],
            "runtime.compile=model needs static shapes: set data.blocks_per_row",
        ),
        (["data.dataset=x", "data.blocks_per_row=-1"], "data.blocks_per_row -1 must be >= 0"),
        (["data.dataset=x", "runtime.time_limit_min=0"], "runtime.time_limit_min"),
        (["data.dataset=x", "runtime.flex_block_size=[96,128]"], r"runtime.flex_block_size \[96, 128\]"),
        (["data.dataset=x", "runtime.flex_block_size=[64]"], "two tile sizes"),
        (["data.dataset=x", "runtime.compile_mode=fast"], "runtime.compile_mode 'fast'"),
        (
            ["data.dataset=x", "runtime.compile_mode=reduce-overhead"],
            "'reduce-overhead' was removed .*measured slower",
        ),
        (["data.dataset=x", "runtime.flex_block_size=[64,64]"], r"below 128 has no backward kernel"),
        (
            [
                "data.dataset=x",
                "runtime.flex_block_size=[128,64]",
                "runtime.compile=model,loss",
                "data.blocks_per_row=8",
            ],
            "set runtime.compile=model with runtime.compile_mode=max-autotune-no-cudagraphs",
        ),
        (["data.dataset=x", "telemetry.peak_tflops=0"], "telemetry.peak_tflops 0.0 must be > 0"),
        (["data.dataset=x", "telemetry.peak_tflops=-790"], "telemetry.peak_tflops -790.0 must be > 0"),
        (["data.dataset=x", "runtime.host_threads=-1"], "runtime.host_threads -1 must be >= 0"),
    ],
)
def test_validate_names_the_field(overrides, message):
    cfg = load_config(TrainConfig, None, overrides)
    with pytest.raises(ConfigError, match=message):
        cfg.validate()


def test_shipped_configs_load():
    files = sorted(CONFIGS.glob("*.yaml"))
    assert files, "configs/ has no example config"
    for f in files:
        load_config(TrainConfig, f).validate()


def test_cli_reports_config_errors_in_one_line(tmp_path):
    from typer.testing import CliRunner

    from flashdraft.cli import app

    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"run_dir: {tmp_path / 'run'}\ndata:\n  dataset: {tmp_path / 'missing'}\n")
    runner = CliRunner()
    bad_key = runner.invoke(app, ["train", str(cfg), "optim.lrr=1"])
    assert bad_key.exit_code == 1 and "did you mean 'lr'" in bad_key.output
    no_ckpt = runner.invoke(app, ["train", str(cfg), "--resume"])
    assert no_ckpt.exit_code == 1 and "has no complete checkpoint" in no_ckpt.output


def test_fused_ce_unset_follows_where_the_loss_is_compiled():
    """loss.fused_ce unset: the fused CE only where the loss is compiled (it is slower eager on CPU)."""
    from flashdraft.train.config import fused_ce_on

    cfg = load_config(TrainConfig, None, ["runtime.compile=model,loss"])
    assert cfg.loss.fused_ce is None
    assert fused_ce_on(cfg.loss, cfg.runtime, "cuda") and not fused_ce_on(cfg.loss, cfg.runtime, "cpu")
    eager = load_config(TrainConfig, None, ["runtime.compile=attention"])
    assert not fused_ce_on(eager.loss, eager.runtime, "cuda")
    for value, want in (("true", True), ("false", False)):
        c = load_config(TrainConfig, None, [f"loss.fused_ce={value}", "runtime.compile=model,loss"])
        assert (
            fused_ce_on(c.loss, c.runtime, "cpu") is want and fused_ce_on(c.loss, c.runtime, "cuda") is want
        )


def test_small_flex_tiles_only_where_they_compile():
    """runtime.flex_block_size below 128: with max-autotune's kernel configs (the whole drafter compiled), or
    with FlexAttention not compiled at all; [128, 128] everywhere."""
    for extra in (
        [
            "runtime.compile=model,loss",
            "data.blocks_per_row=8",
            "runtime.compile_mode=max-autotune-no-cudagraphs",
        ],
        ["runtime.compile=loss"],
        ["runtime.compile=none"],
    ):
        load_config(
            TrainConfig, None, ["data.dataset=x", "runtime.flex_block_size=[64,64]", *extra]
        ).validate()
    load_config(
        TrainConfig, None, ["data.dataset=x", "runtime.compile=model", "data.blocks_per_row=8"]
    ).validate()


OLD_DEFAULTS = {"data": {"greedy_labels": False}, "loss": {"feature_noise": 0.0, "embedding_noise": 0.0},
                "runtime": {"gc_every": 50}}  # fmt: skip


def test_a_run_config_saved_before_the_knob_removals_still_loads_and_hashes_the_same(tmp_path):
    """A run folder's config.yaml from before data.greedy_labels, loss.feature_noise / embedding_noise and
    runtime.gc_every were removed holds them at their defaults: it loads (they did nothing) and config_hash
    is the one those runs stored in their checkpoints (else --resume warns 'not the same run')."""
    import yaml

    from flashdraft.config import to_dict
    from flashdraft.train.trainer import config_hash

    raw = to_dict(load_config(TrainConfig, None, ["data.dataset=x"]))
    for section, keys in OLD_DEFAULTS.items():
        raw[section].update(keys)
    raw["runtime"]["gc_every"] = 7  # any gc_every: it never changed what a run computes
    p = tmp_path / "config.yaml"
    p.write_text(yaml.safe_dump(raw, sort_keys=False))
    cfg = load_config(TrainConfig, p)
    assert cfg == load_config(TrainConfig, None, ["data.dataset=x"])
    # the value the code before the removals computed for this config (and for the shipped config + an override)
    assert config_hash(cfg) == "1f4b703e10f539b5"
    shipped = load_config(TrainConfig, CONFIGS / "smollm2-b16.yaml", ["data.dataset=d", "optim.lr=0.001"])
    assert config_hash(shipped) == "843aaa818a5338e9"
    # a knob added since (data.loop_anchor_weight) enters the hash only away from its default
    assert config_hash(load_config(TrainConfig, None, ["data.dataset=x", "data.loop_anchor_weight=1.0"])) == (
        "1f4b703e10f539b5"
    )
    assert config_hash(load_config(TrainConfig, None, ["data.dataset=x", "data.loop_anchor_weight=0.3"])) != (
        "1f4b703e10f539b5"
    )
    grown = ["data.dataset=x", "model.init_from=d"]
    assert config_hash(load_config(TrainConfig, None, [*grown, "model.grow_layers=0"])) == config_hash(
        load_config(TrainConfig, None, grown)
    ) != config_hash(load_config(TrainConfig, None, [*grown, "model.grow_layers=2"]))


@pytest.mark.parametrize(
    "override, key",
    [("data.greedy_labels=true", "data.greedy_labels"), ("loss.feature_noise=0.1", "loss.feature_noise"),
     ("loss.embedding_noise=0.05", "loss.embedding_noise"), ("data.greedy_labels=0", "data.greedy_labels")],
)  # fmt: skip
def test_a_removed_key_that_asks_for_something_is_refused_in_one_line(override, key, tmp_path):
    p = tmp_path / "old.yaml"
    p.write_text("data:\n  dataset: x\n")
    with pytest.raises(ConfigError) as e:
        load_config(TrainConfig, p, [override])
    msg = str(e.value)
    assert (
        "\n" not in msg and f"config key '{key}' was removed (" in msg and "delete it from the config" in msg
    )
    assert msg.startswith(str(p))  # names the file


def test_the_fields_that_only_shape_or_place_things_reach_what_they_set():
    """model.target_dtype, the drafter's architecture fields (num_attention_heads, num_key_value_heads, head_dim,
    mask_token_id), runtime.target_device: each reaches the object it configures."""
    import torch

    from flashdraft.train.launch import build_drafter, resolve_precision
    from flashdraft.train.pipeline import resolve_target_device
    from tests.conftest import tiny_target

    cpu = torch.device("cpu")
    assert (
        resolve_precision(load_config(TrainConfig, None, ["model.target_dtype=float64"]), cpu).target
        == torch.float64
    )
    with pytest.raises(ConfigError, match="model.target_dtype 'int8'"):
        resolve_precision(load_config(TrainConfig, None, ["model.target_dtype=int8"]), cpu)
    shape = ["model.num_layers=1", "model.block_size=4", "model.num_attention_heads=2", "model.num_key_value_heads=1",
             "model.head_dim=8", "model.mask_token_id=7"]  # fmt: skip
    d = build_drafter(load_config(TrainConfig, None, shape), tiny_target("llama"), cpu, torch.float32).config
    assert (d.num_attention_heads, d.num_key_value_heads, d.head_dim, d.mask_token_id) == (2, 1, 8, 7)
    assert resolve_target_device("same", cpu) == cpu and resolve_target_device("cpu,cpu", cpu, 1) == cpu
    with pytest.raises(ValueError, match="lists 2 devices but this is local rank 2"):
        resolve_target_device("cpu,cpu", cpu, 2)


def test_data_split_picks_the_split_training_reads(tmp_path):
    """data.split: the dataset split training reads (regenerate writes train and a held-out eval split)."""
    import numpy as np

    from flashdraft.data.dataset import Sample, write_dataset
    from flashdraft.train.launch import open_samples

    samples = [
        Sample(f"s{i}", np.arange(1, 20 + i), np.array([False] * 5 + [True] * (14 + i))) for i in range(40)
    ]
    write_dataset(samples, tmp_path / "ds", eval_fraction=0.5, contamination_sources=())
    counts = {}
    for split in ("train", "eval"):
        overrides = [f"run_dir={tmp_path}/r", f"data.dataset={tmp_path}/ds", f"data.split={split}"]
        cfg = load_config(TrainConfig, None, overrides)
        ds, lengths = open_samples(cfg)
        counts[split] = len(lengths)
        assert len(ds) == len(lengths)
    assert counts["train"] + counts["eval"] == 40 and min(counts.values()) > 0
