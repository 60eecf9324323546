"""CPU-checkable parts of the CUDA-graph decode path (run in CI): bucket choice and padding, the
capturable decode model's numerics against the float64 reference, its batch invariance and
padding isolation, and its stream program under the adversarial emulator and the static checker."""

from __future__ import annotations

import pytest
import torch

from canary.oracles.tolerances import assert_close_to_reference
from runtime.faults import FaultSet
from runtime.graph.decode_model import DecodeInputs, StaticDecodeModel
from runtime.graph.runner import COARSE_BUCKETS, FINE_BUCKETS, can_use_cuda_graph, pad_batch, pad_inputs
from runtime.kernels import cpu, reference
from runtime.kvcache.kv_cache import KVCache
from runtime.models.batch import ForwardBatch, Segment
from runtime.models.dsv4_mini import DSV4Mini
from runtime.streams.checker import check_program, find_hazards
from runtime.streams.emulator import AdversarialExecutor
from runtime.streams.tasks import InOrderExecutor
from tests.utils import SLOTS_PER_REQUEST, ExtendCase

pytestmark = pytest.mark.kernels
PAGE = 16
PAGES_PER_REQUEST = SLOTS_PER_REQUEST // PAGE


def test_pad_batch_picks_the_smallest_bucket_that_fits():
    assert [pad_batch(n, (16, 32, 64)) for n in (1, 16, 17, 32, 33, 64)] == [16, 16, 32, 32, 64, 64]
    assert can_use_cuda_graph(128, FINE_BUCKETS) and not can_use_cuda_graph(129, FINE_BUCKETS)
    assert not can_use_cuda_graph(0, COARSE_BUCKETS)
    with pytest.raises(ValueError):
        pad_batch(129, COARSE_BUCKETS)


def test_buckets_come_from_the_env_knob_or_the_fine_default():
    from runtime.env import Env
    from runtime.graph.runner import GraphRunner

    class Model:  # the runner only needs these attributes before capture
        max_pages, device = 2, "cpu"

    def buckets(env):
        return GraphRunner(Model(), None, InOrderExecutor(), scratch_page=0, env=env).buckets

    assert buckets(Env.load({"DSV4_GRAPH_BUCKETS": "64,16, 32"})) == (16, 32, 64)
    assert buckets(Env()) == FINE_BUCKETS
    with pytest.raises(ValueError):
        buckets(Env.load({"DSV4_GRAPH_BUCKETS": "0,16"}))


def decode_case(tiny, seed: int):
    """ExtendCase's requests, cached up to their last token, which each then decodes."""
    case = ExtendCase(tiny, seed)
    spans = [(p + n - 1, p + n) for p, n in zip(case.prefix, case.new)]
    gap = _extend_batch(case, [(p, s) for p, (s, _) in zip(case.prefix, spans)])
    if gap is not None:
        DSV4Mini(tiny.config, tiny.weights, cpu).forward(gap, case.kv, InOrderExecutor())
    n = len(spans)
    inputs = DecodeInputs(
        token_ids=torch.tensor([case.ids[i][s] for i, (s, _) in enumerate(spans)]),
        positions=torch.tensor([s for s, _ in spans]),
        write_slots=torch.tensor([i * SLOTS_PER_REQUEST + s for i, (s, _) in enumerate(spans)]),
        page_table=torch.arange(n)[:, None] * PAGES_PER_REQUEST + torch.arange(PAGES_PER_REQUEST)[None, :])
    return case, spans, inputs


def fresh_kv(case) -> KVCache:
    kv = KVCache.__new__(KVCache)
    kv.latent, kv.index_keys = case.kv.latent.clone(), case.kv.index_keys.clone()
    return kv


def static_model(tiny, case, faults=()) -> StaticDecodeModel:
    return StaticDecodeModel(tiny.config, tiny.weights, page_size=PAGE, max_pages=PAGES_PER_REQUEST,
                             max_batch=64, faults=FaultSet(faults))


def run_static(tiny, case, inputs, streams=None, faults=(), rows=16, scratch=None):
    model = static_model(tiny, case, faults)
    padded = pad_inputs(inputs, rows, case.scratch_page if scratch is None else scratch, PAGE)
    return model.forward(padded, fresh_kv(case), streams or InOrderExecutor())[:inputs.batch_size]


