"""Export round trip: run folder -> clean DFlash checkpoint that loads and matches bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flashdraft.drafter import DFlashDrafter
from flashdraft.serve.export import export_drafter, resolve_checkpoint
from tests.conftest import tiny_drafter, tiny_target

# The key set of the public z-lab Qwen3-4B-DFlash-b16 / Qwen3-8B-DFlash-b16 config.json (the
# releases SGLang and vLLM are tested with), minus `auto_map` (remote code, dropped on purpose)
# and bos/eos ids (the target's, not the drafter's business).
PUBLIC_KEYS = {
    "architectures", "attention_bias", "attention_dropout", "block_size", "dflash_config", "dtype",
    "head_dim", "hidden_act", "hidden_size", "initializer_range", "intermediate_size", "layer_types",
    "max_position_embeddings", "max_window_layers", "model_type", "num_attention_heads", "num_hidden_layers",
    "num_key_value_heads", "num_target_layers", "rms_norm_eps", "rope_scaling", "rope_theta", "sliding_window",
    "tie_word_embeddings", "use_cache", "use_sliding_window", "vocab_size",
}  # fmt: skip


def _make_run(tmp: Path, drafter: DFlashDrafter, steps: list[int]) -> Path:
    run = tmp / "run"
    for s in steps:
        d = drafter if s == max(steps) else tiny_drafter_like(drafter, seed=s)
        step = run / "checkpoints" / f"step-{s:08d}"
        d.save_pretrained(step / "drafter")
        (step / "trainer_state.json").write_text(json.dumps({"step": s}))  # marks a complete checkpoint
    (run / "config.yaml").write_text("model:\n  target: Qwen/Qwen3-8B\n")
    return run


def tiny_drafter_like(d: DFlashDrafter, seed: int) -> DFlashDrafter:
    torch.manual_seed(seed)
    other = DFlashDrafter(d.config)
    other.reset_parameters(0.1)
    return other


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_export_round_trip_from_run(tmp_path: Path, dtype: str) -> None:
    target = tiny_target("qwen3", dtype=torch.float32)
    drafter = tiny_drafter(target, layers=2, block_size=16).float()
    # a checkpoint written by an older tool with remote-code hooks: export must drop them
    drafter.config.extra["auto_map"] = {"AutoModel": "dflash.DFlashDraftModel"}
    run = _make_run(tmp_path, drafter, steps=[100, 2000, 300])
    assert resolve_checkpoint(run).parent.name == "step-00002000"  # numeric, not lexical/insertion order

    out = tmp_path / "export"
    res = export_drafter(run, out, dtype=dtype)
    assert res.dest == out.resolve() and res.max_abs_diff == 0.0

    # the written folder: exactly config + weights + README, no code
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    cfg = json.loads((out / "config.json").read_text())
    assert set(cfg) == PUBLIC_KEYS, set(cfg) ^ PUBLIC_KEYS
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == 16 and cfg["dflash_config"]["block_size"] == 16
    assert set(cfg["dflash_config"]) == {"mask_token_id", "target_layer_ids", "block_size"}
    assert cfg["dflash_config"]["target_layer_ids"] == drafter.config.target_layer_ids
    assert cfg["tie_word_embeddings"] is False and cfg["dtype"] == dtype
    assert cfg["num_target_layers"] == target.num_layers

    # z-lab key layout, no embedding / head
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert {f.get_tensor(k).dtype for k in keys} == {getattr(torch, dtype)}
    assert keys == set(drafter.state_dict())
    assert "fc.weight" in keys and "layers.1.self_attn.q_norm.weight" in keys
    assert not any("embed" in k or "lm_head" in k for k in keys)

    # loads in DFlashDrafter.from_pretrained and gives identical outputs at the exported dtype
    loaded = DFlashDrafter.from_pretrained(out)
    ref = drafter.to(getattr(torch, dtype))
    feats = torch.randn(1, 5, len(drafter.target_layer_ids) * target.hidden_size).to(getattr(torch, dtype))
    noise = torch.randn(1, 16, target.hidden_size).to(getattr(torch, dtype))
    pos = torch.arange(5 + 16)[None]
    with torch.no_grad():
        assert torch.equal(loaded(feats, noise, pos), ref(feats, noise, pos))

    readme = (out / "README.md").read_text()
    assert (
        "--speculative-algorithm DFLASH" in readme
        and f"--speculative-draft-model-path {out.resolve()}" in readme
    )
    assert '"method": "dflash"' in readme and '"num_speculative_tokens": 15' in readme
    assert readme.count("not run here") == 2 and "Qwen/Qwen3-8B" in readme  # target from the run config

    # exporting again replaces the folder atomically; a step folder is a valid source too
    res2 = export_drafter(run / "checkpoints" / "step-00000100", out, dtype=dtype, target="my/target")
    assert res2.source.parent.name == "step-00000100"
    assert "my/target" in (out / "README.md").read_text()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".export")]


def test_export_refuses_bad_sources(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such folder"):
        export_drafter(tmp_path / "missing", tmp_path / "o")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="not a DFlash checkpoint"):
        export_drafter(tmp_path / "empty", tmp_path / "o")
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        export_drafter(tmp_path / "run", tmp_path / "o")
    target = tiny_target("llama", dtype=torch.float32)
    tiny_drafter(target).float().save_pretrained(tmp_path / "d")
    with pytest.raises(ValueError, match="not exportable"):
        export_drafter(tmp_path / "d", tmp_path / "o", dtype="int8")
    assert not (tmp_path / "o").exists()
