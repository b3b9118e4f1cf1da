"""A training process's lifecycle: signals and the heartbeat file `flashdraft runs status` reads.

    with RunSignals() as signals:          # installed at start-up, before the target loads
        ...
        Trainer(..., signals=signals).run()   # reads the flags at step boundaries

    kill -USR1 PID    a checkpoint of the live weights at the next step boundary; a request that comes while
                      the run loads is kept until the first step, one after the last step is not needed
    kill -TERM PID    (or Ctrl-C) a checkpoint at the next step boundary, then exit 143 (130); a second
                      signal, or one before training started, exits at once

RUN/heartbeat.json (rank 0, rewritten atomically every HEARTBEAT_S seconds and when the state changes):

    {"pid", "host", "started", "heartbeat", "every_s", "state": "running" | "finished" | "stopped" | "failed",
     "reason", "step", "total_steps", "checkpoint"}

A "running" file whose process is gone (same host: the pid is dead; another host: no heartbeat for
STALE_BEATS × every_s) means the process was killed without a chance to say so (SIGKILL, power loss).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from flashdraft.files import atomic_write_text

HEARTBEAT_FILE = "heartbeat.json"
HEARTBEAT_S = 15.0
STALE_BEATS = 4  # another host's run is taken for dead after this many missed heartbeats

STOP_SIGNALS = {signal.SIGINT: "SIGINT", signal.SIGTERM: "SIGTERM"}


def _say(line: str) -> None:
    """One line on stderr from a signal handler: os.write, since the interrupted code may be inside a print."""
    os.write(2, (line + "\n").encode())


class RunSignals:
    """SIGUSR1 / SIGINT / SIGTERM handlers as flags the training loop reads at step boundaries.

    `armed` is set by the loop while a stop can still end in a checkpoint; outside it a stop signal exits
    at once (SystemExit 128 + signal number: `finally` blocks still run, temp folders are removed)."""

    def __init__(self) -> None:
        self.checkpoint_requested = False
        self.stop_signal: int | None = None
        self.armed = False
        self._old: dict[int, Any] = {}

    def install(self) -> RunSignals:
        if threading.current_thread() is not threading.main_thread():
            return self  # signal handlers can only be set from the main thread (tests driving a thread)
        wanted: list[tuple[int, Callable[[int, FrameType | None], None]]] = [
            (s, self._on_stop) for s in STOP_SIGNALS
        ]
        if hasattr(signal, "SIGUSR1"):
            wanted.append((signal.SIGUSR1, self._on_checkpoint))
        for signum, handler in wanted:
            self._old[signum] = signal.signal(signum, handler)
        return self

    def restore(self) -> None:
        for signum, handler in self._old.items():
            signal.signal(signum, handler)
        self._old.clear()

    def __enter__(self) -> RunSignals:
        return self.install()

    def __exit__(self, *_exc: object) -> None:
        self.restore()

    def take_checkpoint_request(self) -> bool:
        asked, self.checkpoint_requested = self.checkpoint_requested, False
        return asked

    @property
    def stop_name(self) -> str | None:
        return None if self.stop_signal is None else STOP_SIGNALS.get(self.stop_signal, "signal")

    def _on_checkpoint(self, _signum: int, _frame: FrameType | None) -> None:
        self.checkpoint_requested = True  # only a flag: the checkpoint is written at the next step boundary

    def _on_stop(self, signum: int, _frame: FrameType | None) -> None:
        name = STOP_SIGNALS.get(signum, str(signum))
        if self.stop_signal is not None or not self.armed:
            why = "a second stop signal" if self.stop_signal is not None else "no training step has run yet"
            _say(f"{name}: exiting at once ({why}); no checkpoint written")
            raise SystemExit(128 + signum)
        self.stop_signal = signum
        _say(
            f"{name}: writing a checkpoint at the end of this step, then stopping (send it again to exit at once)"
        )


# ----------------------------------------------------------------------------- heartbeat


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    atomic_write_text(path, json.dumps(data) + "\n")


class Heartbeat:
    """Rank 0's RUN/heartbeat.json: written at start, every `every_s` seconds by a daemon thread (so a long
    target load or a slow step still beats), and once more with the final state."""

    def __init__(self, run_dir: str | os.PathLike[str], every_s: float = HEARTBEAT_S) -> None:
        self.path = Path(run_dir) / HEARTBEAT_FILE
        self.every_s = every_s
        self.progress: Callable[[], dict[str, Any]] = dict  # step, total_steps, checkpoint (set by launch)
        self.record: dict[str, Any] = {
            "pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "every_s": every_s,
            "state": "running", "reason": None,
        }  # fmt: skip
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def beat(self) -> None:
        with self._lock:
            try:
                self.record.update(self.progress())
            except Exception:  # noqa: BLE001, S110 — progress read mid-update: the next beat has it
                pass
            self.record["heartbeat"] = time.time()
            write_json_atomic(self.path, self.record)

    def start(self) -> Heartbeat:
        self.beat()
        self._thread = threading.Thread(target=self._loop, name="flashdraft-heartbeat", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.beat()
            except OSError:
                continue  # a full disk must not stop training; the file just ages

    def finish(self, state: str, reason: str) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.record.update(state=state, reason=reason)
        self.beat()


def read_heartbeat(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    try:
        data = json.loads((Path(run_dir) / HEARTBEAT_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def process_gone(beat: dict[str, Any], now: float) -> bool:
    """Whether the process of a "running" heartbeat is gone (see the module docstring)."""
    if beat.get("host") == socket.gethostname() and isinstance(beat.get("pid"), int):
        if not pid_alive(beat["pid"]):
            return True
        # the same pid may belong to a new process: a file far older than its beat interval is dead too
    last = beat.get("heartbeat")
    every = float(beat.get("every_s") or HEARTBEAT_S)
    return not isinstance(last, (int, float)) or now - last > STALE_BEATS * every
