"""A test drafter that knows the answer: it proposes the target's own greedy continuation.

It wraps a real DFlashDrafter (so the drafter KV cache and context bookkeeping run exactly as
in production) and replaces its output with the target's final-normed hidden states along
the greedy continuation of the *actual* committed sequence, so `target.lm_head` of slot k
gives the target's own logits for the k-th next token. The committed sequence is learned
through generate's `on_tokens` callback (the oracle checks the bonus it is fed against it).
With `error_rate > 0` some slots get a random hidden state instead (a mostly-right drafter);
`sharpness` scales the logits (same argmax) so a DDTree spends its budget along the greedy path.
"""

from __future__ import annotations

import torch
from torch import nn

from flashdraft.drafter import DFlashDrafter
from flashdraft.target import TargetModel


class OracleDrafter(nn.Module):
    def __init__(
        self,
        target: TargetModel,
        inner: DFlashDrafter,
        prompt: list[int],
        error_rate: float = 0.0,
        sharpness: float = 1.0,
        seed: int = 0,
        memo: dict | None = None,
    ) -> None:
        super().__init__()
        self.inner = inner
        self.target = target  # not a module: never registered, never moved
        self.seq: list[int] = list(prompt)
        self.error_rate = error_rate
        self.sharpness = sharpness  # scales the logits: > 1 makes a tree follow the greedy path deeper
        self.gen = torch.Generator().manual_seed(seed)
        self.calls = 0
        # prefix -> [B-1, H] greedy hidden states; share one dict between oracles on the same target
        self._memo: dict[tuple[int, ...], torch.Tensor] = {} if memo is None else memo

    # the attributes generate() reads from a drafter
    @property
    def config(self):  # type: ignore[no-untyped-def]
        return self.inner.config

    @property
    def block_size(self) -> int:
        return self.inner.block_size

    @property
    def mask_token_id(self) -> int:
        return self.inner.mask_token_id

    @property
    def target_layer_ids(self) -> list[int]:
        return self.inner.target_layer_ids

    def on_tokens(self, tokens: list[int]) -> None:
        self.seq.extend(tokens)

    def reset(self, prompt: list[int]) -> None:
        self.seq = list(prompt)

    def greedy_hidden(self, prefix: tuple[int, ...]) -> torch.Tensor:
        """[B-1, H]: final-normed target hidden states at the bonus and the next B-2 greedy tokens."""
        if prefix in self._memo:
            return self._memo[prefix]
        from flashdraft import cache as kv

        t = self.target
        cache = kv.new_cache()
        ids = torch.tensor([prefix], dtype=torch.long)
        rows = []
        for _ in range(self.block_size - 1):
            h = t.model.model(input_ids=ids, use_cache=True, **{t._cache_kw: cache}).last_hidden_state[:, -1]
            rows.append(h[0])
            ids = t.lm_head(h).argmax(-1, keepdim=True)  # [1, 1]
        out = torch.stack(rows)  # [B-1, H]
        self._memo[prefix] = out
        return out

    def forward(self, target_hidden, noise_embedding, position_ids, attention_mask=None, cache=None):  # type: ignore[no-untyped-def]
        self.calls += 1
        real = self.inner(target_hidden, noise_embedding, position_ids, attention_mask, cache)  # [1, B, H]
        bonus_row = self.target.embed_tokens(torch.tensor([self.seq[-1]]))[0].to(noise_embedding.dtype)
        if not torch.equal(noise_embedding[0, 0], bonus_row):
            raise AssertionError("oracle: the bonus fed to the drafter is not the last committed token")
        hidden = self.greedy_hidden(tuple(self.seq)).to(real.dtype) * self.sharpness  # [B-1, H]
        if self.error_rate > 0:
            wrong = torch.rand(hidden.shape[0], generator=self.gen) < self.error_rate
            noise = (
                torch.randn(hidden.shape, generator=self.gen, dtype=hidden.dtype) * hidden.norm(dim=-1).mean()
            )
            hidden = torch.where(wrong[:, None], noise, hidden)
        return torch.cat([real[:, :1], hidden[None]], dim=1)  # [1, B, H]
