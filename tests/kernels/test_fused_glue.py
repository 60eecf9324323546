"""The decode step's fused glue kernels (kernels/triton/glue.py) against their readable torch
references (kernels/cuda_torch.py's CPU path) and the float64 reference.

Without CUDA the kernels run under the Triton interpreter in float32/float16; on a GPU in bfloat16
too. Outputs are NaN-poisoned; data is never zero; routing is compared tie-aware (rows with a
near-tie at a decision boundary are skipped, exact ties must go to the lower id); batch invariance is
bit for bit. RoPE (alone and in the cache write) claims the unfused torch ops' bits exactly, and
add_rms_norm elementwise.rms_norm's: both are checked with torch.equal.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from canary.oracles.tolerances import assert_close_to_reference
from runtime.kernels import cpu, reference
from runtime.kernels import cuda_torch as k
from runtime.kernels.triton import elementwise, glue
from tests.kernels.test_triton_kernels import DEVICE, DTYPES, SEEDS, assert_prefix_invariant, poisoned, randn

pytestmark = pytest.mark.kernels

EXAMPLES = settings(max_examples=12, deadline=None)
ROWS = st.sampled_from([0, 1, 2, 15, 17])
THETA = 10000.0


def assert_close_scaled(actual, expected, dtype, msg=""):
    magnitude = max(1.0, float(expected.abs().max())) if expected.numel() else 1.0
    assert not torch.isnan(actual).any(), f"NaN in output (unwritten?) {msg}"
    assert_close_to_reference(actual.cpu(), expected, dtype, scale=4 * magnitude, msg=msg)


# ---------------------------------------------------------------- residual add + RMSNorm

@EXAMPLES
@given(seed=SEEDS, rows=ROWS, width=st.sampled_from([1, 17, 64, 300]), dtype=st.sampled_from(DTYPES),
       magnitude=st.sampled_from([1e-2, 1.0, 1e3]))
def test_add_rms_norm_is_the_unfused_add_then_norm(seed, rows, width, dtype, magnitude):
    gen = torch.Generator().manual_seed(seed)
    x, delta = randn(gen, rows, width, scale=magnitude, dtype=dtype), randn(gen, rows, width, dtype=dtype)
    w = randn(gen, width, dtype=dtype)

    def run(n):
        return glue.add_rms_norm(x[:n], delta[:n], w, 1e-6, out=poisoned(n, width, dtype=dtype))

    total, normed = run(rows)
    assert torch.equal(total, x + delta), "the sum must be the unfused add's"
    assert torch.equal(normed, elementwise.rms_norm(x + delta, w, 1e-6)), "the norm must be rms_norm's bits"
    assert_close_scaled(normed, reference.rms_norm((x + delta).cpu(), w.cpu(), 1e-6), dtype)
    assert_prefix_invariant(normed, lambda n: run(n)[1], rows)


@EXAMPLES
@given(seed=SEEDS, rows=ROWS, width=st.sampled_from([1, 17, 300]), dtype=st.sampled_from(DTYPES),
       magnitude=st.sampled_from([1e-2, 1.0, 1e3]))
def test_embed_rms_norm_is_the_gather_then_norm(seed, rows, width, dtype, magnitude):
    gen = torch.Generator().manual_seed(seed)
    table, w = randn(gen, 50, width, scale=magnitude, dtype=dtype), randn(gen, width, dtype=dtype)
    ids = torch.randint(0, 50, (rows,), generator=gen).to(DEVICE)

    def run(n):
        return glue.embed_rms_norm(ids[:n], table, w, 1e-6, out=poisoned(n, width, dtype=dtype))

    gathered, normed = run(rows)
    assert torch.equal(gathered, table[ids])
    assert torch.equal(normed, elementwise.rms_norm(table[ids], w, 1e-6)), "the norm must be rms_norm's bits"
    assert_close_scaled(normed, reference.rms_norm(table[ids].cpu(), w.cpu(), 1e-6), dtype)
    assert_prefix_invariant(normed, lambda n: run(n)[1], rows)


# ---------------------------------------------------------------- RoPE in place

def _projection(gen, rows, heads, head_dim, rope_dim, dtype):
    """A projection output [T, H * head_dim + 5] whose per-head last rope_dim channels are roped in place."""
    proj = randn(gen, rows, heads * head_dim + 5, dtype=dtype)
    return proj, lambda t: t[:, :heads * head_dim].view(t.shape[0], heads, head_dim)[..., head_dim - rope_dim:]


@EXAMPLES
@given(seed=SEEDS, rows=ROWS, heads=st.sampled_from([1, 3, 16]), half=st.sampled_from([4, 8, 32]),
       extra=st.sampled_from([0, 24]), max_pos=st.sampled_from([10, 100_000]), dtype=st.sampled_from(DTYPES))
def test_rope_in_place_gives_the_torch_ops_bits(seed, rows, heads, half, extra, max_pos, dtype):
    gen = torch.Generator().manual_seed(seed)
    proj, rope_view = _projection(gen, rows, heads, extra + 2 * half, 2 * half, dtype)
    positions = torch.randint(0, max_pos, (rows,), generator=gen).to(DEVICE)
    cos, sin = k.rope_table(half, THETA, max_pos, DEVICE, dtype)

    def run(n):
        out = proj[:n].clone()
        glue.rope_(rope_view(out), positions[:n], cos, sin)
        return out

    out = run(rows)
    expected = proj.clone()
    rope_view(expected).copy_(k.rope(rope_view(proj), positions, cos, sin))
    assert torch.equal(out, expected), "in-place RoPE must give the torch rope's bits and leave the rest alone"
    assert_close_scaled(rope_view(out), reference.rope(rope_view(proj).cpu(), positions.cpu(), THETA), dtype)
    assert_prefix_invariant(out, run, rows)


def _rope_rounded_once(x, positions, cos, sin):
    """Rotate-half RoPE in float32, rounded once at the end: a valid RoPE with other roundings."""
    half = x.shape[-1] // 2
    c, s = cos[positions].float()[:, None, :], sin[positions].float()[:, None, :]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def test_bit_equality_oracle_fails_on_a_rope_without_the_torch_roundings():
    """Negative control: a RoPE that rounds once, from float32 math; in float16 its bits differ
    from the torch ops' (which round every product), and the check above sees it."""
    gen = torch.Generator().manual_seed(0)
    x = randn(gen, 16, 4, 64, dtype=torch.float16)
    positions = torch.randint(0, 1000, (16,), generator=gen).to(DEVICE)
    cos, sin = k.rope_table(32, THETA, 1000, DEVICE, torch.float16)
    assert not torch.equal(_rope_rounded_once(x, positions, cos, sin), k.rope(x, positions, cos, sin))


