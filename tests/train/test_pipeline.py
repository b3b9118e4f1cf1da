"""Online pipeline: queued batches equal inline ones, consumer-position resume, starvation metrics, errors."""

from __future__ import annotations

import re
import time

import pytest
import torch

from flashdraft.config import load_config
from flashdraft.train.config import TrainConfig
from flashdraft.train.launch import train
from flashdraft.train.metrics import read_metrics
from flashdraft.train.pipeline import FrozenHeads, QueuedSource, _Pull, inline_reason, resolve_target_device
from flashdraft.train.source import InProcessSource
from tests.conftest import tiny_target
from tests.train.helpers import fake_features, make_docs, token_batch

DOCS = make_docs([40, 30, 20, 45, 25, 33, 38, 27, 41, 22], seed=3)


def _source(target, epochs=2) -> InProcessSource:  # noqa: ANN001
    return InProcessSource(DOCS, target, [1, 3, 4], max_length=48, token_budget=96, epochs=epochs, seed=5)


def _same(a, b) -> bool:  # noqa: ANN001
    return (
        torch.equal(a.features, b.features)
        and torch.equal(a.input_ids, b.input_ids)
        and torch.equal(a.doc_ids, b.doc_ids)
        and a.sample_ids == b.sample_ids
    )


@pytest.fixture(scope="module")
def target():  # noqa: ANN201
    return tiny_target("llama", dtype=torch.float32)


def test_queued_batches_equal_inline_batches_across_epochs(target):
    inline = list(_source(target))
    q = QueuedSource(_source(target), depth=3)
    queued = list(q)
    assert len(queued) == len(inline) == 2 * _source(target).micro_batches_per_epoch()
    assert all(_same(a, b) for a, b in zip(inline, queued, strict=True))
    assert q.epoch == 1


def test_state_is_the_consumers_position_and_resume_restarts_the_producer_there(target):
    full = list(_source(target))
    q = QueuedSource(_source(target), depth=4)
    it = iter(q)
    taken = [next(it) for _ in range(3)]
    deadline = time.time() + 60  # generous: CI machines are loaded
    while q._queue.qsize() < 4 and time.time() < deadline:  # let the producer run ahead
        time.sleep(0.01)
    assert q._queue.qsize() == 4, "the producer did not run ahead"
    ref = _source(target)
    ref_it = iter(ref)
    for _ in range(3):
        next(ref_it)
    assert q.state_dict() == ref.state_dict()  # 3 consumed, not 3 + 4 produced
    state = q.state_dict()
    it.close()  # stops the producer; queued batches are dropped
    assert q._thread is None
    resumed = QueuedSource(_source(target), depth=2)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert all(_same(a, b) for a, b in zip(full[:3], taken, strict=True))
    assert len(rest) == len(full) - 3
    assert all(_same(a, b) for a, b in zip(full[3:], rest, strict=True))


def test_inline_one_batch_ahead_gives_the_same_batches_states_and_resume(target):
    """inline_ahead = 1 launches batch k+1 before handing over batch k: the batches, the consumer's state after
    each and a resume from it are those of plain inline iteration (on a CPU there is no side stream)."""
    full = list(_source(target))
    q = QueuedSource(_source(target), depth=0, ahead=1, source_device=torch.device("cpu"))
    it = iter(q)
    taken = [next(it) for _ in range(3)]
    assert q.inner.state_dict()["position"] == 4  # one batch launched ahead ...
    ref = _source(target)
    ref_it = iter(ref)
    for _ in range(3):
        next(ref_it)
    assert q.state_dict() == ref.state_dict()  # ... but the state is the consumer's: 3 batches
    resumed = QueuedSource(_source(target), depth=0, ahead=1, source_device=torch.device("cpu"))
    resumed.load_state_dict(q.state_dict())
    rest = list(resumed)
    assert all(_same(a, b) for a, b in zip(full, taken + rest, strict=True)) and len(taken + rest) == len(full)
    assert resumed.epoch == 1 and q.take_stats()["pipeline/queue_depth"] == 1.0
    with pytest.raises(ValueError, match="use 0 or 1"):
        QueuedSource(_source(target), depth=0, ahead=2)


