"""Run folders and checkpoints (the layout is a contract with eval and serve/export).

    RUN/config.yaml  command.txt  metrics.jsonl  tensorboard/  heartbeat.json (flashdraft/train/lifecycle.py)
    RUN/checkpoints/step-00001234/drafter/                    plain DFlash folder (from_pretrained works)
    RUN/checkpoints/step-00001234/trainer_state.safetensors   optimizer tensors, RNG states
    RUN/checkpoints/step-00001234/trainer_state.json          step, epoch, data position, config hash, ...
    RUN/eval/log.jsonl                                        written by the evaluator only

A checkpoint is written into a temp folder and renamed: a `step-*` folder that exists is complete.

    list_checkpoints("runs/x")       # [Path(.../step-00001000), ...] sorted by step
    latest_checkpoint("runs/x")      # the newest complete one, or None
    resume_checkpoint("runs/x")      # the newest one whose files are intact (--resume), or None
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flashdraft.files import apply_umask, stage_dir

CHECKPOINTS = "checkpoints"
DRAFTER = "drafter"
STATE_TENSORS = "trainer_state.safetensors"
STATE_JSON = "trainer_state.json"
_STEP_RE = re.compile(r"^step-(\d{8})$")


def checkpoint_dir(run_dir: str | os.PathLike[str], step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"step-{step:08d}"


def step_of(checkpoint: str | os.PathLike[str]) -> int:
    m = _STEP_RE.match(Path(checkpoint).name)
    if not m:
        raise ValueError(f"{checkpoint}: not a checkpoint folder (expected a name like step-00001234)")
    return int(m.group(1))


def list_checkpoints(run_dir: str | os.PathLike[str]) -> list[Path]:
    """Complete checkpoint folders of a run, sorted by step (temp folders are never listed)."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [
        p for p in root.iterdir() if p.is_dir() and _STEP_RE.match(p.name) and (p / STATE_JSON).is_file()
    ]
    return sorted(found, key=step_of)


def latest_checkpoint(run_dir: str | os.PathLike[str]) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def checkpoint_problem(checkpoint: str | os.PathLike[str]) -> str | None:
    """Why a checkpoint folder cannot be resumed from ("drafter/model.safetensors: truncated ..."), or None.

    Reads the JSON files and the safetensors headers only: a truncated safetensors file fails its header check."""
    from safetensors import safe_open

    ckpt = Path(checkpoint)
    for part in (STATE_JSON, f"{DRAFTER}/config.json", STATE_TENSORS, f"{DRAFTER}/model.safetensors"):
        path = ckpt / part
        if not path.is_file():
            return f"{part} is missing"
        try:
            if part.endswith(".json"):
                info = json.loads(path.read_text())
                if part == STATE_JSON and (not isinstance(info, dict) or "state" not in info):
                    return f"{part} has no 'state'"
            else:
                with safe_open(str(path), framework="pt"):
                    pass
        except json.JSONDecodeError as e:
            return f"{part}: invalid JSON ({e.msg})"
        except Exception as e:  # noqa: BLE001 — safetensors' own error type: a truncated or corrupt file
            return f"{part}: unreadable ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
    return None


def resume_checkpoint(run_dir: str | os.PathLike[str], warn: Any = None) -> Path | None:
    """The newest checkpoint that is intact; each newer broken one is skipped with one line to `warn`."""
    for ckpt in reversed(list_checkpoints(run_dir)):
        problem = checkpoint_problem(ckpt)
        if problem is None:
            return ckpt
        if warn is not None:
            warn(f"warning: --resume: skipping {ckpt} ({problem}); trying the one before it")
    return None


# drafter config.json field -> the TrainConfig setting that decides it (None: the target does)
ARCHITECTURE = {
    "num_hidden_layers": "model.num_layers", "block_size": "model.block_size",
    "target_layer_ids": "model.target_layer_ids", "mask_token_id": "model.mask_token_id",
    "num_attention_heads": "model.num_attention_heads", "num_key_value_heads": "model.num_key_value_heads",
    "head_dim": "model.head_dim", "intermediate_size": "model.intermediate_size",
    "hidden_size": None, "vocab_size": None, "num_target_layers": None,
}  # fmt: skip


def architecture_mismatch(checkpoint: str | os.PathLike[str], config: Any) -> str | None:
    """One line naming the first drafter setting where `checkpoint` differs from `config` (a DFlashConfig)."""
    from flashdraft.drafter import DFlashConfig

    path = Path(checkpoint) / DRAFTER / "config.json"
    saved = DFlashConfig.from_json_dict(json.loads(path.read_text()), source=str(path))
    for key, setting in ARCHITECTURE.items():
        theirs, mine = getattr(saved, key), getattr(config, key)
        if theirs == mine:
            continue
        fix = f"set {setting}={theirs}" if setting else "use the target it was trained with (model.target)"
        return (
            f"--resume: {path} has {key}={theirs}, this run's drafter has {mine}: {fix} to continue it, "
            "or start a new run_dir"
        )
    return None


# ----------------------------------------------------------------------------- nested state ↔ flat tensors