# ---------------------------------------------------------------- cache-row write

def _assert_only_rows_written(cache, slots, msg=""):
    written = torch.zeros(cache.shape[0], dtype=torch.bool, device=cache.device)
    written[slots] = True
    assert not torch.isnan(cache[written]).any(), f"a row was not (fully) written {msg}"
    assert torch.isnan(cache[~written]).all(), f"a row outside the slots was written {msg}"


@EXAMPLES
@given(seed=SEEDS, rows=ROWS, head=st.sampled_from([0, 1, 16, 64, 300]), half=st.sampled_from([4, 32]),
       norm=st.booleans(), dtype=st.sampled_from(DTYPES), magnitude=st.sampled_from([1e-2, 1.0, 1e3]))
def test_write_cache_rows_is_norm_rope_and_scatter(seed, rows, head, half, norm, dtype, magnitude):
    """head 0: an indexer key that is all rope (the tiny model's)."""
    norm = norm and head > 0
    gen = torch.Generator().manual_seed(seed)
    width, num_slots, max_pos = head + 2 * half, 2 * rows + 3, 5000
    # A strided source (a slice of a wider projection), as the model passes it.
    src = randn(gen, rows, width + 7, scale=magnitude, dtype=dtype)[:, 7:]
    positions = torch.randint(0, max_pos, (rows,), generator=gen).to(DEVICE)
    slots = torch.randperm(num_slots, generator=gen)[:rows].to(DEVICE)
    weight = randn(gen, head, dtype=dtype) if norm else None
    cos, sin = k.rope_table(half, THETA, max_pos, DEVICE, dtype)

    def run(n):
        cache = poisoned(num_slots, width, dtype=dtype)
        glue.write_cache_rows(src[:n], positions[:n], slots[:n], cos, sin, cache, 2 * half, weight, 1e-6)
        return cache

    cache = run(rows)
    _assert_only_rows_written(cache, slots)
    written = cache[slots]
    assert torch.equal(written[:, head:], k.rope(src[:, head:], positions, cos, sin)), "RoPE must be torch's bits"
    if weight is None:
        assert torch.equal(written[:, :head], src[:, :head]), "the head part must be copied"
    else:  # compiled without FMA: on a GPU not elementwise.rms_norm's bits, only close (see glue.NO_FMA)
        assert_close_scaled(written[:, :head], reference.rms_norm(src[:, :head].cpu(), weight.cpu(), 1e-6), dtype)
    assert_prefix_invariant(cache[slots], lambda n: run(n)[slots[:n]], rows)


