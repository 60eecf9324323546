"""The selection's group maxima written by the indexer's logits kernel (indexer.GroupMaxima,
`logits_and_selection(fused=True)`) against a readable torch definition of topk's pass 1.

The fused kernel must leave the logits' bits alone, write exactly pass 1's packed maxima (poisoned
buffers; rows the selection answers without pass 1 untouched), and the selection built on them must be
the one select_slots computes by itself and the stable sort's. Under the Triton interpreter on CPU
(blocks of 32 positions) and, on a GPU, at the deployment's 64K-position rows.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import triton
from hypothesis import example, given, settings
from hypothesis import strategies as st

from runtime.kernels import cuda_torch
from runtime.kernels.triton import elementwise, indexer, topk
from tests.kernels.test_indexer_topk import assert_prefix_invariant
from tests.kernels.test_triton_kernels import DEVICE, DTYPES, ON_GPU, SEEDS, _indexer_case, poisoned

pytestmark = pytest.mark.kernels
POISON = torch.iinfo(torch.int64).max  # the packed key of a NaN at position 0: ranks first if read unwritten


def reference_group_maxima(logits: torch.Tensor, positions: torch.Tensor, window: int, group: int) -> torch.Tensor:
    """topk's pass 1, readable: each position's order key (the float's bits made monotone: -0.0 as +0.0,
    every NaN highest, positions past p - window as -inf), the largest of each group of `group`
    positions (lanes past the row at key 0), packed with the group's index g as
    (key - 2^31) * 2^32 + (2^32 - 1 - g): descending order is key descending, then g ascending."""
    rows, width = logits.shape
    cols = torch.arange(width)
    x = torch.where(cols[None, :] <= positions[:, None] - window, logits, float("-inf"))
    x = torch.where(x == 0, torch.zeros_like(x), x).contiguous()
    bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    key = torch.where(bits >= 2**31, ~bits & 0xFFFFFFFF, bits | 2**31)
    key = torch.where(torch.isnan(x), torch.full_like(key, 2**32 - 1), key)
    groups = -(-width // group)
    best = torch.nn.functional.pad(key, (0, groups * group - width), value=0).view(rows, groups, group).amax(-1)
    return (best - 2**31) * 2**32 + (2**32 - 1 - torch.arange(groups))[None, :]


def fused_run(q, w, keys, table, lens, page_size, positions, window, k, group, key_scale=None, blocks=None,
              unmasked=None, prefetch=None):
    """(logits, maxima) of the fused kernel on poisoned buffers (NaN logits, int64-max maxima). unmasked,
    prefetch: indexer_logits' unmasked_full_blocks and prefetch_scale."""
    width = table.shape[1] * page_size
    logits = poisoned(q.shape[0], width, dtype=torch.float32)
    maxima = torch.full((q.shape[0], triton.cdiv(width, group)), POISON, dtype=torch.int64, device=DEVICE)
    spec = indexer.GroupMaxima(maxima, positions.to(DEVICE), window, min(k, width), group)
    indexer.indexer_logits(q, w, keys, table, lens, page_size, key_scale=key_scale, out=logits, blocks=blocks,
                           maxima=spec, unmasked_full_blocks=unmasked, prefetch_scale=prefetch)
    return logits, maxima


def pass_1(logits, positions, window, k, group) -> torch.Tensor:
    """topk._maxima_kernel's own output on a poisoned buffer, launched as selection_launches does."""
    rows, width = logits.shape
    segment = topk.segment_size(group)
    maxima = torch.full((rows, triton.cdiv(width, group)), POISON, dtype=torch.int64, device=DEVICE)
    topk._maxima_kernel[(rows, triton.cdiv(width, segment))](
        logits, positions.to(DEVICE), maxima, width, logits.stride(0), maxima.stride(0), WINDOW=window,
        TOPK=min(k, width), GROUP=group, SEGMENT=segment, **topk.row_pass_launch("maxima"))
    return maxima


