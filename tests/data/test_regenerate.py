"""Regeneration end to end on a tiny random target: samples, resume after an interruption, client mode."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from flashdraft.data.dataset import open_dataset
from flashdraft.data.generate import GenerationParams, LocalGenerator, ServerError, ServerGenerator
from flashdraft.data.regenerate import RegenConfig, regenerate
from flashdraft.data.template import ChatTemplate
from tests.conftest import tiny_target
from tests.data.tokenizers import make_tokenizer

VOCAB = 320


def _write_sharegpt(path, n: int = 10) -> str:
    rows = []
    for i in range(n):
        conv = [{"from": "human", "value": f"Tell me a joke number {i}."}, {"from": "gpt", "value": "old"}]
        if i % 3 == 0:
            conv += [{"from": "human", "value": "Why?"}, {"from": "gpt", "value": "old"}]
        rows.append({"id": f"q{i}", "conversations": conv})
    rows.append(dict(rows[1], id="dup"))  # same prompts as q1: dropped before generation
    path.write_text(json.dumps(rows))
    return f"sharegpt:{path}"


def _setup(tmp_path, out="ds", **kw):
    tok = make_tokenizer("chatml")
    tpl = ChatTemplate(tok)
    params = GenerationParams(
        max_new_tokens=kw.pop("max_new_tokens", 6),
        temperature=kw.pop("temperature", 0.0),
        stop_ids=tpl.stop_ids,
    )
    cfg = RegenConfig(
        inputs=[_write_sharegpt(tmp_path / "in.json")],
        out=str(tmp_path / out),
        target="tiny",
        max_new_tokens=params.max_new_tokens,
        temperature=params.temperature,
        shard_size=3,
        block_size=2,
        eval_fraction=0.2,
        contamination_sources=[],
        **kw,
    )
    return cfg, tpl, params


def _dump(path) -> dict:
    out = {}
    for split in ("train", "eval"):
        for s in open_dataset(path, split):
            out[s.id] = (split, s.input_ids.tolist(), s.loss_mask.tolist(), s.meta)
    return out


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", vocab=VOCAB)


def test_regenerate_writes_samples(tmp_path, target):
    cfg, tpl, params = _setup(tmp_path)
    res = regenerate(cfg, tpl, LocalGenerator(target, params, batch_size=4))
    m = res.manifest
    assert m["conversations"] == 10 and m["dropped"]["duplicate_prompt"] == 1
    assert m["counts"]["train"] + m["counts"]["eval"] == 10
    assert res.shards_total == 4 and res.shards_skipped == 0
    data = _dump(tmp_path / "ds")
    s = data["sharegpt/q0"]
    ids, mask = np.array(s[1]), np.array(s[2])
    assert s[3]["turns"] == [0, 2] and len(s[3]["finish"]) == 2
    # every response is 6 generated tokens (or fewer, ending in the stop token), all in the loss
    assert 2 <= mask.sum() <= 12 and "Why?" in tpl.tokenizer.decode(ids[~mask])
    assert not (tmp_path / "ds.partial").exists()
    assert m["template"]["stop_ids"] == tpl.stop_ids and m["target"] == "tiny"


def test_native_engine_streams_every_shard_through_one_call_with_the_same_result(tmp_path, target):
    """Greedy with the native engine: every shard's conversations go through one generate call, each next turn
    fed into the running batch (follow-ups), each shard written when its last conversation is answered; greedy
    answers depend only on the history, so the dataset equals the turn-by-turn loop's, shard for shard."""
    cfg, tpl, params = _setup(tmp_path, "loop")
    regenerate(cfg, tpl, LocalGenerator(target, params, batch_size=4), keep_partial=True)
    cfg2, _, _ = _setup(tmp_path, "native")
    gen = LocalGenerator(target, params, engine="native", batch_size=3)
    calls = []
    inner = gen.generate
    gen.generate = lambda *a, **k: calls.append(k) or inner(*a, **k)  # type: ignore[method-assign]
    regenerate(cfg2, tpl, gen, keep_partial=True)
    assert len(calls) == 1 and calls[0]["follow_up"] is not None
    assert _dump(tmp_path / "native") == _dump(tmp_path / "loop")
    for k in range(4):
        name = f"shard-{k:05d}.parquet"
        assert (tmp_path / "native.partial" / name).read_bytes() == (
            tmp_path / "loop.partial" / name
        ).read_bytes()


