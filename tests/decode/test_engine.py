"""The fast engine equals the reference: native forwards vs HF / DFlashDrafter, the device tree vs
build_tree, and FastEngine.generate vs reference generate (AR, chain, DDTree) token for token.

All on CPU in float64 with CUDA graphs off (the same phase functions run eagerly); the last
test replays the graphs on CUDA when there is one.
"""

from __future__ import annotations

import gc
import random
import weakref

import pytest
import torch
import torch.nn.functional as F

from flashdraft.decode.device_tree import (
    TreeInputs,
    TreePlan,
    build_tree_device,
    compile_tree_writer,
    draft_top,
    visibility_device,
    write_tree_inputs,
)
from flashdraft.decode.engine import FastEngine
from flashdraft.decode.engine import generate as fast_generate
from flashdraft.decode.generate import generate as reference_generate
from flashdraft.decode.native import (
    NativeDrafter,
    NativeTarget,
    _attend,
    additive_mask,
    gqa_mask,
    native_support_error,
)
from flashdraft.drafter import DrafterCache
from flashdraft.tree import build_tree, tree_visibility
from tests.conftest import tiny_drafter, tiny_target
from tests.decode.oracle import OracleDrafter

BLOCK = 8
BUDGETS = [1, 4, 8, 15, 32, 64]
METHODS = [("ar", None), ("chain", None)] + [("ddtree", b) for b in BUDGETS]


# ----------------------------------------------------------------------------- native forwards


def test_native_target_matches_hf(family):
    target = tiny_target(family, layers=4)
    ids = torch.randint(3, target.vocab_size, (19,), generator=torch.Generator().manual_seed(0))
    layer_ids = [3, 0, 2]  # unsorted on purpose, and the last layer (final-normed like HF's)
    ref = target.forward(ids[None], layer_ids=layer_ids)
    native = NativeTarget(target, capacity=40)
    pos = torch.arange(19)
    causal = torch.arange(40)[None] <= pos[:, None]  # [19, 40]
    # prefill 11, then 8 more against the cache: the cached path must agree with one full pass
    native.forward(ids[:11], pos[:11], pos[:11], causal[:11])
    out = native.forward(ids[11:], pos[11:], pos[11:], causal[11:], layer_ids=layer_ids)
    torch.testing.assert_close(out.logits, ref.logits[0, 11:], rtol=0, atol=1e-10)
    torch.testing.assert_close(out.features, ref.features[0, 11:], rtol=0, atol=1e-10)


@pytest.mark.parametrize("heads,kv", [(9, 3), (4, 4), (8, 1)])
def test_attend_folds_query_groups_instead_of_copying_the_cache(heads, kv):
    # the folded grouped-query attention equals attention with the cache repeated per query head (HF's repeat_kv)
    g = torch.Generator().manual_seed(heads)
    q_len, cap, hd = 5, 23, 8
    # strided, as the engine's q is
    q = torch.randn(1, q_len, heads, hd, generator=g, dtype=torch.float64).transpose(1, 2)
    k, v = (torch.randn(1, kv, cap, hd, generator=g, dtype=torch.float64) for _ in range(2))
    allowed = torch.rand(q_len, cap, generator=g) < 0.6
    allowed[:, 0] = True  # no row without a key
    mask = additive_mask(allowed, torch.float64)
    rep = heads // kv
    ref = F.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), attn_mask=mask, scale=0.3
    )
    out = _attend(q, k, v, gqa_mask(mask, rep), 0.3)
    assert out.shape == (1, heads, q_len, hd)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("bias", [False, True])
