"""Expected failures, and how the `flashdraft` command prints them: one line, `error: ...`, exit 2.

    raise UserError(f"{path}: not a drafter folder (no config.json): pass the folder `flashdraft export` wrote")

An *expected* failure is the user's to fix (a bad option, a missing or corrupt file, a config value);
anything else is a bug and keeps its traceback. Expected are:
- `UserError` and its subclasses (`ConfigError`, `BadInputError`, ...);
- the error classes of other flashdraft modules listed in `_EXPECTED` (recognised by name, so checking
  an exception imports nothing);
- missing / existing / unreadable files (`FileNotFoundError`, `FileExistsError`, `PermissionError`, ...),
  and a text file that is not UTF-8 (`UnicodeDecodeError`: the message says so; --debug says which file);
- a plain `ValueError` that a flashdraft `raise` statement wrote: flashdraft validates its inputs with
  `raise ValueError("what is wrong: the fix")`; a ValueError from inside torch or from a builtin call in
  flashdraft code (`int("x")`) is not one of those, and keeps its traceback.
`flashdraft --debug ...` or FLASHDRAFT_DEBUG=1 shows the traceback of expected failures too.
"""

from __future__ import annotations

import linecache
import os
from pathlib import Path

_PACKAGE = str(Path(__file__).resolve().parent)

# error classes of flashdraft modules that carry a message meant for the user
_EXPECTED = {
    "flashdraft.data.dataset.DatasetError",
    "flashdraft.data.template.TemplateError",
    "flashdraft.data.generate.ServerError",
    "flashdraft.train.runs.RunError",
    "flashdraft.train.trainer.TrainingError",
    "flashdraft.train.features.FeaturesError",
}
_FILE_ERRORS = (FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError)


class UserError(Exception):
    """An expected failure; the message names the file / field / option and the fix, on one line."""


def debug_enabled() -> bool:
    return os.environ.get("FLASHDRAFT_DEBUG", "") not in ("", "0")


def _raised_by_flashdraft(e: BaseException) -> bool:
    """True when the innermost frame is a `raise` statement in a flashdraft module."""
    tb = e.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    filename = tb.tb_frame.f_code.co_filename
    if not str(Path(filename).resolve()).startswith(_PACKAGE):
        return False
    return linecache.getline(filename, tb.tb_lineno).lstrip().startswith("raise")


def is_expected(e: BaseException) -> bool:
    if isinstance(e, (UserError, UnicodeDecodeError, *_FILE_ERRORS)):
        return True
    if any(f"{c.__module__}.{c.__qualname__}" in _EXPECTED for c in type(e).__mro__):
        return True
    return type(e) is ValueError and _raised_by_flashdraft(e)


def one_line(e: BaseException) -> str:
    """The message of an expected failure as one line (a file error says which file)."""
    if isinstance(e, OSError) and e.filename is not None and e.strerror:
        text = f"{e.filename}: {e.strerror}"
    elif isinstance(e, UnicodeDecodeError):
        text = f"a file that should be UTF-8 text is not ({e}); run with --debug to see which"
    else:
        text = str(e) or type(e).__name__
    return " ".join(part.strip() for part in text.splitlines() if part.strip())
