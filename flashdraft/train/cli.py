"""`flashdraft train CONFIG [key=value ...] [--resume]`: train a drafter (see flashdraft/train/launch.py).

flashdraft train configs/smollm2-b16.yaml
flashdraft train configs/smollm2-b16.yaml optim.max_steps=200 run_dir=runs/try --resume
kill -USR1 <pid>      # write a checkpoint of the live weights at the next step
kill -TERM <pid>      # (or Ctrl-C) write a checkpoint at the next step, then exit 143 (130); again: exit at once
"""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    @app.command(context_settings={"allow_extra_args": False})
    def train(
        config: str = typer.Argument(..., help="a TrainConfig YAML file (see configs/)"),
        overrides: list[str] = typer.Argument(None, help="key=value overrides, e.g. optim.lr=3e-4"),
        resume: bool = typer.Option(
            False, "--resume", help="continue exactly from the run's latest checkpoint"
        ),
    ) -> None:
        """Train a DFlash drafter on the target's own responses (docs/method.md §7)."""
        import shlex
        import signal
        import sys

        if hasattr(signal, "SIGUSR1"):  # never fatal: ignored around the training's own handler (lifecycle.py)
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        from flashdraft.config import ConfigError, load_config
        from flashdraft.train.config import TrainConfig
        from flashdraft.train.launch import train as run_training
        from flashdraft.train.trainer import TrainingError

        try:
            cfg = load_config(TrainConfig, config, list(overrides or []))
            result = run_training(cfg, resume=resume, command=shlex.join(["flashdraft", *sys.argv[1:]]))
        except (ConfigError, TrainingError) as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(1) from None
        if result.stopped in ("SIGINT", "SIGTERM"):
            typer.echo(
                f"stopped by {result.stopped} at step {result.steps}: checkpoint {result.last_checkpoint}; "
                "continue with --resume",
                err=True,
            )
            raise typer.Exit(128 + getattr(signal, result.stopped))
        typer.echo(
            f"done: {result.steps} steps, epoch {result.epoch} ({result.stopped}); "
            f"checkpoint {result.last_checkpoint}"
        )