class _Slow:
    """A fake inner source: `delay` seconds per batch (producer-bound), or an error at batch `fail_at`."""

    def __init__(self, n: int, delay: float, fail_at: int | None = None) -> None:
        self.n, self.delay, self.fail_at, self.i = n, delay, fail_at, 0
        self.batch = fake_features(token_batch([[DOCS[0]]], 48))

    @property
    def epoch(self) -> int:
        return 0

    def micro_batches_per_epoch(self) -> int:
        return self.n

    def state_dict(self) -> dict:
        return {"epoch": 0, "position": self.i}

    def load_state_dict(self, state: dict) -> None:
        self.i = state["position"]

    def __iter__(self):  # noqa: ANN204
        while self.i < self.n:
            time.sleep(self.delay)
            self.i += 1
            if self.i == self.fail_at:
                raise RuntimeError("target pass failed")
            yield self.batch


def test_a_starved_consumer_is_measured_and_warned_about(capsys):
    q = QueuedSource(_Slow(8, delay=0.05), depth=2, starve_window=5)
    for _ in q:
        time.sleep(0.001)  # the consumer is much faster than the producer
    s = q.take_stats()
    assert s["pipeline/consumer_wait_frac_window"] > 0.5
    assert s["pipeline/consumer_wait_frac"] > 0.5
    assert s["pipeline/producer_s_per_batch"] >= 0.05
    assert "WARNING: trainer starved" in capsys.readouterr().err


def test_the_starvation_warning_names_the_bottleneck_and_comes_at_most_once_a_minute(capsys):
    q = QueuedSource(_Slow(8, delay=0.05), depth=2, starve_window=5)
    for _ in q:
        time.sleep(0.001)  # the trainer takes features far faster than the producer makes them
    for _ in range(5):
        q.take_stats()
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    assert "the producer is the bottleneck and a longer queue cannot help" in err[0]
    m = re.search(r"the producer makes ([\d,]+) target tokens/s, the trainer takes ([\d,]+)", err[0])
    made, taken = (float(g.replace(",", "")) for g in m.groups())
    assert made < taken
    q._warned_at -= 61  # a minute later: warned again
    q.take_stats()
    assert "trainer starved" in capsys.readouterr().err
    # a producer that keeps up on average, with a queue that ran dry: raise the queue depth
    q._window.clear()
    q._window.extend(_Pull(wait_s=0.5, cycle_s=1.0, tokens=100, produce_s=0.1) for _ in range(5))
    assert "keeps up on average but the queue ran dry; raise pipeline.queue_depth" in q.bottleneck()


class _FakeStreamIdle:
    """`StreamIdle` without CUDA: each pull's stream idle is `share` of its cycle (what device events would read)."""

    def __init__(self, share: float) -> None:
        self.share, self.pending = share, []

    def asked(self) -> object:
        return object()

    def got(self, asked: object, cycle_s: float | None) -> None:
        if cycle_s is not None:
            self.pending.append(cycle_s)

    def harvest(self) -> list[tuple[float, float]]:
        out, self.pending = [(self.share * c, c) for c in self.pending], []
        return out


@pytest.mark.parametrize("share", [0.0, 0.5])
def test_with_the_producer_on_side_streams_the_stream_idle_decides_starvation(capsys, share):
    """A host-slow producer whose batches the trainer's stream never waits for (its queued work covers the host's
    wait, share 0) is not starvation; a stream idle half the time is, and the warning says both figures."""
    q = QueuedSource(_Slow(8, delay=0.05), depth=2, starve_window=5)
    q.stream_idle = _FakeStreamIdle(share)  # type: ignore[assignment]
    for _ in q:
        time.sleep(0.001)
    s = q.take_stats()
    assert s["pipeline/consumer_wait_frac_window"] > 0.5  # the host waited either way
    assert s["pipeline/stream_idle_frac_window"] == pytest.approx(share)
    assert s["pipeline/stream_idle_frac"] == pytest.approx(share, abs=0.1)
    err = capsys.readouterr().err
    if share == 0.0:
        assert "starved" not in err
    else:
        assert "its CUDA stream idled 50.0% of the time waiting for features (its thread waited" in err


def test_stream_idle_is_measured_only_where_the_producer_has_side_streams():
    cuda = torch.device("cuda", 0)  # constructing the source touches no device
    assert QueuedSource(_Slow(1, delay=0.0), depth=0, device="cpu").stream_idle is None
    assert QueuedSource(_Slow(1, delay=0.0), depth=0, source_device=cuda, ahead=0).stream_idle is None
    for kw in ({"depth": 2}, {"depth": 0, "ahead": 1}):
        assert QueuedSource(_Slow(1, delay=0.0), source_device=cuda, **kw).stream_idle is not None


