"""Python's cyclic garbage collector during training: collected at step boundaries, not at random.

    with GCPolicy(cfg.runtime.gc_every) as gc_policy:    # Trainer.run; benchmarks/train_throughput.py
        for step in range(1, n + 1):
            optimizer_step(...)
            gc_policy.step(step)                          # gc.collect(1) every `every` steps
            if checkpoint_due:
                save(); gc_policy.after_checkpoint()      # a full gc.collect()

Automatic collection runs whenever enough objects have been allocated, so a full (generation-2)
collection over the large heap that torch.compile / inductor leaves behind can pause the host
for tens of ms at any step while the GPU idles (the suspect for issue 5's 11 of 60 drafter steps
60-90 ms slow on the H200: benchmarks/gpu/mfu_ab.sh's allgc variant tests it). With `every > 0` automatic collection is off inside the block; the young generations
are collected every `every` steps (each rank at the same step under torchrun, so no rank waits on
another's pause) and everything after each checkpoint save, a pause that is already paid there.
`every = 0` leaves the collector alone. The previous state (`gc.isenabled()`) is restored on
exit, exceptions included.
"""

from __future__ import annotations

import gc
from types import TracebackType


class GCPolicy:
    def __init__(self, every: int) -> None:
        if every < 0:
            raise ValueError(f"gc every {every} must be >= 0 (0 = Python's automatic collection)")
        self.every = every
        self._was_enabled: bool | None = None  # set while the policy is active

    def start(self) -> None:
        if self.every > 0 and self._was_enabled is None:
            self._was_enabled = gc.isenabled()
            gc.disable()

    def stop(self) -> None:
        """Restore automatic collection as start() found it (safe to call more than once, or unstarted)."""
        if self._was_enabled:
            gc.enable()
        self._was_enabled = None

    def __enter__(self) -> GCPolicy:
        self.start()
        return self

    def __exit__(
        self, _type: type[BaseException] | None, _exc: BaseException | None, _tb: TracebackType | None
    ) -> None:
        self.stop()

    def step(self, step: int) -> None:
        """After optimizer step `step` (1-based, counted over the run): the young generations every `every`
        steps. Generation 1 also covers generation 0; cyclic garbage that reaches into older objects waits
        for the next checkpoint's full collection."""
        if self.every > 0 and step % self.every == 0:
            gc.collect(1)

    def after_checkpoint(self) -> None:
        if self.every > 0:
            gc.collect()
