"""moe.FUSED_X_QUANT: on the fp8 path gate/up quantizes the tokens it loads itself, a BLOCK_K step's 128 channels
of its rows at a time (elementwise.quantize_rows, quantize_group's formula), in place of a quantize_groups launch
before the MoE. The MoE's output must be that launch's bit for bit on every path: per-row tiles, aligned tiles, the
shared expert's dense pass, with split-K gate/up and without, and a 128-channel group the hidden width cuts short.
On CPU through the Triton interpreter (its fp8 casts are its own, but the same on both paths), on a GPU for real;
and the kernel through sm_90's compiler."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import example, given, settings
from hypothesis import strategies as st

from runtime.kernels.triton import elementwise, moe
from tests.kernels.test_moe_fused_act_quant import SHAPES, TOKENS, _fp8_case
from tests.kernels.test_triton_kernels import ON_GPU, SEEDS, _run_moe

pytestmark = pytest.mark.kernels


@contextmanager
def fused_x_quant(on: bool):
    saved = moe.FUSED_X_QUANT
    moe.FUSED_X_QUANT = on
    try:
        yield
    finally:
        moe.FUSED_X_QUANT = saved


def _both_ways(x, packed, ids, route_w, split_k):
    with fused_x_quant(False):
        launch = _run_moe(x, packed, ids, route_w, split_k)
    with fused_x_quant(True):
        fused = _run_moe(x, packed, ids, route_w, split_k)
    return launch, fused


@settings(max_examples=15 if ON_GPU else 5, deadline=None)
@given(seed=SEEDS, tokens=TOKENS, shape=st.sampled_from(SHAPES), shared=st.booleans(),
       split_k=st.sampled_from([1, 2, 4]))
@example(seed=3, tokens=17, shape=SHAPES[2], shared=True, split_k=2)  # aligned tiles, a short group, split-K
@example(seed=4, tokens=1, shape=SHAPES[1], shared=False, split_k=1)  # per-row tiles, gate/up writes the act
def test_gate_up_quantizing_the_tokens_gives_the_launchs_bits(seed, tokens, shape, shared, split_k):
    x, packed, ids, route_w = _fp8_case(seed, tokens, shape, shared)
    launch, fused = _both_ways(x, packed, ids, route_w, split_k)
    assert not torch.isnan(launch).any() and bool(launch.abs().max() > 0)
    assert torch.equal(fused, launch)


def test_the_switch_drops_the_token_quantize_launch(monkeypatch):
    """With the switch on, quantize_groups never sees the tokens (and, with the fused act quantize and split-K,
    is not called at all); off, it quantizes them once, before the experts."""
    x, packed, ids, route_w = _fp8_case(0, 9, SHAPES[0], True)
    calls = []
    real = moe.quantize_groups
    monkeypatch.setattr(moe, "quantize_groups", lambda t: calls.append(tuple(t.shape)) or real(t))
    monkeypatch.setattr(moe, "FUSED_ACT_QUANT", True)
    for on, split_k, expected in ((True, 2, []), (False, 2, [tuple(x.shape)])):
        calls.clear()
        with fused_x_quant(on):
            _run_moe(x, packed, ids, route_w, split_k)
        assert calls == expected, (on, split_k, calls)


@triton.jit
def _planted_quantize_rows(x, FP8_MAX: tl.constexpr):
    """quantize_rows with a wrong range constant: the scales and values move, their product barely."""
    scale = elementwise.group_scale(tl.max(tl.abs(x), axis=1), FP8_MAX - 16.0)
    return tl.clamp(x / scale[:, None], -FP8_MAX, FP8_MAX), scale


@pytest.mark.skipif(ON_GPU, reason="the interpreter reads a jit function's globals at run time; a GPU compiles them")
def test_the_bits_check_sees_another_quantization_formula(monkeypatch):
    """Negative control: gate/up quantizing the tokens by a formula other than quantize_groups' gives other bits,
    and the comparison above sees it, though the outputs stay close."""
    x, packed, ids, route_w = _fp8_case(1, 9, SHAPES[0], False)
    monkeypatch.setattr(moe, "quantize_rows", _planted_quantize_rows)
    launch, fused = _both_ways(x, packed, ids, route_w, 2)
    assert not torch.equal(fused, launch)
    torch.testing.assert_close(fused.float(), launch.float(), atol=0.1 * float(launch.abs().max()), rtol=0.1)


@pytest.mark.skipif(ON_GPU, reason="on a GPU the tests above compile it for real")
@pytest.mark.parametrize("routing, split_k, act", [(moe.ALIGNED, 4, "*fp32"), (moe.PER_ROW, 1, "*bf16"),
                                                   (moe.DENSE, 4, "*fp32")])
def test_gate_up_quantizing_the_tokens_compiles_for_the_gpu_without_one(routing, split_k, act):
    """At the deployed launch (BLOCK_M 16, BLOCK_N 32, 4 warps, 4 stages), each routing; with split-K the act pointer
    is the float32 partials (the fused act quantize's launch writes the act), without it the bfloat16 act."""
    from tests.kernels.test_indexer_topk import compile_for_sm90

    signature = {"x_ptr": "*bf16", "x_scale_ptr": "*bf16", "w_ptr": "*fp8e4nv", "w_scale_ptr": "*fp32",
                 "act_ptr": act, "sorted_rows_ptr": "*i32", "tile_expert_ptr": "*i32", "num_rows": "i32",
                 "top_k": "i32", "hidden": "i32", "inter": "i32", "stride_x": "i32", "stride_xs": "i32",
                 "stride_we": "i32", "stride_wn": "i32", "stride_wse": "i32", "stride_wsn": "i32", "stride_act": "i32",
                 "part_ptr": "*fp32", "k_chunk": "i32"}
    constants = dict(FP8=True, ROUTING=routing, SPLIT_K=split_k, FUSED_SPLITS=False, PRECISION="tf32", BLOCK_M=16,
                     BLOCK_N=32, BLOCK_K=moe.BLOCK_K, QUANT_X=True, FP8_MAX=elementwise.FP8_MAX)
    done = compile_for_sm90("runtime.kernels.triton.moe", "_gate_up_kernel", signature, constants, num_warps=4,
                            num_stages=4)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
