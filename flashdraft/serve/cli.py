"""`flashdraft serve` (OpenAI-compatible server) and `flashdraft export` (a clean DFlash checkpoint).

flashdraft serve                                          # default target + shipped drafter on 127.0.0.1:8000
flashdraft serve --drafter RUN/checkpoints/step-00001000/drafter --method ddtree --budget 8 --api-key KEY
flashdraft export RUN --to out/my-drafter --dtype bfloat16 --target HuggingFaceTB/SmolLM2-135M-Instruct [--overwrite]
"""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    @app.command()
    def serve(
        target: str = typer.Option(
            "default", help="HF folder, hub-style id, .gguf path, or 'default' (SmolLM2)"
        ),
        drafter: str | None = typer.Option(
            None,
            help="DFlash drafter folder; 'none' serves plain AR; default: the shipped drafter if present",
        ),
        method: str = typer.Option(
            "auto", help="auto (the fastest of AR, chain and DDTree budgets here) | chain | ddtree | ar"
        ),
        budget: str | None = typer.Option(
            None, help="DDTree budget (tree nodes, root excluded), or 'auto' (= --method auto)"
        ),
        host: str = typer.Option("127.0.0.1", help="bind address; localhost by default"),
        port: int = typer.Option(8000),
        api_key: str | None = typer.Option(
            None,
            envvar="FLASHDRAFT_API_KEY",
            help="require 'Authorization: Bearer KEY' on /v1/* and /metrics",
        ),
        max_queue: int = typer.Option(
            16, help="waiting requests beyond the one being generated; more get 429"
        ),
        timeout: float = typer.Option(120.0, help="seconds per request, queueing included; then 504"),
        max_body_bytes: int = typer.Option(1 << 20, help="larger request bodies get 413"),
        max_tokens_cap: int = typer.Option(4096, help="largest max_tokens a client may ask for"),
        model_name: str | None = typer.Option(
            None, help="the model id clients send (default: from --target)"
        ),
        device: str = typer.Option("cpu"),
        dtype: str = typer.Option("float32", help="float32 | bfloat16 | float16 | float64"),
        engine: str = typer.Option(
            "auto", help="auto (CUDA-graph engine on CUDA, reference decoder on CPU) | fast | reference"
        ),
        compile: bool = typer.Option(
            False, "--compile", help="fast engine: forwards through torch.compile (bf16 near-ties may vary)"
        ),
        graph_prefill: bool = typer.Option(
            False, "--graph-prefill", help="fast engine on CUDA: each prompt's prefill as a CUDA graph"
        ),
        threads: int | None = typer.Option(
            None,
            help="CPU threads for torch (on a shared CPU, 1 avoids OpenMP threads spinning against each other)",
        ),
    ) -> None:
        """Serve the target with speculative decoding behind an OpenAI-compatible HTTP API."""
        import logging

        import torch

        if threads:
            torch.set_num_threads(threads)

        try:
            from flashdraft.serve.app import AppSettings, create_app
        except ImportError as e:  # fastapi/uvicorn are optional (absent on the GPU machine)
            raise typer.BadParameter(
                f"flashdraft serve needs fastapi and uvicorn ({e.name} is missing): pip install 'flashdraft[serve]'"
            ) from None
        from flashdraft.serve.protocol import Limits
        from flashdraft.serve.server import ServeOptions, build_engine, serve_forever

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        if budget == "auto":
            method, budget = "auto", None
        if budget is not None and not budget.isdigit():
            raise typer.BadParameter(f"--budget {budget!r}: a node count or 'auto'", param_hint="--budget")
        opts = ServeOptions(
            target=target,
            drafter=drafter,
            method=method,
            budget=int(budget) if budget is not None else None,
            device=device,
            dtype=dtype,
            model_id=model_name,
            max_queue=max_queue,
            timeout=timeout,
            limits=Limits(max_tokens_cap=max_tokens_cap),
            engine=engine,
            compile=compile,
            graph_prefill=graph_prefill,
        )
        try:
            engine = build_engine(opts)
        except (ValueError, FileNotFoundError) as e:
            raise typer.BadParameter(str(e)) from None
        s = engine.settings
        typer.echo(
            f"serving {s.model_id!r} with method {s.method}"
            + (f" budget {s.budget}" if s.budget else "")
            + f" on http://{host}:{port}/v1"
            + (" (API key required)" if api_key else "")
        )
        app = create_app(engine, AppSettings(api_key=api_key, max_body_bytes=max_body_bytes))
        serve_forever(engine, app, host, port)

    @app.command()
    def export(
        source: str = typer.Argument(
            ..., help="a DFlash checkpoint folder, a run folder, or a run's step folder"
        ),
        to: str = typer.Option(..., "--to", help="output folder: new or empty, or replaced with --overwrite"),
        overwrite: bool = typer.Option(
            False,
            "--overwrite",
            help="replace a non-empty --to folder (atomically: the new one is swapped in whole)",
        ),
        dtype: str = typer.Option("bfloat16", help="bfloat16 | float16 | float32"),
        target: str | None = typer.Option(
            None,
            help="the target (folder, hub id, .gguf or 'default'): its tokenizer gives the mask token's string, "
            "its name goes into the README launch commands (default: from the run config)",
        ),
    ) -> None:
        """Write a DFlash checkpoint that SGLang, vLLM and transformers load unchanged, and verify it."""
        from flashdraft.serve.export import export_drafter

        try:
            res = export_drafter(source, to, dtype=dtype, target=target, overwrite=overwrite)
        except (ValueError, FileNotFoundError, FileExistsError) as e:
            raise typer.BadParameter(str(e)) from None
        typer.echo(f"exported {res.source} -> {res.dest} ({res.dtype}, {res.num_parameters:,} parameters)")
        typer.echo(f"verified: reloaded outputs identical at {res.dtype} (max |diff| {res.max_abs_diff})")
        if res.mask_token is None:
            typer.echo(
                "warning: the target's tokenizer has no string for the mask token id: SGLang cannot serve "
                "this drafter (vLLM, transformers and flashdraft can)"
            )
        typer.echo(f"launch commands for SGLang / vLLM: {res.dest / 'README.md'}")
