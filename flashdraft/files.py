"""Writing folders and files so that a reader never sees them half-written, with the user's umask.

    with atomic_folder(dest) as tmp:           # an empty folder beside dest
        (tmp / "config.json").write_text(...)
    # dest now holds exactly what was written; on an exception dest is untouched and tmp is gone

    atomic_write_text(path, text)               # one file: temp name beside it, then rename

    save_file(tensors, path); apply_umask(path)  # safetensors writes 0600 files: give it the usual mode

Why not `tempfile.mkdtemp` / `mkstemp`: they create 0700 folders and 0600 files whatever the
umask, and a rename keeps that mode, so a checkpoint or an export came out private to its
writer. Here the staging folder is made with `mkdir` and the file with `open(..., 0o666)`,
which the kernel masks with the umask as for any file the user creates.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path


def _unique_sibling(dest: Path, tag: str) -> Path:
    return dest.with_name(f".{dest.name}.{tag}-{secrets.token_hex(4)}")


def stage_dir(dest: str | os.PathLike[str], tag: str = "tmp") -> Path:
    """A new empty folder beside `dest` (same filesystem, so one rename moves it into place), created
    with the user's umask. The caller renames it into place or removes it."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    while True:
        tmp = _unique_sibling(dest, tag)
        try:
            tmp.mkdir()  # mode 0o777 & ~umask
            return tmp
        except FileExistsError:  # 32 random bits taken: draw again
            continue


def move_into_place(staged: Path, dest: Path, *, overwrite: bool) -> None:
    """Rename the finished folder `staged` to `dest`.

    Without `overwrite` the rename itself refuses a non-empty `dest` (POSIX replaces only an empty
    folder), so nothing of the user's is ever removed. With `overwrite` the old `dest` is first
    renamed aside, the new one renamed in, and only then the old one deleted: at every instant
    `dest` is either the complete old folder, absent for the moment between two renames, or the
    complete new one."""
    if not overwrite:
        try:
            os.rename(staged, dest)
        except OSError as e:
            if dest.exists() or dest.is_symlink():
                raise FileExistsError(
                    f"{dest} exists and is not an empty folder: refusing to replace it"
                ) from e
            raise
        return
    if not dest.exists() and not dest.is_symlink():
        os.rename(staged, dest)
        return
    old = _unique_sibling(dest, "old")
    os.rename(dest, old)
    try:
        os.rename(staged, dest)
    except BaseException:
        os.rename(old, dest)  # put the old one back before failing
        raise
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old)
    else:
        old.unlink()


@contextlib.contextmanager
def atomic_folder(
    dest: str | os.PathLike[str], *, overwrite: bool = True, tag: str = "tmp"
) -> Iterator[Path]:
    """Yield an empty staging folder beside `dest`; when the block ends without an exception it becomes
    `dest` (see move_into_place). On an exception the staging folder is removed and `dest` is untouched."""
    dest = Path(dest)
    tmp = stage_dir(dest, tag)
    try:
        yield tmp
        move_into_place(tmp, dest, overwrite=overwrite)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def apply_umask(path: str | os.PathLike[str]) -> None:
    """Give the file `path` the mode a new file gets under the current umask (0o666 & ~umask), for
    writers that create theirs 0600 (safetensors' save_file). The umask is read by creating a probe
    file beside it, not with os.umask(), which would change it for every thread for a moment."""
    path = Path(path)
    probe = _unique_sibling(path, "mode")
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        mode = os.fstat(fd).st_mode & 0o777
    finally:
        os.close(fd)
        probe.unlink()
    path.chmod(mode)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write `text` (UTF-8) to `path` through a temp file beside it and one rename (the umask's mode)."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write `data` to `path` through a temp file beside it and one rename (the file keeps the umask's mode)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        tmp = _unique_sibling(path, "tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            break
        except FileExistsError:
            continue
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def file_sha256(path: str | os.PathLike[str]) -> str:
    """The sha256 of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def weights_sha256(path: str | os.PathLike[str] | None) -> str | None:
    """The sha256 of the weights file a drafter folder (or a checkpoint's drafter/) holds: its model.safetensors;
    None when there is none (no path, a run folder, an in-memory drafter)."""
    if not path:
        return None
    for f in (Path(path) / "model.safetensors", Path(path) / "drafter" / "model.safetensors"):
        if f.is_file():
            return file_sha256(f)
    return None