def test_fused_projections_are_views_of_one_weight_and_change_no_output(family, bias):
    """`fuse_projections`: q/k/v (and gate/up) become row views of one buffer each, not saved in the state dict,
    so nothing is stored twice; the transformers forward gives the same logits bit for bit, the fused matmuls the
    separate ones' results (float64); a second call changes nothing. With biases (Qwen2-style, Llama's
    attention_bias / mlp_bias) too."""
    from flashdraft.decode.native import fuse_projections, target_mlp, target_qkv

    target = tiny_target(family, layers=2)
    if bias:
        for layer in target.layers:
            for lin in (*[getattr(layer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj")],
                        layer.mlp.gate_proj, layer.mlp.up_proj):  # fmt: skip
                lin.bias = torch.nn.Parameter(torch.randn(lin.out_features, dtype=torch.float64))
    ids = torch.randint(3, target.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    before = target.forward(ids).logits
    keys = set(target.model.state_dict())
    h = torch.randn(1, 9, target.hidden_size, dtype=torch.float64)
    geometry = (4, 2, target.hidden_size // 4)
    pos = torch.arange(9)[None]
    cos, sin = target.model.model.rotary_emb(h, pos)
    cos, sin = cos[:, None], sin[:, None]
    layer = target.layers[1]
    separate = (*target_qkv(layer, h, *geometry, cos, sin), target_mlp(layer, h))
    fuse_projections(target)
    attn, mlp = layer.self_attn, layer.mlp
    assert (
        attn.q_proj.weight.untyped_storage().data_ptr() == attn.fused_qkv_weight.untyped_storage().data_ptr()
    )
    assert mlp.up_proj.weight.data_ptr() == mlp.fused_gate_up_weight[mlp.gate_proj.out_features :].data_ptr()
    assert (attn.fused_qkv_bias is not None) == bias
    assert set(target.model.state_dict()) == keys
    assert torch.equal(target.forward(ids).logits, before)
    fused = (*target_qkv(layer, h, *geometry, cos, sin), target_mlp(layer, h))
    for a, b in zip(fused, separate, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    buffer = attn.fused_qkv_weight
    fuse_projections(target)
    assert attn.fused_qkv_weight is buffer


def test_native_target_tree_mask_and_rows(family):
    """Rows written out of order with a non-causal mask: each query sees exactly the rows it may."""
    target = tiny_target(family, layers=3, seed=4)
    ids = torch.randint(3, target.vocab_size, (9,), generator=torch.Generator().manual_seed(1))
    native = NativeTarget(target, capacity=16)
    pos = torch.arange(6)
    native.forward(ids[:6], pos, pos, torch.arange(16)[None] <= pos[:, None])
    # a 3-node "tree": two siblings at position 6 (rows 6, 7), a child of the second at 7 (row 8)
    allowed = torch.arange(16)[None] < 6
    allowed = allowed.repeat(3, 1)
    allowed[0, 6] = allowed[1, 7] = allowed[2, 7] = allowed[2, 8] = True
    out = native.forward(ids[6:9], torch.tensor([6, 6, 7]), torch.tensor([6, 7, 8]), allowed)
    # the same logits from plain sequences: [..6 prompt, sibling] and [..., second sibling, child]
    a = target.forward(torch.cat([ids[:6], ids[6:7]])[None]).logits[0, -1]
    b = target.forward(torch.cat([ids[:6], ids[7:9]])[None]).logits[0, -2:]
    torch.testing.assert_close(out.logits, torch.cat([a[None], b]), rtol=0, atol=1e-10)


def test_native_drafter_matches_reference(family):
    target = tiny_target(family, layers=4)
    drafter = tiny_drafter(target, layers=2, block_size=BLOCK)
    feats = target.forward(torch.arange(3, 23)[None], layer_ids=drafter.target_layer_ids).features[
        0
    ]  # [20, k·H]
    nd = NativeDrafter(drafter, target, capacity=40)
    cache = DrafterCache.empty(2)
    mask = drafter.mask_token_id
    for start, end, bonus in [(0, 12, 5), (12, 15, 9)]:  # two rounds: 12 context rows, then 3 more
        block = torch.tensor([bonus] + [mask] * (BLOCK - 1))
        nd.write_context(feats[start:end], torch.arange(start, end))
        allowed = (torch.arange(40) < end + BLOCK)[None].expand(BLOCK, -1)
        got = nd.forward_block(block, torch.arange(end, end + BLOCK), allowed)
        hidden = drafter(
            feats[None, start:end],
            target.embed_tokens(block[None]),
            torch.arange(start, end + BLOCK)[None],
            cache=cache,
        )
        torch.testing.assert_close(got, target.lm_head(hidden)[0], rtol=0, atol=1e-10)


def test_target_logits_are_float32_on_a_bf16_target():
    """bf16 logits tie exactly at the top often enough to split AR from verify (HeadFP32's docstring):
    the native forwards (engine and regeneration) compute the head in float32 on the bf16 hidden states."""
    from flashdraft.data.native import BatchedNativeTarget

    target = tiny_target("llama", layers=2, dtype=torch.bfloat16, vocab=211)
    ids = torch.randint(3, target.vocab_size, (9,), generator=torch.Generator().manual_seed(1))
    native = NativeTarget(target, capacity=16)
    out = native.forward(ids, torch.arange(9), torch.arange(9), torch.arange(16)[None] <= torch.arange(9)[:, None],
                         layer_ids=[1])  # fmt: skip
    assert out.logits is not None and out.logits.dtype == torch.float32
    w = target.lm_head.weight.float()
    torch.testing.assert_close(
        out.logits, out.features.float() @ w.T, rtol=0, atol=0
    )  # last layer: final-normed
    assert not torch.equal(
        out.logits, target.lm_head(out.features).float()
    )  # the bf16 head rounds differently
    batched = BatchedNativeTarget(target, rows=2, capacity=16)
    first = batched.prefill(torch.arange(2), ids[None].expand(2, -1).contiguous(), torch.tensor([9, 9]))
    assert first.dtype == torch.float32
    torch.testing.assert_close(
        first[0], out.logits[-1], rtol=0, atol=0.1
    )  # bf16 hidden states: other kernels


def test_engine_follows_drafter_weights_changed_in_place():
    """The native drafter stacks the layers' K/V projections once; a drafter trained between two generate
    calls (in-place optimizer updates) must draft with its new weights, as a fresh engine would."""
    target = tiny_target("llama", layers=3)
    drafter = tiny_drafter(target, layers=2)
    engine = FastEngine(target, drafter, max_len=64, cuda_graphs=False)
    prompt = [5, 9, 14, 3, 22, 7]
    engine.generate(prompt, max_new_tokens=12, method="chain")
    with torch.no_grad():
        for p in drafter.parameters():
            p.mul_(1.5)
    got = engine.generate(prompt, max_new_tokens=12, method="chain")
    fresh = FastEngine(target, drafter, max_len=64, cuda_graphs=False).generate(
        prompt, max_new_tokens=12, method="chain"
    )
    assert got.tokens == fresh.tokens
    assert got.acceptance_lengths == fresh.acceptance_lengths  # the same drafts, round by round


def test_generate_keeps_one_engine_when_ar_and_drafted_calls_alternate(fast_engine_builds: list[int]) -> None:
    """`flashdraft bench` runs every method on each prompt in turn: an AR call between two drafted ones must
    reuse the engine (an AR row with its own engine paid a rebuild and CUDA-graph capture per prompt, and
    so did the next drafted row), and still give AR's tokens."""
    from flashdraft.decode import engine as fast

    target = tiny_target("llama", layers=3)
    drafter = tiny_drafter(target, layers=2)
    prompt = [5, 9, 14, 3, 22, 7]
    ar_alone = FastEngine(target, None, max_len=64, cuda_graphs=False).generate(
        prompt, max_new_tokens=12, method="ar"
    )
    for method in ("chain", "ar", "chain", "ar"):
        res = fast.generate(
            target, None if method == "ar" else drafter, prompt, max_new_tokens=12, method=method
        )
        if method == "ar":
            assert res.tokens == ar_alone.tokens
    assert len(fast_engine_builds) == 1
    # an AR call the kept engine is too short for builds its own, drafterless; the next drafted call builds again
    chain = fast.generate(target, drafter, prompt, max_new_tokens=12, method="chain")
    fast.generate(target, None, prompt, max_new_tokens=2100, method="ar")
    assert fast.generate(target, drafter, prompt, max_new_tokens=12, method="chain").tokens == chain.tokens
    assert len(fast_engine_builds) == 3
    # a rebuild frees the engine it replaces before it builds the next, though its phases close over it (a
    # reference cycle); the automatic collector off, so that only the rebuild's own collection can free it
    old = weakref.ref(fast._ENGINE["engine"])
    build = fast.FastEngine.__init__
    alive_at_build: list[bool] = []

    def init(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        alive_at_build.append(old() is not None)
        build(self, *args, **kwargs)

    gc.disable()
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(fast.FastEngine, "__init__", init)
            fast.generate(target, None, prompt, max_new_tokens=2100, method="ar")
    finally:
        gc.enable()
    assert alive_at_build == [False]


def test_native_support_refuses_other_families():
    from transformers import GPT2Config, GPT2LMHeadModel

    from flashdraft.target import TargetModel

    cfg = GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2)
    with pytest.raises(ValueError, match="cannot find decoder layers|no native forward"):
        target = TargetModel(GPT2LMHeadModel(cfg))
        assert native_support_error(target) is not None
        FastEngine(target)


# ----------------------------------------------------------------------------- device tree


def _tree_cases():
    g = torch.Generator().manual_seed(0)
    yield "random", torch.randn(7, 50, generator=g) * 2.0
    yield "peaked", torch.randn(7, 50, generator=g) * 8.0
    # integer logits: many exact ties, so every tie-break rule of the heap is exercised
    yield "ties", torch.randint(0, 4, (7, 50), generator=g).double()
    yield "small_vocab", torch.randn(5, 3, generator=g)
    # identical slots of repeated values: equal scores across depths and within each depth's list
    yield "same_rows", (torch.randint(0, 3, (1, 40), generator=g) * 1.5).expand(7, -1).contiguous()
    # -inf logits: tokens of probability 0, so -inf scores in the lists, and in the trees of budget
    # 100 once the 2 + 4 + 4 + 8 + 16 + 32 finite prefixes run out, tied among themselves
    masked = torch.randn(6, 30, generator=g)
    masked[:, 2:] = float("-inf")
    masked[2, 1:] = float("-inf")  # slot 3 has one finite token
    yield "neg_inf", masked


@pytest.mark.parametrize("case, logits", list(_tree_cases()))
def test_build_tree_device_equals_heap(case, logits):
    num_slots, vocab = logits.shape
    for budget in [1, 2, 3, 8, 15, 31, 64, 100]:
        if sum(min(budget, vocab) ** d for d in range(1, num_slots + 1)) < budget:
            continue
        ref = build_tree(logits, budget)
        plan = TreePlan.make(budget, num_slots, vocab, logits.device)
        got = build_tree_device(logits, plan)
        assert got.tokens.tolist() == ref.tokens.tolist(), (case, budget)
        assert got.parents.tolist() == [0] + ref.parents[1:], (case, budget)
        assert got.depths.tolist() == [0] + ref.depths.tolist(), (case, budget)
        torch.testing.assert_close(got.log_probs.float(), ref.log_probs, rtol=0, atol=0)
        vis = visibility_device(got.parents, num_slots + 1)
        assert torch.equal(vis, tree_visibility(ref)), (case, budget)


# ----------------------------------------------------------------------------- compiled tree phase

# the tree phase compiles once per shape (~10-15 s each with inductor's CPU backend on 2 cores): the cases
# are grouped by the shapes the compiled function sees (top-k lists [L, k], the cache's columns), and the
# engine test below builds FastEngine(max_len=64, max_budget=33) over 8-token blocks, whose phases have
# exactly these shapes, so it reuses these compilations when both run in one process
CAP = 112  # that engine's cache columns: -(-(64 + 34) // 16) * 16


def _compiled_tree_cases():
    """(case, logits, budget): `_tree_cases` at budgets 1, 8, 33, in 4 compiled shapes."""
    cases = dict(_tree_cases())
    for case, logits in cases.items():
        yield case, logits, 1  # top-1 lists [1, 1] whatever the logits
    seven = {k: v for k, v in cases.items() if v.shape[0] == 7}  # random, peaked, ties, same_rows
    # -inf at 7 slots: one finite token per slot after the first, so only 2 finite prefixes per depth
    # (14 in all): budget 33 takes 19 -inf nodes, tied among themselves
    masked = cases["peaked"].clone()
    masked[:, 2:] = float("-inf")
    masked[1:, 1:] = float("-inf")
    seven["neg_inf_7"] = masked
    for budget in (8, 33):
        for case, logits in seven.items():
            yield case, logits, budget
    yield "small_vocab", cases["small_vocab"], 8  # 3 tokens < budget: NaN places in the depth-1 list


def _write_tree(write, logits: torch.Tensor, budget: int):
    num_slots, vocab = logits.shape
    dev = logits.device
    plan = TreePlan.make(budget, num_slots, vocab, dev)
    long = dict(dtype=torch.long, device=dev)
    out = TreeInputs(*(torch.zeros(budget + 1, **long) for _ in range(3)),
                     torch.zeros(budget + 1, CAP, dtype=torch.bool, device=dev),
                     torch.zeros(budget + 1, **long), torch.zeros(budget + 1, **long))  # fmt: skip
    # the tree block at cache rows 40..40 + budget
    seq_len, bonus = torch.tensor([40], **long), torch.tensor([7], **long)
    hops = min(num_slots + 1, budget + 1)  # as the engine's: min(block, budget + 1)
    tree = write(*draft_top(logits, plan), plan, seq_len, bonus, torch.arange(CAP, **long), hops, out)
    return tree, out


@pytest.mark.slow
def test_compiled_tree_inputs_equal_eager():
    """`compile_tree_writer` (inductor, here its CPU backend) writes exactly the eager phase's inputs.

    ~50 s on 2 cores, nearly all of it 4 compilations; the sorts are aten's on CPU (inductor's Triton
    sort runs only on CUDA: test_compiled_tree_on_gpu)."""
    compiled = compile_tree_writer()
    seen = set()
    for case, logits, budget in _compiled_tree_cases():
        want, want_out = _write_tree(write_tree_inputs, logits, budget)
        got, got_out = _write_tree(compiled, logits, budget)
        for name in ("tokens", "parents", "depths", "log_probs"):  # float64 scores bit for bit, -inf included
            assert torch.equal(getattr(got, name), getattr(want, name)), (case, budget, name)
        for name in vars(want_out):  # tokens, positions, rows, allowed, parents, depths
            assert torch.equal(getattr(got_out, name), getattr(want_out, name)), (case, budget, name)
        seen.add((case, budget))
        if case == "neg_inf_7" and budget == 33:
            assert (want.log_probs == float("-inf")).sum() == 19
    # the eager phase is the heap's tree (test_build_tree_device_equals_heap), its mask the reference's
    ref = build_tree(dict(_tree_cases())["ties"], 33)
    tree, out = _write_tree(compiled, dict(_tree_cases())["ties"], 33)
    assert tree.tokens.tolist() == ref.tokens.tolist() and tree.parents.tolist() == [0] + ref.parents[1:]
    assert torch.equal(out.allowed[:, 40:74], tree_visibility(ref)) and out.allowed[:, :40].all()
    assert not out.allowed[:, 74:].any()
    assert len(seen) == 6 + 5 * 2 + 1


@pytest.mark.slow
def test_engine_compiled_tree_equals_ar():
    """FastEngine(compile_tree=True): DDTree is token-identical to greedy AR (float64) and to the eager
    engine round for round, with a mostly-right drafter so trees are accepted deep."""
    target = tiny_target("llama", layers=4, seed=5)
    inner = tiny_drafter(target, layers=1, block_size=BLOCK, seed=0)
    rng = random.Random(3)
    deep = 0
    for _ in range(2):
        prompt = _prompt(rng, target.vocab_size)
        max_new = rng.randint(16, 30)
        ar = reference_generate(target, None, prompt, max_new_tokens=max_new, method="ar").tokens
        for budget in (1, 8, 33):
            results = []
            for compile_tree in (False, True):
                oracle = OracleDrafter(target, inner, prompt, error_rate=0.3, sharpness=8.0, seed=3)
                engine = OracleEngine(target, oracle, max_len=64, max_budget=33, compile_tree=compile_tree)
                assert engine.capacity == CAP
                results.append(engine.generate(prompt, max_new_tokens=max_new, method="ddtree", budget=budget,
                                               on_tokens=oracle.on_tokens))  # fmt: skip
            eager, compiled = results
            _same(compiled, eager, budget)
            assert compiled.tokens == ar, budget
            deep += sum(a > 2 for a in compiled.acceptance_lengths)
    assert deep > 0


@pytest.mark.slow
def test_tree_build_benchmark_smoke(tmp_path):
    """benchmarks/gpu/tree_build.py --device cpu: its engines have the shapes above (no new compilation in a
    run of this file; ~25 s alone)."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "tree_build.py"
    spec = importlib.util.spec_from_file_location("tree_build", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.main(["--device", "cpu", "--replays", "2", "--out", str(tmp_path / "tree_build.json")])
    assert [r["budget"] for r in rows] == [8, 33]
    assert all(r["compiled_equal"] and r["compiled_ms"] > 0 and r["eager_ms"] > 0 for r in rows)
    assert json.loads((tmp_path / "tree_build.json").read_text())["meta"]["variants"] == ["eager", "compiled"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_tree_on_gpu():
    """On CUDA inductor sorts lists of <= 512 entries in its own Triton kernel: same trees, same mask."""
    compiled = compile_tree_writer()
    failed = []  # every case's compile error, not just the first
    for case, logits, budget in _compiled_tree_cases():
        if budget == 1:
            continue  # the engine keeps budget 1 eager (FastEngine._treebuf)
        want, want_out = _write_tree(write_tree_inputs, logits.cuda(), budget)
        try:
            got, got_out = _write_tree(compiled, logits.cuda(), budget)
        except Exception as e:  # noqa: BLE001 — collected, asserted below
            failed.append((case, budget, f"{type(e).__name__}: {str(e)[:200]}"))
            continue
        for name in ("tokens", "parents", "depths", "log_probs"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (case, budget, name)
        for name in vars(want_out):
            assert torch.equal(getattr(got_out, name), getattr(want_out, name)), (case, budget, name)
    assert not failed, failed


def test_compile_tree_default_follows_cuda_graphs():
    """The compiled tree phase is the default only where the phases are CUDA graphs (CPU: eager, no compile)."""
    target = tiny_target("llama", layers=1, seed=0)
    drafter = tiny_drafter(target, layers=1, block_size=BLOCK)
    assert FastEngine(target, drafter, max_len=32, max_budget=8).compile_tree is False
    assert FastEngine(target, drafter, max_len=32, max_budget=8, compile_tree=True).compile_tree is True


def test_tree_plan_refuses_impossible_budget():
    with pytest.raises(ValueError, match="exceeds"):
        TreePlan.make(20, 2, 3, torch.device("cpu"))  # only 3 + 9 prefixes exist


# ----------------------------------------------------------------------------- generation


def _prompt(rng: random.Random, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(rng.randint(2, 14))]


def _same(a, b, what) -> None:
    assert a.tokens == b.tokens, what
    assert a.acceptance_lengths == b.acceptance_lengths, what
    assert a.tree_paths == b.tree_paths, what  # what `auto` reads for the smaller budgets
    assert (a.rounds, a.stop_reason, a.prompt_tokens) == (b.rounds, b.stop_reason, b.prompt_tokens), what


@pytest.mark.parametrize("seed", [0, 1])
def test_engine_identity_random_drafter(family, seed):
    """AR, chain and every budget: the engine's tokens, τ per round and stop reason equal the reference's."""
    target = tiny_target(family, layers=4, seed=seed)
    drafter = tiny_drafter(target, layers=1, block_size=BLOCK, seed=seed + 10)
    engine = FastEngine(target, drafter, max_len=64, max_budget=64)  # one engine, reused: state must reset
    rng = random.Random(seed)
    for _ in range(3):
        prompt = _prompt(rng, target.vocab_size)
        max_new = rng.randint(6, 14)
        ar = reference_generate(target, None, prompt, max_new_tokens=max_new, method="ar")
        for method, budget in METHODS:
            ref = reference_generate(
                target, drafter, prompt, max_new_tokens=max_new, method=method, budget=budget
            )
            got = engine.generate(prompt, max_new_tokens=max_new, method=method, budget=budget)
            _same(got, ref, (family, seed, method, budget))
            assert got.tokens == ar.tokens


class OracleEngine(FastEngine):
    """The engine with the oracle's draft logits swapped in after its (real) drafter pass."""

    def __init__(self, target, oracle: OracleDrafter, **kw) -> None:
        super().__init__(target, oracle.inner, **kw)
        self.oracle = oracle

    def _draft(self, span: int | None = None) -> None:
        super()._draft(span)
        o = self.oracle
        assert int(self.bonus.item()) == o.seq[-1], "engine: the bonus is not the last committed token"
        hidden = o.greedy_hidden(tuple(o.seq)) * o.sharpness  # [B-1, H], as OracleDrafter.forward
        if o.error_rate > 0:
            wrong = torch.rand(hidden.shape[0], generator=o.gen) < o.error_rate
            noise = (
                torch.randn(hidden.shape, generator=o.gen, dtype=hidden.dtype) * hidden.norm(dim=-1).mean()
            )
            hidden = torch.where(wrong[:, None], noise, hidden)
        self.draft_logits.copy_(self.target.lm_head(hidden))


@pytest.mark.parametrize("error_rate", [0.0, 0.3])
def test_engine_identity_oracle_drafter(family, error_rate):
    """A (mostly) right drafter: full blocks, stop tokens and length limits inside accepted blocks."""
    target = tiny_target(family, layers=4, seed=5)
    inner = tiny_drafter(target, layers=1, block_size=BLOCK, seed=0)
    rng = random.Random(7)
    full_blocks = 0
    for _ in range(2):
        prompt = _prompt(rng, target.vocab_size)
        max_new = rng.randint(12, 30)
        ar = reference_generate(target, None, prompt, max_new_tokens=max_new, method="ar").tokens
        stop = [ar[rng.randrange(2, len(ar))]]
        for stop_ids in (None, stop):
            for method, budget in [("chain", None), ("ddtree", 8), ("ddtree", 64)]:
                ref_oracle = OracleDrafter(
                    target, inner, prompt, error_rate=error_rate, sharpness=8.0, seed=3
                )
                ref = reference_generate(
                    target, ref_oracle, prompt, max_new_tokens=max_new, method=method, budget=budget,
                    stop_token_ids=stop_ids, on_tokens=ref_oracle.on_tokens,
                )  # fmt: skip
                oracle = OracleDrafter(target, inner, prompt, error_rate=error_rate, sharpness=8.0, seed=3)
                engine = OracleEngine(target, oracle, max_len=64, max_budget=64)
                got = engine.generate(
                    prompt, max_new_tokens=max_new, method=method, budget=budget, stop_token_ids=stop_ids,
                    on_tokens=oracle.on_tokens,
                )  # fmt: skip
                _same(got, ref, (family, method, budget, stop_ids))
                expected = ar if stop_ids is None else ar[: ar.index(stop[0]) + 1]
                assert got.tokens == expected
                full_blocks += got.acceptance_lengths.count(BLOCK)
                if error_rate == 0 and method == "chain":
                    assert all(a == BLOCK for a in got.acceptance_lengths[:-1]), got.acceptance_lengths
    assert full_blocks > 0


def test_engine_sampling_matches_reference():
    """T > 0 with top-p: the same seed gives the same tokens (same generator calls, same order)."""
    target = tiny_target("llama", layers=3, seed=2)
    drafter = tiny_drafter(target, layers=1, block_size=BLOCK)
    engine = FastEngine(target, drafter, max_len=64, max_budget=16)
    for method, budget in [("ar", None), ("chain", None), ("ddtree", 16)]:
        kw = dict(max_new_tokens=24, method=method, budget=budget, temperature=0.8, top_p=0.9, seed=11)
        ref = reference_generate(target, drafter, [4, 9, 13], **kw)
        _same(engine.generate([4, 9, 13], **kw), ref, method)
    a = engine.generate([4, 9, 13], max_new_tokens=24, method="chain", temperature=0.8, seed=1).tokens
    b = engine.generate([4, 9, 13], max_new_tokens=24, method="chain", temperature=0.8, seed=2).tokens
    assert a != b  # the seed is used


def test_engine_edges_and_errors():
    target = tiny_target("qwen3", layers=2)
    drafter = tiny_drafter(target, layers=1, block_size=BLOCK)
    engine = FastEngine(target, drafter, max_len=32, max_budget=8)
    assert engine.generate([5, 6], max_new_tokens=0).tokens == []
    one = engine.generate([5, 6], max_new_tokens=1, method="ddtree", budget=8)
    assert len(one.tokens) == 1 and one.rounds == 0
    with pytest.raises(ValueError, match="max_len"):
        engine.generate(list(range(3, 30)), max_new_tokens=10)
    with pytest.raises(ValueError, match="max_budget"):
        engine.generate([5, 6], max_new_tokens=4, method="ddtree", budget=16)
    with pytest.raises(ValueError, match="needs budget"):
        engine.generate([5, 6], max_new_tokens=4, method="ddtree")
    # the same request checks as the reference decoder's (flashdraft.decode.generate.check_request)
    with pytest.raises(ValueError, match="budget -1 must be >= 0"):
        engine.generate([5, 6], max_new_tokens=4, method="ddtree", budget=-1)
    with pytest.raises(ValueError, match="method 'chain' needs a drafter"):
        FastEngine(target, max_len=32).generate([5, 6], max_new_tokens=4)
    seen: list[list[int]] = []
    res = engine.generate([5, 6], max_new_tokens=20, on_tokens=lambda t: seen.append(t) or len(seen) < 2)
    assert res.stop_reason == "cancelled" and sum(seen, []) == res.tokens
    # the convenience wrapper builds (and keeps) an engine; the AR path needs no drafter
    ar = fast_generate(target, None, [5, 6], max_new_tokens=6, method="ar")
    assert ar.tokens == reference_generate(target, None, [5, 6], max_new_tokens=6, method="ar").tokens


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_equal_eager_on_gpu():
    target = tiny_target("llama", layers=4, dtype=torch.float32)
    target.model.cuda()
    drafter = tiny_drafter(target, layers=1, block_size=BLOCK).cuda()
    graphs = FastEngine(target, drafter, max_len=96, max_budget=32, cuda_graphs=True, compile_tree=False)
    assert FastEngine(target, drafter, max_len=96, max_budget=32).compile_tree  # the default with CUDA graphs
    eager = FastEngine(target, drafter, max_len=96, max_budget=32, cuda_graphs=False)
    # the tree phase compiled in the graph's warm-up, then captured
    compiled = FastEngine(target, drafter, max_len=96, max_budget=32, cuda_graphs=True, compile_tree=True)
    for method, budget in [("ar", None), ("chain", None), ("ddtree", 8), ("ddtree", 32)]:
        a = graphs.generate([5, 9, 11], max_new_tokens=40, method=method, budget=budget)
        b = eager.generate([5, 9, 11], max_new_tokens=40, method=method, budget=budget)
        _same(a, b, method)
        if method == "ddtree":
            _same(compiled.generate([5, 9, 11], max_new_tokens=40, method=method, budget=budget), b, budget)


def test_attention_spans_follow_the_sequence_and_change_no_token(monkeypatch):
    """A round attends over the cache rows it can see (the smallest span holding the committed length and its
    q rows), not the whole cache: a generation crossing several spans gives the tokens, acceptance and tree paths
    of the same engine attending over the whole cache, float64, every method."""
    target = tiny_target("qwen3", layers=3, seed=2)
    drafter = tiny_drafter(target, layers=1, block_size=BLOCK)
    prompt = [3 + (7 * i) % (target.vocab_size - 3) for i in range(50)]
    spans = FastEngine(target, drafter, max_len=256, max_budget=32)
    whole = FastEngine(target, drafter, max_len=256, max_budget=32)
    monkeypatch.setattr(whole, "_spans", lambda: [whole.capacity])
    for method, budget in [("ar", None), ("chain", None), ("ddtree", 8), ("ddtree", 32)]:
        kw = dict(max_new_tokens=120, method=method, budget=budget)
        _same(spans.generate(prompt, **kw), whole.generate(prompt, **kw), (method, budget))
    used = {k[-1] for k in spans._phases if k[0] == "verify_chain"}
    assert {64, 128, 192} <= used and max(used) < spans.capacity  # 50 + 120 tokens + q: never the whole cache
    assert {k[-1] for k in whole._phases if k[0] == "verify_chain"} == {whole.capacity}


@pytest.mark.parametrize("graph_prefill", [False, True])
def test_padded_prefill_changes_no_token(graph_prefill):
    """The prefill runs the prompt padded to `prefill_bucket` rows (64 on CUDA), or to a power of two of at least 64
    (`graph_prefill`: a phase per row count, eager here): the padding's K/V and drafter context sit past the
    committed length, hidden until rounds overwrite them. float64, prompts of several lengths (one that the padding
    would push past the caches, clamped): the reference decoder's tokens and acceptance."""
    target = tiny_target("qwen3", layers=3, seed=2)
    drafter = tiny_drafter(target, layers=1, block_size=BLOCK)
    engine = FastEngine(target, drafter, max_len=180, max_budget=16)
    engine.prefill_bucket, engine.graph_prefill = 64, graph_prefill
    assert engine._prefill_rows(3) == 64 and engine._prefill_rows(65) == 128
    assert engine._prefill_rows(130) == engine.d_capacity == 192  # within both caches (the target's: 208)
    for n in (3, 40, 64, 100, 150):
        prompt = [3 + (11 * i) % (target.vocab_size - 3) for i in range(n)]
        for method, budget in [("ar", None), ("chain", None), ("ddtree", 16)]:
            got = engine.generate(prompt, max_new_tokens=20, method=method, budget=budget)
            ref = reference_generate(target, drafter, prompt, max_new_tokens=20, method=method, budget=budget)
            assert got.tokens == ref.tokens, (n, method)
            assert got.acceptance_lengths == ref.acceptance_lengths, (n, method)
    assert any(k[0] == "prefill" for k in engine._phases) == graph_prefill


def test_attention_span_lists():
    target = tiny_target("llama", layers=2)
    eng = FastEngine(target, tiny_drafter(target, layers=1, block_size=BLOCK), max_len=1000, max_budget=32)
    assert eng.capacity == 1040 and eng._spans()[:3] == [64, 128, 192] and eng._spans()[-2:] == [1024, 1040]
    assert (eng._span(1), eng._span(65), eng._span(1040), eng._span(None)) == (64, 128, 1040, 1040)
    eng.cuda_graphs = True  # a graph per span and phase: a short list
    assert eng._spans() == [256, 512, 1024, 1040] and eng._span(300) == 512
    # compiled forwards take the span as a symbolic size: the same spans, one compilation
    eng.compile_target = eng.compile_drafter = True
    assert eng._spans() == [256, 512, 1024, 1040]
    assert eng._drafter_span(512) == 512 and eng._drafter_span(1040) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_at_every_span_equal_eager_on_gpu():
    """Graphs captured per attention span (256, 512, whole cache), all at the phase's first use, then replayed as
    a long generation crosses them: the eager engine's tokens (its spans are multiples of 64), float32."""
    target = tiny_target("llama", layers=4, dtype=torch.float32)
    target.model.cuda()
    drafter = tiny_drafter(target, layers=1, block_size=BLOCK).cuda()
    graphs = FastEngine(target, drafter, max_len=640, max_budget=32, cuda_graphs=True)
    eager = FastEngine(target, drafter, max_len=640, max_budget=32, cuda_graphs=False)
    prompt = [3 + (7 * i) % (target.vocab_size - 3) for i in range(230)]
    for method, budget in [("ar", None), ("chain", None), ("ddtree", 32)]:
        kw = dict(max_new_tokens=300, method=method, budget=budget)
        _same(graphs.generate(prompt, **kw), eager.generate(prompt, **kw), method)
    assert {k[-1] for k in graphs._phases if k[0] == "verify_chain"} == {256, 512, graphs.capacity}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_prefill_equals_the_eager_prefill_on_gpu():
    """The prefill as a CUDA graph per power-of-two row count: the eager prefill's tokens, greedy and sampled
    (seeded: the capture's warm-up draws come before the seeding), float32, prompts in three buckets."""
    target = tiny_target("llama", layers=4, dtype=torch.float32)
    target.model.cuda()
    drafter = tiny_drafter(target, layers=1, block_size=BLOCK).cuda()
    graphed = FastEngine(target, drafter, max_len=640, max_budget=32, graph_prefill=True)
    plain = FastEngine(target, drafter, max_len=640, max_budget=32)
    for n in (5, 100, 300):
        prompt = [3 + (7 * i) % (target.vocab_size - 3) for i in range(n)]
        for method, budget in [("ar", None), ("chain", None), ("ddtree", 32)]:
            for kw in (dict(), dict(temperature=0.8, seed=3)):
                args = dict(max_new_tokens=24, method=method, budget=budget, **kw)
                _same(graphed.generate(prompt, **args), plain.generate(prompt, **args), (n, method, kw))
    assert {k[1] for k in graphed._phases if k[0] == "prefill"} == {64, 128, 512}
    assert all(ph.graph is not None for k, ph in graphed._phases.items() if k[0] == "prefill")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_engine_built_after_a_graphed_prefill_engine_was_deleted_captures_on_gpu():
    """`engine_spans.py`'s order on the H100 (2026-12-07): engines with the eager prefill, then one with the
    graphed prefill, deleted, then a larger engine, whose first AR graph failed to capture ("operation failed due
    to a previous error during capture"). Each engine decodes; the last gives the first's tokens."""
    target = tiny_target("llama", layers=2, dtype=torch.float32)
    target.model.cuda()
    drafter = tiny_drafter(target, layers=1, block_size=BLOCK).cuda()
    prompt = [3 + (7 * i) % (target.vocab_size - 3) for i in range(150)]
    want = {}
    for max_len, graph_prefill in [(400, False), (400, True), (2048, False), (2048, True)]:
        engine = FastEngine(target, drafter, max_len=max_len, max_budget=512, graph_prefill=graph_prefill)
        for method, budget in [("ar", None), ("chain", None), ("ddtree", 16)]:
            got = engine.generate(prompt, max_new_tokens=16, method=method, budget=budget).tokens
            assert want.setdefault(method, got) == got, (max_len, graph_prefill, method)
        del engine


def test_phases_never_read_the_host():
    """A CUDA graph cannot hold a host read: no `.item()`-like op (incl. 0-d tensor indexing) in any phase."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from flashdraft.decode import engine as engine_mod

    class Watch(TorchDispatchMode):
        reads = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func is torch.ops.aten._local_scalar_dense.default:
                Watch.reads += 1
            return func(*args, **(kwargs or {}))

    target = tiny_target("qwen3", layers=2)
    drafter = tiny_drafter(target, layers=1, block_size=BLOCK)
    engine = FastEngine(target, drafter, max_len=48, max_budget=16)
    engine.graph_prefill = True  # the prefill as a phase too (eager here: no CUDA)
    plain = engine_mod._Phase.__call__

    def watched(self) -> None:  # type: ignore[no-untyped-def]
        with Watch():
            plain(self)

    engine_mod._Phase.__call__ = watched
    try:
        for method, budget in [("ar", None), ("chain", None), ("ddtree", 16)]:
            res = engine.generate(
                [5, 6, 7], max_new_tokens=10, method=method, budget=budget, temperature=0.5, seed=0
            )
            assert res.rounds > 0
    finally:
        engine_mod._Phase.__call__ = plain
    assert Watch.reads == 0 and any(k[0] == "prefill" for k in engine._phases)
