"""`flashdraft info`: target and drafter geometry, parameter counts and the chosen layer ids.

    flashdraft info                                  # the embedded SmolLM2-135M-Instruct default
    flashdraft info --target ./my-model --drafter-layers 5
"""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    @app.command()
    def info(
        target: str = typer.Option("default", help="HF folder, hub-style id, .gguf path, or 'default'"),
        drafter: str | None = typer.Option(None, help="a DFlash drafter folder to check against the target"),
        drafter_layers: int = typer.Option(5, help="drafter depth for the proposed config"),
        block_size: int = typer.Option(16, help="block size B for the proposed config"),
        prompt: str | None = typer.Option(None, help="also generate a short greedy answer to this chat prompt"),
        max_new_tokens: int = typer.Option(48),
    ) -> None:
        """Print target and drafter geometry, parameter counts and the chosen layer ids."""
        import torch

        from flashdraft.drafter import DFlashDrafter
        from flashdraft.target import check_pair, drafter_config_for, load_target

        t = load_target(target)
        typer.echo("target:")
        for k, v in t.geometry().items():
            typer.echo(f"  {k:22s} {v:,}" if isinstance(v, int) else f"  {k:22s} {v}")
        if drafter:
            d = DFlashDrafter.from_pretrained(drafter)
            check_pair(t, d.config)
            cfg = d.config
            title = f"drafter ({drafter}):"
        else:
            cfg = drafter_config_for(t, num_layers=drafter_layers, block_size=block_size)
            with torch.device("meta"):
                d = DFlashDrafter(cfg)
            title = "proposed drafter (random init, not trained):"
        typer.echo(title)
        for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "intermediate_size", "block_size", "target_layer_ids", "mask_token_id"):
            typer.echo(f"  {k:22s} {getattr(cfg, k)}")
        typer.echo(f"  {'parameters':22s} {d.num_parameters():,}")
        if prompt:
            if t.tokenizer is None:
                raise typer.BadParameter("this target has no tokenizer")
            ids = t.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt",
                return_dict=True,
            )["input_ids"]
            out = t.model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
            typer.echo("answer: " + t.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
