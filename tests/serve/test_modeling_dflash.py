"""The modeling file shipped in exports (flashdraft/serve/modeling_dflash.py), loaded the way the public
DFlash README loads a drafter — `AutoModel.from_pretrained(path, trust_remote_code=True)` — must compute
what flashdraft's DFlashDrafter computes, and its `spec_generate` must give the target's greedy tokens."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from flashdraft.drafter import DFlashDrafter, DrafterCache
from flashdraft.serve.export import AUTO_MAP, MODELING_FILE, export_drafter
from tests.conftest import tiny_drafter, tiny_target
from tests.serve.test_export import tiny_tokenizer
from tests.test_drafter import inputs, make, small_cfg


def auto_model(folder: Path, dtype: torch.dtype | str) -> Any:
    from transformers import AutoModel

    return AutoModel.from_pretrained(folder, trust_remote_code=True, dtype=dtype).eval()


def as_remote_code_folder(drafter: DFlashDrafter, folder: Path) -> Path:
    """What export writes for transformers, without export's tokenizer lookup: weights, config with auto_map,
    the modeling file."""
    drafter.save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "auto_map": AUTO_MAP}))
    shutil.copyfile(MODELING_FILE, folder / MODELING_FILE.name)
    return folder


def test_automodel_loads_an_export_and_matches_the_drafter(tmp_path: Path) -> None:
    target = tiny_target("qwen3", dtype=torch.float32)  # 4 query / 2 KV heads: grouped-query attention
    src = tmp_path / "src"
    tiny_drafter(target, layers=2, block_size=8).float().save_pretrained(src)
    out = tmp_path / "dflash-export"
    export_drafter(src, out, dtype="float32", target=str(tiny_tokenizer(tmp_path / "tok")))

    model = auto_model(out, torch.float64)
    assert type(model).__name__ == "DFlashDraftModel" and model.dtype == torch.float64
    assert (model.block_size, model.mask_token_id) == (8, 96)
    ours = DFlashDrafter.from_pretrained(out, dtype=torch.float64)
    theirs = dict(model.named_parameters())
    assert set(theirs) == set(ours.state_dict())
    assert all(torch.equal(theirs[k], v) for k, v in ours.state_dict().items())
    th, ne, pos = inputs(ours.config, b=2, c=6, q=8, dtype=torch.float64)
    with torch.no_grad():
        assert torch.equal(model(position_ids=pos, noise_embedding=ne, target_hidden=th), ours(th, ne, pos))
        # position ids given once for the batch, as the reference's generate loop passes them
        assert torch.equal(
            model(position_ids=pos[0], noise_embedding=ne, target_hidden=th), ours(th, ne, pos)
        )

    model32 = auto_model(out, "auto")  # the exported dtype
    ours32 = DFlashDrafter.from_pretrained(out)
    th, ne, pos = inputs(ours32.config, c=6, q=8)
    with torch.no_grad():
        a, b = model32(position_ids=pos, noise_embedding=ne, target_hidden=th), ours32(th, ne, pos)
    assert model32.dtype == torch.float32 and float((a - b).abs().max()) <= 1e-6


class ListCache:
    """The part of transformers' Cache the reference's generate loop uses: update() appends, crop() cuts."""

    def __init__(self) -> None:
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx in self.k:
            k, v = torch.cat([self.k[layer_idx], k], dim=2), torch.cat([self.v[layer_idx], v], dim=2)
        self.k[layer_idx], self.v[layer_idx] = k, v
        return k, v

    def crop(self, n: int) -> None:
        for i in self.k:
            self.k[i], self.v[i] = self.k[i][:, :, :n], self.v[i][:, :, :n]


def test_kv_cache_rounds_match_the_drafter_cache(tmp_path: Path) -> None:
    from transformers import DynamicCache

    cfg = small_cfg(block_size=4)
    d = make(cfg, torch.float64)
    model = auto_model(as_remote_code_folder(d, tmp_path / "d"), torch.float64)
    th, ne, _ = inputs(cfg, b=1, c=9, q=4, dtype=torch.float64)
    ours, theirs = DrafterCache.empty(cfg.num_hidden_layers), ListCache()
    with torch.no_grad():
        # round 1: 6 context rows + the block; round 2: 3 new context rows + the next block
        a = d(th[:, :6], ne, torch.arange(10)[None], cache=ours)
        b = model(
            position_ids=torch.arange(10)[None],
            noise_embedding=ne,
            target_hidden=th[:, :6],
            past_key_values=theirs,
        )
        assert torch.equal(a, b)
        theirs.crop(6)  # the caller drops the block's K/V, as the reference loop does
        a = d(th[:, 6:], ne, torch.arange(6, 13)[None], cache=ours)
        b = model(
            position_ids=torch.arange(6, 13)[None],
            noise_embedding=ne,
            target_hidden=th[:, 6:],
            past_key_values=theirs,
        )
        assert torch.equal(a, b)
        # transformers' own DynamicCache takes the same calls (update(k, v, layer_idx))
        c = model(
            position_ids=torch.arange(10)[None],
            noise_embedding=ne,
            target_hidden=th[:, :6],
            past_key_values=DynamicCache(),
        )
        assert torch.equal(c, d(th[:, :6], ne, torch.arange(10)[None]))


@pytest.mark.parametrize(
    "kw",
    [
        {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 3},
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
        {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 16}},
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}},
        {"attention_bias": True, "rope_theta": 5000.0},
    ],
)  # fmt: skip
def test_config_variants_match(tmp_path: Path, kw: dict[str, Any]) -> None:
    cfg = small_cfg(**kw)
    d = make(cfg, torch.float64)
    if cfg.attention_bias:
        with torch.no_grad():
            for n, p in d.named_parameters():
                if n.endswith("bias"):
                    p.normal_()
    model = auto_model(as_remote_code_folder(d, tmp_path / "d"), torch.float64)
    th, ne, pos = inputs(cfg, c=7, q=4, dtype=torch.float64)
    with torch.no_grad():
        assert torch.equal(
            model(position_ids=pos + 20, noise_embedding=ne, target_hidden=th), d(th, ne, pos + 20)
        )


def test_bad_inputs_are_refused(tmp_path: Path) -> None:
    cfg = small_cfg()
    model = auto_model(as_remote_code_folder(make(cfg), tmp_path / "d"), torch.float32)
    th, ne, pos = inputs(cfg)
    with pytest.raises(ValueError, match="expects 96"):
        model(position_ids=pos, noise_embedding=ne, target_hidden=th[..., :-1])
    with pytest.raises(ValueError, match="expected context 5 \\+ block 4"):
        model(position_ids=pos[:, 1:], noise_embedding=ne, target_hidden=th)
    with pytest.raises(ValueError, match="is_causal=False"):
        model(position_ids=pos, noise_embedding=ne, target_hidden=th, is_causal=True)


def greedy_ar(hf_model: Any, ids: torch.Tensor, n: int) -> list[int]:
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, hf_model(ids).logits[:, -1:].argmax(-1)], dim=1)
    return ids[0].tolist()


def test_spec_generate_gives_the_targets_greedy_tokens(tmp_path: Path) -> None:
    target = tiny_target("llama", dtype=torch.float64)
    model = auto_model(
        as_remote_code_folder(tiny_drafter(target, block_size=4).double(), tmp_path / "d"), torch.float64
    )
    for prompt in ([1, 5, 9, 22, 40], [3], [7, 7, 7, 7, 7, 7, 7, 60]):
        ids = torch.tensor([prompt])
        out = model.spec_generate(target=target.model, input_ids=ids, max_new_tokens=23, stop_token_ids=None)
        assert out[0].tolist() == greedy_ar(target.model, ids, 23)
    with pytest.raises(ValueError, match="temperature=0.0"):
        model.spec_generate(target=target.model, input_ids=ids, max_new_tokens=4, temperature=0.7)


def test_spec_generate_accepting_whole_blocks(tmp_path: Path) -> None:
    """A target whose head always prefers token 7 (a bias on lm_head): the drafter, which uses that head,
    drafts 7s and every draft is accepted — the multi-token path, the length cap mid-block and stop tokens."""
    target = tiny_target("llama", dtype=torch.float64)
    head = target.model.lm_head
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True, dtype=torch.float64)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.zero_()
        biased.bias[7] = 1e4
    target.model.lm_head = biased
    model = auto_model(
        as_remote_code_folder(tiny_drafter(target, block_size=4).double(), tmp_path / "d"), torch.float64
    )
    ids = torch.tensor([[1, 2, 3]])
    out = model.spec_generate(target=target.model, input_ids=ids, max_new_tokens=10, stop_token_ids=[2])
    assert out[0].tolist() == [1, 2, 3] + [7] * 10 == greedy_ar(target.model, ids, 10)
    out = model.spec_generate(target=target.model, input_ids=ids, max_new_tokens=10, stop_token_ids=[7])
    assert out[0].tolist() == [1, 2, 3, 7]  # ends at (and keeps) the first stop token


SHIPPED = Path(__file__).resolve().parents[2] / "models" / "smollm2-135m-instruct-dflash-b16"


@pytest.mark.skipif(
    not (SHIPPED / "model.safetensors").is_file(), reason="the shipped drafter is not in this checkout"
)
def test_shipped_drafter_loads_through_automodel() -> None:
    assert (SHIPPED / "modeling_dflash.py").read_bytes() == MODELING_FILE.read_bytes()  # the copy is current
    cfg = json.loads((SHIPPED / "config.json").read_text())
    assert (
        cfg["auto_map"] == AUTO_MAP and cfg["dflash_config"]["mask_token"] == "ectable"
    )  # SmolLM2's row 49151
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [
        i + 1 for i in cfg["dflash_config"]["target_layer_ids"]
    ]
    model = auto_model(SHIPPED, torch.float64)
    ours = DFlashDrafter.from_pretrained(SHIPPED, dtype=torch.float64)
    th, ne, pos = inputs(ours.config, b=1, c=6, q=16, dtype=torch.float64)
    with torch.no_grad():
        assert torch.equal(model(position_ids=pos, noise_embedding=ne, target_hidden=th), ours(th, ne, pos))
