"""Eval tests run tiny models: one intra-op thread avoids thread-spin stalls when the 2-core
CI machine is shared (tiny float64 matmuls went from ~0.1 ms to ~7 ms with 2 contended threads)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
