"""Export round trip: run folder -> clean DFlash checkpoint that loads and matches bit for bit."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from flashdraft.drafter import DFlashDrafter
from flashdraft.serve.export import MODELING_FILE, export_drafter, resolve_checkpoint
from tests.conftest import tiny_drafter, tiny_target

# The key set of the public z-lab Qwen3-4B-DFlash-b16 / Qwen3-8B-DFlash-b16 config.json (the releases
# SGLang and vLLM are tested with), minus bos/eos ids (the target's, not the drafter's business), plus
# `eagle_aux_hidden_state_layer_ids` (read by some vLLM versions instead of dflash_config).
PUBLIC_KEYS = {
    "architectures", "attention_bias", "attention_dropout", "auto_map", "block_size", "dflash_config", "dtype",
    "eagle_aux_hidden_state_layer_ids", "head_dim", "hidden_act", "hidden_size", "initializer_range",
    "intermediate_size", "layer_types", "max_position_embeddings", "max_window_layers", "model_type",
    "num_attention_heads", "num_hidden_layers", "num_key_value_heads", "num_target_layers", "rms_norm_eps",
    "rope_scaling", "rope_theta", "sliding_window", "tie_word_embeddings", "use_cache", "use_sliding_window",
    "vocab_size",
}  # fmt: skip


def tiny_tokenizer(folder: Path, vocab: int = 97) -> Path:
    """A word-level tokenizer whose token i is the string f"tok{i}" (what the tiny targets' ids decode to)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = {f"tok{i}": i for i in range(vocab)}
    PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(words, unk_token="tok0"))
    ).save_pretrained(folder)
    return folder


def _make_run(tmp: Path, drafter: DFlashDrafter, steps: list[int], target: str = "Qwen/Qwen3-8B") -> Path:
    run = tmp / "run"
    for s in steps:
        d = drafter if s == max(steps) else tiny_drafter_like(drafter, seed=s)
        step = run / "checkpoints" / f"step-{s:08d}"
        d.save_pretrained(step / "drafter")
        (step / "trainer_state.json").write_text(json.dumps({"step": s}))  # marks a complete checkpoint
    (run / "config.yaml").write_text(f"model:\n  target: {target}\n")
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
    # a checkpoint written by an older tool with someone else's remote-code hook: export points it at ours
    drafter.config.extra["auto_map"] = {"AutoModel": "dflash.DFlashDraftModel"}
    tok = tiny_tokenizer(tmp_path / "target-tok")
    run = _make_run(tmp_path, drafter, steps=[100, 2000, 300], target=str(tok))
    assert resolve_checkpoint(run).parent.name == "step-00002000"  # numeric, not lexical/insertion order

    out = tmp_path / "export"
    res = export_drafter(run, out, dtype=dtype)
    assert res.dest == out.resolve() and res.max_abs_diff == 0.0

    # the written folder: config + weights + README + the AutoModel code
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md",
        "config.json",
        "model.safetensors",
        "modeling_dflash.py",
    ]
    assert (out / "modeling_dflash.py").read_bytes() == MODELING_FILE.read_bytes()
    cfg = json.loads((out / "config.json").read_text())
    assert set(cfg) == PUBLIC_KEYS, set(cfg) ^ PUBLIC_KEYS
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["auto_map"] == {"AutoModel": "modeling_dflash.DFlashDraftModel"}
    assert cfg["block_size"] == 16 and cfg["dflash_config"]["block_size"] == 16
    assert set(cfg["dflash_config"]) == {"mask_token_id", "mask_token", "target_layer_ids", "block_size"}
    assert cfg["dflash_config"]["target_layer_ids"] == drafter.config.target_layer_ids
    assert cfg["dflash_config"]["mask_token"] == f"tok{drafter.config.mask_token_id}" == res.mask_token
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in drafter.config.target_layer_ids]
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
    assert "--attention-backend flash_attn" in readme and "trust_remote_code=True" in readme
    assert readme.count("not run here") == 2 and str(tok) in readme  # target from the run config

    # exporting again over the export needs --overwrite; then it is replaced; a step folder is a valid source
    step = run / "checkpoints" / "step-00000100"
    with pytest.raises(FileExistsError, match="pass --overwrite"):
        export_drafter(step, out, dtype=dtype, target=str(tok))
    res2 = export_drafter(step, out, dtype=dtype, target=str(tok), overwrite=True)
    assert res2.source.parent.name == "step-00000100"
    assert str(tok) in (out / "README.md").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "export",
        "run",
        "target-tok",
    ]  # nothing staged is left


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


