"""Export a trained drafter as a DFlash checkpoint that SGLang, vLLM and transformers load unchanged.

    flashdraft export RUN --to out/smollm2-dflash-b16 --dtype bfloat16
    flashdraft export RUN/checkpoints/step-00004000 --to out/d      # a step folder
    flashdraft export some/drafter --to out/d --overwrite           # a plain DFlash folder; replace out/d

Writes config.json (public DFlash layout: `architectures: ["DFlashDraftModel"]`, `block_size` at top
level and in `dflash_config`, the mask token's string for SGLang, the target layers in vLLM's
numbering, `auto_map` for transformers' AutoModel) + model.safetensors (z-lab key layout) +
modeling_dflash.py (this project's self-contained model; it runs only under trust_remote_code=True)
+ README.md with the SGLang / vLLM / transformers commands. The folder is assembled beside the
destination, loaded back and compared with the source at the exported dtype (weights and a forward
pass, bit-identical), and only then renamed into place. An existing non-empty destination is
refused unless --overwrite (then swapped atomically); a destination that holds the source or sits
inside it is always refused.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flashdraft.drafter import DFlashDrafter
from flashdraft.files import move_into_place, stage_dir

EXPORT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
MODELING_FILE = Path(__file__).with_name("modeling_dflash.py")  # copied into every export
# transformers' AutoModel(trust_remote_code=True) builds the model from the file shipped beside the weights
AUTO_MAP = {"AutoModel": "modeling_dflash.DFlashDraftModel"}
# Qwen3 config keys present in the public DFlash releases that our config does not model;
# engines have defaults for them, we write them so the key set matches the releases
RELEASE_DEFAULTS: dict[str, Any] = {"initializer_range": 0.02, "use_cache": True}
DEFAULT_TARGET_HF_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what `--target default` is a quantised copy of


@dataclass
class ExportResult:
    source: Path  # the DFlash folder that was read
    dest: Path
    dtype: str
    num_parameters: int
    max_abs_diff: float  # reloaded vs source forward at the exported dtype (0.0 when bit-identical)
    mask_token: str | None  # dflash_config.mask_token (None: the target's tokenizer has no string for the id)


def _step_of(path: Path) -> int:
    m = re.fullmatch(r"step-(\d+)", path.name)
    return int(m.group(1)) if m else -1


def resolve_checkpoint(source: str | os.PathLike[str]) -> Path:
    """The DFlash folder inside `source`: itself, its `drafter/`, or the newest run checkpoint's."""
    src = Path(source)
    if not src.exists():
        raise FileNotFoundError(f"{src}: no such folder")
    if (src / "config.json").is_file():
        return src
    if (src / "drafter" / "config.json").is_file():
        return src / "drafter"
    if (src / "checkpoints").is_dir():
        latest: Path | None
        try:
            from flashdraft.train.checkpoint import latest_checkpoint

            latest = latest_checkpoint(src)
        except ImportError:  # the training area not present: same rule, by hand
            steps = sorted((p for p in (src / "checkpoints").glob("step-*") if p.is_dir()), key=_step_of)
            latest = steps[-1] if steps else None
        if latest is None or not (Path(latest) / "drafter" / "config.json").is_file():
            raise FileNotFoundError(
                f"{src}: run folder has no complete checkpoint under checkpoints/step-*/drafter"
            )
        return Path(latest) / "drafter"
    raise FileNotFoundError(
        f"{src}: not a DFlash checkpoint (no config.json), a step folder (no drafter/config.json) "
        "or a run folder (no checkpoints/)"
    )


def target_from_run(checkpoint: Path) -> str | None:
    """The target named in the run's config.yaml (RUN/checkpoints/step-*/drafter -> RUN/config.yaml)."""
    for run in (checkpoint.parent.parent.parent, checkpoint.parent):
        cfg = run / "config.yaml"
        if cfg.is_file():
            import yaml

            try:
                raw = yaml.safe_load(cfg.read_text())
            except yaml.YAMLError:
                return None
            return _find_key(raw, "target")
    return None


def _find_key(node: Any, key: str) -> str | None:
    if isinstance(node, dict):
        if isinstance(node.get(key), str):
            return node[key]
        for v in node.values():
            found = _find_key(v, key)
            if found:
                return found
    return None


def check_destination(dest: Path, sources: list[Path], overwrite: bool) -> None:
    """Refuse a destination export would wreck: one holding a source or inside one (always), and an
    existing non-empty folder or a file (unless overwrite)."""
    for src in sources:
        if dest == src or dest in src.parents:
            raise ValueError(
                f"--to {dest} contains the source {src}: replacing it would delete the source; "
                "export to a folder outside it"
            )
        if src in dest.parents:
            raise ValueError(f"--to {dest} is inside the source {src}: export to a folder outside it")
    if overwrite or not (dest.exists() or dest.is_symlink()):
        return
    if not dest.is_dir():
        raise FileExistsError(f"--to {dest} exists and is not a folder: pass --overwrite to replace it")
    if any(dest.iterdir()):
        raise FileExistsError(
            f"--to {dest} is not empty: pass --overwrite to replace it, or export to a new folder"
        )


