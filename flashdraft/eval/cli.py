"""`flashdraft eval` (offline τ, side by side, `--watch` a live run) and `flashdraft bench` (speed).

    flashdraft eval --drafter runs/x --drafter models/z-lab-b16 --dataset humaneval --limit 32
    flashdraft eval --drafter runs/x/checkpoints/step-00002000 --budgets 8,32,128 --topk 8 --out out/eval
    flashdraft eval --watch runs/x --dataset sharegpt-heldout --limit 32 --poll 120
    flashdraft eval --watch runs/x --once --threads 4 --nice 0    # what is there now, as a table
    flashdraft bench --drafter runs/x --dataset humaneval --limit 8 --methods ar,chain,ddtree:16,ddtree:64

Both run on CPU by default, so an evaluator can sit beside a training job that owns the GPUs.
Imports of torch and friends stay inside the commands (`flashdraft --help` stays fast).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import typer

from flashdraft.errors import UserError

if TYPE_CHECKING:
    from flashdraft.eval.evaluate import ReusableReport


def _ints(text: str, flag: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"{flag} must be comma-separated integers, got {text!r}") from None
    if any(v <= 0 for v in vals):
        raise typer.BadParameter(f"{flag} values must be > 0, got {text!r}")
    return vals


def _fail(msg: str) -> NoReturn:
    raise UserError(msg)  # one line, exit 2 (flashdraft/cli.py); --debug shows where


def _name_tail(folder: Path, step: int | None, k: int) -> str:
    """The last k components that name the drafter at `folder`: a run's checkpoint
    (RUN/checkpoints/step-N/drafter) is RUN@step-N; a folder called `drafter` (flashdraft's layout name, not
    a model's) is named with its parent too (`stage/drafter`, not `stage`, which says nothing alone)."""
    parts = folder.resolve().parts[1:]  # without the root
    if step is not None and folder.name == "drafter" and len(parts) >= 4 and parts[-3] == "checkpoints":
        return "/".join(parts[:-3][-k:]) + f"@step-{step}"
    k += folder.name == "drafter"
    return "/".join(parts[-k:])


def drafter_names(found: list[tuple[Path, int | None]]) -> list[str]:
    """Row names of the drafters compared side by side: for each, the shortest tail of its path that no
    other drafter shares (`a/stage/drafter` and `b/stage/drafter` stay apart); the same folder given twice
    gets #2."""
    ks = [1] * len(found)
    names = [_name_tail(f, s, 1) for f, s in found]
    where = [(f.resolve(), s) for f, s in found]
    while True:
        # names two different drafters share
        dup = [
            i
            for i, n in enumerate(names)
            if any(m == n and w != where[i] for m, w in zip(names, where, strict=True))
        ]
        grown = [i for i in dup if _name_tail(*found[i], ks[i] + 1) != names[i]]
        if not grown:
            break
        for i in grown:
            ks[i] += 1
            names[i] = _name_tail(*found[i], ks[i])
    out: list[str] = []
    for n in names:
        name, i = n, 2
        while name in out:
            name, i = f"{n}#{i}", i + 1
        out.append(name)
    return out


def _reusable_report(path: Path) -> ReusableReport:
    """`--reuse FILE`: an earlier eval's report.json, read as data (never unpickled)."""
    import json

    from flashdraft.eval.evaluate import ReusableReport  # torch, only when the command runs

    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        _fail(f"--reuse {path}: not a readable report.json ({e})")
    if not isinstance(report, dict) or not isinstance(report.get("drafters"), dict):
        _fail(f"--reuse {path}: not a `flashdraft eval` report (no 'drafters')")
    return ReusableReport(str(path), report)


def register(app: typer.Typer) -> None:
    @app.command("eval")
    def eval_cmd(
        drafter: list[Path] = typer.Option(
            [],
            "--drafter",
            help="drafter folder, checkpoint folder, or run folder (newest checkpoint); repeat to compare",
        ),
        target: str = typer.Option(
            "default", help="HF folder, hub-style id, .gguf path, or 'default' (SmolLM2)"
        ),
        dataset: str = typer.Option(
            "humaneval", help="humaneval | sharegpt-heldout | a regenerated dataset folder | a prompts file"
        ),
        limit: int | None = typer.Option(None, help="evaluate the first N prompts"),
        max_new_tokens: int = typer.Option(256, help="reference length (published DFlash numbers use 2048)"),
        budgets: str = typer.Option("8,16,32,64,128,256,512", help="DDTree budgets (nodes, root excluded)"),
        topk: str = typer.Option("8", help="top-k streak widths (comma-separated; '' for none)"),
        temperature: float = typer.Option(
            0.0, help="0 = greedy references (exact τ); > 0 = seeded samples (batched: one seed per prompt set)"
        ),
        seed: int = typer.Option(0, help="base seed of sampled references"),
        device: str = typer.Option("cpu", help="cpu | cuda"),
        dtype: str = typer.Option("float32", help="target and drafter dtype"),
        out: Path | None = typer.Option(None, help="report folder (default eval-reports/<dataset>)"),
        watch: Path | None = typer.Option(
            None, help="a run folder: evaluate each new checkpoint as it appears"
        ),
        poll: float = typer.Option(60.0, help="--watch polling interval, seconds"),
        once: bool = typer.Option(
            False, help="--watch: evaluate the checkpoints present now, print the table, exit"
        ),
        keep_watching: bool = typer.Option(
            False, help="--watch: keep polling after the run is finished and every checkpoint is evaluated"
        ),
        threads: int | None = typer.Option(
            None, help="torch threads (default: all; with --watch on CPU a quarter of the cores)"
        ),
        nice: int | None = typer.Option(
            None, help="lower this process's priority by N (default: 0; with --watch on CPU 10)"
        ),
        server: str | None = typer.Option(
            None, help="OpenAI-compatible base URL for references, e.g. http://h:30000/v1"
        ),
        server_model: str | None = typer.Option(None, help="model name on --server"),
        concurrency: int = typer.Option(8, help="--server requests in flight"),
        ref_batch: int | None = typer.Option(
            None,
            "--ref-batch",
            help="rows per batched reference generation; 1 = exact single-sequence AR, or at T > 0 a sample "
            "seeded per prompt (default: 16 on CPU, 256 on CUDA through the batched native engine)",
        ),
        cache_dir: Path | None = typer.Option(
            None, help="reference cache (default ~/.cache/flashdraft/references)"
        ),
        references: Path | None = typer.Option(
            None,
            "--references",
            help="a frozen reference file (benchmarks/yardstick/*.jsonl): its prompts "
            "and tokens, checked against this target and cut at the first disagreement (replaces --dataset)",
        ),  # fmt: skip
        ref_engine: str | None = typer.Option(
            None,
            "--ref-engine",
            help="batched references: loop | native (default: native on CUDA, loop on CPU)",
        ),
        reuse: list[Path] = typer.Option(
            [],
            "--reuse",
            help="an earlier report.json (repeatable): a drafter it scored with the same weights (sha256), "
            "references and settings is not replayed, its results are taken from there (greedy evals)",
        ),
        group: int = typer.Option(
            16, help="references replayed together, their drafter passes packed into one forward (speed only)"
        ),
        progress: bool = typer.Option(True, help="progress bars"),
    ) -> None:
        """Offline τ (chain, DDTree budgets, top-k streak) of one or more drafters, side by side."""

        from flashdraft.drafter import DFlashDrafter
        from flashdraft.eval.evaluate import evaluate
        from flashdraft.eval.prompts import load_eval_prompts
        from flashdraft.eval.references import ServerConfig
        from flashdraft.eval.report import markdown_table, write_report
        from flashdraft.eval.watch import WatchResources, resolve_drafter, watch_table
        from flashdraft.eval.watch import watch as watch_run
        from flashdraft.target import _parse_dtype, check_pair, load_target

        if not drafter and watch is None:
            _fail("give --drafter PATH (repeatable) or --watch RUN_DIR")
        if ref_batch is not None and ref_batch < 1:
            _fail(f"--ref-batch {ref_batch} must be >= 1 (1 = exact single-sequence AR)")
        if group < 1:
            _fail(f"--group {group} must be >= 1")
        if ref_engine is not None and ref_engine not in ("loop", "native"):
            _fail(f"--ref-engine {ref_engine!r}: use loop or native")
        b_list, k_list = _ints(budgets, "--budgets"), _ints(topk, "--topk") if topk.strip() else []
        reusable = [_reusable_report(f) for f in reuse]  # before the target loads: a bad file fails at once
        try:  # before the target loads: beside a run on CPU the evaluator yields the cores to the trainer
            resources = WatchResources.resolve(device, threads, nice, watching=watch is not None)
        except ValueError as e:
            _fail(str(e))
        resources.apply()
        torch_dtype = _parse_dtype(dtype)
        found = []
        for p in drafter:
            try:
                found.append(resolve_drafter(p))
            except FileNotFoundError as e:
                _fail(str(e))
        resolved = [(name, folder) for name, (folder, _) in zip(drafter_names(found), found, strict=True)]
        t = load_target(target, dtype=torch_dtype, device=device)
        models: dict[str, DFlashDrafter] = {}
        for name, folder in resolved:
            try:
                d = DFlashDrafter.from_pretrained(folder, dtype=torch_dtype, device=device)
                check_pair(t, d.config)
            except (ValueError, FileNotFoundError) as e:
                _fail(f"drafter {folder}: {e}")
            models[name] = d
        frozen = None
        if references is not None:
            from flashdraft.eval.prompts import EvalPrompt
            from flashdraft.eval.references import read_frozen

            try:
                frozen = read_frozen(references, limit)
            except (ValueError, FileNotFoundError) as e:
                _fail(str(e))
            if max_new_tokens > frozen.max_new_tokens or temperature != 0:
                _fail(f"{references} holds greedy references of {frozen.max_new_tokens} tokens: use "
                      f"--temperature 0 and --max-new-tokens {frozen.max_new_tokens} or less")  # fmt: skip
            prompts = [EvalPrompt(r.id, r.prompt_ids, r.template) for r in frozen.references]
            dataset = references.stem
        else:
            prompts = load_eval_prompts(dataset, t, limit)
        srv = ServerConfig(server, server_model, concurrency) if server else None
        kwargs = dict(
            budgets=b_list, topk=k_list, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
            cache_dir=cache_dir, server=srv, ref_batch=ref_batch, dataset=dataset, progress=progress,
            ref_engine=ref_engine, frozen=frozen, reuse=reusable, group=group,
        )  # fmt: skip

        if watch is not None:

            def one(folder: Path, name: str):  # type: ignore[no-untyped-def]
                d = DFlashDrafter.from_pretrained(folder, dtype=torch_dtype, device=device)
                check_pair(t, d.config)
                return evaluate(t, {name: d}, prompts, drafter_paths={name: str(folder)}, **kwargs)

            typer.echo(
                f"watching {watch} (poll {poll:g}s, {resources.describe()}); "
                f"results in {watch / 'eval' / 'log.jsonl'}"
            )
            res = watch_run(watch, one, poll_s=poll, once=once, keep_watching=keep_watching, echo=typer.echo)
            if res.skipped:
                typer.echo(
                    f"skipped steps {res.skipped} (deleted by the trainer's keep_last before evaluation)"
                )
            if once or res.finished:
                typer.echo(("run finished; " if res.finished else "") + f"{watch / 'eval' / 'log.jsonl'}:")
                typer.echo(watch_table(watch))
            return
        report = evaluate(t, models, prompts, drafter_paths={n: str(f) for n, f in resolved}, **kwargs)
        files = write_report(report, out or Path("eval-reports") / Path(dataset).name)
        typer.echo(markdown_table(report))
        typer.echo(f"report: {files.json} {files.markdown} " + " ".join(str(p) for p in files.plots))

    @app.command("bench")
    def bench_cmd(
        drafter: Path | None = typer.Option(
            None, help="drafter, checkpoint or run folder (omit for AR only)"
        ),
        target: str = typer.Option("default", help="HF folder, hub-style id, .gguf path, or 'default'"),
        dataset: str = typer.Option(
            "humaneval", help="humaneval | sharegpt-heldout | dataset folder | prompts file"
        ),
        limit: int = typer.Option(8, help="prompts to generate for"),
        methods: str = typer.Option(
            "ar,chain,ddtree:16,ddtree:64", help="ar, chain, ddtree:N, auto (comma-separated)"
        ),
        max_new_tokens: int = typer.Option(128),
        temperature: float = typer.Option(0.0),
        device: str = typer.Option("cpu", help="cpu | cuda"),
        dtype: str = typer.Option("float32"),
        engine: str = typer.Option("auto", help="auto (fast on CUDA) | reference | fast"),
        compile: bool = typer.Option(
            False, "--compile", help="fast engine: forwards through torch.compile (bf16 near-ties may vary)"
        ),
        graph_prefill: bool = typer.Option(
            False, "--graph-prefill", help="fast engine on CUDA: each prompt's prefill as a CUDA graph"
        ),
        warmup: int = typer.Option(1, help="untimed runs per method before timing"),
        tau_report: Path | None = typer.Option(
            None, help="method auto: a `flashdraft eval` report.json giving the drafter's τ per budget"
        ),
        out: Path | None = typer.Option(None, help="write bench.json / bench.md here"),
        progress: bool = typer.Option(True),
    ) -> None:
        """Real generation speed: time per output token, tokens/s, speedup over AR, τ."""
        from flashdraft.drafter import DFlashDrafter
        from flashdraft.eval.bench import bench, bench_table
        from flashdraft.eval.prompts import load_eval_prompts
        from flashdraft.eval.report import atomic_write_text
        from flashdraft.eval.watch import resolve_drafter
        from flashdraft.target import _parse_dtype, check_pair, load_target

        torch_dtype = _parse_dtype(dtype)
        t = load_target(target, dtype=torch_dtype, device=device)
        d, dname = None, ""
        if drafter is not None:
            try:
                folder, _ = resolve_drafter(drafter)
                d = DFlashDrafter.from_pretrained(folder, dtype=torch_dtype, device=device)
                check_pair(t, d.config)
            except (ValueError, FileNotFoundError) as e:
                _fail(f"drafter {drafter}: {e}")
            dname = str(folder)
        prompts = load_eval_prompts(dataset, t, limit)
        try:
            report = bench(
                t, d, prompts, methods=methods, max_new_tokens=max_new_tokens, temperature=temperature,
                engine=engine, warmup=warmup, dataset=dataset, drafter_name=dname, progress=progress,
                tau_report=str(tau_report) if tau_report else None, compile=compile, graph_prefill=graph_prefill,
            )  # fmt: skip
        except ValueError as e:
            _fail(str(e))
        table = bench_table(report)
        typer.echo(table)
        if out is not None:
            import json

            atomic_write_text(out / "bench.json", json.dumps(report.to_dict(), indent=1) + "\n")
            atomic_write_text(out / "bench.md", table)
            typer.echo(f"report: {out / 'bench.json'} {out / 'bench.md'}")
