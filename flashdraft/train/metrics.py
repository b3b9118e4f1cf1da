"""The metrics logger: one JSON line per logged step (always), TensorBoard (default on), W&B (optional).

    logger = MetricsLogger(run_dir, tensorboard=True, wandb_project=None)
    logger.log(step, {"loss": 2.31, "lr": 6e-4, "slot_acc": [..]})   # plain floats only
    logger.close()

Values must already be host floats (the trainer reads the device once per log interval).
Lists are written as lists to JSONL and as `name/i` scalars to TensorBoard.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf; keep it visible rather than dropping the line
    if isinstance(v, list):
        return [_clean(x) for x in v]
    return v


class MetricsLogger:
    def __init__(
        self, run_dir: str | os.PathLike[str], *, tensorboard: bool = True, wandb_project: str | None = None,
        config: dict[str, Any] | None = None, enabled: bool = True,
    ) -> None:  # fmt: skip
        self.run_dir = Path(run_dir)
        self.enabled = enabled  # only rank 0 writes in data-parallel runs
        self.path = self.run_dir / METRICS_FILE
        self._tb: Any = None
        self._wandb: Any = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
            except ImportError as e:  # tensorboard is a dependency, but do not die over telemetry
                print(
                    f"warning: TensorBoard disabled ({e}); metrics still go to {self.path}", file=sys.stderr
                )
        if wandb_project:
            try:
                import wandb
            except ImportError:
                raise RuntimeError(
                    f"telemetry.wandb_project={wandb_project!r} but wandb is not installed: "
                    "pip install wandb, or unset telemetry.wandb_project"
                ) from None
            self._wandb = wandb.init(
                project=wandb_project, dir=str(self.run_dir), config=config, resume="allow"
            )

    def truncate_after(self, step: int) -> None:
        """Drop lines logged after `step` (a resumed run re-logs them); atomic rewrite."""
        if not self.enabled or not self.path.is_file():
            return
        keep = []
        for line in self.path.read_text().splitlines():
            try:
                if int(json.loads(line).get("step", -1)) <= step:
                    keep.append(line)
            except (json.JSONDecodeError, ValueError, TypeError):
                continue  # a line cut by a kill
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(k + "\n" for k in keep))
        tmp.replace(self.path)

    def log(self, step: int, values: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": int(step), "time": time.time(), **{k: _clean(v) for k, v in values.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for k, v in values.items():
                if isinstance(v, list):
                    for i, x in enumerate(v):
                        if isinstance(x, (int, float)):
                            self._tb.add_scalar(f"{k}/{i}", x, step)
                elif isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in values.items() if isinstance(v, (int, float))}, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every object of a JSONL log (a missing file is empty; lines cut by a kill are skipped)."""
    out = []
    p = Path(path)
    if p.is_file():
        for line in p.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def read_metrics(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All logged lines of a run."""
    return read_jsonl(Path(run_dir) / METRICS_FILE)