def test_written_rows_oracle_fails_on_a_skipped_row():
    """Negative control: a write that misses the last token leaves its slot NaN, and the check sees it."""
    gen = torch.Generator().manual_seed(0)
    src, positions = randn(gen, 5, 24, dtype=DTYPES[0]), torch.arange(5).to(DEVICE)
    slots = torch.tensor([9, 2, 4, 0, 7])
    cos, sin = k.rope_table(4, THETA, 16, DEVICE, DTYPES[0])
    cache = poisoned(10, 24, dtype=DTYPES[0])
    glue.write_cache_rows(src[:4], positions[:4], slots[:4].to(DEVICE), cos, sin, cache, 8)
    with pytest.raises(AssertionError, match="not .*written"):
        _assert_only_rows_written(cache, slots.to(DEVICE))


# ---------------------------------------------------------------- routing

ROUTERS = [(256, 8, 4, 6), (8, 1, 1, 2), (64, 4, 2, 3), (16, 16, 8, 4), (24, 3, 2, 5)]  # (E, groups, topk groups, K)


def _route_case(gen, rows, experts, magnitude):
    logits = torch.randn(rows, experts, generator=gen) * magnitude
    if rows and experts > 1:  # planted exact ties: equal logits must go to the lower id
        logits[:, experts // 2] = logits[:, 0]
        logits[:, -1] = logits[:, 1]
    bias = torch.randn(experts, generator=gen) * 0.1
    bias[-1] = bias[1]
    return logits.to(DEVICE), bias.to(DEVICE)


def _near_tied_rows(affinity, bias, n_group, topk_group, top_k, tol):
    """Rows with two different float64 scores within tol at a group or expert boundary: there a
    float32 kernel may pick either."""
    choice = affinity + bias
    near = torch.zeros(affinity.shape[0], dtype=torch.bool)

    def boundary(scores, k):
        top = torch.sort(scores, dim=-1, descending=True).values
        if k >= top.shape[1]:
            return torch.zeros(top.shape[0], dtype=torch.bool)
        gap = (top[:, k - 1] - top[:, k]).abs()
        return (gap > 0) & (gap < tol)

    if n_group > 1:
        grouped = choice.view(choice.shape[0], n_group, -1)
        near |= boundary(grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1), topk_group)
    near |= boundary(choice, top_k)  # over all experts: a superset of the allowed ones' boundaries
    return near


