"""`--budget auto`: the policy's choices, its calibration cache, and token identity with AR whatever it picks."""

from __future__ import annotations

import json
import random
import re

import pytest

from flashdraft.decode.budget import (
    AutoPolicy,
    auto_policy,
    calibrate,
    parse_label,
    prior_tau,
    tau_from_report,
)
from flashdraft.decode.engine import FastEngine
from flashdraft.decode.generate import generate
from tests.conftest import tiny_drafter, tiny_target
from tests.decode.oracle import OracleDrafter

BLOCK = 8


class InvariantChecker:
    """The round invariants that hold whatever ran: the target cache holds all but the bonus; the drafter
    cache plus its pending rows cover the same positions (AR rounds leave their features pending)."""

    def __init__(self) -> None:
        self.rounds = 0

    def __call__(self, info) -> None:  # type: ignore[no-untyped-def]
        self.rounds += 1
        assert info.target_cache_length == info.prompt_tokens + info.committed - 1, info
        assert info.drafter_cache_length + info.drafter_pending == info.target_cache_length, info


class Scripted:
    """A policy that switches method every round along a fixed cycle (the worst case for the state)."""

    period = 1

    def __init__(self, cycle: list[str]) -> None:
        self.cycle, self.i, self.seen = cycle, 0, []

    def choice(self):  # type: ignore[no-untyped-def]
        c = parse_label(self.cycle[self.i % len(self.cycle)])
        self.i += 1
        return c

    def observe(self, choice, accepted, paths=None) -> None:  # type: ignore[no-untyped-def]
        self.seen.append((choice, accepted))


