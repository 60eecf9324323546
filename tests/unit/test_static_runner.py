"""The GPU engine's runner logic on CPU (EngineConfig(runner="static")): prefill as one row per
token through the capturable decode model, eager chunks, device-side sampling, the future-token
buffer. The GPU-only parts (graphs, side streams, jitter) are tests/gpu/test_engine_gpu.py."""

from __future__ import annotations

import random

import pytest
import torch

from canary.faults.engine_gates import at_once, drive
from canary.oracles.logprob_close import Generation, check_logprobs_close
from runtime.config import EngineConfig
from runtime.distributed.tp_engine import start_engine
from runtime.engine.request import SamplingParams
from runtime.env import Env
from runtime.faults import FaultSet

pytestmark = pytest.mark.unit


def workload(n: int, seed: int, long_prompt: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.choice([rng.randint(1, 12), rng.randint(30, 90)]))]
               for _ in range(n)]
    if long_prompt:
        prompts[0] = [rng.randrange(3, 256) for _ in range(long_prompt)]
    params = [SamplingParams(max_tokens=rng.randint(3, 10), ignore_eos=True, logprobs=True, top_logprobs=3,
                             temperature=0.0 if i % 3 else 0.7, seed=i) for i in range(n)]
    return prompts, params


def run(tiny, prompts, params, faults=(), overlap=False, tp=1, env=None, **cfg) -> list[Generation]:
    ecfg = EngineConfig(**{"num_pages": 1024, "max_model_len": 2048, **cfg})
    with start_engine(tiny, ecfg, FaultSet(faults), env or Env(), overlap=overlap, tp=tp) as eng:
        reqs = drive(eng, at_once(prompts, params), rid_prefix=None).requests
        assert eng.pages_in_use == 0
        if tp > 1:
            assert all(r["pages_in_use"] == 0 for r in eng.tp.rank_stats()), "a worker rank leaked pages"
    return [Generation(r.output_ids, r.output_logprobs, r.output_top_logprobs) for r in reqs]


def test_static_runner_batched_equals_solo_bit_for_bit(tiny):
    prompts, params = workload(10, seed=1)
    batched = run(tiny, prompts, params, runner="static")
    solo = [run(tiny, [p], [sp], runner="static")[0] for p, sp in zip(prompts, params)]
    assert batched == solo


def test_static_runner_agrees_with_the_eager_runner_within_near_ties(tiny):
    """Prefill as single-token rows in one pass per chunk must be causal: row p sees exactly
    positions 0..p. A long prompt spans three prefill chunks (512 rows each), so it reads its
    prefix from the paged cache across chunk boundaries."""
    prompts, params = workload(6, seed=2, long_prompt=1100)
    params = [SamplingParams(max_tokens=sp.max_tokens, ignore_eos=True, logprobs=True, top_logprobs=3) for sp in params]
    eager = run(tiny, prompts, params, runner="eager", max_prefill_tokens=2048)
    static = run(tiny, prompts, params, runner="static", max_prefill_tokens=2048, prefill_chunk=512)
    check_logprobs_close(eager, static, margin=1e-3, logprob_atol=1e-4)


def test_prompt_bits_do_not_depend_on_how_the_prompts_are_chunked(tiny):
    """Chunked prefill: the same prompts in passes of 37 rows (chunk boundaries inside prompts, many
    requests per pass) and of 4096 rows (every prompt in one pass) give the same bits."""
    prompts, params = workload(8, seed=8, long_prompt=150)
    small = run(tiny, prompts, params, runner="static", prefill_chunk=37)
    whole = run(tiny, prompts, params, runner="static", prefill_chunk=4096)
    assert small == whole


def test_chunking_oracle_fails_when_a_chunk_cannot_see_its_prefix(tiny, monkeypatch):
    """Negative control: a pass that writes its KV somewhere the next pass does not read (here: every
    chunk but the first attends with its page table pointed at the scratch page) changes outputs."""
    from runtime.engine import static_runner
    from runtime.graph.decode_model import DecodeInputs

    prompts, params = workload(4, seed=9, long_prompt=120)
    clean = run(tiny, prompts, params, runner="static", prefill_chunk=40)
    original = static_runner.GraphRunner.eager

    def forgetful(self, inp):
        if int(inp.positions.min()) > 0:  # a later chunk: lose the prefix written by earlier ones
            table = torch.full_like(inp.page_table, self.scratch_page)
            table[:, 0] = inp.page_table[:, 0]
            inp = DecodeInputs(inp.token_ids, inp.positions, inp.write_slots, table)
        return original(self, inp)
    monkeypatch.setattr(static_runner.GraphRunner, "eager", forgetful)
    broken = run(tiny, prompts, params, runner="static", prefill_chunk=40)
    assert broken != clean