def test_a_fed_consumer_waits_little_and_sees_a_full_queue(capsys):
    q = QueuedSource(_Slow(10, delay=0.0), depth=3, starve_window=5)
    it = iter(q)
    next(it)
    time.sleep(0.2)  # producer fills the queue
    q.take_stats()
    for _ in it:
        time.sleep(0.03)  # a slow drafter step: features are always ready
    s = q.take_stats()
    assert s["pipeline/consumer_wait_frac_window"] < 0.05
    assert s["pipeline/queue_depth"] >= 1.0
    assert s["pipeline/queue_capacity"] == 3.0
    assert "starved" not in capsys.readouterr().err


def test_producer_errors_reach_the_trainer():
    with pytest.raises(RuntimeError, match="target pass failed"):
        list(QueuedSource(_Slow(5, delay=0.0, fail_at=3), depth=2))


def test_target_placement_and_frozen_heads(target):
    cpu = torch.device("cpu")
    assert resolve_target_device("same", cpu) == cpu
    assert resolve_target_device("cpu", torch.device("meta")) == cpu
    assert resolve_target_device("cpu,meta", cpu, local_rank=1) == torch.device("meta")
    with pytest.raises(ValueError, match="one device per rank"):
        resolve_target_device("cpu,meta", cpu, local_rank=2)
    heads = FrozenHeads(target, cpu)
    assert torch.equal(heads.lm_head.weight, target.lm_head.weight)
    assert heads.lm_head.weight.data_ptr() != target.lm_head.weight.data_ptr()
    assert not heads.embed_tokens.weight.requires_grad