def _exportable(tmp_path: Path) -> tuple[Path, Path]:
    """A run with one checkpoint and a target tokenizer: (run folder, tokenizer folder)."""
    target = tiny_target("llama", dtype=torch.float32)
    tok = tiny_tokenizer(tmp_path / "tok")
    return _make_run(tmp_path, tiny_drafter(target).float(), steps=[10], target=str(tok)), tok


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize(
    "where", ["checkpoints", "run", "step", "drafter", "inside-drafter", "inside-run", "parent"]
)
def test_export_never_replaces_its_own_source(tmp_path: Path, where: str, overwrite: bool) -> None:
    run, _ = _exportable(tmp_path)
    step = run / "checkpoints" / "step-00000010"
    to = {
        "checkpoints": run / "checkpoints",  # a run's checkpoints/ folder: held every checkpoint
        "run": run,
        "step": step,
        "drafter": step / "drafter",  # the source itself
        "inside-drafter": step / "drafter" / "export",
        "inside-run": run / "export",
        "parent": tmp_path,  # a parent folder of the source
    }[where]
    before = _tree(tmp_path)
    with pytest.raises(ValueError, match="contains the source|is inside the source"):
        export_drafter(run, to, overwrite=overwrite)
    assert _tree(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["run", "tok"]


def test_export_into_an_unrelated_folder(tmp_path: Path) -> None:
    run, _ = _exportable(tmp_path)
    out = tmp_path / "mine"
    out.mkdir()
    export_drafter(run, out)  # an empty existing folder is taken
    assert (out / "config.json").is_file()
    (out / "notes.txt").write_text("the user's")
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="is not empty: pass --overwrite"):
        export_drafter(run, out)
    with pytest.raises(FileExistsError, match="is not a folder: pass --overwrite"):
        export_drafter(run, tmp_path / "file")
    assert (out / "notes.txt").read_text() == "the user's" and (tmp_path / "file").read_text() == "x"
    export_drafter(run, out, overwrite=True)  # replaced whole: the new export, nothing of the old folder
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md",
        "config.json",
        "model.safetensors",
        "modeling_dflash.py",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "mine", "run", "tok"]


def test_failed_export_leaves_the_destination_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flashdraft.serve import export

    run, _ = _exportable(tmp_path)
    out = tmp_path / "mine"
    export_drafter(run, out)
    before = _tree(out)

    def broken(*_: object) -> float:
        raise ValueError("verification failed")

    monkeypatch.setattr(export, "_verify", broken)
    with pytest.raises(ValueError, match="verification failed"):
        export_drafter(run, out, overwrite=True)
    assert _tree(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["mine", "run", "tok"]


@pytest.mark.parametrize(("mask", "dir_mode", "file_mode"), [(0o022, 0o755, 0o644), (0o077, 0o700, 0o600)])
def test_export_modes_follow_the_umask(tmp_path: Path, mask: int, dir_mode: int, file_mode: int) -> None:
    import os
    import stat

    run, _ = _exportable(tmp_path)
    old = os.umask(mask)
    try:
        export_drafter(run, tmp_path / "out")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == dir_mode
    assert {stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "out").iterdir()} == {file_mode}


def test_mask_token_string(tmp_path: Path) -> None:
    target = tiny_target("llama", dtype=torch.float32)
    src = tmp_path / "d"
    tiny_drafter(target, mask_token_id=5).float().save_pretrained(src)
    # no tokenizer to be found: refused, naming the fix
    with pytest.raises(ValueError, match="cannot load the tokenizer of target .*pass --target"):
        export_drafter(src, tmp_path / "o", target=str(tmp_path / "no-such-model"))
    assert not (tmp_path / "o").exists()
    tok = tiny_tokenizer(tmp_path / "tok")
    res = export_drafter(src, tmp_path / "o", target=str(tok))
    assert res.mask_token == "tok5"
    # re-exporting that export without a tokenizer keeps the string it already carries
    res = export_drafter(tmp_path / "o", tmp_path / "o2", target=str(tmp_path / "no-such-model"))
    assert res.mask_token == "tok5"
    assert json.loads((tmp_path / "o2" / "config.json").read_text())["dflash_config"]["mask_token"] == "tok5"
    # an id the tokenizer has no string for (embedding rows beyond the tokenizer): exported, SGLang noted
    small = tiny_tokenizer(tmp_path / "small-tok", vocab=5)
    res = export_drafter(src, tmp_path / "o3", target=str(small))
    assert res.mask_token is None
    assert "mask_token" not in json.loads((tmp_path / "o3" / "config.json").read_text())["dflash_config"]
    assert (
        "SGLang, which looks the mask up by its string, cannot serve"
        in (tmp_path / "o3" / "README.md").read_text()
    )