def test_static_runner_overlap_equals_normal_and_stale_token_is_caught(tiny):
    prompts, params = workload(8, seed=3)
    normal = run(tiny, prompts, params, runner="static")
    overlap = run(tiny, prompts, params, runner="static", overlap=True)
    stale = run(tiny, prompts, params, runner="static", overlap=True, faults=("overlap-stale-token",))
    assert overlap == normal
    assert stale != normal  # negative control


def test_kv_slot_reuse_changes_static_runner_outputs(tiny):
    """Negative control for batched == solo: with pages handed out twice, batching matters."""
    prompts, params = workload(10, seed=4)
    clean = run(tiny, prompts, params, runner="static", max_model_len=128)
    broken = run(tiny, prompts, params, runner="static", faults=("kv-slot-reuse",))
    assert broken != clean


@pytest.mark.parametrize("overlap", [False, True])
def test_static_runner_tp2_matches_tp1_within_near_ties(tiny, overlap):
    """The GPU runner's tensor parallelism (heads and expert intermediates sharded, partial sums
    all-reduced; gloo here, NCCL on GPUs): reduction order differs, so tokens may part only at a
    recorded near-tie."""
    prompts, params = workload(8, seed=5)
    params = [SamplingParams(max_tokens=sp.max_tokens, ignore_eos=True, logprobs=True, top_logprobs=3)
              for sp in params]
    one = run(tiny, prompts, params, runner="static")
    two = run(tiny, prompts, params, runner="static", tp=2, overlap=overlap, env=Env(tp_check=True))
    check_logprobs_close(one, two, margin=1e-3, logprob_atol=1e-4)


def test_static_runner_with_the_fused_triton_moe(tiny):
    """The engine with runtime/kernels/triton/moe.py as its MoE (the Triton interpreter on CPU, float32):
    batched == solo bit for bit, and the torch MoE's tokens within recorded near-ties."""
    prompts, params = workload(4, seed=6)
    params = [SamplingParams(max_tokens=4, ignore_eos=True, logprobs=True, top_logprobs=3) for _ in params]
    torch_moe = run(tiny, prompts, params, runner="static")
    triton_moe = run(tiny, prompts, params, runner="static", moe_kernel="triton")
    check_logprobs_close(torch_moe, triton_moe, margin=1e-3, logprob_atol=1e-4)
    solo = [run(tiny, [p], [sp], runner="static", moe_kernel="triton")[0] for p, sp in zip(prompts, params)]
    assert triton_moe == solo


# Under the interpreter every indexer program scans the whole page table: a short context capacity
# (128 positions, still past window + top-k + the longest prompt) keeps these tests to seconds.
TRITON_ATTENTION = dict(runner="static", attention_kernel="triton", max_model_len=128)


def test_static_runner_with_the_triton_indexer_and_sparse_attention(tiny):
    """The engine with runtime/kernels/triton/indexer.py + attention.py as its indexer and attention
    (the Triton interpreter on CPU, float32): batched == solo bit for bit, the torch path's tokens within
    recorded near-ties, and a long prompt (past window + top-k) so the top-k selection is exercised."""
    prompts, params = workload(4, seed=7, long_prompt=tiny.config.sliding_window + tiny.config.index_topk + 40)
    params = [SamplingParams(max_tokens=4, ignore_eos=True, logprobs=True, top_logprobs=3) for _ in params]
    torch_attn = run(tiny, prompts, params, runner="static", max_model_len=128)
    triton_attn = run(tiny, prompts, params, **TRITON_ATTENTION)
    check_logprobs_close(torch_attn, triton_attn, margin=1e-3, logprob_atol=1e-4)
    solo = [run(tiny, [p], [sp], **TRITON_ATTENTION)[0] for p, sp in zip(prompts, params)]
    assert triton_attn == solo


