"""The page-tile indexer (runtime/kernels/triton/indexer_pages.py) against the pointer kernel, bit for bit.

The page kernel copies each tile's keys by TMA from one page and must give exactly the logits of the
pointer kernel (itself held to the readable reference in test_triton_kernels.py): every tiling, launch
and way of loading the key scales, -inf past each length, nothing left unwritten (poisoned outputs),
rows independent of the batch. Under the Triton interpreter on CPU (tiles of 16 positions) and, on a
GPU, at wgmma's 64-row tiles, through graph capture too; an sm_90 compile of the deployment's launch
on CPU.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from runtime.kernels.triton import indexer, indexer_pages
from tests.kernels.test_indexer_topk import compile_for_sm90
from tests.kernels.test_triton_kernels import (
    ON_GPU,
    SEEDS,
    _eager_graph_and_side_stream,
    _indexer_case,
    _scaled_keys,
    assert_prefix_invariant,
    launches_changing_bits,
    poisoned,
)

pytestmark = pytest.mark.kernels
TILE = indexer_pages.TILE
PAGE_SIZES = [TILE, 2 * TILE]
DTYPES = [torch.bfloat16, torch.float16] if ON_GPU else [torch.float32, torch.float16]


def _logits(q, w, keys, table, lens, page_size, key_scale=None, *, page_tma, **page_knobs):
    """indexer_logits into a poisoned buffer: the pointer kernel (page_tma False) or the page kernel with
    `page_knobs` (indexer_pages.page_logits' tiles / launch / scale_ahead)."""
    out = poisoned(q.shape[0], table.shape[1] * page_size, dtype=torch.float32)
    if page_tma and page_knobs:
        assert indexer_pages.fits(keys, key_scale, page_size)
        indexer_pages.page_logits(q, w, keys, table, lens, page_size, out, key_scale,
                                  indexer.key_block(q.shape[2], q.dtype),
                                  page_knobs.pop("tiles", None) or indexer.page_tiles(q.shape[0],
                                                                                      table.shape[1] * page_size),
                                  **page_knobs)
    else:
        indexer.indexer_logits(q, w, keys, table, lens, page_size, key_scale=key_scale, out=out, page_tma=page_tma)
    return out


# A page id no cache has: the page-table entries wholly past a query's length hold it, as a runtime may leave
# anything there. A kernel that followed one would fault (the interpreter crashes its process).
NO_PAGE = 2**24


def _case(seed, queries, context, page_size, dtype, scaled, heads=4, dim=16):
    q, w, keys, table, lens, _ = _indexer_case(seed, queries, heads, dim, context, page_size, dtype)
    past = torch.arange(table.shape[1], device=table.device)[None, :] * page_size >= lens[:, None]
    table = torch.where(past, NO_PAGE, table).to(torch.int32)
    key_scale = None
    if scaled:
        keys, key_scale = _scaled_keys(keys)
        q = q.to(keys.dtype)
    return q, w, keys, table, lens, key_scale


@settings(max_examples=6 if ON_GPU else 4, deadline=None)
@given(seed=SEEDS, queries=st.sampled_from([1, 3, 5]), context=st.sampled_from([TILE, 5 * TILE + 3, 300]),
       page_size=st.sampled_from(PAGE_SIZES), dtype=st.sampled_from(DTYPES), scaled=st.booleans(),
       tiles=st.sampled_from([1, 2, None]), scale_ahead=st.booleans())
@example(seed=3, queries=5, context=300, page_size=TILE, dtype=DTYPES[0], scaled=True, tiles=2, scale_ahead=True)
def test_page_tiles_give_the_pointer_kernels_bits(seed, queries, context, page_size, dtype, scaled, tiles,
                                                  scale_ahead):
    """Queries of several lengths (tiles full, partial and wholly past the length; programs of one or more
    tiles): every logit the pointer kernel's bits, -inf past each length included, none left poisoned."""
    q, w, keys, table, lens, key_scale = _case(seed, queries, context, page_size, dtype, scaled)
    want = _logits(q, w, keys, table, lens, page_size, key_scale, page_tma=False)
    got = _logits(q, w, keys, table, lens, page_size, key_scale, page_tma=True, tiles=tiles,
                  scale_ahead=scale_ahead)
    assert not torch.isnan(got).any(), "a position left unwritten (poison)"
    assert torch.equal(got, want)


@settings(max_examples=3, deadline=None)
@given(seed=SEEDS, dtype=st.sampled_from(DTYPES), scaled=st.booleans())
def test_page_tile_rows_do_not_depend_on_the_batch(seed, dtype, scaled):
    """f(x)[:k] == f(x[:k]): a smaller batch spreads each row over more programs of fewer tiles
    (indexer.page_tiles), and no row's bits move."""
    q, w, keys, table, lens, key_scale = _case(seed, 5, 9 * TILE + 5, TILE, dtype, scaled)
    run = lambda k: _logits(q[:k], w[:k], keys, table[:k], lens[:k], TILE, key_scale, page_tma=True)  # noqa: E731
    assert_prefix_invariant(run(5), run, 5)


def test_the_default_switch_takes_the_page_kernel_only_where_it_fits(monkeypatch):
    """indexer.PAGE_TMA on: a call that fits goes to the page kernel; one whose page does not hold whole tiles,
    or whose key scales are strided, or that asks for the fused maxima, keeps the pointer kernel, with its bits."""
    calls = []
    real = indexer_pages.page_logits
    monkeypatch.setattr(indexer_pages, "page_logits", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(indexer, "PAGE_TMA", {True: True, False: True})
    q, w, keys, table, lens, key_scale = _case(1, 3, 4 * TILE, TILE, DTYPES[0], True)
    assert torch.equal(_logits(q, w, keys, table, lens, TILE, key_scale, page_tma=None),
                       _logits(q, w, keys, table, lens, TILE, key_scale, page_tma=False))
    assert len(calls) == 1
    q2, w2, keys2, table2, lens2, scale2 = _case(1, 3, 4 * TILE, TILE // 2, DTYPES[0], True)
    assert not indexer_pages.fits(keys2, scale2, TILE // 2)
    strided = torch.stack([key_scale, key_scale], dim=1)[:, 0]
    assert not indexer_pages.fits(keys, strided, TILE)
    _logits(q2, w2, keys2, table2, lens2, TILE // 2, scale2, page_tma=None)
    _logits(q, w, keys, table, lens, TILE, strided, page_tma=None)
    assert len(calls) == 1, "a call that does not fit reached the page kernel"


def test_page_tile_check_sees_one_page_misread():
    """Negative control of the bit comparison: the page kernel given a page table with one query's second page
    swapped for a page of another query must differ from the pointer kernel, in that page's positions alone."""
    q, w, keys, table, lens, key_scale = _case(4, 3, 6 * TILE, TILE, DTYPES[0], True)
    want = _logits(q, w, keys, table, lens, TILE, key_scale, page_tma=False)
    wrong = table.clone()
    wrong[0, 1] = table[1, 0]
    got = _logits(q, w, keys, wrong, lens, TILE, key_scale, page_tma=True, tiles=2)
    changed = (got != want).nonzero().tolist()
    assert changed and {(row, col // TILE) for row, col in changed} == {(0, 1)}
    with pytest.raises(AssertionError):
        assert torch.equal(got, want)


def test_page_tile_launch_knobs_are_checked():
    q, w, keys, table, lens, key_scale = _case(1, 1, TILE, TILE, DTYPES[0], False)
    with pytest.raises(ValueError, match="unknown"):
        _logits(q, w, keys, table, lens, TILE, key_scale, page_tma=True, launch={"block_l": 64})


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device (run on the device machine: scripts/gpu_suite.sh)")
@pytest.mark.parametrize("keys_dtype", ["fp8", "bf16"])
def test_page_tile_launches_keep_the_pointer_kernels_bits(keys_dtype):
    """Every launch bench.indexer_pages times (indexer_pages.LAUNCH_VARIANTS) at the deployment's 64 heads and
    128-lane keys: the pointer kernel's bits, or the chip cannot hold the launch (named)."""
    q, w, keys, table, lens, key_scale = _case(5, 4, 3000, 64, torch.bfloat16, keys_dtype == "fp8", 64, 128)
    want = _logits(q, w, keys, table, lens, 64, key_scale, page_tma=False)
    assert not torch.isnan(want).any()
    changed, refused = launches_changing_bits(
        indexer_pages.LAUNCH_VARIANTS, lambda knobs: _logits(q, w, keys, table, lens, 64, key_scale, page_tma=True,
                                                             **knobs), want)
    assert not changed, f"page-tile launches {changed} changed logits' bits"
    print(f"page-tile launches the chip could not hold: {refused}")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device (run on the device machine: scripts/gpu_suite.sh)")
@pytest.mark.parametrize("scaled", [False, True])
def test_page_tiles_under_graph_replay_and_side_stream(scaled):
    """Descriptors built at capture time: a replay on new keys, queries and lengths (same tensors) gives the
    eager logits, as does a side stream."""
    def make(seed):
        q, w, keys, table, lens, key_scale = _case(seed, 4, 700, 64, torch.bfloat16, scaled, 64, 128)
        return q, w, keys, table, lens, key_scale
    eager, replayed, side = _eager_graph_and_side_stream(
        make, lambda q, w, k, t, n, s: _logits(q, w, k, t, n, 64, s, page_tma=True))
    assert torch.equal(replayed, eager), "graph replay differs from eager"
    assert torch.equal(side, eager), "side stream differs from eager"


def _timed_launches() -> list[tuple[int, int]]:
    """(warps, stages) of the default launch and of every launch variant the bench times."""
    return sorted({(knobs.get("num_warps", indexer_pages.LAUNCH["num_warps"]),
                    knobs.get("num_stages", indexer_pages.LAUNCH["num_stages"]))
                   for knobs in [{}, *(v.get("launch", {}) for v in indexer_pages.LAUNCH_VARIANTS.values())]})


@pytest.mark.skipif(ON_GPU, reason="on a GPU the tests above compile it for real")
@pytest.mark.parametrize("scale_ahead", [False, True])
@pytest.mark.parametrize("warps, stages", _timed_launches())
def test_the_page_kernel_compiles_for_the_gpu_without_one(scale_ahead, warps, stages):
    """The deployment's launch (fp8 keys of 128 lanes, 64 heads, 16 tiles of 64 a program) through sm_90's
    compiler at each timed warp and stage count: TMA descriptors, wgmma on a copied tile and the loop-carried
    scales are what the interpreter cannot vouch for."""
    signature = {"q_ptr": "*fp8e4nv", "w_ptr": "*fp32", "key_desc": "tensordesc<fp8e4nv[64, 128]>",
                 "scale_ptr": "*fp32", "table_ptr": "*i32", "lens_ptr": "*i32", "out_ptr": "*fp32", "heads": "i32",
                 "dim": "i32", "page_size": "i32", "width": "i32", "stride_qt": "i32", "stride_qh": "i32",
                 "stride_w": "i32", "stride_table": "i32", "stride_out": "i32"}
    constants = dict(KEY_SCALE=True, PRECISION="tf32", TILES=16, BLOCK_H=64, BLOCK_D=128, TILE=64,
                     SCALE_AHEAD=scale_ahead)
    done = compile_for_sm90("runtime.kernels.triton.indexer_pages", "_indexer_pages_kernel", signature, constants,
                            num_warps=warps, num_stages=stages)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


def test_a_pointer_knob_keeps_the_pointer_kernel(monkeypatch):
    """The tests and benches that compare the pointer kernel's launches (blocks, scales, masks, launch shapes) must
    run it, not the page kernel the default switch would pick: else they compare the page kernel with itself. Asking
    for the page kernel together with a pointer knob is refused."""
    calls = []
    real = indexer_pages.page_logits
    monkeypatch.setattr(indexer_pages, "page_logits", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(indexer, "PAGE_TMA", {True: True, False: True})
    q, w, keys, table, lens, key_scale = _case(2, 2, 4 * TILE, TILE, DTYPES[0], True)
    out = poisoned(2, table.shape[1] * TILE, dtype=torch.float32)
    for knob in (dict(blocks=1), dict(early_scale=False), dict(launch={"num_stages": 1}),
                 dict(unmasked_full_blocks=False), dict(prefetch_scale=False), dict(register_cap=0)):
        indexer.indexer_logits(q, w, keys, table, lens, TILE, key_scale=key_scale, out=out, **knob)
        assert not calls, f"{knob} ran the page kernel"
        with pytest.raises(ValueError, match="none of the pointer kernel's knobs"):
            indexer.indexer_logits(q, w, keys, table, lens, TILE, key_scale=key_scale, page_tma=True, **knob)
    indexer.indexer_logits(q, w, keys, table, lens, TILE, key_scale=key_scale, out=out)
    assert len(calls) == 1
