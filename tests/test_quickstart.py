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
    over = train_overrides(sizes, tmp_path / "run", tmp_path / "data", tmp_path / "feats", preset)
    cfg = load_config(TrainConfig, CONFIG, over)
    cfg.validate()
    assert cfg.model.block_size == sizes.block_size and cfg.model.num_layers == sizes.layers
    assert cfg.optim.max_steps == sizes.steps and cfg.optim.lr == sizes.lr
    assert cfg.data.max_anchors == sizes.max_anchors and cfg.data.token_budget == sizes.token_budget
    assert cfg.loss.gamma == sizes.gamma and cfg.model.init_from_target == sizes.init_from_target
    assert cfg.runtime.time_limit_min == sizes.train_minutes
    assert cfg.model.target_layer_ids == sizes.target_layer_ids
    assert cfg.pipeline.mode == "offline" and cfg.pipeline.features_dir == str(tmp_path / "feats")