def test_native_engine_stops_at_the_time_limit_and_a_rerun_completes(tmp_path, target, monkeypatch):
    """Streaming with a time limit: the call returns at the first host sync after it; the shards finished by
    then are written, the others not, and a rerun answers only those: the dataset equals an uninterrupted run."""
    from flashdraft.data import native

    cfg, tpl, params = _setup(tmp_path, "full")
    regenerate(cfg, tpl, LocalGenerator(target, params, engine="native", batch_size=3))
    cfg2, _, _ = _setup(tmp_path, "timed")
    cfg2.time_limit_s = 3600.0
    clock = {"t": 0.0}
    real_step = native.BatchedNativeTarget.step_graphed

    def step(self, *a, **k):  # every decode step "takes" 100 s: the limit passes during shard 0's answers
        clock["t"] += 100.0
        return real_step(self, *a, **k)

    monkeypatch.setattr(native.BatchedNativeTarget, "step_graphed", step)
    real_clock = time.perf_counter
    monkeypatch.setattr(time, "perf_counter", lambda: real_clock() + clock["t"])
    res = regenerate(cfg2, tpl, LocalGenerator(target, params, engine="native", batch_size=3))
    assert 0 < res.shards_done < 4 and res.manifest["complete"] is False
    # the cut shards' answered turns are in the dataset: each conversation up to its last answered turn, the
    # start of what the uninterrupted run wrote for it
    shards = res.manifest["regen_shards"]
    assert res.shards_cut == shards["cut"] == 4 - res.shards_done and shards["cut_turns_answered"] > 0
    timed, full = _dump(tmp_path / "timed"), _dump(tmp_path / "full")
    shorter = 0
    for sid, (split, ids, mask, meta) in timed.items():
        f_split, f_ids, f_mask, f_meta = full[sid]
        assert (split, ids, mask) == (f_split, f_ids[: len(ids)], f_mask[: len(ids)])
        assert mask[-1]  # an answer ends it, not the prompt left waiting
        assert meta["turns"][0] == f_meta["turns"][0] and meta["turns"][1] <= f_meta["turns"][1]
        assert meta["prompt"] == f_meta["prompt"][: len(meta["prompt"])]
        shorter += len(ids) < len(f_ids)
    assert len(timed) < len(full) or shorter > 0
    monkeypatch.undo()
    cfg2.time_limit_s = None
    res2 = regenerate(
        cfg2, tpl, LocalGenerator(target, params, engine="native", batch_size=3), overwrite=True
    )
    assert res2.shards_skipped == res.shards_done and res2.manifest["complete"] is True
    assert _dump(tmp_path / "timed") == _dump(tmp_path / "full")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_native_engine_holds_one_batch_cache_at_a_time(tmp_path, target, monkeypatch, temperature):
    """Each `native_generate` call allocates a KV cache sized for the whole batch (39 GiB for 512 rows of
    SmolLM2-135M in bf16): one per shard when sampling, one for the whole run when greedy (streaming). The
    previous call's must be gone before the next allocates, without waiting for the cyclic GC (a reference cycle
    through the net kept it alive, and the next shard ran out of an H100's 80 GB), and the last one when the run
    returns. The GC is off here, as between the rare full collections of a long run."""
    import gc
    import weakref

    from flashdraft.data.native import BatchedNativeTarget

    caches: list[weakref.ref] = []
    init = BatchedNativeTarget.__init__

    def tracked(self, *a, **k) -> None:
        alive = sum(r() is not None for r in caches)
        assert alive == 0, f"a batch cache is allocated while {alive} earlier one(s) are alive"
        init(self, *a, **k)
        caches.append(weakref.ref(self.cache))

    monkeypatch.setattr(BatchedNativeTarget, "__init__", tracked)
    cfg, tpl, params = _setup(tmp_path, temperature=temperature)
    enabled = gc.isenabled()
    gc.disable()
    try:
        res = regenerate(cfg, tpl, LocalGenerator(target, params, engine="native", batch_size=3))
    finally:
        if enabled:
            gc.enable()
    # sampling: one cache per shard (conversations of 1 and 2 user turns); greedy: one for every shard
    assert res.shards_total == 4 and len(caches) == (1 if temperature == 0 else 4)
    assert all(r() is None for r in caches)


