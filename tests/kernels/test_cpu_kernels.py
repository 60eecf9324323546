"""CPU fast path vs the readable float64 reference, op by op, with hypothesis-drawn shapes.

Shapes are drawn around the traps (0 and 1 rows, row counts around the matmul tile, widths that
are not multiples of the SIMD alignment); values are never zeros, include large magnitudes, and
indexer keys include exact duplicates so top-k ties really occur.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, example, given
from hypothesis import strategies as st

from canary.oracles.tolerances import assert_close_to_reference
from canary.oracles.topk_compare import wrong_topk_indices
from runtime.kernels import cpu, reference
from runtime.kernels.cpu import ROW_TILE
from runtime.kernels.types import MoEWeights

pytestmark = pytest.mark.kernels

ROWS = st.sampled_from([0, 1, 2, ROW_TILE - 1, ROW_TILE, ROW_TILE + 1, 2 * ROW_TILE + 3, 50])
WIDTHS = st.sampled_from([1, 3, 8, 17, 64, 65, 96])
SEEDS = st.integers(0, 2**31 - 1)


def randn(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    # Never exact zeros: a kernel that forgets to write its output must not pass by luck.
    t = torch.randn(*shape, generator=gen) * scale
    return torch.where(t == 0, torch.full_like(t, 1e-3), t)


def assert_batch_invariant(fn, x: torch.Tensor, *args, **kwargs) -> None:
    """f(x)[:k] == f(x[:k]) bit for bit, for several prefixes k."""
    full = fn(x, *args, **kwargs)
    for k in sorted({1, x.shape[0] // 2, x.shape[0] - 1}):
        if 0 < k < x.shape[0]:
            part = fn(x[:k], *args, **kwargs)
            assert torch.equal(full[:k], part), f"row results changed with the batch (k={k} of {x.shape[0]})"


@given(rows=ROWS, d_in=WIDTHS, d_out=WIDTHS, seed=SEEDS, scale=st.sampled_from([1.0, 100.0]))
@example(rows=ROW_TILE + 1, d_in=65, d_out=17, seed=0, scale=100.0)
def test_linear_matches_reference_and_is_batch_invariant(rows, d_in, d_out, seed, scale):
    gen = torch.Generator().manual_seed(seed)
    x, w = randn(gen, rows, d_in, scale=scale), randn(gen, d_out, d_in)
    out = cpu.linear(x, w)
    assert out.shape == (rows, d_out)
    assert_close_to_reference(out, reference.linear(x, w), torch.float32, scale=scale * d_in ** 0.5)
    assert_batch_invariant(cpu.linear, x, w)


@given(rows=ROWS, width=WIDTHS, seed=SEEDS, scale=st.sampled_from([1e-2, 1.0, 1e3]))
def test_rms_norm_matches_reference_and_is_batch_invariant(rows, width, seed, scale):
    gen = torch.Generator().manual_seed(seed)
    x, w = randn(gen, rows, width, scale=scale), randn(gen, width)
    assert_close_to_reference(cpu.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6), torch.float32, scale=4)
    assert_batch_invariant(cpu.rms_norm, x, w, 1e-6)


@given(rows=ROWS, heads=st.sampled_from([1, 3]), half=st.sampled_from([1, 4, 8, 33]), seed=SEEDS,
       max_pos=st.sampled_from([10, 4096, 100_000]))
def test_rope_matches_reference_and_is_batch_invariant(rows, heads, half, seed, max_pos):
    gen = torch.Generator().manual_seed(seed)
    x = randn(gen, rows, heads, 2 * half)
    positions = torch.randint(0, max_pos, (rows,), generator=gen)
    assert_close_to_reference(cpu.rope(x, positions, 10000.0), reference.rope(x, positions, 10000.0),
                              torch.float32, scale=4)
    full = cpu.rope(x, positions, 10000.0)
    for k in (1, rows // 2):
        if 0 < k < rows:
            assert torch.equal(full[:k], cpu.rope(x[:k], positions[:k], 10000.0))


def _indexer_case(seed, length, queries, heads, dim, dup_every):
    gen = torch.Generator().manual_seed(seed)
    keys = randn(gen, length, dim)
    if dup_every:
        # Exact duplicate keys give exactly equal scores: the top-k must cope with ties.
        keys[dup_every::dup_every] = keys[0]
    q = randn(gen, queries, heads, dim)
    w = randn(gen, queries, heads)
    positions = torch.sort(torch.randint(0, length, (queries,), generator=gen)).values
    positions[-1] = length - 1
    return q, w, keys, positions


@given(seed=SEEDS, length=st.sampled_from([1, 5, 16, 17, 40, 131]), queries=st.sampled_from([1, 2, 7]),
       heads=st.sampled_from([1, 4]), dim=st.sampled_from([8, 17]), window=st.sampled_from([1, 4, 8]),
       topk=st.sampled_from([0, 1, 8, 24]), dup_every=st.sampled_from([0, 3]))
def test_indexer_selection_matches_reference_tie_aware(seed, length, queries, heads, dim, window, topk, dup_every):
    q, w, keys, positions = _indexer_case(seed, length, queries, heads, dim, dup_every)
    fast_scores = cpu.indexer_scores(q, w, keys, positions)
    ref_scores = reference.indexer_scores(q, w, keys)
    scored = torch.arange(length)[None, :] <= positions[:, None]  # the fast path scores only these
    assert_close_to_reference(torch.where(scored, fast_scores, 0), torch.where(scored, ref_scores, 0).float(),
                              torch.float32, scale=dim ** 0.5 * heads)
    mask = cpu.selection_mask(fast_scores, positions, window, topk)
    cols = torch.arange(length)
    for i, p in enumerate(positions.tolist()):
        in_window = (cols <= p) & (cols > p - window)
        assert torch.equal(mask[i] & in_window, in_window), "the sliding window is always selected"
        assert not bool((mask[i] & (cols > p)).any()), "no future token may be selected"
        candidates = cols <= p - window
        wrong = wrong_topk_indices(mask[i] & candidates, ref_scores[i], candidates, topk, tie_tol=1e-4)
        assert wrong == [], f"query {i} at position {p}: wrong top-k indices {wrong}"


@given(seed=SEEDS, length=st.sampled_from([3, 40]), window=st.sampled_from([1, 4]), topk=st.sampled_from([2, 8]))
def test_selection_breaks_ties_toward_earlier_positions(seed, length, window, topk):
    scores = torch.ones(1, length)  # every candidate tied
    positions = torch.tensor([length - 1])
    mask = cpu.selection_mask(scores, positions, window, topk)
    candidates = max(0, length - window)
    expected = list(range(min(topk, candidates))) + list(range(length - window, length))
    assert torch.nonzero(mask[0]).flatten().tolist() == sorted(set(p for p in expected if p >= 0))
    assert mask.tolist() == reference.selection_mask(scores.double(), positions, window, topk).tolist()


@given(seed=SEEDS, length=st.sampled_from([1, 16, 17, 90]), queries=st.sampled_from([1, 3, ROW_TILE + 1]),
       heads=st.sampled_from([1, 4]), latent=st.sampled_from([8, 32]), rope_dim=st.sampled_from([2, 16]),
       scale=st.sampled_from([1.0, 8.0]))
def test_gathered_attention_matches_reference(seed, length, queries, heads, latent, rope_dim, scale):
    from runtime.models.dsv4_mini import gathered_positions

    gen = torch.Generator().manual_seed(seed)
    q = randn(gen, queries, heads, latent + rope_dim, scale=scale)
    kv = randn(gen, length, latent + rope_dim)
    positions = torch.arange(length - queries, length).clamp(min=0)
    scores = reference.indexer_scores(randn(gen, queries, 2, 8), randn(gen, queries, 2), randn(gen, length, 8))
    mask = reference.selection_mask(scores, positions, 4, 5)
    softmax_scale = (latent + rope_dim) ** -0.5
    selected, valid = gathered_positions(mask, 9)
    out = cpu.gathered_attention(q, kv[selected], valid, latent, softmax_scale)
    assert out.shape == (queries, heads, latent)
    assert_close_to_reference(out, reference.sparse_attention(q, kv, mask, latent, softmax_scale), torch.float32,
                              scale=scale * 4)
    assert_batch_invariant(lambda rows: cpu.gathered_attention(q[rows], kv[selected[rows]], valid[rows], latent,
                                                               softmax_scale), torch.arange(queries))


@given(seed=SEEDS, length=st.integers(1, 700), data=st.data())
def test_indexer_scores_do_not_depend_on_the_segment(seed, length, data):
    """A query's scores are the same bits whichever segment of the context computed them (the rows
    before it, the keys after it): one query scored alone over its own causal context, or inside
    any segment that ends at or after it."""
    gen = torch.Generator().manual_seed(seed)
    heads, dim = 4, 32
    keys = randn(gen, length, dim)
    q, w = randn(gen, length, heads, dim), randn(gen, length, heads)
    start = data.draw(st.integers(0, length - 1))
    end = data.draw(st.integers(start + 1, length))
    rows = torch.arange(start, end)
    segment = cpu.indexer_scores(q[start:end], w[start:end], keys[:end], rows)
    for i in sorted({start, (start + end) // 2, end - 1}):
        alone = cpu.indexer_scores(q[i:i + 1], w[i:i + 1], keys[:i + 1], torch.tensor([i]))
        assert torch.equal(segment[i - start, :i + 1], alone[0]), f"query {i} of segment [{start}, {end})"


def _moe_case(seed, tokens, hidden, experts, top_k, inter, shared):
    gen = torch.Generator().manual_seed(seed)
    weights = MoEWeights(
        router=randn(gen, experts, hidden, scale=hidden ** -0.5), bias=randn(gen, experts, scale=0.1),
        w_gate=randn(gen, experts, inter, hidden, scale=hidden ** -0.5),
        w_up=randn(gen, experts, inter, hidden, scale=hidden ** -0.5),
        w_down=randn(gen, experts, hidden, inter, scale=inter ** -0.5),
        shared_gate=randn(gen, inter, hidden, scale=hidden ** -0.5) if shared else None,
        shared_up=randn(gen, inter, hidden, scale=hidden ** -0.5) if shared else None,
        shared_down=randn(gen, hidden, inter, scale=inter ** -0.5) if shared else None,
    )
    return randn(gen, tokens, hidden), weights


ROUTING = st.sampled_from([(8, 2, 1, 1), (16, 6, 4, 2), (4, 4, 1, 1), (8, 1, 2, 1)])  # E, K, groups, topk_group


@given(seed=SEEDS, tokens=st.sampled_from([1, 2, 17, 40]), routing=ROUTING)
def test_route_matches_reference_tie_aware(seed, tokens, routing):
    experts, top_k, n_group, topk_group = routing
    gen = torch.Generator().manual_seed(seed)
    logits = randn(gen, tokens, experts)
    logits[:, -1] = logits[:, 0]  # a guaranteed tie between expert 0 and the last expert
    bias = torch.zeros(experts)
    w_fast, ids_fast = cpu.route(logits, bias, top_k, n_group, topk_group, 2.5, True)
    w_ref, ids_ref = reference.route(logits, bias, top_k, n_group, topk_group, 2.5, True)
    if n_group == 1:
        # With one group both must agree exactly, ties included (lower expert id wins).
        assert torch.equal(ids_fast, ids_ref)
    else:
        assert torch.equal(torch.sort(ids_fast).values, torch.sort(ids_ref).values)
    assert_close_to_reference(w_fast, w_ref, torch.float32, scale=4)
    assert_close_to_reference(w_fast.sum(-1), torch.full((tokens,), 2.5, dtype=torch.float64), torch.float32)


@given(seed=SEEDS, tokens=st.sampled_from([1, 3, ROW_TILE + 1, 40]), routing=ROUTING, shared=st.booleans())
def test_moe_matches_reference_and_is_batch_invariant(seed, tokens, routing, shared):
    experts, top_k, n_group, topk_group = routing
    x, weights = _moe_case(seed, tokens, 24, experts, top_k, 20, shared)
    kwargs = dict(top_k=top_k, n_group=n_group, topk_group=topk_group, scaling=1.5, normalize=True)
    choice = torch.sort(torch.sqrt(torch.nn.functional.softplus(reference.linear(x, weights.router)))
                        + weights.bias.double(), descending=True).values
    if top_k < experts:
        # A near-tie at the k-th expert may legitimately route differently in float32.
        assume(bool(((choice[:, top_k - 1] - choice[:, top_k]) > 1e-4).all()))
    out = cpu.moe(x, weights, **kwargs)
    assert_close_to_reference(out, reference.moe(x, weights, **kwargs), torch.float32, scale=8)
    assert_batch_invariant(cpu.moe, x, weights, **kwargs)


def test_batch_invariance_oracle_fails_on_a_batch_dependent_kernel():
    """Negative control: a kernel that mixes rows (a planted bug) must trip the oracle."""
    x = randn(torch.Generator().manual_seed(0), 9, 8)
    with pytest.raises(AssertionError, match="row results changed"):
        assert_batch_invariant(lambda t: t - t.mean(0, keepdim=True), x)


def test_tie_aware_topk_oracle_flags_a_wrong_index():
    """Negative control: picking a clearly worse candidate is a wrong index, a tie is not."""
    scores = torch.tensor([5.0, 4.0, 4.0, 1.0])
    candidates = torch.ones(4, dtype=torch.bool)
    tie = torch.tensor([True, False, True, False])
    worse = torch.tensor([True, False, False, True])
    assert wrong_topk_indices(tie, scores, candidates, 2, tie_tol=1e-6) == []
    assert wrong_topk_indices(worse, scores, candidates, 2, tie_tol=1e-6) == [3]


def test_einsum_indexer_scores_depend_on_the_segment():
    """Negative control for the check above: the indexer before its tiles (one einsum over the
    segment's rows and context keys, a head-sum reduction) gives some query other bits inside a
    segment than alone, on hosts whose BLAS blocks by the matrix's size."""
    def einsum_scores(q, w, keys):
        return (torch.relu(torch.einsum("thd,ld->thl", q, keys)) * w[:, :, None]).sum(1)

    gen = torch.Generator().manual_seed(0)
    length = 700
    keys, q, w = randn(gen, length, 32), randn(gen, length, 4, 32), randn(gen, length, 4)
    segment = einsum_scores(q, w, keys)
    differ = [i for i in range(0, length, 7)
              if not torch.equal(segment[i, :i + 1], einsum_scores(q[i:i + 1], w[i:i + 1], keys[:i + 1])[0])]
    if not differ:
        pytest.skip("this host's einsum scores a query alike in any segment")
    assert differ
