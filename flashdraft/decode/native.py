"""Static-cache forwards for the fast engine: the target (Llama / Qwen2 / Qwen3 / Mistral) and the drafter.

The gpt-fast way: one preallocated KV cache per model, `[layers, 2, kv_heads, capacity, head_dim]`,
and every input a tensor of fixed shape — token ids, positions, the cache rows to write and a
boolean mask over the whole cache — so a forward never branches on data, never reads back to
the host and can be captured once as a CUDA graph and replayed. Both forwards run over the
models' OWN modules and weights (the HF target's layers, the DFlashDrafter's layers): nothing
is copied, so a checkpoint loaded once serves the reference decoder and this engine alike.

    native = NativeTarget(target, capacity=2048 + 64)
    out = native.forward(ids, positions, write_rows, allowed, layer_ids=[1, 8, 14, 20, 27])
    out.logits, out.features                      # [q, V], [q, k·H]
    out = native.compiled_forward(ids, positions, write_rows, allowed)   # the same through torch.compile
    dstep = NativeDrafter(drafter, target, capacity=2048 + 64)
    logits = dstep.step(pending, n_pending, seq_len, bonus, mask_ids)   # [B, V]; compiled_step: through torch.compile

Used by `flashdraft/decode/engine.py`; `tests/decode/test_engine.py` checks it against HF in float64. The
regeneration engine's batched forward (flashdraft/data/native.py) shares the public layer primitives below
(`rope_tables`, `rms_norm`, `additive_mask`, `fuse_projections`, `target_qkv`, `target_mlp`, `HeadFP32`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flashdraft.drafter import DFlashDrafter
from flashdraft.target import TargetModel

# families whose decoder layer is exactly: norm → q/k/v (+bias, +QK-norm) → RoPE → attention →
# o_proj → residual → norm → SwiGLU → residual, with one global RoPE. Everything else stays on
# the transformers path (flashdraft/decode/generate.py).
NATIVE_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


def native_support_error(target: TargetModel) -> str | None:
    """None when `target` can run on the native forward, else one line saying why not."""
    cfg = target.config
    mt = getattr(cfg, "model_type", "?")
    if mt not in NATIVE_FAMILIES:
        return f"model_type {mt!r} has no native forward (supported: {', '.join(NATIVE_FAMILIES)}); use the transformers path"
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        return f"hidden_act {act!r}: the native forward implements SwiGLU with silu only"
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", mt == "mistral"):
        return f"{mt} with a sliding window ({cfg.sliding_window}) cannot use a static full-attention cache"
    rope = getattr(target.model.model, "rotary_emb", None)
    if rope is None:
        return f"{type(target.model).__name__}: no model.model.rotary_emb to take RoPE from"
    kind = str(getattr(rope, "rope_type", "default"))
    if "dynamic" in kind or "longrope" in kind:
        return f"rope type {kind!r} changes with the sequence length; a static graph cannot follow it"
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1 is not supported by the native forward"
    return None


def attention_geometry(target: TargetModel) -> tuple[int, int, int]:
    """(query heads, kv heads, head dim) of a native-family target."""
    cfg = target.config
    n_heads = int(cfg.num_attention_heads)
    n_kv = int(getattr(cfg, "num_key_value_heads", None) or n_heads)
    return n_heads, n_kv, int(getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads)


class HeadFP32:
    """The target's lm_head evaluated in at least float32 (a float32 copy of the weight, made once).

    A bf16 head over a 49K vocabulary rounds logits of ~20 to steps of 0.125, so the top two tie exactly
    often: on the H200 every divergence of a bf16 speculative decode from bf16 AR sat at a top-2 margin
    of 0.0–0.5, most at 0.0 (benchmarks/RESULTS.md "Regeneration", 2026-12-02), and two regenerations of the same prompts
    in different batches split at a median of 25 answer tokens. Float32 logits leave only the ties
    the hidden states themselves make; the cost is one float32 matmul of [q, H] × [H, V] per forward."""

    def __init__(self, lm_head: torch.nn.Module) -> None:
        w = lm_head.weight
        dt = torch.promote_types(w.dtype, torch.float32)
        self.weight = w.detach().to(dt)  # [V, H]; a copy only when the head is narrower than float32
        b = getattr(lm_head, "bias", None)
        self.bias = None if b is None else b.detach().to(dt)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden.to(self.weight.dtype), self.weight, self.bias)


@dataclass
class NativeOutput:
    logits: torch.Tensor | None  # [q, V]
    features: torch.Tensor | None  # [q, k·H] outputs of layer_ids, concatenated in listed order


# Every op below is a kernel that a CUDA graph replays each round, and a small model's step is bound by
# their number, not by bandwidth (benchmarks/engine_op_count.py): hence RoPE for q and k in one pass, the
# rotation as a roll, and the mask converted once per forward instead of inside SDPA in every layer.


def rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin with its first half negated): rotate_half(x) · sin == roll(x, hd/2) · sin_signed."""
    half = sin.shape[-1] // 2
    return cos, torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """HF's x·cos + rotate_half(x)·sin, with rotate_half(x) = roll(x, hd/2) and its sign in sin_signed."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


def _rope_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on q [b, heads, n, hd] and k [b, kv, n, hd] in one pass (cos/sin_signed [b, 1, n, hd])."""
    qk = _rope(torch.cat([q, k], dim=1), cos, sin_signed)  # [b, heads + kv, n, hd]
    return qk[:, : q.shape[1]], qk[:, q.shape[1] :]


def rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`norm(x)` for the RMSNorms of the native families and the drafter (statistics in float32, the weight
    applied in the input dtype, as HF's LlamaRMSNorm), through F.rms_norm: PyTorch's fused kernel on CUDA
    (`_fused_rms_norm`) instead of five elementwise ones; on CPU the same decomposition as HF's."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if eps is None:
        return norm(x)
    return norm.weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool mask (True = attend) → 0 / −inf in `dtype`, the form SDPA converts a boolean mask to."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, float("-inf")
    )


def fuse_projections(target: TargetModel) -> None:
    """Each decoder layer's q/k/v projections made row blocks of one weight (and bias), and its gate/up projections
    of another, with the modules' own parameters turned into views of them: `target_qkv` and `target_mlp` then run
    one matmul where there were three and two (three fewer kernels a layer in a step that is bound by their number
    on a small target), the transformers forward runs as before, and no weight is stored twice. Idempotent; a
    layer whose projections differ in bias or dtype keeps its separate matmuls."""
    for layer in target.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not hasattr(attn, "fused_qkv_weight"):
            _fuse_rows(attn, "fused_qkv", [attn.q_proj, attn.k_proj, attn.v_proj])
        if not hasattr(mlp, "fused_gate_up_weight"):
            _fuse_rows(mlp, "fused_gate_up", [mlp.gate_proj, mlp.up_proj])


def _fuse_rows(owner: torch.nn.Module, name: str, linears: list[torch.nn.Module]) -> None:
    """`linears`' weights (and biases) concatenated by rows into buffers `{name}_weight` / `{name}_bias` of `owner`
    (not saved in its state dict), each linear's parameters made views of its rows."""
    biases = [getattr(lin, "bias", None) for lin in linears]
    if len({(lin.weight.dtype, lin.weight.device) for lin in linears}) > 1 or (
        any(b is None for b in biases) and any(b is not None for b in biases)
    ):
        return
    with torch.no_grad():
        weight = torch.cat([lin.weight for lin in linears])
        bias = None if biases[0] is None else torch.cat(biases)
        row = 0
        for lin in linears:
            n = lin.weight.shape[0]
            lin.weight.data = weight[row : row + n]
            if bias is not None:
                lin.bias.data = bias[row : row + n]
            row += n
    owner.register_buffer(f"{name}_weight", weight, persistent=False)
    owner.register_buffer(f"{name}_bias", bias, persistent=False)


