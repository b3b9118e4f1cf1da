"""The quickstart's training overrides form a valid train config for every size preset (the
quickstart itself takes minutes and is measured by hand, see benchmarks/RESULTS.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from flashdraft.config import load_config
from flashdraft.quickstart import CONFIG, SIZES, train_overrides
from flashdraft.train.config import TrainConfig


@pytest.mark.parametrize("preset", sorted(SIZES))
def test_train_overrides_make_a_valid_config(preset: str, tmp_path: Path) -> None:
    sizes = SIZES[preset]
    device = "cuda" if preset == "cuda" else "cpu"
    over = train_overrides(sizes, tmp_path / "run", tmp_path / "data", tmp_path / "feats", device)
    cfg = load_config(TrainConfig, CONFIG, over)
    cfg.validate()
    assert cfg.model.block_size == sizes.block_size and cfg.model.num_layers == sizes.layers
    assert cfg.optim.max_steps == sizes.steps and cfg.optim.lr == sizes.lr
    assert cfg.data.max_anchors == sizes.max_anchors and cfg.data.token_budget == sizes.token_budget
    assert cfg.loss.gamma == sizes.gamma and cfg.model.init_from_target == sizes.init_from_target
    assert cfg.runtime.time_limit_min == sizes.train_minutes
    assert cfg.model.target_layer_ids == sizes.target_layer_ids
    assert cfg.pipeline.mode == "offline" and cfg.pipeline.features_dir == str(tmp_path / "feats")


def test_preset_follows_the_device_and_the_cpu_bf16_support(monkeypatch: pytest.MonkeyPatch) -> None:
    import flashdraft.quickstart as qs

    assert qs.preset_for("cuda:0") == "cuda"
    monkeypatch.setattr(qs, "cpu_has_native_bf16", lambda: True)
    assert qs.preset_for("cpu") == "cpu" and SIZES["cpu"].dtype == "bfloat16"
    monkeypatch.setattr(qs, "cpu_has_native_bf16", lambda: False)
    assert qs.preset_for("cpu") == "cpu-fp32" and SIZES["cpu-fp32"].dtype == "float32"