def assert_maxima_match(logits, maxima, positions, window, k, group) -> None:
    """The fused maxima are pass 1's on every row it runs on (more than k candidates); the others untouched."""
    logits, maxima, positions = logits.cpu(), maxima.cpu(), positions.cpu()
    want = reference_group_maxima(logits, positions, window, group)
    runs = positions - window + 1 > min(k, logits.shape[1])
    bad = torch.nonzero((maxima != want) & runs[:, None])
    assert bad.numel() == 0, f"group maxima differ at (row, group) {bad[:8].tolist()}"
    assert bool((maxima[~runs] == POISON).all()), "a row the selection answers without pass 1 was written"


@settings(max_examples=8 if ON_GPU else 5, deadline=None)
@given(seed=SEEDS, queries=st.sampled_from([2, 5]), context=st.sampled_from([40, 150, 300]),
       page_size=st.sampled_from([4, 16]), dtype=st.sampled_from(DTYPES), window=st.sampled_from([0, 1, 8]),
       k=st.sampled_from([1, 5, 24]), group=st.sampled_from([None, 1, 4, 32] + ([64, 128] if ON_GPU else [])),
       blocks=st.sampled_from([1, 2]), unmasked=st.booleans())
@example(seed=1, queries=5, context=300, page_size=16, dtype=DTYPES[0], window=8, k=5, group=4, blocks=2,
         unmasked=False)
@example(seed=2, queries=5, context=150, page_size=4, dtype=DTYPES[0], window=1, k=24, group=32, blocks=1,
         unmasked=True)
def test_the_logits_kernel_writes_pass_1s_maxima(seed, queries, context, page_size, dtype, window, k, group, blocks,
                                                 unmasked):
    """Queries of several lengths (blocks partly or wholly past the length, rows with fewer candidates
    than k), tied logits (duplicated keys): the logits keep their bits, the maxima are pass 1's, and
    the selection on them is select_slots' own and the stable sort's. unmasked: full blocks without masks
    (indexer.UNMASKED_FULL_BLOCKS) in the fused kernel, against the masked plain kernel."""
    q, w, keys, table, lens, _ = _indexer_case(seed, queries, 4, 16, context, page_size, dtype)
    width = table.shape[1] * page_size
    positions = (lens - 1).to(torch.int64)  # a decode row's keys end at its own position
    group = topk.group_size(width, k, group)
    logits, maxima = fused_run(q, w, keys, table, lens, page_size, positions, window, k, group, blocks=blocks,
                               unmasked=unmasked)
    plain = indexer.indexer_logits(q, w, keys, table, lens, page_size, blocks=blocks, unmasked_full_blocks=False)
    assert torch.equal(logits, plain), "the fused maxima changed the logits"
    assert_maxima_match(logits, maxima, positions, window, k, group)
    # The reference is pass 1: the selection's own kernel writes the same buffer (rows it skips untouched).
    assert torch.equal(pass_1(logits, positions, window, k, group), maxima), "the fused maxima are not pass 1's"
    on_maxima = topk.select_slots(logits, positions.to(DEVICE), window, k, group=group, maxima=maxima)
    own = topk.select_slots(logits, positions.to(DEVICE), window, k, group=group)
    by_sort = cuda_torch.select_slots_by_sort(logits.cpu(), positions.cpu(), window, k)
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(on_maxima, own)), "selection on the fused maxima differs"
    assert all(torch.equal(a.cpu(), b) for a, b in zip(own, by_sort)), "selection differs from the stable sort"
    # The entry point the decode step calls, both ways: the same logits and selection.
    fused = indexer.logits_and_selection(q, w, keys, table, lens, page_size, positions.to(DEVICE), window, k,
                                         fused=True)
    unfused = indexer.logits_and_selection(q, w, keys, table, lens, page_size, positions.to(DEVICE), window, k,
                                           fused=False)
    assert torch.equal(fused[0], unfused[0]) and all(torch.equal(a, b) for a, b in zip(fused[1], unfused[1]))


