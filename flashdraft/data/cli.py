"""`flashdraft data …`: regenerate a training set with the target, inspect it, list sources.

flashdraft data regenerate --input sharegpt --limit 4 --max-length 512 --max-new-tokens 32 --out /tmp/regen-demo
flashdraft data inspect /tmp/regen-demo
flashdraft data merge --out data/all data/turn1 data/turns2
flashdraft data pack data/all --out all.fdpack && flashdraft data unpack all.fdpack --out data/all-again
flashdraft data self-prompts --n 2000 --out self.jsonl.gz   # then: regenerate --input prompts:self.jsonl.gz
flashdraft data sources
"""

from __future__ import annotations

from typing import Any

import typer


def _local_generator(
    target: str, dtype: str, device: str, engine: str, attention: str, batch_size: int, max_batch_tokens: int | None,
    loop_groups: int, thinking: bool | None, max_new_tokens: int, temperature: float, top_p: float,
) -> tuple[Any, Any, str, str]:  # fmt: skip
    """(the target's chat template, a LocalGenerator on it, the engine and the attention it resolved to)."""
    from flashdraft.data.generate import GenerationParams, LocalGenerator
    from flashdraft.data.template import ChatTemplate, stop_token_ids
    from flashdraft.target import load_target

    t = load_target(target, dtype=dtype, device=device)
    if t.tokenizer is None:
        raise typer.BadParameter(f"target {target!r} has no tokenizer: cannot render chat templates")
    tpl = ChatTemplate(
        t.tokenizer,
        enable_thinking=thinking,
        stop_ids=stop_token_ids(t.tokenizer, getattr(t.model, "generation_config", None)),
    )
    params = GenerationParams(max_new_tokens, temperature, top_p, tpl.stop_ids)
    if engine == "auto":
        from flashdraft.data.native import native_support_error

        engine = "native" if t.device.type == "cuda" and not native_support_error(t) else "loop"
    groups = loop_groups or (5 if t.device.type == "cpu" else 1)
    if engine == "native":  # resolved here so the manifest says which ran
        from flashdraft.data.native import decode_attention

        try:
            attention = decode_attention(t, attention)
        except ValueError as e:
            raise typer.BadParameter(f"--{e}") from None
    gen = LocalGenerator(
        t, params, engine=engine, batch_size=batch_size, max_batch_tokens=max_batch_tokens, groups=groups,
        attention=attention,
    )  # fmt: skip
    return tpl, gen, engine, attention


