"""Each source format, and each kind of bad input: skipped with file and line, counted, or the run stops."""

from __future__ import annotations

import gzip
import json
import logging

import pytest

from flashdraft.data.sources import (
    CODEIO_TEMPLATE,
    HUMANEVAL_TEMPLATE,
    BadInputError,
    SourceStats,
    describe_sources,
    load_conversations,
    load_prompts,
)


def test_registry_lists_sources():
    assert {"sharegpt", "messages", "prompts", "humaneval", "codeio"} <= set(describe_sources())


def test_packaged_sharegpt_and_humaneval():
    stats = SourceStats()
    convs = load_conversations("sharegpt", limit=50, stats=stats)
    assert len(convs) == 50 and all(c.user_turns for c in convs)
    assert convs[0].id == "QWJhYvA_0" and convs[0].turns[0].role == "user" and convs[0].group == "QWJhYvA"
    he = load_prompts("humaneval")
    assert len(he) == 164 and he[0].id == "HumanEval/0"
    text = he[0].user_turns[0]
    assert text.startswith(
        "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
    )
    assert text.endswith("\n```") and "def has_close_elements" in text
    assert HUMANEVAL_TEMPLATE.format(prompt="X") == text.split("```python\n")[0] + "```python\nX\n```"


def test_codeio_tasks_from_both_of_reasoning_gyms_files(tmp_path):
    """codeio.jsonl.gz is JSONL, codeio-hq.jsonl.gz one JSON array: both read; a task's id is a hash of its text,
    so the same task in both files is the same prompt; a record without the two fields is skipped, named."""
    task = {"task_description": "Given a list of integers, what is the sum of its squares? ",
            "input_output_spec": "Input:\n  `xs` (list of int)\nOutput:\n  `return` (int)", "code_sample": "x"}  # fmt: skip
    with gzip.open(tmp_path / "codeio.jsonl.gz", "wt") as f:
        f.write(json.dumps(task) + "\n" + json.dumps({"task_description": "no spec"}) + "\n")
    with gzip.open(tmp_path / "codeio-hq.jsonl.gz", "wt") as f:
        f.write(json.dumps([{**task, "prompt": "<TASK>", "output": "7 6"}]))
    stats = SourceStats(max_bad_fraction=1.0)  # one bad of two: skip it, do not stop
    lines = load_conversations(f"codeio:{tmp_path / 'codeio.jsonl.gz'}", stats=stats)
    array = load_conversations(f"codeio:{tmp_path / 'codeio-hq.jsonl.gz'}")
    assert len(lines) == 1 and len(array) == 1 and lines[0].id == array[0].id
    assert lines[0].id.startswith("codeio-") and lines[0].source == "codeio"
    assert lines[0].user_turns == [CODEIO_TEMPLATE.format(task=task["task_description"].strip(),
                                                          spec=task["input_output_spec"])]  # fmt: skip
    assert lines[0].user_turns[0].startswith("Write a Python function that solves this task.\n\nGiven a list")
    assert len(stats.bad) == 1 and stats.bad[0].line == 2 and "input_output_spec" in stats.bad[0].reason


