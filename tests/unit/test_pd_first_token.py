"""The PD decode side's first token (runtime/disagg/decode.py `_first_token`): streamed on the event
loop before the engine has the request, it ends the request exactly when the engine, admitting the
same request, says it does (max_tokens=1, EOS, a stop token id, a stop string), and the event loop
decides that without the engine thread's scheduler."""

from __future__ import annotations

import base64
from types import SimpleNamespace

import pytest
import torch

from runtime.config import EngineConfig
from runtime.disagg.decode import DecodeSide, prefilled_request
from runtime.engine.engine import Engine
from runtime.engine.request import SamplingParams
from runtime.env import Env
from runtime.faults import FaultSet
from runtime.server.bridge import TokenOut
from runtime.server.trace import NO_TRACE

pytestmark = pytest.mark.unit
PROMPT = [5, 6, 7, 8, 9]
A, B = 65, 66  # "A", "B" for the byte-level tokenizer of tiny-random


@pytest.fixture(scope="module")
def engine(tiny):
    return Engine(tiny, EngineConfig(page_size=4, num_pages=64, prefix_cache=False), faults=FaultSet(), env=Env(),
                  overlap=False)


def loop_side(engine: Engine) -> DecodeSide:
    """A DecodeSide whose engine offers only what is fixed when it is built (tokenizer, config): no
    scheduler, which belongs to the engine thread."""
    frozen = SimpleNamespace(tokenizer=engine.tokenizer, cfg=engine.cfg)
    return DecodeSide(frozen, None, "decode-test", None, 10.0, FaultSet())  # type: ignore[arg-type]


def prefill_reply(token: int) -> dict:
    """The prefill side's /pd/transfer answer, as far as `prefilled_request` reads it."""
    state = torch.Generator().manual_seed(0).get_state().numpy().tobytes()
    return {"token": token, "logprob": None, "top": [], "num_sampled": 1, "generator": base64.b64encode(state).decode()}


def first_token(side: DecodeSide, rid: str, token: int, params: SamplingParams) -> TokenOut:
    req = prefilled_request(rid, PROMPT, params, [], prefill_reply(token))
    out = side._first_token(req, NO_TRACE)
    assert isinstance(out, TokenOut)
    return out


def engine_reason(engine: Engine, rid: str, token: int, params: SamplingParams) -> str | None:
    """What the engine says of the same request when it admits it (the decode side's next step)."""
    pages = engine.pool.allocate(rid, engine.pool.pages_for_tokens(len(PROMPT)))
    reason = engine.admit_prefilled(prefilled_request(rid, PROMPT, params, pages, prefill_reply(token)))
    if reason is None:
        engine.abort(rid)
        engine.run_until_done()
    return reason


CASES = {  # id: (first token, its params, the finish reason, counted as a stop token)
    "max-tokens-1": (A, SamplingParams(max_tokens=1), "length", False),
    "eos": ("eos", SamplingParams(max_tokens=8), "stop", True),
    "eos-max-tokens-1": ("eos", SamplingParams(max_tokens=1), "stop", True),
    "eos-ignored": ("eos", SamplingParams(max_tokens=8, ignore_eos=True), None, False),
    "stop-token-id": (A, SamplingParams(max_tokens=8, stop_token_ids=(A,)), "stop", True),
    "stop-string": (A, SamplingParams(max_tokens=8, stop=("A",)), "stop", False),
    "continues": (B, SamplingParams(max_tokens=8, stop=("A",), stop_token_ids=(A,)), None, False),
}


@pytest.mark.parametrize("case", CASES)
def test_the_first_token_ends_the_request_as_the_engine_would(engine, case):
    token, params, reason, is_stop = CASES[case]
    if token == "eos":
        token = engine.tokenizer.eos_token_id
    out = first_token(loop_side(engine), f"{case}-loop", token, params)
    assert (out.token, out.finish_reason, out.is_stop_token) == (token, reason, is_stop)
    assert engine_reason(engine, f"{case}-engine", token, params) == reason
    assert engine.pages_in_use == 0
