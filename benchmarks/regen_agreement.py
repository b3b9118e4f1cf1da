"""How far two regenerations of the same conversations agree, sample by sample.

    python benchmarks/regen_agreement.py DATASET_A DATASET_B [--json out.json]

For every sample id in both (train and eval splits): identical, one a strict prefix of the other
(the same conversation answered for fewer turns), or divergent — then where the first differing
token sits, counted from the first answer token. Greedy regenerations of one prompt differ only
through floating point: on a GPU in bf16, a different batch (other rows, other attention spans)
changes the rounding, and a top-2 tie in the logits then picks the other token.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import numpy as np

from flashdraft.data.dataset import SPLITS, open_dataset


def compare(path_a: str, path_b: str) -> dict:
    a = {s.id: s for split in SPLITS for s in open_dataset(path_a, split)}
    kinds: Counter[str] = Counter()
    into_answer: list[int] = []
    for split in SPLITS:
        for y in open_dataset(path_b, split):
            x = a.get(y.id)
            if x is None:
                kinds["only_in_b"] += 1
                continue
            n = min(len(x.input_ids), len(y.input_ids))
            diff = np.nonzero(x.input_ids[:n] != y.input_ids[:n])[0]
            if len(diff) == 0:
                kinds["identical" if len(x.input_ids) == len(y.input_ids) else "prefix"] += 1
                continue
            first_answer = int(np.argmax(x.loss_mask))
            kinds["divergent_in_prompt" if diff[0] < first_answer else "divergent_in_answer"] += 1
            if diff[0] >= first_answer:
                into_answer.append(int(diff[0]) - first_answer)
    q = np.percentile(into_answer, [10, 25, 50, 75, 90]).tolist() if into_answer else []
    return {
        "a": path_a,
        "b": path_b,
        "shared": sum(v for k, v in kinds.items() if k != "only_in_b"),
        "kinds": dict(kinds),
        "divergence_tokens_into_answer_p10_p25_p50_p75_p90": q,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    r = compare(args.a, args.b)
    print(f"{r['shared']} shared samples: {r['kinds']}")
    if r["divergence_tokens_into_answer_p10_p25_p50_p75_p90"]:
        print("first divergence, tokens into the answer (p10/p25/p50/p75/p90):",
              " / ".join(f"{v:.0f}" for v in r["divergence_tokens_into_answer_p10_p25_p50_p75_p90"]))  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
