"""Reference cache (a second call runs no target); server and batched references checked against the target."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from flashdraft.decode.generate import generate
from flashdraft.eval.evaluate import evaluate
from flashdraft.eval.prompts import EvalPrompt
from flashdraft.eval.references import ReferenceSettings, ServerConfig, compute_references
from flashdraft.target import target_fingerprint
from tests.conftest import tiny_drafter, tiny_target

PROMPTS = [EvalPrompt(f"p{i}", [3 + i, 7, 9, 11 + i, 4], "token ids") for i in range(3)]


def _count_forwards(target, monkeypatch) -> list[int]:  # type: ignore[no-untyped-def]
    calls = [0]
    real = target.forward

    def counted(*a, **k):  # type: ignore[no-untyped-def]
        calls[0] += 1
        return real(*a, **k)

    monkeypatch.setattr(target, "forward", counted)
    return calls


def test_second_call_is_cached(tmp_path, monkeypatch) -> None:
    target = tiny_target("llama")
    calls = _count_forwards(target, monkeypatch)
    settings = ReferenceSettings(max_new_tokens=12, stop_token_ids=[])
    first = compute_references(target, PROMPTS, settings, cache_dir=tmp_path, progress=False)
    assert first.computed == 3 and first.cached == 0 and calls[0] > 0
    n = calls[0]
    second = compute_references(target, PROMPTS, settings, cache_dir=tmp_path, progress=False)
    assert calls[0] == n, "a cached reference must not run the target"
    assert second.computed == 0 and second.cached == 3
    assert [r.tokens for r in second.references] == [r.tokens for r in first.references]
    expect = generate(
        target, None, PROMPTS[0].input_ids, max_new_tokens=12, method="ar", stop_token_ids=[]
    ).tokens
    assert first.references[0].tokens == expect
    # another setting, another target (weights) or another prompt is a different key
    third = compute_references(
        target,
        PROMPTS,
        ReferenceSettings(max_new_tokens=8, stop_token_ids=[]),
        cache_dir=tmp_path,
        progress=False,
    )
    assert third.computed == 3
    other = tiny_target("llama", seed=5)
    assert compute_references(other, PROMPTS[:1], settings, cache_dir=tmp_path, progress=False).computed == 1


def test_sampled_references_are_seeded(tmp_path) -> None:
    target = tiny_target("qwen3")
    s = ReferenceSettings(max_new_tokens=16, temperature=1.0, seed=3, stop_token_ids=[])
    a = compute_references(target, PROMPTS, s, cache_dir=tmp_path / "a", progress=False).references
    b = compute_references(target, PROMPTS, s, cache_dir=tmp_path / "b", progress=False).references
    assert [r.tokens for r in a] == [r.tokens for r in b]
    c = compute_references(
        target, PROMPTS, ReferenceSettings(16, 1.0, 4, []), cache_dir=tmp_path / "c", progress=False
    ).references
    assert [r.tokens for r in a] != [r.tokens for r in c]


def test_server_references_checked_and_cut(tmp_path) -> None:
    """A fake OpenAI-compatible server answers the target's greedy continuation, with one token
    changed in the second prompt: the replay stops there and the agreement rate says so."""
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    truth = {
        tuple(p.input_ids): generate(
            target, None, p.input_ids, max_new_tokens=16, method="ar", stop_token_ids=[]
        ).tokens
        for p in PROMPTS
    }
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        if len(seen) == 1:
            return httpx.Response(503, text="warming up")  # retried
        toks = list(truth[tuple(body["prompt"])])
        if body["prompt"] == PROMPTS[1].input_ids:
            toks[5] = (toks[5] + 1) % 97
        return httpx.Response(
            200, json={"choices": [{"text": "", "token_ids": toks, "finish_reason": "length"}]}
        )

    server = ServerConfig("http://fake/v1", "tiny", concurrency=1, retries=2)
    refs = compute_references(
        target,
        PROMPTS,
        ReferenceSettings(16, stop_token_ids=[]),
        cache_dir=tmp_path,
        server=server,
        progress=False,
        transport=httpx.MockTransport(handler),
    )
    assert refs.computed == 3 and len(seen) == 4 and seen[0]["max_tokens"] == 16
    report = evaluate(
        target,
        {"d": drafter},
        PROMPTS,
        budgets=[4],
        topk=2,
        max_new_tokens=16,
        references=refs.references,
        progress=False,
    )
    st = report.references
    assert st.truncated_samples == 1
    assert st.tokens == 16 + 5 + 16  # the changed prompt keeps the 5 tokens before the disagreement
    assert st.checked == 16 + 6 + 16 and st.agreed == 37  # compared up to the first disagreement
    assert st.agreement_rate == pytest.approx(37 / 38)
    assert len(st.divergences) == 1
    assert st.divergences[0]["index"] == 5 and st.divergences[0]["id"] == "p1"


def test_server_client_error_is_not_retried(tmp_path) -> None:
    target = tiny_target("llama")
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        return httpx.Response(404, text="model not found")

    with pytest.raises(ValueError, match="HTTP 404"):
        compute_references(
            target,
            PROMPTS[:1],
            ReferenceSettings(8, stop_token_ids=[]),
            cache_dir=tmp_path,
            server=ServerConfig("http://fake/v1"),
            progress=False,
            transport=httpx.MockTransport(handler),
        )
    assert len(calls) == 1


MIXED = [
    EvalPrompt("a", [3, 7, 9], "token ids"),
    EvalPrompt("b", [5, 6, 7, 8, 9, 10, 11, 12, 13], "token ids"),
    EvalPrompt("c", [12, 40, 41, 8, 30], "token ids"),
    EvalPrompt("d", [22, 5], "token ids"),
    EvalPrompt("e", [60, 61, 62, 63, 64, 65, 66], "token ids"),
]


def _early_stop(target, prompts: list[EvalPrompt], n: int) -> int:  # type: ignore[no-untyped-def]
    """A stop token that one prompt's greedy continuation emits early and another's never does."""
    free = [
        generate(target, None, p.input_ids, max_new_tokens=n, method="ar", stop_token_ids=[]).tokens
        for p in prompts
    ]
    for row in free:
        for t in row[2:6]:
            if any(t not in other for other in free):
                return t
    raise AssertionError("no stop token separates the prompts: change MIXED")


def test_batched_greedy_references_match_single(tmp_path, family, monkeypatch) -> None:
    """Batched references (flashdraft's padded greedy loop, prompts of 2..9 tokens in two batches) are
    the single-prompt AR references token for token in float64, stop token and stop_reason included."""
    target = tiny_target(family)
    stop = _early_stop(target, MIXED, 14)
    s = ReferenceSettings(max_new_tokens=14, stop_token_ids=[stop])
    one = compute_references(target, MIXED, s, cache_dir=tmp_path, progress=False).references
    reasons = {r.stop_reason for r in one}
    assert reasons == {"stop", "length"}, "the test needs a row that stops early and one that runs to the end"
    assert any(r.stop_reason == "stop" and len(r.tokens) < 14 and r.tokens[-1] == stop for r in one)
    assert any(r.stop_reason == "length" and len(r.tokens) == 14 for r in one)
    calls = _count_forwards(target, monkeypatch)
    many = compute_references(target, MIXED, s, cache_dir=tmp_path, progress=False, batch_size=3).references
    assert 0 < calls[0] <= 2 * 14, "two batches of flashdraft's loop: a prefill + a forward per token"
    assert [r.tokens for r in many] == [r.tokens for r in one]
    assert [r.stop_reason for r in many] == [r.stop_reason for r in one]
    assert [r.id for r in many] == [p.id for p in MIXED]
    assert {r.source for r in many} == {"local-batched"} and {r.source for r in one} == {"local"}


def test_batched_references_have_their_own_cache_key(tmp_path) -> None:
    """The source is in the key: batched references never answer for exact AR ones (nor the reverse)."""
    target = tiny_target("llama")
    s = ReferenceSettings(max_new_tokens=6, stop_token_ids=[])
    many = compute_references(target, PROMPTS, s, cache_dir=tmp_path, progress=False, batch_size=4)
    one = compute_references(target, PROMPTS, s, cache_dir=tmp_path, progress=False)
    assert many.computed == 3 and one.computed == 3 and one.cached == 0
    assert not {r.key for r in many.references} & {r.key for r in one.references}
    again = compute_references(target, PROMPTS, s, cache_dir=tmp_path, progress=False, batch_size=4)
    assert again.cached == 3 and [r.key for r in again.references] == [r.key for r in many.references]


def test_sampled_references_in_a_batch_are_seeded_per_prompt_set(tmp_path) -> None:
    """At T>0 a batch samples with one generator for all its rows, so a row's sample depends on the batch:
    the key names the prompt set and the seed. The same set and seed give the same samples; another set
    does not reuse them; batch_size 1 keeps seeded single-prompt samples."""
    target = tiny_target("llama")
    s = ReferenceSettings(12, 1.0, 5, [])
    kw = dict(progress=False, batch_size=4)
    first = compute_references(target, PROMPTS, s, cache_dir=tmp_path / "a", **kw).references
    again = compute_references(target, PROMPTS, s, cache_dir=tmp_path / "b", **kw).references
    assert [r.tokens for r in first] == [r.tokens for r in again]
    assert len({r.source for r in first}) == 1 and first[0].source.startswith("local-batched-sampled:")
    assert {r.seed for r in first} == {5} and all(len(r.tokens) == 12 for r in first)
    greedy = compute_references(target, PROMPTS, ReferenceSettings(12, 0.0, 5, []), cache_dir=tmp_path, **kw)
    assert [r.tokens for r in first] != [r.tokens for r in greedy.references]
    two = compute_references(target, PROMPTS[:2], s, cache_dir=tmp_path / "a", **kw)
    assert two.computed == 2 and not {r.key for r in two.references} & {r.key for r in first}
    other_seed = compute_references(target, PROMPTS, ReferenceSettings(12, 1.0, 6, []), cache_dir=tmp_path, **kw)
    assert [r.tokens for r in other_seed.references] != [r.tokens for r in first]
    single = compute_references(target, PROMPTS, s, cache_dir=tmp_path, progress=False, batch_size=1)
    assert {r.source for r in single.references} == {"local"}
    native = [
        compute_references(target, PROMPTS, s, cache_dir=tmp_path / d, batch_engine="native", **kw).references
        for d in ("n1", "n2")
    ]
    assert [r.tokens for r in native[0]] == [r.tokens for r in native[1]]
    assert native[0][0].source.startswith("local-native-sampled:")


def test_batched_references_cut_at_first_disagreement(tmp_path) -> None:
    """A local-batched reference is not exact AR: like a server's, evaluate cuts it at its first
    disagreement with the teacher-forced argmax (a near-tie flip of the padded batch, simulated here)."""
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    refs = compute_references(
        target, PROMPTS, ReferenceSettings(16, stop_token_ids=[]), cache_dir=tmp_path, progress=False,
        batch_size=3,
    ).references  # fmt: skip
    assert {r.source for r in refs} == {"local-batched"}
    refs[1].tokens[5] = (refs[1].tokens[5] + 1) % 97
    report = evaluate(
        target, {"d": drafter}, PROMPTS, budgets=[4], topk=2, max_new_tokens=16, references=refs, progress=False
    )  # fmt: skip
    st = report.references
    assert st.source == "local-batched" and st.truncated_samples == 1
    assert st.tokens == 16 + 5 + 16  # the changed prompt keeps the 5 tokens before the disagreement
    assert st.checked == 16 + 6 + 16 and st.agreed == 37  # compared up to the first disagreement
    assert [(d["id"], d["index"]) for d in st.divergences] == [("p1", 5)]
    assert [x["tokens"] for x in report.drafters["d"].per_sample] == [16, 5, 16]


def test_evaluate_ref_batch(tmp_path) -> None:
    """evaluate's ref_batch picks the producer: None = batched on a CPU target, 1 = exact AR."""
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    kw = dict(budgets=[4], topk=None, max_new_tokens=8, cache_dir=tmp_path, progress=False)
    assert evaluate(target, {"d": drafter}, PROMPTS, **kw).references.source == "local-batched"
    assert evaluate(target, {"d": drafter}, PROMPTS, ref_batch=1, **kw).references.source == "local"


def test_local_divergences_are_counted_not_cut(tmp_path) -> None:
    """A local reference that differs from the teacher-forced argmax (a float near-tie flip, simulated
    here) is kept whole, and the divergence is reported with its position and top-2 margin."""
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    refs = compute_references(
        target, PROMPTS, ReferenceSettings(16, stop_token_ids=[]), cache_dir=tmp_path, progress=False
    ).references
    refs[2].tokens[15] = (refs[2].tokens[15] + 1) % 97  # the last token: no later position is affected
    report = evaluate(
        target,
        {"d": drafter},
        PROMPTS,
        budgets=[4],
        topk=2,
        max_new_tokens=16,
        references=refs,
        progress=False,
    )
    st = report.references
    assert st.truncated_samples == 0 and st.tokens == 48
    assert st.checked == 48 and st.agreed == 47
    assert [(d["id"], d["index"]) for d in st.divergences] == [("p2", 15)] and st.divergences[0]["margin"] > 0
    assert any("differ from the teacher-forced argmax" in n for n in report.notes)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fast_engine_references_match_reference_decoder(tmp_path, family) -> None:
    """The fast engine (the default producer where the target is on CUDA) gives the reference decoder's
    tokens (float64), greedy with a stop token, under its own source and cache key."""
    target = tiny_target(family)
    prompts = [*PROMPTS, EvalPrompt("long", [5, 6, 7, 8, 9, 10, 11, 12, 13], "token ids")]
    s = ReferenceSettings(max_new_tokens=14, stop_token_ids=[4])
    slow = compute_references(target, prompts, s, cache_dir=tmp_path, progress=False, fast_engine=False)
    fast = compute_references(target, prompts, s, cache_dir=tmp_path, progress=False, fast_engine=True)
    assert fast.computed == len(prompts)  # "local-engine": not served from the reference decoder's cache
    assert [r.tokens for r in fast.references] == [r.tokens for r in slow.references]
    assert [r.stop_reason for r in fast.references] == [r.stop_reason for r in slow.references]
    assert {r.source for r in fast.references} == {"local-engine"}
    assert {r.source for r in slow.references} == {"local"}  # a CPU target keeps the reference decoder


def _taus(report) -> dict[str, list[float]]:  # type: ignore[no-untyped-def]
    return {m: [s["tau"][m] for s in report.drafters["d"].per_sample] for m in report.methods}


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_native_batched_references_match_single(tmp_path, family) -> None:
    """References from the batched native engine (continuous batching over a static cache, the default on
    CUDA) are the exact single-sequence AR references token for token in float64, stop tokens and stop
    reasons included, and evaluate() gives the same τ per prompt from both."""
    target = tiny_target(family)
    drafter = tiny_drafter(target)
    stop = _early_stop(target, MIXED, 14)
    s = ReferenceSettings(max_new_tokens=14, stop_token_ids=[stop])
    one = compute_references(target, MIXED, s, cache_dir=tmp_path, progress=False).references
    assert {r.stop_reason for r in one} == {"stop", "length"}
    many = compute_references(
        target, MIXED, s, cache_dir=tmp_path, progress=False, batch_size=3, batch_engine="native"
    ).references
    assert {r.source for r in many} == {"local-native"}
    assert [r.tokens for r in many] == [r.tokens for r in one]
    assert [r.stop_reason for r in many] == [r.stop_reason for r in one]
    kw = dict(budgets=[4, 16], topk=2, max_new_tokens=14, progress=False)
    exact = evaluate(target, {"d": drafter}, MIXED, references=one, **kw)
    batched = evaluate(target, {"d": drafter}, MIXED, references=many, **kw)
    assert batched.references.truncated_samples == 0 and batched.references.agreement_rate == 1.0
    assert _taus(batched) == _taus(exact)


def test_native_is_the_cuda_default() -> None:
    from flashdraft.eval.references import CUDA_REF_BATCH, default_batch_engine, default_ref_batch

    target = tiny_target("llama")
    assert default_batch_engine(target) == "loop" and default_ref_batch("cpu") == 16
    assert default_ref_batch("cuda") == CUDA_REF_BATCH > 1

    class OnCuda:
        device = torch.device("cuda")
        config = target.config
        model = target.model

    assert default_batch_engine(OnCuda()) == "native"


def test_frozen_references_round_trip_same_tau(tmp_path) -> None:
    """A frozen reference file written from exact AR references and read back gives the same τ per prompt
    as the fresh references (float64), with every token checked against the target and nothing cut."""
    from flashdraft.eval.references import read_frozen, write_frozen

    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    s = ReferenceSettings(max_new_tokens=12, stop_token_ids=[4])
    fresh = compute_references(target, MIXED, s, cache_dir=tmp_path, progress=False).references
    path = write_frozen(tmp_path / "y" / "set.jsonl", fresh, target, s)
    with pytest.raises(FileExistsError, match="overwrite"):
        write_frozen(path, fresh, target, s)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["id"] for x in lines] == [p.id for p in MIXED]
    assert {x["target_fingerprint"] for x in lines} == {target_fingerprint(target)}
    assert {x["max_new_tokens"] for x in lines} == {12} and {x["stop_token_ids"][0] for x in lines} == {4}
    frozen = read_frozen(path)
    assert [r.tokens for r in frozen.references] == [r.tokens for r in fresh]
    kw = dict(budgets=[4, 16], topk=2, max_new_tokens=12, progress=False)
    a = evaluate(target, {"d": drafter}, MIXED, references=fresh, **kw)
    b = evaluate(target, {"d": drafter}, MIXED, frozen=frozen, **kw)
    assert b.references.source == "frozen:set.jsonl" and b.references.truncated_samples == 0
    assert b.references.agreement_rate == 1.0 and b.references.checked == a.references.checked
    assert _taus(a) == _taus(b)
    assert any("fingerprint" in n and "this target" in n for n in b.notes)
    assert len(read_frozen(path, limit=2).references) == 2


