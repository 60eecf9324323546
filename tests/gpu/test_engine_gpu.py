"""The engine on the GPU (runtime/engine/static_runner.py), end to end through `Engine.step()`:
batched == solo, graphs + multi-stream == eager single-stream, overlap == normal (all bit for
bit, tokens and logprobs), GPU == CPU within recorded near-ties, and the jitter injector leaves the
fixed runtime unchanged but exposes `stream-race`. Run by scripts/gpu_suite.sh."""

from __future__ import annotations

import random

import pytest

from canary.faults.engine_gates import Arrival, at_once, drive
from canary.oracles.logprob_close import Generation, check_logprobs_close
from runtime.config import EngineConfig, default_model
from runtime.engine.engine import Engine
from runtime.engine.request import SamplingParams
from runtime.env import Env
from runtime.faults import FaultSet
from runtime.graph.runner import FINE_BUCKETS, STEP_BUCKETS
from runtime.models.loader import load_model

pytestmark = [pytest.mark.gpu]
JITTER = 2_000_000  # cycles, ~1 ms: longer than the main-stream work between fork and attention


@pytest.fixture(scope="module")
def loaded():
    return load_model(default_model())


def workload(loaded, n: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Mixed prompt lengths (a few tokens to several hundred: short and long contexts around the
    indexer's window + top-k), greedy and seeded-sampled requests, top logprobs recorded."""
    rng = random.Random(seed)
    vocab = loaded.tokenizer.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.choice([rng.randint(2, 40), rng.randint(100, 600)]))]
               for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randint(8, 40), ignore_eos=True, logprobs=True, top_logprobs=5,
                             temperature=0.0 if i % 4 else 0.8, seed=i) for i in range(n)]
    return prompts, params


def engine(loaded, *, dtype="bfloat16", faults=(), env=None, overlap=False, **cfg) -> Engine:
    cfg = {"num_pages": 4096, "max_running_requests": 64, **cfg}
    ecfg = EngineConfig(device="cuda", dtype=dtype, **cfg)
    return Engine(loaded, ecfg, FaultSet(faults), env or Env(), overlap=overlap)


def generations(eng: Engine, prompts, params) -> list[Generation]:
    reqs = drive(eng, at_once(prompts, params), rid_prefix=None).requests  # fresh ids: engines are reused
    assert eng.pages_in_use == 0, "KV pages leaked"
    return [Generation(r.output_ids, r.output_logprobs, r.output_top_logprobs) for r in reqs]


def first_difference(a: list[Generation], b: list[Generation]) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            pos = next((p for p, (s, t) in enumerate(zip(x.tokens, y.tokens)) if s != t), None)
            return f"request {i} differs (first token mismatch at {pos})"
    return "no difference"


def test_batched_equals_solo_bit_for_bit(loaded):
    prompts, params = workload(loaded, 24, seed=1)
    eng = engine(loaded)
    batched = generations(eng, prompts, params)
    solo = [generations(eng, [p], [sp])[0] for p, sp in zip(prompts, params)]
    assert eng.runner.graphs.replays > 0, "decode steps did not replay graphs"
    assert batched == solo, first_difference(batched, solo)


def test_graphs_and_side_stream_change_no_bit(loaded):
    prompts, params = workload(loaded, 40, seed=2)
    fast = engine(loaded)
    plain = engine(loaded, cuda_graphs=False, multi_stream=False)
    out_fast, out_plain = generations(fast, prompts, params), generations(plain, prompts, params)
    assert fast.runner.graphs.replays > 0 and plain.runner.graphs.replays == 0
    assert out_fast == out_plain, first_difference(out_fast, out_plain)


def test_overlap_equals_normal_with_aborts(loaded):
    prompts, params = workload(loaded, 32, seed=3)
    for i in (5, 9, 14):  # long enough to still be running when aborted
        params[i] = SamplingParams(max_tokens=80, ignore_eos=True, logprobs=True)
    # The same aborts at the same loop iterations in both loops: request i after i steps.
    arrivals = [Arrival(0, p, sp, abort_at=i if i in (5, 9, 14) else None)
                for i, (p, sp) in enumerate(zip(prompts, params))]
    results = {}
    for overlap in (False, True):
        eng = engine(loaded, overlap=overlap)
        reqs = drive(eng, arrivals, rid_prefix=None).requests
        assert [reqs[i].finish_reason for i in (5, 9, 14)] == ["abort"] * 3
        assert eng.pages_in_use == 0
        results[overlap] = [(r.output_ids, r.output_logprobs) for r in reqs if r.finish_reason != "abort"]
    assert results[True] == results[False]


def test_overlap_stale_token_is_caught_on_gpu(loaded):
    """Negative control for the comparison above."""
    prompts, params = workload(loaded, 8, seed=4)
    clean = generations(engine(loaded, overlap=True), prompts, params)
    stale = generations(engine(loaded, overlap=True, faults=("overlap-stale-token",)), prompts, params)
    assert clean != stale


def test_gpu_float32_matches_cpu_within_near_ties(loaded):
    prompts, params = workload(loaded, 16, seed=5)
    params = [SamplingParams(max_tokens=sp.max_tokens, ignore_eos=True, logprobs=True, top_logprobs=5) for sp in params]
    gpu = generations(engine(loaded, dtype="float32"), prompts, params)
    cpu = generations(Engine(loaded, EngineConfig(num_pages=4096), FaultSet(), Env()), prompts, params)
    ties = check_logprobs_close(cpu, gpu, margin=0.05, logprob_atol=1e-3)
    assert len(ties) <= 2, ties


