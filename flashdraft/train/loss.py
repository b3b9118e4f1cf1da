"""The drafter loss: decayed hard cross-entropy through the target's frozen lm_head (docs/method.md §6).

    weights = slot_weights(block_size=16)                       # [B]: 0, 1, e^(-1/7), ...
    denom = loss_denominator([draft1, draft2], weights)          # Σw over the global batch
    out = drafter_loss(hidden, draft, target.lm_head.weight, weights, denom)
    out.loss.backward()

Labels are the data token ids (the target's own output); no target logits are computed.
The [tokens, vocab] logits never exist at once: `LinearCrossEntropy` walks the labelled
tokens in chunks and computes the input gradient chunk by chunk in the forward pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from flashdraft.train.blocks import IGNORE, DraftBatch

DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}  # the paper's decay per block size


def default_gamma(block_size: int) -> float:
    if block_size not in DEFAULT_GAMMA:
        raise ValueError(
            f"no default loss decay γ for block_size {block_size} (known: {sorted(DEFAULT_GAMMA)}): "
            "set loss.gamma in the config"
        )
    return DEFAULT_GAMMA[block_size]


def slot_weights(block_size: int, gamma: float | None = None) -> torch.Tensor:
    """[B] float32: w_0 = 0 (slot 0 has no loss), w_k = exp(−(k−1)/γ) for k ≥ 1."""
    g = default_gamma(block_size) if gamma is None else float(gamma)
    if g <= 0:
        raise ValueError(f"loss.gamma {g} must be > 0")
    w = torch.tensor([0.0] + [math.exp(-(k - 1) / g) for k in range(1, block_size)], dtype=torch.float32)
    return w


def loss_denominator(drafts: list[DraftBatch], weights: torch.Tensor) -> torch.Tensor:
    """Σw over every labelled slot of the global batch (all micro-batches, all ranks).

    Labels are known before any forward, so the denominator is exact before the first backward.
    """
    total = torch.zeros((), dtype=torch.float64)
    for d in drafts:
        slots = d.slots.cpu()[None].expand_as(d.labels)  # [R, N·B]
        total += weights.double()[slots][d.labels.cpu() != IGNORE].sum()
    if dist.is_available() and dist.is_initialized():
        backend = dist.get_backend()
        dev = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        t = total.to(dev)
        dist.all_reduce(t)
        total = t.cpu()
    return total


def _ce_chunk(
    h: torch.Tensor,  # [c, H] in the matmul dtype
    w: torch.Tensor,  # [V, H] in the matmul dtype
    labels: torch.Tensor,  # [c] long
    token_weights: torch.Tensor,  # [c]
    acc: torch.dtype,  # float32, or float64 for exact tests
    need_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One chunk: per-token CE, argmax and (optionally) w_t · d CE / d h. Logits live only in here."""
    logits = (h @ w.t()).to(acc)  # [c, V]
    # log_softmax, not logsumexp: on CPU eager logsumexp is ~5× slower than the fused log_softmax kernel
    logp = torch.log_softmax(logits, dim=-1)  # [c, V]
    ce = -logp.gather(1, labels[:, None]).squeeze(1)  # [c]
    pred = logits.argmax(-1)
    if not need_grad:
        return ce, pred, None
    p = logp.exp_()  # softmax, in place; d CE / d logits = softmax − onehot
    p.scatter_add_(1, labels[:, None], torch.full_like(p[:, :1], -1.0))
    p.mul_(token_weights[:, None].to(acc))
    return ce, pred, p.to(w.dtype) @ w  # [c, H]


