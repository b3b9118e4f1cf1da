"""Which decoder runs a request: the reference decoder (transformers forwards, any target) or the CUDA-graph engine
(`flashdraft.decode.engine`, native Llama / Qwen2 / Qwen3 / Mistral forwards). Both are lossless and take the same
arguments; `flashdraft generate`, `bench` and `serve` pick through here.

    name, generate = pick_engine(target, "auto")                 # "fast" on CUDA where it runs the target
    name, generate = pick_engine(target, "fast", compile=True)   # "fast-compiled": forwards via torch.compile
    name, generate = pick_engine(target, "fast", graph_prefill=True)  # "fast-graph-prefill" (CUDA)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

ENGINES = ("auto", "fast", "reference")


def check_engine_name(engine: str) -> None:
    """ValueError (one line) unless `engine` is one of ENGINES: callers check it before loading a target."""
    if engine not in ENGINES:
        raise ValueError(f"--engine {engine!r}: use {', '.join(ENGINES)}")


def pick_engine(
    target: Any, engine: str = "auto", compile: bool = False, graph_prefill: bool = False
) -> tuple[str, Callable[..., Any]]:
    """(name, its generate function). "auto": the fast engine on CUDA when it can run this target, else the
    reference; "fast" also on a CPU (one line saying why where it cannot run the target). `compile`: the fast
    engine's target and drafter forwards through torch.compile ("fast-compiled"; the reference refuses it).
    `graph_prefill`: the fast engine's prefill as a CUDA graph per prompt-length bucket (a CUDA target only)."""
    from flashdraft.decode.generate import generate as reference
    from flashdraft.decode.native import native_support_error

    check_engine_name(engine)
    why = native_support_error(target)
    if engine == "fast" and why is not None:
        raise ValueError(f"--engine fast: {why}")
    if engine == "reference" or why is not None or (engine == "auto" and target.device.type != "cuda"):
        if compile:
            raise ValueError("--compile: only the fast engine compiles (a CUDA target, or --engine fast)")
        if graph_prefill:
            raise ValueError("--graph-prefill: only the fast engine on a CUDA target graphs its prefill")
        return "reference", reference
    if graph_prefill and target.device.type != "cuda":
        raise ValueError("--graph-prefill: CUDA graphs need a CUDA target (--device cuda)")
    from flashdraft.decode import engine as fast

    name = ("fast-compiled" if compile else "fast") + ("-graph-prefill" if graph_prefill else "")
    kw = {k: True for k, on in (("compile", compile), ("graph_prefill", graph_prefill)) if on}
    return name, functools.partial(fast.generate, **kw) if kw else fast.generate