@pytest.mark.parametrize("seed", range(2))
def test_static_decode_matches_the_float64_reference(tiny, seed):
    case, spans, inputs = decode_case(tiny, seed)
    ref_batch = ForwardBatch(inputs.token_ids, inputs.positions, inputs.write_slots, tuple(
        Segment(i, i + 1, i * SLOTS_PER_REQUEST + torch.arange(s + 1)) for i, (s, _) in enumerate(spans)))
    expected = DSV4Mini(tiny.config, tiny.weights, reference).forward(ref_batch, fresh_kv(case), InOrderExecutor())
    actual = run_static(tiny, case, inputs)
    assert max(s for s, _ in spans) >= tiny.config.selected_tokens, "the sparse path must run"
    assert_close_to_reference(actual, expected, torch.float32, scale=10, msg="static decode vs reference")


def _extend_batch(case, spans):
    """Tokens [prefix, decode position) of each request with a gap; zero-length spans skipped."""
    ids, pos, slots, segs, row = [], [], [], [], 0
    for i, (start, stop) in enumerate(spans):
        if stop <= start:
            continue
        base = i * SLOTS_PER_REQUEST
        ids.append(torch.tensor(case.ids[i][start:stop]))
        pos.append(torch.arange(start, stop))
        slots.append(base + torch.arange(start, stop))
        segs.append(Segment(row, row + stop - start, base + torch.arange(stop)))
        row += stop - start
    if not segs:
        return None
    return ForwardBatch(torch.cat(ids), torch.cat(pos), torch.cat(slots), tuple(segs))


def test_rows_do_not_depend_on_the_batch_or_its_padding(tiny):
    """Batch invariance by tiles: a request decoded in a padded tile of 16 and inside two tiles
    of 48 rows gives the same bits (what makes graph-at-bucket equal eager-at-size)."""
    case, _, inputs = decode_case(tiny, 1)
    small = run_static(tiny, case, inputs, rows=16)
    large = run_static(tiny, case, inputs, rows=48)
    assert torch.equal(small, large)


def test_padding_onto_a_live_page_is_caught(tiny):
    """Negative control for the oracle above: padded rows that write request 0's first page
    corrupt it, and the comparison sees it."""
    case, _, inputs = decode_case(tiny, 1)
    clean = run_static(tiny, case, inputs, rows=16)
    leaky = run_static(tiny, case, inputs, rows=16, scratch=0)
    assert not torch.equal(clean[0], leaky[0])


@pytest.mark.parametrize("mode", ["late", "random"])
def test_static_decode_is_order_independent_and_race_is_exposed(tiny, mode):
    case, _, inputs = decode_case(tiny, 0)
    expected = run_static(tiny, case, inputs)
    assert torch.equal(run_static(tiny, case, inputs, AdversarialExecutor(seed=5, mode=mode)), expected)
    raced = run_static(tiny, case, inputs, AdversarialExecutor(seed=5, mode="late"), faults=("stream-race",))
    assert not torch.equal(raced, expected), "stream-race in the capturable path must be exposed"


def test_static_decode_program_passes_the_checker_and_the_race_does_not(tiny):
    case, _, inputs = decode_case(tiny, 0)
    streams = InOrderExecutor(record_program=True)
    run_static(tiny, case, inputs, streams)
    check_program(streams.program)
    raced = InOrderExecutor(record_program=True)
    run_static(tiny, case, inputs, raced, faults=("stream-race",))
    assert {h.buffer for h in find_hazards(raced.program) if h.kind == "read-after-write"} == {"selection"}


def test_the_model_owns_its_weights_and_keeps_one_copy(tiny):
    """Repacked weights (stacked projections, kernel-layout experts) replace the caller's entries
    by views into the packed copies: a dict the caller keeps pins no second copy, and every value
    is unchanged."""
    weights = {name: t.clone() for name, t in tiny.weights.items()}
    before = {name: t.clone() for name, t in weights.items()}
    model = StaticDecodeModel(tiny.config, weights, page_size=PAGE, max_pages=PAGES_PER_REQUEST, max_batch=16,
                              moe_kernel="triton")
    packed = [*model.attn_proj, *model.indexer_proj]
    for p in model.packed_moe:
        packed += [p.w13, p.w2] + ([p.shared_w13, p.shared_w2] if p.shared_w13 is not None else [])
    owners = {t.untyped_storage().data_ptr() for t in packed}
    repacked = [name for name in weights if name.endswith(("attn.wq.weight", "attn.wkv.weight", "indexer.wq.weight",
                                                           "indexer.wk.weight", "indexer.weights_proj.weight"))
                or ".moe.experts." in name or ".moe.shared." in name]
    assert len(repacked) == tiny.config.num_layers * (5 + 3 + 3 * (tiny.config.n_shared_experts > 0))
    stray = [name for name in repacked if weights[name].untyped_storage().data_ptr() not in owners]
    assert not stray, f"entries still holding their own copy: {stray}"
    changed = [name for name in weights if not torch.equal(weights[name], before[name])]
    assert not changed, f"values changed by the handover: {changed}"
    assert model.w is weights
