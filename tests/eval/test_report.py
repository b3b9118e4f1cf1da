"""The Markdown report of drafters of different shapes: each drafter's block size, depth and feature layers,
and every table row as wide as its header."""

from __future__ import annotations

from flashdraft.eval.evaluate import evaluate
from flashdraft.eval.report import markdown_table
from tests.conftest import tiny_drafter, tiny_target


def _tables(md: str) -> list[list[list[str]]]:
    """Each Markdown table as its rows of cells (the separator row included)."""
    tables: list[list[list[str]]] = []
    prev = ""
    for line in md.splitlines():
        if line.startswith("|"):
            if not prev.startswith("|"):
                tables.append([])
            tables[-1].append([c.strip() for c in line.strip().strip("|").split("|")])
        prev = line
    return tables


def test_drafters_of_different_shapes() -> None:
    target = tiny_target("llama")
    small = tiny_drafter(target, seed=1, layers=1, block_size=4)
    big = tiny_drafter(target, seed=2, layers=2, block_size=8)
    report = evaluate(
        target, {"b4": small, "b8": big}, [[3, 5, 7, 9], [4, 6, 8, 10, 12]], budgets=[2, 4], topk=2,
        max_new_tokens=10, stop_token_ids=[], references=None, drafter_paths={"b4": "runs/a/drafter"},
        progress=False, cache_dir=None,
    )  # fmt: skip
    md = markdown_table(report)
    tables = _tables(md)
    for table in tables:
        assert {len(row) for row in table} == {len(table[0])}, table
    drafters = tables[0]
    assert drafters[0] == ["drafter", "block size", "layers", "feature layers", "path"]
    layers = lambda d: ",".join(map(str, d.target_layer_ids))  # noqa: E731
    assert drafters[2] == ["b4", "4", "1", layers(small), "runs/a/drafter"]
    assert drafters[3] == ["b8", "8", "2", layers(big), "—"]
    slots = tables[-1]
    assert slots[0] == ["drafter", *(f"s{k}" for k in range(1, 8))]
    assert slots[2][4:] == [""] * 4 and all(c for c in slots[3])  # B=4 has slots 1-3 only: blank cells
    assert report.drafters["b8"].target_layer_ids == list(big.target_layer_ids)