def _ce_chunk_fused(
    h: torch.Tensor,  # [c, H] in the matmul dtype
    w: torch.Tensor,  # [V, H] in the matmul dtype
    labels: torch.Tensor,  # [c] long
    token_weights: torch.Tensor,  # [c]
    acc: torch.dtype,  # float32, or float64 for exact tests
    need_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`_ce_chunk` written as two passes over the logits (loss.fused_ce): compiled, the logits stay in the
    matmul dtype (bf16 on GPU) and no [c, V] float32 tensor is written — one reduction (max, argmax,
    Σ exp) and one pointwise pass (softmax − onehot, scaled, cast) that writes the gradient logits in the
    matmul dtype. `_ce_chunk`'s log_softmax / exp_ / scatter_add_ / mul_ / cast came out of inductor as a
    reduction writing float32 plus a cast pass (benchmarks/RESULTS.md, "Training throughput and MFU": the H200 profile).
    Same values: CE = logsumexp − logit[label], d CE / d logits = softmax − onehot."""
    logits = h @ w.t()  # [c, V] in the matmul dtype
    z = logits.to(acc)  # compiled: fused into both passes, never written
    m = z.amax(-1, keepdim=True)  # [c, 1]
    lse = m + (z - m).exp().sum(-1, keepdim=True).log()  # [c, 1]
    ce = (lse - z.gather(1, labels[:, None])).squeeze(1)  # [c]
    pred = z.argmax(-1)
    if not need_grad:
        return ce, pred, None
    onehot = torch.arange(z.shape[1], device=z.device)[None] == labels[:, None]  # [c, V] bool, not stored
    g = ((z - lse).exp() - onehot.to(acc)) * token_weights[:, None].to(acc)  # [c, V]
    return ce, pred, g.to(w.dtype) @ w  # [c, H]


_CHUNK_FN: Any = _ce_chunk  # compile_loss() swaps in a compiled one
_FUSED_CHUNK_FN: Any = _ce_chunk_fused  # likewise (loss.fused_ce)

_CAST: list[Any] = []  # [weight, its _version, dtype, the cast copy]: one entry, the frozen head


def _cast_frozen(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`weight.to(dtype)`, kept across steps: the head is frozen, and casting [V, H] every micro-step cost
    ~30 ms of a ~0.3 s CPU bf16 step. The cached entry holds `weight` itself, so its memory cannot be
    reused by another tensor while cached; an in-place update (a new `_version`) recasts."""
    if weight.dtype == dtype:
        return weight
    if _CAST and _CAST[0] is weight and _CAST[1] == weight._version and _CAST[2] == dtype:
        return _CAST[3]
    w = weight.detach().to(dtype)
    _CAST[:] = [weight, weight._version, dtype, w]
    return w


def compile_loss() -> None:
    """Run every chunk of `LinearCrossEntropy` through one torch.compile'd kernel (CUDA training).

    Eager, a chunk is ~10 passes over its [chunk, V] float32 logits (cast, logsumexp, softmax,
    scatter, scale, cast); compiled they fuse into a few. Chunks are padded to `chunk` rows so
    one static shape serves every step (train config runtime.compile "loss").
    """
    global _CHUNK_FN, _FUSED_CHUNK_FN
    if _CHUNK_FN is _ce_chunk:
        _CHUNK_FN = torch.compile(_ce_chunk, dynamic=False)
    if _FUSED_CHUNK_FN is _ce_chunk_fused:
        _FUSED_CHUNK_FN = torch.compile(_ce_chunk_fused, dynamic=False)


class LinearCrossEntropy(torch.autograd.Function):
    """Σ_t w_t · CE(hidden_t @ weightᵀ, label_t), chunked over tokens; `weight` is frozen.

    Forward computes each chunk's logits in float32, its CE, its argmax and — when the input
    needs a gradient — d(sum)/d(hidden) for the chunk, then drops the logits. Backward only
    scales the stored input gradient. Peak extra memory: a few [chunk, V] float32 blocks.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,  # noqa: ANN001
        hidden: torch.Tensor,  # [T, H]
        weight: torch.Tensor,  # [V, H] frozen lm_head
        labels: torch.Tensor,  # [T] long
        token_weights: torch.Tensor,  # [T] float
        chunk: int,
        fused: bool = False,  # loss.fused_ce: `_ce_chunk_fused` instead of `_ce_chunk` (same values)
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t = hidden.shape[0]
        need_grad = bool(ctx.needs_input_grad[0])
        acc = torch.promote_types(hidden.dtype, torch.float32)  # float32, or float64 for exact tests
        # matmuls in the autocast dtype when autocast is on (a bf16 head: no fp32 copy of [V, H])
        dev = hidden.device.type
        on = torch.is_autocast_enabled(dev)
        cdt = torch.get_autocast_dtype(dev) if on else torch.promote_types(hidden.dtype, weight.dtype)
        w_mat = _cast_frozen(weight, cdt)
        h_all = hidden.to(cdt)
        fn, eager = (_FUSED_CHUNK_FN, _ce_chunk_fused) if fused else (_CHUNK_FN, _ce_chunk)
        if fn is not eager:  # compiled: pad to whole chunks, one static shape (padding has w = 0)
            pad = -t % chunk
            h_all = torch.nn.functional.pad(h_all, (0, 0, 0, pad))
            labels = torch.nn.functional.pad(labels, (0, pad))
            token_weights = torch.nn.functional.pad(token_weights, (0, pad))
        outs = [
            fn(
                h_all[i : i + chunk],
                w_mat,
                labels[i : i + chunk],
                token_weights[i : i + chunk],
                acc,
                need_grad,
            )
            for i in range(0, h_all.shape[0], chunk)
        ]
        ce = torch.cat([o[0] for o in outs])[:t]
        pred = torch.cat([o[1] for o in outs])[:t]
        grad = torch.cat([o[2] for o in outs])[:t].to(hidden.dtype) if need_grad else None
        total = (ce * token_weights[:t].to(acc)).sum()
        ctx.save_for_backward(grad if grad is not None else torch.empty(0))
        ctx.mark_non_differentiable(ce, pred)
        return total, ce, pred

    @staticmethod
    def backward(ctx, g_total: torch.Tensor, _g_ce: torch.Tensor, _g_pred: torch.Tensor):  # type: ignore[override]  # noqa: ANN001, ANN205
        (grad,) = ctx.saved_tensors
        return grad * g_total.to(grad.dtype), None, None, None, None, None


@dataclass
class LossOutput:
    """The loss (with grad) and detached per-slot statistics (device tensors: no host sync)."""

    loss: torch.Tensor  # scalar: this micro-batch's share of Σ w·CE / Σw_global
    weighted_ce: torch.Tensor  # scalar Σ w·CE (detached)
    slot_correct: torch.Tensor  # [B] float count of correct predictions per slot
    slot_count: torch.Tensor  # [B] float count of labelled slots
    streak_sum: torch.Tensor  # scalar Σ over valid blocks of the leading run of correct slots
    num_blocks: torch.Tensor  # scalar number of valid blocks


def drafter_loss(
    hidden: torch.Tensor,  # [R, N·B, H] drafter output (final-normed)
    draft: DraftBatch,  # on hidden's device
    lm_head_weight: torch.Tensor,  # [V, H] the target's frozen head
    weights: torch.Tensor,  # [B] slot weights
    denominator: torch.Tensor | float,  # Σw over the global batch, a CPU value (see loss_denominator)
    chunk_tokens: int = 4096,
    fused_ce: bool = False,  # loss.fused_ce: two passes over each chunk's logits instead of log_softmax's
) -> LossOutput:
    r, q, h = hidden.shape
    b = draft.block_size
    device = hidden.device
    slots = draft.slots  # [N·B]
    flat_slots = slots[None].expand(r, q).reshape(-1)  # [R·N·B]
    idx = draft.label_index  # [T]
    labels = draft.labels.reshape(-1).index_select(0, idx)  # [T]
    tok_w = weights.to(device)[flat_slots.index_select(0, idx)]  # [T]
    sel = hidden.reshape(r * q, h).index_select(0, idx)  # [T, H]
    total, ce, pred = LinearCrossEntropy.apply(sel, lm_head_weight, labels, tok_w, chunk_tokens, fused_ce)
    # DDP averages gradients over ranks: scale by world size so the result is Σ w·CE / Σw_global
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    loss = total * (world / float(denominator))  # a host float: no device transfer, no sync
    correct = (pred == labels).float()  # [T]
    slot_of = flat_slots.index_select(0, idx)
    slot_correct = torch.zeros(b, device=device).index_add_(0, slot_of, correct)
    slot_count = torch.zeros(b, device=device).index_add_(0, slot_of, torch.ones_like(correct))
    # τ proxy: per block, the run of correct slots from slot 1 (an unlabelled slot ends it)
    grid = torch.zeros(r * q, device=device).index_copy_(0, idx, correct).view(r, -1, b)  # [R, N, B]
    streak = grid[:, :, 1:].cumprod(-1).sum(-1)  # [R, N]
    valid = draft.valid.to(device)
    return LossOutput(
        loss=loss,
        weighted_ce=total.detach(),
        slot_correct=slot_correct,
        slot_count=slot_count,
        streak_sum=(streak * valid).sum(),
        num_blocks=valid.sum().float(),
    )