def load_tokenizer(target: str) -> Any | None:
    """The target's tokenizer, without loading its weights: "default", a .gguf file, a folder or a
    hub id (from the local cache when offline); None when none can be found."""
    from transformers import AutoTokenizer

    from flashdraft.target import DEFAULT_TARGET, default_target_path, gguf_cache_dir

    try:
        if target == DEFAULT_TARGET or target.endswith(".gguf"):
            folder, name = (
                default_target_path()
                if target == DEFAULT_TARGET
                else (Path(target).parent, Path(target).name)
            )
            cached = gguf_cache_dir(Path(folder) / name)  # the de-quantized copy holds the tokenizer too
            if cached is not None and (cached / "tokenizer_config.json").is_file():
                return AutoTokenizer.from_pretrained(str(cached))
            return AutoTokenizer.from_pretrained(str(folder), gguf_file=name)
        return AutoTokenizer.from_pretrained(target)
    except (OSError, ValueError, ImportError):
        return None


def mask_token_string(tokenizer: Any, mask_token_id: int) -> str | None:
    """The token string SGLang looks the mask up by (`tokenizer.get_vocab()[s]`), if one maps back to the id."""
    s = tokenizer.convert_ids_to_tokens(mask_token_id)
    return s if isinstance(s, str) and s and tokenizer.get_vocab().get(s) == mask_token_id else None


def release_config(drafter: DFlashDrafter, mask_token: str | None) -> None:
    """Add what the public loaders read beyond flashdraft's own keys (in place): `auto_map` to the
    shipped modeling file, `dflash_config.mask_token`, and the release keys engines expect."""
    cfg = drafter.config
    extra = {k: v for k, v in cfg.extra.items() if k != "custom_pipelines"}
    extra["auto_map"] = dict(AUTO_MAP)  # ours, whatever an earlier tool wrote
    dflash = {k: v for k, v in (extra.get("dflash_config") or {}).items() if k != "mask_token"}
    if mask_token is not None:
        dflash["mask_token"] = mask_token
    extra["dflash_config"] = dflash
    for k, v in RELEASE_DEFAULTS.items():
        extra.setdefault(k, v)
    extra.setdefault("max_window_layers", cfg.num_hidden_layers)
    drafter.config = dataclasses.replace(cfg, extra=extra)


def readme_text(dest: Path, target: str, cfg: Any, dtype: str, source: Path, mask_token: str | None) -> str:
    spec = json.dumps({"method": "dflash", "model": str(dest), "num_speculative_tokens": cfg.block_size - 1})
    mask = (
        f"{cfg.mask_token_id} (`{mask_token}`)"
        if mask_token is not None
        else f"{cfg.mask_token_id} (no token string in the target's tokenizer: SGLang, which looks the "
        "mask up by its string, cannot serve this drafter; vLLM, transformers and flashdraft use the id)"
    )
    return f"""# DFlash drafter

Exported by `flashdraft export` from `{source}`.

- block size: {cfg.block_size} ({cfg.block_size - 1} draft tokens per round)
- drafter layers: {cfg.num_hidden_layers}, hidden size {cfg.hidden_size}
- target layers read: {cfg.target_layer_ids} of {cfg.num_target_layers}
- mask token id: {mask}
- weights: {dtype}, `model.safetensors` (public DFlash key layout)
- `modeling_dflash.py`: the model for transformers' `AutoModel`; it runs only when you pass
  `trust_remote_code=True`. SGLang and vLLM do not use it.

The drafter has no embedding or LM head: it uses the target's. Serve it with the target it
was trained for (`{target}`).

## SGLang (not run here: these machines cannot run SGLang)

```bash
python -m sglang.launch_server \\
    --model-path {target} \\
    --speculative-algorithm DFLASH \\
    --speculative-draft-model-path {dest} \\
    --speculative-num-draft-tokens {cfg.block_size} \\
    --dtype {dtype}
```

## vLLM (not run here: these machines cannot run vLLM)

DFlash drafts a block without a causal mask, so vLLM needs an attention backend that has one.

```bash
vllm serve {target} \\
    --dtype {dtype} \\
    --attention-backend flash_attn \\
    --speculative-config '{spec}'
```

## transformers (greedy reference decoding; slow, for checking)

```python
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

draft = AutoModel.from_pretrained("{dest}", trust_remote_code=True, dtype="auto").eval()
target = AutoModelForCausalLM.from_pretrained("{target}", dtype="auto").eval()
tokenizer = AutoTokenizer.from_pretrained("{target}")
ids = tokenizer.apply_chat_template([{{"role": "user", "content": "Hello"}}], add_generation_prompt=True,
                                    return_tensors="pt")
out = draft.spec_generate(target=target, input_ids=ids, max_new_tokens=256, temperature=0.0,
                          stop_token_ids=[tokenizer.eos_token_id])
print(tokenizer.decode(out[0]))
```

## flashdraft (run here)

```bash
flashdraft serve --target <flashdraft target> --drafter {dest}
```
"""