def test_sharegpt_user_file_json_and_jsonl(tmp_path):
    rows = [
        {
            "id": "a",
            "conversations": [
                {"from": "system", "value": "Be nice."},
                {"from": "human", "value": "hi"},
                {"from": "gpt", "value": "hello"},
                {"from": "human", "value": "bye"},
            ],
        },
        {
            "id": "b",
            "conversations": [{"from": "gpt", "value": "(continued)"}, {"from": "human", "value": "go on"}],
        },
    ]
    (tmp_path / "x.json").write_text(json.dumps(rows, indent=2))
    (tmp_path / "x.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    for spec in (str(tmp_path / "x.json"), f"sharegpt:{tmp_path / 'x.jsonl'}", str(tmp_path / "x.jsonl")):
        a, b = load_conversations(spec)
        assert (
            a.system == "Be nice."
            and a.user_turns == ["hi", "bye"]
            and [t.role for t in a.turns][2] == "assistant"
        )
        assert b.id == "b" and [t.role for t in b.turns] == ["user"]  # a leading assistant turn is dropped


def test_messages_and_prompts(tmp_path):
    msgs = [
        {
            "id": "m1",
            "messages": [
                {"role": "system", "content": "S"},
                {"role": "user", "content": "Q1"},
                {"role": "assistant", "content": "A1"},
                {"role": "user", "content": "Q2"},
            ],
        },
        {"messages": [{"role": "user", "content": "only"}]},
    ]
    (tmp_path / "m.jsonl").write_text("\n".join(json.dumps(m) for m in msgs) + "\n\n")
    a, b = load_conversations(str(tmp_path / "m.jsonl"))
    assert a.id == "m1" and a.system == "S" and a.user_turns == ["Q1", "Q2"]
    assert b.id == "m.jsonl:2" and b.user_turns == ["only"]
    (tmp_path / "p.txt").write_text("first question\n\nsecond question\n")
    assert [c.user_turns for c in load_conversations(str(tmp_path / "p.txt"))] == [
        ["first question"],
        ["second question"],
    ]
    (tmp_path / "p.jsonl").write_text('{"prompt": "x1"}\n{"text": "x2", "id": "k"}\n')
    got = load_conversations(f"prompts:{tmp_path / 'p.jsonl'}")
    assert [c.user_turns[0] for c in got] == ["x1", "x2"] and got[1].id == "k"
    with pytest.raises(FileNotFoundError, match="neither a registered source"):
        load_conversations(str(tmp_path / "missing.jsonl"))


def test_prompts_of_one_group_share_their_split_key(tmp_path):
    from flashdraft.data.regenerate import RegenConfig, collect_conversations

    rows = [{"id": "a1", "prompt": "Add 1 and 2.", "group": "sum"}, {"id": "a2", "prompt": "Add 3 and 4.", "group": "sum"},
            {"id": "b1", "prompt": "Sort 3, 1, 2."}, {"prompt": "x", "group": 7}]  # fmt: skip
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    stats = SourceStats(max_bad_fraction=0.5)
    got = load_conversations(f"prompts:{path}", stats=stats)
    assert [(c.id, c.group) for c in got] == [("a1", "sum"), ("a2", "sum"), ("b1", None)]
    assert stats.bad[0].line == 4 and "'group' must be a non-empty string" in stats.bad[0].reason
    convs, _, _ = collect_conversations(RegenConfig(inputs=[f"prompts:{path}"], out="y", max_bad_fraction=0.5))
    # what the samples' train/eval split hashes: a group's prompts go to one split together
    assert [c.group or c.id for c in convs] == ["prompts/sum", "prompts/sum", "prompts/b1"]


BAD_LINES = [
    ('{"messages": [{"role": "user", "content": "ok"}]', "malformed JSON"),
    ('{"messages": [{"content": "no role"}]}', "has no 'role'"),
    ('{"messages": [{"role": "wizard", "content": "x"}]}', "unknown role 'wizard'"),
    (
        '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "  "}]}',
        "(assistant) is empty",
    ),
    ('{"messages": [{"role": "user", "content": "q"}], "score": 3}', "unknown field(s) ['score']"),
    ('{"messages": [{"role": "assistant", "content": "a"}]}', "no user turn"),
    ("[1, 2]", "expected a JSON object"),
]


@pytest.mark.parametrize("line,reason", BAD_LINES)
def test_bad_jsonl_record_is_skipped_with_file_and_line(tmp_path, caplog, line, reason):
    good = json.dumps({"messages": [{"role": "user", "content": "fine"}]})
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join([good, good, line, good]) + "\n")
    stats = SourceStats(max_bad_fraction=0.5)
    convs = load_conversations(f"messages:{path}", stats=stats)
    assert len(convs) == 3 and len(stats.bad) == 1
    assert stats.bad[0].line == 3 and reason in stats.bad[0].reason
    assert f"{path}:3: " in stats.summary() and reason in stats.summary()
    # without a caller's stats to report them, one warning line says it
    with caplog.at_level(logging.WARNING, logger="flashdraft.data"):
        load_conversations(f"messages:{path}", max_bad_fraction=0.5)
    assert caplog.text.count("\n") == 1
    assert f"skipped 1 bad input record(s) of 4 (first: {path}:3: " in caplog.text


def test_many_bad_records_make_one_line(tmp_path, caplog):
    """Thirty bad records: one warning line with the count and the first, not thirty lines; the list on request."""
    good = json.dumps({"messages": [{"role": "user", "content": "fine"}]})
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join([good] * 300 + ["not json"] * 30) + "\n")
    with caplog.at_level(logging.WARNING, logger="flashdraft.data"):
        assert len(load_conversations(f"messages:{path}")) == 300
    assert caplog.text.count("\n") == 1 and "skipped 30 bad input record(s) of 330" in caplog.text
    stats = SourceStats()
    load_conversations(f"messages:{path}", stats=stats)
    stats.write_bad(tmp_path / "bad.txt")
    lines = (tmp_path / "bad.txt").read_text().splitlines()
    assert len(lines) == 30 and lines[0].startswith(f"{path}:301: malformed JSON")