CYCLES = [
    ["ar", "chain", "ddtree:3", "ar", "ar", "ddtree:16", "chain"],
    ["chain", "ar", "ddtree:64", "ddtree:1", "ar"],
    ["ar", "ar", "ar", "chain", "chain", "ddtree:8"],
]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("error_rate", [0.0, 0.3])
def test_auto_switching_every_round_equals_ar(family, error_rate) -> None:
    """Method auto switching between AR, the chain and DDTree budgets every round (AR rounds between
    draft rounds included) commits AR's tokens in float64, with stop tokens and length limits; the
    round invariants (drafter cache + pending == target cache) hold after every round."""
    target = tiny_target(family, layers=4, seed=2)
    inner = tiny_drafter(target, layers=1, block_size=BLOCK)
    rng = random.Random(0)
    runs = long_rounds = 0
    for cycle in CYCLES:
        for _ in range(2):
            prompt = [rng.randrange(target.vocab_size) for _ in range(rng.randint(2, 9))]
            max_new = rng.randint(10, 30)
            ar = generate(target, None, prompt, max_new_tokens=max_new, method="ar").tokens
            stops = [None, [ar[len(ar) // 2]]]
            for stop in stops:
                expected = ar if stop is None else ar[: ar.index(stop[0]) + 1]
                oracle = OracleDrafter(target, inner, prompt, error_rate=error_rate, sharpness=8.0)
                policy = Scripted(cycle)
                checker = InvariantChecker()
                res = generate(
                    target, oracle, prompt, max_new_tokens=max_new, method="auto", policy=policy,
                    stop_token_ids=stop, on_tokens=oracle.on_tokens, _round_callback=checker,
                )  # fmt: skip
                assert res.tokens == expected, (family, cycle, prompt, stop)
                assert res.method == "auto" and sum(res.acceptance_lengths) == len(res.tokens) - 1
                assert checker.rounds == res.rounds + 1
                runs += 1
                long_rounds += sum(a[0] > 1 for c, a in policy.seen if c[0] != "ar")
    assert runs == 12
    assert long_rounds >= 8 or error_rate > 0  # a right drafter: draft rounds commit several tokens


def test_auto_policy_on_the_reference_decoder_equals_ar() -> None:
    """The real policy, calibrated on this machine, with a period of one round: still AR's tokens."""
    target = tiny_target("llama", layers=4, seed=4)
    inner = tiny_drafter(target, layers=1, block_size=BLOCK)
    prompt = [5, 17, 33, 8, 2]
    ar = generate(target, None, prompt, max_new_tokens=40, method="ar").tokens
    oracle = OracleDrafter(target, inner, prompt, error_rate=0.2, sharpness=8.0)
    # costs that make a tree pay at the start; the prior then meets what the oracle does
    policy = AutoPolicy({"ar": 1.0, "chain": 1.5, "ddtree:4": 1.6, "ddtree:16": 1.7},
                        {"chain": 3.0, "ddtree:4": 3.5, "ddtree:16": 4.0}, period=1)  # fmt: skip
    res = generate(target, oracle, prompt, max_new_tokens=40, method="auto", policy=policy,
                   on_tokens=oracle.on_tokens)  # fmt: skip
    assert res.tokens == ar
    assert policy.history and policy.history[0] != "ar" and policy.observed


def test_policy_picks_by_expected_rate_and_falls_back_to_ar() -> None:
    # a CPU-like table: a chain round costs 4.5 AR steps, a tree round more; τ 2.5-3: AR wins, and stays
    cpu = AutoPolicy({"ar": 0.1, "chain": 0.45, "ddtree:8": 0.5}, {"chain": 2.7, "ddtree:8": 3.1})
    assert cpu.choice() == ("ar", None) and cpu.choice() == ("ar", None)
    assert cpu.history == ["ar"] and cpu.counts == {"ar": 2}  # a repeat is counted, recorded once
    # a GPU-like table: a tree round costs 1.6 AR steps; DDTree-8 wins on its τ
    gpu = AutoPolicy({"ar": 1.0, "chain": 1.4, "ddtree:8": 1.6}, {"chain": 2.7, "ddtree:8": 3.1})
    assert gpu.choice() == ("ddtree", 8)
    # it commits one token a round: the estimate falls (8 rounds of prior), the chain's with it, AR takes over
    gpu.observe(("ddtree", 8), [1] * 40)
    assert gpu.tau("ddtree:8") < 1.4 and gpu.tau("chain") < 1.4
    assert gpu.choice() == ("ar", None)
    # ties go to AR
    assert AutoPolicy({"ar": 1.0, "chain": 2.0}, {"chain": 2.0}).choice() == ("ar", None)
    with pytest.raises(ValueError, match="no starting τ"):
        AutoPolicy({"ar": 1.0, "chain": 2.0}, {})


def test_prior_is_below_a_budget_plus_one() -> None:
    assert prior_tau(("ar", None)) == 1.0
    assert prior_tau(("ddtree", 1)) <= 2.0
    assert prior_tau(("chain", None)) < prior_tau(("ddtree", 8)) < prior_tau(("ddtree", 32))


def test_tau_from_report(tmp_path) -> None:
    rep = {
        "drafters": {
            "d": {"methods": {"chain": {"tau": 2.5}, "ddtree-8": {"tau": 3.0}, "topk-8": {"tau": 4}}}
        }
    }
    (tmp_path / "report.json").write_text(json.dumps(rep))
    assert tau_from_report(tmp_path) == {"chain": 2.5, "ddtree:8": 3.0}
    assert tau_from_report(tmp_path, "x") == {"chain": 2.5, "ddtree:8": 3.0}  # the only drafter
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a flashdraft eval report"):
        tau_from_report(tmp_path / "bad.json")


def test_tau_from_report_picks_the_drafter_that_runs(tmp_path) -> None:
    """A report of several drafters (shipped beside a candidate): the entry is chosen by name, by the running
    drafter folder's weights (sha256) or by its folder name; otherwise a one-line error naming them."""
    from flashdraft.files import file_sha256

    mine = tmp_path / "runs" / "drafter-bf16"
    mine.mkdir(parents=True)
    (mine / "model.safetensors").write_bytes(b"weights of the candidate")
    entry = lambda tau, **kw: {"methods": {"chain": {"tau": tau}}, **kw}  # noqa: E731
    rep = {"drafters": {"shipped": entry(2.7, weights_sha256="0" * 64),
                        "cand": entry(3.1, weights_sha256=file_sha256(mine / "model.safetensors"))}}  # fmt: skip
    (tmp_path / "report.json").write_text(json.dumps(rep))
    assert tau_from_report(tmp_path, "shipped") == {"chain": 2.7}
    assert tau_from_report(tmp_path, str(mine)) == {"chain": 3.1}  # by weights, though named otherwise
    shipped_dir = tmp_path / "models" / "shipped"  # named like an entry, but that entry records other weights
    shipped_dir.mkdir(parents=True)
    (shipped_dir / "model.safetensors").write_bytes(b"weights shipped since")
    with pytest.raises(ValueError, match="none has its weights"):
        tau_from_report(tmp_path, str(shipped_dir))
    rep["drafters"] = {"shipped": entry(2.7), "drafter-bf16": entry(3.3)}  # an older report: no weights field
    (tmp_path / "report.json").write_text(json.dumps(rep))
    assert tau_from_report(tmp_path, str(mine)) == {"chain": 3.3}  # by folder name
    with pytest.raises(ValueError, match="name one"):
        tau_from_report(tmp_path)
    with pytest.raises(ValueError, match="no drafter 'other'"):
        tau_from_report(tmp_path, "other")


def test_calibration_is_cached_per_target_and_drafter(tmp_path) -> None:
    target = tiny_target("llama", layers=2)
    drafter = tiny_drafter(target, layers=1, block_size=BLOCK)
    calls = []

    def counted(*a, **k):  # type: ignore[no-untyped-def]
        calls.append(k["method"])
        return generate(*a, **k)

    cands = [("ar", None), ("chain", None), ("ddtree", 4)]
    t1 = calibrate(target, drafter, counted, cands, cache_dir=tmp_path, rounds=3, prompt_len=8)
    assert set(t1.seconds) == {"ar", "chain", "ddtree:4"} and all(v > 0 for v in t1.seconds.values())
    assert calls == ["ar", "ar", "chain", "chain", "ddtree", "ddtree"]  # a warm-up and a timed run each
    t2 = calibrate(target, drafter, counted, cands, cache_dir=tmp_path, rounds=3, prompt_len=8)
    assert t2 == t1 and len(calls) == 6
    other = tiny_drafter(target, layers=1, block_size=BLOCK, seed=9)
    calibrate(target, other, counted, cands, cache_dir=tmp_path, rounds=3, prompt_len=8)
    assert len(calls) == 12  # another drafter's weights: measured again


def test_auto_policy_from_report_keeps_its_budgets(tmp_path) -> None:
    target = tiny_target("llama", layers=2)
    drafter = tiny_drafter(target, layers=1, block_size=BLOCK)
    rep = {"drafters": {"d": {"methods": {"chain": {"tau": 2.0}, "ddtree-4": {"tau": 2.5}}}}}
    (tmp_path / "report.json").write_text(json.dumps(rep))
    pol = auto_policy(target, drafter, generate, tau_report=tmp_path, cache_dir=tmp_path / "c")
    assert set(pol.seconds) == {"ar", "chain", "ddtree:4"} and pol.start_tau == {
        "ar": 1.0,
        "chain": 2.0,
        "ddtree:4": 2.5,
    }
    assert auto_policy(target, None, generate, cache_dir=tmp_path / "c").seconds.keys() == {"ar"}


def test_fast_engine_auto_picks_per_call_and_equals_ar() -> None:
    """On the fast engine auto picks once per call and learns from the call's rounds; AR's tokens."""
    target = tiny_target("qwen3", layers=3, seed=1)
    drafter = tiny_drafter(target, layers=1, block_size=BLOCK, seed=3)
    engine = FastEngine(target, drafter, max_len=64, max_budget=16)
    prompt = [3, 9, 27, 81 % 97]
    ar = generate(target, None, prompt, max_new_tokens=20, method="ar").tokens
    policy = AutoPolicy({"ar": 1.0, "chain": 1.9, "ddtree:16": 2.0}, {"chain": 3.0, "ddtree:16": 4.0})
    first = engine.generate(prompt, max_new_tokens=20, method="auto", policy=policy)
    assert first.tokens == ar and first.method == "ddtree" and policy.observed["ddtree:16"][0] > 0
    # a random drafter commits ~1 token a round: after a few calls the policy falls back to AR
    for _ in range(6):
        res = engine.generate(prompt, max_new_tokens=20, method="auto", policy=policy)
        assert res.tokens == ar
    assert policy.history[-1] == "ar"


def test_generate_and_bench_commands_with_auto(tmp_path, monkeypatch) -> None:
    """`flashdraft generate` picks auto by default (and with --budget auto, and from --tau-report), prints
    what it ran and AR's tokens; `flashdraft bench --methods auto,ar` has an auto row identical to AR."""
    import torch
    from typer.testing import CliRunner

    from flashdraft.cli import app
    from flashdraft.target import load_target

    monkeypatch.setenv("FLASHDRAFT_CACHE", str(tmp_path / "cache"))
    t = tiny_target("llama", dtype=torch.float32, layers=4)
    t.model.save_pretrained(tmp_path / "target")
    tiny_drafter(t, layers=1, block_size=BLOCK).save_pretrained(tmp_path / "drafter")
    loaded = load_target(str(tmp_path / "target"))
    expected = generate(loaded, None, [5, 6, 7, 8], max_new_tokens=12, method="ar").tokens
    runner = CliRunner()
    args = ["generate", "--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"),
            "--prompt-ids", "5,6,7,8", "--max-new-tokens", "12"]  # fmt: skip
    rep = {"drafters": {"d": {"methods": {"chain": {"tau": 7.5}, "ddtree-4": {"tau": 2.0}}}}}
    (tmp_path / "report.json").write_text(json.dumps(rep))
    for extra in ([], ["--budget", "auto"], ["--tau-report", str(tmp_path / "report.json")]):
        res = runner.invoke(app, [*args, *extra])
        assert res.exit_code == 0, res.output
        assert res.stdout.strip().splitlines()[0] == " ".join(map(str, expected))
        assert "[auto: " in res.stderr and "12 tokens" in res.stderr
    assert "[auto: chain" in res.stderr  # τ 7.5 from the report: the chain pays even on a CPU
    assert list((tmp_path / "cache" / "budget").glob("*.json"))  # the calibration was cached
    res = runner.invoke(app, [*args, "--budget", "x"])
    assert res.exit_code != 0 and "'auto'" in res.output
    (tmp_path / "p.jsonl").write_text('{"input_ids": [5, 6, 7]}\n{"input_ids": [9, 3]}\n')
    res = runner.invoke(app, ["bench", "--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"),
                              "--dataset", str(tmp_path / "p.jsonl"), "--limit", "2", "--methods", "ar,auto",
                              "--max-new-tokens", "8", "--no-progress"])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "| auto |" in res.stdout and "2/2" in res.stdout and "auto chose" in res.stdout
    assert re.search(r"auto: \d+\.\d% of the best fixed method's tokens/s \(ar, ", res.stdout), res.stdout
    cold = runner.invoke(app, ["bench", "--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"),
                               "--dataset", str(tmp_path / "p.jsonl"), "--limit", "2", "--methods", "ar,auto",
                               "--max-new-tokens", "8", "--no-progress", "--warmup", "0"])  # fmt: skip
    chose = [re.search(r"auto chose \(per choice\): ([^;]*);", r.stdout).group(1) for r in (res, cold)]
    # the warm-up ran on a copy of auto's policy: the timed runs learn from scratch
    assert chose[0] == chose[1]


