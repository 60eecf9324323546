"""moe.FUSED_ACT_QUANT: on the fp8 path with split-K gate/up, the launch that adds the partials also quantizes
the SiLU-and-mul output (rounded to bfloat16 first, as the act buffer it replaces holds it) in place of a
quantize_groups launch after it. The MoE's output must be the two launches' bit for bit on every path:
per-row tiles, aligned tiles, the shared expert's dense pass, and 128-channel groups the width cuts short.
On CPU through the Triton interpreter (its fp8 casts are its own, but the same on both paths: the plumbing
of rows, groups and scales is what is tested), on a GPU for real; and the kernel through sm_90's compiler."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
import triton.language as tl
from hypothesis import example, given, settings
from hypothesis import strategies as st

from runtime.kernels.triton import elementwise, moe
from tests.kernels.test_triton_kernels import ON_GPU, SEEDS, _moe_case, _run_moe, fp8_packed

# (experts, top_k, hidden, inter): the deployment's group-aligned widths, and 200 / 136, whose last
# 128-channel group is cut short.
SHAPES = [(9, 3, 256, 128), (16, 6, 384, 256), (8, 2, 200, 136)]
# 1-2 tokens take the per-row tiles at top-2/3, 9+ the aligned ones (PER_ROW_MAX_ROWS = 16 routed rows).
TOKENS = st.sampled_from([1, 2, 9, 17, 33])
# The x dtype the fp8 path is fed: bfloat16 on a GPU; the interpreter is wrong in bfloat16 arithmetic.
X_DTYPE = torch.bfloat16 if ON_GPU else torch.float16


@contextmanager
def fused_act_quant(on: bool):
    saved = moe.FUSED_ACT_QUANT
    moe.FUSED_ACT_QUANT = on
    try:
        yield
    finally:
        moe.FUSED_ACT_QUANT = saved


def _fp8_case(seed, tokens, shape, shared):
    experts, top_k, hidden, inter = shape
    x, raw, ids, route_w = _moe_case(seed, tokens, experts, top_k, hidden, inter, shared, X_DTYPE, 1.0)
    return x, fp8_packed(raw, shared), ids, route_w


def _both_ways(x, packed, ids, route_w, split_k):
    with fused_act_quant(False):
        launches = _run_moe(x, packed, ids, route_w, split_k)
    with fused_act_quant(True):
        fused = _run_moe(x, packed, ids, route_w, split_k)
    return launches, fused


@settings(max_examples=15 if ON_GPU else 5, deadline=None)
@given(seed=SEEDS, tokens=TOKENS, shape=st.sampled_from(SHAPES), shared=st.booleans(), split_k=st.sampled_from([2, 4]))
@example(seed=3, tokens=17, shape=SHAPES[2], shared=True, split_k=4)
def test_the_fused_act_quantize_gives_the_two_launches_bits(seed, tokens, shape, shared, split_k):
    x, packed, ids, route_w = _fp8_case(seed, tokens, shape, shared)
    launches, fused = _both_ways(x, packed, ids, route_w, split_k)
    assert not torch.isnan(launches).any() and bool(launches.abs().max() > 0)
    assert torch.equal(fused, launches)


def test_the_switch_drops_the_act_quantize_launches(monkeypatch):
    """The switch does what it says: with split-K, one quantize_groups call with it on (the tokens), three
    with it off (the tokens, the routed and the shared SiLU-and-mul outputs); without split-K it changes
    nothing (three either way: gate/up writes the act itself)."""
    x, packed, ids, route_w = _fp8_case(0, 9, SHAPES[0], True)
    calls = []
    real = moe.quantize_groups
    monkeypatch.setattr(moe, "quantize_groups", lambda t: calls.append(t.shape) or real(t))
    for on, split_k, expected in ((True, 2, 1), (False, 2, 3), (True, 1, 3)):
        calls.clear()
        with fused_act_quant(on):
            _run_moe(x, packed, ids, route_w, split_k)
        assert len(calls) == expected, (on, split_k, calls)


@pytest.mark.skipif(ON_GPU, reason="the interpreter reads a jit function's globals at run time; a GPU compiles them")
def test_the_bits_check_sees_a_missing_bfloat16_rounding(monkeypatch):
    """Negative control: the fused launch quantizing the float32 act (without the bfloat16 rounding the
    act buffer applies) gives other bits, and the comparison above sees it."""
    x, packed, ids, route_w = _fp8_case(1, 9, SHAPES[0], False)
    monkeypatch.setattr(moe, "ACT_ROUNDING", tl.constexpr(tl.float32))
    launches, fused = _both_ways(x, packed, ids, route_w, 2)
    assert not torch.equal(fused, launches)


@pytest.mark.skipif(ON_GPU, reason="on a GPU the tests above compile it for real")
def test_the_fused_act_quantize_compiles_for_the_gpu_without_one():
    from tests.kernels.test_indexer_topk import compile_for_sm90

    signature = {"part_ptr": "*fp32", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "num_rows": "i32", "inter": "i32",
                 "stride_q": "i32", "stride_s": "i32"}
    done = compile_for_sm90("runtime.kernels.triton.moe", "_split_act_quant_kernel", signature,
                            dict(SPLIT_K=4, GROUP=elementwise.FP8_GROUP, FP8_MAX=elementwise.FP8_MAX), num_warps=4)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