def test_frozen_references_cut_at_first_disagreement(tmp_path) -> None:
    """Scored on another target, a frozen reference is checked against that target's argmax and cut at its
    first disagreement; the note says the fingerprint is not this target's. A bad line is one clear error."""
    from flashdraft.eval.references import read_frozen, write_frozen

    target = tiny_target("llama")
    s = ReferenceSettings(max_new_tokens=12, stop_token_ids=[])
    fresh = compute_references(target, PROMPTS, s, cache_dir=tmp_path, progress=False).references
    path = write_frozen(tmp_path / "set.jsonl", fresh, target, s)
    other = tiny_target("llama", seed=5)
    rep = evaluate(
        other, {"d": tiny_drafter(other)}, PROMPTS, budgets=[4], topk=None, max_new_tokens=12,
        frozen=read_frozen(path), progress=False,
    )  # fmt: skip
    st = rep.references
    assert st.truncated_samples == 3 and st.agreed == st.checked - 3 and st.tokens == st.checked - 3
    assert any("another target" in n for n in rep.notes)
    with pytest.raises(ValueError, match="max_new_tokens 20"):
        evaluate(other, {"d": tiny_drafter(other)}, PROMPTS, max_new_tokens=20, frozen=read_frozen(path),
                 progress=False)  # fmt: skip
    path.write_text(path.read_text() + '{"format": "x"}\n')
    with pytest.raises(ValueError, match=r"set.jsonl:4: not a frozen reference line"):
        read_frozen(path)


