"""The online pipeline: a producer thread runs the target ahead of the trainer into a bounded queue.

    flashdraft train cfg.yaml pipeline.queue_depth=4 runtime.target_device=cuda:0 runtime.device=cuda:1

    source = QueuedSource(InProcessSource(...), depth=4, device=drafter_device)
    for fb in source: ...                # FeatureBatch, features already on `device`
    source.take_stats()                  # {"pipeline/queue_depth": .., "pipeline/consumer_wait_frac": .., ...}

The producer iterates the inner source (which runs the target, or reads features from disk)
in a background thread; CUDA kernels and CPU torch ops release the GIL, so it overlaps with
the drafter step. On CUDA it works on its own stream; a batch is put on the queue only after
its features (moved to the trainer's device with a non-blocking copy) are complete, and the
consumer marks them used on its own stream, so the caching allocator cannot hand their memory
back to the producer while the drafter still reads them.

Starvation: `take_stats` reports the trainer's wait for each batch (host time) and, on CUDA where the producer works
on side streams, how long the trainer's stream ran dry meanwhile (`StreamIdle`): there the host's wait overlaps
queued device work, and only the stream's idle time costs the run anything, so it is what the warning and
`flashdraft runs status` judge by.

Resume: the producer runs ahead, so what it has produced is not what the trainer has used.
Every queued batch carries the inner source's position right after it; `state_dict()` returns
the position after the last batch the consumer took, and a restored source restarts the
producer from there (queued but unused batches are recomputed, never skipped).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import math
import queue
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from flashdraft.train.batch import FeatureBatch
from flashdraft.train.source import FeatureSource


@dataclass
class _Item:
    batch: FeatureBatch
    state: dict[str, Any]  # the inner source's position right after this batch
    produce_s: float  # producer wall time for this batch (target pass or disk read, and the hand-off)
    event: Any = None  # torch.cuda.Event recorded after the features were ready (CUDA only)
    host_s: dict[str, float] | None = None  # the inner source's stages (`InProcessSource.last_host_s`)


@dataclass
class _Error:
    exc: BaseException


_END = object()

STARVE_WARN_EVERY_S = 60.0  # the starvation warning at most once a minute: the metrics carry every interval


@dataclass
class _Pull:
    """One micro-batch the consumer took, for the starvation window."""

    wait_s: float  # the consumer waited for it
    cycle_s: float  # since the previous pull: its wait + the trainer's own work
    tokens: int
    produce_s: float


class StreamIdle:
    """How long the trainer's CUDA stream sat idle while the trainer waited for each batch.

    An event on the trainer's stream when it asks for a batch (the device reaches it when the last step's work is
    done) and one when it has the batch (after the stream was told to wait for the batch's features): the device
    time between the two is time the stream ran nothing, waiting on the host to enqueue the next step or on the
    producer's stream. Where the producer runs on side streams, this, not the host's wait, is what a slow producer
    costs: the host's wait overlaps queued device work. Read once both events completed, so no sync.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pending: collections.deque[tuple[Any, Any, float]] = collections.deque()  # (asked, got, cycle_s)

    def _mark(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def asked(self) -> Any:
        return self._mark()

    def got(self, asked: Any, cycle_s: float | None) -> None:
        """`cycle_s`: the pull's whole cycle (None for the first, start-up: not counted)."""
        got = self._mark()
        if cycle_s is not None:
            self.pending.append((asked, got, cycle_s))

    def harvest(self) -> list[tuple[float, float]]:
        """(idle seconds, cycle seconds) of every pull whose events completed, oldest first."""
        out = []
        while self.pending and self.pending[0][1].query():
            asked, got, cycle_s = self.pending.popleft()
            out.append((asked.elapsed_time(got) / 1e3, cycle_s))
        return out


class _Interval:
    """Consumer-side sums between two `take_stats` calls."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.batches = 0
        self.wait_s = 0.0
        self.idle_s = 0.0  # the trainer's stream idle (`StreamIdle`), for the pulls read so far
        self.produce_s = 0.0
        self.depth_sum = 0
        self.host_s: dict[str, float] = {}  # summed per stage of the inner source


class QueuedSource:
    """A FeatureSource that runs `inner` in a background thread, `depth` batches ahead.

    depth = 0: no thread; the inner source runs inline and its time counts as consumer wait. With `ahead` = 1
    the inline source runs one batch ahead: each pull first launches the next batch's target pass on a side
    CUDA stream, from the trainer's own thread (no second thread, so nothing compiled runs concurrently on the
    host), then hands over the batch launched one pull earlier, so the GPU runs that target pass under the
    drafter step. On a CPU there is no side stream, and the order and states are those of ahead = 0.
    """

    def __init__(
        self,
        inner: FeatureSource,
        *,
        depth: int = 4,
        device: torch.device | str | None = None,  # the trainer's device (None: features stay put)
        source_device: torch.device | str | None = None,  # where `inner` makes features (the target's device)
        starve_threshold: float = 0.05,
        starve_window: int = 50,  # micro-batches
        inline_why: str | None = None,  # depth 0 by necessity, not by choice: why (`inline_reason`)
        ahead: int = 0,  # depth 0: batches launched ahead on a side stream (0 or 1)
    ) -> None:
        if ahead not in (0, 1):
            raise ValueError(f"pipeline.inline_ahead {ahead}: use 0 or 1")
        self.inner = inner
        self.ahead = ahead
        self.depth = int(depth)
        self.inline_why = inline_why
        self.device = torch.device(device) if device is not None else None
        self.source_device = torch.device(source_device) if source_device is not None else None
        self.starve_threshold, self.starve_window = starve_threshold, starve_window
        self._state = copy.deepcopy(inner.state_dict())
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max(1, self.depth))
        self._interval = _Interval()
        self._window: collections.deque[_Pull] = collections.deque(maxlen=starve_window)
        self._warned_at: float | None = None  # time.monotonic() of the last starvation warning
        self._last_get: float | None = None  # end of the previous pull (None: nothing pulled yet)
        # where the producer works on side streams (its own thread, or inline one batch ahead) on CUDA: the trainer
        # stream's idle time per pull; (idle s, cycle s) of the last `starve_window` pulls read
        cuda = [d for d in (self.device, self.source_device) if d is not None and d.type == "cuda"]
        side = self.depth > 0 or self.ahead == 1
        self.stream_idle = StreamIdle(cuda[0]) if cuda and side else None
        self._idle_window: collections.deque[tuple[float, float]] = collections.deque(maxlen=starve_window)
        self.startup_wait_s = 0.0  # the first pull waits for the first target pass: not starvation

    # ------------------------------------------------------------------ FeatureSource

    @property
    def epoch(self) -> int:
        return int(self._state["epoch"])

    def micro_batches_per_epoch(self) -> int:
        return self.inner.micro_batches_per_epoch()

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch the consumer took (not where the producer is)."""
        return copy.deepcopy(self._state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._thread is not None:
            raise RuntimeError(
                "QueuedSource.load_state_dict while the producer runs: restore before iterating"
            )
        self.inner.load_state_dict(state)
        self._state = copy.deepcopy(self.inner.state_dict())

    def __iter__(self) -> Iterator[FeatureBatch]:
        if self.depth == 0:
            yield from self._inline()
            return
        if self._thread is not None:
            raise RuntimeError("QueuedSource can be iterated once (one producer thread)")
        self._stop.clear()
        self._thread = threading.Thread(target=self._produce, name="flashdraft-producer", daemon=True)
        self._thread.start()
        try:
            while True:
                t0 = time.perf_counter()
                asked = self.stream_idle.asked() if self.stream_idle is not None else None
                depth = self._queue.qsize()
                item = self._queue.get()
                t1 = time.perf_counter()
                if item is _END:
                    return
                if isinstance(item, _Error):
                    raise item.exc
                yield self._take(item, asked, wait=t1 - t0, depth=depth, now=t1)
        finally:
            self.close()

    def close(self) -> None:
        """Stop the producer (idempotent); queued batches are dropped (the state does not include them)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            while thread.is_alive():
                with contextlib.suppress(queue.Empty):
                    self._queue.get_nowait()  # unblock a producer waiting on a full queue
                thread.join(timeout=0.05)
        self._queue = queue.Queue(maxsize=max(1, self.depth))

    # ------------------------------------------------------------------ producer

    def _producer_streams(self) -> list[Any]:
        """One side stream per CUDA device the producer touches (the target's, the trainer's)."""
        devs = []
        for d in (self.source_device, self.device):
            if d is not None and d.type == "cuda":
                d = torch.device("cuda", d.index if d.index is not None else torch.cuda.current_device())
                if d not in devs:
                    devs.append(d)
        return [torch.cuda.Stream(device=d) for d in devs]

    def _produce(self) -> None:
        # Side streams: the target's kernels and the copies overlap the trainer's default stream. A
        # cross-device copy runs on the source device's current stream and fences the destination's
        # current stream, which is also a side stream here, so the trainer's queue is never waited on.
        streams = self._producer_streams()
        try:
            with contextlib.ExitStack() as ctx:
                for st in streams:
                    ctx.enter_context(torch.cuda.stream(st))
                it = iter(self.inner)
                while not self._stop.is_set():
                    t0 = time.perf_counter()
                    fb = next(it, None)
                    if fb is None:
                        break
                    state = copy.deepcopy(self.inner.state_dict())  # right after this batch
                    fb = self._hand_off(fb)
                    event = None
                    for st in streams:
                        event = st.record_event()
                        event.synchronize()  # blocks this thread only: honest producer time, bounded work in flight
                    item = _Item(fb, state, time.perf_counter() - t0, event, self._host_s())
                    if not self._put(item):
                        return
            self._put(_END)
        except BaseException as e:  # noqa: BLE001 — re-raised in the consumer
            self._put(_Error(e))

    def _host_s(self) -> dict[str, float]:
        return dict(getattr(self.inner, "last_host_s", None) or {})

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _hand_off(self, fb: FeatureBatch) -> FeatureBatch:
        """Move the features to the trainer's device (async; pinned when coming from the CPU)."""
        if self.device is None or fb.features.device == self.device:
            return fb
        f = fb.features
        if self.device.type == "cuda" and f.device.type == "cpu":
            f = f.pin_memory()
        fb.features = f.to(self.device, non_blocking=True)
        return fb

    # ------------------------------------------------------------------ consumer

    def _take(self, item: _Item, asked: Any, *, wait: float, depth: int, now: float) -> FeatureBatch:
        """The batch handed to the trainer, its pull recorded."""
        cycle = now - self._last_get if self._last_get is not None else None
        self._consumed(item, wait=wait, depth=depth, now=now)
        fb = self._ready(item)
        if self.stream_idle is not None:
            self.stream_idle.got(asked, cycle)
        return fb

    def _ready(self, item: _Item) -> FeatureBatch:
        fb = item.batch
        if item.event is not None and fb.features.device.type == "cuda":
            consumer = torch.cuda.current_stream(fb.features.device)
            consumer.wait_event(item.event)
            fb.features.record_stream(consumer)  # memory stays reserved until the consumer's work is done
        return fb

    def _consumed(self, item: _Item, *, wait: float, depth: int, now: float) -> None:
        self._state = item.state
        iv = self._interval
        if self._last_get is None:
            self.startup_wait_s = wait
        else:
            self._window.append(_Pull(wait, now - self._last_get, item.batch.num_tokens, item.produce_s))
            iv.wait_s += wait
        self._last_get = now
        iv.batches += 1
        iv.produce_s += item.produce_s
        iv.depth_sum += depth
        for k, v in (item.host_s or {}).items():
            iv.host_s[k] = iv.host_s.get(k, 0.0) + v

    def _inline(self) -> Iterator[FeatureBatch]:
        it = iter(self.inner)
        side = self._producer_streams()[:1] if self.ahead and self.source_device is not None else []
        pending: collections.deque[_Item] = collections.deque()
        exhausted = False
        while True:
            t0 = time.perf_counter()
            asked = self.stream_idle.asked() if self.stream_idle is not None else None
            while not exhausted and len(pending) <= self.ahead:  # launch up to `ahead` batches past this one
                with torch.cuda.stream(side[0]) if side else contextlib.nullcontext():
                    fb = next(it, None)
                    if fb is None:
                        exhausted = True
                        break
                    fb = self._hand_off(fb)
                    event = side[0].record_event() if side else None
                state = copy.deepcopy(self.inner.state_dict())  # right after this batch
                pending.append(_Item(fb, state, time.perf_counter() - t0, event, self._host_s()))
            if not pending:
                return
            item = pending.popleft()
            t1 = time.perf_counter()
            yield self._take(item, asked, wait=t1 - t0, depth=len(pending), now=t1)

    # ------------------------------------------------------------------ metrics

    def _read_idle(self) -> None:
        """The completed pulls' stream idle, into the interval and the window."""
        if self.stream_idle is None:
            return
        for idle_s, cycle_s in self.stream_idle.harvest():
            self._interval.idle_s += idle_s
            self._idle_window.append((idle_s, cycle_s))

    def window_idle_fraction(self) -> float | None:
        """The trainer stream's idle / wall time over the window's pulls read so far (None: not measured)."""
        if self.stream_idle is None or len(self._idle_window) < min(self.starve_window, 2):
            return None
        total = sum(c for _, c in self._idle_window)
        return sum(i for i, _ in self._idle_window) / total if total > 0 else 0.0

    def window_wait_fraction(self) -> float:
        """Consumer wait / wall time over the last `starve_window` micro-batches (startup excluded)."""
        total = sum(p.cycle_s for p in self._window)
        return sum(p.wait_s for p in self._window) / total if total > 0 else 0.0

    def bottleneck(self) -> str:
        """Why the trainer waits, from the window's rates: producer tokens/s vs the trainer's own tokens/s."""
        w = list(self._window)
        tokens = sum(p.tokens for p in w)
        produce_s = sum(p.produce_s for p in w)
        busy_s = sum(max(0.0, p.cycle_s - p.wait_s) for p in w)
        made = tokens / produce_s if produce_s > 0 else math.inf
        taken = tokens / busy_s if busy_s > 0 else math.inf
        rates = f"the producer makes {made:,.0f} target tokens/s, the trainer takes {taken:,.0f}"
        if self.depth == 0 and self.inline_why:
            return (
                f"{rates}; the target pass is part of every step, in the trainer's thread: {self.inline_why}"
            )
        if self.depth == 0:
            return f"{rates}; pipeline.queue_depth=0 runs the producer inline: set pipeline.queue_depth > 0"
        if made < taken:
            return (
                f"{rates}: the producer is the bottleneck and a longer queue cannot help; put the target on its "
                "own GPU (runtime.target_device) or use pipeline.mode=offline"
            )
        return f"{rates}: the producer keeps up on average but the queue ran dry; raise pipeline.queue_depth"

    def take_stats(self) -> dict[str, float]:
        """Pipeline metrics since the previous call (host floats); warns loudly when the trainer starves."""
        self._read_idle()
        iv, self._interval = self._interval, _Interval()
        elapsed = max(time.perf_counter() - iv.start, 1e-9)
        n = max(iv.batches, 1)
        window = self.window_wait_fraction()
        idle = self.window_idle_fraction()
        stats = {
            "pipeline/queue_depth": iv.depth_sum / n,  # batches ready when the trainer asked (mean)
            "pipeline/queue_capacity": float(self.depth),
            "pipeline/producer_s_per_batch": iv.produce_s / n,
            "pipeline/consumer_wait_s": iv.wait_s,
            "pipeline/consumer_wait_frac": min(1.0, iv.wait_s / elapsed),
            "pipeline/consumer_wait_frac_window": window,
            # where the producer's time goes, host side (on CUDA the target pass is launched, not waited for)
            **{f"pipeline/host_{k}_ms": 1e3 * v / n for k, v in iv.host_s.items()},
        }
        if self.stream_idle is not None:
            # the pulls of this interval whose events completed (the newest may be read at the next call)
            stats["pipeline/stream_idle_frac"] = min(1.0, iv.idle_s / elapsed)
            if idle is not None:
                stats["pipeline/stream_idle_frac_window"] = idle
        now = time.monotonic()
        due = self._warned_at is None or now - self._warned_at >= STARVE_WARN_EVERY_S
        # with the producer on side streams the trainer's host wait overlaps queued device work: what it costs is
        # the stream's idle time, once measured; otherwise the host wait
        starved = idle if idle is not None else window
        if due and len(self._window) >= min(self.starve_window, 2) and starved > self.starve_threshold:
            self._warned_at = now
            what = (
                f"its CUDA stream idled {idle:.1%} of the time waiting for features (its thread waited {window:.1%})"
                if idle is not None
                else f"it waited for features {window:.1%} of the time"
            )
            print(
                f"WARNING: trainer starved: {what} over the last {len(self._window)} micro-batches (threshold "
                f"{self.starve_threshold:.0%}): {self.bottleneck()}{_host_split(iv.host_s, n)} (this warning: at "
                "most once a minute)",
                file=sys.stderr,
            )
        return stats


def _host_split(host_s: dict[str, float], batches: int) -> str:
    """'; host per batch: pack 1.2 ms, target 8.1 ms' (empty without stage times), with a hint when packing is slow:
    it reads the batch's samples from the dataset's shards, ~1 ms a micro-batch when they are decoded once."""
    if not host_s:
        return ""
    out = "; host per batch: " + ", ".join(f"{k} {1e3 * v / batches:.1f} ms" for k, v in host_s.items())
    if 1e3 * host_s.get("pack", 0.0) / batches > 10:
        out += (
            " (slow packing: the samples' shards decoded again and again, flashdraft.data.dataset.SHARD_CACHE_BYTES "
            "smaller than the decoded dataset, or a slow disk)"
        )
    return out


# ----------------------------------------------------------------------------- assembly (launch.py)


class FrozenHeads:
    """The target's frozen embedding and lm_head, copied onto the trainer's device.

    The drafter step reads only these two from the target; when the target runs on another
    device (runtime.target_device), the trainer gets this instead of the target.
    """

    def __init__(self, target: Any, device: torch.device) -> None:
        self.embed_tokens = copy.deepcopy(target.embed_tokens).to(device).requires_grad_(False)
        self.lm_head = copy.deepcopy(target.lm_head).to(device).requires_grad_(False)
        self.device = device
        self.dtype = target.dtype


def resolve_target_device(spec: str, drafter_device: torch.device, local_rank: int = 0) -> torch.device:
    """runtime.target_device: "same", "cuda:1", or one device per local rank ("cuda:4,cuda:5")."""
    if spec == "same":
        return drafter_device
    devices = [s.strip() for s in spec.split(",") if s.strip()]
    if len(devices) > 1 and local_rank >= len(devices):
        raise ValueError(
            f"runtime.target_device lists {len(devices)} devices but this is local rank {local_rank}: "
            "give one device per rank (or one for all)"
        )
    dev = torch.device(devices[local_rank] if len(devices) > 1 else devices[0])
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"runtime.target_device={spec!r} but CUDA is not available: use runtime.target_device=same"
        )
    return dev


def inline_reason(feature_pass: str, target_device: torch.device | None) -> str | None:
    """Why the online target pass must run in the trainer's own thread, or None when a producer thread is safe.

    The native feature pass on CUDA calls torch.compile'd functions (create_block_mask, flex_attention, the whole
    pass with runtime.compile=target), and so does the trainer (its compiled drafter, loss or FlexAttention).
    Dynamo's "FX is tracing" flag is one per process, not per thread: a compiled call in one thread while the
    other thread compiles raises "Detected that you are using FX to symbolically trace a dynamo-optimized
    function" (it stopped a training run on an H100 on 2026-12-06, in the first steps). The transformers pass
    (feature_pass=hf) calls nothing compiled, so its producer thread stays."""
    if feature_pass == "native" and target_device is not None and target_device.type == "cuda":
        return (
            "runtime.feature_pass=native calls compiled functions, which dynamo does not allow in one thread "
            "while another compiles"
        )
    return None


def build_source(
    cfg: Any,  # TrainConfig
    samples: Any,
    lengths: list[int],
    target: Any,  # TargetModel, or None in offline mode
    layer_ids: list[int],
    device: torch.device,  # the trainer's device
    *,
    rank: int = 0,
    world_size: int = 1,
) -> QueuedSource:
    """The trainer's FeatureSource for pipeline.mode (online: target passes; offline: a dump)."""
    from flashdraft.train.source import InProcessSource

    kw = dict(
        max_length=cfg.data.max_length, token_budget=cfg.data.token_budget,
        epochs=None if cfg.optim.max_steps is not None else cfg.optim.epochs, seed=cfg.runtime.seed,
        shuffle=cfg.data.shuffle, pad_multiple=cfg.data.pad_multiple, lengths=lengths, rank=rank,
        world_size=world_size,
    )  # fmt: skip
    p = cfg.pipeline
    inner: Any
    if p.mode == "offline":
        from flashdraft.train.features import FeatureStore, OfflineSource

        inner = OfflineSource(samples, FeatureStore(p.features_dir), layer_ids, **kw)
    else:
        compile_target = "target" in cfg.runtime.compile_parts and torch.device(target.device).type == "cuda"
        inner = InProcessSource(
            samples,
            target,
            layer_ids,
            feature_pass=cfg.runtime.feature_pass,
            compile_target=compile_target,
            target_graph=compile_target and "target_graph" in cfg.runtime.compile_parts,
            **kw,
        )
    depth = p.queue_depth
    why = inline_reason(
        cfg.runtime.feature_pass, None if p.mode == "offline" else torch.device(target.device)
    )
    if depth > 0 and why is not None:
        print(
            f"pipeline: the target runs in the trainer's thread (queue_depth 0, not {depth}): {why}",
            file=sys.stderr,
        )
        depth = 0
    return QueuedSource(
        inner, depth=depth, device=device, starve_threshold=p.starve_threshold,
        starve_window=p.starve_window, inline_why=why if depth == 0 else None,
        source_device=torch.device("cpu") if p.mode == "offline" else torch.device(target.device),
        ahead=p.inline_ahead if depth == 0 else 0,
    )  # fmt: skip