def test_sampled_set_merges_beside_the_greedy_one_with_the_same_split(tmp_path, target):
    """A sampled regeneration names its samples after the sampling (`@T1s7`), so merging it with the
    greedy set keeps both answers of every conversation — and each lands in the same split."""
    from flashdraft.data.merge import merge_datasets

    cfg, tpl, params = _setup(tmp_path, "greedy")
    regenerate(cfg, tpl, LocalGenerator(target, params, batch_size=4))
    cfg2, _, params2 = _setup(tmp_path, "sampled", temperature=1.0, seed=7)
    regenerate(cfg2, tpl, LocalGenerator(target, params2, batch_size=4))
    greedy, sampled = _dump(tmp_path / "greedy"), _dump(tmp_path / "sampled")
    assert sorted(sampled) == sorted(f"{k}@T1s7" for k in greedy)
    assert all(sampled[f"{k}@T1s7"][0] == v[0] for k, v in greedy.items())  # same split
    assert any(sampled[f"{k}@T1s7"][1] != v[1] for k, v in greedy.items())  # other answers
    merge_datasets([tmp_path / "greedy", tmp_path / "sampled"], tmp_path / "both")
    assert sorted(_dump(tmp_path / "both")) == sorted([*greedy, *sampled])


class _Interrupt(Exception):
    pass


class _FailingGenerator:
    """Delegates to a real generator, then raises on call number `fail_at` (a crash mid-run)."""

    def __init__(self, inner, fail_at: int) -> None:
        self.inner, self.fail_at, self.calls, self.params = inner, fail_at, 0, inner.params

    def generate(self, prompts, seed, on_batch=None):
        self.calls += 1
        if self.calls == self.fail_at:
            raise _Interrupt("killed")
        return self.inner.generate(prompts, seed, on_batch)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_resume_after_interruption_gives_identical_dataset(tmp_path, target, temperature):
    cfg, tpl, params = _setup(tmp_path, "full", temperature=temperature)
    regenerate(cfg, tpl, LocalGenerator(target, params, batch_size=4))
    cfg2, _, _ = _setup(tmp_path, "resumed", temperature=temperature)
    # shards hold 3 conversations; q0, q3, q6 have two turns: 2 calls per shard, die on shard 2's first
    failing = _FailingGenerator(LocalGenerator(target, params, batch_size=4), fail_at=5)
    with pytest.raises(_Interrupt):
        regenerate(cfg2, tpl, failing)
    partial = tmp_path / "resumed.partial"
    assert sorted(p.name for p in partial.glob("shard-*")) == ["shard-00000.parquet", "shard-00001.parquet"]
    assert not (tmp_path / "resumed").exists()  # never a half-written dataset
    counter = _FailingGenerator(LocalGenerator(target, params, batch_size=4), fail_at=-1)
    res = regenerate(cfg2, tpl, counter)
    assert res.shards_skipped == 2
    assert _dump(tmp_path / "resumed") == _dump(tmp_path / "full")


