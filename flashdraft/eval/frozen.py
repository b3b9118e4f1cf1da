"""The frozen reference file: one JSON line per greedy reference, with the target and settings that made it.

    head, records = read_frozen_records("benchmarks/yardstick/humaneval-164.jsonl")

Written by `flashdraft.eval.references.write_frozen` (benchmarks/yardstick/make_references.py, and the
trainer's RUN/val_references.jsonl); read here as plain records so that the references (eval/references.py:
`flashdraft eval --references`, the trainer's eval.references) and the prompt sets (eval/prompts.py: a frozen
file is also a prompt set) use one parser without importing each other.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FROZEN_FORMAT = "flashdraft-frozen-references/1"
_HEAD_KEYS = ("target", "target_fingerprint", "dtype", "max_new_tokens", "stop_token_ids")


def is_frozen_file(path: str | Path) -> bool:
    path = Path(path)
    if not path.is_file():
        return False
    with path.open(errors="replace") as f:
        return FROZEN_FORMAT in f.readline()


def read_frozen_records(
    path: str | Path, limit: int | None = None
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(head, records): what every line shares (target, fingerprint, dtype, max_new_tokens, stop ids) and
    the first `limit` references as {id, prompt_ids, tokens, template, stop_reason}. A bad line is one
    error naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no frozen reference file (benchmarks/yardstick/make_references.py writes one)"
        )
    records: list[dict[str, Any]] = []
    head: dict[str, Any] | None = None
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            if rec.get("format") != FROZEN_FORMAT:
                raise ValueError(f"format {rec.get('format')!r}, expected {FROZEN_FORMAT!r}")
            if float(rec.get("temperature", 0.0)) != 0:
                raise ValueError(f"temperature {rec['temperature']}: frozen references are greedy (T=0)")
            meta = {k: rec[k] for k in _HEAD_KEYS}
            record = {
                "id": str(rec["id"]),
                "prompt_ids": [int(i) for i in rec["prompt_ids"]],
                "tokens": [int(i) for i in rec["tokens"]],
                "template": str(rec.get("template", "token ids")),
                "stop_reason": str(rec["stop_reason"]),
            }
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}:{n}: not a frozen reference line ({e})") from None
        if head is None:
            head = meta
        elif meta != head:
            raise ValueError(
                f"{path}:{n}: target or settings differ from line 1: one file, one target and setting"
            )
        records.append(record)
        if limit is not None and len(records) >= limit:
            break
    if head is None:
        raise ValueError(f"{path}: empty frozen reference file")
    return head, records