def test_serve_engine_auto_uses_one_learning_policy(tmp_path, monkeypatch) -> None:
    """The server's Engine with method auto calibrates one policy at start-up and passes it to every
    generation (greedy: AR's tokens), which learns from each request."""
    import time

    from flashdraft.serve.protocol import SamplingParams
    from flashdraft.serve.worker import Done, Engine, EngineSettings, Job

    class Tok:
        eos_token_id = None

        def get_vocab(self) -> dict[str, int]:
            return {}

        def decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
            return " ".join(map(str, tokens))

    monkeypatch.setenv("FLASHDRAFT_CACHE", str(tmp_path))
    target = tiny_target("llama", layers=3, seed=6)
    drafter = tiny_drafter(target, layers=1, block_size=BLOCK)
    target.tokenizer = Tok()
    engine = Engine(target, drafter, EngineSettings(method="auto"))
    assert engine.policy is not None and set(engine.policy.seconds) >= {"ar", "chain", "ddtree:4"}
    prompt = [4, 8, 15, 16]
    ar = generate(target, None, prompt, max_new_tokens=10, method="ar").tokens
    events: list = []
    job = Job(prompt, SamplingParams(max_tokens=10, temperature=0.0), events.append, time.monotonic() + 60)
    engine._run(job)
    done = [e for e in events if isinstance(e, Done)]
    assert len(done) == 1 and done[0].completion_tokens == 10 and engine.policy.history
    text = "".join(getattr(e, "text", "") for e in events)
    assert text.split() == [str(t) for t in ar]