def test_jitter_leaves_the_fixed_runtime_unchanged(loaded):
    prompts, params = workload(loaded, 40, seed=6)
    calm = generations(engine(loaded), prompts, params)
    jittered = generations(engine(loaded, env=Env(stream_jitter_cycles=JITTER)), prompts, params)
    assert calm == jittered, first_difference(calm, jittered)


def test_jitter_exposes_stream_race(loaded):
    """Negative control: the same workload with the indexer's join dropped."""
    prompts, params = workload(loaded, 40, seed=6)
    calm = generations(engine(loaded), prompts, params)
    raced = generations(engine(loaded, faults=("stream-race",), env=Env(stream_jitter_cycles=JITTER)),
                        prompts, params)
    assert calm != raced, "jitter failed to expose the missing join"


def test_eager_fallback_above_the_largest_bucket_equals_graph_replay(loaded):
    """With decode-sized buckets (up to 128 rows), 130 running requests decode in eager passes; capped at
    64, with the default step buckets (prompt rows ride in the graphs too), they replay graphs."""
    prompts, params = workload(loaded, 130, seed=7)
    wide = engine(loaded, max_running_requests=130, env=Env(graph_buckets=FINE_BUCKETS))
    narrow = engine(loaded, max_running_requests=64)
    out_wide, out_narrow = generations(wide, prompts, params), generations(narrow, prompts, params)
    assert narrow.runner.graphs.replays > 0
    assert out_wide == out_narrow, first_difference(out_wide, out_narrow)


def busiest_step(loaded) -> list[Arrival]:
    """63 requests decoding when a prompt of nearly the whole prefill budget arrives: the largest step
    the scheduler plans (4,090 prompt rows + 63 decode rows), as in the gate when fresh turns come."""
    rng = random.Random(11)
    vocab = loaded.tokenizer.vocab_size
    decoding = [Arrival(0, [rng.randrange(3, vocab) for _ in range(rng.randint(20, 300))],
                        SamplingParams(max_tokens=24, ignore_eos=True)) for _ in range(63)]
    budget = EngineConfig().max_prefill_tokens
    return decoding + [Arrival(4, [rng.randrange(3, vocab) for _ in range(budget - 6)],
                               SamplingParams(max_tokens=6, ignore_eos=True))]


def test_the_busiest_step_replays_a_graph_and_compiles_nothing(loaded):
    """Serving never leaves the graphs captured at start-up: no eager pass and no Triton compile while
    the busiest step runs. Control: buckets that stop at the prefill budget (the old STEP_BUCKETS)
    send that step to eager passes."""
    import triton

    eng = engine(loaded, dtype="float32")
    compiled: list[str] = []
    triton.knobs.runtime.jit_post_compile_hook = lambda *args, **kwargs: compiled.append(str(kwargs.get("fn")))
    try:
        drive(eng, busiest_step(loaded), rid_prefix=None)
    finally:
        triton.knobs.runtime.jit_post_compile_hook = None
    assert eng.pages_in_use == 0
    assert eng.runner.eager_passes == 0, f"{eng.runner.eager_passes} eager passes"
    assert not compiled, f"Triton compiled on the serving path: {compiled}"
    old = engine(loaded, dtype="float32", env=Env(graph_buckets=STEP_BUCKETS))
    drive(old, busiest_step(loaded), rid_prefix=None)
    assert old.runner.eager_passes > 0, "the control: the busiest step should not fit the old buckets"


@pytest.mark.parametrize("kernel", ["moe_kernel", "attention_kernel"])
def test_torch_reference_kernels_in_the_engine(loaded, kernel):
    """The GPU runner with one torch reference path (moe: gathered-expert ops; attention: gather + bmm)
    in place of its Triton default, captured in the decode graphs: batched == solo bit for bit in bf16
    (its shape-dependent library calls run on fixed row groups); in float32 the Triton default's
    tokens within recorded near-ties."""
    prompts, params = workload(loaded, 12, seed=8)
    eng = engine(loaded, **{kernel: "torch"})
    batched = generations(eng, prompts, params)
    solo = [generations(eng, [p], [sp])[0] for p, sp in zip(prompts, params)]
    assert eng.runner.graphs.replays > 0
    assert batched == solo, first_difference(batched, solo)
    greedy = [SamplingParams(max_tokens=sp.max_tokens, ignore_eos=True, logprobs=True, top_logprobs=5) for sp in params]
    torch_path = generations(engine(loaded, dtype="float32", **{kernel: "torch"}), prompts, greedy)
    triton_path = generations(engine(loaded, dtype="float32"), prompts, greedy)
    check_logprobs_close(torch_path, triton_path, margin=0.05, logprob_atol=1e-3)


def test_prompt_bits_do_not_depend_on_the_prefill_chunk(loaded):
    """Chunked prefill on the GPU: passes of 61 rows (boundaries inside prompts, several requests per
    pass) and of 4096 rows give the same tokens and logprobs, bit for bit."""
    prompts, params = workload(loaded, 16, seed=9)
    small = generations(engine(loaded, prefill_chunk=61), prompts, params)
    whole = generations(engine(loaded, prefill_chunk=4096), prompts, params)
    assert small == whole, first_difference(small, whole)


def test_the_gpu_default_is_the_triton_kernels():
    ecfg = EngineConfig(device="cuda")
    assert (ecfg.moe_kernel, ecfg.attention_kernel) == ("triton", "triton")