class _SlowGenerator(_FailingGenerator):
    def generate(self, prompts, seed, on_batch=None):
        time.sleep(0.6)
        return super().generate(prompts, seed, on_batch)


def test_time_limit_writes_the_finished_shards_and_a_rerun_completes(tmp_path, target):
    cfg, tpl, params = _setup(tmp_path, "full")
    regenerate(cfg, tpl, LocalGenerator(target, params, batch_size=4))
    cfg2, _, _ = _setup(tmp_path, "timed")
    cfg2.time_limit_s = 0.5  # shard 0 takes >= 0.6 s: no shard starts after it
    res = regenerate(cfg2, tpl, _SlowGenerator(LocalGenerator(target, params, batch_size=4), fail_at=-1))
    assert (res.shards_done, res.shards_total) == (1, 4)
    assert res.manifest["complete"] is False and res.manifest["regen_shards"] == {"done": 1, "total": 4}
    assert res.manifest["conversations"] == 3 and (tmp_path / "timed.partial").exists()
    cfg2.time_limit_s = None
    res = regenerate(cfg2, tpl, LocalGenerator(target, params, batch_size=4), overwrite=True)
    assert res.shards_skipped == 1 and res.manifest["complete"] is True
    assert _dump(tmp_path / "timed") == _dump(tmp_path / "full")


def test_time_limit_starts_no_shard_that_would_end_after_it(tmp_path, target):
    # shards take >= 1.2 s (two 0.6 s calls); a 2 s limit leaves room to start shard 1 at ~1.2 s
    # but it would end at ~2.4 s: only shard 0 is done, and the run returns well before 2.4 s
    cfg, tpl, params = _setup(tmp_path, "timed")
    cfg.time_limit_s = 2.0
    res = regenerate(cfg, tpl, _SlowGenerator(LocalGenerator(target, params, batch_size=4), fail_at=-1))
    assert (res.shards_done, res.shards_total) == (1, 4)


def test_a_time_limit_that_finishes_no_shard_is_a_clear_error(tmp_path, target):
    from flashdraft.data.regenerate import RegenError

    cfg, tpl, params = _setup(tmp_path, "timed")
    cfg.time_limit_s = 1e-9  # past before the first decode step
    with pytest.raises(RegenError, match="no shard of 3 conversations finished"):
        regenerate(cfg, tpl, LocalGenerator(target, params, engine="native", batch_size=3))
    assert not (tmp_path / "timed.partial").exists() and not (tmp_path / "timed").exists()


def test_resume_refuses_changed_settings(tmp_path, target):
    cfg, tpl, params = _setup(tmp_path)
    with pytest.raises(_Interrupt):
        regenerate(cfg, tpl, _FailingGenerator(LocalGenerator(target, params), fail_at=3))
    cfg2, _, params2 = _setup(tmp_path, max_new_tokens=7)
    with pytest.raises(ValueError, match="max_new_tokens"):
        regenerate(cfg2, tpl, LocalGenerator(target, params2))


def test_split_turns(tmp_path, target):
    cfg, tpl, params = _setup(tmp_path, split_turns=True)
    regenerate(cfg, tpl, LocalGenerator(target, params, batch_size=8))
    data = _dump(tmp_path / "ds")
    assert "sharegpt/q0#t0" in data and "sharegpt/q0#t1" in data and len(data) == 14
    t0, t1 = np.array(data["sharegpt/q0#t0"][1]), np.array(data["sharegpt/q0#t1"][1])
    assert t1[: len(t0)].tolist() == t0.tolist()  # turn 1 keeps the regenerated history
    assert not np.array(data["sharegpt/q0#t1"][2])[: len(t0)].any()


# ------------------------------------------------------------------------------------------- client mode


