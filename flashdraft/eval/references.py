"""Target reference continuations for an eval set, computed once and cached on disk.

    refs = compute_references(target, prompts, ReferenceSettings(max_new_tokens=256))
    refs = compute_references(target, prompts, settings, server=ServerConfig("http://localhost:30000/v1"))

A reference is what the target itself answers (greedy at T=0, or a seeded sample at T>0): the
offline replay (offline.py) treats it as the target's choice at every position. Local
references come from `flashdraft.decode.generate(method="ar")` (the fast engine on CUDA), so they
are token-identical to plain autoregressive decoding. Batched local references (`batch_size > 1`,
greedy only; the default, see `default_ref_batch`) come from flashdraft's batched greedy loop on a CPU
and from the batched native engine (`flashdraft.data.generate.native_generate`, static cache, CUDA
graphs) on CUDA; server references from an OpenAI-compatible SGLang/vLLM endpoint; frozen references
from a frozen JSONL file (`write_frozen` / `read_frozen`: benchmarks/yardstick/, the trainer's
RUN/val_references.jsonl). None of these is exact AR of the local target, so evaluate() checks them
against the local target's teacher-forced argmax, cuts them at the first disagreement and reports the
agreement rate (`cut_at_disagreement`).

Cache: one JSON file per reference under `cache_dir` (default ~/.cache/flashdraft/references or
$FLASHDRAFT_CACHE/references), named by a hash of the target's identity (geometry, dtype and a
fingerprint of its weights), the prompt template, the prompt token ids and the settings.
Written atomically (temp + rename), so a killed run leaves no half-written entry.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from flashdraft.eval.frozen import FROZEN_FORMAT, read_frozen_records
from flashdraft.eval.prompts import EvalPrompt
from flashdraft.files import atomic_write_text
from flashdraft.target import target_fingerprint

FORMAT = "flashdraft-reference/1"


@dataclass
class ReferenceSettings:
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy; > 0 = a seeded sample per prompt (or per batched prompt set)
    seed: int = 0  # base seed; a single-prompt sample's seed is derived from it and the prompt id
    stop_token_ids: list[int] | None = None  # None = the target's own stop tokens

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens {self.max_new_tokens} must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature {self.temperature} must be >= 0 (0 = greedy)")


@dataclass
class ServerConfig:
    """An OpenAI-compatible completions endpoint (SGLang, vLLM) serving the same target."""

    url: str  # base URL including /v1, e.g. http://localhost:30000/v1
    model: str | None = None  # the served model name (None: the server's first model)
    concurrency: int = 8  # requests in flight at once
    retries: int = 3  # extra attempts per request, exponential back-off
    timeout_s: float = 600.0
    api_key: str | None = None


@dataclass
class Reference:
    id: str
    prompt_ids: list[int]
    tokens: list[int]  # the continuation: new tokens only, the stop token included if hit
    template: str
    source: str  # "local" | "local-batched" | "server:<url>"
    temperature: float
    seed: int | None  # the per-prompt sampling seed (None when greedy)
    stop_reason: str  # "stop" | "length" | server finish_reason
    key: str


@dataclass
class ReferenceSet:
    references: list[Reference]
    computed: int  # references produced by this call (target or server runs)
    cached: int  # references read from the cache
    seconds: float


# Rows per batched greedy reference generation on a CPU, where a single-token forward of a small target
# is overhead-bound: 12 HumanEval prompts x 96 tokens of the 135M default, float32, 2-core CPU, took 97.8 s
# one prompt at a time and 23.4 s in one batch, same tokens (benchmarks/RESULTS.md).
CPU_REF_BATCH = 16
# Rows of the batched native engine on CUDA (continuous batching): one prompt at a time the fast engine
# made ~110 tok/s of references on an H100, the batched native engine regenerates ~28K tok/s; 256 rows
# hold all 164 HumanEval problems at once.
CUDA_REF_BATCH = 256
BATCH_ENGINES = ("loop", "native")


def default_ref_batch(device: str | torch.device) -> int:
    """Rows per batched greedy reference generation when none is given: 16 on CPU, 256 on CUDA."""
    return CUDA_REF_BATCH if torch.device(device).type == "cuda" else CPU_REF_BATCH


def default_batch_engine(target: Any) -> str:
    """ "native" (the batched static-cache engine) where the target is on CUDA and has a native forward,
    else "loop" (flashdraft's padded loop over transformers)."""
    from flashdraft.decode.native import native_support_error

    on_cuda = torch.device(target.device).type == "cuda"
    return "native" if on_cuda and native_support_error(target) is None else "loop"


def cut_at_disagreement(source: str) -> bool:
    """True for references that are not exact AR of the local target (a server's, a batch's, a frozen
    file's): evaluate() cuts them at the first token that differs from the teacher-forced argmax."""
    return source.startswith(("server", "frozen")) or source in ("local-batched", "local-native")


def default_cache_dir() -> Path:
    root = os.environ.get("FLASHDRAFT_CACHE")
    return Path(root) / "references" if root else Path.home() / ".cache" / "flashdraft" / "references"


def target_stop_ids(target: Any) -> list[int]:
    """The target's stop tokens: generation_config.eos_token_id plus the tokenizer's eos."""
    ids: set[int] = set()
    gen = getattr(getattr(target, "model", None), "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    if eos is not None:
        ids.update([eos] if isinstance(eos, int) else list(eos))
    tok = getattr(target, "tokenizer", None)
    if tok is not None and tok.eos_token_id is not None:
        ids.add(int(tok.eos_token_id))
    return sorted(int(i) for i in ids)


def prompt_seed(base: int, prompt_id: str) -> int:
    """A per-prompt seed that does not depend on the order or number of prompts."""
    return int.from_bytes(hashlib.blake2b(f"{base}:{prompt_id}".encode(), digest_size=6).digest(), "big")


def reference_key(
    fingerprint: str, prompt: EvalPrompt, settings: ReferenceSettings, stop: list[int], source: str
) -> str:
    payload = {
        "format": FORMAT, "target": fingerprint, "template": prompt.template, "prompt_ids": prompt.input_ids,
        "max_new_tokens": settings.max_new_tokens, "temperature": settings.temperature,
        "seed": prompt_seed(settings.seed, prompt.id) if settings.temperature > 0 else None,
        "stop": stop, "source": source,
    }  # fmt: skip
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]


def _path(cache_dir: Path, key: str) -> Path:
    return cache_dir / key[:2] / f"{key}.json"


def _read(path: Path) -> Reference | None:
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None  # a missing or unreadable entry is recomputed
    if raw.pop("format", None) != FORMAT:
        return None
    return Reference(**raw)


def _write(path: Path, ref: Reference) -> None:
    atomic_write_text(path, json.dumps({"format": FORMAT, **asdict(ref)}))


# ----------------------------------------------------------------------------- producers


def _local(
    target: Any, prompt: EvalPrompt, settings: ReferenceSettings, stop: list[int], fast: bool
) -> tuple[list[int], str]:
    """One prompt's continuation by AR decoding: the fast engine (static cache, CUDA graphs) where
    `fast`, else the reference decoder — token-identical in exact arithmetic (tests/decode), while
    on a GPU the reference decoder's eager steps cost ~25 ms each (benchmarks/RESULTS.md "Decode speed"); on a CPU the engine
    is the slower one (benchmarks/reference_speed.py)."""
    if fast:
        from flashdraft.decode.engine import generate
    else:
        from flashdraft.decode.generate import generate

    seed = prompt_seed(settings.seed, prompt.id) if settings.temperature > 0 else None
    res = generate(
        target, None, prompt.input_ids, max_new_tokens=settings.max_new_tokens, method="ar",
        temperature=settings.temperature, stop_token_ids=stop, seed=seed,
    )  # fmt: skip
    return res.tokens, res.stop_reason


def _local_batch(
    target: Any, prompts: list[EvalPrompt], settings: ReferenceSettings, stop: list[int], engine: str = "loop"
) -> list[tuple[list[int], str]]:
    """Continuations of several prompts in one batch of flashdraft's own loop (`loop_generate`: a
    left-padded prefill, then one token per step for every row; the loop that regenerates training data),
    or, with engine "native", of the batched native engine (`native_generate`: continuous batching over
    a static cache, one CUDA graph per step on a GPU; `len(prompts)` rows). Greedy, or at T > 0 sampled
    with one generator seeded by `settings.seed` for the whole batch: a row's sample depends on the batch.

    Like `_local`, each row keeps its stop token when hit ("stop"), else runs to max_new_tokens ("length").
    Faster on CPU than one decode per prompt, but a padded batch sums in another order than a
    single-sequence decode: in float32 a near-tie may flip. evaluate() therefore checks every token
    against the teacher-forced argmax and cuts the reference at the first disagreement
    (`cut_at_disagreement`); use batch_size=1 for exact AR.
    """
    from flashdraft.data.generate import GenerationParams, loop_generate, native_generate

    params = GenerationParams(
        max_new_tokens=settings.max_new_tokens, temperature=settings.temperature, stop_ids=list(stop)
    )
    ids = [list(p.input_ids) for p in prompts]
    if engine == "native":
        gens = native_generate(target, ids, params, seed=settings.seed, rows=len(prompts))
    else:
        gens = loop_generate(target, ids, params, seed=settings.seed)
    return [(g.ids, g.finish) for g in gens]


def _server_request(
    client: Any, server: ServerConfig, prompt: EvalPrompt, settings: ReferenceSettings, stop: list[int],
    tokenizer: Any,
) -> tuple[list[int], str]:  # fmt: skip
    body: dict[str, Any] = {
        "prompt": prompt.input_ids,  # token ids: no second tokenization of the prompt on the server
        "max_tokens": settings.max_new_tokens, "temperature": settings.temperature,
        "stop_token_ids": stop, "skip_special_tokens": False, "return_token_ids": True,
    }  # fmt: skip
    if server.model:
        body["model"] = server.model
    if settings.temperature > 0:
        body["seed"] = prompt_seed(settings.seed, prompt.id) % (2**31)
    for attempt in range(server.retries + 1):
        try:
            r = client.post(server.url.rstrip("/") + "/completions", json=body)
            if r.status_code >= 500 or r.status_code == 429:
                raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
            if r.status_code >= 400:  # a client error will not get better by retrying
                raise ValueError(f"{server.url}: HTTP {r.status_code} for prompt {prompt.id}: {r.text[:300]}")
            choice = r.json()["choices"][0]
            break
        except ValueError:
            raise
        except Exception as e:  # transport errors, 5xx, 429: back off and retry
            if attempt == server.retries:
                raise RuntimeError(
                    f"{server.url}: prompt {prompt.id} failed after {attempt + 1} attempts: {e}"
                ) from e
            time.sleep(min(2.0**attempt * 0.5, 10.0))
    reason = str(choice.get("finish_reason") or "length")
    ids = choice.get("token_ids") or choice.get("output_token_ids")
    if ids is None:
        if tokenizer is None:
            raise ValueError(
                f"{server.url} returned text only and the local target has no tokenizer to encode it"
            )
        ids = tokenizer.encode(choice.get("text", ""), add_special_tokens=False)
        if reason == "stop" and stop and (not ids or ids[-1] not in stop):
            matched = choice.get("matched_stop") or choice.get("stop_reason")
            ids = [*ids, matched if isinstance(matched, int) and matched in stop else stop[0]]
    return [int(i) for i in ids][: settings.max_new_tokens], reason


def compute_references(
    target: Any,
    prompts: list[EvalPrompt],
    settings: ReferenceSettings,
    *,
    cache_dir: str | Path | None = None,
    server: ServerConfig | None = None,
    progress: bool = True,
    transport: Any | None = None,  # an httpx transport (tests use httpx.MockTransport)
    batch_size: int = 1,  # > 1: local references in batches (see _local_batch)
    fast_engine: bool | None = None,  # AR on the fast engine (None: where the target is on CUDA)
    batch_engine: str | None = None,  # batch_size > 1: "loop" | "native" (None: default_batch_engine)
    on_reference: Callable[[Reference], None] | None = None,
) -> ReferenceSet:
    """References for `prompts`, from the cache where present, else from the target or the server."""
    from tqdm import tqdm

    t0 = time.perf_counter()
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    stop = list(settings.stop_token_ids) if settings.stop_token_ids is not None else target_stop_ids(target)
    batched = server is None and batch_size > 1
    fast = fast_engine if fast_engine is not None else torch.device(target.device).type == "cuda"
    engine = batch_engine or default_batch_engine(target)
    if engine not in BATCH_ENGINES:
        raise ValueError(f"batch engine {engine!r}: use one of {', '.join(BATCH_ENGINES)}")
    batch_source = "local-native" if engine == "native" else "local-batched"
    if settings.temperature > 0:  # a batched sample depends on the whole prompt set: name the set in the key
        prompt_set = json.dumps([settings.seed, batch_size, [p.id for p in prompts]]).encode()
        batch_source += f"-sampled:{hashlib.sha256(prompt_set).hexdigest()[:12]}"
    local = batch_source if batched else ("local-engine" if fast else "local")
    source = f"server:{server.url}" if server is not None else local
    fp = target_fingerprint(target)
    keys = [reference_key(fp, p, settings, stop, source) for p in prompts]
    out: list[Reference | None] = [_read(_path(cache, k)) for k in keys]
    todo = [i for i, r in enumerate(out) if r is None]
    cached = len(prompts) - len(todo)

    def make(i: int, tokens: list[int], reason: str) -> Reference:
        p = prompts[i]
        seed = None
        if settings.temperature > 0:
            seed = settings.seed if batched else prompt_seed(settings.seed, p.id)
        ref = Reference(
            p.id, list(p.input_ids), tokens, p.template, source, settings.temperature, seed, reason, keys[i]
        )
        _write(_path(cache, keys[i]), ref)
        if on_reference is not None:
            on_reference(ref)
        return ref

    bar = tqdm(
        total=len(todo), desc=f"references ({source})", disable=not progress or not todo, unit="prompt"
    )
    if batched:
        order = sorted(todo, key=lambda i: len(prompts[i].input_ids))  # similar lengths pad less
        for a in range(0, len(order), batch_size):
            chunk = order[a : a + batch_size]
            for i, (tokens, reason) in zip(
                chunk, _local_batch(target, [prompts[i] for i in chunk], settings, stop, engine), strict=True
            ):
                out[i] = make(i, tokens, reason)
            bar.update(len(chunk))
    elif server is None:
        for i in todo:
            tokens, reason = _local(target, prompts[i], settings, stop, fast)
            out[i] = make(i, tokens, reason)
            bar.update(1)
    elif todo:
        import httpx

        headers = {"Authorization": f"Bearer {server.api_key}"} if server.api_key else {}
        with httpx.Client(timeout=server.timeout_s, transport=transport, headers=headers) as client:
            with ThreadPoolExecutor(max_workers=max(1, server.concurrency)) as pool:
                futures = {
                    i: pool.submit(
                        _server_request, client, server, prompts[i], settings, stop, target.tokenizer
                    )
                    for i in todo
                }
                for i, fut in futures.items():
                    tokens, reason = fut.result()
                    out[i] = make(i, tokens, reason)
                    bar.update(1)
    bar.close()
    refs = [r for r in out if r is not None]
    return ReferenceSet(refs, len(todo), cached, time.perf_counter() - t0)


@dataclass
class ReferenceCheck:
    """How a server or batched reference agrees with the local target's teacher-forced argmax."""

    checked: int = 0  # reference tokens compared
    agreed: int = 0
    kept: int = 0  # tokens before the first disagreement (what the replay uses)
    first_disagreement: int | None = None
    margins: list[float] = field(default_factory=list)  # top-2 logit margin where they disagree


# ----------------------------------------------------------------------------- frozen reference sets


@dataclass
class FrozenSet:
    """References read from a frozen JSONL file, with what made them (every line must agree)."""

    path: Path
    references: list[Reference]
    target: str  # the target's name when written
    fingerprint: str  # `target_fingerprint` of the target that wrote them
    dtype: str
    max_new_tokens: int
    stop_token_ids: list[int]


def write_frozen(
    path: str | Path,
    refs: list[Reference],
    target: Any,
    settings: ReferenceSettings,
    *,
    overwrite: bool = False,
) -> Path:
    """One JSON line per reference: id, prompt_ids, tokens, stop_reason, the settings and the target's
    fingerprint. Greedy references only (a frozen yardstick is the target's own choice at every
    position). Written whole (temp + rename); an existing file is replaced only with `overwrite`."""
    path = Path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists: pass overwrite=True (--overwrite) to replace it")
    if settings.temperature != 0 or any(r.temperature != 0 for r in refs):
        raise ValueError("frozen references are greedy (T=0) only")
    stop = list(settings.stop_token_ids) if settings.stop_token_ids is not None else target_stop_ids(target)
    common = {
        "format": FROZEN_FORMAT, "target": getattr(target, "name", "target"),
        "target_fingerprint": target_fingerprint(target), "dtype": str(target.dtype).removeprefix("torch."),
        "max_new_tokens": settings.max_new_tokens, "temperature": 0.0, "stop_token_ids": stop,
    }  # fmt: skip
    lines = [
        json.dumps(
            {
                "id": r.id,
                "prompt_ids": r.prompt_ids,
                "tokens": r.tokens,
                "stop_reason": r.stop_reason,
                "template": r.template,
                "source": r.source,
                **common,
            }  # fmt: skip
        )
        for r in refs
    ]
    atomic_write_text(path, "".join(line + "\n" for line in lines))  # the umask's mode: a file to share
    return path


def read_frozen(path: str | Path, limit: int | None = None) -> FrozenSet:
    """The references of a `write_frozen` file (the first `limit`), as source "frozen:<file name>":
    evaluate() checks each against the local target's teacher-forced argmax and cuts it at the first
    disagreement, so a frozen set stays usable on another engine, dtype or device."""
    path = Path(path)
    head, records = read_frozen_records(path, limit)
    refs = [
        Reference(
            **r, source=f"frozen:{path.name}", temperature=0.0, seed=None, key=f"frozen:{path.name}:{r['id']}"
        )
        for r in records
    ]
    return FrozenSet(path, refs, head["target"], head["target_fingerprint"], head["dtype"],
                     int(head["max_new_tokens"]), [int(i) for i in head["stop_token_ids"]])  # fmt: skip
