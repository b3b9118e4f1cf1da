"""Prompt sources before any regeneration: how many conversations each holds, how many distinct prompts, and how
many share a word 13-gram with an evaluation set (the check `flashdraft data regenerate --contamination` applies).

    python benchmarks/source_overlap.py codeio:/tmp/rg/codeio.jsonl.gz codeio:/tmp/rg/codeio-hq.jsonl.gz
    python benchmarks/source_overlap.py sharegpt --eval humaneval --ngram 13

Distinct prompts are counted over all the sources given, in order (a prompt seen in an earlier source is not
counted again), with the regenerator's own key (`flashdraft.data.regenerate.conversation_key`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashdraft.data.dataset import source_ngrams, word_ngrams  # noqa: E402
from flashdraft.data.regenerate import conversation_key  # noqa: E402
from flashdraft.data.sources import SourceStats, load_conversations  # noqa: E402


def overlap_table(sources: list[str], evals: list[str], ngram: int) -> str:
    refs = {name: source_ngrams(name, ngram) for name in evals}
    seen: set[str] = set()
    lines = [
        f"| source | conversations | distinct prompts (new) | {' | '.join(f'sharing a {ngram}-gram with {e}' for e in evals)} |",
        "|---|---:|---:|" + "---:|" * len(evals),
    ]
    for spec in sources:
        stats = SourceStats(max_bad_fraction=1.0)
        convs = load_conversations(spec, stats=stats)
        new = []
        for c in convs:
            key = conversation_key(c)
            if key not in seen:
                seen.add(key)
                new.append(c)
        conv_grams = [set().union(*(word_ngrams(t.content, ngram) for t in c.turns)) for c in new]
        hits = [sum(1 for g in conv_grams if g & grams) for grams in refs.values()]
        bad = f" ({len(stats.bad)} bad records skipped)" if stats.bad else ""
        lines.append(
            f"| {spec}{bad} | {len(convs):,} | {len(new):,} | {' | '.join(f'{h:,}' for h in hits)} |"
        )
    lines.append(f"| all | | {len(seen):,} | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "sources", nargs="+", help="source specs as `flashdraft data regenerate --input` takes them"
    )
    ap.add_argument("--eval", action="append", default=None, help="evaluation source(s) (default: humaneval)")
    ap.add_argument("--ngram", type=int, default=13, help="word n-gram length of the check")
    a = ap.parse_args(argv)
    print(overlap_table(a.sources, a.eval or ["humaneval"], a.ngram))


if __name__ == "__main__":
    main()
