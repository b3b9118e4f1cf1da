"""The `flashdraft` command. Each area registers its own subcommands; imports stay lazy so
`flashdraft --help` does not load torch.

    flashdraft info
    flashdraft --help
"""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
    name="flashdraft",
    help="Train, evaluate and serve DFlash drafters for lossless speculative decoding.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)



@app.callback()
def _root() -> None:
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