@pytest.mark.parametrize("unmasked, prefetch", [(None, None), (True, False), (True, True)])
def test_fp8_style_scaled_keys_give_pass_1s_maxima_too(unmasked, prefetch):
    """Keys with a per-slot scale (fp8 on a GPU; on CPU the keys as they are with a random scale), through
    the default loop, unmasked full blocks, and unmasked full blocks with the key scales prefetched: the
    maxima are pass 1's and the logits the masked loop's bits."""
    q, w, keys, table, lens, _ = _indexer_case(3, 3, 4, 16, 200, 16, DTYPES[0])
    if ON_GPU:
        keys, key_scale = elementwise.quantize_groups(keys.to(torch.float32))
        key_scale = key_scale[:, 0].contiguous()
        q = q.to(keys.dtype)
    else:
        key_scale = torch.rand(keys.shape[0], generator=torch.Generator().manual_seed(3)) + 0.5
    positions = (lens - 1).to(torch.int64)
    logits, maxima = fused_run(q, w, keys, table, lens, 16, positions, 8, 5, 4, key_scale=key_scale,
                               unmasked=unmasked, prefetch=prefetch)
    assert_maxima_match(logits, maxima, positions, 8, 5, 4)
    plain = indexer.indexer_logits(q, w, keys, table, lens, 16, key_scale=key_scale, unmasked_full_blocks=False)
    assert torch.equal(logits, plain)


def test_maxima_oracle_fails_on_a_window_off_by_one():
    """Negative control: maxima written with a window one longer than the selection's (9, not 8) also
    mask position p - 8 to -inf; with groups of one position, that group's maximum must differ."""
    q, w, keys, table, lens, _ = _indexer_case(4, 2, 4, 16, 150, 16, DTYPES[0])
    positions = (lens - 1).to(torch.int64)
    positions[:] = 149
    lens = (positions + 1).to(torch.int32).to(DEVICE)
    logits, maxima = fused_run(q, w, keys, table, lens, 16, positions, 9, 5, 1)
    with pytest.raises(AssertionError, match="group maxima differ"):
        assert_maxima_match(logits, maxima, positions, 8, 5, 1)


def test_maxima_oracle_fails_on_a_row_written_that_pass_1_skips():
    """Negative control of the untouched-rows check: a row of fewer candidates than k given maxima."""
    q, w, keys, table, lens, _ = _indexer_case(5, 2, 4, 16, 64, 16, DTYPES[0])
    positions = torch.tensor([63, 3])  # row 1: 4 candidates, fewer than k
    lens = (positions + 1).to(torch.int32).to(DEVICE)
    logits, maxima = fused_run(q, w, keys, table, lens, 16, positions, 0, 5, 1)
    maxima[1] = 0  # as if the kernel wrote a row the selection answers as positions [0, k)
    with pytest.raises(AssertionError, match="without pass 1 was written"):
        assert_maxima_match(logits, maxima, positions, 0, 5, 1)


def test_bad_maxima_are_refused_with_what_they_need():
    q, w, keys, table, lens, _ = _indexer_case(6, 2, 4, 16, 300, 16, DTYPES[0])
    width, positions = table.shape[1] * 16, (lens - 1).to(torch.int64).to(DEVICE)
    block = indexer.block_positions()
    wide = torch.empty(2, triton.cdiv(width, 2 * block), dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="do not tile the logits kernel's blocks"):
        indexer.indexer_logits(q, w, keys, table, lens, 16,
                               maxima=indexer.GroupMaxima(wide, positions, 8, 5, 2 * block))
    short = torch.empty(2, 3, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="group maxima need out int64"):
        indexer.indexer_logits(q, w, keys, table, lens, 16, maxima=indexer.GroupMaxima(short, positions, 8, 5, 4))
    logits = torch.randn(2, width, device=DEVICE)
    with pytest.raises(ValueError, match="need int64"):
        topk.select_slots(logits, positions, 8, 5, group=4, maxima=short)


