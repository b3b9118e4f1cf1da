"""Telemetry: the metrics logger plus extra readings merged into every logged line.

    flashdraft train cfg.yaml telemetry.wandb_project=my-drafters telemetry.gpu=true

    logger = TelemetryLogger(run_dir, providers=[source.take_stats, GpuStats(device)], wandb_project=None)
    logger.log(step, {"loss": 2.3})    # + pipeline/*, gpu0/util_pct, cuda/allocated_gb, ... as host floats

JSONL and TensorBoard always (MetricsLogger), Weights & Biases only when a project is set
(imported lazily, never required). A resumed run drops the steps after its checkpoint from both
metrics.jsonl and the TensorBoard event files, so replayed steps are not shown twice. On CUDA:
NVML per GPU (utilisation, memory, power, temperature) when `pynvml` (package nvidia-ml-py)
imports, else one log line saying it is skipped; and the CUDA caching allocator's allocated /
reserved / peak bytes and fragmentation (1 − allocated/reserved). Every value is read once per log line and handed on as a Python float.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from flashdraft.config import ConfigError
from flashdraft.train.metrics import MetricsLogger

Provider = Callable[[], dict[str, float]]
_GB = 1024**3


def _scalar(v: Any) -> Any:
    """A logged value as a detached host scalar (tensors are read here, once)."""
    if isinstance(v, torch.Tensor):
        return v.detach().cpu().item() if v.numel() == 1 else v.detach().cpu().tolist()
    if isinstance(v, (list, tuple)):
        return [_scalar(x) for x in v]
    return v


class TelemetryLogger(MetricsLogger):
    """A MetricsLogger that adds the readings of `providers` to every logged line."""

    def __init__(
        self, run_dir: str | os.PathLike[str], *, providers: list[Provider] | None = None,
        tensorboard: bool = True, wandb_project: str | None = None, config: dict[str, Any] | None = None,
        enabled: bool = True,
    ) -> None:  # fmt: skip
        if wandb_project and enabled and importlib.util.find_spec("wandb") is None:
            raise ConfigError(
                f"telemetry.wandb_project={wandb_project!r} but the wandb package is not installed: "
                "pip install wandb, or drop telemetry.wandb_project (JSONL and TensorBoard are always written)"
            )
        super().__init__(
            run_dir, tensorboard=tensorboard, wandb_project=wandb_project, config=config, enabled=enabled
        )
        self.providers = list(providers or [])

    def truncate_after(self, step: int) -> None:
        """As MetricsLogger's, and the TensorBoard event files too (the writer is reopened on a fresh file)."""
        super().truncate_after(step)
        if self._tb is None:
            return
        from torch.utils.tensorboard import SummaryWriter

        log_dir = self._tb.log_dir
        self._tb.close()
        for path in sorted(Path(log_dir).glob("events.out.tfevents.*")):
            truncate_event_file(path, step)
        self._tb = SummaryWriter(log_dir)

    def log(self, step: int, values: dict[str, Any]) -> None:
        merged = dict(values)
        for p in self.providers:
            merged.update(p())  # providers run on every rank (they may reset interval counters)
        super().log(step, {k: _scalar(v) for k, v in merged.items()})


def truncate_event_file(path: Path, step: int) -> int:
    """Drop the summaries logged after `step` from one TensorBoard event file (temp file + rename; the file is
    left alone when nothing is dropped). Returns how many events were dropped."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.summary.writer.record_writer import RecordWriter

    keep, dropped = [], 0
    for raw in RawEventFileLoader(str(path)).Load():  # a record cut by a kill ends the file
        event = Event.FromString(raw)
        if event.HasField("summary") and event.step > step:
            dropped += 1
        else:
            keep.append(raw)
    if dropped:
        tmp = path.with_name(
            f".truncating-{os.getpid()}.tmp"
        )  # no "tfevents" in the name: TensorBoard skips it
        with tmp.open("wb") as f:
            writer = RecordWriter(f)
            for raw in keep:
                writer.write(raw)
        tmp.replace(path)
    return dropped


class GpuStats:
    """NVML readings of every visible GPU + this process's CUDA allocator stats, as host floats."""

    def __init__(self, device: torch.device | str, nvml: bool = True) -> None:
        self.device = torch.device(device)
        self._nvml: Any = None
        self._handles: list[Any] = []
        if self.device.type != "cuda":
            return
        if nvml:
            try:
                import pynvml

                pynvml.nvmlInit()
                self._nvml = pynvml
                self._handles = [
                    pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())
                ]
            except Exception as e:  # noqa: BLE001 — ImportError or an NVML error: telemetry must not stop training
                print(
                    f"telemetry: NVML skipped ({type(e).__name__}: {e}); install nvidia-ml-py for GPU "
                    "utilisation/power/temperature",
                    file=sys.stderr,
                )

    def __call__(self) -> dict[str, float]:
        if self.device.type != "cuda":
            return {}
        out: dict[str, float] = {}
        idx = self.device.index if self.device.index is not None else torch.cuda.current_device()
        allocated = torch.cuda.memory_allocated(idx)
        reserved = torch.cuda.memory_reserved(idx)
        out["cuda/allocated_gb"] = allocated / _GB
        out["cuda/reserved_gb"] = reserved / _GB
        out["cuda/peak_allocated_gb"] = torch.cuda.max_memory_allocated(idx) / _GB
        out["cuda/fragmentation"] = 1.0 - allocated / reserved if reserved else 0.0
        nv = self._nvml
        for i, h in enumerate(self._handles):
            try:
                util = nv.nvmlDeviceGetUtilizationRates(h)
                mem = nv.nvmlDeviceGetMemoryInfo(h)
                out[f"gpu{i}/util_pct"] = float(util.gpu)
                out[f"gpu{i}/mem_used_gb"] = mem.used / _GB
                out[f"gpu{i}/mem_total_gb"] = mem.total / _GB
                out[f"gpu{i}/power_w"] = nv.nvmlDeviceGetPowerUsage(h) / 1000.0
                out[f"gpu{i}/temp_c"] = float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))
            except Exception:  # noqa: BLE001, S112 — one unreadable sensor does not drop the line
                continue
        return out
