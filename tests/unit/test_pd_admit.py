"""`Engine.admit_prefilled` (the decode side's entry, runtime/engine/scheduler.py): a request prefilled
by another engine, its KV pages copied into this engine's pool under other page ids, continues to
exactly the tokens and logprobs one engine produces alone - in both loops, with more such requests
than running slots (they queue holding their pages), and with every page back afterwards. No
transfer engine here: the pages are copied with torch, so this isolates the engine's half of PD."""

from __future__ import annotations

import copy

import pytest
import torch

from runtime.config import EngineConfig
from runtime.engine.engine import Engine
from runtime.engine.request import Request, SamplingParams
from runtime.env import Env
from runtime.faults import FaultSet

pytestmark = pytest.mark.unit
PAGE = 4


def engine(tiny, overlap: bool, **cfg) -> Engine:
    # Without the prefix cache, as runtime.serve runs both PD sides (Engine.admit_prefilled refuses it).
    return Engine(tiny, EngineConfig(page_size=PAGE, num_pages=128, prefix_cache=False, **cfg), faults=FaultSet(),
                  env=Env(), overlap=overlap)


def handed_over(prefill: Engine, decode: Engine, prompt: list[int], params: SamplingParams, rid: str,
                shift_pages: bool = True) -> Request:
    """Prefill `prompt` to one token on `prefill`, copy its KV pages into pages of `decode`, and build the
    request decode admits (what runtime/disagg does over the network)."""
    import dataclasses

    seen: dict[str, tuple[int, ...]] = {}
    prefill.add_request(prompt, dataclasses.replace(params, max_tokens=1), rid=rid)
    while prefill.has_work:
        result = prefill.step()
        for ext in result.plan.extends:
            seen[ext.rid] = ext.new_pages  # a prefill extend lists every page (first_page 0)
    done = prefill.scheduler.requests.pop(rid)
    num_pages = prefill.pool.pages_for_tokens(len(prompt))
    spacer = decode.pool.allocate("spacer", 3) if shift_pages else []  # other page ids on the decode side
    dst = decode.pool.allocate(rid, num_pages)
    decode.pool.free("spacer", spacer)  # free again: the next request's pages are scattered
    src = torch.tensor(seen[rid][:num_pages])
    for name in ("latent", "index_keys"):
        source, target = getattr(prefill.kv, name), getattr(decode.kv, name)
        view = lambda t: t.view(t.shape[0], -1, PAGE, t.shape[2])  # noqa: E731 - [layers, pages, page, dim]
        view(target)[:, torch.tensor(dst)] = view(source)[:, src]
    req = Request(rid, list(prompt), params)
    req.output_ids = list(done.output_ids)
    req.output_logprobs, req.output_top_logprobs = list(done.output_logprobs), copy.deepcopy(done.output_top_logprobs)
    req.pages, req.num_sampled = dst, done.num_sampled
    assert req.generator is not None and done.generator is not None
    req.generator.set_state(done.generator.get_state())
    return req


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_prefilled_requests_continue_bit_for_bit(tiny, overlap):
    torch.manual_seed(0)
    prompts = [torch.randint(3, tiny.config.vocab_size, (n,)).tolist() for n in (5, 9, 17, 2, 30)]
    params = [SamplingParams(max_tokens=12, logprobs=True, top_logprobs=2),
              SamplingParams(max_tokens=12, temperature=0.9, seed=5, logprobs=True)] * 3
    alone = engine(tiny, overlap)
    expected = alone.generate(prompts, params[:len(prompts)])
    prefill = engine(tiny, overlap)
    decode = engine(tiny, overlap, max_running_requests=2)  # 5 requests, 2 slots: the rest queue
    rids = []
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        req = handed_over(prefill, decode, prompt, sp, f"r{i}")
        assert decode.admit_prefilled(req) is None
        rids.append(req.rid)
    assert len(decode.scheduler.prefilled) == 5
    results = {}
    while decode.has_work:
        for req in decode.step().finished:
            results[req.rid] = req
    for rid, want in zip(rids, expected):
        got = results[rid]
        assert (got.output_ids, got.output_logprobs, got.output_top_logprobs) == (
            want.output_ids, want.output_logprobs, want.output_top_logprobs)
    assert decode.pages_in_use == prefill.pages_in_use == 0


def test_a_first_token_that_finishes_is_not_scheduled(tiny):
    prefill, decode = engine(tiny, False), engine(tiny, False)
    req = handed_over(prefill, decode, [5, 6, 7], SamplingParams(max_tokens=1), "one", shift_pages=False)
    assert decode.admit_prefilled(req) == "length"
    assert not decode.has_work and decode.pages_in_use == 0 and "one" not in decode.scheduler.requests


def test_aborting_a_queued_prefilled_request_frees_its_pages(tiny):
    prefill, decode = engine(tiny, False), engine(tiny, False, max_running_requests=1)
    for rid in ("a", "b"):
        decode.admit_prefilled(handed_over(prefill, decode, [5, 6, 7, 8, 9], SamplingParams(max_tokens=30), rid,
                                           shift_pages=False))
    decode.step()
    assert [r.rid for r in decode.scheduler.prefilled] == ["b"]
    decode.abort("b")
    decode.abort("a")
    decode.run_until_done()
    assert decode.pages_in_use == 0


def test_the_gates_pd_pair_waits_past_a_saturated_prefill_queue_unless_told_otherwise():
    """The 80-session PD gate on the 2-core CPU queues prompts ~30 s on the prefill server: the pair it
    starts gets the longer deadline; a deadline the caller passes (either spelling) is kept."""
    from canary.pd_target import GATE_PD_TIMEOUT_S, with_gate_timeout

    assert with_gate_timeout(["--dtype=float32"]) == ["--dtype=float32", "--disaggregation-timeout",
                                                      f"{GATE_PD_TIMEOUT_S:g}"]
    assert GATE_PD_TIMEOUT_S > 30.0  # the server's default, which failed a clean run
    assert with_gate_timeout(["--disaggregation-timeout", "5"]) == ["--disaggregation-timeout", "5"]
    assert with_gate_timeout(["--disaggregation-timeout=5"]) == ["--disaggregation-timeout=5"]
