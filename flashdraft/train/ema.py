"""An exponential moving average of the drafter's weights (`optim.ema_decay`).

    ema = WeightEMA(drafter, decay=0.998)
    ...optimizer.step(); ema.update(step)        # after every optimizer step
    ema.state_dict()                             # the drafter's state dict with the averaged weights

With EMA on, a checkpoint's `drafter/` folder holds the averaged weights (what eval, `--watch`, export and
serve read) and the trainer state holds the weights being trained (`train_weights`), so `--resume` is exact.
The decay warms up as min(decay, (1 + step) / (10 + step)): the first steps' random-ish weights do not linger.
"""

from __future__ import annotations

from typing import Any

import torch


class WeightEMA:
    def __init__(self, module: torch.nn.Module, decay: float) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"optim.ema_decay {decay} must be in (0, 1) (0 turns the average off)")
        self.module, self.decay = module, decay
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.shadow = [p.detach().clone() for p in self.params]  # the master weights' dtype and device

    def decay_at(self, step: int) -> float:
        """The decay applied after optimizer step `step` (1-based)."""
        return min(self.decay, (1 + step) / (10 + step))

    @torch.no_grad()
    def update(self, step: int) -> None:
        torch._foreach_lerp_(self.shadow, [p.detach() for p in self.params], 1.0 - self.decay_at(step))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The module's state dict with every trained parameter replaced by its average."""
        state = dict(self.module.state_dict())
        state.update(zip(self.names, self.shadow, strict=True))
        return state

    @torch.no_grad()
    def reset_to_weights(self) -> None:
        """Averages := the module's current weights (after a checkpoint's averaged drafter/ weights were loaded)."""
        torch._foreach_copy_(self.shadow, [p.detach() for p in self.params])

    def train_weights(self) -> dict[str, Any]:
        """The weights being trained (copies: a checkpoint's trainer state keeps them for `--resume`)."""
        return {n: p.detach().clone() for n, p in zip(self.names, self.params, strict=True)}
