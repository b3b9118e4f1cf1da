"""One way to capture a CUDA graph, shared by the decoding engine's phases, the regeneration step and the training
feature pass: the callable run twice on a side stream (lazy cuBLAS handles, compilations, kernel choices: work a
capture must not see), then captured on the caller's stream.

    graph, out = capture(fn, pool=pool)     # later: refill fn's static inputs, graph.replay(), read `out`
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def capture(
    fn: Callable[[], T], *, pool: Any = None, generator: torch.Generator | None = None, warmups: int = 2
) -> tuple[torch.cuda.CUDAGraph, T]:
    """(the graph, what `fn` returned in the capture: static tensors the replays rewrite). `pool`: a memory pool
    shared with other graphs (`torch.cuda.graph_pool_handle()`); `generator`: a seeded generator the graph draws
    from, registered so that each replay advances it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    if generator is not None:
        graph.register_generator_state(generator)
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out
