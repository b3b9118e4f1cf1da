"""The frozen reference file's parser: greedy lines only, one error naming the file and line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashdraft.eval.frozen import FROZEN_FORMAT, read_frozen_records

LINE = {
    "format": FROZEN_FORMAT, "id": "p0", "prompt_ids": [3, 4], "tokens": [5, 2], "stop_reason": "stop",
    "template": "token ids", "source": "local", "target": "t", "target_fingerprint": "f", "dtype": "float32",
    "max_new_tokens": 8, "temperature": 0.0, "stop_token_ids": [2],
}  # fmt: skip


def test_a_sampled_line_is_refused(tmp_path: Path) -> None:
    """A frozen file holds the target's greedy choice at every position: a T>0 line is an error, not a
    reference the eval or the trainer's validation would replay unchecked."""
    p = tmp_path / "set.jsonl"
    p.write_text(json.dumps(LINE) + "\n" + json.dumps({**LINE, "id": "p1", "temperature": 0.7}) + "\n")
    with pytest.raises(ValueError, match=r"set.jsonl:2: not a frozen reference line \(temperature 0.7"):
        read_frozen_records(p)
    head, records = read_frozen_records(p, limit=1)
    assert head["target_fingerprint"] == "f" and [r["id"] for r in records] == ["p0"]
