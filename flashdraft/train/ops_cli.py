"""Training operations: `flashdraft features dump` and `flashdraft runs list|status|archive`.

flashdraft features dump --target default --dataset data/sharegpt --out features/sharegpt --layers 1,8,14,20,27
flashdraft runs list runs/
flashdraft runs status runs/smollm2-b16          # prints a handoff summary, writes RUN/STATUS.md
flashdraft runs archive runs/smollm2-b16         # RUN -> RUN.archived-<UTC time>
"""

from __future__ import annotations

from pathlib import Path

import typer

from flashdraft.errors import UserError

features_app = typer.Typer(
    help="Offline target features for training (pipeline.mode=offline).", no_args_is_help=True
)
runs_app = typer.Typer(help="Inspect and manage training run folders.", no_args_is_help=True)


@features_app.command("dump")
def features_dump(
    target: str = typer.Option("default", help="target: HF folder / hub id / .gguf / default"),
    dataset: str = typer.Option(..., help="a flashdraft dataset folder"),
    out: str = typer.Option(..., help="output folder (resumable: finished shards are skipped)"),
    layers: str = typer.Option(
        None, help="target layer ids, comma-separated (default: docs/method.md §2.2 for --drafter-layers)"
    ),
    drafter_layers: int = typer.Option(5, help="drafter depth, for the default layer choice"),
    split: str = typer.Option("train"),
    dtype: str = typer.Option("bfloat16", help="stored dtype: bfloat16, float16 or float32"),
    max_length: int = typer.Option(
        3072, help="must equal the training data.max_length for identical packing"
    ),
    token_budget: int = typer.Option(16384, help="as data.token_budget (the packing of the target pass)"),
    pad_multiple: int = typer.Option(64, help="as data.pad_multiple"),
    device: str = typer.Option("auto", help="auto: cuda if available"),
    target_dtype: str = typer.Option("auto", help="auto: bfloat16 on CUDA, float32 on CPU"),
    shard_mb: int = typer.Option(1024, help="feature megabytes per shard"),
    yes: bool = typer.Option(False, "--yes", help="write dumps larger than --confirm-gb without asking"),
    confirm_gb: float = typer.Option(10.0, help="dumps above this size need --yes"),
) -> None:
    """Write the target's raw selected-layer features [S, k·H] per sample (sharded safetensors)."""
    import sys

    import torch

    from flashdraft.data.dataset import open_dataset
    from flashdraft.drafter import build_target_layer_ids
    from flashdraft.target import load_target
    from flashdraft.train.features import FeaturesError, check_disk, dump_features, plan_dump

    try:
        ds = open_dataset(dataset, split)
    except (ValueError, FileNotFoundError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    dev = torch.device(
        "cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device)
    )
    dtypes = {"auto": torch.bfloat16 if dev.type == "cuda" else torch.float32, "bfloat16": torch.bfloat16,
              "float32": torch.float32, "float16": torch.float16}  # fmt: skip
    if target_dtype not in dtypes:
        raise UserError(f"--target-dtype {target_dtype!r}: use one of {', '.join(dtypes)}")
    tdt = dtypes[target_dtype]
    t = load_target(target, dtype=tdt, device=dev)
    layer_ids = (
        [int(x) for x in layers.split(",")]
        if layers
        else build_target_layer_ids(t.num_layers, drafter_layers)
    )
    try:
        plan = plan_dump(
            [int(n) for n in ds.lengths], layer_ids=layer_ids, hidden_size=t.hidden_size, dtype=dtype,
            max_length=max_length, token_budget=token_budget, pad_multiple=pad_multiple,
            shard_bytes=shard_mb * 1_000_000,
        )  # fmt: skip
        typer.echo(f"features dump: {plan.estimate_line()} -> {out}", err=True)  # before anything is written
        if plan.total_bytes > confirm_gb * 1e9 and not yes:
            typer.echo(
                f"error: the dump is larger than --confirm-gb {confirm_gb:g} GB: pass --yes to write it "
                "(or train online: pipeline.mode=online needs no disk)",
                err=True,
            )
            raise typer.Exit(2)
        check_disk(out, plan.total_bytes)
        meta = {"target": target, "dataset": str(dataset), "split": split}
        res = dump_features(t, ds, plan, out, meta=meta, progress=sys.stderr.isatty())
    except FeaturesError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"done: {res.written} shard(s) written, {res.skipped} already there; {res.out}")


@runs_app.command("list")
def runs_list(root: str = typer.Argument("runs", help="folder holding run folders")) -> None:
    """One line per run: name, state (running / finished / stopped / failed), step, last loss, τ proxy, last eval τ,
    age."""
    from flashdraft.train.runs import list_runs

    if not Path(root).is_dir():
        raise UserError(f"{root}: no such folder (give the folder that holds the run folders)")
    lines = list_runs(root)
    if not lines:
        typer.echo(f"no runs under {root}")
    for line in lines:
        typer.echo(line)


@runs_app.command("status")
def runs_status(run: str = typer.Argument(..., help="a run folder")) -> None:
    """Print a handoff summary of RUN (is it running, finished or stopped, and what --resume would lose; progress;
    every evaluated step) and write it to RUN/STATUS.md."""
    from flashdraft.train.runs import RunError, write_status

    try:
        text = write_status(run)
    except RunError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(text)


@runs_app.command("archive")
def runs_archive(run: str = typer.Argument(..., help="a run folder")) -> None:
    """Move RUN aside (RUN.archived-<UTC time>, one atomic rename) so its config can start fresh."""
    from flashdraft.train.runs import RunError, archive_run

    try:
        dest = archive_run(run)
    except RunError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"archived {run} -> {dest}")


def register(app: typer.Typer) -> None:
    app.add_typer(features_app, name="features")
    app.add_typer(runs_app, name="runs")
