"""Eval prompt sets, registered by name, turned into the exact token ids the target sees.

    prompts = load_eval_prompts("humaneval", target, limit=20)     # published DFlash wording, chat template
    prompts = load_eval_prompts("sharegpt-heldout", target)        # ShareGPT conversations in the held-out split
    prompts = load_eval_prompts("data/sharegpt-smollm2", target)   # a regenerated dataset's eval split (exact ids)
    prompts = load_eval_prompts("my_prompts.jsonl", target)        # any file flashdraft.data.sources reads
    prompts = load_eval_prompts("benchmarks/yardstick/humaneval-164.jsonl", target)  # a frozen reference file's prompts

Each `EvalPrompt` carries its token ids and a `template` string saying how they were made, so
a report can state the prompt formatting next to every number (docs/method.md §11.4: compare with
published figures only under the same wording and max_new_tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashdraft.eval.frozen import is_frozen_file, read_frozen_records

HELDOUT_FRACTION = 0.02  # must match the data pipeline's default eval_fraction (flashdraft.data)


@dataclass
class EvalPrompt:
    id: str
    input_ids: list[int]  # the prompt exactly as the target sees it (chat template applied)
    template: str  # how input_ids were made, e.g. "chat-template(humaneval wording)" or "token ids"
    messages: list[dict[str, str]] = field(default_factory=list)  # the chat turns, when known


_SETS: dict[str, Callable[[Any, int | None], list[EvalPrompt]]] = {}


def register_prompt_set(name: str) -> Callable:
    """Decorator: `@register_prompt_set("humaneval")` makes `--dataset humaneval` work."""

    def deco(fn: Callable[[Any, int | None], list[EvalPrompt]]) -> Callable:
        _SETS[name] = fn
        return fn

    return deco


def prompt_set_names() -> list[str]:
    return sorted(_SETS)


def chat_ids(target: Any, messages: list[dict[str, str]]) -> list[int]:
    """Apply the target's chat template (generation prompt added); refuse a target without a tokenizer."""
    tok = getattr(target, "tokenizer", None)
    if tok is None:
        raise ValueError(
            f"target {getattr(target, 'name', '?')} has no tokenizer, so chat prompts cannot be encoded: "
            "pass prompts as token ids (a regenerated dataset folder) or load a target with a tokenizer"
        )
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    ids = out["input_ids"]
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return [int(i) for i in ids]


def _from_conversations(
    target: Any, spec: str, limit: int | None, label: str, keep: Callable[[Any], bool]
) -> list[EvalPrompt]:
    from flashdraft.data.sources import iter_conversations

    out: list[EvalPrompt] = []
    for conv in iter_conversations(spec):
        if not keep(conv):
            continue
        # the first user turn (with any system turn before it): a single-turn prompt, as published
        messages: list[dict[str, str]] = []
        for t in conv.turns:
            if t.role == "assistant":
                break
            messages.append({"role": t.role, "content": t.content})
        if not any(m["role"] == "user" for m in messages):
            continue
        out.append(EvalPrompt(conv.id, chat_ids(target, messages), f"chat-template({label})", messages))
        if limit is not None and len(out) >= limit:
            break
    return out


@register_prompt_set("humaneval")
def humaneval(target: Any, limit: int | None) -> list[EvalPrompt]:
    # flashdraft.data.sources applies the DFlash paper wording ("Write a solution to the following
    # problem and make sure that it passes the tests:" + the problem in a python code fence)
    return _from_conversations(target, "humaneval", limit, "humaneval: DFlash paper wording", lambda c: True)


@register_prompt_set("sharegpt-heldout")
def sharegpt_heldout(target: Any, limit: int | None) -> list[EvalPrompt]:
    from flashdraft.data.dataset import split_of

    return _from_conversations(
        target, "sharegpt", limit, f"sharegpt held-out split ({HELDOUT_FRACTION:g})",
        # the data pipeline's split key: the chat a ShareGPT part was cut from ("X" for "X_0"), else the id
        lambda c: split_of(getattr(c, "group", None) or c.id, HELDOUT_FRACTION) == "eval",
    )  # fmt: skip


def _from_dataset_dir(path: Path, limit: int | None) -> list[EvalPrompt]:
    """The eval split of a regenerated dataset: the prompt is every token before the first loss token."""
    from flashdraft.data.dataset import open_dataset

    ds = open_dataset(path, split="eval")
    out: list[EvalPrompt] = []
    for s in ds:
        first = int(s.loss_mask.argmax()) if s.loss_mask.any() else len(s.input_ids)
        if first == 0:
            continue
        msgs = s.meta.get("prompt_messages") or s.meta.get("messages") or []
        out.append(
            EvalPrompt(s.id, [int(i) for i in s.input_ids[:first]], f"token ids ({path} eval split)", msgs)
        )
        if limit is not None and len(out) >= limit:
            break
    return out


def _from_ids_jsonl(path: Path, limit: int | None) -> list[EvalPrompt]:
    """JSONL of {"id"?, "input_ids": [...]}: prompts already tokenized (chat template included)."""
    import json

    out: list[EvalPrompt] = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            ids = [int(i) for i in rec["input_ids"]]
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f'{path}:{n}: expected {{"input_ids": [ints]}} ({e})') from None
        out.append(EvalPrompt(str(rec.get("id", f"{path.stem}-{n}")), ids, f"token ids ({path.name})"))
        if limit is not None and len(out) >= limit:
            break
    return out


def _first_line(path: Path) -> str:
    if path.suffix != ".jsonl" or not path.is_file():
        return ""
    with open(path) as f:
        return f.readline()


def _is_ids_jsonl(path: Path) -> bool:
    return '"input_ids"' in _first_line(path)


def load_eval_prompts(spec: str, target: Any, limit: int | None = None) -> list[EvalPrompt]:
    """A registered set name, a regenerated dataset folder, an input_ids JSONL, or a file
    `flashdraft.data.sources` reads (text prompts, chat template applied)."""
    if spec in _SETS:
        prompts = _SETS[spec](target, limit)
    elif Path(spec).is_dir() and (Path(spec) / "manifest.json").is_file():
        prompts = _from_dataset_dir(Path(spec), limit)
    elif _is_ids_jsonl(Path(spec)):
        prompts = _from_ids_jsonl(Path(spec), limit)
    elif is_frozen_file(spec):  # the prompts a frozen yardstick was made from
        _, records = read_frozen_records(spec, limit)
        prompts = [EvalPrompt(r["id"], r["prompt_ids"], r["template"]) for r in records]
    else:
        if not Path(spec.split(":", 1)[-1]).exists():
            raise FileNotFoundError(
                f"--dataset {spec!r}: not a registered set ({', '.join(prompt_set_names())}), "
                "a dataset folder, or an existing file"
            )
        prompts = _from_conversations(target, spec, limit, f"file {spec}", lambda c: True)
    if not prompts:
        raise ValueError(f"--dataset {spec!r} gave no prompts")
    return prompts
