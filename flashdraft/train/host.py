"""The host's intra-op CPU threads during training (runtime.host_threads).

    # Trainer.run and benchmarks/train_throughput.py; inside, torch.get_num_threads() == 1 on CUDA
    with HostThreads(resolve_host_threads(cfg.runtime.host_threads, device)):
        ...

On CUDA the host only queues kernels and builds small index tensors (anchor sampling, build_blocks), and
torch's default of one OpenMP thread per core makes every such op a parallel region whose barrier waits on
the slowest thread: one descheduled thread stalls the step. On the H200, 2026-12-04 (benchmarks/gpu/mfu_ab.sh,
random and real SmolLM2 targets): 2-6 of 60-120 drafter steps 60-150 ms slow, all of it host block building
(70-180 ms at worst vs 8-9 ms with one thread); with OMP_NUM_THREADS=1 no slow step in three runs (0/60,
0/120, 0/120); GC ruled out. torchrun sets OMP_NUM_THREADS=1 by default for the same reason. On CPU the
threads do the training, so torch's default stays.
"""

from __future__ import annotations

from types import TracebackType

import torch


def resolve_host_threads(value: int | None, device: torch.device | str) -> int:
    """runtime.host_threads → the thread count to set, 0 = leave torch's setting alone.
    None (auto): 1 on CUDA, 0 elsewhere."""
    if value is None:
        return 1 if torch.device(device).type == "cuda" else 0
    if value < 0:
        raise ValueError(f"host threads {value} must be >= 0 (0 = torch's setting)")
    return value


class HostThreads:
    """torch.set_num_threads(n) between start() and stop() (n >= 1), the previous count restored by stop();
    n = 0 changes nothing. Also a context manager (exceptions included)."""

    def __init__(self, n: int) -> None:
        if n < 0:
            raise ValueError(f"host threads {n} must be >= 0 (0 = torch's setting)")
        self.n = n
        self._previous: int | None = None  # set while active

    def start(self) -> None:
        if self.n > 0 and self._previous is None:
            self._previous = torch.get_num_threads()
            torch.set_num_threads(self.n)

    def stop(self) -> None:
        """Restore the count start() found (safe to call more than once, or unstarted)."""
        if self._previous is not None:
            torch.set_num_threads(self._previous)
        self._previous = None

    def __enter__(self) -> HostThreads:
        self.start()
        return self

    def __exit__(
        self, _type: type[BaseException] | None, _exc: BaseException | None, _tb: TracebackType | None
    ) -> None:
        self.stop()