def test_eval_command_scores_a_frozen_file(tmp_path) -> None:
    """`flashdraft eval --references FILE` takes prompts and tokens from the file (no --dataset), reports the
    frozen source, and refuses a longer --max-new-tokens than the file holds with the fix."""
    from typer.testing import CliRunner

    from flashdraft.cli import app
    from flashdraft.eval.references import write_frozen
    from flashdraft.target import load_target

    target = tiny_target("llama")
    target.model.save_pretrained(tmp_path / "target")
    tiny_drafter(target).save_pretrained(tmp_path / "d")
    loaded = load_target(str(tmp_path / "target"), dtype="float64")
    s = ReferenceSettings(max_new_tokens=10, stop_token_ids=[])
    refs = compute_references(loaded, PROMPTS, s, cache_dir=tmp_path / "c", progress=False).references
    frozen = write_frozen(tmp_path / "y.jsonl", refs, loaded, s)
    base = ["eval", "--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "d"), "--references",
            str(frozen), "--budgets", "4", "--topk", "", "--dtype", "float64", "--no-progress"]  # fmt: skip
    r = CliRunner().invoke(app, [*base, "--max-new-tokens", "10", "--out", str(tmp_path / "out")])
    assert r.exit_code == 0, r.output
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    assert rep["references"]["source"] == "frozen:y.jsonl" and rep["references"]["count"] == 3
    assert rep["references"]["agreement_rate"] == 1.0 and rep["dataset"] == "y"
    r = CliRunner().invoke(app, [*base, "--max-new-tokens", "20"])
    assert r.exit_code == 2 and "--max-new-tokens 10 or less" in r.stderr


def test_frozen_file_is_a_prompt_set(tmp_path) -> None:
    """`--dataset FROZEN.jsonl` (bench, eval) gives the prompts the frozen references were made from."""
    from flashdraft.eval.prompts import load_eval_prompts
    from flashdraft.eval.references import write_frozen

    target = tiny_target("llama")
    s = ReferenceSettings(max_new_tokens=4, stop_token_ids=[])
    refs = compute_references(target, MIXED, s, cache_dir=tmp_path, progress=False).references
    path = write_frozen(tmp_path / "set.jsonl", refs, target, s)
    got = load_eval_prompts(str(path), target, limit=3)
    assert [(p.id, p.input_ids) for p in got] == [(p.id, p.input_ids) for p in MIXED[:3]]