def test_training_losses_are_the_same_with_and_without_the_queue(tmp_path, target):
    losses = {}
    for depth, ahead in ((0, 0), (3, 0), (0, 1)):  # inline, a producer thread, inline one batch ahead
        cfg = load_config(
            TrainConfig, None,
            [f"run_dir={tmp_path / f'{depth}-{ahead}'}", "model.num_layers=1", "model.block_size=8", "data.max_length=48",
             "data.token_budget=96", "data.max_anchors=6", "data.pad_multiple=1", "telemetry.log_every=1",
             "telemetry.tensorboard=false", "telemetry.progress=false", "runtime.dtype=float32",
             "optim.max_steps=6", "optim.grad_accum=2", f"pipeline.queue_depth={depth}",
             f"pipeline.inline_ahead={ahead}"],
        )  # fmt: skip
        train(cfg, target=target, samples=DOCS)
        m = read_metrics(tmp_path / f"{depth}-{ahead}")
        losses[depth, ahead] = [r["loss"] for r in m]
        for key in ("pipeline/queue_depth", "pipeline/consumer_wait_frac", "pipeline/producer_s_per_batch"):
            assert key in m[-1], key
    assert len(losses[0, 0]) == 6 and losses[0, 0] == losses[3, 0] == losses[0, 1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("placement", ["same", "cross"])
def test_cuda_hand_off_equals_inline_batches(placement):
    """Producer on side streams (same GPU, or target on GPU 0 and trainer on GPU 1): same features."""
    if placement == "cross" and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    src = torch.device("cuda:0")
    dst = torch.device("cuda:1" if placement == "cross" else "cuda:0")
    t = tiny_target("llama", dtype=torch.float32)
    t.model.to(src)
    inline = [fb.features.cpu() for fb in _source(t)]
    q = QueuedSource(_source(t), depth=2, device=dst, source_device=src)
    got = []
    for fb in q:
        assert fb.features.device == dst
        got.append((fb.features * 1).cpu())  # a kernel on the trainer's stream reads the hand-off
    assert len(got) == len(inline) and all(torch.equal(a, b) for a, b in zip(inline, got, strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("step_ms, starved", [(60.0, False), (4.0, True)])
def test_stream_idle_on_gpu_separates_a_hidden_host_wait_from_an_idle_stream(step_ms, starved):
    """Inline one batch ahead, a producer that takes 20 ms of host time per batch: under 60 ms of device work per
    step the trainer's stream never runs dry (the host's wait is hidden), under 4 ms it idles most of the time."""
    dev = torch.device("cuda", 0)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10**7)
    end.record()
    end.synchronize()
    cycles_per_ms = 10**7 / start.elapsed_time(end)
    q = QueuedSource(_Slow(12, delay=0.02), depth=0, device=dev, source_device=dev, ahead=1, starve_window=10)
    for _ in q:
        torch.cuda._sleep(int(step_ms * cycles_per_ms))  # the drafter step's device work, queued
    torch.cuda.synchronize()
    s = q.take_stats()
    assert s["pipeline/consumer_wait_frac_window"] > 0.2  # the host waited in both
    idle = s["pipeline/stream_idle_frac_window"]
    # not starved: the pulls at start-up, before device work is queued ahead, may idle a producer delay or two
    # (H100, 2026-12-07: 6.9% of the window); starved: most of it
    assert (idle > 0.5) if starved else (idle < 0.25), idle


def test_a_compiled_call_while_another_thread_fx_traces_raises():
    """The premise of `inline_reason`: dynamo's FX-tracing flag is per process. While one thread is inside
    torch.fx symbolic tracing (as torch.compile's own tracing is), a compiled call in another thread raises."""
    import threading

    inside, release = threading.Event(), threading.Event()

    class Waits(torch.nn.Module):
        def forward(self, x):  # traced by torch.fx: holds the flag until released
            inside.set()
            release.wait(30)
            return x + 1

    tracer = threading.Thread(target=torch.fx.symbolic_trace, args=(Waits(),), daemon=True)
    tracer.start()
    assert inside.wait(30)
    try:
        compiled = torch.compile(lambda x: x * 2, backend="eager")
        with pytest.raises(RuntimeError, match="FX to symbolically trace a dynamo-optimized function"):
            compiled(torch.ones(2))
    finally:
        release.set()
        tracer.join(30)
    assert torch.equal(compiled(torch.ones(2)), torch.full((2,), 2.0))  # fine once the other thread is done


def test_the_native_pass_on_cuda_runs_inline_and_the_others_keep_their_thread():
    assert inline_reason("native", torch.device("cuda", 0)) is not None
    assert inline_reason("native", torch.device("cpu")) is None  # dense SDPA: nothing compiled
    assert inline_reason("hf", torch.device("cuda", 0)) is None  # transformers' forward: nothing compiled
    assert inline_reason("native", None) is None  # offline: features read from disk


def test_build_source_drops_the_thread_when_inline_reason_says_so(target, monkeypatch, capsys):
    """A reason → queue depth 0 (inline, no producer thread), said on stderr; none → the configured depth. The
    reason is faked here (the target is on the CPU): only build_source's use of it is checked."""
    from flashdraft.train import pipeline

    cfg = TrainConfig()
    lengths = [len(d.input_ids) for d in DOCS]
    for reason, depth in ((None, cfg.pipeline.queue_depth), ("a reason", 0)):
        monkeypatch.setattr(pipeline, "inline_reason", lambda fp, dev, r=reason: r)
        source = pipeline.build_source(cfg, DOCS, lengths, target, [1, 3], torch.device("cpu"))
        assert source.depth == depth and source.inline_why == reason
    # its starvation warning names the reason instead of asking for a queue
    source._window.extend(_Pull(wait_s=0.5, cycle_s=1.0, tokens=100, produce_s=0.5) for _ in range(5))
    assert source.bottleneck().endswith(
        "; the target pass is part of every step, in the trainer's thread: a reason"
    )
    assert cfg.pipeline.queue_depth > 0
    assert (
        "the target runs in the trainer's thread (queue_depth 0, not 4): a reason" in capsys.readouterr().err
    )


class _Staged(_Slow):
    """A slow source that reports its stages' host seconds, as InProcessSource does (`last_host_s`)."""

    def __iter__(self):  # noqa: ANN204
        for b in super().__iter__():
            self.last_host_s = {"pack": 0.002, "target": self.delay}
            yield b


@pytest.mark.parametrize("depth", [0, 2])
def test_the_producers_host_stages_are_reported_and_named_in_the_warning(depth, capsys):
    """pipeline/host_<stage>_ms: the mean host time of each stage of the inner source per batch, threaded or inline;
    the starvation warning says them, so a starved run shows whether packing or the target pass costs the time."""
    q = QueuedSource(_Staged(6, delay=0.03), depth=depth, starve_window=4)
    for _ in q:
        pass
    s = q.take_stats()
    assert s["pipeline/host_pack_ms"] == pytest.approx(2.0)
    assert s["pipeline/host_target_ms"] == pytest.approx(30.0)
    assert "host per batch: pack 2.0 ms, target 30.0 ms" in capsys.readouterr().err


def test_slow_packing_gets_its_hint():
    from flashdraft.train.pipeline import _host_split

    assert _host_split({"pack": 0.004, "target": 0.3}, 4) == "; host per batch: pack 1.0 ms, target 75.0 ms"
    assert "slow packing: the samples' shards decoded again" in _host_split({"pack": 0.2, "target": 0.03}, 4)


def test_the_in_process_source_times_its_stages():
    target = tiny_target("llama", layers=2)
    src = InProcessSource(DOCS, target, [0, 1], max_length=48, token_budget=96, epochs=1)
    next(iter(src))
    assert set(src.last_host_s) == {"pack", "target"} and all(v >= 0 for v in src.last_host_s.values())
