"""`data inspect`'s repetition share and regeneration-cap count, on a crafted dataset with known loops."""

from __future__ import annotations

import numpy as np
import pytest

from flashdraft.data.dataset import Sample, open_dataset, write_dataset
from flashdraft.data.inspect import inspect_dataset, repeated_tokens, repetition_stats


def _brute(answer: list[int], n: int) -> list[bool]:
    seen: set[tuple[int, ...]] = set()
    out = []
    for i in range(len(answer)):
        if i < n - 1:
            out.append(False)
            continue
        g = tuple(answer[i - n + 1 : i + 1])
        out.append(g in seen)
        seen.add(g)
    return out


@pytest.mark.parametrize("seed", range(5))
def test_repeated_tokens_is_the_set_of_earlier_ngrams(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for length in (0, 3, 8, 9, 40, 300):
        a = rng.integers(0, 3, length)  # 3 symbols: 3-grams repeat often, 8-grams sometimes
        for n in (3, 8):
            assert repeated_tokens(a, n).tolist() == _brute(a.tolist(), n)


def _sample(sid: str, prompt: int, answers: list[list[int]], finish: list[str]) -> Sample:
    ids, mask = [], []
    for k, ans in enumerate(answers):
        ids += list(range(1000 + 10 * k, 1000 + 10 * k + prompt))  # a prompt before every answer
        mask += [False] * prompt
        ids += ans
        mask += [True] * len(ans)
    return Sample(
        sid, np.array(ids, np.int32), np.array(mask, bool), {"conversation_id": sid, "finish": finish}
    )


def test_inspect_reports_repetition_and_the_cap(tmp_path) -> None:  # noqa: ANN001
    ten = list(range(1, 11))
    samples = [
        _sample("a", 5, [ten + ten], ["length"]),  # the second copy of 1..8, 2..9, 3..10: 3 repeated tokens
        _sample("b", 5, [list(range(20, 50))], ["stop"]),  # no repeat
        _sample("c", 4, [[7] * 10, [7] * 10], ["stop", "length"]),  # two answers, 2 repeated tokens each
        _sample(
            "d", 3, [list(range(100, 200)) + list(range(100, 120))], ["stop"]
        ),  # 13 repeats, all after 96
    ]
    out = tmp_path / "ds"
    write_dataset(samples, out, eval_fraction=0.0, contamination_sources=(),
                  manifest_extra={"generation": {"max_new_tokens": 20}})  # fmt: skip
    st = repetition_stats(open_dataset(out, "train"))
    assert (st.answers, st.tokens, st.repeated) == (5, 190, 20)
    assert (st.early_tokens, st.early_repeated) == (166, 7)
    assert (st.with_finish, st.capped) == (5, 2)
    text = inspect_dataset(str(out), tokenizer="none")
    line = next(x for x in text.splitlines() if "train repetition" in x)
    assert (
        "10.5% of 190 answer tokens repeat an earlier 8-gram of their answer (4.2% in the first 96, 54.2% after)"
        in line
    )
    assert "2 of 5 answers (40.0%) stopped at the 20-token cap" in line
    assert "eval  repetition: - of 0 answer tokens" in text
    assert st.summary() == {
        "answers": 5, "answer_tokens": 190, "repeated": 0.1053, "repeated_first_96": 0.0422,
        "repeated_after_96": 0.5417, "at_cap": 0.4,
    }  # fmt: skip
    assert repetition_stats([]).summary()["repeated"] is None


def test_inspect_of_a_folder_trimmed_to_one_split(tmp_path) -> None:  # noqa: ANN001
    """A dataset folder holding only its eval split (the committed held-out split) is inspected with
    --split eval; the missing split is one line naming its shard, not a failure."""
    import shutil

    samples = [_sample(f"s{i}", 5, [list(range(10 * i, 10 * i + 12))], ["stop"]) for i in range(8)]
    out = tmp_path / "ds"
    write_dataset(samples, out, eval_fraction=0.5, contamination_sources=())
    shutil.rmtree(out / "train")
    text = inspect_dataset(str(out), split="eval", tokenizer="none")
    assert "train repetition: not read" in text and "part-00000.parquet" in text
    assert "eval  repetition: 0.0% of" in text
