"""`flashdraft generate`: one completion with speculative decoding, then a one-line summary.

flashdraft generate --drafter RUN --prompt "Write a haiku about rain" --chat
flashdraft generate --prompt "def fib(n):"                 # --method auto: AR, chain or a DDTree budget, by speed
flashdraft generate --prompt "def fib(n):" --method ddtree --budget 8     # default target + shipped drafter
flashdraft generate --method ar --prompt "Hello" --chat --temperature 0.7 --seed 1
flashdraft generate --target ./tiny --drafter ./tiny-drafter --prompt-ids 5,17,33   # no tokenizer needed
"""

from __future__ import annotations

from pathlib import Path

import typer


def resolve_drafter_path(path: str) -> Path:
    """A drafter folder, a checkpoint folder (…/step-N, holding drafter/) or a run folder (latest step)."""
    p = Path(path)
    if (p / "config.json").is_file():
        return p
    if (p / "drafter" / "config.json").is_file():
        return p / "drafter"
    steps = sorted((p / "checkpoints").glob("step-*/drafter/config.json"))
    if steps:
        return steps[-1].parent  # step folders are zero-padded: the last is the latest
    raise FileNotFoundError(
        f"{p}: not a drafter folder (no config.json), a checkpoint (no drafter/) or a run (no checkpoints/step-*)"
    )


def _stop_ids(tokenizer, model) -> list[int]:  # type: ignore[no-untyped-def]
    """The tokenizer's eos (and the generation config's, when it lists more)."""
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), tokenizer):
        eos = getattr(src, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list | tuple):
            ids.update(int(e) for e in eos)
    return sorted(ids)