def test_the_fused_path_is_taken_only_where_it_fits():
    """Groups that do not tile the kernel's block, no top-k part, or the switch off: logits + select_slots."""
    block = indexer.block_positions()
    assert indexer.fuses(4 * block, 1, fused=True)  # groups of one position
    assert not indexer.fuses(4 * block, 0, fused=True)  # window only
    assert not indexer.fuses(4 * block, 1, fused=False)
    wide = 2048 * block  # max(1024, 2k) groups of 2 blocks each at small k
    assert topk.group_size(wide, 1) == 2 * block and not indexer.fuses(wide, 1, fused=True)


@pytest.mark.parametrize("k", [0, 7, 150, 400])
def test_fused_and_unfused_agree_at_every_top_k_width(k):
    """k of 0 (window only), under, at and over the row's width: the same logits and selection."""
    q, w, keys, table, lens, _ = _indexer_case(7, 3, 4, 16, 150, 16, DTYPES[0])
    positions = (lens - 1).to(torch.int64)
    fused = indexer.logits_and_selection(q, w, keys, table, lens, 16, positions, 8, k, fused=True)
    unfused = indexer.logits_and_selection(q, w, keys, table, lens, 16, positions, 8, k, fused=False)
    assert torch.equal(fused[0], unfused[0]) and all(torch.equal(a, b) for a, b in zip(fused[1], unfused[1]))


def test_a_selection_that_does_not_compile_falls_back_to_the_sort(monkeypatch):
    """As cuda_torch.select_slots: a Triton build that cannot compile the selection costs speed, with a
    warning, and every later call sorts too."""
    from triton.runtime.errors import PTXASError

    def broken(*args, **kwargs):
        raise PTXASError("planted compile failure")
    monkeypatch.setattr(topk, "select_slots", broken)
    monkeypatch.setattr(cuda_torch, "_TRITON_SELECT_FAILED", [])
    q, w, keys, table, lens, _ = _indexer_case(8, 2, 4, 16, 150, 16, DTYPES[0])
    positions = (lens - 1).to(torch.int64)
    with pytest.warns(RuntimeWarning, match="planted compile failure"):
        logits, got = indexer.logits_and_selection(q, w, keys, table, lens, 16, positions, 8, 5, fused=True)
    want = cuda_torch.select_slots_by_sort(logits, positions, 8, 5)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the next call skips the fused path: no second failure, no warning
        again = indexer.logits_and_selection(q, w, keys, table, lens, 16, positions, 8, 5, fused=True)
    assert all(torch.equal(a, b) for a, b in zip(again[1], want))


