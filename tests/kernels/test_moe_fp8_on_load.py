"""moe.QUANTIZE_ON_LOAD: the fp8 MoE's GEMMs quantize the activation rows they load (the tokens in
gate/up, SiLU-and-mul's output in down) instead of quantize_groups launches before them. The outputs
must be the launches' bit for bit on every path: per-row tiles, aligned tiles, the shared expert's
dense pass, split-K, and 128-channel groups the width cuts short. On CPU through the Triton
interpreter (whose fp8 casts are its own, but the same on both paths: the plumbing of rows, groups and
scales is what is tested), on a GPU for real; and both kernels with ON_LOAD through sm_90's compiler."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.kernels.triton import moe
from tests.kernels.test_triton_kernels import ON_GPU, SEEDS, _moe_case, _run_moe, fp8_packed

# (experts, top_k, hidden, inter): the deployment's group-aligned widths, and 200 / 136, whose last
# 128-channel group is cut short (gate/up's last K step, down's).
SHAPES = [(9, 3, 256, 128), (16, 6, 384, 256), (8, 2, 200, 136)]
# 1-2 tokens take the per-row tiles at top-2/3, 9+ the aligned ones (PER_ROW_MAX_ROWS = 16 routed rows).
TOKENS = st.sampled_from([1, 2, 9, 17, 33])
# The x dtype the fp8 path is fed: bfloat16 on a GPU; the interpreter is wrong in bfloat16 (its act
# buffer is bfloat16 either way, read alike by both paths).
X_DTYPE = torch.bfloat16 if ON_GPU else torch.float16


@contextmanager
def quantize_on_load(on: bool):
    saved = moe.QUANTIZE_ON_LOAD
    moe.QUANTIZE_ON_LOAD = on
    try:
        yield
    finally:
        moe.QUANTIZE_ON_LOAD = saved


def _fp8_case(seed, tokens, shape, shared):
    experts, top_k, hidden, inter = shape
    x, raw, ids, route_w = _moe_case(seed, tokens, experts, top_k, hidden, inter, shared, X_DTYPE, 1.0)
    return x, fp8_packed(raw, shared), ids, route_w


def _both_ways(x, packed, ids, route_w, split_k):
    with quantize_on_load(False):
        launches = _run_moe(x, packed, ids, route_w, split_k)
    with quantize_on_load(True):
        on_load = _run_moe(x, packed, ids, route_w, split_k)
    return launches, on_load


@settings(max_examples=15 if ON_GPU else 5, deadline=None)
@given(seed=SEEDS, tokens=TOKENS, shape=st.sampled_from(SHAPES), shared=st.booleans(), split_k=st.sampled_from([1, 2]))
def test_quantizing_on_load_gives_the_quantize_launches_bits(seed, tokens, shape, shared, split_k):
    x, packed, ids, route_w = _fp8_case(seed, tokens, shape, shared)
    launches, on_load = _both_ways(x, packed, ids, route_w, split_k)
    assert not torch.isnan(launches).any() and bool(launches.abs().max() > 0)
    assert torch.equal(on_load, launches)


def test_quantizing_on_load_launches_no_quantize_kernel(monkeypatch):
    """The switch does what it says: no quantize_groups call on the fp8 path with it on, three with it off
    (the tokens, the routed and the shared SiLU-and-mul outputs)."""
    x, packed, ids, route_w = _fp8_case(0, 9, SHAPES[0], True)
    calls = []
    real = moe.quantize_groups
    monkeypatch.setattr(moe, "quantize_groups", lambda t: calls.append(t.shape) or real(t))
    for on, expected in ((True, 0), (False, 3)):
        calls.clear()
        with quantize_on_load(on):
            _run_moe(x, packed, ids, route_w, 2)
        assert len(calls) == expected, (on, calls)


@pytest.mark.skipif(ON_GPU, reason="the interpreter reads a jit function's globals at run time; a GPU compiles them")
def test_the_bits_check_sees_another_quantization_formula(monkeypatch):
    """Negative control: the on-load path with another e4m3 limit (240, e4m3fnuz's) than quantize_groups'
    (448) gives other scales and other bits, and the comparison above sees it."""
    x, packed, ids, route_w = _fp8_case(1, 9, SHAPES[0], False)
    monkeypatch.setattr(moe, "ACT_FP8_MAX", tl.constexpr(240.0))
    launches, on_load = _both_ways(x, packed, ids, route_w, 1)
    assert not torch.equal(on_load, launches)


_GATE_UP_SIGNATURE = {"x_ptr": "*bf16", "x_scale_ptr": "*bf16", "w_ptr": "*fp8e4nv", "w_scale_ptr": "*fp32",
                      "act_ptr": "*bf16", "sorted_rows_ptr": "*i32", "tile_expert_ptr": "*i32", "num_rows": "i32",
                      "top_k": "i32", "hidden": "i32", "inter": "i32", "stride_x": "i32", "stride_xs": "i32",
                      "stride_we": "i32", "stride_wn": "i32", "stride_wse": "i32", "stride_wsn": "i32",
                      "stride_act": "i32", "part_ptr": "*fp32", "k_chunk": "i32"}
_DOWN_SIGNATURE = {"act_ptr": "*bf16", "act_scale_ptr": "*bf16", "w_ptr": "*fp8e4nv", "w_scale_ptr": "*fp32",
                   "out_ptr": "*fp32", "sorted_rows_ptr": "*i32", "tile_expert_ptr": "*i32", "route_w_ptr": "*fp32",
                   "num_rows": "i32", "hidden": "i32", "inter": "i32", "stride_act": "i32", "stride_as": "i32",
                   "stride_we": "i32", "stride_wn": "i32", "stride_wse": "i32", "stride_wsn": "i32",
                   "stride_out": "i32"}


@pytest.mark.skipif(ON_GPU, reason="on a GPU the tests above compile them for real")
@pytest.mark.parametrize("routing, split_k, fused", [(moe.ALIGNED, 4, False), (moe.PER_ROW, 4, False),
                                                     (moe.ALIGNED, 4, True), (moe.DENSE, 1, False)])
def test_the_on_load_kernels_compile_for_the_gpu_without_one(routing, split_k, fused):
    """gate/up and down with ON_LOAD at the decode launch (BLOCK_N 32, 4 warps, 4 stages) through sm_90's
    compiler: the fp8 cast and the row amax inside the pipelined K loop."""
    from tests.kernels.test_indexer_topk import compile_for_sm90

    common = dict(FP8=True, ROUTING=routing, PRECISION="tf32", BLOCK_M=moe.BLOCK_M, BLOCK_K=moe.BLOCK_K, ON_LOAD=True)
    done = compile_for_sm90("runtime.kernels.triton.moe", "_gate_up_kernel", dict(_GATE_UP_SIGNATURE),
                            {**common, "SPLIT_K": split_k, "FUSED_SPLITS": fused, "BLOCK_N": 32},
                            num_warps=4, num_stages=4)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
    done = compile_for_sm90("runtime.kernels.triton.moe", "_down_kernel", dict(_DOWN_SIGNATURE),
                            {**common, "WEIGHTED": routing != moe.DENSE, "BLOCK_N": 64, "N_TILES": 1},
                            num_warps=4, num_stages=4)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]