def check_route(weights, ids, logits, bias, n_group, topk_group, top_k, scaling, normalize):
    """Zero wrong ids (tie-aware) and weights close to the float64 noaux_tc selection; returns how
    many rows were free of near-ties (and so checked)."""
    if not logits.shape[0]:
        return 0
    affinity = torch.sqrt(torch.nn.functional.softplus(logits.cpu().double()))
    ref_w, ref_ids = cpu.select_experts(affinity, bias.cpu().double(), top_k, n_group, topk_group, scaling, normalize)
    checked = ~_near_tied_rows(affinity, bias.cpu().double(), n_group, topk_group, top_k, tol=1e-5)
    bad = (ids.cpu() != ref_ids).any(-1) & checked
    assert not bad.any(), f"wrong expert ids in rows {bad.nonzero().flatten().tolist()}"
    assert_close_to_reference(weights.cpu()[checked], ref_w[checked], torch.float32, scale=4, msg="routing weights")
    return int(checked.sum())


@EXAMPLES
@given(seed=SEEDS, rows=ROWS, router=st.sampled_from(ROUTERS), normalize=st.booleans(),
       magnitude=st.sampled_from([0.1, 3.0, 30.0]))
def test_route_matches_noaux_tc_tie_aware_and_is_batch_invariant(seed, rows, router, normalize, magnitude):
    experts, n_group, topk_group, top_k = router
    gen = torch.Generator().manual_seed(seed)
    logits, bias = _route_case(gen, rows, experts, magnitude)

    def run(n):
        out = (poisoned(n, top_k, dtype=torch.float32), torch.full((n, top_k), -7, dtype=torch.long, device=DEVICE))
        return glue.route(logits[:n], bias, top_k, n_group, topk_group, 2.5, normalize, out=out)

    weights, ids = run(rows)
    assert not torch.isnan(weights).any() and bool((ids >= 0).all()), "unwritten routing output"
    checked = check_route(weights, ids, logits, bias, n_group, topk_group, top_k, 2.5, normalize)
    assert checked >= rows // 2, f"only {checked} of {rows} rows free of near-ties"
    assert_prefix_invariant(ids, lambda n: run(n)[1], rows)
    assert_prefix_invariant(weights, lambda n: run(n)[0], rows)


def test_route_oracle_fails_on_routing_without_the_bias_correction():
    """Negative control: routing by the raw affinity (bias dropped) picks other experts, and the
    check sees it."""
    gen = torch.Generator().manual_seed(0)
    logits, _ = _route_case(gen, 16, 64, 1.0)
    bias = (torch.randn(64, generator=gen) * 2).to(DEVICE)
    weights, ids = glue.route(logits, torch.zeros_like(bias), 3, 4, 2, 2.5, True)
    with pytest.raises(AssertionError, match="wrong expert ids"):
        check_route(weights, ids, logits, bias, 4, 2, 3, 2.5, True)


# ---------------------------------------------------------------- selected slot ids

@EXAMPLES
@given(seed=SEEDS, rows=ROWS, pages=st.sampled_from([1, 5]), page_size=st.sampled_from([1, 16]),
       selected=st.sampled_from([1, 7, 40]))
def test_selected_slots_are_page_table_lookups(seed, rows, pages, page_size, selected):
    gen = torch.Generator().manual_seed(seed)
    table = torch.randint(0, 1000, (rows, pages), generator=gen).to(DEVICE)
    positions = torch.randint(0, pages * page_size, (rows, selected), generator=gen)
    valid = (torch.rand(rows, selected, generator=gen) > 0.3).to(DEVICE)
    positions = torch.where(valid.cpu(), positions, -1).to(DEVICE)  # unselected entries may be anything

    def run(n):
        out = torch.full((n, selected), -7, dtype=torch.int32, device=DEVICE)
        return glue.selected_slots(table[:n], positions[:n], valid[:n], page_size, out=out)

    out = run(rows)
    ctx = (table[:, :, None] * page_size + torch.arange(page_size, device=DEVICE)).flatten(1)  # every context slot
    expected = torch.where(valid, ctx.gather(1, positions.clamp(min=0)), -1).to(torch.int32)
    assert torch.equal(out, expected)
    assert torch.equal(out, k.selected_slots(table, positions, valid, page_size))
    assert_prefix_invariant(out, run, rows)


# ---------------------------------------------------------------- the decode model through the glue

