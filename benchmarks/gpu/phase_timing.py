"""The median time of one run of a GPU phase, for the benchmarks beside this file (tree_build.py, forward_speed.py).

ms = median_ms(phase, reps=100, warmup=10, cuda=True)                 # a CUDA-graph replay, events around it
ms = median_ms(phase, reps=30, warmup=3, cuda=False, before=restore)  # eager on CPU; state reset before each run
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def median_ms(
    run: Callable[[], object], reps: int, *, warmup: int, cuda: bool, before: Callable[[], None] | None = None
) -> float:
    """Median milliseconds of `run()` over `reps` timed runs after `warmup` untimed ones; `before()` (untimed)
    precedes every run. On CUDA each run sits between two events and is waited for."""
    if reps < 1:
        raise ValueError(f"reps {reps}: time at least one run")
    times = []
    for i in range(warmup + reps):
        if before is not None:
            before()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            run()
            ms = (time.perf_counter() - t0) * 1e3
        if i >= warmup:
            times.append(ms)
    return statistics.median(times)
