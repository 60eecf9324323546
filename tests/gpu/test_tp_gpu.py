"""Tensor parallelism on two GPUs (NCCL for activations, gloo for plans), with CUDA graphs and the
side-stream indexer on: TP=2 == TP=1 within recorded near-ties (overlap off and on), the abort
storm at TP=2 with overlap (no hang, no leaked page or slot on any rank), `tp-local-abort` caught
as DesyncError. Needs the nvidia-h200-x2 kind: scripts/gpu_tp.sh."""

from __future__ import annotations

import random

import pytest
import torch

from canary.faults.engine_gates import at_once, drive
from canary.oracles.logprob_close import Generation, check_logprobs_close
from runtime.config import EngineConfig, default_model
from runtime.distributed.errors import DesyncError
from runtime.distributed.tp_engine import start_engine
from runtime.engine.request import SamplingParams
from runtime.env import Env
from runtime.faults import FaultSet
from runtime.models.loader import load_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (nvidia-h200-x2)")]


def workload(vocab: int, n: int, seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.choice([rng.randint(2, 40), rng.randint(100, 500)]))]
               for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randint(8, 32), ignore_eos=True, logprobs=True, top_logprobs=5)
              for _ in range(n)]
    return prompts, params


@pytest.mark.parametrize("overlap", [False, True])
def test_tp2_matches_tp1_on_gpus(overlap):
    loaded = load_model(default_model())
    prompts, params = workload(loaded.tokenizer.vocab_size, 24, seed=1)
    cfg = EngineConfig(device="cuda", dtype="float32", num_pages=4096)
    outputs = {}
    for tp in (1, 2):
        with start_engine(loaded, cfg, FaultSet(), Env(tp_check=True), overlap=overlap, tp=tp) as eng:
            reqs = drive(eng, at_once(prompts, params), rid_prefix=None).requests
            assert eng.runner.graphs.replays > 0
            assert eng.pages_in_use == 0
            if tp == 2:
                assert all(s["pages_in_use"] == 0 for s in eng.tp.rank_stats())
            outputs[tp] = [Generation(r.output_ids, r.output_logprobs, r.output_top_logprobs) for r in reqs]
    ties = check_logprobs_close(outputs[1], outputs[2], margin=0.05, logprob_atol=1e-3)
    print(f"overlap={overlap}: {len(ties)} near-tie divergences of 24 sequences")


def test_abort_storm_tp2_overlap_on_gpus():
    tiny = load_model("tiny-random")
    rng = random.Random(7)
    env = Env(tp_check=True, tp_timeout_s=30.0)
    cfg = EngineConfig(device="cuda", dtype="bfloat16", num_pages=10, page_size=4, max_running_requests=6,
                       max_model_len=40, max_prefill_tokens=40)
    with start_engine(tiny, cfg, FaultSet(), env, overlap=True, tp=2) as engine:
        live: list[str] = []
        for _ in range(1000):
            if rng.random() < 0.6:
                prompt = [rng.randrange(3, 256) for _ in range(rng.randint(1, 10))]
                live.append(engine.add_request(prompt, SamplingParams(max_tokens=rng.randint(1, 14), ignore_eos=True)))
            if live and rng.random() < 0.35:
                engine.abort(rng.choice(live))
            engine.step()
            live = [rid for rid in live if not engine.scheduler.requests[rid].finished]
        engine.run_until_done()
        sched = engine.scheduler
        reasons = [r.finish_reason for r in sched.requests.values()]
        assert reasons.count("abort") > 50 and reasons.count("length") > 50
        assert sched.aborts_in_flight > 10 and sched.num_preemptions > 0
        assert engine.pages_in_use == 0 and engine.runner.future.live == 0
        for stats in engine.tp.rank_stats():
            assert stats == {"rank": stats["rank"], "pages_in_use": 0, "requests": 0, "future_slots": 0}
        print(f"storm: {sched.step} steps, {reasons.count('abort')} aborts ({sched.aborts_in_flight} in flight), "
              f"{sched.num_preemptions} preemptions")


def test_tp_local_abort_raises_desync_on_gpus():
    tiny = load_model("tiny-random")
    prompts, params = workload(256, 8, seed=3)
    cfg = EngineConfig(device="cuda", dtype="bfloat16", num_pages=512)
    engine = start_engine(tiny, cfg, FaultSet(["tp-local-abort"]), Env(tp_check=True, tp_timeout_s=30.0), overlap=True,
                          tp=2)
    try:
        with pytest.raises(DesyncError) as caught:
            drive(engine, at_once(prompts, params), rid_prefix=None)
    finally:
        engine.shutdown()
    assert "decode" in caught.value.differing