def flatten_state(
    obj: Any, prefix: str = "", tensors: dict[str, torch.Tensor] | None = None
) -> tuple[Any, dict[str, torch.Tensor]]:
    """A nested dict/list with tensors → (JSON skeleton with {"__tensor__": key}, {key: tensor})."""
    tensors = {} if tensors is None else tensors
    if isinstance(obj, torch.Tensor):
        key = prefix or "tensor"
        tensors[key] = obj.detach().cpu().contiguous()
        return {"__tensor__": key}, tensors
    if isinstance(obj, dict):
        if not all(isinstance(k, (str, int)) for k in obj):
            raise TypeError(f"{prefix}: only str/int keys can be saved")
        # int keys (optimizer param indices) are tagged so they come back as ints
        skel = {("__int__" + str(k) if isinstance(k, int) else k): flatten_state(v, f"{prefix}.{k}" if prefix else str(k), tensors)[0] for k, v in obj.items()}  # fmt: skip
        return skel, tensors
    if isinstance(obj, (list, tuple)):
        return [flatten_state(v, f"{prefix}.{i}", tensors)[0] for i, v in enumerate(obj)], tensors
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj, tensors
    raise TypeError(f"{prefix}: cannot save a {type(obj).__name__} in trainer state")


def unflatten_state(skel: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(skel, dict):
        if set(skel) == {"__tensor__"}:
            return tensors[skel["__tensor__"]]
        return {
            (int(k[7:]) if k.startswith("__int__") else k): unflatten_state(v, tensors)
            for k, v in skel.items()
        }
    if isinstance(skel, list):
        return [unflatten_state(v, tensors) for v in skel]
    return skel


# ----------------------------------------------------------------------------- save / load


@dataclass
class TrainerState:
    """What a checkpoint holds besides the drafter weights."""

    info: dict[str, Any]  # step, epoch, data position, tokens seen, config hash, ... (JSON)
    state: dict[str, Any]  # nested tensors and values: optimizer, RNG states, anchor sampler


class StateDictDrafter:
    """What `save_checkpoint` needs from a drafter, built from a full state dict (FSDP2's gathered shards, or
    the EMA's averages): a plain CPU copy of the drafter with those weights."""

    def __init__(self, drafter: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
        self.drafter, self.state = drafter, state

    def save_pretrained(self, path: Path) -> Path:
        from flashdraft.drafter import DFlashDrafter

        plain = DFlashDrafter(self.drafter.config)  # type: ignore[arg-type]
        plain.load_state_dict(self.state, strict=True)
        return plain.save_pretrained(path)


def save_checkpoint(run_dir: str | os.PathLike[str], step: int, drafter: Any, state: TrainerState) -> Path:
    """Write drafter + trainer state into a temp folder, then rename it to step-XXXXXXXX."""
    from safetensors.torch import save_file

    dest = checkpoint_dir(run_dir, step)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = stage_dir(dest)  # not mkdtemp: that one is 0700 whatever the umask
    try:
        drafter.save_pretrained(tmp / DRAFTER)  # master-weight dtype: resume must be exact
        skel, tensors = flatten_state(state.state)
        save_file(tensors, str(tmp / STATE_TENSORS))
        apply_umask(tmp / STATE_TENSORS)  # safetensors makes it 0600
        info = {**state.info, "step": step, "state": skel}
        (tmp / STATE_JSON).write_text(json.dumps(info, indent=1) + "\n")
        if dest.exists():  # re-saving a step (a SIGUSR1 right at a scheduled checkpoint): replace
            shutil.rmtree(dest)
        tmp.rename(dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def load_trainer_state(checkpoint: str | os.PathLike[str]) -> TrainerState:
    from safetensors.torch import load_file

    ckpt = Path(checkpoint)
    path = ckpt / STATE_JSON
    try:
        info = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: missing; {ckpt} is not a complete checkpoint") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: line {e.lineno}: invalid JSON ({e.msg})") from None
    tensors = load_file(str(ckpt / STATE_TENSORS))
    skel = info.pop("state")
    return TrainerState(info=info, state=unflatten_state(skel, tensors))


def load_drafter_weights(checkpoint: str | os.PathLike[str], drafter: torch.nn.Module) -> None:
    """Copy a checkpoint's drafter weights into an existing drafter (keeps its dtype/device)."""
    from safetensors.torch import load_file

    state = load_file(str(Path(checkpoint) / DRAFTER / "model.safetensors"))
    drafter.load_state_dict(state, strict=True)


# ----------------------------------------------------------------------------- retention


def best_checkpoint_step(run_dir: str | os.PathLike[str], metric: str = "tau_chain") -> int | None:
    """The step with the highest `metric` in RUN/eval/log.jsonl, if the evaluator has results."""
    log = Path(run_dir) / "eval" / "log.jsonl"
    if not log.is_file():
        return None
    best: tuple[float, int] | None = None
    for line in log.read_text().splitlines():
        try:
            rec = json.loads(line)
            value, step = float(rec[metric]), int(rec["step"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            continue
        if best is None or value > best[0]:
            best = (value, step)
    return None if best is None else best[1]


def prune_checkpoints(
    run_dir: str | os.PathLike[str], keep_last: int, best_metric: str = "tau_chain"
) -> list[Path]:
    """Delete all but the newest `keep_last` checkpoints and the best one by eval; returns the deleted."""
    found = list_checkpoints(run_dir)
    keep = set(found[-keep_last:]) if keep_last > 0 else set()
    best = best_checkpoint_step(run_dir, best_metric)
    if best is not None:
        keep.add(checkpoint_dir(run_dir, best))
    deleted = []
    for p in found:
        if p not in keep:
            shutil.rmtree(p, ignore_errors=True)
            deleted.append(p)
    return deleted
