"""`flashdraft data inspect DIR`: counts, length histogram, loss-token totals, repetition, one sample with its loss mask.

    flashdraft data inspect data/sharegpt-smollm2 --sample 3
    flashdraft data inspect data/sharegpt-smollm2 --tokenizer none     # ids instead of text

Loss tokens (what the target generated, trained on) are shown inside [[ ]]; everything else is prompt.
Repetition, per split: the share of answer tokens that end an 8-token n-gram already seen earlier in the same
answer (a small greedy target loops: such tokens are easy to draft, and they inflate the training metrics
over what held-out τ shows), the same share in an answer's first 96 tokens and after them, and how many
answers stopped at the regeneration cap (finish "length": max_new_tokens) instead of a stop token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from flashdraft.data.dataset import SPLITS, DatasetError, Sample, loss_runs, open_dataset


def histogram(lengths: np.ndarray, bins: int = 10, width: int = 40) -> list[str]:
    if len(lengths) == 0:
        return ["  (empty)"]
    counts, edges = np.histogram(lengths, bins=bins)
    top = max(int(counts.max()), 1)
    return [
        f"  {int(edges[i]):>7,}–{int(edges[i + 1]):<7,} {int(c):>7,} {'#' * int(round(width * c / top))}"
        for i, c in enumerate(counts)
    ]


def render_sample(s: Sample, tokenizer: Any | None) -> str:
    """The sample as text (or ids), loss runs wrapped in [[ ]]."""
    ids, mask = s.input_ids.tolist(), s.loss_mask
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    cuts = [0, *edges.tolist(), len(ids)]
    parts = []
    for a, b in zip(cuts[:-1], cuts[1:], strict=True):
        if a == b:
            continue
        chunk = ids[a:b]
        body = tokenizer.decode(chunk) if tokenizer is not None else " ".join(map(str, chunk))
        parts.append(f"[[{body}]]" if mask[a] else body)
    return ("" if tokenizer is not None else " ").join(parts)


REPEAT_NGRAM = 8  # tokens per n-gram of the repetition share
# "an answer's first tokens": where slot-1 accuracy was lowest on the shipped drafter's data
EARLY_TOKENS = 96


def repeated_tokens(answer: np.ndarray, n: int = REPEAT_NGRAM) -> np.ndarray:
    """[len] bool: token i ends an n-gram (tokens i-n+1..i) that already ended at an earlier position of `answer`."""
    out = np.zeros(len(answer), bool)
    if len(answer) <= n:
        return out
    grams = np.ascontiguousarray(sliding_window_view(answer.astype(np.int64), n))  # [m, n]
    keys = grams.view(np.dtype((np.void, 8 * n))).ravel()  # [m]: one exact key per n-gram
    _, first = np.unique(keys, return_index=True)  # the first position of each distinct n-gram
    seen = np.ones(len(keys), bool)
    seen[first] = False
    out[n - 1 :] = seen
    return out


@dataclass
class RepetitionStats:
    answers: int = 0  # loss runs: one per generated answer
    tokens: int = 0  # answer (loss) tokens
    repeated: int = 0  # of them, ending an n-gram seen earlier in the same answer
    early_tokens: int = 0  # answer tokens at positions < EARLY_TOKENS of their answer
    early_repeated: int = 0
    with_finish: int = 0  # answers whose sample meta records how generation ended
    capped: int = 0  # of them, stopped by max_new_tokens (finish "length")

    @staticmethod
    def share(part: int, whole: int) -> str:
        return f"{part / whole:.1%}" if whole else "-"

    def line(self, split: str, cap: Any) -> str:
        late_t, late_r = self.tokens - self.early_tokens, self.repeated - self.early_repeated
        cap_text = f"the {cap}-token cap" if cap else "the regeneration cap"
        capped = (f"{self.capped:,} of {self.with_finish:,} answers ({self.share(self.capped, self.with_finish)}) "
                  f"stopped at {cap_text}") if self.with_finish else "no finish reasons recorded"  # fmt: skip
        return (
            f"  {split:5s} repetition: {self.share(self.repeated, self.tokens)} of {self.tokens:,} answer tokens "
            f"repeat an earlier {REPEAT_NGRAM}-gram of their answer ({self.share(self.early_repeated, self.early_tokens)} "
            f"in the first {EARLY_TOKENS}, {self.share(late_r, late_t)} after); {capped}"
        )

    def summary(self) -> dict[str, Any]:
        """The shares as numbers (a stint's line in benchmarks/results/campaign/stints.jsonl)."""

        def share(part: int, whole: int) -> float | None:
            return round(part / whole, 4) if whole else None

        late_t, late_r = self.tokens - self.early_tokens, self.repeated - self.early_repeated
        return {
            "answers": self.answers,
            "answer_tokens": self.tokens,
            "repeated": share(self.repeated, self.tokens),
            f"repeated_first_{EARLY_TOKENS}": share(self.early_repeated, self.early_tokens),
            f"repeated_after_{EARLY_TOKENS}": share(late_r, late_t),
            "at_cap": share(self.capped, self.with_finish),
        }


def repetition_stats(samples: Any) -> RepetitionStats:
    """Repetition over every answer (loss run) of `samples` (a Dataset split or any iterable of Samples)."""
    st = RepetitionStats()
    for s in samples:
        finish = s.meta.get("finish") or []
        for k, (a, b) in enumerate(loss_runs(s.loss_mask)):
            rep = repeated_tokens(s.input_ids[a:b])
            st.answers += 1
            st.tokens += b - a
            st.repeated += int(rep.sum())
            st.early_tokens += min(b - a, EARLY_TOKENS)
            st.early_repeated += int(rep[:EARLY_TOKENS].sum())
            if k < len(finish):
                st.with_finish += 1
                st.capped += finish[k] == "length"
    return st


def inspect_dataset(path: str, *, split: str = "train", index: int = 0, tokenizer: str | None = None,
                    bins: int = 10) -> str:  # fmt: skip
    first = open_dataset(path, split)
    m = first.manifest
    lines = [f"dataset {path}  (format {m['format']}, target {m.get('target', '?')})"]
    if "command" in m:
        lines.append(f"  made by: {m['command']}")
    for sp in SPLITS:
        t = m["tokens"][sp]
        frac = t["loss"] / t["total"] if t["total"] else 0.0
        lines.append(
            f"  {sp:5s} {m['counts'][sp]:>8,} samples {t['total']:>13,} tokens {t['loss']:>13,} loss tokens ({frac:.0%})"
        )
    lines.append(f"  dropped: {m.get('dropped') or 'nothing'}")
    cap = (m.get("generation") or {}).get("max_new_tokens")
    for sp in SPLITS:
        try:
            ds = first if sp == split else open_dataset(path, sp)
        except DatasetError as e:  # a folder trimmed to one split (e.g. a committed held-out split)
            lines.append(f"  {sp:5s} repetition: not read ({e})")
            continue
        lines.append(repetition_stats(ds).line(sp, cap))
    lines.append(f"length histogram ({split}, tokens per sample):")
    lines += histogram(first.lengths, bins)
    if len(first) == 0:
        return "\n".join(lines)
    tok = None
    name = tokenizer if tokenizer is not None else m.get("target")
    if name and name != "none":
        try:
            from flashdraft.data.regenerate import load_tokenizer

            tok = load_tokenizer(name)
        except (OSError, ValueError) as e:
            lines.append(f"(no tokenizer for {name!r}: {e}; showing ids)")
    s = first[index]
    n_loss = int(s.loss_mask.sum())
    lines.append(f"sample {index} ({s.id}): {len(s.input_ids)} tokens, {n_loss} loss tokens in [[ ]]:")
    lines.append(render_sample(s, tok))
    return "\n".join(lines)