def _verify(reference: DFlashDrafter, folder: Path, dtype: torch.dtype) -> float:
    """Load `folder` back and compare weights and one forward with `reference` (already at dtype)."""
    loaded = DFlashDrafter.from_pretrained(folder)
    ref_state, new_state = reference.state_dict(), loaded.state_dict()
    for k, v in ref_state.items():
        w = new_state[k]
        if w.dtype != dtype or not torch.equal(w, v):
            raise ValueError(f"{folder}: weight {k} differs after reload ({w.dtype} vs {v.dtype})")
    saved, wanted = loaded.config.to_json_dict(), reference.config.to_json_dict()
    saved.pop("dtype"), wanted.pop("dtype")  # the source's dtype vs the exported one: differs on purpose
    if saved != wanted:
        changed = sorted(k for k in saved.keys() | wanted.keys() if saved.get(k) != wanted.get(k))
        raise ValueError(f"{folder}: config.json does not round-trip (fields {changed})")
    cfg = reference.config
    g = torch.Generator().manual_seed(0)
    ctx, block = 7, cfg.block_size
    feats = torch.randn(1, ctx, len(cfg.target_layer_ids) * cfg.hidden_size, generator=g).to(
        dtype
    )  # [1, c, k·H]
    noise = torch.randn(1, block, cfg.hidden_size, generator=g).to(dtype)  # [1, B, H]
    pos = torch.arange(ctx + block)[None]  # [1, c + B]
    with torch.no_grad():
        a, b = reference(feats, noise, pos), loaded(feats, noise, pos)
    diff = float((a.float() - b.float()).abs().max())
    if not torch.equal(a, b):
        raise ValueError(f"{folder}: reloaded drafter output differs from the source (max |diff| {diff})")
    return diff


def export_drafter(
    source: str | os.PathLike[str],
    to: str | os.PathLike[str],
    *,
    dtype: str = "bfloat16",
    target: str | None = None,
    overwrite: bool = False,
) -> ExportResult:
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not exportable: use one of {', '.join(EXPORT_DTYPES)}")
    torch_dtype = EXPORT_DTYPES[dtype]
    src = resolve_checkpoint(source)
    dest = Path(to).resolve()
    check_destination(dest, [Path(source).resolve(), src.resolve()], overwrite)
    drafter = DFlashDrafter.from_pretrained(src)
    target = target or target_from_run(src)
    mask_token = _mask_token(drafter, target)
    release_config(drafter, mask_token)
    reference = copy.deepcopy(drafter).to(torch_dtype).eval()
    shown = DEFAULT_TARGET_HF_ID if target == "default" else target or "<target model id or path>"

    stage = stage_dir(dest, "export")
    try:
        folder = drafter.save_pretrained(stage / "ckpt", dtype=torch_dtype)
        shutil.copyfile(MODELING_FILE, folder / MODELING_FILE.name)
        (folder / "README.md").write_text(readme_text(dest, shown, drafter.config, dtype, src, mask_token))
        diff = _verify(reference, folder, torch_dtype)
        move_into_place(folder, dest, overwrite=overwrite)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return ExportResult(src, dest, dtype, drafter.num_parameters(), diff, mask_token)


def _mask_token(drafter: DFlashDrafter, target: str | None) -> str | None:
    """dflash_config.mask_token: the string of mask_token_id in the target's tokenizer, else the one an
    earlier export wrote; None when the tokenizer has no string for the id."""
    tokenizer = load_tokenizer(target) if target else None
    if tokenizer is not None:
        return mask_token_string(tokenizer, drafter.config.mask_token_id)
    earlier = (drafter.config.extra.get("dflash_config") or {}).get("mask_token")
    if isinstance(earlier, str) and earlier:
        return earlier
    raise ValueError(
        f"cannot load the tokenizer of target {target or '(none named in the run config)'} to write "
        "dflash_config.mask_token (SGLang finds the mask token by its string): pass --target with the "
        "target's folder, hub id, .gguf file or 'default'"
    )