class _FakeServer:
    """A tiny OpenAI-compatible /v1/completions on 127.0.0.1: echoes a deterministic answer as token ids.

    Every prompt's first request gets a 503 (the client must retry); it tracks requests in flight.
    """

    def __init__(self, stop_id: int, omit_stop: bool = False, no_ids: bool = False) -> None:
        self.lock = threading.Lock()
        self.inflight = self.max_inflight = 0
        self.seen: set[tuple] = set()
        fake = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._send(200, {"data": [{"id": "fake-model"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    fake.inflight += 1
                    fake.max_inflight = max(fake.max_inflight, fake.inflight)
                time.sleep(0.02)
                key = tuple(body["prompt"])
                with fake.lock:
                    fake.inflight -= 1
                    first = key not in fake.seen
                    fake.seen.add(key)
                if first:
                    return self._send(503, {"error": "warming up"})
                n = len(key) % 5 + 4
                ids = [(len(key) * 7 + k) % 200 + 20 for k in range(n)]
                choice = {"text": "", "finish_reason": "stop"}
                if not no_ids:
                    choice["token_ids"] = ids if omit_stop else ids + [stop_id]
                self._send(200, {"choices": [choice]})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.parametrize("omit_stop", [False, True])
def test_client_mode_against_fake_server(tmp_path, omit_stop):
    cfg, tpl, params = _setup(tmp_path)
    srv = _FakeServer(tpl.stop_ids[0], omit_stop=omit_stop)
    try:
        gen = ServerGenerator(srv.url, params, concurrency=3, retries=2, backoff_s=0.01)
        regenerate(cfg, tpl, gen)
    finally:
        srv.close()
    assert 1 <= srv.max_inflight <= 3
    data = _dump(tmp_path / "ds")
    assert len(data) == 10
    for _split, ids, mask, meta in data.values():
        ids, mask = np.array(ids), np.array(mask)
        assert (
            ids[mask][-1] == tpl.stop_ids[0]
        )  # the stop token is in the sample even when the server drops it
        assert meta["finish"] == ["stop"] * len(meta["finish"])


def test_client_mode_errors(tmp_path):
    cfg, tpl, params = _setup(tmp_path)
    srv = _FakeServer(tpl.stop_ids[0], no_ids=True)
    try:
        gen = ServerGenerator(srv.url, params, concurrency=2, retries=1, backoff_s=0.01)
        with pytest.raises(ServerError, match="no token ids"):
            gen.generate([[1, 2, 3]], seed=0)
        gen = ServerGenerator(srv.url, params, concurrency=2, retries=0, backoff_s=0.01)
        with pytest.raises(ServerError, match="failed 1 times"):
            gen.generate([[4, 5, 6, 7]], seed=0)  # a fresh prompt: its only attempt gets the 503
    finally:
        srv.close()


def test_max_turns_answers_only_the_first_user_turns(tmp_path, target):
    cfg, tpl, params = _setup(tmp_path, "full", split_turns=True)
    regenerate(cfg, tpl, LocalGenerator(target, params, batch_size=8))
    cfg1, _, _ = _setup(tmp_path, "first", max_turns=1)
    regenerate(cfg1, tpl, LocalGenerator(target, params, batch_size=8))
    full, first = _dump(tmp_path / "full"), _dump(tmp_path / "first")
    assert "sharegpt/q0#t1" in full  # q0 has two turns; with max_turns=1 only its first is answered
    assert set(first) == {cid.split("#")[0] for cid in full}
    for cid, (split, ids, mask, _) in first.items():
        runs = np.flatnonzero(np.diff(np.concatenate([[0], np.array(mask, np.int8), [0]])))
        assert len(runs) == 2, cid  # one answered turn
        ref = full.get(f"{cid}#t0", full.get(cid))
        assert (split, ids, mask) == ref[:3]  # the same first answer (and split) as the full run's


def test_skip_answers_a_later_slice_of_the_conversations(tmp_path, target):
    """--skip 4 --limit 3: conversations q4..q6 of the input as read, each answered as in the full run; skip is
    in the resume fingerprint. Skipped conversations do not count as seen: a later duplicate of one is kept."""
    cfg, tpl, params = _setup(tmp_path, "full")
    regenerate(cfg, tpl, LocalGenerator(target, params, batch_size=8))
    cfg2, _, _ = _setup(tmp_path, "slice", skip=4, limit=3)
    res = regenerate(cfg2, tpl, LocalGenerator(target, params, batch_size=8))
    full, part = _dump(tmp_path / "full"), _dump(tmp_path / "slice")
    assert sorted(part) == ["sharegpt/q4", "sharegpt/q5", "sharegpt/q6"]
    assert all(part[k][:3] == full[k][:3] for k in part)
    assert res.manifest["conversations"] == 3
    assert cfg2.fingerprint(tpl)["skip"] == 4 and "skip" not in cfg.fingerprint(tpl)
    cfg3, _, _ = _setup(tmp_path, "tail", skip=10)  # only "dup" (q1's prompts) is left, and q1 was skipped
    assert regenerate(cfg3, tpl, LocalGenerator(target, params, batch_size=8)).manifest["conversations"] == 1


def test_max_turns_is_part_of_the_resume_fingerprint(tmp_path, target):
    cfg, tpl, params = _setup(tmp_path)
    with pytest.raises(_Interrupt):
        regenerate(cfg, tpl, _FailingGenerator(LocalGenerator(target, params), fail_at=3))
    cfg2, _, _ = _setup(tmp_path, max_turns=1)
    with pytest.raises(ValueError, match="max_turns"):
        regenerate(cfg2, tpl, LocalGenerator(target, params))


def test_input_errors_leave_no_partial_folder(tmp_path, target):
    """A missing input file or too many bad records stop the run before it writes anything: no OUT.partial/."""
    from flashdraft.data.sources import BadInputError

    cfg, tpl, params = _setup(tmp_path)
    cfg.inputs = [f"messages:{tmp_path / 'missing.jsonl'}"]
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        regenerate(cfg, tpl, LocalGenerator(target, params))
    good = '{"messages": [{"role": "user", "content": "q"}]}\n'
    (tmp_path / "junk.jsonl").write_text("not json\n" * 5 + good)
    cfg.inputs = [f"messages:{tmp_path / 'junk.jsonl'}"]
    with pytest.raises(BadInputError, match="5 of 6 records are bad"):
        regenerate(cfg, tpl, LocalGenerator(target, params))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.json", "junk.jsonl"]


def _prompt_len(tpl: ChatTemplate, i: int = 0) -> int:
    return len(tpl.prompt_ids(None, [], f"Tell me a joke number {i}."))


def test_max_length_drops_are_counted(tmp_path, target):
    """Turns whose prompt (the history included) reaches --max-length are counted, not silently left out."""
    cfg, tpl, params = _setup(tmp_path)
    cfg.max_length = max(_prompt_len(tpl, i) for i in range(10)) + 7  # every first turn fits, no second one
    res = regenerate(cfg, tpl, LocalGenerator(target, params, batch_size=4))
    m = res.manifest
    assert m["dropped"]["turns_over_max_length"] == 4  # q0, q3, q6, q9 have a second user turn
    assert m["counts"]["train"] + m["counts"]["eval"] == 10
    assert "conversation_over_max_length" not in m["dropped"]


def test_nothing_usable_fails_and_writes_nothing(tmp_path, target):
    """Every first prompt is longer than --max-length: one error naming the drops and the fix; no dataset,
    no OUT.partial/ (it was this run's)."""
    from flashdraft.data.regenerate import RegenError

    cfg, tpl, params = _setup(tmp_path)
    cfg.max_length = min(_prompt_len(tpl, i) for i in range(10))
    want = (
        r"nothing usable remains of 10 conversations .*'conversation_over_max_length': 10.*raise --max-length"
    )
    with pytest.raises(RegenError, match=want):
        regenerate(cfg, tpl, LocalGenerator(target, params, batch_size=4))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.json"]
