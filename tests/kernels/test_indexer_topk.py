"""The Triton radix-select selection (kernels/triton/topk.py) vs a readable Python definition.

The tie rule is fixed (lower position first), so the comparison is exact: the same positions in
the same order and the same valid mask, for hypothesis-drawn scores with planted ties, values that
differ only in their last mantissa bits (every radix digit decides), NaN / +-inf / +-0.0, rows with
fewer candidates than top-k. The chosen set also passes the tie-aware oracle. Outputs and the
workspace are poisoned before every run; batch invariance is bit for bit. Each check has a negative
control. Under the Triton interpreter on CPU (float32); on a GPU also 64K-position rows against
torch's CUDA stable sort (select_slots_by_sort), graph replay and a side stream.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from canary.oracles.topk_compare import wrong_topk_indices
from runtime.kernels import cuda_torch
from runtime.kernels.triton import indexer as indexer_kernels
from runtime.kernels.triton import topk

pytestmark = pytest.mark.kernels

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
gpu = pytest.mark.gpu
STYLES = ("normal", "few_values", "all_equal", "last_bits", "specials", "zeros_and_nans")
# NaNs of either sign and several payloads, as float32 bits: all rank equal (above +inf), as torch.sort
# on CPU ranks them; torch.sort on CUDA (CUB radix) orders NaNs by their bits, so GPU checks skip them.
NAN_BITS = (0x7FC00000, 0x7FC00001, 0x7F800001, -0x00400000, -0x00000001)
POISON_POS = -7  # never a position


def reference_selection(scores: torch.Tensor, positions: torch.Tensor, window: int, k: int,
                        ties_to_lower: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Row by row in Python: the window (p - window, p] (clamped at 0, valid if >= 0), then the first
    min(k, L) positions ordered by score descending, position ascending, where positions
    > p - window rank as -inf, NaN ranks above +inf and -0.0 equals +0.0 (so do Python's floats).
    ties_to_lower=False: the other tie rule (negative control only)."""
    rows, width = scores.shape
    sel, ok = [], []
    for r in range(rows):
        p = int(positions[r])
        window_pos = [p - window + 1 + j for j in range(window)]

        def rank(j: int, r=r, p=p) -> tuple:
            v = float(scores[r, j]) if j <= p - window else -math.inf
            tie = j if ties_to_lower else -j
            return (0, 0.0, tie) if math.isnan(v) else (1, -v, tie)
        order = sorted(range(width), key=rank)[:min(k, width)]
        sel.append([max(w, 0) for w in window_pos] + order)
        ok.append([w >= 0 for w in window_pos] + [j <= p - window for j in order])
    return (torch.tensor(sel, dtype=torch.int64).view(rows, -1), torch.tensor(ok, dtype=torch.bool).view(rows, -1))