def test_a_tree_round_tells_what_every_smaller_budget_would_have_accepted() -> None:
    """The first round of a budget-16 DDTree read for b < 16 through its path (its nodes <= b: a b-node tree is the
    first b nodes) commits what a budget-b round from the same state commits (float64, a mostly-right drafter)."""
    target = tiny_target("llama", layers=4, seed=2)
    inner = tiny_drafter(target, layers=1, block_size=BLOCK)
    rng = random.Random(1)
    seen, cut = set(), 0

    def first_round(prompt: list[int], seed: int, budget: int):  # type: ignore[no-untyped-def]
        oracle = OracleDrafter(target, inner, prompt, error_rate=0.2, sharpness=4.0, seed=seed)
        return generate(target, oracle, prompt, max_new_tokens=BLOCK + 1, method="ddtree", budget=budget,
                        on_tokens=oracle.on_tokens)  # fmt: skip

    for i in range(12):
        prompt = [rng.randrange(target.vocab_size) for _ in range(rng.randint(2, 9))]
        big = first_round(prompt, i, 16)
        path = big.tree_paths[0]
        assert big.acceptance_lengths[0] == 1 + len(path) and path == sorted(path)
        for b in (1, 2, 4, 8):
            small = first_round(prompt, i, b)
            assert small.acceptance_lengths[0] == 1 + sum(node <= b for node in path), (prompt, b, path)
            seen.add(small.acceptance_lengths[0])
            cut += small.acceptance_lengths[0] < big.acceptance_lengths[0]
    assert len(seen) >= 5 and cut >= 10  # long and short acceptances; smaller trees often accepted less