def dispatch_as_on_a_gpu(patch: pytest.MonkeyPatch) -> None:
    """The ops of kernels/cuda_torch.py as they dispatch on a GPU (to the Triton kernels), on any
    device: so the decode model's flow through the fused glue runs under the interpreter too."""
    from runtime.kernels.triton import matmul

    patch.setattr(k, "add_rms_norm", lambda x, d, w, eps, out=None: glue.add_rms_norm(
        x.contiguous(), d.contiguous(), w, eps, out=out))
    patch.setattr(k, "embed_rms_norm", glue.embed_rms_norm)
    patch.setattr(k, "rope_", glue.rope_)
    patch.setattr(k, "write_cache_rows", glue.write_cache_rows)
    patch.setattr(k, "route", lambda logits, *args: glue.route(logits.contiguous(), *args))
    patch.setattr(k, "selected_slots", glue.selected_slots)
    patch.setattr(k, "rms_norm", lambda x, w, eps, out=None: elementwise.rms_norm(x.contiguous(), w, eps, out=out))
    patch.setattr(k, "linear", lambda x, w: matmul.matmul(x.contiguous(), w))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs this flow natively (tests/gpu)")
def test_decode_model_through_the_fused_glue_matches_the_torch_ops_and_is_batch_invariant(tiny):
    """The tiny model's decode step with every op on its GPU kernel (fused glue, Triton GEMM, sparse
    MLA, fused MoE) vs the same step on the torch ops: logits and the KV rows written close (float32),
    no other slot written, and a row's logits bit for bit the same in padded batches of 16 and 48."""
    from runtime.graph.decode_model import StaticDecodeModel
    from runtime.graph.runner import pad_inputs
    from runtime.streams.tasks import InOrderExecutor
    from tests.kernels import test_graph_static as graph_static

    case, _, inputs = graph_static.decode_case(tiny, 0)

    def step(rows, **kernels):
        model = StaticDecodeModel(tiny.config, tiny.weights, page_size=graph_static.PAGE,
                                  max_pages=graph_static.PAGES_PER_REQUEST, max_batch=64, **kernels)
        kv = graph_static.fresh_kv(case)
        padded = pad_inputs(inputs, rows, case.scratch_page, graph_static.PAGE)
        return model.forward(padded, kv, InOrderExecutor())[:inputs.batch_size], kv

    expected, expected_kv = step(16)
    with pytest.MonkeyPatch.context() as patch:
        dispatch_as_on_a_gpu(patch)
        actual, actual_kv = step(16, attention_kernel="triton", moe_kernel="triton")
        wider, _ = step(48, attention_kernel="triton", moe_kernel="triton")
    assert_close_to_reference(actual, expected, torch.float32, scale=10, msg="fused glue vs torch ops")
    for name in ("latent", "index_keys"):  # never-written slots stay NaN on both sides
        ours, theirs = getattr(actual_kv, name), getattr(expected_kv, name)
        assert torch.equal(ours.isnan(), theirs.isnan()), f"{name}: other slots written"
        assert_close_to_reference(ours.nan_to_num(), theirs.nan_to_num(), torch.float32, msg=name)
    assert torch.equal(actual, wider), "a row's logits changed with the batch"


# ---------------------------------------------------------------- compiled for the GPU

def compile_for_sm90(*args: str) -> subprocess.CompletedProcess:
    """tests/kernels/glue_sm90.py in a process where the kernels are compiled, not interpreted."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(root)}
    return subprocess.run([sys.executable, "-m", "tests.kernels.glue_sm90", *args], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)


def test_glue_kernels_compile_for_the_h200_and_rope_has_no_fma():
    """The interpreter runs code the GPU compiler rejects: every glue kernel is compiled for sm_90
    here, and the RoPE kernels' PTX must hold no fused multiply-add (their bits are the torch ops')."""
    result = compile_for_sm90()
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]


def test_fma_check_fails_on_rope_compiled_with_contraction():
    """Negative control: with FMA contraction on, the bf16 RoPE products fuse and the check sees it."""
    result = compile_for_sm90("--with-fma")
    assert result.returncode == 1 and "fused multiply-adds" in result.stdout, result.stdout + result.stderr[-3000:]
