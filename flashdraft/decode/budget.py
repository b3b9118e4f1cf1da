"""`--budget auto`: pick AR, the chain or a DDTree budget by expected tokens/s, and keep picking.

    policy = auto_policy(target, drafter, generate_fn, engine="reference")   # calibrated once, cached
    result = generate(target, drafter, ids, max_new_tokens=256, method="auto", policy=policy)
    policy.choice()                      # ("ddtree", 16), ("chain", None) or ("ar", None)

Expected tokens/s of a method = τ(method) / seconds per round(method), AR's τ being 1:
- seconds per round come from a short calibration of this target (and drafter) on this device,
  dtype and engine: a few real rounds of every candidate on a fixed prompt, the median kept. The
  table is cached as JSON in $FLASHDRAFT_CACHE/budget (default ~/.cache/flashdraft/budget), keyed
  by the target's and drafter's weight fingerprints, device, dtype, engine and CPU threads.
- τ per method comes from an eval report (`flashdraft eval`'s report.json, `--tau-report`) when one
  is given, else from a conservative prior (PRIOR_TAU). Either way it adapts online: the rounds a
  method runs pull its estimate toward what it achieved (`prior_weight` rounds of pseudo-count), and
  methods not running are scaled by how the running ones fared against their starting values.
- A DDTree round of budget b also tells every smaller budget's round: the tree of b' < b nodes is the
  first b' nodes of b's (the same best-first order), so it would have accepted the path's nodes up to
  b' (the same tokens at T = 0; at T > 0 the target's samples at those nodes, which have the same law).
  So the largest budget runs at the second choice (the first trusts the starting τ: a single generation
  on the fast engine is one choice, with no later one to profit from a measurement), and again every
  `explore_every` choices, while its expected rate is at least `explore_ratio` of the best: one such
  generation measures every budget on this workload, where an eval report's τ came from other prompts.

The choice is made again every `period` rounds (inside a generation on the reference decoder,
between generations on the fast engine). Every choice decodes losslessly, so any sequence of
choices is token-identical to AR at T=0 (tests/decode/test_budget.py). Once AR wins nothing more
is learned about the drafter, so AR stays: that is the fallback where no tree pays (a 2-core CPU).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from flashdraft.files import atomic_write_text

Choice = tuple[str, int | None]  # ("ar", None) | ("chain", None) | ("ddtree", budget)

CPU_BUDGETS = (4, 8, 16, 32)  # a CPU verify grows with the tree: larger budgets never paid on 2 cores
CUDA_BUDGETS = (8, 16, 32, 64, 128, 256, 512)
# Conservative starting τ when no eval report is given: the chain slightly below, and every budget well
# below, what the shipped SmolLM2-135M drafter measured on held-out prompts (chain 2.70, DDTree-8 3.06 …
# 512 4.65, H100 float32; benchmarks/RESULTS.md), with DDTree's gain halved.
PRIOR_CHAIN_TAU = 2.5
PRIOR_TREE_GAIN_PER_DOUBLING = 0.1  # τ(ddtree-b) = chain + 0.1 · log2(b / 4) + 0.2


def label(choice: Choice) -> str:
    method, budget = choice
    return f"ddtree:{budget}" if method == "ddtree" else method


def parse_label(text: str) -> Choice:
    if text in ("ar", "chain"):
        return text, None
    if text.startswith("ddtree:") and text[7:].isdigit():
        return "ddtree", int(text[7:])
    raise ValueError(f"unknown method label {text!r}: use ar, chain or ddtree:N")


def prior_tau(choice: Choice) -> float:
    method, budget = choice
    if method == "ar":
        return 1.0
    if method == "chain":
        return PRIOR_CHAIN_TAU
    assert budget is not None
    import math

    return min(
        budget + 1.0, PRIOR_CHAIN_TAU + 0.2 + PRIOR_TREE_GAIN_PER_DOUBLING * math.log2(max(budget, 1) / 4)
    )


def tau_from_report(path: str | Path, drafter: str | None = None) -> dict[str, float]:
    """τ per method label from a `flashdraft eval` report.json: the entry of `drafter` (a name in the report,
    or a drafter folder, matched by its weights' sha256, then by its folder name), else the only one."""
    p = Path(path)
    if p.is_dir():
        p = p / "report.json"
    try:
        rep = json.loads(p.read_text())
        drafters = rep["drafters"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{p}: not a flashdraft eval report.json ({e})") from None
    name = report_entry(drafters, drafter, p)
    out: dict[str, float] = {}
    for method, m in drafters[name]["methods"].items():
        if method == "chain":
            out["chain"] = float(m["tau"])
        elif method.startswith("ddtree-"):
            out[f"ddtree:{int(method[7:])}"] = float(m["tau"])
    return out


def report_entry(drafters: dict[str, Any], drafter: str | None, p: Path) -> str:
    """Which of a report's drafters `drafter` is (see tau_from_report); a one-line error when none is."""
    if drafter is None:
        if len(drafters) != 1:
            raise ValueError(f"{p} has drafters {sorted(drafters)}: name one")
        return next(iter(drafters))
    if drafter in drafters:
        return drafter
    from flashdraft.files import weights_sha256

    folder = Path(drafter)
    sha = weights_sha256(folder)
    if sha is not None:
        same = [k for k, v in drafters.items() if isinstance(v, dict) and v.get("weights_sha256") == sha]
        if same:
            return same[0]
    # an entry that records other weights is another drafter, whatever its name; older reports record none
    unknown = [
        k for k, v in drafters.items() if sha is None or not (isinstance(v, dict) and v.get("weights_sha256"))
    ]
    by_name = [k for k in unknown if k == folder.name]
    if by_name or len(drafters) == len(unknown) == 1:
        return by_name[0] if by_name else unknown[0]
    why = f"; none has its weights (sha256 {sha[:12]}…)" if sha else ""
    raise ValueError(f"{p}: no drafter {drafter!r} (has {sorted(drafters)}){why}")


# ----------------------------------------------------------------------------- calibration


@dataclass
class CostTable:
    """Seconds per decoding round of each candidate, measured on one target/drafter/device/dtype/engine."""

    key: str
    seconds: dict[str, float]  # label -> median seconds per round
    device: str
    engine: str
    measured: str  # ISO date-time of the measurement


def default_cache_dir() -> Path:
    root = os.environ.get("FLASHDRAFT_CACHE")
    return Path(root) / "budget" if root else Path.home() / ".cache" / "flashdraft" / "budget"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"cpu:{platform.machine()}:{os.cpu_count()}cores:{torch.get_num_threads()}threads"


# bumped when an engine's round costs change (a cached calibration of the old engine would mislead `auto`):
# 2 = 2026-12-07, the fast engine's rounds attend over their spans of the cache, not all of it
COST_VERSION = 2


def cost_key(target: Any, drafter: Any, engine: str, candidates: list[Choice]) -> str:
    from flashdraft.target import target_fingerprint

    h = hashlib.sha256()
    h.update(target_fingerprint(target).encode())
    if drafter is not None:
        for name, p in drafter.named_parameters():
            flat = p.detach().reshape(-1)
            h.update(name.encode() + str(tuple(p.shape)).encode())
            h.update(flat[:: max(1, flat.numel() // 64)].to("cpu", torch.float64).numpy().tobytes())
    h.update(
        json.dumps(
            [
                _device_name(target.device),
                str(target.dtype),
                engine,
                [label(c) for c in candidates],
                COST_VERSION,
            ]
        ).encode()
    )
    return h.hexdigest()[:24]


def calibrate(
    target: Any,
    drafter: Any,
    generate_fn: Callable[..., Any],
    candidates: list[Choice],
    *,
    engine: str = "reference",
    rounds: int = 6,
    prompt_len: int = 96,
    cache_dir: str | Path | None = None,
) -> CostTable:
    """Median seconds per round of every candidate: `rounds` timed rounds after one untimed warm-up
    generation, on a fixed prompt of `prompt_len` token ids; read from the cache when present."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key = cost_key(target, drafter, engine, candidates)
    path = cache / f"{key}.json"
    try:
        raw = json.loads(path.read_text())
        return CostTable(**raw)
    except (OSError, json.JSONDecodeError, TypeError):
        pass  # absent or unreadable: measure
    vocab = int(target.vocab_size)
    ids = [(7 + 31 * i) % vocab for i in range(prompt_len)]
    seconds: dict[str, float] = {}
    for choice in candidates:
        method, budget = choice
        marks: list[float] = []

        def tick(_new: list[int], marks: list[float] = marks) -> bool:
            marks.append(time.perf_counter())
            return len(marks) <= rounds  # the prefill's call, then `rounds` rounds

        d = None if method == "ar" else drafter
        kw = dict(max_new_tokens=rounds * 32 + 1, method=method, budget=budget, stop_token_ids=[])
        generate_fn(target, d, ids, **kw, on_tokens=lambda _new: False)  # warm-up (graph capture on CUDA)
        generate_fn(target, d, ids, **kw, on_tokens=tick)
        seconds[label(choice)] = statistics.median(b - a for a, b in zip(marks, marks[1:], strict=False))
    table = CostTable(key, seconds, _device_name(target.device), engine, time.strftime("%Y-%m-%dT%H:%M:%S"))
    atomic_write_text(path, json.dumps(table.__dict__))
    return table


# ----------------------------------------------------------------------------- the policy


@dataclass
class AutoPolicy:
    """Expected tokens/s = τ / seconds per round, maximised over the candidates; τ adapts online."""

    seconds: dict[str, float]  # label -> seconds per round (`CostTable.seconds`)
    start_tau: dict[str, float]  # label -> τ before any round (an eval report's, else `prior_tau`)
    prior_weight: float = 8.0  # rounds of pseudo-count behind each starting τ
    period: int = 4  # rounds between two choices inside a generation
    # the largest budget runs (its rounds measure every budget) while its rate is at least this share of the best
    explore_ratio: float = 0.8
    explore_every: int = 32  # choices between two such runs
    observed: dict[str, list[int]] = field(default_factory=dict)  # label -> [rounds, tokens committed]
    history: list[str] = field(default_factory=list)  # the choices in order, a repeat recorded once
    counts: dict[str, int] = field(default_factory=dict)  # label -> times chosen
    explored_at: int | None = None  # the choice (count of all choices) that last ran the largest budget

    def __post_init__(self) -> None:
        missing = [k for k in self.seconds if k != "ar" and k not in self.start_tau]
        if missing:
            raise ValueError(f"no starting τ for {missing}: give an eval report with them or use the prior")
        if "ar" not in self.seconds:
            raise ValueError("the candidates must include ar (the fallback)")

    def tau(self, lab: str) -> float:
        """The current τ estimate of a method label."""
        if lab == "ar":
            return 1.0
        start = self.start_tau[lab]
        n, tok = self.observed.get(lab, [0, 0])
        if n:
            return (self.prior_weight * start + tok) / (self.prior_weight + n)
        # not run yet: scale its lead over AR by how the methods that ran did against their start
        w = sum(r for r, _ in self.observed.values())
        if not w:
            return start
        ratio = (
            sum(
                r * (self.tau(k) - 1) / max(self.start_tau[k] - 1, 1e-6)
                for k, (r, _) in self.observed.items()
            )
            / w
        )
        return 1 + (start - 1) * ratio

    @property
    def ar_final(self) -> bool:
        """True once AR was chosen: every later choice is AR (nothing more is learned about the drafter)."""
        return bool(self.history) and self.history[-1] == "ar"

    def rates(self) -> dict[str, float]:
        """Expected tokens/s per label."""
        return {k: self.tau(k) / s for k, s in self.seconds.items()}

    def choice(self) -> Choice:
        if self.ar_final:
            self._record("ar")
            return "ar", None  # nothing is learned while AR runs: AR stays
        r = self.rates()
        best = max(r, key=lambda k: (r[k], k == "ar"))  # ties go to AR
        trees = [k for k in r if k.startswith("ddtree:")]
        largest = max(trees, key=lambda k: parse_label(k)[1] or 0) if trees else None
        made = sum(self.counts.values())
        due = made >= 1 if self.explored_at is None else made - self.explored_at >= self.explore_every
        if largest is not None and best != "ar" and due and r[largest] >= self.explore_ratio * r[best]:
            best = largest  # one of its rounds measures every smaller budget too
        if best == largest:
            self.explored_at = made
        self._record(best)
        return parse_label(best)

    def _record(self, lab: str) -> None:
        self.counts[lab] = self.counts.get(lab, 0) + 1
        if not self.history or self.history[-1] != lab:
            self.history.append(lab)
            del self.history[:-1000]  # a server's policy lives long: keep the recent switches

    def observe(self, choice: Choice, accepted: list[int], paths: list[list[int]] | None = None) -> None:
        """Tokens committed per round while `choice` ran; for DDTree rounds, `paths` (GenerationResult.tree_paths,
        one per round) also count as rounds of every smaller candidate budget: 1 + the path's nodes <= b' each."""
        lab = label(choice)
        if lab == "ar" or not accepted:
            return
        if paths is not None and len(paths) != len(accepted):
            raise ValueError(f"{len(paths)} tree paths for {len(accepted)} rounds")
        self._add(lab, len(accepted), sum(accepted))
        method, budget = choice
        if method != "ddtree" or paths is None or budget is None:
            return
        for k in self.seconds:
            m, b = parse_label(k)
            if m == "ddtree" and b is not None and b < budget:
                self._add(k, len(paths), sum(1 + sum(1 for node in path if node <= b) for path in paths))

    def _add(self, lab: str, rounds: int, tokens: int) -> None:
        n, tok = self.observed.get(lab, [0, 0])
        self.observed[lab] = [n + rounds, tok + tokens]


def candidates_for(device: torch.device, drafter: Any, budgets: list[int] | None = None) -> list[Choice]:
    if drafter is None:
        return [("ar", None)]
    bs = budgets or list(CUDA_BUDGETS if device.type == "cuda" else CPU_BUDGETS)
    return [("ar", None), ("chain", None), *[("ddtree", b) for b in bs]]


def auto_policy(
    target: Any,
    drafter: Any,
    generate_fn: Callable[..., Any],
    *,
    engine: str = "reference",
    tau_report: str | Path | None = None,
    report_drafter: str | None = None,
    budgets: list[int] | None = None,
    cache_dir: str | Path | None = None,
) -> AutoPolicy:
    """A calibrated policy: the candidates for this device (budgets limited to those in the report, when
    one is given), their cost per round, their starting τ."""
    cands = candidates_for(target.device, drafter, budgets)
    start: dict[str, float] = {label(c): prior_tau(c) for c in cands}
    if tau_report is not None and drafter is not None:
        measured = tau_from_report(tau_report, report_drafter)
        cands = [c for c in cands if c[0] == "ar" or label(c) in measured]
        start = {label(c): measured.get(label(c), 1.0) for c in cands}
    table = calibrate(target, drafter, generate_fn, cands, engine=engine, cache_dir=cache_dir)
    return AutoPolicy({label(c): table.seconds[label(c)] for c in cands}, start)