# Every config.json key the public DFlash loaders read, by the file that reads it (the versions read on
# 2026-12-05). A dotted key is inside a dict (`dflash_config.mask_token`).
LOADER_KEYS: dict[str, list[str]] = {
    # transformers' AutoModel (the z-lab README's path): auto_map picks the modeling file, model_type the config
    # class; the reference model reads the Qwen3 fields and dflash_config
    "z-lab/dflash dflash/model.py @1012959 (DFlashDraftModel, dflash_generate)": [
        "auto_map.AutoModel", "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "intermediate_size", "hidden_act", "rms_norm_eps", "attention_bias",
        "attention_dropout", "layer_types", "sliding_window", "rope_theta", "rope_scaling",
        "max_position_embeddings", "dflash_config.target_layer_ids", "dflash_config.block_size",
        "dflash_config.mask_token_id",
    ],
    "z-lab/dflash model/dflash.py @a3516f8 (the first release's model)": [
        "num_target_layers", "block_size", "dflash_config.target_layer_ids",
    ],
    "sglang python/sglang/srt/speculative/dflash_utils.py @7f151c5 (resolve_dflash_mask_token, target layers)": [
        "dflash_config.mask_token", "dflash_config.target_layer_ids",
    ],
    "sglang python/sglang/srt/models/dflash.py @7f151c5 (DFlashDraftModel)": [
        "architectures", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "attention_bias", "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings",
        "intermediate_size", "hidden_act", "block_size", "dflash_config.block_size",
        "dflash_config.target_layer_ids",
    ],
    "vllm vllm/model_executor/models/qwen3_dflash.py @036a00d (DFlashQwen3Model)": [
        "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
        "intermediate_size", "hidden_act", "rms_norm_eps", "attention_bias", "rope_theta",
        "max_position_embeddings", "layer_types", "sliding_window", "vocab_size", "dflash_config.mask_token_id",
    ],
    "vllm vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py @da84445 (get_eagle3_aux_layers_from_config)": [
        "eagle_aux_hidden_state_layer_ids",
    ],
}  # fmt: skip


def test_config_has_every_key_the_public_loaders_read(tmp_path: Path) -> None:
    target = tiny_target("qwen3", dtype=torch.float32)
    drafter = tiny_drafter(target, layers=3, block_size=16).float()
    drafter.save_pretrained(tmp_path / "src")
    export_drafter(tmp_path / "src", tmp_path / "out", target=str(tiny_tokenizer(tmp_path / "tok")))
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())

    missing = [f"{k} ({src})" for src, keys in LOADER_KEYS.items() for k in keys if _get(cfg, k) is _MISSING]
    assert not missing, missing
    lookup = functools.partial(_get, cfg)
    ids, c = drafter.config.target_layer_ids, drafter.config
    assert lookup("architectures") == ["DFlashDraftModel"] and lookup("model_type") == "qwen3"
    module, cls = str(lookup("auto_map.AutoModel")).split(".")
    assert (tmp_path / "out" / f"{module}.py").is_file() and cls == "DFlashDraftModel"
    assert (
        lookup("dflash_config.target_layer_ids") == ids and lookup("num_target_layers") == target.num_layers
    )
    assert lookup("eagle_aux_hidden_state_layer_ids") == [i + 1 for i in ids]  # vLLM numbers layer inputs
    assert lookup("dflash_config.mask_token_id") == c.mask_token_id
    assert lookup("dflash_config.mask_token") == f"tok{c.mask_token_id}"  # the tokenizer's string for that id
    assert lookup("block_size") == lookup("dflash_config.block_size") == 16
    assert lookup("layer_types") == ["full_attention"] * 3 and lookup("sliding_window") is None
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "hidden_act", "rms_norm_eps", "attention_bias", "rope_theta",
                "max_position_embeddings", "vocab_size"):  # fmt: skip
        assert lookup(key) == getattr(c, key), key


_MISSING = object()


def _get(cfg: dict[str, object], key: str) -> object:
    node: object = cfg
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node
