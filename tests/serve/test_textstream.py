"""Stop strings matched on decoded text, across token boundaries, with held-back partial text."""

from __future__ import annotations

import random

from flashdraft.serve.textstream import TextStream

# a toy tokenizer: token i is the i-th piece; 9 and 10 are the two halves of "é" in UTF-8
PIECES = ["Hel", "lo", " wor", "ld", "\n", "\n\n", "END", "E", "ND", b"\xc3", b"\xa9", "!"]


def decode(tokens: list[int]) -> str:
    raw = b"".join(p if isinstance(p, bytes) else p.encode() for p in (PIECES[t] for t in tokens))
    return raw.decode("utf-8", errors="replace")


def run(tokens: list[int], rounds: list[int], stop: list[str]) -> tuple[str, TextStream]:
    ts = TextStream(decode, stop)
    out, i = [], 0
    for r in rounds:
        out.append(ts.push(tokens[i : i + r]))
        i += r
        if ts.stopped:
            break
    out.append(ts.finish())
    return "".join(out), ts


def test_no_stop_streams_everything() -> None:
    text, ts = run([0, 1, 2, 3], [1, 1, 2], [])
    assert text == "Hello world" and not ts.stopped


def test_stop_spanning_tokens_and_rounds_is_cut_before_the_stop() -> None:
    # "E" + "ND" = "END" spans two tokens that arrive in different rounds
    text, ts = run([0, 1, 7, 8, 2, 3], [2, 1, 1, 2], ["END"])
    assert text == "Hello" and ts.stopped
    assert ts.stop_tokens == 4  # tokens up to and including the one completing the stop


def test_partial_stop_is_held_back_then_released() -> None:
    ts = TextStream(decode, ["END"])
    assert ts.push([0, 7]) == "Hel"  # "E" might start "END": held back
    assert ts.push([11]) == "E!"  # it did not
    assert not ts.stopped


def test_earliest_of_several_stops_wins() -> None:
    text, ts = run([0, 4, 1, 6], [4], ["END", "\n"])
    assert text == "Hel" and ts.stopped and ts.stop_tokens == 2


def test_incomplete_utf8_is_held_back() -> None:
    ts = TextStream(decode, [])
    assert ts.push([0, 9]) == "Hel"  # first byte of "é" only
    assert ts.push([10]) == "é"


def test_random_rounds_give_the_same_text_as_one_pass() -> None:
    rng = random.Random(0)
    for _ in range(200):
        tokens = [rng.randrange(len(PIECES)) for _ in range(rng.randint(1, 20))]
        stops = rng.choice([[], ["END"], ["\n\n"], ["ld", "!"], ["o wo"]])
        rounds = []
        while sum(rounds) < len(tokens):
            rounds.append(rng.randint(1, 4))
        text, ts = run(tokens, rounds, stops)
        full = decode(tokens)
        cut = min((i for s in stops if (i := full.find(s)) >= 0), default=None)
        assert text == (full if cut is None else full[:cut]), (tokens, rounds, stops)
        assert ts.stopped == (cut is not None)
