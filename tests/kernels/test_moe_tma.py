"""The fused MoE's weight tiles by TMA descriptor (the gate/up and down launches' "TMA" knob, moe.weight_boxes):
the same values reach the same dot as the masked pointer loads, so the output is the pointer launch's bit for bit,
on the aligned tiles, with split-K and fused splits, with column tiles walked per program, fp8 and 16-bit. A box
that could hold another part's rows (the gate's into the up's, one expert's into the next's) is never built: the
launch falls back to the pointer loads. On CPU through the Triton interpreter (it supports descriptors), on a GPU
for real, under graph capture and batch-prefix invariance too; and both kernels through sm_90's compiler."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from runtime.kernels.triton import moe
from tests.kernels.test_triton_kernels import (
    ON_GPU,
    SEEDS,
    _eager_graph_and_side_stream,
    _moe_case,
    _moe_reference,
    assert_close_scaled,
    assert_prefix_invariant,
    fp8_packed,
    gpu,
    poisoned,
)

pytestmark = pytest.mark.kernels

# 16-bit weights and tokens (fp8 weights take 16-bit tokens too): bfloat16 on a GPU, float16 under the interpreter
# (wrong in bfloat16). Descriptors are built for 1- and 2-byte weights only (moe.weight_boxes).
X16 = torch.bfloat16 if ON_GPU else torch.float16
BASE = {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
# (experts, top_k, hidden, inter): whole boxes along both GEMMs' rows (I and D multiples of the BLOCK_Ns drawn).
SHAPES = [(9, 3, 256, 128), (16, 6, 384, 256)]
LAUNCHES = [{"gate_up": {"TMA": True}},
            {"down": {"BLOCK_N": 64, "TMA": True}},
            {"gate_up": {"TMA": True, "FUSED_SPLITS": True, "BLOCK_N": 64, "num_stages": 3},
             "down": {"BLOCK_N": 128, "N_TILES": 3, "TMA": True, "FLAT": True, "num_stages": 3}},
            {"gate_up": {"TMA": True, "BLOCK_N": 16}, "down": {"BLOCK_N": 64, "N_TILES": 2, "TMA": True}}]


def _weights(raw, shared: bool, fp8: bool) -> moe.PackedMoE:
    return fp8_packed(raw, shared) if fp8 else moe.pack_weights(*raw[:3], *(raw[3:] if shared else [None] * 3))


def _run(x, packed, ids, route_w, split_k, config):
    out = poisoned(*x.shape, dtype=x.dtype)
    moe.fused_moe(x, packed, route_w, ids, out=out, split_k=split_k, config=config)
    return out


def _boxes_built(monkeypatch) -> list:
    """Each descriptor moe.weight_boxes builds, by its rows per part (I: gate/up, D: down)."""
    built = []
    real = moe.weight_boxes

    def counted(w, rows, block_n):
        boxes = real(w, rows, block_n)
        if boxes is not None:
            built.append(rows)
        return boxes
    monkeypatch.setattr(moe, "weight_boxes", counted)
    return built


@settings(max_examples=15 if ON_GPU else 4, deadline=None)
@given(seed=SEEDS, tokens=st.sampled_from([9, 17, 33]), shape=st.sampled_from(SHAPES), shared=st.booleans(),
       fp8=st.booleans(), split_k=st.sampled_from([1, 2]), launch=st.sampled_from(LAUNCHES))
@example(seed=0, tokens=33, shape=SHAPES[1], shared=True, fp8=True, split_k=2, launch=LAUNCHES[2])
def test_weights_by_descriptor_give_the_pointer_loads_bits(seed, tokens, shape, shared, fp8, split_k, launch):
    experts, top_k, hidden, inter = shape
    dtype = X16
    x, raw, ids, route_w = _moe_case(seed, tokens, experts, top_k, hidden, inter, shared, dtype, 1.0)
    packed = _weights(raw, shared, fp8)
    pointer = _run(x, packed, ids, route_w, split_k, BASE)
    with pytest.MonkeyPatch.context() as patch:
        built = _boxes_built(patch)
        boxes = _run(x, packed, ids, route_w, split_k, {**BASE, **launch})
    # Routed and shared passes alike: every side the launch asks for went through a descriptor.
    assert set(built) == {r for side, r in (("gate_up", inter), ("down", hidden)) if side in launch}, built
    assert torch.equal(boxes, pointer), f"the launch {launch} changed a row's bits"
    if not fp8:
        assert_close_scaled(boxes, _moe_reference(x, raw, ids, route_w), dtype)
    if ON_GPU:
        assert_prefix_invariant(boxes, lambda k: _run(x[:k], packed, ids[:k], route_w[:k], split_k,
                                                      {**BASE, **launch}), tokens)


def test_the_bits_check_sees_a_box_read_from_the_wrong_expert(monkeypatch):
    """Negative control: descriptors over the experts in another order (a planted bug: each box one expert off)
    give other bits, and the comparison above sees it."""
    x, raw, ids, route_w = _moe_case(2, 17, *SHAPES[0], False, X16, 1.0)
    packed = _weights(raw, False, False)
    pointer = _run(x, packed, ids, route_w, 1, BASE)
    real = moe.weight_boxes
    monkeypatch.setattr(moe, "weight_boxes", lambda w, rows, block_n: real(w.roll(1, 0).contiguous(), rows, block_n))
    boxes = _run(x, packed, ids, route_w, 1, {**BASE, **LAUNCHES[1]})
    assert not torch.isnan(boxes).any()
    assert not torch.equal(boxes, pointer), "a box of the wrong expert gave the same bits: the check is blind"


def test_a_box_that_could_cross_a_part_falls_back_to_pointer_loads(monkeypatch):
    """weight_boxes builds nothing where a box could hold rows of the next part, for 4-byte weights, or for a view
    that is not the experts' dense stack; the launch then takes the pointer loads, with the same bits."""
    w = torch.randn(4, 2 * 96, 256, device="cuda" if ON_GPU else "cpu").to(torch.float16)
    assert moe.weight_boxes(w, 96, 32) is not None
    assert moe.weight_boxes(w, 96, 64) is None  # 96 rows a part: a 64-row box would straddle gate and up
    assert moe.weight_boxes(w.float(), 96, 32) is None
    assert moe.weight_boxes(w[:, :, :128], 96, 32) is None  # not contiguous
    x, raw, ids, route_w = _moe_case(4, 17, 9, 3, 256, 96, False, X16, 1.0)
    packed = _weights(raw, False, False)
    built = _boxes_built(monkeypatch)
    launch = {"gate_up": {"TMA": True, "BLOCK_N": 64}, "down": {"BLOCK_N": 64, "TMA": True}}
    assert torch.equal(_run(x, packed, ids, route_w, 1, {**BASE, **launch}),
                       _run(x, packed, ids, route_w, 1, {**BASE, "gate_up": {"BLOCK_N": 64}, "down": {"BLOCK_N": 64}}))
    assert built == [256], "only the down projection (D = 256 rows an expert) could take whole boxes"


@gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_descriptor_launches_under_graph_replay_and_side_stream(fp8):
    """Descriptors are kernel arguments baked into the graph: replayed on new tokens and routes (same weights), the
    output is the eager one's, and a side stream's."""
    shape = (16, 6, 512, 128)
    raw = _moe_case(0, 33, *shape, True, torch.bfloat16, 1.0)[1]
    packed = _weights(raw, True, fp8)
    config = {**BASE, **LAUNCHES[2]}

    def make(seed):
        x, _, ids, route_w = _moe_case(seed, 33, *shape, True, torch.bfloat16, 1.0)
        return x, ids, route_w
    eager, replayed, side = _eager_graph_and_side_stream(
        make, lambda x, ids, w: moe.fused_moe(x, packed, w, ids, split_k=4, config=config))
    assert torch.equal(replayed, eager), "graph replay differs from eager"
    assert torch.equal(side, eager), "side stream differs from eager"


def _compile_cases():
    """(kernel, signature, constexprs, warps, stages) at the deployment's shapes (fp8 and bf16 weights, I = 256,
    D = 4096) and the launches bench.moe_tma times."""
    for wt, fp8 in (("fp8e4nv", True), ("bf16", False)):
        for block_n, warps, stages in ((32, 2, 5), (64, 4, 4)):
            yield ("_gate_up_kernel",
                   {"x_ptr": "*" + wt, "x_scale_ptr": "*fp32", "w_ptr": "*" + wt,
                    "w_desc": f"tensordesc<{wt}[{block_n}, 128]>", "w_scale_ptr": "*fp32", "act_ptr": "*fp32",
                    "sorted_rows_ptr": "*i32", "tile_expert_ptr": "*i32", "num_rows": "i32", "top_k": "i32",
                    "hidden": "i32", "inter": "i32", "stride_x": "i32", "stride_xs": "i32", "stride_we": "i32",
                    "stride_wn": "i32", "stride_wse": "i32", "stride_wsn": "i32", "stride_act": "i32",
                    "part_ptr": "*fp32", "k_chunk": "i32"},
                   dict(FP8=fp8, ROUTING=moe.ALIGNED, SPLIT_K=4, FUSED_SPLITS=False, W_TMA=True, PRECISION="tf32",
                        BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=moe.BLOCK_K), warps, stages)
        for block_n, n_tiles, warps, stages in ((64, 1, 4, 4), (128, 2, 4, 3)):
            yield ("_down_kernel",
                   {"act_ptr": "*" + wt, "act_scale_ptr": "*fp32", "w_ptr": "*" + wt,
                    "w_desc": f"tensordesc<{wt}[{block_n}, 128]>", "w_scale_ptr": "*fp32", "out_ptr": "*fp32",
                    "sorted_rows_ptr": "*i32", "tile_expert_ptr": "*i32", "route_w_ptr": "*fp32", "num_rows": "i32",
                    "hidden": "i32", "inter": "i32", "stride_act": "i32", "stride_as": "i32", "stride_we": "i32",
                    "stride_wn": "i32", "stride_wse": "i32", "stride_wsn": "i32", "stride_out": "i32"},
                   dict(FP8=fp8, ROUTING=moe.ALIGNED, WEIGHTED=True, W_TMA=True, PRECISION="tf32", BLOCK_M=16,
                        BLOCK_N=block_n, BLOCK_K=moe.BLOCK_K, N_TILES=n_tiles, FLAT=n_tiles > 1), warps, stages)


@pytest.mark.skipif(ON_GPU, reason="on a GPU the tests above compile it for real")
@pytest.mark.parametrize("case", list(_compile_cases()),
                         ids=lambda c: f"{c[0]}-{'fp8' if c[2]['FP8'] else 'bf16'}-{c[2]['BLOCK_N']}")
def test_the_descriptor_launches_compile_for_the_gpu_without_one(case):
    """The interpreter takes a descriptor's box and its transpose into the dot on trust; sm_90's compiler must take
    them at fp8's mma.sync tile (16 rows) and bf16's."""
    from tests.kernels.test_indexer_topk import compile_for_sm90

    kernel, signature, constants, warps, stages = case
    done = compile_for_sm90("runtime.kernels.triton.moe", kernel, signature, constants, num_warps=warps,
                            num_stages=stages)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