def test_non_utf8_bytes(tmp_path):
    good = json.dumps({"messages": [{"role": "user", "content": "fine"}]}).encode()
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\n".join([good, b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', good]))
    stats = SourceStats(max_bad_fraction=0.5)
    assert len(load_conversations(f"messages:{path}", stats=stats)) == 2
    assert stats.bad[0].line == 2 and "not valid UTF-8" in stats.bad[0].reason
    # inside a JSON array (ShareGPT layout): only the record holding the bytes is lost, its line is named
    rec = lambda v: b'{"id": "%s", "conversations": [{"from": "human", "value": "%s"}]}' % (v, v)  # noqa: E731
    arr = tmp_path / "a.json"
    arr.write_bytes(b"[\n" + b",\n".join([rec(b"x1"), rec(b"bad\xff"), rec(b"x3")]) + b"\n]")
    stats = SourceStats(max_bad_fraction=0.5)
    assert [c.id for c in load_conversations(str(arr), stats=stats)] == ["x1", "x3"]
    assert stats.bad[0].line == 3 and "UTF-8" in stats.bad[0].reason


def test_truncated_json_array(tmp_path):
    arr = tmp_path / "t.json"
    full = json.dumps(
        [{"id": str(i), "conversations": [{"from": "human", "value": f"q{i}"}]} for i in range(5)], indent=1
    )
    arr.write_text(full[: len(full) - 30])
    stats = SourceStats(max_bad_fraction=0.5)
    convs = load_conversations(str(arr), stats=stats)
    assert [c.id for c in convs] == ["0", "1", "2", "3"] and len(stats.bad) == 1
    assert "malformed JSON" in stats.bad[0].reason and stats.bad[0].line > 1


def test_too_many_bad_records_stop_the_run(tmp_path):
    good = json.dumps({"messages": [{"role": "user", "content": "fine"}]})
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join([good, "not json", "{}", good, "nope"]))
    with pytest.raises(BadInputError, match=r"3 of 5 records are bad .*max_bad_fraction") as e:
        load_conversations(f"messages:{path}", max_bad_fraction=0.2)
    assert f"{path}:2:" in str(e.value) and "\n" not in str(e.value)
    # a large file stops as soon as the fraction is exceeded, without reading to the end
    big = tmp_path / "big.jsonl"
    big.write_text("\n".join(["junk"] * 200 + [good] * 10_000))
    with pytest.raises(BadInputError):
        load_conversations(f"messages:{big}")


def test_gzip_jsonl(tmp_path):
    p = tmp_path / "he.jsonl.gz"
    with gzip.open(p, "wt") as f:
        f.write(json.dumps({"task_id": "T/0", "prompt": "def f():\n"}) + "\n")
    (c,) = load_conversations(f"humaneval:{p}")
    assert c.id == "T/0" and c.user_turns[0] == HUMANEVAL_TEMPLATE.format(prompt="def f():\n")


def test_sharegpt_turns_asks_each_later_turn_alone_and_splits_it_with_its_chat(tmp_path):
    from flashdraft.data.regenerate import RegenConfig, collect_conversations

    rows = [
        {"id": "a", "conversations": [{"from": "system", "value": "Be nice."}, {"from": "human", "value": "hi"},
                                      {"from": "gpt", "value": "hello"}, {"from": "human", "value": "bye"},
                                      {"from": "gpt", "value": "ciao"}, {"from": "human", "value": "again"}]},
        {"id": "b_1", "conversations": [{"from": "human", "value": "one"}, {"from": "gpt", "value": "x"},
                                        {"from": "human", "value": "bye"}]},
        {"id": "c", "conversations": [{"from": "human", "value": "only"}]},
    ]  # fmt: skip
    (tmp_path / "x.json").write_text(json.dumps(rows))
    turns = load_conversations(f"sharegpt-turns:{tmp_path / 'x.json'}")
    assert [(c.id, c.user_turns, c.group) for c in turns] == [
        ("a#u2", ["bye"], "a"), ("a#u3", ["again"], "a"), ("b_1#u2", ["bye"], "b"),
    ]  # fmt: skip
    assert all(len(c.turns) == 1 for c in turns)  # no system prompt, no history

    def split_keys(spec: str) -> list[str]:  # what the regenerated samples' train/eval split hashes
        convs, drops, _ = collect_conversations(RegenConfig(inputs=[spec], out="y"))
        return [c.group or c.id for c in convs], drops

    chats, _ = split_keys(f"sharegpt:{tmp_path / 'x.json'}")
    alone, drops = split_keys(f"sharegpt-turns:{tmp_path / 'x.json'}")
    assert chats == ["sharegpt/a", "sharegpt/b", "sharegpt/c"]
    assert (
        alone == ["sharegpt/a", "sharegpt/a"] and drops["duplicate_prompt"] == 1
    )  # "bye" asked twice: one kept