def test_the_fast_engine_reports_the_reference_decoder_s_tree_paths() -> None:
    target = tiny_target("qwen3", layers=3, seed=1)
    drafter = tiny_drafter(target, layers=1, block_size=BLOCK, seed=3)
    engine = FastEngine(target, drafter, max_len=96, max_budget=32)
    for prompt in ([3, 9, 27, 81], [5, 17, 33, 8, 2, 60]):
        ref = generate(target, drafter, prompt, max_new_tokens=40, method="ddtree", budget=32)
        fast = engine.generate(prompt, max_new_tokens=40, method="ddtree", budget=32)
        assert fast.tokens == ref.tokens and fast.acceptance_lengths == ref.acceptance_lengths
        assert fast.tree_paths == ref.tree_paths and len(ref.tree_paths) == ref.rounds
        chain = engine.generate(prompt, max_new_tokens=40, method="chain")
        assert chain.tree_paths == []


def test_a_tree_round_counts_for_every_smaller_budget_and_the_largest_runs_first() -> None:
    seconds = {"ar": 1.0, "chain": 1.4, "ddtree:8": 1.5, "ddtree:32": 1.6, "ddtree:128": 1.9}
    start = {"chain": 3.0, "ddtree:8": 3.5, "ddtree:32": 4.0, "ddtree:128": 4.6}
    pol = AutoPolicy(seconds, start, explore_every=4)
    # DDTree-32 leads (2.50 tokens per unit against 2.42): the first choice trusts that; 128 is within explore_ratio,
    # so it runs at the second
    assert pol.choice() == ("ddtree", 32) and pol.choice() == ("ddtree", 128)
    pol.observe(("ddtree", 128), [4, 4, 2], [[1, 3, 9], [1, 2, 40], [70]])
    # 32 would have kept nodes 1, 3, 9 | 1, 2 | none; 8 would have kept 1, 3 | 1, 2 | none
    assert pol.observed == {"ddtree:128": [3, 10], "ddtree:32": [3, 8], "ddtree:8": [3, 7]}
    with pytest.raises(ValueError, match="2 tree paths for 3 rounds"):
        pol.observe(("ddtree", 128), [4, 6, 2], [[1, 3, 9], [1, 2]])
    assert pol.observed["ddtree:128"] == [3, 10]  # a refused observation changes nothing
    # measured below their starts, 32 leads (2.27 against 2.24 for 128) until the next exploration
    assert pol.tau("ddtree:32") == pytest.approx((8 * 4.0 + 8) / 11)
    assert [pol.choice() for _ in range(4)] == [("ddtree", 32)] * 3 + [("ddtree", 128)]  # 4 choices after
    # far below the best, the largest budget does not run
    far = AutoPolicy({"ar": 1.0, "chain": 1.4, "ddtree:512": 5.0}, {"chain": 3.0, "ddtree:512": 6.0})
    assert [far.choice() for _ in range(3)] == [("chain", None)] * 3
    # where AR wins (a CPU), nothing is explored
    cpu = AutoPolicy({"ar": 0.1, "chain": 0.45, "ddtree:8": 0.5}, {"chain": 2.7, "ddtree:8": 3.1})
    assert cpu.choice() == ("ar", None)