def test_static_runner_with_the_selections_pass_1_in_the_indexer_kernel(tiny, monkeypatch):
    """indexer.FUSED_MAXIMA (the logits kernel writes the selection's group maxima, the selection runs on
    them) gives the engine's tokens and logprobs bit for bit, against the same run without it."""
    from runtime.kernels.triton import indexer as triton_indexer

    prompts, params = workload(3, seed=8, long_prompt=tiny.config.sliding_window + tiny.config.index_topk + 40)
    params = [SamplingParams(max_tokens=3, ignore_eos=True, logprobs=True, top_logprobs=3) for _ in params]
    apart = run(tiny, prompts, params, **TRITON_ATTENTION)
    calls = []
    real = triton_indexer.indexer_logits

    def counted(*args, **kwargs):
        calls.append(kwargs.get("maxima") is not None)
        return real(*args, **kwargs)
    monkeypatch.setattr(triton_indexer, "indexer_logits", counted)
    monkeypatch.setattr(triton_indexer, "FUSED_MAXIMA", True)
    fused = run(tiny, prompts, params, **TRITON_ATTENTION)
    assert calls and all(calls), "the decode step did not take the fused path"
    assert fused == apart


def test_fused_pass_1_comparison_sees_wrong_maxima(tiny, monkeypatch):
    """Negative control: group maxima that count the window's positions as top-k candidates (the window
    one shorter: the maxima then bound the k-th key too high) make the selection miss true top-k
    positions: fewer than k candidates reach the finish, which leaves slots unfilled (whatever its
    buffers held), and the step either fails on an index out of range or samples other tokens. (Maxima
    that bound too low cannot show here: the selection stays exact, only slower; the kernel tests compare
    the maxima themselves.)"""
    from runtime.kernels.triton import indexer as triton_indexer

    prompts, params = workload(3, seed=8, long_prompt=tiny.config.sliding_window + tiny.config.index_topk + 40)
    params = [SamplingParams(max_tokens=3, ignore_eos=True, logprobs=True, top_logprobs=3) for _ in params]
    apart = run(tiny, prompts, params, **TRITON_ATTENTION)
    real = triton_indexer.indexer_logits

    def planted(*args, **kwargs):
        if kwargs.get("maxima") is not None:
            kwargs["maxima"] = kwargs["maxima"]._replace(window=0)
        return real(*args, **kwargs)
    monkeypatch.setattr(triton_indexer, "indexer_logits", planted)
    monkeypatch.setattr(triton_indexer, "FUSED_MAXIMA", True)
    with pytest.raises((AssertionError, RuntimeError)):
        assert run(tiny, prompts, params, **TRITON_ATTENTION) == apart


def test_static_runner_triton_attention_comparison_sees_a_planted_bug(tiny, monkeypatch):
    """Negative control: the same comparison fails when the Triton attention is given a wrong softmax
    scale (the classic slip of scaling by the latent width alone, without the rope dims)."""
    from runtime.kernels.triton import attention as triton_attention

    prompts, params = workload(4, seed=7, long_prompt=tiny.config.sliding_window + tiny.config.index_topk + 40)
    params = [SamplingParams(max_tokens=4, ignore_eos=True, logprobs=True, top_logprobs=3) for _ in params]
    clean = run(tiny, prompts, params, runner="static", max_model_len=128)
    real = triton_attention.sparse_mla_decode
    monkeypatch.setattr(triton_attention, "sparse_mla_decode",
                        lambda q, cache, slots, latent, scale, **kw:
                        real(q, cache, slots, latent, latent ** -0.5, **kw))
    planted = run(tiny, prompts, params, **TRITON_ATTENTION)
    with pytest.raises(AssertionError):
        check_logprobs_close(clean, planted, margin=1e-3, logprob_atol=1e-4)


def test_static_runner_tp2_overlap_recomputes_preempted_requests_like_tp1(tiny):
    """Worker ranks append sampled tokens lazily in the overlap loop; a preempted request's recompute
    prefill must still see every token on every rank (else the ranks' partial sums disagree)."""
    prompts, params = workload(8, seed=9)
    params = [SamplingParams(max_tokens=24, ignore_eos=True, logprobs=True, top_logprobs=3) for _ in params]
    reference = run(tiny, prompts, params, runner="static")
    small = EngineConfig(runner="static", num_pages=24, page_size=4, max_model_len=128, max_prefill_tokens=128)
    with start_engine(tiny, small, FaultSet(), Env(tp_check=True), overlap=True, tp=2) as eng:
        reqs = drive(eng, at_once(prompts, params), rid_prefix=None).requests
        assert eng.scheduler.num_preemptions > 0, "the pool must be small enough to force preemption"
        assert all(s["pages_in_use"] == 0 for s in eng.tp.rank_stats())
    check_logprobs_close(reference, [Generation(r.output_ids, r.output_logprobs, r.output_top_logprobs)
                                     for r in reqs], margin=1e-3, logprob_atol=1e-4)