def target_qkv(
    layer: torch.nn.Module, h: torch.Tensor, n_heads: int, n_kv: int, head_dim: int, cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """One HF decoder layer's attention inputs: h [b, q, H] → q [b, heads, q, hd], k and v [b, kv, q, hd],
    RoPE applied (cos/sin_signed [b, 1, q, hd], `rope_tables`); Qwen3's per-head QK-norm before RoPE,
    biases inside the projections. One matmul for all three after `fuse_projections`."""
    attn = layer.self_attn
    b, q_len, _ = h.shape
    x = rms_norm(layer.input_layernorm, h)
    fused = getattr(attn, "fused_qkv_weight", None)
    if fused is not None:
        q, k, v = F.linear(x, fused, attn.fused_qkv_bias).split(
            [n_heads * head_dim, n_kv * head_dim, n_kv * head_dim], dim=-1
        )
    else:
        q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    q = q.view(b, q_len, n_heads, head_dim)  # [b, q, heads, hd]
    k = k.view(b, q_len, n_kv, head_dim)
    v = v.view(b, q_len, n_kv, head_dim)
    if hasattr(attn, "q_norm"):  # Qwen3 QK-norm, per head, before RoPE
        q, k = rms_norm(attn.q_norm, q), rms_norm(attn.k_norm, k)
    q, k = _rope_qk(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # [b, heads|kv, q, hd]
    return q, k, v.transpose(1, 2)


def target_mlp(layer: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    """One HF decoder layer's SwiGLU block on its residual stream h (its post-attention norm first), without the
    residual add: down(silu(gate(x)) · up(x)); gate and up as one matmul after `fuse_projections`."""
    mlp = layer.mlp
    x = rms_norm(layer.post_attention_layernorm, h)
    fused = getattr(mlp, "fused_gate_up_weight", None)
    if fused is None:
        return mlp(x)
    gate, up = F.linear(x, fused, mlp.fused_gate_up_bias).chunk(2, dim=-1)
    return mlp.down_proj(F.silu(gate) * up)


def gqa_mask(mask: torch.Tensor, rep: int) -> torch.Tensor:
    """An additive mask [q, S] for `_attend` with `rep` query heads per KV head: [rep·q, S], the mask once per
    query head of a group (made once per forward, shared by its layers)."""
    return mask.repeat(rep, 1) if rep > 1 else mask


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [1, heads, q, hd] over the cache k/v [1, kv, capacity, hd] → [1, heads, q, hd]; mask [rep·q, span] additive
    (`gqa_mask(additive_mask(...), rep)`, rep = heads / kv): the cache's first `span` rows are read, no more.

    Grouped-query attention without copying the cache: query head h reads KV head h // rep, so the rep query
    heads of a group are folded into the query axis ([1, kv, rep·q, hd]) and SDPA runs once per KV head. Copying
    the cache to one K/V per query head instead costs a write of the whole capacity in every layer and step (and
    SDPA's own GQA falls back to its math kernel under a mask)."""
    b, heads, q_len, hd = q.shape
    kv, span = k.shape[1], mask.shape[-1]
    k, v = k[:, :, :span], v[:, :, :span]
    # heads are KV-major, (group, member): member m's query t becomes row m·q + t of its group
    folded = q.reshape(b, kv, heads // kv * q_len, hd)
    o = F.scaled_dot_product_attention(folded, k, v, attn_mask=mask[None, None], scale=scale)
    return o.reshape(b, heads, q_len, hd)  # (a copy where SDPA returns the folded rows strided: CUDA)


def put_rows(cache: torch.Tensor, layers: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """values [l, 2, kv, q, hd] into `cache` [L, 2, kv, S, hd] at layers `layers` [l], rows `rows` [q]: one
    index_put_ on the cache itself, every index broadcast to [l, 2, kv, q].

    For code under torch.compile: there an index_copy_ into a view of the cache (`cache[i, 0]`) is
    functionalized into a copy of the whole cache, written back at the end of every forward (seen in
    inductor's output code, CPU, torch 2.13), where this stays an in-place scatter."""
    dev = rows.device
    index = (
        layers[:, None, None, None],
        torch.arange(2, device=dev)[None, :, None, None],  # k, v
        torch.arange(cache.shape[2], device=dev)[None, None, :, None],
        rows[None, None, None],
    )
    cache.index_put_(index, values)


def write_kv(cache: torch.Tensor, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """k, v [kv, q, hd] into rows `rows` [q] of `cache[layer]`: `put_rows` under torch.compile, else the two
    index_copy_ kernels eager has always run (the same values either way)."""
    if torch.compiler.is_compiling():
        put_rows(cache, torch.full((1,), layer, device=rows.device), rows, torch.stack([k, v])[None])
    else:
        cache[layer, 0].index_copy_(1, rows, k)  # cache[layer, 0]: [kv, S, hd]
        cache[layer, 1].index_copy_(1, rows, v)


# rows past `capacity` in the native caches that no mask ever reaches. A compiled forward takes its span (the
# cache rows it reads) as a symbolic size; a span equal to the cache's own length would be specialised by the
# slice `cache[..., :span, :]` and compiled a second time. With spare rows every span is shorter than the cache.
SPARE_ROWS = 16


class NativeTarget:
    """A static-cache forward over the HF target's own layers (batch 1)."""

    def __init__(self, target: TargetModel, capacity: int) -> None:
        why = native_support_error(target)
        if why is not None:
            raise ValueError(f"native target forward: {why}")
        fuse_projections(target)  # q/k/v and gate/up: one matmul each
        self.target = target
        self.n_heads, self.n_kv, self.head_dim = attention_geometry(target)
        self.capacity = capacity
        self.inner = target.model.model  # LlamaModel / Qwen3Model ...: embed_tokens, layers, norm, rotary_emb
        self.layers = list(target.layers)
        self.head = HeadFP32(target.lm_head)
        # [layers, 2 (k, v), kv_heads, capacity + SPARE_ROWS, head_dim]; zeros so unwritten rows are finite
        self.cache = torch.zeros(
            len(self.layers), 2, self.n_kv, capacity + SPARE_ROWS, self.head_dim, dtype=target.dtype,
            device=target.device,
        )  # fmt: skip
        self._compiled: Callable[..., tuple[torch.Tensor | None, torch.Tensor | None]] | None = None

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,  # [q] token ids
        positions: torch.Tensor,  # [q] RoPE positions
        write_rows: torch.Tensor,  # [q] cache rows that receive this forward's K/V
        allowed: torch.Tensor,  # bool [q, span]: may attend (after the writes); attention reads cache rows < span
        *,
        layer_ids: list[int] | None = None,
        logits: bool = True,
        logits_row: torch.Tensor | None = None,  # [1] index: logits of this row only ([1, V])
    ) -> NativeOutput:
        return NativeOutput(
            *self._run(input_ids, positions, write_rows, allowed, tuple(layer_ids or ()), logits, logits_row)
        )

    def compiled_forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        write_rows: torch.Tensor,
        allowed: torch.Tensor,
        *,
        layer_ids: list[int] | None = None,
        logits: bool = True,
    ) -> NativeOutput:
        """`forward` through torch.compile (`compile_native_target`): the same arguments and results, one
        compilation per q and per (layer_ids, logits); the span (`allowed`'s columns) is one symbolic size, so
        every span shares it. For fixed-shape callers (the engine's phases): a variable-length prefill through
        it would compile once per prompt length."""
        if self._compiled is None:
            self._compiled = compile_native_target(self)
        # maybe: should a backend specialise the span after all, it compiles per span rather than failing
        torch._dynamo.maybe_mark_dynamic(allowed, 1)
        with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=COMPILE_RECOMPILE_LIMIT):
            out = self._compiled(input_ids, positions, write_rows, allowed, tuple(layer_ids or ()), logits)
        return NativeOutput(*out)

    def _run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        write_rows: torch.Tensor,
        allowed: torch.Tensor,
        layer_ids: tuple[int, ...],
        logits: bool,
        logits_row: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """`forward`'s body, (logits [q, V] (or [1, V]: `logits_row`) | None, features [q, k·H] | None): a plain
        tuple, which torch.compile returns as it is."""
        h = self.inner.embed_tokens(input_ids[None])  # [1, q, H]
        cos, sin = self.inner.rotary_emb(h, positions[None])  # [1, q, hd] each, computed as HF does
        cos, sin = rope_tables(cos[:, None], sin[:, None])  # [1, 1, q, hd]
        mask = gqa_mask(additive_mask(allowed, h.dtype), self.n_heads // self.n_kv)  # once for every layer
        q_len = input_ids.shape[0]
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            q, k, v = target_qkv(
                layer, h, self.n_heads, self.n_kv, self.head_dim, cos, sin
            )  # [1, heads|kv, q, hd]
            write_kv(self.cache, i, write_rows, k[0], v[0])
            o = _attend(q, self.cache[i, 0][None], self.cache[i, 1][None], mask, attn.scaling)
            o = o.transpose(1, 2).reshape(1, q_len, self.n_heads * self.head_dim)  # [1, q, heads·hd]
            h = h + attn.o_proj(o)
            h = h + target_mlp(layer, h)
            if i in layer_ids:
                captured[i] = h
        feats = None
        if layer_ids:
            last = len(self.layers) - 1
            # HF's hidden_states[-1] is final-normed; TargetModel.forward matches that, so do we
            parts = [rms_norm(self.inner.norm, captured[i]) if i == last else captured[i] for i in layer_ids]
            feats = torch.cat(parts, dim=-1)[0]  # [q, k·H] in listed order
        if logits_row is not None:
            h = h.index_select(1, logits_row)  # a device index: no host read (a prefill's CUDA graph)
        out_logits = (
            self.head(rms_norm(self.inner.norm, h))[0] if logits else None
        )  # [q, V] (or [1, V]), float32 at least
        return out_logits, feats


# one compiled code object (`NativeTarget._run`) serves every shape, flag set and NativeTarget instance of a
# process, and dynamo counts its compilations together: an engine with AR, the chain and 7 DDTree budgets
# alone has 9 shapes, one past the default recompile_limit (8), a hard error under fullgraph
COMPILE_RECOMPILE_LIMIT = 256


def compile_native_target(
    native: NativeTarget,
) -> Callable[..., tuple[torch.Tensor | None, torch.Tensor | None]]:
    """`native._run` through torch.compile (fullgraph, static shapes, inductor's default mode) — applied from
    outside the model code, which stays plain eager PyTorch.

    Inductor fuses what eager runs as separate kernels: each RMSNorm with the residual add before it, RoPE of
    q and k, SiLU · up, the mask conversion; the matmuls and SDPA stay library calls, and the cache writes
    stay in place (index_copy_ on the static cache). No CUDA graphs of its own (mode "default"): the engine
    captures the compiled code inside its own graphs, so the compilation must run before a capture —
    `_Phase`'s warm-up calls make it. Under a CUDA graph, the replay runs the fused kernels without Python.
    Float32/float64 results differ from eager only by summation order; bf16 ones also by the intermediate
    roundings inductor skips inside a fused kernel (benchmarks/gpu/forward_speed.py reports both)."""
    return torch.compile(native._run, fullgraph=True, dynamic=False)


class NativeDrafter:
    """A static-cache DFlash drafter step over a DFlashDrafter's own modules (batch 1).

    The drafter cache holds context K/V at the context rows' own positions (row p = position p).
    Context K/V depend only on the fused features (`k_norm(k_proj(ctx))`, `v_proj(ctx)`), so new
    context rows are written once — for every layer in one matmul (the layers' K/V projections are
    stacked at construction: a snapshot of the drafter's weights), one norm, one RoPE and one cache
    write; the block's K/V are written at its positions after them and overwritten by the next
    round's context (the mask hides every row past the block).
    """

    def __init__(self, drafter: DFlashDrafter, target: TargetModel, capacity: int) -> None:
        cfg = drafter.config
        if any(cfg.is_sliding(i) for i in range(cfg.num_hidden_layers)):
            raise ValueError("native drafter step: sliding-window drafter layers are not supported")
        self.drafter = drafter
        self.embed = target.embed_tokens
        self.lm_head = target.lm_head
        self.capacity = capacity
        self.n_heads, self.n_kv, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        p = next(drafter.parameters())
        n_layers = cfg.num_hidden_layers
        self.cache = torch.zeros(
            n_layers, 2, self.n_kv, capacity + SPARE_ROWS, self.head_dim, dtype=p.dtype, device=p.device
        )
        attns = [layer.self_attn for layer in drafter.layers]
        self._weights = [w for a in attns for w in (a.k_proj.weight, a.v_proj.weight)]
        self._biases = [b for a in attns for b in (a.k_proj.bias, a.v_proj.bias) if b is not None]
        self._norms = [a.k_norm.weight for a in attns]
        with torch.no_grad():
            # [L·2·kv·hd, H]: layer-major, then k / v — one matmul projects the context for every layer
            self.ctx_weight = torch.cat(self._weights)
            self.ctx_bias = torch.cat(self._biases) if self._biases else None
            self.k_norm_weight = torch.stack(self._norms)[:, None]  # [L, 1, hd]
        self.k_norm_eps = attns[0].k_norm.eps
        self._versions = self._source_versions()
        self.kv_idx = torch.arange(capacity, device=p.device)
        self._compiled: Callable[..., torch.Tensor] | None = None

    def _source_versions(self) -> list[int]:
        return [t._version for t in (*self._weights, *self._biases, *self._norms)]

    @torch.no_grad()
    def sync_weights(self) -> None:
        """Refresh the stacked copies in place (CUDA graphs keep their addresses) when the drafter's own
        weights changed since they were made — an optimizer step between two generate calls."""
        versions = self._source_versions()
        if versions != self._versions:
            self.ctx_weight.copy_(torch.cat(self._weights))
            if self.ctx_bias is not None:
                self.ctx_bias.copy_(torch.cat(self._biases))
            self.k_norm_weight.copy_(torch.stack(self._norms)[:, None])
            self._versions = versions

    @torch.no_grad()
    def step(
        self,
        pending: torch.Tensor,  # [B, k·H] raw features; its first `n_pending` rows are new context
        n_pending: torch.Tensor,  # [1]
        seq_len: torch.Tensor,  # [1] the bonus's position: the context ends right before it
        bonus: torch.Tensor,  # [1]
        mask_ids: torch.Tensor,  # [B − 1] the drafter's mask token
        span: int | None = None,  # attend over the cache's first `span` rows (>= seq_len + B); None: all
    ) -> torch.Tensor:
        """One drafting step on device scalars, no host read: the pending context rows written (all B of
        them: rows past `n_pending` land in the block, which overwrites them), then [bonus, MASK, ...] drafted
        against the context before it. Logits [B, V], slot 0 included."""
        return self._step(pending, n_pending, seq_len, bonus, mask_ids, self.kv_idx[:span])

    def compiled_step(self, *args: torch.Tensor, span: int | None = None) -> torch.Tensor:
        """`step` through torch.compile (fullgraph): one compilation, the span a symbolic size. Inductor fuses
        the norms, RoPE, SwiGLU and the residual adds of the context write and the block's layers; the matmuls and
        SDPA stay library calls. For the engine's drafting phase, compiled in its warm-up and captured in its CUDA
        graph."""
        if self._compiled is None:
            self._compiled = torch.compile(self._step, fullgraph=True, dynamic=False)
        rows = self.kv_idx[:span]
        torch._dynamo.maybe_mark_dynamic(rows, 0)
        with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=COMPILE_RECOMPILE_LIMIT):
            return self._compiled(*args, rows)

    def _step(
        self,
        pending: torch.Tensor,
        n_pending: torch.Tensor,
        seq_len: torch.Tensor,
        bonus: torch.Tensor,
        mask_ids: torch.Tensor,
        rows: torch.Tensor,  # [span] the cache rows attended over: kv_idx[:span]
    ) -> torch.Tensor:
        """`step`'s body (callers hold no_grad), its span given as the rows it covers: a shape, symbolic under
        torch.compile."""
        b = pending.shape[0]
        ar = torch.arange(b, device=pending.device)
        self.write_context(pending, seq_len - n_pending + ar)
        positions = seq_len + ar  # [B]
        allowed = (rows < seq_len + b)[None].expand(b, -1)  # [B, span]
        return self.forward_block(torch.cat([bonus, mask_ids]), positions, allowed)

    @torch.no_grad()
    def write_context(self, feats: torch.Tensor, positions: torch.Tensor) -> None:
        """Fuse raw features [c, k·H] and store their K/V at rows `positions` [c] in every layer."""
        d = self.drafter
        ctx = d.fuse(feats[None].to(d.fc.weight.dtype))[0]  # [c, H]
        c, n_layers = ctx.shape[0], self.cache.shape[0]
        kv = F.linear(ctx, self.ctx_weight, self.ctx_bias).view(c, n_layers, 2, self.n_kv, self.head_dim)
        k, v = kv[:, :, 0], kv[:, :, 1]  # [c, L, kv, hd]
        # each layer's k_norm (drafter.RMSNorm: statistics in float32, weight in the input dtype)
        k = self.k_norm_weight * F.rms_norm(k.float(), k.shape[-1:], eps=self.k_norm_eps).to(k.dtype)
        cos, sin = d.rope(positions[None], ctx.dtype)  # [1, c, hd]
        cos, sin = rope_tables(cos[0, :, None, None], sin[0, :, None, None])  # [c, 1, 1, hd]
        k = _rope(k, cos, sin)
        kv = torch.stack([k, v], dim=2).permute(1, 2, 3, 0, 4)  # [L, 2, kv, c, hd]
        if torch.compiler.is_compiling():
            put_rows(self.cache, torch.arange(n_layers, device=positions.device), positions, kv)
        else:  # into the cache rows `positions` of every layer at once
            self.cache.index_copy_(3, positions, kv)

    @torch.no_grad()
    def forward_block(
        self,
        block_ids: torch.Tensor,  # [B] = [bonus, MASK, ...]
        positions: torch.Tensor,  # [B] the block's positions (= its cache rows)
        allowed: torch.Tensor,  # bool [B, span]: context rows before the block + the block itself
    ) -> torch.Tensor:
        """Drafter logits for every block slot, [B, V] (slot 0 included; callers drop it)."""
        d = self.drafter
        h = self.embed(block_ids[None]).to(d.fc.weight.dtype)  # [1, B, H]
        b_len = block_ids.shape[0]
        cos, sin = d.rope(positions[None], h.dtype)
        cos, sin = rope_tables(cos[:, None], sin[:, None])  # [1, 1, B, hd]
        mask = gqa_mask(additive_mask(allowed, h.dtype), self.n_heads // self.n_kv)  # once for every layer
        for i, layer in enumerate(d.layers):
            attn = layer.self_attn
            x = rms_norm(layer.input_layernorm, h)
            q = rms_norm(attn.q_norm, attn.q_proj(x).view(1, b_len, self.n_heads, self.head_dim)).transpose(
                1, 2
            )
            k = rms_norm(attn.k_norm, attn.k_proj(x).view(1, b_len, self.n_kv, self.head_dim)).transpose(1, 2)
            v = attn.v_proj(x).view(1, b_len, self.n_kv, self.head_dim).transpose(1, 2)  # [1, kv, B, hd]
            q, k = _rope_qk(q, k, cos, sin)
            write_kv(self.cache, i, positions, k[0], v[0])
            o = _attend(q, self.cache[i, 0][None], self.cache[i, 1][None], mask, 1.0 / self.head_dim**0.5)
            o = o.transpose(1, 2).reshape(1, b_len, self.n_heads * self.head_dim)  # [1, B, heads·hd]
            h = h + attn.o_proj(o)
            h = h + target_mlp(layer, h)
        return self.lm_head(rms_norm(d.norm, h).to(self.lm_head.weight.dtype))[
            0
        ]  # [B, V] in the target's dtype
