"""Triton decode kernels vs the readable float64 reference, hypothesis-drawn around the traps.

Without CUDA the kernels run under the Triton interpreter in float32/float16 (the interpreter is
wrong in bfloat16), with few examples; on a GPU in bfloat16 too, plus fp8, CUDA-graph capture +
replay and a side stream. Outputs are NaN-poisoned before every run; data is never zero; top-k is
compared tie-aware; batch invariance is bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import example, given, settings
from hypothesis import strategies as st

from canary.oracles.tolerances import assert_close_to_reference
from canary.oracles.topk_compare import wrong_topk_indices
from runtime.kernels import cuda_torch, reference
from runtime.kernels.triton import INTERPRETED, attention, elementwise, glue, indexer, matmul, mla_grouped, moe

pytestmark = pytest.mark.kernels

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.bfloat16, torch.float16] if ON_GPU else [torch.float32, torch.float16]
# Few examples: the interpreter runs each program in Python, and on the GPU each new shape compiles.
EXAMPLES = settings(max_examples=15)
SEEDS = st.integers(0, 2**31 - 1)
ROWS = st.sampled_from([0, 1, 2, 15, 16, 17, 33])  # 0/1 rows and the BLOCK_M tile +- 1
gpu = pytest.mark.gpu


def randn(gen: torch.Generator, *shape: int, scale: float = 1.0, dtype=torch.float32) -> torch.Tensor:
    t = torch.randn(*shape, generator=gen) * scale
    return torch.where(t == 0, torch.full_like(t, 1e-3), t).to(dtype).to(DEVICE)


def poisoned(*shape: int, dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def assert_prefix_invariant(full: torch.Tensor, run_prefix, rows: int) -> None:
    """f(x)[:k] == f(x[:k]) bit for bit for several prefixes k."""
    for k in sorted({1, rows // 2, rows - 1}):
        if 0 < k < rows:
            assert torch.equal(full[:k], run_prefix(k)), f"row results changed with the batch (k={k} of {rows})"


def assert_close_scaled(actual, expected, dtype, msg=""):
    # Errors scale with the largest term, not with each (possibly cancelling) element.
    magnitude = max(1.0, float(expected.abs().max())) if expected.numel() else 1.0
    assert not torch.isnan(actual).any(), f"NaN in output (unwritten?) {msg}"
    assert_close_to_reference(actual.cpu(), expected, dtype, scale=4 * magnitude, msg=msg)


# ---------------------------------------------------------------- fused MoE

def _moe_case(seed, tokens, experts, top_k, hidden, inter, shared, dtype, magnitude):
    gen = torch.Generator().manual_seed(seed)
    w_gate = randn(gen, experts, inter, hidden, scale=hidden ** -0.5, dtype=dtype)
    w_up = randn(gen, experts, inter, hidden, scale=hidden ** -0.5, dtype=dtype)
    w_down = randn(gen, experts, hidden, inter, scale=inter ** -0.5, dtype=dtype)
    shared_w = [randn(gen, inter, hidden, scale=hidden ** -0.5, dtype=dtype),
                randn(gen, inter, hidden, scale=hidden ** -0.5, dtype=dtype),
                randn(gen, hidden, inter, scale=inter ** -0.5, dtype=dtype)] if shared else [None] * 3
    x = randn(gen, tokens, hidden, scale=magnitude, dtype=dtype)
    # Few experts get all the tokens (experts with no tokens are the rule, as in decode).
    used = torch.randperm(experts, generator=gen)[:max(top_k, experts // 2)]
    ids = torch.stack([used[torch.randperm(len(used), generator=gen)[:top_k]] for _ in range(tokens)]) \
        if tokens else torch.empty(0, top_k, dtype=torch.long)
    route_w = torch.rand(tokens, top_k, generator=gen) + 0.25
    route_w[:, -1] = route_w[:, 0]  # tied weights
    return x, (w_gate, w_up, w_down, *shared_w), ids.to(DEVICE), route_w.to(DEVICE)


def _moe_reference(x, raw, ids, route_w):
    w_gate, w_up, w_down, s_gate, s_up, s_down = [w.cpu() if w is not None else None for w in raw]
    x, ids, route_w = x.cpu(), ids.cpu(), route_w.cpu()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            out[t] += float(route_w[t, j]) * reference.swiglu_expert(x[t], w_gate[e], w_up[e], w_down[e])
        if s_gate is not None:
            out[t] += reference.swiglu_expert(x[t], s_gate, s_up, s_down)
    return out


def fp8_packed(raw, shared: bool) -> moe.PackedMoE:
    """_moe_case's weights (w_gate, w_up, w_down, then the shared expert's three) as fp8 128x128 blocks."""
    return moe.quantize_packed(moe.pack_weights(*raw[:3], *(raw[3:] if shared else [None] * 3)))


def _run_moe(x, packed, ids, route_w, split_k=1):
    out = poisoned(*x.shape, dtype=x.dtype)
    result = moe.fused_moe(x, packed, route_w, ids, out=out, split_k=split_k)
    assert result.data_ptr() == out.data_ptr()
    return out


@EXAMPLES
@given(seed=SEEDS, tokens=ROWS, shape=st.sampled_from([(9, 3, 130, 40), (4, 1, 48, 20), (16, 6, 64, 17)]),
       shared=st.booleans(), dtype=st.sampled_from(DTYPES), magnitude=st.sampled_from([1.0, 20.0]),
       split_k=st.sampled_from([1, 3]))
@example(seed=0, tokens=17, shape=(9, 3, 130, 40), shared=True, dtype=DTYPES[0], magnitude=20.0, split_k=3)
def test_fused_moe_matches_reference_and_is_batch_invariant(seed, tokens, shape, shared, dtype, magnitude, split_k):
    experts, top_k, hidden, inter = shape
    x, raw, ids, route_w = _moe_case(seed, tokens, experts, top_k, hidden, inter, shared, dtype, magnitude)
    packed = moe.pack_weights(*raw)
    out = _run_moe(x, packed, ids, route_w, split_k)
    assert out.shape == (tokens, hidden)
    assert_close_scaled(out, _moe_reference(x, raw, ids, route_w), dtype)
    assert_prefix_invariant(out, lambda k: _run_moe(x[:k], packed, ids[:k], route_w[:k], split_k), tokens)


@EXAMPLES
@given(seed=SEEDS, tokens=ROWS, experts=st.sampled_from([1, 5, 64]), top_k=st.sampled_from([1, 2, 6]))
@example(seed=0, tokens=128, experts=256, top_k=6)
def test_align_tokens_places_every_row_once_in_its_experts_tile(seed, tokens, experts, top_k):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, experts, (tokens, top_k), generator=gen).to(DEVICE)
    sorted_rows, tile_expert = moe.align_tokens(ids, experts)
    rows = tokens * top_k
    sorted_rows, tile_expert = sorted_rows.cpu().view(-1, moe.BLOCK_M), tile_expert.cpu()
    real = sorted_rows[sorted_rows < rows]
    assert sorted(real.tolist()) == list(range(rows)), "each routed row exactly once"
    for tile, expert in enumerate(tile_expert.tolist()):
        members = sorted_rows[tile][sorted_rows[tile] < rows]
        if expert < 0:
            assert members.numel() == 0, "an unused tile holds rows"
        else:
            assert members.numel() > 0 and bool((ids.cpu().flatten()[members] == expert).all())


@EXAMPLES
@given(seed=SEEDS, tokens=st.sampled_from([17, 33]), shared=st.booleans(),
       dtype=st.sampled_from(sorted(set(DTYPES) | {torch.float32}, key=str)), split_k=st.sampled_from([1, 3]),
       launch=st.sampled_from([{"down": {"BLOCK_N": 64, "N_TILES": 2}},
                               {"down": {"BLOCK_N": 64, "N_TILES": 3, "num_warps": 8}},
                               {"gate_up": {"FUSED_SPLITS": True}},
                               {"gate_up": {"FUSED_SPLITS": True, "BLOCK_N": 16, "num_warps": 8},
                                "down": {"BLOCK_N": 128, "N_TILES": 1, "num_stages": 3}}]))
@example(seed=0, tokens=33, shared=True, dtype=DTYPES[0], split_k=3,
         launch={"gate_up": {"FUSED_SPLITS": True}, "down": {"BLOCK_N": 64, "N_TILES": 3}})
def test_moe_gate_up_and_down_launches_keep_a_rows_bits(seed, tokens, shared, dtype, split_k, launch):
    """A bucket's own gate/up and down launches (moe.gate_up_launch: splits added in the tile's program;
    moe.down_launch: column tiles walked per program; BLOCK_N, warps, stages) only move which program
    computes what: the output equals the bucket's plain launch bit for bit (hidden 130 leaves a column
    tile part-masked inside the walk, D 130 cut in 3 splits leaves a short last split), and both match
    the reference."""
    experts, top_k, hidden, inter = 9, 3, 130, 40
    x, raw, ids, route_w = _moe_case(seed, tokens, experts, top_k, hidden, inter, shared, dtype, 1.0)
    packed = moe.pack_weights(*raw)
    base = {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    outs = []
    for config in (base, {**base, **launch}):
        out = poisoned(*x.shape, dtype=x.dtype)
        moe.fused_moe(x, packed, route_w, ids, out=out, split_k=split_k, config=config)
        outs.append(out)
    assert_close_scaled(outs[1], _moe_reference(x, raw, ids, route_w), dtype)
    assert torch.equal(outs[0], outs[1]), f"the launch {launch} changed a row's bits"


def test_moe_fused_gate_up_splits_follow_the_split_order():
    """Negative control for the bits check above: the same fused launch with D summed in another order
    (a planted bug: the hidden dimension walked backwards) must differ somewhere. float32 on every
    device (the canary's GPU dtype): a 16-bit output rounds most order changes away (seen on the H200),
    which is why the bits test above draws float32 too."""
    x, raw, ids, route_w = _moe_case(3, 33, 9, 3, 130, 40, False, torch.float32, 20.0)
    packed = moe.pack_weights(*raw)
    base = {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    plain = moe.fused_moe(x, packed, route_w, ids, split_k=3, config=base)
    flipped = x.flip(1).contiguous()  # same sums per row, taken in the reverse k order
    packed_flipped = moe.pack_weights(raw[0].flip(2).contiguous(), raw[1].flip(2).contiguous(), raw[2])
    fused = moe.fused_moe(flipped, packed_flipped, route_w, ids, split_k=3,
                          config={**base, "gate_up": {"FUSED_SPLITS": True}})
    assert_close_scaled(fused, _moe_reference(x, raw, ids, route_w), torch.float32)
    assert not torch.equal(plain, fused), "a different addition order gave the same bits: the check is blind"


def test_moe_reference_oracle_fails_on_swapped_routing_weights():
    """Negative control: a kernel that applies rank 1's weight to rank 0 must fail the check."""
    x, raw, ids, route_w = _moe_case(1, 5, 9, 3, 64, 20, False, DTYPES[0], 1.0)
    route_w[:, 1] += 1.0
    out = _run_moe(x, moe.pack_weights(*raw), ids, route_w.roll(1, dims=1).contiguous())
    with pytest.raises(AssertionError):
        assert_close_scaled(out, _moe_reference(x, raw, ids, route_w), DTYPES[0])


# ---------------------------------------------------------------- sparse latent-MQA decode

def _attention_case(seed, queries, heads, latent, rope_dim, context, window, topk, dtype, page_size=16):
    """A paged latent cache (pages shuffled), queries at the last positions, selection by random
    indexer scores via the reference, converted to slot ids."""
    gen = torch.Generator().manual_seed(seed)
    pages = -(-context // page_size)
    page_table = torch.randperm(pages + 3, generator=gen)[:pages]
    positions = torch.arange(context - queries, context).clamp(min=0)
    scores = torch.rand(queries, context, generator=gen).double()
    scores[:, ::3] = 0.5  # ties in the selection
    mask = reference.selection_mask(scores, positions, window, topk)
    cache = randn(gen, (pages + 3) * page_size, latent + rope_dim, dtype=dtype)
    selected = torch.full((queries, window + topk), -1, dtype=torch.int32)
    for i in range(queries):
        chosen = torch.nonzero(mask[i]).flatten()
        selected[i, :len(chosen)] = chosen.to(torch.int32)
        selected[i] = selected[i][torch.randperm(window + topk, generator=gen)]  # order must not matter
    slots = indexer.positions_to_slots(selected.to(DEVICE), page_table[None].expand(queries, -1).to(DEVICE),
                                       page_size)
    q = randn(gen, queries, heads, latent + rope_dim, dtype=dtype)
    dense_kv = cache.cpu()[(page_table[torch.arange(context) // page_size] * page_size
                            + torch.arange(context) % page_size)]
    return q, cache, slots, dense_kv, mask


def _run_attention(q, cache, slots, latent, scale, splits, block_h=None, block_s=32, spread=None, merge=None,
                   v_split=None, narrow_partials=None):
    out = poisoned(q.shape[0], q.shape[1], latent, dtype=q.dtype)
    attention.sparse_mla_decode(q, cache, slots, latent, scale, num_splits=splits, block_h=block_h, block_s=block_s,
                                spread=spread, merge=merge, v_split=v_split, narrow_partials=narrow_partials, out=out)
    return out


# spread + in-kernel merge, spread + merge launch, gathered (fold in registers), gathered (through memory)
MLA_MODES = [(True, "ticket"), (True, "kernel"), (False, "registers"), (False, "memory")]


def assert_same_bits(outs: dict) -> None:
    """Every launch mode's output equals the first one's bit for bit."""
    (first, want), *rest = outs.items()
    for name, got in rest:
        assert torch.equal(got, want), f"launch mode {name} differs from {first}"


# The compiled checks first: a device run cut short by its time limit still has them.
@gpu
@pytest.mark.parametrize("heads,topk,launch", [(64, 512, {}), (16, 640, {}), (64, 512, dict(block_h=32, num_warps=8)),
                                               (20, 300, dict(block_s=32, num_splits=7, v_split=2)),
                                               (64, 512, dict(num_splits=10, narrow_partials=True))])
def test_sparse_mla_launch_modes_agree_on_the_gpu(heads, topk, launch):
    """Compiled, the modes must still round alike (same MMA layouts, no contraction in the fold),
    at the deployment shapes (C=512, R=64, window 128) and bs 1 / 3."""
    for queries in (1, 3):
        q, cache, slots, dense_kv, mask = _attention_case(queries, queries, heads, 512, 64, 2 * (topk + 128), 128,
                                                          topk, torch.bfloat16, page_size=64)
        outs = {}
        for spread, merge in MLA_MODES:
            outs[spread, merge] = poisoned(queries, heads, 512, dtype=torch.bfloat16)
            attention.sparse_mla_decode(q, cache, slots, 512, 0.04, spread=spread, merge=merge, out=outs[spread, merge],
                                        **launch)
        assert_same_bits(outs)
        assert_close_scaled(outs[MLA_MODES[0]], reference.sparse_attention(q.cpu(), dense_kv, mask, 512, 0.04),
                            torch.bfloat16)


@gpu
@pytest.mark.parametrize("heads,topk,queries", [(64, 512, 1), (64, 640, 8), (16, 640, 3), (64, 512, 16)])
def test_sparse_mla_merge_as_a_dependent_launch_keeps_the_bits_on_the_gpu(heads, topk, queries):
    """The spread mode's merge as a programmatic dependent launch (attention.PDL_MERGE): it may start while the
    chunk programs run and must wait for them, so its output is the plain launch's bit for bit, eager and under
    graph replay (the graph keeps the launch's programmatic edge). Consecutive passes alternate two inputs
    whose outputs differ, so a merge that read the chunk states before this pass wrote them (the last pass's,
    in the same memory under replay) gives the other input's answer; each output poisoned before its run."""
    if not attention.pdl_launch(True, torch.device("cuda")):
        pytest.skip("no programmatic dependent launch below sm_90")
    q, cache, slots, _, _ = _attention_case(11, queries, heads, 512, 64, 2 * (topk + 128), 128, topk, torch.bfloat16,
                                            page_size=64)
    inputs = [q, -q]

    def run(pdl, q, out):
        return attention.sparse_mla_decode(q, cache, slots, 512, 0.04, spread=True, merge="kernel", pdl=pdl, out=out)
    wants = [run(False, x, poisoned(queries, heads, 512, dtype=torch.bfloat16)) for x in inputs]
    assert not torch.equal(wants[0], wants[1]), "the two inputs' outputs must differ, or a stale read hides"
    for i in range(6):
        got = run(True, inputs[i % 2], poisoned(queries, heads, 512, dtype=torch.bfloat16))
        assert torch.equal(got, wants[i % 2]), "the dependent merge launch changed the bits (or read stale states)"
    static_q, out = q.clone(), poisoned(queries, heads, 512, dtype=torch.bfloat16)
    run(True, static_q, out)  # compiled and warm before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(True, static_q, out)
    for i in range(20):  # each replay races the merge against its chunks again, over the last replay's states
        static_q.copy_(inputs[i % 2])
        out.copy_(poisoned(queries, heads, 512, dtype=torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, wants[i % 2]), "a graph replay of the dependent merge launch differs"


@gpu
def test_sparse_mla_invariant_across_the_spread_switch_on_the_gpu():
    """160 queries x 1 head block: chunks spread below half the SM count, not above it; prefixes on
    both sides of the switch give the rows' same bits."""
    q, cache, slots, _, _ = _attention_case(7, 160, 16, 512, 64, 900, 128, 512, torch.bfloat16, page_size=64)
    run = lambda k: _run_attention(q[:k], cache, slots[:k], 512, 0.04, None, block_s=None)  # noqa: E731
    full = run(160)
    for k in (1, 37, 65, 67, 131, 159):
        assert torch.equal(full[:k], run(k)), f"row results changed with the batch (k={k} of 160)"


@EXAMPLES
@given(seed=SEEDS, queries=st.sampled_from([1, 2, 5]), heads=st.sampled_from([1, 16, 20]),
       dims=st.sampled_from([(32, 16), (48, 8), (64, 64)]), context_vs_selected=st.sampled_from([-5, 0, 1, 40]),
       splits=st.sampled_from([1, 2, 3]), dtype=st.sampled_from(DTYPES),
       blocks=st.sampled_from([(None, 32), (16, 16), (64, 64)]), mode=st.sampled_from(MLA_MODES + [(None, None)]))
@example(seed=0, queries=2, heads=20, dims=(48, 8), context_vs_selected=1, splits=3, dtype=DTYPES[0], blocks=(16, 16),
         mode=(None, None))
def test_sparse_mla_decode_matches_reference_and_is_batch_invariant(seed, queries, heads, dims, context_vs_selected,
                                                                    splits, dtype, blocks, mode):
    latent, rope_dim = dims
    window, topk = 8, 24
    context = max(queries, window + topk + context_vs_selected)  # shorter / equal / longer than window+topk
    q, cache, slots, dense_kv, mask = _attention_case(seed, queries, heads, latent, rope_dim, context, window, topk,
                                                      dtype)
    scale = (latent + rope_dim) ** -0.5
    out = _run_attention(q, cache, slots, latent, scale, splits, *blocks, *mode)
    expected = reference.sparse_attention(q.cpu(), dense_kv, mask, latent, scale)
    assert_close_scaled(out, expected, dtype)
    # mode (None, None): the mode follows the batch (spread below INTERPRETER_FILL programs), and
    # the prefixes cross that switch.
    assert_prefix_invariant(out, lambda k: _run_attention(q[:k], cache, slots[:k], latent, scale, splits, *blocks,
                                                          *mode), queries)


@settings(max_examples=8 if ON_GPU else 3)  # + the two examples; each runs 4 launch modes (interpreted: slow)
@given(seed=SEEDS, queries=st.sampled_from([1, 3]), heads=st.sampled_from([20, 48, 64]),
       topk=st.sampled_from([40, 57, 100]), splits=st.sampled_from([2, 3, 5, 7]), block_h=st.sampled_from([16, 32]),
       latent=st.sampled_from([64, 192]), v_split=st.sampled_from([1, 2]), narrow=st.booleans(),
       dtype=st.sampled_from(DTYPES))
@example(seed=1, queries=1, heads=64, topk=100, splits=7, block_h=16, latent=64, v_split=1, narrow=False,
         dtype=DTYPES[0])
@example(seed=2, queries=3, heads=20, topk=57, splits=3, block_h=16, latent=192, v_split=2, narrow=True,
         dtype=torch.float16)
def test_sparse_mla_launch_modes_give_the_same_bits(seed, queries, heads, topk, splits, block_h, latent, v_split,
                                                    narrow, dtype):
    """The grid that fills the GPU at bs 1 (one program per chunk and head block, heads not a
    multiple of the block, selections not a multiple of the position block, latent tiles of the
    merge not dividing the latent, latent-column blocks, 16-bit partial states) and the one that
    does not spread: the same bits, and the reference's values; rows permuted give rows permuted."""
    rope_dim, window = 16, 12
    q, cache, slots, dense_kv, mask = _attention_case(seed, queries, heads, latent, rope_dim, 3 * (window + topk),
                                                      window, topk, dtype)
    scale = (latent + rope_dim) ** -0.5
    run = lambda q, s, mode: _run_attention(q, cache, s, latent, scale, splits, block_h, 16, *mode,  # noqa: E731
                                            v_split=v_split, narrow_partials=narrow)
    outs = {mode: run(q, slots, mode) for mode in MLA_MODES}
    assert_same_bits(outs)
    assert_close_scaled(outs[MLA_MODES[0]], reference.sparse_attention(q.cpu(), dense_kv, mask, latent, scale), dtype)
    perm = torch.randperm(queries, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    assert torch.equal(run(q[perm], slots[perm], MLA_MODES[0]), outs[MLA_MODES[0]][perm]), "row order changed bits"


# The grouped kernel's modes (mla_grouped: no merge="memory" form)
GROUPED_MODES = [(True, "ticket"), (True, "kernel"), (False, "registers")]


def _run_grouped(q, cache, slots, latent, scale, splits, spread, merge, **launch):
    out = poisoned(q.shape[0], q.shape[1], latent, dtype=q.dtype)
    return attention.sparse_mla_decode(q, cache, slots, latent, scale, num_splits=splits, block_h=16, block_s=16,
                                       spread=spread, merge=merge, column_groups=4, out=out, **launch)


@settings(max_examples=6 if ON_GPU else 3)
@given(seed=SEEDS, queries=st.sampled_from([1, 3]), heads=st.sampled_from([16, 20, 64]),
       latent=st.sampled_from([64, 192, 512]), topk=st.sampled_from([40, 100]), splits=st.sampled_from([1, 3, 5]),
       rowsum_mma=st.booleans(), narrow=st.booleans(), dtype=st.sampled_from(DTYPES))
@example(seed=4, queries=3, heads=20, latent=192, topk=100, splits=5, rowsum_mma=True, narrow=True,
         dtype=torch.float16)
def test_sparse_mla_column_groups_match_the_reference_in_every_mode(seed, queries, heads, latent, topk, splits,
                                                                    rowsum_mma, narrow, dtype):
    """column_groups=4 (mla_grouped: the latent as four column groups, chained score dots): the
    reference's values, every launch mode's bits alike (latents that four groups do not divide
    into powers of two included), and rows permuted give rows permuted."""
    rope_dim, window = 16, 12
    q, cache, slots, dense_kv, mask = _attention_case(seed, queries, heads, latent, rope_dim, 3 * (window + topk),
                                                      window, topk, dtype)
    scale = (latent + rope_dim) ** -0.5

    def run(q, s, spread, merge):
        return _run_grouped(q, cache, s, latent, scale, splits, spread, merge, narrow_partials=narrow,
                            rowsum_mma=rowsum_mma)
    outs = {mode: run(q, slots, *mode) for mode in GROUPED_MODES}
    assert_same_bits(outs)
    assert_close_scaled(outs[GROUPED_MODES[0]], reference.sparse_attention(q.cpu(), dense_kv, mask, latent, scale),
                        dtype)
    perm = torch.randperm(queries, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    assert torch.equal(run(q[perm], slots[perm], *GROUPED_MODES[2]), outs[GROUPED_MODES[0]][perm])


def test_sparse_mla_column_groups_refuse_what_they_do_not_run():
    q, cache, slots, _, _ = _attention_case(0, 1, 16, 64, 16, 300, 8, 100, DTYPES[0])
    for launch in (dict(v_split=2), dict(spread=False, merge="memory"), dict(column_groups=3)):
        with pytest.raises(ValueError, match="column_groups"):
            attention.sparse_mla_decode(q, cache, slots, 64, 0.1, num_splits=3, block_s=16,
                                        **{"column_groups": 4, **launch})
    # groups of 8 latent columns: narrower than a dot's k step
    q, cache, slots, _, _ = _attention_case(0, 1, 16, 32, 16, 300, 8, 100, DTYPES[0])
    with pytest.raises(ValueError, match="column_groups"):
        attention.sparse_mla_decode(q, cache, slots, 32, 0.1, num_splits=3, block_s=16, column_groups=4)


@settings(max_examples=6 if ON_GPU else 3)
@given(seed=SEEDS, queries=st.sampled_from([1, 3]), heads=st.sampled_from([16, 20]), latent=st.sampled_from([64, 192]),
       topk=st.sampled_from([36, 100]), splits=st.sampled_from([2, 7, 9]), rowsum_mma=st.booleans(),
       narrow=st.booleans(), dtype=st.sampled_from(DTYPES))
@example(seed=6, queries=3, heads=20, latent=192, topk=100, splits=7, rowsum_mma=False, narrow=True,
         dtype=torch.float16)
def test_sparse_mla_one_block_chunks_keep_the_general_loops_bits(seed, queries, heads, latent, topk, splits,
                                                                 rowsum_mma, narrow, dtype):
    """mla_grouped.ONE_BLOCK_CHUNKS (chunks of one BLOCK_S block folded as each block ends, one accumulator a
    column group): the general loop's bits in every grouped mode, whether the chunks are one block (window 12 +
    top-100 = 7 blocks of 16 in 7 or 9 chunks) or not (2 chunks; the flag then changes nothing)."""
    rope_dim, window = 16, 12
    q, cache, slots, dense_kv, mask = _attention_case(seed, queries, heads, latent, rope_dim, 3 * (window + topk),
                                                      window, topk, dtype)
    scale = (latent + rope_dim) ** -0.5
    outs = {}
    for one_block in (False, True):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(mla_grouped, "ONE_BLOCK_CHUNKS", one_block)
            patch.setattr(mla_grouped, "ONE_BLOCK_MIN_WARPS", 1)  # the interpreter's launches are 4 warps
            for spread, merge in GROUPED_MODES:
                outs[one_block, spread, merge] = _run_grouped(q, cache, slots, latent, scale, splits, spread, merge,
                                                              narrow_partials=narrow, rowsum_mma=rowsum_mma)
    assert_same_bits(outs)
    assert_close_scaled(outs[False, False, "registers"],
                        reference.sparse_attention(q.cpu(), dense_kv, mask, latent, scale), dtype)


_ONE_BLOCK_FOLD = mla_grouped._fold_block_chunk


@triton.jit
def _fold_block_chunk_unrounded(scores, kv0, kv1, kv2, kv3, M, L, A0, A1, A2, A3, dtype: tl.constexpr,
                                BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_G: tl.constexpr,
                                PRECISION: tl.constexpr, NARROW: tl.constexpr, ROWSUM_MMA: tl.constexpr):
    """A planted slip: the one-block loop's fold without rounding the chunk's sum to the 16-bit dtype."""
    return _ONE_BLOCK_FOLD(scores, kv0, kv1, kv2, kv3, M, L, A0, A1, A2, A3, dtype, BLOCK_H, BLOCK_S, BLOCK_G,
                           PRECISION, False, ROWSUM_MMA)


@pytest.mark.skipif(not INTERPRETED, reason="a planted jit helper is swapped in by name: the interpreter only")
def test_sparse_mla_one_block_chunks_control_an_unrounded_chunk_sum_is_caught(monkeypatch):
    """Negative control for the test above: with the one-block loop's fold planted without the chunk sum's
    16-bit rounding, its bits leave the general loop's (which also shows the one-block loop is what ran)."""
    q, cache, slots, _, _ = _attention_case(6, 3, 20, 64, 16, 3 * (12 + 100), 12, 100, torch.float16)
    monkeypatch.setattr(mla_grouped, "ONE_BLOCK_MIN_WARPS", 1)
    monkeypatch.setattr(mla_grouped, "ONE_BLOCK_CHUNKS", False)
    want = _run_grouped(q, cache, slots, 64, 0.1, 7, False, "registers", narrow_partials=True)
    monkeypatch.setattr(mla_grouped, "ONE_BLOCK_CHUNKS", True)
    assert torch.equal(_run_grouped(q, cache, slots, 64, 0.1, 7, False, "registers", narrow_partials=True), want)
    monkeypatch.setattr(mla_grouped, "_fold_block_chunk", _fold_block_chunk_unrounded)
    bug = _run_grouped(q, cache, slots, 64, 0.1, 7, False, "registers", narrow_partials=True)
    assert not torch.equal(bug, want), "the planted slip left the bits alone: the equality shows nothing"


@gpu
@pytest.mark.parametrize("heads,latent,rope,window,topk,dtype", [
    (64, 512, 64, 128, 512, torch.bfloat16), (64, 512, 64, 128, 640, torch.bfloat16),
    (16, 512, 64, 128, 512, torch.float32),
    (4, 64, 16, 32, 32, torch.float32),  # the canary's shape: its GPU golden store must not move
])
def test_sparse_mla_column_groups_keep_the_deployments_bits_on_the_gpu(heads, latent, rope, window, topk, dtype):
    """On the GPU a chained tl.dot adds like one long dot (bench.mma_bits), so the grouped kernel
    must give the ungrouped kernel's bits in every mode, at the deployment shapes (C=512, R=64,
    window 128, and the canary's), bs 1 and 5: what lets default_launch group every head count."""
    for queries in (1, 5):
        q, cache, slots, _, _ = _attention_case(queries, queries, heads, latent, rope, 2 * (topk + window), window,
                                                topk, dtype, page_size=64)

        def run(q=q, cache=cache, slots=slots, **launch):
            out = poisoned(q.shape[0], heads, latent, dtype=dtype)
            return attention.sparse_mla_decode(q, cache, slots, latent, 0.04, out=out, **launch)
        want = run(spread=False, merge="registers", column_groups=1)
        for one_block in (True, False):  # one-block chunks' own loop (every shape here) and the general one
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(mla_grouped, "ONE_BLOCK_CHUNKS", one_block)
                patch.setattr(mla_grouped, "ONE_BLOCK_MIN_WARPS", 1)
                for spread, merge in GROUPED_MODES:
                    got = run(spread=spread, merge=merge, column_groups=4)
                    assert torch.equal(got, want), f"bits changed: column groups, {spread=}, {merge=}, {one_block=}"
                assert torch.equal(run(spread=False, merge="registers", column_groups=4, num_warps=8), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sparse_mla_row_sums_as_an_mma_match_the_reference_in_every_mode(dtype):
    """rowsum_mma (the softmax row sums as p @ ones over the 16-bit p, a candidate deployment knob):
    the reference's values within the dtype's tolerance, and every launch mode's bits alike."""
    heads, latent, rope_dim, window, topk = 20, 64, 16, 12, 57
    q, cache, slots, dense_kv, mask = _attention_case(7, 3, heads, latent, rope_dim, 3 * (window + topk), window,
                                                      topk, dtype)
    scale = (latent + rope_dim) ** -0.5
    outs = {}
    for spread, merge in MLA_MODES:
        outs[spread, merge] = poisoned(3, heads, latent, dtype=dtype)
        attention.sparse_mla_decode(q, cache, slots, latent, scale, num_splits=3, block_h=16, block_s=16,
                                    spread=spread, merge=merge, rowsum_mma=True, out=outs[spread, merge])
    assert_same_bits(outs)
    assert_close_scaled(outs[MLA_MODES[0]], reference.sparse_attention(q.cpu(), dense_kv, mask, latent, scale), dtype)


@gpu
def test_sparse_mla_row_sums_as_an_mma_free_the_head_block_and_warps():
    """With rowsum_mma, BLOCK_H 16/32/64, 4/8 warps, latent-column splits and the launch mode give one
    set of bits (every reduction of a row is an MMA k-chain or a max); negative control: with tl.sum's
    row sums, some of the same launches change them (`bench.mla_sweep --free`)."""
    q, cache, slots, _, _ = _attention_case(3, 4, 64, 512, 64, 2 * (512 + 128), 128, 512, torch.bfloat16,
                                            page_size=64)

    def run(rowsum_mma: bool, **launch):
        out = poisoned(4, 64, 512, dtype=torch.bfloat16)
        attention.sparse_mla_decode(q, cache, slots, 512, 0.04, rowsum_mma=rowsum_mma, out=out,
                                    **{"spread": False, "merge": "registers", **launch})
        return out

    launches = (dict(num_warps=8), dict(block_h=32, num_warps=8), dict(block_h=64, num_warps=8),
                dict(block_h=32, num_warps=8, v_split=2), dict(v_split=2),
                dict(spread=True, merge="kernel", block_h=64, num_warps=8),
                # small-batch candidates: more programs per query (issue 15 item 2)
                dict(spread=True, merge="ticket", v_split=4), dict(spread=True, merge="ticket", v_split=8))
    want = run(True)
    for launch in launches:
        assert torch.equal(run(True, **launch), want), f"rowsum_mma bits changed with {launch}"
    # On the H200, 8 warps alone left these inputs' tl.sum bits as they were (2026-12-02); the tile
    # height changes them (the mma_bits bench: tl.sum's tree follows the layout).
    plain = run(False)
    assert any(not torch.equal(run(False, **launch), plain) for launch in launches), \
        "tl.sum row sums no longer depend on the launch: the control shows nothing"


def test_row_count_launches_apply_to_their_row_counts_only(monkeypatch):
    """PREFILL_LAUNCH: passes of more than PREFILL_LAUNCH_ROWS rows run it, shorter passes the
    deployment's; a caller's argument wins; SMALL_BATCH_LAUNCH likewise at the other end, MID_BATCH_LAUNCH
    in its band. Their knobs keep a row's bits (the outputs stay the plain launch's), so which launch ran
    is read from the kernel's launch arguments."""
    q, cache, slots, _, _ = _attention_case(2, 3, 20, 64, 16, 120, 8, 64, DTYPES[0])
    scale = 80 ** -0.5
    # column_groups=1: the kernel whose launches are recorded here (a GPU groups every head count)
    base = dict(num_splits=3, block_s=16, spread=False, merge="registers", rowsum_mma=True, column_groups=1)
    kernel, launched = attention._sparse_mla_kernel, []

    class Recorded:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append((kwargs["BLOCK_H"], kwargs["V_SPLIT"]))
                return kernel[grid](*args, **kwargs)
            return launch

    def run(rows, **launch):
        out = poisoned(rows, 20, 64, dtype=q.dtype)
        launched.clear()
        attention.sparse_mla_decode(q[:rows], cache, slots[:rows], 64, scale, out=out, **{**base, **launch})
        return out, launched[:]

    monkeypatch.setattr(attention, "_sparse_mla_kernel", Recorded())
    monkeypatch.setattr(attention, "PREFILL_LAUNCH", None)
    monkeypatch.setattr(attention, "LARGE_BATCH_LAUNCH", None)
    want, launch = run(3)
    assert launch == [(16, 1)]
    monkeypatch.setattr(attention, "PREFILL_LAUNCH", dict(block_h=64, num_warps=8, v_split=2))
    monkeypatch.setattr(attention, "PREFILL_LAUNCH_ROWS", 2)
    out, launch = run(3)
    assert launch == [(64, 2)], "a 3-row pass did not take PREFILL_LAUNCH"
    assert torch.equal(out, want), "PREFILL_LAUNCH changed the bits"
    out, launch = run(2)
    assert launch == [(16, 1)] and torch.equal(out, want[:2]), "a 2-row pass took PREFILL_LAUNCH"
    out, launch = run(3, v_split=1)
    assert launch == [(64, 1)] and torch.equal(out, want), "the caller's arguments lost"
    # SMALL_BATCH_LAUNCH: passes of at most SMALL_BATCH_ROWS rows, the same rules.
    monkeypatch.setattr(attention, "PREFILL_LAUNCH", None)
    monkeypatch.setattr(attention, "SMALL_BATCH_LAUNCH", dict(block_h=32, v_split=4))
    monkeypatch.setattr(attention, "SMALL_BATCH_ROWS", 2)
    out, launch = run(2)
    assert launch == [(32, 4)] and torch.equal(out, want[:2]), "a 2-row pass did not take SMALL_BATCH_LAUNCH"
    out, launch = run(3)
    assert launch == [(16, 1)] and torch.equal(out, want), "a 3-row pass took SMALL_BATCH_LAUNCH"
    monkeypatch.setattr(attention, "SMALL_BATCH_LAUNCH", dict(block_s=32))
    with pytest.raises(ValueError, match="reduction order"):  # BLOCK_S sets the chunking: never per batch
        run(2)
    # MID_BATCH_LAUNCH: gathered passes of at most MID_BATCH_ROWS rows, the same rules.
    monkeypatch.setattr(attention, "SMALL_BATCH_LAUNCH", dict(block_h=32, v_split=4))
    monkeypatch.setattr(attention, "SMALL_BATCH_ROWS", 1)
    monkeypatch.setattr(attention, "MID_BATCH_LAUNCH", dict(block_h=64, v_split=2))
    monkeypatch.setattr(attention, "MID_BATCH_ROWS", 2)
    out, launch = run(1)
    assert launch == [(32, 4)] and torch.equal(out, want[:1]), "a 1-row pass left SMALL_BATCH_LAUNCH"
    out, launch = run(2)
    assert launch == [(64, 2)] and torch.equal(out, want[:2]), "a 2-row pass did not take MID_BATCH_LAUNCH"
    out, launch = run(3)
    assert launch == [(16, 1)] and torch.equal(out, want), "a 3-row pass took MID_BATCH_LAUNCH"
    # Its lower bound is the automatic mode's switch (2 rows x 1 head block < INTERPRETER_FILL: spread), wherever
    # the switch falls (a smaller fill: gathered).
    out, launch = run(2, spread=None)
    assert launch == [(16, 1)] and torch.equal(out, want[:2]), "a pass the deployment spreads took MID_BATCH_LAUNCH"
    monkeypatch.setattr(attention, "INTERPRETER_FILL", 2)
    out, launch = run(2, spread=None)
    assert launch == [(64, 2)] and torch.equal(out, want[:2]), "a gathered pass did not take MID_BATCH_LAUNCH"
    monkeypatch.setattr(attention, "MID_BATCH_LAUNCH", dict(num_splits=2))
    with pytest.raises(ValueError, match="reduction order"):
        run(2)


def test_large_batch_launch_takes_its_band_and_only_mma_row_sum_deployments(monkeypatch):
    """LARGE_BATCH_LAUNCH (64-head blocks for the largest decode buckets): passes of LARGE_BATCH_ROWS to
    PREFILL_LAUNCH_ROWS rows run it with the same bits; shorter passes and a deployment whose row sums
    are tl.sum's (its launch shape is its numerics: H < 64, the canary) keep default_launch's."""
    kernel, launched = attention._sparse_mla_kernel, []

    class Recorded:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append(kwargs["BLOCK_H"])
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(attention, "_sparse_mla_kernel", Recorded())
    monkeypatch.setattr(attention, "LARGE_BATCH_ROWS", 3)
    monkeypatch.setattr(attention, "PREFILL_LAUNCH_ROWS", 4)
    monkeypatch.setattr(attention, "PREFILL_LAUNCH", None)  # the band's upper end alone
    monkeypatch.setattr(attention, "MID_BATCH_LAUNCH", None)  # (gathered passes of <= 32 rows would take it)
    for heads, band_block_h in ((64, 64), (20, 16)):  # default_launch: MMA row sums at H >= 64 only
        q, cache, slots, _, _ = _attention_case(4, 5, heads, 64, 16, 120, 8, 64, DTYPES[0])

        def run(rows, q=q, cache=cache, slots=slots, heads=heads):
            out = poisoned(rows, heads, 64, dtype=q.dtype)
            launched.clear()
            attention.sparse_mla_decode(q[:rows], cache, slots[:rows], 64, 80 ** -0.5, out=out, num_splits=3,
                                        block_s=16, spread=False, merge="registers", column_groups=1)
            return out, launched[:]
        monkeypatch.setattr(attention, "LARGE_BATCH_LAUNCH", None)
        want, launch = run(4)
        assert launch == [16]
        monkeypatch.setattr(attention, "LARGE_BATCH_LAUNCH", dict(block_h=64, num_warps=8))
        for rows, block_h in ((2, 16), (3, band_block_h), (4, band_block_h), (5, 16)):
            out, launch = run(rows)
            assert launch == [block_h], f"H={heads}, {rows} rows ran BLOCK_H {launch}, not {block_h}"
            if rows <= 4:
                assert torch.equal(out, want[:rows]), f"H={heads}, {rows} rows: the band's launch changed the bits"


def test_a_caller_asking_for_tl_sum_row_sums_runs_its_own_launch_at_a_tables_row_count(monkeypatch):
    """rowsum_mma=False from the caller at a row-count table's rows: the table is not applied (its launch would
    change tl.sum's bits) and nothing is refused; the pass runs the caller's launch (the free-knob sweep's
    tl.sum base at bs 128 raised here before)."""
    q, cache, slots, _, _ = _attention_case(1, 3, 64, 64, 16, 40, 8, 24, DTYPES[0])
    run = lambda: attention.sparse_mla_decode(q, cache, slots, 64, 0.1, rowsum_mma=False)  # noqa: E731
    want = run()
    monkeypatch.setattr(attention, "LARGE_BATCH_LAUNCH", dict(block_h=64, num_warps=8))
    monkeypatch.setattr(attention, "LARGE_BATCH_ROWS", 2)
    assert torch.equal(run(), want)


@pytest.mark.parametrize("launch, match", [(dict(block_s=32), "block_s"), (dict(num_splits=2), "num_splits"),
                                           (dict(block_h=64, rowsum_mma=False), "rowsum_mma=True")])
def test_prefill_launch_refuses_knobs_that_change_bits(monkeypatch, launch, match):
    q, cache, slots, _, _ = _attention_case(1, 3, 16, 64, 16, 40, 8, 24, DTYPES[0])
    monkeypatch.setattr(attention, "PREFILL_LAUNCH", launch)
    monkeypatch.setattr(attention, "PREFILL_LAUNCH_ROWS", 2)
    with pytest.raises(ValueError, match=match):
        attention.sparse_mla_decode(q, cache, slots, 64, 0.1)
    attention.sparse_mla_decode(q[:2], cache, slots[:2], 64, 0.1)  # at most PREFILL_LAUNCH_ROWS: not read


def _trailing_padding_case(seed: int, valid_counts: list[int], heads: int, selected: int, dtype):
    """Rows whose selection is `count` slots then -1 to the end, as a prompt row near the start of
    its sequence has (window first, then fewer top-k candidates than k)."""
    gen = torch.Generator().manual_seed(seed)
    latent, rope_dim = 64, 16
    cache = randn(gen, 4 * selected, latent + rope_dim, dtype=dtype)
    slots = torch.full((len(valid_counts), selected), -1, dtype=torch.int32)
    for i, count in enumerate(valid_counts):
        slots[i, :count] = torch.randperm(cache.shape[0], generator=gen)[:count].to(torch.int32)
    q = randn(gen, len(valid_counts), heads, latent + rope_dim, dtype=dtype)
    return q, cache, slots.to(DEVICE), latent, (latent + rope_dim) ** -0.5


@pytest.mark.parametrize("dtype", DTYPES)
def test_skipping_empty_trailing_chunks_keeps_the_bits(dtype):
    """skip_tail (prefill passes) against the full loop, in every launch mode: rows whose last slot
    is the first or last of a chunk, or in the first chunk; chunks of 32 positions (2 blocks of 16)."""
    counts = [1, 31, 32, 33, 64, 65, 97, 100]
    q, cache, slots, latent, scale = _trailing_padding_case(5, counts, 20, 100, dtype)
    for spread, merge in MLA_MODES:
        outs = {}
        for skip in (False, True):
            outs[skip] = poisoned(len(counts), 20, latent, dtype=dtype)
            attention.sparse_mla_decode(q, cache, slots, latent, scale, num_splits=4, block_h=16, block_s=16,
                                        spread=spread, merge=merge, skip_tail=skip, out=outs[skip])
        assert torch.equal(outs[True], outs[False]), f"skip_tail changed bits ({spread}, {merge})"
        assert not torch.isnan(outs[True]).any()


def test_skip_tail_oracle_fails_when_a_used_chunk_is_dropped():
    """Negative control: the same rows with their last selected slot dropped (what skipping one
    chunk too many does to a row whose last chunk holds one slot) give other bits."""
    q, cache, slots, latent, scale = _trailing_padding_case(5, [33, 65], 20, 100, DTYPES[0])
    dropped = slots.clone()
    dropped[0, 32] = dropped[1, 64] = -1
    run = lambda s: attention.sparse_mla_decode(q, cache, s, latent, scale, num_splits=4, block_h=16,  # noqa: E731
                                                block_s=16, skip_tail=True)
    assert not torch.equal(run(slots)[0], run(dropped)[0]) and not torch.equal(run(slots)[1], run(dropped)[1])


@pytest.mark.skipif(ON_GPU, reason="on a GPU the tests above compile it for real")
@pytest.mark.parametrize("spread, ticket, stream", [(False, False, False), (False, False, True), (True, True, False)])
def test_sparse_mla_with_skip_tail_compiles_for_the_gpu_without_one(spread, ticket, stream):
    """The deployment shape (H=64 blocks of 16, C=512, R=64, 5 chunks, bf16 chunk sums) with the
    tail scan, through sm_90's compiler: the interpreter accepts code the compiler refuses."""
    from tests.kernels.test_indexer_topk import compile_for_sm90

    pointers = dict(q_ptr="*bf16", kv_ptr="*bf16", idx_ptr="*i32", out_ptr="*bf16", part_ptr="*bf16",
                    stats_ptr="*fp32", ticket_ptr="*i32")
    scalars = dict.fromkeys(["heads", "selected", "blocks_per_chunk", "stride_qt", "stride_qh", "stride_kv",
                             "stride_idx", "stride_ot", "stride_oh"], "i32")
    constants = dict(LATENT=512, ROPE=64, SPREAD=spread, TICKET=ticket, PRECISION="tf32", BLOCK_H=16, BLOCK_S=64,
                     BLOCK_C=512, BLOCK_R=64, V_SPLIT=1, NARROW=True, SPLITS=5, STREAM=stream, TAIL=True,
                     BLOCK_ALL=1024, ROWSUM_MMA=False, PDL=False)
    done = compile_for_sm90("runtime.kernels.triton.attention", "_sparse_mla_kernel",
                            {**pointers, **scalars, "sm_scale_log2": "fp32"}, constants, num_warps=4, num_stages=2,
                            enable_fp_fusion=False)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


@pytest.mark.parametrize("block_h", [16, 64])
def test_sparse_mla_with_row_sums_as_an_mma_compiles_for_the_gpu(block_h):
    """rowsum_mma's p @ ones at the deployment shape (gathered, bf16), through sm_90's compiler at
    16-head (mma.sync) and 64-head (wgmma) blocks."""
    from tests.kernels.test_indexer_topk import compile_for_sm90

    pointers = dict(q_ptr="*bf16", kv_ptr="*bf16", idx_ptr="*i32", out_ptr="*bf16", part_ptr="*bf16",
                    stats_ptr="*fp32", ticket_ptr="*i32")
    scalars = dict.fromkeys(["heads", "selected", "blocks_per_chunk", "stride_qt", "stride_qh", "stride_kv",
                             "stride_idx", "stride_ot", "stride_oh"], "i32")
    constants = dict(LATENT=512, ROPE=64, SPREAD=False, TICKET=False, PRECISION="tf32", BLOCK_H=block_h,
                     BLOCK_S=64, BLOCK_C=512, BLOCK_R=64, V_SPLIT=1, NARROW=True, SPLITS=5, STREAM=False, TAIL=False,
                     BLOCK_ALL=1024, ROWSUM_MMA=True, PDL=False)
    # 16-head blocks launch at 4 warps (default_launch, H=64), 64-head ones at 8 (LARGE_BATCH_LAUNCH).
    done = compile_for_sm90("runtime.kernels.triton.attention", "_sparse_mla_kernel",
                            {**pointers, **scalars, "sm_scale_log2": "fp32"}, constants,
                            num_warps=4 if block_h == 16 else 8, num_stages=2, enable_fp_fusion=False)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


@pytest.mark.skipif(ON_GPU, reason="on a GPU the column-group tests compile it for real")
@pytest.mark.parametrize("spread, ticket", [(False, False), (True, True)])
@pytest.mark.parametrize("block_h, warps, narrow, mma_sums, one_block", [
    (16, 4, True, True, True), (16, 4, True, True, False), (16, 8, False, False, True), (64, 8, True, True, True)])
def test_sparse_mla_column_groups_compile_for_the_gpu_without_one(spread, ticket, block_h, warps, narrow, mma_sums,
                                                                   one_block):
    """mla_grouped's kernel (gathered, spread + ticket) through sm_90's compiler at each launch that
    runs it on a GPU: H=64's default (16-head blocks, 4 warps, narrow partials, MMA row sums; one-block chunks'
    loop and the general one), the default under 64 heads (8 warps, neither) and the large-batch / prefill
    launch (64-head blocks, 8 warps)."""
    from tests.kernels.test_indexer_topk import compile_for_sm90

    pointers = dict(q_ptr="*bf16", kv_ptr="*bf16", idx_ptr="*i32", out_ptr="*bf16",
                    part_ptr="*bf16" if narrow else "*fp32", stats_ptr="*fp32", ticket_ptr="*i32")
    scalars = dict.fromkeys(["heads", "selected", "blocks_per_chunk", "stride_qt", "stride_qh", "stride_kv",
                             "stride_idx", "stride_ot", "stride_oh"], "i32")
    constants = dict(LATENT=512, ROPE=64, SPREAD=spread, TICKET=ticket, PRECISION="tf32", BLOCK_H=block_h,
                     BLOCK_S=64, BLOCK_G=128, BLOCK_R=64, NARROW=narrow, SPLITS=5, TAIL=False, BLOCK_ALL=1024,
                     ROWSUM_MMA=mma_sums, ONE_BLOCK=one_block, PDL=False)
    done = compile_for_sm90("runtime.kernels.triton.mla_grouped", "_sparse_mla_grouped_kernel",
                            {**pointers, **scalars, "sm_scale_log2": "fp32"}, constants, num_warps=warps, num_stages=2,
                            enable_fp_fusion=False)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


def test_merge_dependent_launch_is_on_by_default_but_never_in_the_interpreter_or_off_the_gpu():
    """PDL_MERGE is on (the H100 kept the bits and saved 1-1.6 us at bs 1); asked for where it cannot run (the
    interpreter, the CPU) it is not used, and the output is the plain launch's."""
    assert attention.PDL_MERGE is True
    assert attention.pdl_launch(None, torch.device("cpu")) is False
    if INTERPRETED:
        device = torch.device(DEVICE)
        assert attention.pdl_launch(None, device) is False and attention.pdl_launch(True, device) is False
        q, cache, slots, _, _ = _attention_case(2, 2, 20, 64, 16, 120, 8, 64, DTYPES[0])
        run = lambda pdl: attention.sparse_mla_decode(q, cache, slots, 64, 0.1, num_splits=3, block_s=16,  # noqa: E731
                                                      spread=True, merge="kernel", pdl=pdl)
        assert torch.equal(run(True), run(False))


@pytest.mark.skipif(ON_GPU, reason="on a GPU the dependent-launch bit test compiles them for real")
@pytest.mark.parametrize("kernel, pdl, wants", [("_merge_kernel", True, ["griddepcontrol.wait"]),
                                               ("_merge_kernel", False, []),
                                               ("_sparse_mla_kernel", True, ["griddepcontrol.launch_dependents"]),
                                               ("_sparse_mla_grouped_kernel", True,
                                                ["griddepcontrol.launch_dependents"])])
def test_merge_dependent_launch_compiles_its_wait_and_trigger_for_the_gpu(kernel, pdl, wants):
    """PDL=True puts griddepcontrol.wait before the merge's first read and the chunk programs' trigger in their
    sm_90 code; PDL=False (the default) leaves both out (a merge launched as a dependent without its wait could
    read chunk states not yet written)."""
    from tests.kernels.test_indexer_topk import compile_for_sm90

    merge = kernel == "_merge_kernel"
    pointers = dict(part_ptr="*bf16", stats_ptr="*fp32", out_ptr="*bf16") if merge else dict(
        q_ptr="*bf16", kv_ptr="*bf16", idx_ptr="*i32", out_ptr="*bf16", part_ptr="*bf16", stats_ptr="*fp32",
        ticket_ptr="*i32")
    names = ["heads", "stride_ot", "stride_oh"] if merge else [
        "heads", "selected", "blocks_per_chunk", "stride_qt", "stride_qh", "stride_kv", "stride_idx", "stride_ot",
        "stride_oh"]
    signature = {**pointers, **dict.fromkeys(names, "i32"), **({} if merge else {"sm_scale_log2": "fp32"})}
    spread = dict(LATENT=512, ROPE=64, SPREAD=True, TICKET=False, PRECISION="tf32", BLOCK_H=16, BLOCK_S=64,
                  BLOCK_R=64, NARROW=True, SPLITS=10, TAIL=False, BLOCK_ALL=1024, ROWSUM_MMA=True, PDL=False)
    constants = {"_merge_kernel": dict(SPLITS=10, LATENT=512, BLOCK_H=8, BLOCK_C=128),
                 "_sparse_mla_kernel": dict(spread, BLOCK_C=512, V_SPLIT=1, STREAM=False),
                 "_sparse_mla_grouped_kernel": dict(spread, BLOCK_G=128, ONE_BLOCK=False)}[kernel]
    module = "runtime.kernels.triton." + ("mla_grouped" if kernel == "_sparse_mla_grouped_kernel" else "attention")
    done = compile_for_sm90(module, kernel, signature, {**constants, "PDL": pdl}, num_warps=4, num_stages=2,
                            enable_fp_fusion=False)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
    found = [line for line in done.stdout.splitlines() if line.startswith("griddepcontrol")]
    assert found == [f"griddepcontrol: {wants}"], found


def test_launch_mode_oracle_fails_when_a_mode_folds_other_chunks():
    """Negative control: a gathered mode that ran the query as one chunk (no fold) instead of the
    deployment's 3 would round differently, and the same-bits check sees it."""
    q, cache, slots, _, _ = _attention_case(4, 2, 20, 64, 16, 120, 8, 64, torch.float32)
    outs = {"spread, 3 chunks": _run_attention(q, cache, slots, 64, 0.1, 3, 16, 16, True, "ticket"),
            "gathered, 1 chunk": _run_attention(q, cache, slots, 64, 0.1, 1, 16, 16, False)}
    with pytest.raises(AssertionError, match="differs"):
        assert_same_bits(outs)


def test_sparse_mla_never_reads_unselected_poisoned_slots():
    """-1 slots point nowhere; every cache row no query selects is NaN (never written). Negative
    control: the same padding turned into a real slot id of a poisoned row leaks NaN."""
    q, cache, slots, dense_kv, mask = _attention_case(5, 3, 20, 64, 16, 30, 8, 40, torch.float32)
    used = torch.zeros(cache.shape[0], dtype=torch.bool, device=DEVICE)
    used[slots[slots >= 0].long()] = True
    cache[~used] = float("nan")
    assert (slots < 0).any() and (~used).any()
    scale = 80 ** -0.5
    expected = reference.sparse_attention(q.cpu(), torch.nan_to_num(dense_kv, nan=0.0), mask, 64, scale)
    for mode in MLA_MODES:
        assert_close_scaled(_run_attention(q, cache, slots, 64, scale, 3, 16, 16, *mode), expected, torch.float32)
    leaky = torch.where(slots < 0, int(torch.nonzero(~used)[0]), slots).to(torch.int32)
    with pytest.raises(AssertionError, match="NaN"):
        assert_close_scaled(_run_attention(q, cache, leaky, 64, scale, 3, 16, 16), expected, torch.float32)


def test_batch_invariance_oracle_fails_when_splits_follow_the_batch():
    """Negative control: choosing the split count from the batch size (what a naive "fill the GPU"
    heuristic does) changes a row's bits, and the oracle sees it."""
    q, cache, slots, _, _ = _attention_case(3, 4, 16, 64, 16, 200, 8, 160, torch.float32)
    run = lambda k: _run_attention(q[:k], cache, slots[:k], 64, 0.1, splits=6 if k < 4 else 1)  # noqa: E731
    with pytest.raises(AssertionError, match="row results changed"):
        assert_prefix_invariant(run(4), run, 4)


# ---------------------------------------------------------------- indexer logits + top-k

def _indexer_case(seed, queries, heads, dim, context, page_size, dtype, dup_every=3):
    gen = torch.Generator().manual_seed(seed)
    pages = -(-context // page_size)
    page_table = torch.stack([torch.randperm(pages * queries + 2, generator=gen)[:pages] for _ in range(queries)])
    keys = randn(gen, (pages * queries + 2) * page_size, dim, dtype=dtype)
    lens = torch.randint(1, context + 1, (queries,), generator=gen)
    lens[0] = context
    dense = []
    for i in range(queries):
        pos = torch.arange(context)
        rows = page_table[i][pos // page_size] * page_size + pos % page_size
        if dup_every:
            keys[rows[dup_every::dup_every].to(DEVICE)] = keys[rows[0]].clone()  # equal keys: tied logits
        dense.append(rows)
    q = randn(gen, queries, heads, dim, dtype=dtype)
    w = randn(gen, queries, heads)
    return q, w, keys, page_table.to(torch.int32).to(DEVICE), lens.to(torch.int32).to(DEVICE), dense


def _run_indexer(q, w, keys, table, lens, page_size, key_scale=None, blocks=None, early_scale=None, launch=None,
                 unmasked_full_blocks=None, prefetch_scale=None):
    out = poisoned(q.shape[0], table.shape[1] * page_size, dtype=torch.float32)
    indexer.indexer_logits(q, w, keys, table, lens, page_size, key_scale=key_scale, out=out, blocks=blocks,
                           early_scale=early_scale, launch=launch, unmasked_full_blocks=unmasked_full_blocks,
                           prefetch_scale=prefetch_scale)
    return out


def _scaled_keys(keys):
    """fp8 keys and their per-slot scale on the GPU; on CPU (no fp8 dot in the interpreter) the keys as
    they are with a random scale."""
    if ON_GPU:
        keys, key_scale = elementwise.quantize_groups(keys.to(torch.float32))
        return keys, key_scale[:, 0].contiguous()
    return keys, torch.rand(keys.shape[0], device=DEVICE) + 0.5


@settings(max_examples=4 if ON_GPU else 2, deadline=None)
@given(seed=SEEDS, queries=st.sampled_from([1, 3]), context=st.sampled_from([65, 150, 300]),
       dtype=st.sampled_from(DTYPES))
def test_indexer_blocks_per_program_keep_the_bits(seed, queries, context, dtype):
    """How many position blocks a program walks (`blocks_per_program`: fewer for small steps) only moves
    blocks between programs: every logit is the same bits, -inf past each length included."""
    q, w, keys, table, lens, dense = _indexer_case(seed, queries, 4, 16, context, 16, dtype)
    outs = [_run_indexer(q, w, keys, table, lens, 16, blocks=b) for b in (1, 2, 8)]
    assert not torch.isnan(outs[0]).any()
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@settings(max_examples=4 if ON_GPU else 3, deadline=None)
@given(seed=SEEDS, queries=st.sampled_from([2, 5]), context=st.sampled_from([64, 150, 300]),
       page_size=st.sampled_from([4, 16, 64]), dtype=st.sampled_from(DTYPES), blocks=st.sampled_from([1, 2]),
       scaled=st.booleans())
@example(seed=1, queries=5, context=300, page_size=16, dtype=torch.float32, blocks=2, scaled=True)
def test_indexer_early_key_scale_keeps_the_bits(seed, queries, context, page_size, dtype, blocks, scaled):
    """`early_scale` (each block's key scale loaded before its keys and their MMA) changes no bit. Queries
    of several lengths (some programs full, some partly or wholly past the length): every logit is the
    late load's bits, -inf past each length included."""
    q, w, keys, table, lens, _ = _indexer_case(seed, queries, 4, 16, context, page_size, dtype)
    key_scale = None
    if scaled:
        keys, key_scale = _scaled_keys(keys)
        q = q.to(keys.dtype)
    late, early = (_run_indexer(q, w, keys, table, lens, page_size, key_scale, blocks=blocks, early_scale=value)
                   for value in (False, True))
    assert not torch.isnan(early).any(), "a position left unwritten (poison)"
    assert torch.equal(early, late)


@settings(max_examples=4 if ON_GPU else 3, deadline=None)
@given(seed=SEEDS, queries=st.sampled_from([2, 5]), context=st.sampled_from([64, 150, 300]),
       page_size=st.sampled_from([4, 16, 64]), dtype=st.sampled_from(DTYPES), blocks=st.sampled_from([1, 2, None]),
       scaled=st.booleans())
@example(seed=2, queries=5, context=256, page_size=16, dtype=torch.float32, blocks=None, scaled=True)
def test_indexer_unmasked_full_blocks_keep_the_bits(seed, queries, context, page_size, dtype, blocks, scaled):
    """`unmasked_full_blocks` (a program's blocks wholly below the length run without masks, its last live
    block masked after the loop), with and without `prefetch_scale` (each full block's key scales loaded
    during the block before), changes no bit. Lengths of whole blocks (context 64 / 256: no masked block)
    and of any size; every logit the masked loop's bits, -inf past each length included."""
    q, w, keys, table, lens, _ = _indexer_case(seed, queries, 4, 16, context, page_size, dtype)
    key_scale = None
    if scaled:
        keys, key_scale = _scaled_keys(keys)
        q = q.to(keys.dtype)
    masked = _run_indexer(q, w, keys, table, lens, page_size, key_scale, blocks=blocks, unmasked_full_blocks=False)
    for prefetch in (False, True):
        unmasked = _run_indexer(q, w, keys, table, lens, page_size, key_scale, blocks=blocks,
                                unmasked_full_blocks=True, prefetch_scale=prefetch)
        assert not torch.isnan(unmasked).any(), f"a position left unwritten (poison; prefetch {prefetch})"
        assert torch.equal(unmasked, masked), f"prefetch {prefetch}"


def test_indexer_unmasked_check_sees_a_length_one_short_or_a_scale_changed():
    """Negative controls of the test above: the unmasked run over lengths one shorter for one query (its
    last key now past the length, so its last block masked) must differ in that position alone; the
    prefetching run with one key scale changed (the second block's first: loaded during the first block)
    must differ in that position alone."""
    q, w, keys, table, lens, dense = _indexer_case(4, 3, 4, 16, 150, 16, torch.float32)
    want = _run_indexer(q, w, keys, table, lens, 16, unmasked_full_blocks=False)
    shorter = lens.clone()
    shorter[0] -= 1
    got = _run_indexer(q, w, keys, table, shorter, 16, unmasked_full_blocks=True)
    differs = (got != want).nonzero().tolist()
    assert differs == [[0, int(lens[0]) - 1]] and got[0, int(lens[0]) - 1] == float("-inf")
    keys, key_scale = _scaled_keys(keys)
    q = q.to(keys.dtype)
    block = indexer.block_positions()
    want = _run_indexer(q, w, keys, table, lens, 16, key_scale, blocks=2, unmasked_full_blocks=False)
    changed = key_scale.clone()
    slot = int(dense[0][block])
    changed[slot] *= 2
    got = _run_indexer(q, w, keys, table, lens, 16, changed, blocks=2, unmasked_full_blocks=True, prefetch_scale=True)
    rows_using_slot = {i for i in range(3) for j in range(int(lens[i])) if int(dense[i][j]) == slot}
    differs = {tuple(x) for x in (got != want).nonzero().tolist()}
    assert (0, block) in differs and {i for i, _ in differs} <= rows_using_slot


# Blocks of positions that run one MMA form: sm_90 runs blocks of fewer than 64 rows as another
# instruction (the H100 gave other bits at 16 and 32), so a GPU compares its 64-row forms only.
BLOCKS_KEEPING_BITS = (64, 128, 256) if ON_GPU else (16, 32, 64)


@settings(max_examples=3, deadline=None)
@given(seed=SEEDS, queries=st.sampled_from([2, 5]), context=st.sampled_from([100, 300]),
       page_size=st.sampled_from([4, 16, 64]), dtype=st.sampled_from(DTYPES), scaled=st.booleans())
def test_indexer_launch_shapes_keep_the_bits(seed, queries, context, page_size, dtype, scaled):
    """Blocks of BLOCKS_KEEPING_BITS positions (`launch`'s block_l; warps and stages are the GPU test's)
    give every logit the same bits, -inf past each length included: a block only moves positions between
    programs and MMA rows."""
    q, w, keys, table, lens, _ = _indexer_case(seed, queries, 4, 16, context, page_size, dtype)
    key_scale = None
    if scaled:
        keys, key_scale = _scaled_keys(keys)
        q = q.to(keys.dtype)
    outs = [_run_indexer(q, w, keys, table, lens, page_size, key_scale, launch=dict(block_l=b))
            for b in BLOCKS_KEEPING_BITS]
    assert not torch.isnan(outs[0]).any(), "a position left unwritten (poison)"
    assert all(torch.equal(out, outs[0]) for out in outs[1:])


def test_indexer_launch_check_sees_one_logit_change():
    """Negative control of the launch-shape tests: the same comparison over keys with one position's key
    changed (in the last block of a query, where a short block would lose it) must see it. (Queries may
    share a page, so only query 0's change is asserted.)"""
    q, w, keys, table, lens, dense = _indexer_case(3, 2, 4, 16, 150, 16, torch.float32, dup_every=0)
    short, tall = BLOCKS_KEEPING_BITS[0], BLOCKS_KEEPING_BITS[-1]
    want = _run_indexer(q, w, keys, table, lens, 16, launch=dict(block_l=short))
    last = int(lens[0]) - 1
    keys[dense[0][last].to(DEVICE)] += 1.0
    got = _run_indexer(q, w, keys, table, lens, 16, launch=dict(block_l=tall))
    assert not torch.equal(got, want) and got[0, last] != want[0, last]


def test_indexer_launch_knobs_are_checked():
    with pytest.raises(ValueError, match="unknown"):
        indexer.launch_shape(dict(block_m=64))
    with pytest.raises(ValueError, match="power of two"):
        indexer.launch_shape(dict(block_l=96))
    assert set(indexer.launch_shape()) == set(indexer.LAUNCH)
    for knobs in indexer.LAUNCH_VARIANTS.values():
        indexer.launch_shape(knobs)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device (run on the device machine: scripts/gpu_suite.sh)")
@pytest.mark.parametrize("keys_dtype", ["fp8", "bf16"])
def test_indexer_launch_variants_keep_the_deployed_bits(keys_dtype):
    """Every launch shape bench.kernels times (indexer.LAUNCH_VARIANTS) at the deployment's heads and dim:
    the deployed launch's bits, or the shape cannot be deployed. A shape the chip cannot hold is skipped
    by name (the bench reports it the same way)."""
    q, w, keys, table, lens, _ = _indexer_case(5, 4, 64, 128, 3000, 64, torch.bfloat16)
    key_scale = None
    if keys_dtype == "fp8":
        keys, key_scale = _scaled_keys(keys)
        q = q.to(keys.dtype)
    want = _run_indexer(q, w, keys, table, lens, 64, key_scale)
    assert not torch.isnan(want).any()
    changed, refused = launches_changing_bits(
        indexer.LAUNCH_VARIANTS, lambda knobs: _run_indexer(q, w, keys, table, lens, 64, key_scale, launch=knobs), want)
    assert not changed, f"launch shapes {changed} changed logits' bits: they must not be deployed"
    print(f"launch shapes the chip could not hold: {refused}")


def launches_changing_bits(variants: dict, run, want: torch.Tensor) -> tuple[list[str], list[str]]:
    """Run each of `variants` (name: knobs) through `run(knobs)`: the names whose output is not `want`'s bits,
    and the names the chip could not hold (Triton's OutOfResources: shared memory, registers)."""
    changed, refused = [], []
    for name, knobs in variants.items():
        try:
            got = run(knobs)
        except Exception as err:  # noqa: BLE001 - triton's OutOfResources (shared memory, registers)
            if "OutOfResources" not in type(err).__name__:
                raise
            refused.append(name)
            continue
        if not torch.equal(got, want):
            changed.append(name)
    return changed, refused


def test_indexer_spreads_small_steps_over_more_programs():
    assert indexer.blocks_per_program(1, 2048, 128) == 1  # bs 1: 16 programs of one block, not 2 of eight
    assert indexer.blocks_per_program(128, 2048, 128) == 8  # 256 programs already
    assert indexer.blocks_per_program(4096, 65536, 128) == 8
    assert indexer.blocks_per_program(16, 2048, 128) == 1


@EXAMPLES
@given(seed=SEEDS, queries=st.sampled_from([1, 2, 5]), heads=st.sampled_from([1, 4, 17]),
       dim=st.sampled_from([16, 40]), context=st.sampled_from([1, 31, 64, 65, 150]),
       page_size=st.sampled_from([1, 16, 64]), dtype=st.sampled_from(DTYPES),
       window=st.sampled_from([1, 8]), topk=st.sampled_from([1, 24]))
def test_indexer_logits_and_selection_match_reference_tie_aware(seed, queries, heads, dim, context, page_size, dtype,
                                                                window, topk):
    q, w, keys, table, lens, dense = _indexer_case(seed, queries, heads, dim, context, page_size, dtype)
    logits = _run_indexer(q, w, keys, table, lens, page_size)
    positions = (lens - 1).to(torch.int64)
    selected = indexer.select_positions(logits, positions, window, topk).cpu()
    for i in range(queries):
        n = int(lens[i])
        expected = reference.indexer_scores(q[i:i + 1].cpu(), w[i:i + 1].cpu(), keys.cpu()[dense[i][:n]])[0]
        assert_close_scaled(logits[i, :n], expected, dtype, msg=f"query {i}")
        assert bool((logits[i, n:] == float("-inf")).all()), "positions past the length must be -inf"
        chosen = torch.zeros(n, dtype=torch.bool)
        picks = selected[i][selected[i] >= 0].long()
        assert len(set(picks.tolist())) == len(picks), "a position selected twice"
        chosen[picks] = True
        cols = torch.arange(n)
        in_window = cols > n - 1 - window
        assert torch.equal(chosen & in_window, in_window), "the window is always selected"
        candidates = cols <= n - 1 - window
        atol = 1e-4
        tie_tol = 8 * (atol + float(expected.abs().max()) * (1e-2 if dtype != torch.float32 else 1e-5))
        wrong = wrong_topk_indices(chosen & candidates, expected, candidates, topk, tie_tol=tie_tol)
        assert wrong == [], f"query {i}: wrong top-k indices {wrong}"
    assert_prefix_invariant(logits, lambda k: _run_indexer(q[:k], w[:k], keys, table[:k], lens[:k], page_size),
                            queries)


# ---------------------------------------------------------------- dense GEMM

# (N, K): a narrow N with a long K (split over K), a wide N (no split), K off the block size.
GEMM_SHAPES = st.sampled_from([(40, 1024), (300, 96), (72, 130), (8, 512)])


def _run_matmul(x, w, split_k=None):
    out = poisoned(x.shape[0], w.shape[0], dtype=x.dtype)
    assert matmul.matmul(x, w, out=out, split_k=split_k).data_ptr() == out.data_ptr()
    return out


@EXAMPLES
@given(seed=SEEDS, rows=st.sampled_from([1, 2, 17, 64, 65, 130, 300]), shape=GEMM_SHAPES,
       dtype=st.sampled_from(DTYPES), magnitude=st.sampled_from([1e-2, 1.0, 30.0]))
@example(seed=0, rows=300, shape=(40, 1024), dtype=DTYPES[0], magnitude=1.0)  # both configs, split K
@example(seed=1, rows=300, shape=(300, 96), dtype=DTYPES[-1], magnitude=1.0)
def test_matmul_matches_reference_and_is_batch_invariant(seed, rows, shape, dtype, magnitude):
    """Prefixes cross row tiles and the decode/prefill config switch (PREFILL_ROWS): a row's bits must
    depend neither on the tile it rides in nor on the tile shape."""
    n, k = shape
    gen = torch.Generator().manual_seed(seed)
    x, w = randn(gen, rows, k, scale=magnitude, dtype=dtype), randn(gen, n, k, scale=k ** -0.5, dtype=dtype)
    out = _run_matmul(x, w)
    assert_close_scaled(out, reference.linear(x.cpu(), w.cpu()), dtype)
    assert_prefix_invariant(out, lambda m: _run_matmul(x[:m], w), rows)


@EXAMPLES
@given(seed=SEEDS, rows=st.sampled_from([1, 17, 300]), split=st.sampled_from([2, 3, 4]), dtype=st.sampled_from(DTYPES),
       magnitude=st.sampled_from([1e-2, 1.0, 30.0]))
def test_matmul_fused_splits_give_the_split_kernels_bits(seed, rows, split, dtype, magnitude):
    """A prefill pass adds its splits inside the tile's program; a decode pass writes partials and
    sums them in a second kernel. Same additions in the same order: same bits, at any row count."""
    gen = torch.Generator().manual_seed(seed)
    x, w = randn(gen, rows, 520, scale=magnitude, dtype=dtype), randn(gen, 72, 520, scale=520 ** -0.5, dtype=dtype)
    run = lambda fused: matmul.matmul(x, w, out=poisoned(rows, 72, dtype=dtype), split_k=split,  # noqa: E731
                                      fused_splits=fused)
    apart, fused = run(False), run(True)
    assert_close_scaled(fused, reference.linear(x.cpu(), w.cpu()), dtype)
    assert torch.equal(apart, fused)


@settings(max_examples=6 if ON_GPU else 2, deadline=None)
@given(seed=SEEDS, rows=st.sampled_from([257, 300]), shape=st.sampled_from([(72, 520), (300, 96), (40, 1024)]),
       split=st.sampled_from([None, 2, 4]), dtype=st.sampled_from(DTYPES), magnitude=st.sampled_from([1e-2, 1.0, 30.0]))
@example(seed=0, rows=300, shape=(72, 520), split=4, dtype=DTYPES[0], magnitude=1.0)  # K off the box, 4 splits
def test_matmul_tma_kernel_gives_the_pointer_kernels_bits(seed, rows, shape, split, dtype, magnitude):
    """The persistent TMA kernel (PREFILL_TMA) only moves loads and programs around: each output's
    k steps and split order are the pointer kernel's, so its bits must be too (K off the box size:
    the box past K reads zeros, as the masked loads do), whether its split partials are added by
    `_split_sum_kernel` or by a program walking its tile's splits (fused, FUSED_TMA), in whose
    128 x 128 tiles the splits are added."""
    n, k = shape
    gen = torch.Generator().manual_seed(seed)
    x, w = randn(gen, rows, k, scale=magnitude, dtype=dtype), randn(gen, n, k, scale=k ** -0.5, dtype=dtype)
    run = lambda tma, fused=False: matmul.matmul(  # noqa: E731
        x, w, out=poisoned(rows, n, dtype=dtype), split_k=split, fused_splits=fused, tma=tma)
    pointer, apart = run(False), run(True)
    assert_close_scaled(apart, reference.linear(x.cpu(), w.cpu()), dtype)
    assert torch.equal(pointer, apart)
    if split and split > 1:
        assert torch.equal(pointer, run(True, fused=True)), "the TMA kernel's fused splits changed the bits"


def test_matmul_tma_oracle_fails_when_a_split_is_dropped():
    """Negative control: a TMA pass that lost its last split's partial differs from the pointer kernel."""
    gen = torch.Generator().manual_seed(2)
    x, w = randn(gen, 300, 520, dtype=DTYPES[0]), randn(gen, 72, 520, scale=520 ** -0.5, dtype=DTYPES[0])
    pointer = matmul.matmul(x, w, split_k=2, fused_splits=False, tma=False)
    head = matmul.matmul(x[:, :256].contiguous(), w[:, :256].contiguous(), split_k=1, tma=True)
    assert not torch.equal(pointer, head)


def test_matmul_tma_serves_16_bit_prefill_passes_only(monkeypatch):
    assert matmul.PREFILL_TMA  # deployed: same bits, faster on the H200 (docs/results.md, twelfth session)
    assert matmul.FUSED_TMA  # deployed: same bits, faster on the H200 (docs/results.md, fifteenth session)
    assert matmul.uses_tma(4096, 2, fused=False)
    assert matmul.uses_tma(4096, 2, fused=True)
    assert not matmul.uses_tma(4096, 4, fused=False)  # float32 (the canary on a GPU): its bits stay put
    assert not matmul.uses_tma(matmul.PREFILL_ROWS, 2, fused=False)  # decode
    monkeypatch.setattr(matmul, "FUSED_TMA", False)
    assert not matmul.uses_tma(4096, 2, fused=True)  # then fused splits keep the pointer kernel
    monkeypatch.setattr(matmul, "PREFILL_TMA", False)
    assert not matmul.uses_tma(4096, 2, fused=False)


@pytest.mark.skipif(ON_GPU, reason="on a GPU the TMA bits test compiles it for real")
@pytest.mark.parametrize("split, flatten, fused", [(1, True, False), (8, False, False), (8, True, False),
                                                   (8, False, True)])
def test_matmul_tma_kernel_compiles_for_the_gpu_without_one(split, flatten, fused):
    """The prefill tile (128 x 256, bf16, 8 warps; 128 x 128 with fused splits) through sm_90's
    compiler: descriptors, the persistent loop and the partials' store are what the interpreter
    cannot vouch for."""
    from tests.kernels.test_indexer_topk import compile_for_sm90

    launch = matmul.config_for(4096, 2, fused=fused)  # the warps and stages a 4,096-row bf16 pass launches with
    block_n = launch["BLOCK_N"]
    signature = {"x_desc": "tensordesc<bf16[128, 64]>", "w_desc": f"tensordesc<bf16[{block_n}, 64]>",
                 "out_ptr": "*bf16", "part_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32", "k_chunk": "i32",
                 "stride_om": "i32"}
    constants = dict(SPLIT_K=split, PRECISION="tf32", BLOCK_M=128, BLOCK_N=block_n, BLOCK_K=64, PROGRAMS=132,
                     FLATTEN=flatten, FUSED=fused)
    done = compile_for_sm90("runtime.kernels.triton.matmul", "_matmul_tma_kernel", signature, constants,
                            num_warps=launch["num_warps"], num_stages=launch["num_stages"])
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


def test_matmul_fuses_the_splits_of_prefill_passes_only(monkeypatch):
    assert matmul.fuses_splits(4096, 4096, 8)  # lm_head / router: the partials' traffic dominates
    assert matmul.fuses_splits(4096, 32768, 8, element_size=2)  # attention output, 16-bit: the TMA kernel walks them
    assert not matmul.fuses_splits(4096, 32768, 8, element_size=4)  # float32: long splits keep the wide pointer tile
    assert not matmul.fuses_splits(matmul.PREFILL_ROWS, 4096, 8, element_size=2)  # decode: one program per split
    assert not matmul.fuses_splits(4096, 4096, 1, element_size=2)
    monkeypatch.setattr(matmul, "FUSED_TMA", False)
    assert not matmul.fuses_splits(4096, 32768, 8, element_size=2)


def test_matmul_split_is_fixed_per_shape_and_fills_a_decode_step():
    assert matmul.split_for(4096, 32768) > 1  # attention output: few N tiles, long K
    assert matmul.split_for(36864, 4096) == 1  # query projection: N tiles enough
    assert all(matmul.split_for(n, k) == matmul.split_for(n, k) for n, k in [(256, 4096), (576, 4096)])


def test_matmul_invariance_oracle_fails_when_the_split_follows_the_batch():
    """Negative control: a split-K chosen from M (what cuBLAS's heuristics do) changes a row's bits."""
    gen = torch.Generator().manual_seed(1)
    x, w = randn(gen, 8, 1024, dtype=torch.float32), randn(gen, 40, 1024, scale=1 / 32, dtype=torch.float32)
    run = lambda m: _run_matmul(x[:m], w, split_k=4 if m < 8 else 1)  # noqa: E731
    with pytest.raises(AssertionError, match="row results changed"):
        assert_prefix_invariant(run(8), run, 8)


# ---------------------------------------------------------------- RMSNorm, RoPE

@EXAMPLES
@given(seed=SEEDS, rows=ROWS, width=st.sampled_from([1, 17, 64, 300]), dtype=st.sampled_from(DTYPES),
       magnitude=st.sampled_from([1e-2, 1.0, 1e3]))
def test_rms_norm_matches_reference_and_is_batch_invariant(seed, rows, width, dtype, magnitude):
    gen = torch.Generator().manual_seed(seed)
    x, w = randn(gen, rows, width, scale=magnitude, dtype=dtype), randn(gen, width, dtype=dtype)
    run = lambda k: elementwise.rms_norm(x[:k], w, 1e-6, out=poisoned(k, width, dtype=dtype))  # noqa: E731
    out = run(rows)
    assert_close_scaled(out, reference.rms_norm(x.cpu(), w.cpu(), 1e-6), dtype)
    assert_prefix_invariant(out, run, rows)


@EXAMPLES
@given(seed=SEEDS, rows=ROWS, heads=st.sampled_from([1, 3, 16]), half=st.sampled_from([4, 8, 32, 33]),
       max_pos=st.sampled_from([10, 100_000]), dtype=st.sampled_from(DTYPES))
def test_rope_matches_reference_and_is_batch_invariant(seed, rows, heads, half, max_pos, dtype):
    gen = torch.Generator().manual_seed(seed)
    x = randn(gen, rows, heads, 2 * half, dtype=dtype)
    positions = torch.randint(0, max_pos, (rows,), generator=gen).to(DEVICE)
    cos, sin = cuda_torch.rope_table(half, 10000.0, max_pos, DEVICE, dtype)

    def run(k):  # the step's RoPE, in place on a copy of the first k rows
        return glue.rope_(x[:k].clone(), positions[:k], cos, sin)
    out = run(rows)
    assert_close_scaled(out, reference.rope(x.cpu(), positions.cpu(), 10000.0), dtype)
    assert_prefix_invariant(out, run, rows)


def test_poisoned_output_catches_an_unwritten_row():
    """Negative control: a kernel that skips the last row leaves NaN, and the check fails."""
    gen = torch.Generator().manual_seed(0)
    x, w = randn(gen, 5, 17, dtype=DTYPES[0]), randn(gen, 17, dtype=DTYPES[0])
    out = poisoned(5, 17, dtype=DTYPES[0])
    elementwise.rms_norm(x[:4], w, 1e-6, out=out[:4])
    with pytest.raises(AssertionError, match="NaN"):
        assert_close_scaled(out, reference.rms_norm(x.cpu(), w.cpu(), 1e-6), DTYPES[0])


def test_interpreter_is_used_exactly_without_cuda():
    assert INTERPRETED == (not ON_GPU)


def test_quantize_packed_in_steps_gives_one_calls_bits():
    """moe.quantize_packed quantizes the routed experts a few at a time: a block's scale is its own, so any
    step gives the bits of one quantize_weight_blocks call over all of them (the shared expert too)."""
    _, raw, _, _ = _moe_case(4, 1, 5, 2, 256, 136, True, torch.float32, 1.0)
    packed = moe.pack_weights(*raw)
    whole = moe.quantize_packed(packed, experts_per_step=len(raw[0]))
    for step in (1, 2):
        stepped = moe.quantize_packed(packed, experts_per_step=step)
        for name in ("w13", "w2", "shared_w13", "shared_w2", "w13_scale", "w2_scale", "shared_w13_scale",
                     "shared_w2_scale"):
            a, b = getattr(stepped, name), getattr(whole, name)
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                                                      b.view(torch.uint8) if b.element_size() == 1 else b), name
    assert torch.equal(whole.w13_scale, elementwise.quantize_weight_blocks(packed.w13)[1])


# ---------------------------------------------------------------- GPU only: fp8, graphs, streams

@gpu
@EXAMPLES
@given(seed=SEEDS, rows=ROWS, width=st.sampled_from([64, 128, 300]), magnitude=st.sampled_from([1e-2, 1.0, 300.0]))
def test_fp8_group_quantization_round_trips(seed, rows, width, magnitude):
    gen = torch.Generator().manual_seed(seed)
    x = randn(gen, rows, width, scale=magnitude, dtype=torch.bfloat16)
    q, scale = elementwise.quantize_groups(x)
    back = elementwise.dequantize_groups(q, scale, torch.float32)
    groups = scale.shape[1]
    amax = torch.nn.functional.pad(x.float().abs(), (0, groups * 128 - width)).view(rows, groups, 128).amax(-1)
    torch.testing.assert_close(scale, amax / elementwise.FP8_MAX, rtol=1e-6, atol=0)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 of the group's scale range.
    bound = scale.repeat_interleave(128, 1)[:, :width] * elementwise.FP8_MAX * 2.0 ** -4
    assert bool(((back - x.float()).abs() <= bound + 1e-30).all())


@gpu
@EXAMPLES
@given(seed=SEEDS, tokens=ROWS, shape=st.sampled_from([(9, 3, 256, 128), (16, 6, 384, 256), (8, 2, 200, 136)]),
       shared=st.booleans(), split_k=st.sampled_from([1, 2]))
def test_fp8_fused_moe_matches_dequantized_reference(seed, tokens, shape, shared, split_k):
    experts, top_k, hidden, inter = shape
    x, raw, ids, route_w = _moe_case(seed, tokens, experts, top_k, hidden, inter, shared, torch.bfloat16, 1.0)
    packed = fp8_packed(raw, shared)
    out = _run_moe(x, packed, ids, route_w, split_k)
    # Reference over the dequantized weights; activations are quantized too (per 128), so the
    # tolerance is e4m3's: 2^-4 relative per operand.
    deq13 = elementwise.dequantize_weight_blocks(packed.w13, packed.w13_scale)
    deq = [deq13[:, :inter], deq13[:, inter:], elementwise.dequantize_weight_blocks(packed.w2, packed.w2_scale)]
    if shared:
        s13d = elementwise.dequantize_weight_blocks(packed.shared_w13, packed.shared_w13_scale)[0]
        deq += [s13d[:inter], s13d[inter:],
                elementwise.dequantize_weight_blocks(packed.shared_w2, packed.shared_w2_scale)[0]]
    else:
        deq += [None] * 3
    expected = _moe_reference(x.float(), deq, ids, route_w)
    magnitude = max(1.0, float(expected.abs().max())) if tokens else 1.0
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.cpu().double(), expected, atol=0.15 * magnitude, rtol=0.15)
    assert_prefix_invariant(out, lambda k: _run_moe(x[:k], packed, ids[:k], route_w[:k], split_k), tokens)


@gpu
def test_fused_moe_full_size_tuned_buckets_and_per_row_path_keep_a_rows_bits():
    """E=256, top-6, hidden 4096, I=256 (TP8 shard): batches of 1, 16, 33, 600 and 2,100 use different
    tuned configs from the device's config file (the last two taller tiles: 32 and 128 rows, the
    latter wgmma instead of mma.sync), and a single token takes the per-row path (no alignment); a row's bits
    must not change, and the rows must match the reference."""
    experts, top_k, hidden, inter, tokens = 256, 6, 4096, 256, 2100
    if moe.moe_config(experts, inter, False, 1) == moe.moe_config(experts, inter, False, tokens):
        pytest.skip("no tuned config file with distinct buckets for this device")
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) * hidden ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn(experts, hidden, inter, device="cuda", generator=gen) * inter ** -0.5).to(torch.bfloat16)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    ids = torch.rand(tokens, experts, device="cuda", generator=gen).argsort(dim=1)[:, :top_k]
    route_w = torch.rand(tokens, top_k, device="cuda", generator=gen) + 0.1
    packed = moe.PackedMoE(w13, w2)
    split_k = moe.gate_up_splits(hidden, inter)
    out = _run_moe(x, packed, ids, route_w, split_k)
    for t in (0, 16, 32):
        expected = torch.zeros(hidden, dtype=torch.float64)
        for j in range(top_k):
            e = int(ids[t, j])
            expected += float(route_w[t, j]) * reference.swiglu_expert(
                x[t].cpu(), w13[e, :inter].cpu(), w13[e, inter:].cpu(), w2[e].cpu())
        assert_close_scaled(out[t], expected, torch.bfloat16, msg=f"token {t}")
    assert {moe.moe_config(experts, inter, False, k).get("BLOCK_M", moe.BLOCK_M) for k in (16, 600, tokens)} \
        == {16, 32, 128}, "the tuned file no longer spans three tile heights: this test checks less"
    for k in (1, 16, 33, 600):
        assert torch.equal(out[:k], _run_moe(x[:k], packed, ids[:k], route_w[:k], split_k)), f"prefix {k}"
    assert torch.equal(out[16:17], _run_moe(x[16:17], packed, ids[16:17], route_w[16:17], split_k))


def _eager_graph_and_side_stream(make_inputs, run):
    """Capture run(*inputs) in a CUDA graph with one set of inputs, replay it on new ones, and run the
    new ones eagerly and on a side stream. Returns (eager, replayed, side_stream) outputs."""
    static = make_inputs(0)
    run(*static)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = run(*static)
    fresh = make_inputs(1)
    for dst, src in zip(static, fresh):
        if isinstance(dst, torch.Tensor):
            dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    eager = run(*fresh)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        on_side = run(*fresh)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    return eager, static_out, on_side


@gpu
@pytest.mark.parametrize("tokens,split_k", [(1, 4), (17, 1), (64, 4)])
def test_fused_moe_under_graph_replay_and_side_stream(tokens, split_k):
    packed = moe.pack_weights(*_moe_case(0, tokens, 16, 6, 512, 128, True, torch.bfloat16, 1.0)[1])

    def make(seed):
        x, _, ids, route_w = _moe_case(seed, tokens, 16, 6, 512, 128, True, torch.bfloat16, 1.0)
        return x, ids, route_w
    eager, replayed, side = _eager_graph_and_side_stream(
        make, lambda x, ids, w: moe.fused_moe(x, packed, w, ids, split_k=split_k))
    assert torch.equal(replayed, eager), "graph replay differs from eager"
    assert torch.equal(side, eager), "side stream differs from eager"


@gpu
@pytest.mark.parametrize("queries,splits", [(1, 4), (9, 1), (9, 3), (200, 3)])  # 200: the gathered mode
def test_sparse_mla_under_graph_replay_and_side_stream(queries, splits):
    def make(seed):
        q, cache, slots, _, _ = _attention_case(seed, queries, 16, 512, 64, 300, 16, 128, torch.bfloat16)
        return q, cache, slots
    eager, replayed, side = _eager_graph_and_side_stream(
        make, lambda q, c, s: attention.sparse_mla_decode(q, c, s, 512, 0.04, num_splits=splits))
    assert torch.equal(replayed, eager), "graph replay differs from eager"
    assert torch.equal(side, eager), "side stream differs from eager"


@gpu
def test_indexer_under_graph_replay_and_side_stream():
    def make(seed):
        q, w, keys, table, lens, _ = _indexer_case(seed, 4, 64, 128, 500, 64, torch.bfloat16)
        return q, w, keys, table, lens
    eager, replayed, side = _eager_graph_and_side_stream(
        make, lambda q, w, k, t, n: indexer.indexer_logits(q, w, k, t, n, 64))
    # -inf marks positions past each row's length: equal, and NaN-free, on all three paths.
    assert torch.equal(replayed, eager), "graph replay differs from eager"
    assert torch.equal(side, eager), "side stream differs from eager"


@gpu
def test_graph_oracle_fails_on_capture_time_metadata():
    """Negative control: a kernel that bakes a capture-time value (the selection length read on the
    host) into the graph must differ from eager after replay with new metadata."""
    def make(seed):
        q, cache, slots, _, _ = _attention_case(seed, 2, 16, 64, 16, 100 + 50 * seed, 8, 40, torch.bfloat16)
        return q, cache, slots

    def run(q, cache, slots):
        baked = int(math.ceil(slots.shape[1] / 2))  # a host-side decision frozen at capture
        return attention.sparse_mla_decode(q, cache, slots[:, :baked] if seed_box[0] else slots, 64, 0.1)
    seed_box = [True]
    with pytest.raises(AssertionError):
        static = make(0)
        run(*static)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run(*static)
        static[0].copy_(make(1)[0])
        graph.replay()
        seed_box[0] = False
        assert torch.equal(out, run(static[0], static[1], static[2])), "graph replay differs from eager"


def test_one_block_loop_runs_where_chunks_are_one_block_and_warps_reach_the_floor(monkeypatch):
    """mla_grouped.one_block_loop: chunks of one block at ONE_BLOCK_MIN_WARPS warps or more (where it was
    faster on the H100), never with ONE_BLOCK_CHUNKS off."""
    monkeypatch.setattr(mla_grouped, "ONE_BLOCK_MIN_WARPS", 8)
    assert mla_grouped.one_block_loop(1, 8) and not mla_grouped.one_block_loop(1, 4)
    assert not mla_grouped.one_block_loop(2, 8)
    monkeypatch.setattr(mla_grouped, "ONE_BLOCK_CHUNKS", False)
    assert not mla_grouped.one_block_loop(1, 8)
