"""The `flashdraft` command. Each area registers its own subcommands; imports stay lazy so
`flashdraft --help` does not load torch.

    flashdraft info
    flashdraft --help
    flashdraft --debug eval --drafter runs/x      # a failure shows its traceback (or FLASHDRAFT_DEBUG=1)

Every command's expected failures (flashdraft/errors.py) print one line, `error: ...`, and exit 2;
usage errors too. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import importlib
from typing import Any

import typer
from typer.core import TyperGroup

from flashdraft.errors import debug_enabled, is_expected, one_line


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def _is_click(e: BaseException, name: str) -> bool:
    """By class name: typer >= 0.2x vendors click (typer._click), older typer uses click itself."""
    return any(c.__name__ == name for c in type(e).__mro__)


class _OneLineErrors(TyperGroup):
    """The one handler: every subcommand runs inside `invoke`, so this is where failures become one line."""

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except (typer.Exit, typer.Abort):
            raise
        except Exception as e:
            if _is_click(e, "NoArgsIsHelpError"):  # `flashdraft data` alone: click prints the help
                raise
            # a command's own check (no option named), worded for the user already
            unnamed = getattr(e, "param", None) is None and getattr(e, "param_hint", None) is None
            if _is_click(e, "BadParameter") and unnamed:
                _fail(" ".join(e.message.split()))
            # a bad option or argument: click's message, then where the help is
            if _is_click(e, "UsageError"):
                sub = getattr(e, "ctx", None) or ctx
                _fail(f"{' '.join(e.format_message().split())} (see '{sub.command_path} --help')")
            if _is_click(e, "ClickException"):
                _fail(" ".join(e.format_message().split()))
            if ctx.params.get("debug") or debug_enabled() or not is_expected(e):
                raise
            _fail(one_line(e))


app = typer.Typer(
    name="flashdraft",
    help="Train, evaluate and serve DFlash drafters for lossless speculative decoding.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    cls=_OneLineErrors,
)


@app.callback()
def _root(
    debug: bool = typer.Option(
        False, "--debug", help="show the traceback of a failure (also: FLASHDRAFT_DEBUG=1)"
    ),
) -> None:
    """Train, evaluate and serve DFlash drafters for lossless speculative decoding."""


# each module defines `register(app)`; the order is the order of the data flow
_AREAS = [
    "flashdraft.info_cli",
    "flashdraft.data.cli",
    "flashdraft.train.cli",
    "flashdraft.train.ops_cli",  # features dump, runs list/status/archive
    "flashdraft.eval.cli",
    "flashdraft.decode.cli",
    "flashdraft.serve.cli",
    "flashdraft.quickstart",
]

for _mod in _AREAS:
    try:
        _m = importlib.import_module(_mod)
    except ModuleNotFoundError as _e:  # an area not built yet must not break the others
        if _e.name != _mod:
            raise
        continue
    _m.register(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
