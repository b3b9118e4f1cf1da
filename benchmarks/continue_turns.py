"""How many later user turns `flashdraft data regenerate --continue-from DATASET` would answer, before any GPU time:
the conversations DATASET answered from turn 0, the turns each has left under --max-turns, and the counted skips.

    python benchmarks/continue_turns.py --input sharegpt:.stage/1/sharegpt_compact.json.gz --skip 10240 \
        --max-turns 8 .data/campaign/stint-3/new-data

The chat template is the target's tokenizer's (the default target's unless --target), with the stop ids and the eval
fraction the first DATASET's manifest records, so a dataset made on a GPU host from a saved copy of the target is
read as that run wrote it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashdraft.data.regenerate import (  # noqa: E402
    RegenConfig,
    collect_conversations,
    continue_conversations,
    load_tokenizer,
)
from flashdraft.data.template import ChatTemplate  # noqa: E402
from flashdraft.errors import UserError  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("datasets", nargs="+", help="the --continue-from datasets")
    ap.add_argument("--input", action="append", required=True)
    ap.add_argument("--skip", type=int, default=0)
    ap.add_argument("--max-turns", type=int, default=None)
    ap.add_argument("--target", default="default", help="whose tokenizer renders the chat template")
    a = ap.parse_args(argv)
    try:
        manifest = json.loads((Path(a.datasets[0]) / "manifest.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        sys.exit(f"error: {a.datasets[0]}: not a dataset ({e})")
    recorded = manifest["template"]
    template = ChatTemplate(load_tokenizer(a.target), enable_thinking=recorded.get("enable_thinking"),
                            stop_ids=recorded["stop_ids"])  # fmt: skip
    cfg = RegenConfig(inputs=a.input, out="/dev/null", target=manifest.get("target", a.target), skip=a.skip,
                      max_turns=a.max_turns, continue_from=a.datasets,
                      eval_fraction=manifest["split"]["eval_fraction"])  # fmt: skip
    try:
        convs, _, _ = collect_conversations(cfg)
        kept, histories, drops = continue_conversations(convs, cfg, template)
    except UserError as e:
        sys.exit(f"error: {e}")
    left = sum(len(c.user_turns) - len(histories[c.id]) for c in kept)
    print(f"{len(convs):,} conversations read; {len(kept):,} continued, {left:,} user turns to answer; "
          f"skipped {dict(drops)}")  # fmt: skip


if __name__ == "__main__":
    main()