def draw_scores(seed: int, rows: int, width: int, style: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if style == "few_values":  # heavy ties: 4 distinct values
        return torch.randint(0, 4, (rows, width), generator=gen).float()
    if style == "all_equal":
        return torch.full((rows, width), 0.5)
    if style == "zeros_and_nans":  # -0.0 == +0.0 and every NaN equal: only the position breaks ties
        nans = torch.tensor(NAN_BITS, dtype=torch.int32).view(torch.float32)
        values = torch.cat([torch.tensor([-0.0, 0.0, 0.0, -0.0, 1.0, -1.0]), nans])
        return values[torch.randint(0, len(values), (rows, width), generator=gen)]
    if style == "last_bits":  # equal above the last 6 mantissa bits: the last digit decides
        return 1.0 + torch.randint(0, 64, (rows, width), generator=gen).float() * 2.0**-23
    x = torch.randn(rows, width, generator=gen)
    x[:, ::5] = x[:, :1].clone()  # planted ties with the row's first score
    if style == "specials":
        picks = torch.randint(0, width, (rows, 6), generator=gen)
        for r in range(rows):
            for value, j in zip((float("nan"), float("inf"), float("-inf"), -0.0, 0.0, float("nan")), picks[r]):
                x[r, j] = value
    return x


def draw_positions(seed: int, rows: int, width: int) -> torch.Tensor:
    p = torch.randint(0, width, (rows,), generator=torch.Generator().manual_seed(seed + 1))
    p[0] = width - 1  # a full row
    return p


def run_poisoned(scores, positions, window, k, group=None, expected_ok=None, rank_order=None, segment=None,
                 sort_finish=None, resident_bound=None, row_pass_launches=None):
    """The kernel on poisoned buffers: positions -7, valid the opposite of the expected mask (or all
    True), workspace all int64 max (the packed key of a NaN at position 0: first if read unwritten)."""
    rows, width = scores.shape
    s = window + min(k, width)
    sel = torch.full((rows, s), POISON_POS, dtype=torch.int64, device=DEVICE)
    ok = (~expected_ok.to(DEVICE)) if expected_ok is not None else torch.ones(rows, s, dtype=torch.bool, device=DEVICE)
    scratch = torch.full((rows, width), torch.iinfo(torch.int64).max, dtype=torch.int64, device=DEVICE)
    topk.select_slots(scores.to(DEVICE), positions.to(DEVICE), window, k, group=group, out=(sel, ok),
                      scratch=scratch, rank_order=rank_order, segment=segment, sort_finish=sort_finish,
                      row_pass_launches=row_pass_launches,
                      resident_bound=resident_bound)
    return sel.cpu(), ok.cpu()


def assert_same_selection(actual, expected, msg="") -> None:
    (sel, ok), (want_sel, want_ok) = actual, expected
    assert sel.shape == want_sel.shape, f"shape {tuple(sel.shape)} != {tuple(want_sel.shape)} {msg}"
    assert not bool((sel == POISON_POS).any()), f"unwritten positions {msg}"
    bad = torch.nonzero((sel != want_sel) | (ok != want_ok))
    assert bad.numel() == 0, f"selection differs at (row, slot) {bad[:8].tolist()} {msg}"


def assert_tie_aware(sel, ok, scores, positions, window, k) -> None:
    """The chosen set, ignoring order and the tie rule: zero wrong indices (canary's oracle)."""
    for r in range(scores.shape[0]):
        width = scores.shape[1]
        candidates = torch.arange(width) <= int(positions[r]) - window
        if bool(torch.isnan(scores[r][candidates]).any()):
            continue  # the oracle compares numbers; the exact check covers NaN
        chosen = torch.zeros(width, dtype=torch.bool)
        part = sel[r, window:][ok[r, window:]]
        assert len(set(part.tolist())) == len(part), f"row {r}: a position chosen twice"
        chosen[part] = True
        wrong = wrong_topk_indices(chosen, scores[r], candidates, k, tie_tol=0.0)
        assert wrong == [], f"row {r}: wrong top-k indices {wrong}"


def assert_prefix_invariant(full, run_prefix, rows: int) -> None:
    """f(x)[:k] == f(x[:k]) bit for bit for several prefixes k."""
    for n in sorted({1, rows // 2, rows - 1}):
        if 0 < n < rows:
            part = run_prefix(n)
            assert all(torch.equal(a[:n], b) for a, b in zip(full, part)), \
                f"row results changed with the batch (k={n} of {rows})"


@settings(max_examples=12)
@given(seed=st.integers(0, 2**31 - 1), rows=st.sampled_from([1, 2, 5]),
       width=st.sampled_from([1, 7, 64, 65, 200]), window=st.sampled_from([0, 1, 8, 128]),
       k=st.sampled_from([1, 5, 24, 64, 512]), group=st.sampled_from([None, 1, 4, 16]),
       style=st.sampled_from(STYLES), segment=st.sampled_from([None, 8, 32]), resident=st.booleans())
@example(seed=3, rows=2, width=200, window=8, k=24, group=16, style="normal", segment=None, resident=False)
@example(seed=4, rows=2, width=200, window=8, k=24, group=2, style="last_bits", segment=8, resident=True)
@example(seed=5, rows=2, width=65, window=1, k=5, group=8, style="specials", segment=8, resident=False)
@example(seed=6, rows=2, width=200, window=8, k=64, group=4, style="zeros_and_nans", segment=32, resident=True)
@example(seed=7, rows=2, width=200, window=8, k=24, group=4, style="normal", segment=32, resident=True)
@example(seed=8, rows=2, width=200, window=8, k=24, group=4, style="few_values", segment=None, resident=True)
def test_selection_matches_reference_exactly(seed, rows, width, window, k, group, style, segment, resident):
    """segment: positions per program of the passes over the row (at least the group): many segments
    per row, so candidates come from several and move down to one run. resident: the bound's select
    holds the group maxima in registers (rows of at most 64 of them here)."""
    scores, positions = draw_scores(seed, rows, width, style), draw_positions(seed, rows, width)
    expected = reference_selection(scores, positions, window, k)
    actual = run_poisoned(scores, positions, window, k, group, expected_ok=expected[1], segment=segment,
                          resident_bound=resident)
    assert_same_selection(actual, expected,
                          msg=f"({style}, group={group}, segment={segment}, resident={resident})")
    assert_tie_aware(*actual, scores, positions, window, k)
    # The torch definition the CPU path runs agrees too (the lead's golden stores were recorded with it).
    assert_same_selection(cuda_torch.select_slots_by_sort(scores, positions, window, k), expected, msg="(by sort)")
    assert_prefix_invariant(actual, lambda n: run_poisoned(scores[:n], positions[:n], window, k, group,
                                                           segment=segment, resident_bound=resident), rows)


@settings(max_examples=4)
@given(seed=st.integers(0, 2**31 - 1), style=st.sampled_from(STYLES), k=st.sampled_from([1, 3, 16]))
def test_the_gpu_order_tl_sort_matches_too(seed, style, k):
    """The interpreter orders the chosen by counting (rank_order); the GPU by tl.sort: small k here,
    where the interpreter's sort is affordable."""
    scores, positions = draw_scores(seed, 2, 70, style), draw_positions(seed, 2, 70)
    expected = reference_selection(scores, positions, 4, k)
    actual = run_poisoned(scores, positions, 4, k, expected_ok=expected[1], rank_order=False)
    assert_same_selection(actual, expected, msg=f"({style}, tl.sort)")


@settings(max_examples=6)
@given(seed=st.integers(0, 2**31 - 1), style=st.sampled_from(STYLES), k=st.sampled_from([1, 3, 16]),
       group=st.sampled_from([None, 1, 4]))
@example(seed=1, style="all_equal", k=16, group=4)  # 70 candidates > 2k: the radix finish
@example(seed=2, style="normal", k=16, group=4)
@example(seed=3, style="normal", k=16, group=1)  # the bound is the k-th key itself
def test_the_sort_in_place_of_the_finish_radix_select_matches_too(seed, style, k, group):
    """The GPU's default finish (one sort of a row's candidates when they are at most 2k, else the
    radix select): small k, where the interpreter's sort is affordable."""
    scores, positions = draw_scores(seed, 2, 70, style), draw_positions(seed, 2, 70)
    expected = reference_selection(scores, positions, 4, k)
    actual = run_poisoned(scores, positions, 4, k, group, expected_ok=expected[1], segment=8, sort_finish=True)
    assert_same_selection(actual, expected, msg=f"({style}, sort finish)")


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("group", [4, 16])
def test_every_style_through_the_histogram_path(style, group):
    """Groups > 1 leave more than k candidates above the bound, so the digit histograms decide
    (group 1 makes the bound the k-th key itself; short rows take positions [0, k))."""
    scores, positions = draw_scores(11, 2, 256, style), torch.tensor([255, 200])
    expected = reference_selection(scores, positions, 8, 16)
    assert_same_selection(run_poisoned(scores, positions, 8, 16, group, expected_ok=expected[1]), expected,
                          msg=f"({style}, group={group})")


def test_select_slots_dispatch_keeps_the_sort_definition_on_cpu():
    scores, positions = draw_scores(9, 3, 40, "few_values"), draw_positions(9, 3, 40)
    a = cuda_torch.select_slots(scores, positions, 4, 8)
    b = cuda_torch.select_slots_by_sort(scores, positions, 4, 8)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


# ---------------------------------------------------------------- negative controls

def test_exact_check_fails_on_the_other_tie_rule():
    """Ties broken toward the higher position: the same scores, another (valid-looking) order."""
    scores, positions = draw_scores(1, 2, 64, "few_values"), draw_positions(1, 2, 64)
    expected = reference_selection(scores, positions, 4, 16)
    other = reference_selection(scores, positions, 4, 16, ties_to_lower=False)
    with pytest.raises(AssertionError, match="selection differs"):
        assert_same_selection(other, expected)


def test_poison_check_fails_on_an_unwritten_window():
    scores, positions = draw_scores(2, 2, 64, "normal"), draw_positions(2, 2, 64)
    expected = reference_selection(scores, positions, 8, 16)
    sel, ok = run_poisoned(scores, positions, 8, 16, expected_ok=expected[1])
    sel[:, :8] = POISON_POS  # as if the kernel skipped the window part
    ok[:, :8] = ~expected[1][:, :8]
    with pytest.raises(AssertionError, match="unwritten positions"):
        assert_same_selection((sel, ok), expected)


def test_tie_aware_check_fails_on_a_lower_score_chosen():
    scores, positions = draw_scores(3, 1, 64, "normal"), torch.tensor([63])
    sel, ok = reference_selection(scores, positions, 4, 8)
    worst = int(torch.argmin(torch.where(torch.arange(64) <= 59, scores[0], torch.tensor(float("inf")))))
    sel[0, -1] = worst  # the lowest candidate instead of the 8th best
    with pytest.raises(AssertionError, match="wrong top-k"):
        assert_tie_aware(sel, ok, scores, positions, 4, 8)


def test_invariance_check_fails_when_rows_depend_on_the_batch():
    scores, positions = draw_scores(4, 4, 64, "normal"), draw_positions(4, 4, 64)

    def batch_dependent(n):  # top-k width chosen by the batch: a row's result depends on its batch
        return reference_selection(scores[:n], positions[:n], 4, 4 + n)
    with pytest.raises(AssertionError, match="row results changed"):
        assert_prefix_invariant(batch_dependent(4), batch_dependent, 4)


# ---------------------------------------------------------------- GPU: full-size rows, graphs, streams

def _logits_like(seed: int, rows: int, width: int, style: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if style == "indexer":  # sums of relu'd products: positive, concentrated (what the indexer emits)
        x = torch.relu(torch.randn(rows, width, 8, generator=gen)).sum(-1)
    elif style == "zeros":
        x = torch.zeros(rows, width)
    else:
        x = draw_scores(seed, rows, width, style)
        # CUB's radix sort (torch.sort on CUDA) may order -0.0 and +0.0 by their bits: against it, no zeros
        # (test_gpu_kernel_matches_the_readable_reference covers them).
        x = torch.where(x == 0, torch.full_like(x, 1e-3), x)
    return x.cuda()


@gpu
@pytest.mark.parametrize("style", ["indexer", "normal", "few_values", "zeros", "last_bits", "specials"])
@pytest.mark.parametrize("group, segment", [(None, None), (16, 1024), (128, None), (64, 128)])
def test_full_rows_match_torch_cuda_stable_sort(style, group, segment):
    rows, width, window, k = 64, 65536, 128, 512
    scores = _logits_like(7, rows, width, style)
    positions = torch.randint(0, width, (rows,), generator=torch.Generator().manual_seed(8)).cuda()
    positions[:8] = width - 1
    positions[8] = 100  # fewer candidates than k
    expected = tuple(t.cpu() for t in cuda_torch.select_slots_by_sort(scores, positions, window, k))
    actual = run_poisoned(scores, positions, window, k, group, expected_ok=expected[1], segment=segment)
    assert_same_selection(actual, expected, msg=f"({style}, group={group}, segment={segment})")
    assert_prefix_invariant(actual, lambda n: run_poisoned(scores[:n], positions[:n], window, k, group,
                                                           segment=segment), rows)


@gpu
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("group", [None, 16])
def test_gpu_kernel_matches_the_readable_reference(style, group):
    """The compiled kernel (tl.sort order, the GPU's -0.0 and NaN handling) against the Python
    definition, NaNs of every sign and payload included."""
    scores, positions = draw_scores(5, 4, 2048, style), draw_positions(5, 4, 2048)
    positions[1] = 40  # fewer candidates than k
    expected = reference_selection(scores, positions, 128, 64)
    actual = run_poisoned(scores, positions, 128, 64, group, expected_ok=expected[1])
    assert_same_selection(actual, expected, msg=f"({style}, group={group})")
    dispatched = cuda_torch.select_slots(scores.cuda(), positions.cuda(), 128, 64)  # what decode_model calls
    assert_same_selection(tuple(t.cpu() for t in dispatched), expected, msg="(cuda_torch.select_slots)")


@gpu
def test_selection_under_graph_replay_and_side_stream():
    rows, width, window, k = 16, 8192, 128, 512
    scores = _logits_like(1, rows, width, "indexer")
    positions = torch.full((rows,), width - 1, dtype=torch.int64, device="cuda")
    run = lambda: topk.select_slots(scores, positions, window, k)  # noqa: E731
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    scores.copy_(_logits_like(2, rows, width, "few_values"))  # new inputs, same addresses
    positions.copy_(torch.randint(0, width, (rows,), generator=torch.Generator().manual_seed(3)).cuda())
    graph.replay()
    eager = run()
    side_stream = torch.cuda.Stream()
    side_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side_stream):
        side = run()
    torch.cuda.current_stream().wait_stream(side_stream)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(captured, eager)), "graph replay differs from eager"
    assert all(torch.equal(a, b) for a, b in zip(side, eager)), "side stream differs from eager"
    assert_same_selection(tuple(t.cpu() for t in eager),
                          tuple(t.cpu() for t in cuda_torch.select_slots_by_sort(scores, positions, window, k)))


def assert_options_keep_the_selection(seed: int, short_row: int, reference: dict, options: list[dict]) -> None:
    """select_slots with each of `options` (keyword arguments) gives its output with `reference`'s, at B=64,
    64K positions, top-512, on indexer-like and tied rows, one row `short_row` positions long."""
    rows, width, window, k = 64, 65536, 128, 512
    for style in ("indexer", "few_values"):
        scores = _logits_like(seed, rows, width, style)
        positions = torch.full((rows,), width - 1, dtype=torch.int64, device="cuda")
        positions[seed % rows] = short_row
        want = topk.select_slots(scores, positions, window, k, **reference)
        for kwargs in options:
            got = topk.select_slots(scores, positions, window, k, **kwargs)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), f"{kwargs} changed the selection ({style})"


@gpu
def test_register_caps_keep_the_selection():
    """topk.REGISTER_CAPS (each launch's maxnreg) moves values between registers and the stack only: every
    launch capped low (spills included) gives the uncapped launches' output, tied rows too."""
    tight = {"maxima": 32, "bound": 32, "candidates": 48, "finish": 48}
    assert_options_keep_the_selection(12, 300, dict(register_caps=dict.fromkeys(topk.REGISTER_CAPS)),
                                      [dict(register_caps=tight), dict(register_caps={"candidates": 64})])


@gpu
def test_row_pass_launches_keep_the_selection():
    """topk.ROW_PASS_LAUNCHES (each pass over the row's warps and pipelining) give the same maxima, stretches
    and counts: every launch bench.kernels times gives the 8-warp launches' output, tied rows and a short row
    too."""
    both = ("maxima", "candidates")
    launches = ({"warps": 4, "stages": 3}, {"warps": 2, "stages": 1}, {"warps": 4, "stages": None})
    reference = dict(row_pass_launches=dict.fromkeys(both, {"warps": 8, "stages": None}))
    assert_options_keep_the_selection(13, 700, reference,
                                      [dict(row_pass_launches=dict.fromkeys(both, launch)) for launch in launches])


@gpu
def test_dispatch_falls_back_to_the_sort_with_a_warning(monkeypatch):
    """A Triton build that cannot compile the kernel must cost speed, not the decode step."""
    from triton.runtime.errors import PTXASError

    def broken(*args, **kwargs):
        raise PTXASError("planted compile failure")
    monkeypatch.setattr(topk, "select_slots", broken)
    monkeypatch.setattr(cuda_torch, "_TRITON_SELECT_FAILED", [])
    scores, positions = draw_scores(2, 3, 512, "few_values").cuda(), draw_positions(2, 3, 512).cuda()
    with pytest.warns(RuntimeWarning, match="planted compile failure"):
        got = cuda_torch.select_slots(scores, positions, 8, 16)
    assert all(torch.equal(a, b) for a, b in zip(got, cuda_torch.select_slots_by_sort(scores, positions, 8, 16)))


@gpu
def test_dispatch_does_not_hide_a_failure_that_is_no_compile_error(monkeypatch):
    """Negative control of the fallback: a fault of the kernel's call (not of its build) surfaces."""
    def broken(*args, **kwargs):
        raise RuntimeError("planted launch failure")
    monkeypatch.setattr(topk, "select_slots", broken)
    monkeypatch.setattr(cuda_torch, "_TRITON_SELECT_FAILED", [])
    scores, positions = draw_scores(2, 3, 512, "few_values").cuda(), draw_positions(2, 3, 512).cuda()
    with pytest.raises(RuntimeError, match="planted launch failure"):
        cuda_torch.select_slots(scores, positions, 8, 16)
    assert not cuda_torch._TRITON_SELECT_FAILED, "the kernel must stay in use"


# ---------------------------------------------------------------- the compiler, without a GPU

# Compiles a @triton.jit function of a module for an H200 (sm_90) in a fresh process without the
# interpreter: the interpreter accepts code the compiler refuses (a constexpr reassigned in a
# static_range did pass here and fail there). Needs only Triton's bundled ptxas, no device.
_COMPILE = """
import importlib, os, sys
os.environ["TRITON_INTERPRET"] = "0"
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
module, name, signature, constants = sys.argv[1], sys.argv[2], eval(sys.argv[3]), eval(sys.argv[4])
num_warps, num_stages, options = int(sys.argv[5]), int(sys.argv[6]), eval(sys.argv[7])
fn = getattr(importlib.import_module(module), name)
# A launch specializes pointers to 16-byte alignment (torch's allocations are), and each integer argument
# that is a multiple of 16 (unless the kernel says do_not_specialize) to that divisibility: the code differs
# (vector loads appear only with alignment known; a loop whose mask runs along its vectors is pipelined
# only when its bound is known divisible: the MoE gate/up loop took 16 KB of shared memory without, 60 KB
# with). So this compiles both: integers of any value, and the deployment's, every one a multiple of 16.
free = {p.name for p in getattr(fn, "params", []) if p.do_not_specialize}
params = [(i, n, kind) for i, (n, kind) in enumerate(signature.items())]
signature.update({key: "constexpr" for key in constants})
for ints in (False, True):
    aligned = {(i,): [["tt.divisibility", 16]] for i, n, kind in params
               if kind.startswith("*") or (ints and kind in ("i32", "i64") and n not in free)}
    kernel = triton.compile(ASTSource(fn=fn, signature=dict(signature), constexprs=constants, attrs=aligned),
                            target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=num_warps, num_stages=num_stages, **options))
print("compiled")
# The grid-dependency instructions in the code (programmatic dependent launch: attention.PDL_MERGE).
import re
print("griddepcontrol:", sorted(set(re.findall(r"griddepcontrol\\.\\w+", kernel.asm["ptx"]))))
"""
_KERNELS = {  # name: (signature, constexprs beyond the shared ones)
    "_maxima_kernel": ({"scores_ptr": "*fp32", "pos_ptr": "*i64", "maxima_ptr": "*i64", "width": "i32",
                        "stride_s": "i32", "stride_maxima": "i32"}, ("GROUP", "SEGMENT")),
    "_bound_kernel": ({"maxima_ptr": "*i64", "pos_ptr": "*i64", "bound_ptr": "*i64", "n_groups": "i32",
                       "stride_maxima": "i32"}, ("SMALL_BLOCK", "RESIDENT")),
    "_candidates_kernel": ({"scores_ptr": "*fp32", "pos_ptr": "*i64", "bound_ptr": "*i64", "scratch_ptr": "*i64",
                            "counts_ptr": "*i32", "width": "i32", "stride_s": "i32", "stride_scratch": "i32",
                            "stride_counts": "i32"}, ("SEGMENT",)),
    "_finish_kernel": ({"scores_ptr": "*fp32", "pos_ptr": "*i64", "bound_ptr": "*i64", "counts_ptr": "*i32",
                        "scratch_ptr": "*i64", "out_ptr": "*i64", "ok_ptr": "*i1", "n_segments": "i32",
                        "stride_s": "i32", "stride_counts": "i32", "stride_scratch": "i32", "stride_out": "i32",
                        "stride_ok": "i32"}, ("WINDOW_P2", "TOPK_P2", "SEGMENT", "SEGMENTS_P2", "GATHER", "SMALL_BLOCK",
                                               "RANK_ORDER", "SORT_CAP")),
}


def compile_for_sm90(module: str, name: str, signature: dict, constants: dict, *, num_warps: int, num_stages: int = 3,
                     **options):
    """Compile one kernel for sm_90 in a subprocess at the warps and stages its launch uses: a layout, a
    shared-memory budget or an MMA shape can be fine at one warp count and refused at another. options:
    the launch's other compile options (e.g. enable_fp_fusion=False)."""
    import subprocess
    import sys
    from pathlib import Path

    try:
        from triton.backends.nvidia import compiler  # noqa: F401
    except ImportError:
        pytest.skip("this Triton has no NVIDIA backend")
    root = Path(__file__).resolve().parents[2]
    return subprocess.run([sys.executable, "-c", _COMPILE, module, name, repr(signature), repr(constants),
                           str(num_warps), str(num_stages), repr(options)],
                          capture_output=True, text=True, timeout=300, cwd=root,
                          env={**__import__("os").environ, "PYTHONPATH": str(root)})


@pytest.mark.skipif(ON_GPU, reason="on a GPU every test above compiles it for real")
@pytest.mark.parametrize("kernel", sorted(_KERNELS))
@pytest.mark.parametrize("window, k, group, rank_order, sorts", [(128, 512, 64, False, 1024), (0, 1, 1, True, 0)])
def test_kernel_compiles_for_the_gpu_without_one(kernel, window, k, group, rank_order, sorts):
    """sorts: SORT_CAP (0: the radix select). At the deployed launch of a 64K row: topk.SEGMENT positions a
    program of the passes over the row, in their ROW_PASS_LAUNCHES warps, the finish's gather for its segments."""
    segments = 65536 // topk.SEGMENT
    every = dict(WINDOW=window, WINDOW_P2=max(1, 1 << (window - 1).bit_length()), TOPK=k,
                 TOPK_P2=max(2, 1 << (k - 1).bit_length()), GROUP=group, SEGMENT=topk.SEGMENT,
                 SEGMENTS_P2=segments, GATHER=max(16, min(1024, topk.GATHER_CELLS // segments)), SMALL_BLOCK=1024,
                 RANK_ORDER=rank_order, SORT_CAP=sorts, RESIDENT=topk.RESIDENT_BOUND and sorts > 0)
    signature, own = _KERNELS[kernel]
    constants = {name: every[name] for name in ("WINDOW", "TOPK", *own)}
    warps = {"_maxima_kernel": topk.ROW_PASS_LAUNCHES["maxima"]["warps"],
             "_candidates_kernel": topk.ROW_PASS_LAUNCHES["candidates"]["warps"]}.get(kernel, 8)
    done = compile_for_sm90("runtime.kernels.triton.topk", kernel, dict(signature), constants, num_warps=warps)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


@pytest.mark.skipif(ON_GPU, reason="on a GPU test_register_caps_keep_the_selection compiles it for real")
def test_the_candidates_pass_compiles_under_a_register_cap():
    """The 64-register cap bench.kernels times for the candidates pass (topk.REGISTER_CAPS)."""
    signature, _ = _KERNELS["_candidates_kernel"]
    done = compile_for_sm90("runtime.kernels.triton.topk", "_candidates_kernel", dict(signature),
                            dict(WINDOW=128, TOPK=512, SEGMENT=topk.SEGMENT), num_warps=8, maxnreg=64)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


@pytest.mark.skipif(ON_GPU, reason="on a GPU test_row_pass_launches_keep_the_selection compiles them for real")
@pytest.mark.parametrize("kernel", ["_maxima_kernel", "_candidates_kernel"])
@pytest.mark.parametrize("warps, stages", [(4, 3), (2, 1), (8, 2)])
def test_the_row_passes_compile_at_every_timed_launch(kernel, warps, stages):
    """The launches bench.kernels times (topk.ROW_PASS_LAUNCHES' warps and stages) at the deployed segment."""
    signature, _ = _KERNELS[kernel]
    group = {"GROUP": 64} if kernel == "_maxima_kernel" else {}
    constants = dict(WINDOW=128, TOPK=512, SEGMENT=topk.SEGMENT, **group)
    done = compile_for_sm90("runtime.kernels.triton.topk", kernel, dict(signature), constants,
                            num_warps=warps, num_stages=stages)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


@pytest.mark.skipif(ON_GPU, reason="on a GPU test_selection_matches_reference_exactly compiles it for real")
@pytest.mark.parametrize("resident", [False, True])
def test_the_bound_kernel_compiles_for_a_row_of_one_group(resident):
    """Triton passes an integer argument equal to 1 as a constexpr: a one-position row gives the bound
    kernel n_groups == 1 (the interpreter never specializes, so only the H200 saw this fail)."""
    signature, _ = _KERNELS["_bound_kernel"]
    done = compile_for_sm90("runtime.kernels.triton.topk", "_bound_kernel", dict(signature),
                            dict(WINDOW=0, TOPK=1, SMALL_BLOCK=1024, RESIDENT=resident, n_groups=1), num_warps=8)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


def test_compile_check_fails_on_code_only_the_interpreter_accepts():
    """Negative control: the constexpr reassignment the interpreter let through must fail here."""
    done = compile_for_sm90("tests.kernels.planted_compile_error", "reassigns_a_constexpr", {"out_ptr": "*i32"}, {},
                            num_warps=4)
    assert done.returncode != 0 and "constexpr cannot be reassigned" in done.stderr


_INDEXER_SIGNATURE = {"q_ptr": "*fp8e4nv", "w_ptr": "*fp32", "key_ptr": "*fp8e4nv", "key_scale_ptr": "*fp32",
                      "table_ptr": "*i32", "lens_ptr": "*i32", "out_ptr": "*fp32", "pos_ptr": "*i64",
                      "maxima_ptr": "*i64", "heads": "i32", "dim": "i32", "page_size": "i32", "width": "i32",
                      "stride_qt": "i32", "stride_qh": "i32", "stride_w": "i32", "stride_key": "i32",
                      "stride_table": "i32", "stride_out": "i32", "stride_maxima": "i32"}


def _compile_indexer_fp8(block_d: int, maxima: bool = False, unmasked: bool | None = None,
                         prefetch: bool | None = None):
    """The deployment's launch (B=64, 64K: 8 blocks of 128 a program; the selection's top-512 after a
    128-position window in groups of 64 when `maxima`). unmasked: UNMASKED_FULL (the deployed switch's
    value for fp8 keys by default)."""
    constants = dict(KEY_SCALE=True, PRECISION="tf32", BLOCKS=8, BLOCK_H=64, BLOCK_D=block_d, BLOCK_L=128,
                     EARLY_SCALE=True, MAXIMA=maxima, WINDOW=128 if maxima else 0, TOPK=512 if maxima else 0,
                     GROUP=64 if maxima else 1,
                     UNMASKED_FULL=indexer_kernels.UNMASKED_FULL_BLOCKS[True] if unmasked is None else unmasked,
                     PREFETCH_SCALE=indexer_kernels.PREFETCH_SCALE if prefetch is None else prefetch)
    cap = indexer_kernels.REGISTER_CAP[maxima]  # the launch's register cap, as the launch passes it
    return compile_for_sm90("runtime.kernels.triton.indexer", "_indexer_kernel", dict(_INDEXER_SIGNATURE), constants,
                            num_warps=4, num_stages=3, **({"maxnreg": cap} if cap else {}))


@pytest.mark.skipif(ON_GPU, reason="on a GPU the indexer tests compile it for real")
def test_the_indexer_compiles_fp8_keys_narrower_than_the_mma():
    """fp8 keys of 16 lanes (the kernel tests' width): `key_block` pads K to the fp8 MMA's 32. The H100 run of
    the twenty-fifth session failed to compile the kernel at K 16; the interpreter never checks it."""
    block_d = indexer_kernels.key_block(16, torch.float8_e4m3fn)
    assert block_d == 32 and indexer_kernels.key_block(16, torch.bfloat16) == 16
    done = _compile_indexer_fp8(block_d)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


@pytest.mark.skipif(ON_GPU, reason="on a GPU the indexer tests compile it for real")
def test_the_indexer_fp8_compile_check_fails_at_k_16():
    """Negative control of the test above: K 16 with fp8 operands is refused by the sm_90 compile."""
    done = _compile_indexer_fp8(16)
    assert done.returncode != 0 and "K >= 32" in done.stderr


@pytest.mark.skipif(ON_GPU, reason="on a GPU the indexer tests compile it for real")
@pytest.mark.parametrize("maxima", [False, True])
def test_the_indexer_with_unmasked_full_blocks_compiles_for_the_gpu(maxima):
    """indexer.UNMASKED_FULL_BLOCKS both ways through sm_90's compiler (its masked tail block is
    straight-line code after the pipelined loop): the other way here, the deployed one in the tests above."""
    done = _compile_indexer_fp8(128, maxima=maxima, unmasked=not indexer_kernels.UNMASKED_FULL_BLOCKS[True])
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


@pytest.mark.skipif(ON_GPU, reason="on a GPU the indexer tests compile it for real")
@pytest.mark.parametrize("maxima", [False, True])
def test_the_indexer_prefetching_key_scales_compiles_for_the_gpu(maxima):
    """indexer.PREFETCH_SCALE the other way (a loop-carried block of key scales) through sm_90's compiler."""
    done = _compile_indexer_fp8(128, maxima=maxima, unmasked=True, prefetch=not indexer_kernels.PREFETCH_SCALE)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


@pytest.mark.skipif(ON_GPU, reason="on a GPU the fused-maxima tests compile it for real")
def test_the_indexer_with_the_selections_group_maxima_compiles_for_the_gpu():
    """The logits kernel writing the selection's group maxima (indexer.GroupMaxima) at the deployment's
    128-lane fp8 keys, through sm_90's compiler: the group max reshapes a block the MMA laid out."""
    done = _compile_indexer_fp8(128, maxima=True)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


def test_a_row_pass_launch_refuses_a_knob_it_does_not_have():
    """The walk in chunks was removed (thirty-first session): a sweep still asking for it must fail, not run the
    whole segment under a name that says otherwise."""
    with pytest.raises(ValueError, match=r"candidates pass: unknown launch knobs \['chunk'\]"):
        topk.row_pass_launch("candidates", {"chunk": 512, "warps": 4})
    assert topk.row_pass_launch("maxima", {"stages": 1}) == {
        "num_warps": topk.ROW_PASS_LAUNCHES["maxima"]["warps"], "num_stages": 1}
