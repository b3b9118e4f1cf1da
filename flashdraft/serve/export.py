"""Export a trained drafter as a clean DFlash checkpoint that SGLang and vLLM load unchanged.

    flashdraft export RUN --to out/smollm2-dflash-b16 --dtype bfloat16
    flashdraft export RUN/checkpoints/step-00004000 --to out/d      # a step folder
    flashdraft export some/drafter --to out/d                       # a plain DFlash folder

Writes config.json (public DFlash layout: `architectures: ["DFlashDraftModel"]`, `block_size`
at top level and in `dflash_config`, no `auto_map` / remote code) + model.safetensors (z-lab
key layout) + README.md with the SGLang and vLLM launch commands. The folder is assembled
beside the destination, loaded back and compared with the source at the exported dtype
(weights and a forward pass, bit-identical), and only then renamed into place.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flashdraft.drafter import DFlashDrafter

EXPORT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# config keys that would make an engine fetch or run code shipped with the checkpoint
REMOTE_CODE_KEYS = ("auto_map", "custom_pipelines")
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


def clean_config(drafter: DFlashDrafter) -> None:
    """Drop remote-code hooks and add the release keys the engines expect (in place)."""
    cfg = drafter.config
    extra = {k: v for k, v in cfg.extra.items() if k not in REMOTE_CODE_KEYS}
    for k, v in RELEASE_DEFAULTS.items():
        extra.setdefault(k, v)
    extra.setdefault("max_window_layers", cfg.num_hidden_layers)
    drafter.config = dataclasses.replace(cfg, extra=extra)


def readme_text(dest: Path, target: str, cfg: Any, dtype: str, source: Path) -> str:
    spec = json.dumps({"method": "dflash", "model": str(dest), "num_speculative_tokens": cfg.block_size - 1})
    return f"""# DFlash drafter

Exported by `flashdraft export` from `{source}`.

- block size: {cfg.block_size} ({cfg.block_size - 1} draft tokens per round)
- drafter layers: {cfg.num_hidden_layers}, hidden size {cfg.hidden_size}
- target layers read: {cfg.target_layer_ids} of {cfg.num_target_layers}
- mask token id: {cfg.mask_token_id}
- weights: {dtype}, `model.safetensors` (public DFlash key layout); no remote code.

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

```bash
vllm serve {target} \\
    --dtype {dtype} \\
    --speculative-config '{spec}'
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
) -> ExportResult:
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not exportable: use one of {', '.join(EXPORT_DTYPES)}")
    torch_dtype = EXPORT_DTYPES[dtype]
    src = resolve_checkpoint(source)
    dest = Path(to).resolve()
    if dest == src.resolve():
        raise ValueError(f"--to {dest} is the source folder: export to a new folder")
    drafter = DFlashDrafter.from_pretrained(src)
    clean_config(drafter)
    reference = copy.deepcopy(drafter).to(torch_dtype).eval()
    target = target or target_from_run(src) or "<target model id or path>"
    if target == "default":
        target = DEFAULT_TARGET_HF_ID

    dest.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{dest.name}.export-", dir=dest.parent))
    try:
        folder = drafter.save_pretrained(stage / "ckpt", dtype=torch_dtype)
        (folder / "README.md").write_text(readme_text(dest, target, drafter.config, dtype, src))
        diff = _verify(reference, folder, torch_dtype)
        if dest.exists():  # replace atomically enough: old moved aside, new renamed in, old removed
            old = stage / "old"
            dest.rename(old)
            folder.rename(dest)
        else:
            folder.rename(dest)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return ExportResult(src, dest, dtype, drafter.num_parameters(), diff)