def register(app: typer.Typer) -> None:
    @app.command()
    def generate(
        prompt: str | None = typer.Option(None, help="the prompt text"),
        prompt_ids: str | None = typer.Option(
            None, help="the prompt as comma-separated token ids (no tokenizer)"
        ),
        target: str = typer.Option("default", help="HF folder, hub-style id, .gguf path, or 'default'"),
        drafter: str | None = typer.Option(
            None,
            help="drafter folder, checkpoint folder, or run folder (latest); default target: the shipped one",
        ),
        chat: bool = typer.Option(False, "--chat", help="wrap the prompt in the tokenizer's chat template"),
        method: str = typer.Option(
            "auto", help="auto (the fastest of AR, chain and DDTree budgets here) | chain | ddtree | ar"
        ),
        budget: str | None = typer.Option(
            None, help="DDTree nodes excluding the root (method ddtree), or 'auto' (= --method auto)"
        ),
        tau_report: Path | None = typer.Option(
            None, help="--method auto: a `flashdraft eval` report.json giving the drafter's τ per budget"
        ),
        temperature: float = typer.Option(0.0, help="0 = greedy"),
        top_p: float = typer.Option(1.0),
        top_k: int = typer.Option(0, help="0 = off"),
        max_new_tokens: int = typer.Option(256),
        seed: int | None = typer.Option(None, help="sampling seed (T > 0)"),
        ignore_eos: bool = typer.Option(False, "--ignore-eos", help="do not stop at the tokenizer's eos"),
        dtype: str = typer.Option("float32", help="float32 | bfloat16 | float16 | float64"),
        device: str = typer.Option("cpu"),
        attn: str = typer.Option(
            "sdpa", help="target attention: sdpa | eager (ddtree cannot use flash-attention)"
        ),
        engine: str = typer.Option(
            "auto",
            help="auto (the CUDA-graph engine on CUDA, the reference decoder on CPU) | fast | reference",
        ),
        compile: bool = typer.Option(
            False, "--compile", help="fast engine: forwards through torch.compile (bf16 near-ties may vary)"
        ),
        graph_prefill: bool = typer.Option(
            False, "--graph-prefill", help="fast engine on CUDA: each prompt's prefill as a CUDA graph"
        ),
    ) -> None:
        """Generate one completion with DFlash speculative decoding and print a summary line."""
        import torch

        from flashdraft.decode.backend import check_engine_name, pick_engine
        from flashdraft.decode.generate import METHODS
        from flashdraft.drafter import DFlashDrafter
        from flashdraft.target import check_pair, load_target

        try:
            check_engine_name(engine)
        except ValueError as e:
            raise typer.BadParameter(str(e).removeprefix("--engine "), param_hint="--engine") from None
        if budget == "auto":
            method, budget = "auto", None
        if budget is not None and not budget.isdigit():
            raise typer.BadParameter(f"--budget {budget!r}: a node count or 'auto'", param_hint="--budget")
        n_budget = int(budget) if budget is not None else None
        if method not in METHODS:
            raise typer.BadParameter(
                f"unknown method {method!r}: use one of {', '.join(METHODS)}", param_hint="--method"
            )
        if (prompt is None) == (prompt_ids is None):
            raise typer.BadParameter("give exactly one of --prompt and --prompt-ids")
        if method == "ddtree" and budget is None:
            raise typer.BadParameter("--method ddtree needs --budget N (tree nodes excluding the root)")
        if method != "ar" and drafter is None:
            from flashdraft.target import shipped_drafter

            shipped = shipped_drafter(target)  # the default target's drafter from models/, when present
            if shipped is None and method == "auto":
                method = "ar"  # nothing to draft with: auto is AR
            elif shipped is None:
                raise typer.BadParameter(f"--method {method} needs --drafter (or use --method ar)")
            else:
                drafter = str(shipped)
        # a bad target, drafter or pair is a one-line error (flashdraft/cli.py's handler)
        t = load_target(target, dtype=dtype, device=device, attn_implementation=attn)
        d = None
        if method != "ar":
            assert drafter is not None
            d = DFlashDrafter.from_pretrained(resolve_drafter_path(drafter), dtype=t.dtype, device=t.device)
            check_pair(t, d.config)
        tok = t.tokenizer
        if prompt_ids is not None:
            try:
                ids = torch.tensor([int(x) for x in prompt_ids.split(",") if x.strip()])
            except ValueError:
                raise typer.BadParameter(
                    f"--prompt-ids {prompt_ids!r}: expected comma-separated integers"
                ) from None
            vocab = t.vocab_size
            bad = next((int(x) for x in ids if not 0 <= int(x) < vocab), None)
            if bad is not None:  # the server answers the same with a 400
                raise typer.BadParameter(
                    f"prompt token id {bad} is outside the vocabulary (0..{vocab - 1})",
                    param_hint="--prompt-ids",
                )
        else:
            if tok is None:
                raise typer.BadParameter(f"target {target!r} has no tokenizer: pass --prompt-ids")
            if chat:
                ids = tok.apply_chat_template(
                    [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt",
                    return_dict=True,
                )["input_ids"][0]  # fmt: skip
            else:
                ids = tok(prompt, return_tensors="pt")["input_ids"][0]
        stop = [] if ignore_eos or tok is None else _stop_ids(tok, t.model)
        try:
            # the same signature, token-identical
            engine_name, run_generate = pick_engine(t, engine, compile, graph_prefill)
        except ValueError as e:
            raise typer.BadParameter(str(e)) from None
        policy = None
        if method == "auto":
            from flashdraft.decode.budget import auto_policy

            policy = auto_policy(
                t, d, run_generate, engine=engine_name, tau_report=tau_report,
                report_drafter=str(resolve_drafter_path(drafter)) if drafter else None,
            )  # fmt: skip
        res = run_generate(
            t, d, ids, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
            method=method, budget=n_budget, stop_token_ids=stop, seed=seed, policy=policy,
        )  # fmt: skip
        if tok is not None:
            typer.echo(tok.decode(res.tokens, skip_special_tokens=True))
        else:
            typer.echo(" ".join(str(x) for x in res.tokens))
        label = f"ddtree-{n_budget}" if method == "ddtree" else method
        if policy is not None:  # the methods auto ran, in order
            label = f"auto: {' → '.join(policy.history)}"
        typer.echo(
            f"[{label}] {len(res.tokens)} tokens, {res.rounds} rounds, mean τ {res.mean_acceptance:.2f}, "
            f"{res.tokens_per_second:.1f} tok/s, stop: {res.stop_reason} (prompt {res.prompt_tokens} tokens)",
            err=True,
        )
