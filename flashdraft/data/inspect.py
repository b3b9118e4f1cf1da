"""`flashdraft data inspect DIR`: counts, length histogram, loss-token totals, one sample with its loss mask.

    flashdraft data inspect data/sharegpt-smollm2 --sample 3
    flashdraft data inspect data/sharegpt-smollm2 --tokenizer none     # ids instead of text

Loss tokens (what the target generated, trained on) are shown inside [[ ]]; everything else is prompt.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from flashdraft.data.dataset import SPLITS, Sample, open_dataset


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