def test_fused_rows_do_not_depend_on_the_batch():
    """f(x)[:n] == f(x[:n]) bit for bit, logits and selection, for several n (rows of several lengths)."""
    q, w, keys, table, lens, _ = _indexer_case(10, 5, 4, 16, 300, 16, DTYPES[0])
    positions = (lens - 1).to(torch.int64)
    def run(n: int) -> tuple[torch.Tensor, ...]:
        logits, (sel, ok) = indexer.logits_and_selection(q[:n], w[:n], keys, table[:n], lens[:n], 16, positions[:n],
                                                         8, 24, fused=True)
        return logits, sel, ok
    assert_prefix_invariant(run(5), run, 5)  # its negative control: test_indexer_topk.py


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device (run on the device machine: scripts/gpu_suite.sh)")
def test_the_fused_path_under_graph_replay_and_side_stream():
    """Captured in a CUDA graph and replayed on new inputs (lengths included), and on a side stream:
    the eager path's logits and selection, bit for bit."""
    from tests.kernels.test_triton_kernels import _eager_graph_and_side_stream

    def make(seed):
        q, w, keys, table, lens, _ = _indexer_case(seed, 4, 64, 128, 2000, 64, torch.bfloat16)
        return q, w, keys, table, lens, (lens - 1).to(torch.int64)

    def run(q, w, keys, table, lens, positions):
        logits, (sel, ok) = indexer.logits_and_selection(q, w, keys, table, lens, 64, positions, 128, 512, fused=True)
        return logits, sel, ok
    assert indexer.fuses(2048, 512, fused=True)
    eager, replayed, side = _eager_graph_and_side_stream(make, run)
    for name, a, b, c in zip(("logits", "positions", "valid"), eager, replayed, side):
        assert torch.equal(b, a), f"graph replay differs from eager ({name})"
        assert torch.equal(c, a), f"side stream differs from eager ({name})"


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device (run on the device machine: scripts/gpu_suite.sh)")
def test_deployment_rows_fused_and_not_select_the_same():
    """B=16 at 64K positions, fp8 keys of 128 lanes, top-512 after a 128-position window (groups of 64):
    fused and unfused, the same logits and selection, and the maxima are pass 1's."""
    gen = torch.Generator().manual_seed(9)
    batch, heads, dim, context, page_size = 16, 64, 128, 65536, 64
    pages = context // page_size
    table = torch.stack([torch.randperm(pages * batch, generator=gen)[:pages] for _ in range(batch)])
    table = table.to(torch.int32).cuda()
    keys, key_scale = elementwise.quantize_groups(torch.randn(pages * batch * page_size, dim, generator=gen).cuda())
    key_scale = key_scale[:, 0].contiguous()
    q = torch.randn(batch, heads, dim, generator=gen).cuda().to(keys.dtype)
    w = torch.rand(batch, heads, generator=gen).cuda()
    positions = torch.randint(0, context, (batch,), generator=gen).cuda()
    positions[:4] = context - 1
    positions[4] = 300  # fewer candidates than k
    lens = (positions + 1).to(torch.int32)
    group = topk.group_size(context, 512)
    assert group == 64
    logits, maxima = fused_run(q, w, keys, table, lens, page_size, positions, 128, 512, group, key_scale=key_scale)
    assert_maxima_match(logits, maxima, positions, 128, 512, group)
    fused = indexer.logits_and_selection(q, w, keys, table, lens, page_size, positions, 128, 512, key_scale, True)
    unfused = indexer.logits_and_selection(q, w, keys, table, lens, page_size, positions, 128, 512, key_scale, False)
    assert torch.equal(fused[0], unfused[0]) and all(torch.equal(a, b) for a, b in zip(fused[1], unfused[1]))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device (run on the device machine: scripts/gpu_suite.sh)")
@pytest.mark.parametrize("with_maxima", [False, True])
def test_register_caps_keep_the_bits(with_maxima):
    """indexer.REGISTER_CAP (the launch's maxnreg) only moves values between registers and the stack: the
    logits (and maxima) are the uncapped launch's bits at every cap, spills included (96)."""
    q, w, keys, table, lens, _ = _indexer_case(11, 4, 64, 128, 3000, 64, torch.bfloat16)
    positions = (lens - 1).to(torch.int64)
    width = table.shape[1] * 64
    group = topk.group_size(width, 512)
    outs = []
    for cap in (0, 96, 128):
        logits = poisoned(4, width, dtype=torch.float32)
        maxima = torch.full((4, triton.cdiv(width, group)), POISON, dtype=torch.int64, device=DEVICE)
        spec = indexer.GroupMaxima(maxima, positions, 128, 512, group) if with_maxima else None
        indexer.indexer_logits(q, w, keys, table, lens, 64, out=logits, maxima=spec, register_cap=cap)
        outs.append((logits, maxima))
    assert not torch.isnan(outs[0][0]).any()
    for (logits, maxima), cap in zip(outs[1:], (96, 128)):
        assert torch.equal(logits, outs[0][0]) and torch.equal(maxima, outs[0][1]), f"cap {cap} changed a bit"