def register(app: typer.Typer) -> None:
    data = typer.Typer(
        help="Training data: regenerate responses with the target, merge and inspect datasets.",
        no_args_is_help=True,
    )
    app.add_typer(data, name="data")

    @data.command()
    def regenerate(
        out: str = typer.Option(
            ..., "--out", help="dataset folder to write (OUT.partial/ holds resumable shards)"
        ),
        input: list[str] = typer.Option(
            ["sharegpt"], "--input", help="source name, NAME:PATH or a file; repeatable"
        ),
        target: str = typer.Option("default", help="HF folder, hub-style id, .gguf path, or 'default'"),
        max_new_tokens: int = typer.Option(1024, help="per response"),
        temperature: float = typer.Option(0.0, help="0 = greedy"),
        top_p: float = typer.Option(1.0),
        thinking: bool | None = typer.Option(
            None, "--thinking/--no-thinking", help="template's enable_thinking; unset: its default"
        ),
        batch_size: int = typer.Option(64, help="rows per generation batch (raise on a GPU: 512+)"),
        max_batch_tokens: int | None = typer.Option(
            None,
            help="cap rows × (prompt + max_new_tokens) per batch: its KV cache in tokens (native engine: prompt = "
            "--max-length; layers × 2 × kv_heads × head_dim × dtype bytes a token, 23,040 B for SmolLM2-135M in bf16)",
        ),
        limit: int | None = typer.Option(None, help="use only the first N conversations"),
        skip: int = typer.Option(
            0, min=0, help="pass over the inputs' first N conversations as read (before dedup): a later slice"
        ),
        shard_size: int = typer.Option(512, help="conversations per resumable shard"),
        split_turns: bool = typer.Option(False, "--split-turns", help="one sample per answered user turn"),
        max_turns: int | None = typer.Option(
            None,
            min=1,
            help="answer only each conversation's first N user turns (1: the most distinct prompts "
            "per GPU minute: no history to prefill)",
        ),
        continue_from: list[str] = typer.Option(
            [],
            "--continue-from",
            help="dataset (repeatable) whose answers of each conversation's first turns are its history: only the "
            "conversations it answered from turn 0 are continued, from their first unanswered turn",
        ),
        max_length: int = typer.Option(3072, help="tokens per sample"),
        block_size: int = typer.Option(16, help="drafter block size B: samples keep >= 2·B loss tokens"),
        eval_fraction: float = typer.Option(0.02, help="held-out fraction (hash of the conversation id)"),
        device: str = typer.Option("cpu"),
        dtype: str = typer.Option("float32"),
        engine: str = typer.Option(
            "auto",
            help="'native' (continuous batching over a static KV cache; Llama/Qwen/Mistral), 'loop' (batched loop "
            "over transformers' forward), or 'auto': native on CUDA where the family allows, else loop",
        ),
        attention: str = typer.Option(
            "auto",
            help="native engine's decode-step attention: 'varlen' (flash attention, each row reads only its own "
            "cache; CUDA, bf16/fp16), 'sdpa' (one mask over the longest row), or 'auto': varlen where it runs",
        ),
        loop_groups: int = typer.Option(
            0,
            min=0,
            help="loop engine, greedy, Llama family: batches decoded together, the same ids as one at a time "
            "(flashdraft/data/grouped.py); 0 = auto: 5 on CPU, 1 elsewhere",
        ),  # fmt: skip
        server: str | None = typer.Option(None, help="OpenAI-compatible server URL: generate there instead"),
        server_model: str | None = typer.Option(None, help="model name on the server (default: its first)"),
        concurrency: int = typer.Option(64, help="client mode: requests in flight"),
        retries: int = typer.Option(5, help="client mode: retries per request"),
        max_bad_fraction: float = typer.Option(0.1, help="stop when more input records than this are bad"),
        contamination: list[str] = typer.Option(
            ["humaneval"], help="eval sources whose word 13-grams drop training samples; 'none' to disable"
        ),
        seed: int = typer.Option(0),
        time_limit: float | None = typer.Option(
            None,
            help="minutes: greedy native runs stop then, keeping the finished shards and the turns the others had "
            "answered; other runs start no shard that would end after it (forecast: the slowest shard so far); "
            "the dataset's manifest says complete: false; rerun with --overwrite to finish",
        ),
        overwrite: bool = typer.Option(False, help="replace an existing dataset at --out"),
    ) -> None:
        """Answer every user turn with the target; write a dataset (resumable: rerun the same command)."""
        import logging

        from flashdraft.data.generate import GenerationParams, ServerGenerator
        from flashdraft.data.regenerate import RegenConfig, load_tokenizer
        from flashdraft.data.regenerate import regenerate as run
        from flashdraft.data.template import ChatTemplate

        logging.basicConfig(level=logging.WARNING, format="%(message)s")
        cfg = RegenConfig(
            inputs=list(input), out=out, target=target, max_new_tokens=max_new_tokens, temperature=temperature,
            top_p=top_p, thinking=thinking, limit=limit, skip=skip, shard_size=shard_size, max_length=max_length,
            block_size=block_size, eval_fraction=eval_fraction, split_turns=split_turns,
            max_turns=max_turns, continue_from=list(continue_from), max_bad_fraction=max_bad_fraction, seed=seed,
            contamination_sources=[c for c in contamination if c != "none"],
            time_limit_s=time_limit * 60 if time_limit else None,
        )  # fmt: skip
        if server:
            tok = load_tokenizer(target)
            tpl = ChatTemplate(tok, enable_thinking=thinking)
            params = GenerationParams(max_new_tokens, temperature, top_p, tpl.stop_ids)
            gen = ServerGenerator(
                server, params, model=server_model, concurrency=concurrency, retries=retries
            )
        else:
            tpl, gen, engine, attention = _local_generator(
                target, dtype, device, engine, attention, batch_size, max_batch_tokens, loop_groups, thinking,
                max_new_tokens, temperature, top_p,
            )  # fmt: skip
        import sys

        extra = {
            "command": " ".join(["flashdraft", *sys.argv[1:]]),
            "engine": "server:" + server if server else engine,
            **({"attention": attention} if engine == "native" and not server else {}),
        }
        res = run(cfg, tpl, gen, manifest_extra=extra, overwrite=overwrite)
        m = res.manifest
        rate = res.generated_tokens / res.seconds if res.seconds > 0 else 0.0
        cut = f", {res.shards_cut} cut by the time limit with their answered turns" if res.shards_cut else ""
        typer.echo(
            f"wrote {res.out}: {m['counts']['train']} train / {m['counts']['eval']} eval samples, "
            f"{m['tokens']['train']['loss']:,} train loss tokens; shards {res.shards_total} "
            f"({res.shards_skipped} resumed, {res.shards_done} in the dataset{cut}); "
            f"{res.generated_tokens:,} tokens generated in {res.seconds:.1f} s "
            f"({rate:,.0f} tok/s); dropped {m['dropped']}"
        )
        native_stats = getattr(gen, "native_stats", None)
        if native_stats is not None and native_stats.steps:
            typer.echo(native_stats.line())

    @data.command()
    def merge(
        inputs: list[str] = typer.Argument(
            ..., help="two or more dataset folders (same target, template, split)"
        ),
        out: str = typer.Option(..., "--out", help="dataset folder to write"),
        contamination: list[str] = typer.Option(
            ["humaneval"], help="eval sources whose word 13-grams drop training samples; 'none' to disable"
        ),
        overwrite: bool = typer.Option(False, help="replace an existing dataset at --out"),
    ) -> None:
        """Merge regenerated datasets: each sample once (a longer answer of the same conversation wins)."""
        import sys

        from flashdraft.data.merge import describe, merge_datasets

        m = merge_datasets(
            inputs, out, contamination_sources=[c for c in contamination if c != "none"],
            overwrite=overwrite, command=" ".join(["flashdraft", *sys.argv[1:]]),
        )  # fmt: skip
        typer.echo(f"wrote {out}: {describe(m)}")

    @data.command()
    def pack(
        path: str = typer.Argument(..., help="dataset folder"),
        out: str = typer.Option(..., "--out", help="pack file to write (.fdpack)"),
        overwrite: bool = typer.Option(False, help="replace an existing file at --out"),
    ) -> None:
        """The dataset as one xz file (kept in git, carried to a GPU host): `data unpack` gives it back."""
        from flashdraft.data.pack import pack_dataset

        st = pack_dataset(path, out, overwrite=overwrite)
        mib = st["bytes"] / 2**20
        typer.echo(f"wrote {out}: {st['samples']:,} samples, {st['tokens']:,} tokens in {mib:.2f} MiB")

    @data.command()
    def unpack(
        path: str = typer.Argument(..., help="pack file written by `flashdraft data pack`"),
        out: str = typer.Option(..., "--out", help="dataset folder to write"),
        overwrite: bool = typer.Option(False, help="replace an existing dataset at --out"),
    ) -> None:
        """A packed dataset's folder again: the same shards, samples and manifest."""
        from flashdraft.data.dataset import open_dataset
        from flashdraft.data.merge import describe
        from flashdraft.data.pack import unpack_dataset

        d = unpack_dataset(path, out, overwrite=overwrite)
        typer.echo(f"wrote {d}: {describe(open_dataset(d).manifest)}")

    @data.command("self-prompts")
    def self_prompts(
        out: str = typer.Option(..., "--out", help="prompts file to write (.jsonl or .jsonl.gz)"),
        n: int = typer.Option(2000, "--n", min=1, help="distinct prompts to keep"),
        target: str = typer.Option("default", help="HF folder, hub-style id, .gguf path, or 'default'"),
        opening: list[str] = typer.Option(
            [], "--opening", help="text every message of a share of the rows starts with (repeatable; '' for none)"
        ),
        temperature: float = typer.Option(1.0, help="sampling temperature of the messages"),
        top_p: float = typer.Option(1.0),
        max_new_tokens: int = typer.Option(160, help="a message that has not ended its turn by then is dropped"),
        min_words: int = typer.Option(4, help="shorter messages are dropped"),
        seed: int = typer.Option(0),
        batch_size: int = typer.Option(64, help="rows per generation batch (raise on a GPU: 512+)"),
        max_batch_tokens: int | None = typer.Option(None, help="cap rows × (prompt + max_new_tokens) per batch"),
        device: str = typer.Option("cpu"),
        dtype: str = typer.Option("float32"),
        engine: str = typer.Option("auto", help="native | loop | auto (native on CUDA where the family allows)"),
        attention: str = typer.Option("auto", help="native engine's decode-step attention: varlen | sdpa | auto"),
        overwrite: bool = typer.Option(False, help="replace an existing --out"),
    ) -> None:
        """User messages the target writes itself (its chat template up to a user's turn, sampled): a prompts file
        for `regenerate --input prompts:FILE` when the prompt sets run out."""
        from pathlib import Path

        from flashdraft.data.self_prompts import self_prompts as write_messages
        from flashdraft.data.sources import write_prompts
        from flashdraft.data.template import TemplateError

        path = Path(out)
        if path.exists() and not overwrite:
            raise typer.BadParameter(f"{path} exists: pass --overwrite to replace it", param_hint="--out")
        if temperature <= 0:
            raise typer.BadParameter("greedy decoding writes one message: use a temperature > 0", param_hint="--temperature")
        tpl, gen, _, _ = _local_generator(
            target, dtype, device, engine, attention, batch_size, max_batch_tokens, 0, None, max_new_tokens,
            temperature, top_p,
        )  # fmt: skip
        try:
            prompts, stats = write_messages(
                tpl, gen, n, seed=seed, openings=list(opening) or None, min_words=min_words,
                on_round=lambda r, k: typer.echo(f"round {r + 1}: {k:,} of {n:,} kept", err=True),
            )  # fmt: skip
        except TemplateError as e:
            raise typer.BadParameter(str(e), param_hint="--target") from None
        if not prompts:
            raise typer.BadParameter(f"no message was kept ({stats.line()}): nothing written", param_hint="--n")
        write_prompts(path, prompts, overwrite=overwrite)
        typer.echo(f"wrote {path}: {stats.line()}")

    @data.command()
    def inspect(
        path: str = typer.Argument(..., help="dataset folder"),
        split: str = typer.Option("train"),
        sample: int = typer.Option(0, help="index of the sample to render"),
        tokenizer: str | None = typer.Option(
            None, help="tokenizer to render text with (default: the manifest's target)"
        ),
        bins: int = typer.Option(10, help="length histogram bins"),
    ) -> None:
        """Counts, length histogram, loss-token totals, and one sample with its loss tokens bracketed."""
        from flashdraft.data.inspect import inspect_dataset

        typer.echo(inspect_dataset(path, split=split, index=sample, tokenizer=tokenizer, bins=bins))

    @data.command()
    def sources() -> None:
        """List the registered prompt sources."""
        from flashdraft.data.sources import describe_sources

        for name, desc in describe_sources().items():
            typer.echo(f"{name:12s} {desc}")
