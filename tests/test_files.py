"""flashdraft.files: staged folders and files land whole, with the user's umask, and never replace
a non-empty folder unless asked."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from flashdraft.files import apply_umask, atomic_folder, atomic_write_text, move_into_place, stage_dir
from tests.conftest import tiny_drafter, tiny_target


@pytest.fixture
def umask() -> Iterator[Callable[[int], int]]:
    """os.umask for one test; the process's umask is restored after it."""
    old = os.umask(0o022)
    os.umask(old)
    yield os.umask
    os.umask(old)


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


@pytest.mark.parametrize(("mask", "dir_mode", "file_mode"), [(0o022, 0o755, 0o644), (0o077, 0o700, 0o600)])
def test_folder_and_file_modes_follow_the_umask(
    tmp_path: Path, umask, mask: int, dir_mode: int, file_mode: int
) -> None:  # type: ignore[no-untyped-def]
    umask(mask)
    with atomic_folder(tmp_path / "out") as tmp:
        (tmp / "a.txt").write_text("x")
    assert _mode(tmp_path / "out") == dir_mode and _mode(tmp_path / "out" / "a.txt") == file_mode
    atomic_write_text(tmp_path / "b.json", "{}")
    assert _mode(tmp_path / "b.json") == file_mode and (tmp_path / "b.json").read_text() == "{}"
    assert _mode(stage_dir(tmp_path / "c")) == dir_mode
    (tmp_path / "d.bin").touch(mode=0o600)
    apply_umask(tmp_path / "d.bin")
    assert _mode(tmp_path / "d.bin") == file_mode
    assert not list(tmp_path.glob(".d.bin.*"))  # the probe file is gone


MODES = [(0o022, 0o755, 0o644), (0o077, 0o700, 0o600)]


@pytest.mark.parametrize(("mask", "dir_mode", "file_mode"), MODES)
def test_saved_drafter_and_checkpoint_modes_follow_the_umask(
    tmp_path: Path, umask, mask, dir_mode, file_mode
) -> None:  # type: ignore[no-untyped-def]
    from flashdraft.train.checkpoint import TrainerState, save_checkpoint

    drafter = tiny_drafter(tiny_target("llama", dtype=torch.float32)).float()
    umask(mask)
    drafter.save_pretrained(tmp_path / "drafter")
    ckpt = save_checkpoint(tmp_path / "run", 7, drafter, TrainerState({}, {"x": torch.zeros(2)}))
    for folder in (tmp_path / "drafter", ckpt, ckpt / "drafter"):
        assert _mode(folder) == dir_mode, folder
        assert {_mode(p) for p in folder.iterdir() if p.is_file()} == {file_mode}, folder


def test_failure_leaves_the_destination_untouched(tmp_path: Path) -> None:
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "mine.txt").write_text("keep")
    with pytest.raises(RuntimeError), atomic_folder(dest) as tmp:
        (tmp / "half.bin").write_bytes(b"1")
        raise RuntimeError("killed mid-write")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging folder left behind
    assert (dest / "mine.txt").read_text() == "keep" and not (dest / "half.bin").exists()


def test_without_overwrite_only_a_missing_or_empty_folder_is_replaced(tmp_path: Path) -> None:
    dest = tmp_path / "out"
    dest.mkdir()  # empty: taken
    with atomic_folder(dest, overwrite=False) as tmp:
        (tmp / "new.txt").write_text("1")
    assert (dest / "new.txt").read_text() == "1"
    with (
        pytest.raises(FileExistsError, match="exists and is not an empty folder"),
        atomic_folder(dest, overwrite=False) as tmp,
    ):
        (tmp / "other.txt").write_text("2")
    assert sorted(p.name for p in dest.iterdir()) == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_overwrite_swaps_in_the_new_folder_and_removes_the_old(tmp_path: Path) -> None:
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "old.txt").write_text("old")
    staged = stage_dir(dest)
    (staged / "new.txt").write_text("new")
    move_into_place(staged, dest, overwrite=True)
    assert sorted(p.name for p in dest.iterdir()) == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize(("mask", "dir_mode", "file_mode"), MODES)
def test_reference_cache_and_frozen_files_follow_the_umask(
    tmp_path: Path, umask, mask, dir_mode, file_mode
) -> None:  # type: ignore[no-untyped-def]
    from flashdraft.eval.prompts import EvalPrompt
    from flashdraft.eval.references import ReferenceSettings, compute_references, write_frozen

    target = tiny_target("llama")
    umask(mask)
    settings = ReferenceSettings(max_new_tokens=4)
    refs = compute_references(target, [EvalPrompt("p", [1, 5, 7], "token ids")], settings,
                              cache_dir=tmp_path / "cache", progress=False).references  # fmt: skip
    assert {_mode(p) for p in (tmp_path / "cache").rglob("*.json")} == {file_mode}
    assert _mode(write_frozen(tmp_path / "set.jsonl", refs, target, settings)) == file_mode
