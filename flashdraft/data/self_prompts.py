"""Prompts the target writes itself, for regeneration when the prompt sets run out.

    prompts, stats = self_prompts(template, generator, n=20_000, seed=7)     # [{"id", "prompt"}], SelfPromptStats
    write_prompts(Path("self.jsonl.gz"), prompts)   # flashdraft.data.sources: a `prompts:` source file

An instruction-tuned model given its chat template up to where a user's message begins (the system turn the
template adds, then the user header) writes a user's message: the method of Magpie (Xu et al., 2024, "Magpie:
Alignment Data Synthesis from Scratch by Prompting Aligned LLMs with Nothing"). Sampled at T = 1 these are as
varied as the model's idea of its users, without any prompt set. An `opening` starts every message of a share of
the rows ("Write a Python function that" steers toward code); the model writes the rest.

Kept: messages that end their turn (the template's stop token) within `max_new_tokens`, of at least `min_words`
words, with no template marker in them (a special token of the tokenizer), each once (case and spacing ignored).
The answers come later, from `flashdraft data regenerate --input prompts:FILE`, which also drops any prompt sharing
a 13-gram with the eval sets. Every prompt comes from the target and a seed: none is derived from a document.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from flashdraft.data.template import ChatTemplate, TemplateError

_SENTINEL = "FLASHDRAFTUSERMESSAGE"


@dataclass
class SelfPromptStats:
    asked: int = 0  # messages generated
    kept: int = 0
    tokens: int = 0  # generated tokens, stop tokens included
    seconds: float = 0.0
    dropped: Counter[str] = field(default_factory=Counter)

    def line(self) -> str:
        rate = self.tokens / self.seconds if self.seconds > 0 else 0.0
        return (
            f"{self.kept:,} prompts kept of {self.asked:,} written ({self.tokens:,} tokens in {self.seconds:.1f} s, "
            f"{rate:,.0f} tok/s); dropped {dict(self.dropped)}"
        )


def user_prefix(template: ChatTemplate) -> str:
    """The rendered text before a first user message's content: the template's own system turn (if it adds one
    unasked), then the user header."""
    text = template.render_text([{"role": "user", "content": _SENTINEL}], add_generation_prompt=False)
    if text.count(_SENTINEL) != 1:
        raise TemplateError("the chat template does not render a user message's content verbatim")
    return text.split(_SENTINEL)[0]


def _markers(tokenizer: Any) -> set[str]:
    """The tokenizer's special tokens' texts (the template's markers among them)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    found = {str(t) for t in getattr(tokenizer, "all_special_tokens", [])}
    return {t for t in found | {str(a.content) for a in added.values() if getattr(a, "special", False)} if t}


def self_prompts(
    template: ChatTemplate,
    generator: Any,  # flashdraft.data.generate.Generator: its params' stop ids are the template's
    n: int,
    *,
    seed: int,
    openings: list[str] | None = None,
    min_words: int = 4,
    max_rounds: int = 4,
    on_round: Any = None,
) -> tuple[list[dict[str, str]], SelfPromptStats]:
    """Up to `n` distinct user messages the target writes, in the order written; round r asks 1.25× the messages
    still missing with seed `seed · 1000 + r`, until `n` are kept or `max_rounds` ran. `openings`: each message of
    row i starts with openings[i % len(openings)] ("" for none)."""
    if n < 1:
        raise ValueError(f"n {n}: ask for at least one prompt")
    openings = openings or [""]
    prefix = user_prefix(template)
    rows = [template.encode(prefix + o) for o in openings]
    tok, markers = template.tokenizer, _markers(template.tokenizer)
    stats, kept, seen = SelfPromptStats(), [], set()
    t0 = time.perf_counter()
    for r in range(max_rounds):
        missing = n - len(kept)
        if missing <= 0:
            break
        ask = max(1, math.ceil(missing * 1.25))
        outs = generator.generate([rows[i % len(rows)] for i in range(ask)], seed=seed * 1000 + r)
        stats.asked += ask
        for i, g in enumerate(outs):
            stats.tokens += len(g.ids)
            if g.finish != "stop":
                stats.dropped["unfinished"] += 1
                continue
            text = (openings[i % len(openings)] + tok.decode(g.ids[:-1], skip_special_tokens=False)).strip()
            key = " ".join(text.lower().split())
            if len(key.split()) < min_words:
                stats.dropped["too_few_words"] += 1
            elif any(m in text for m in markers):
                stats.dropped["template_marker"] += 1
            elif key in seen:
                stats.dropped["duplicate"] += 1
            elif len(kept) >= n:
                stats.dropped["beyond_n"] += 1
            else:
                seen.add(key)
                kept.append({"id": f"self-{hashlib.sha256(text.encode()).hexdigest()[:16]}", "prompt": text})
        if on_round is not None:
            on_round(r, len(kept))
    stats.kept, stats.seconds = len(kept), time.perf_counter() - t0
    return kept, stats
