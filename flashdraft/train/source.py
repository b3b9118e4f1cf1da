"""Feature sources: where the trainer's FeatureBatches come from.

The trainer only needs an iterator of `FeatureBatch` with a resumable position. This module
holds the interface and the in-process source (packs samples, runs the target in the
training loop). Queue-fed (online producer) and disk-fed (offline dump) sources implement
the same interface.

    source = InProcessSource(dataset, target, layer_ids, max_length=3072, token_budget=16384, epochs=6)
    for batch in source: ...                      # FeatureBatch, one micro-batch at a time
    state = source.state_dict()                   # JSON-able: epoch and position in the epoch
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from flashdraft.train.batch import (
    FeatureBatch,
    MicroBatchPlan,
    Sample,
    compute_features,
    pack_rows,
    plan_micro_batches,
)
from flashdraft.train.target_pass import PackedTargetPass


@runtime_checkable
class FeatureSource(Protocol):
    """An iterator of FeatureBatch whose position can be saved and restored exactly."""

    def __iter__(self) -> Iterator[FeatureBatch]: ...

    @property
    def epoch(self) -> int: ...

    def micro_batches_per_epoch(self) -> int: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class InProcessSource:
    """Packs samples into micro-batches (a fresh seeded order each epoch) and runs the target on them.

    The state is (epoch, next micro-batch index): the plan of an epoch is a pure function of
    (seed, epoch), so a restored source yields exactly the batches an uninterrupted one would.
    Data-parallel ranks take every `world_size`-th micro-batch starting at `rank`.
    """

    def __init__(
        self,
        samples: Sequence[Sample],
        target: Any,  # TargetModel
        layer_ids: list[int],
        *,
        max_length: int,
        token_budget: int,
        epochs: int | None = 1,  # None: cycle forever (max_steps decides)
        seed: int = 0,
        shuffle: bool = True,
        pad_multiple: int = 1,
        lengths: Sequence[int] | None = None,  # known lengths (datasets store them): no need to read samples
        rank: int = 0,
        world_size: int = 1,
        feature_pass: str = "hf",  # runtime.feature_pass: hf (transformers) or native (flashdraft.train.target_pass)
        compile_target: bool = False,  # native only: the pass compiled, micro-batches padded to one static shape
        target_graph: bool = False,  # with compile_target: the compiled pass replayed as a CUDA graph
    ) -> None:
        self.samples = samples
        self.target = target
        self.layer_ids = list(layer_ids)
        self.max_length, self.token_budget = max_length, token_budget
        self.epochs, self.seed, self.shuffle = epochs, seed, shuffle
        self.pad_multiple = pad_multiple
        self.rank, self.world_size = rank, world_size
        if lengths is None:
            lengths = [len(s.input_ids) for s in samples]
        self.lengths = np.asarray(lengths, dtype=np.int64)
        if len(self.lengths) == 0:
            raise ValueError("the dataset has no samples")
        self._epoch = 0
        self._position = 0  # index of the next micro-batch (in this rank's share) within the epoch
        self._plan_cache: tuple[int, list[MicroBatchPlan], np.ndarray] | None = None
        # host seconds of the last batch's stages (packing, the target pass's launch or the disk read): read by
        # the pipeline (flashdraft/train/pipeline.py) into pipeline/host_*_ms, to say where a starved trainer waits
        self.last_host_s: dict[str, float] = {}
        if feature_pass not in ("hf", "native"):
            raise ValueError(f"runtime.feature_pass {feature_pass!r}: use hf or native")
        self.native: PackedTargetPass | None = None
        if feature_pass == "native" and target is not None:
            # the largest micro-batch plan_micro_batches makes, rows padded as pack_rows pads them
            shape = (max(1, token_budget // max_length), -(-max_length // pad_multiple) * pad_multiple)
            self.native = PackedTargetPass(
                target, compile_shape=shape if compile_target else None, cuda_graph=target_graph
            )

    @property
    def epoch(self) -> int:
        return self._epoch

    def _plan(self, epoch: int) -> tuple[list[MicroBatchPlan], np.ndarray]:
        if self._plan_cache is None or self._plan_cache[0] != epoch:
            n = len(self.lengths)
            order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
            plans = plan_micro_batches(self.lengths[order], self.max_length, self.token_budget)
            # every rank gets the same number of micro-batches (ranks step in lockstep): the last
            # len % world_size micro-batches of an epoch are dropped in data-parallel runs
            usable = len(plans) - len(plans) % self.world_size
            self._plan_cache = (epoch, plans[self.rank : usable : self.world_size], order)
        return self._plan_cache[1], self._plan_cache[2]

    def micro_batches_per_epoch(self) -> int:
        return len(self._plan(0)[0])

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "position": self._position, "seed": self.seed, "rank": self.rank}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state.get("seed", self.seed)) != self.seed:
            raise ValueError(
                f"checkpoint data seed {state['seed']} != runtime.seed {self.seed}: resume with the same seed"
            )
        self._epoch, self._position = int(state["epoch"]), int(state["position"])

    def __iter__(self) -> Iterator[FeatureBatch]:
        while self.epochs is None or self._epoch < self.epochs:
            plans, order = self._plan(self._epoch)
            while self._position < len(plans):
                plan = plans[self._position]
                self._position += 1  # the state names the next batch once this one is handed out
                yield self.features([[int(order[i]) for i in row] for row in plan.rows])
            self._epoch += 1
            self._position = 0

    def features(self, rows: list[list[int]]) -> FeatureBatch:
        """One micro-batch: rows of sample indices → packed tokens + the target's features.
        (An offline source overrides this to read the features from disk.)"""
        t0 = time.perf_counter()
        docs = [[self.samples[i] for i in row] for row in rows]
        tokens = pack_rows(docs, self.max_length, self.pad_multiple)
        t1 = time.perf_counter()
        fb = compute_features(self.target, tokens, self.layer_ids, self.native)
        # on CUDA the target pass is launched here, not waited for
        self.last_host_s = {"pack": t1 - t0, "target": time.perf_counter() - t1}
        return fb
