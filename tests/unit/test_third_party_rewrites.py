"""The corrupting proxy's controls for a third-party server (tests/corrupting_proxy.py): each changes
what it says on llama-cpp-python-shaped responses, and `UnderLoad` acts only while another request is
in flight. Plain dicts, no server (the e2e use is tests/e2e/test_third_party.py)."""

from __future__ import annotations

import copy

import pytest

from tests import corrupting_proxy as cp

pytestmark = pytest.mark.unit

NONCES = ["AAAA11", "BBBB22", "CCCC33"]


def body(session: int, user_turns: int = 2, stream: bool = False) -> dict:
    messages = [{"role": "system", "content": f"Session nonce: {NONCES[session]}. Be careful."}]
    messages += [{"role": "user", "content": "hi"}] * user_turns
    return {"messages": messages, "stream": stream}


def unary(tokens: list[str]) -> dict:
    return {"choices": [{"message": {"role": "assistant", "content": "".join(tokens)}, "finish_reason": "stop",
                         "logprobs": {"content": [{"token": t, "logprob": -0.1, "top_logprobs": []} for t in tokens]}}]}


def stream(tokens: list[str]) -> list:
    return ([{"choices": [{"delta": {"role": "assistant"}, "logprobs": None}]}]
            + [{"choices": [{"delta": {"content": t}, "logprobs": {"content": [{"token": t, "logprob": -0.1}]}}]}
               for t in tokens] + ["[DONE]"])


def stream_text(payloads) -> str:
    return "".join(d["content"] for d in cp.content_deltas(payloads))


def test_one_character_changes_a_digit_or_a_letter_and_nothing_else():
    out = cp.OneCharacter().unary(body(0), unary(["Total", " 42", " EUR"]))
    assert out["choices"][0]["message"]["content"] == "Total 52 EUR"
    out = cp.OneCharacter().unary(body(0), unary(["\n[", "INST", "]"]))
    assert out["choices"][0]["message"]["content"] == "\n[iNST]"
    assert [e["token"] for e in out["choices"][0]["logprobs"]["content"]] == ["\n[", "INST", "]"]
    assert stream_text(cp.OneCharacter().stream(body(0), stream(["ab", "7"]))) == "Ab7"


def test_swap_tokens_swaps_text_and_logprobs_alike():
    out = cp.SwapTokens().unary(body(0), unary(["a", "b", "c", "d"]))
    entries = out["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in entries] == ["a", "b", "d", "c"]
    assert out["choices"][0]["message"]["content"] == "abdc"
    payloads = cp.SwapTokens().stream(body(0), stream(["a", "b", "c", "d"]))
    assert stream_text(payloads) == "abdc"
    assert [p["choices"][0]["logprobs"]["content"][0]["token"] for p in payloads[1:-1]] == ["a", "b", "d", "c"]
    # Text that is not the join of its tokens is left alone: the control must stay self-consistent.
    odd = unary(["a", "b", "c"])
    odd["choices"][0]["message"]["content"] = "abc "
    assert cp.SwapTokens().unary(body(0), copy.deepcopy(odd)) == odd


def test_foreign_nonce_appends_another_sessions_nonce():
    out = cp.ForeignNonce(NONCES).unary(body(1), unary(["x"]))
    assert out["choices"][0]["message"]["content"] == "x [AAAA11]"
    assert stream_text(cp.ForeignNonce(NONCES).stream(body(0), stream(["y"]))) == "y [BBBB22]"


def test_by_session_dispatches_on_the_nonce_and_records_what_changed():
    rewrite = cp.BySession([cp.OneCharacter(), cp.DropDone(), cp.Rewrite()], NONCES)
    assert rewrite.applies(body(0)) and not rewrite.applies(body(0, user_turns=1))  # late: second turn on
    rewrite.unary(body(0), unary(["Ab"]))
    assert rewrite.stream(body(1, stream=True), stream(["x"]))[-1] != "[DONE]"
    rewrite.unary(body(2), unary(["Ab"]))
    assert rewrite.changed == {"OneCharacter": {0}, "DropDone": {1}}


def test_under_load_acts_only_while_another_request_is_in_flight():
    proxy = cp.CorruptingProxy("http://127.0.0.1:1")  # never started: only its in-flight count is read
    rewrite = cp.UnderLoad(cp.OneCharacter(), proxy)
    proxy.in_flight = 1
    assert not rewrite.applies(body(0))
    proxy.in_flight = 2
    assert rewrite.applies(body(0)) and not rewrite.applies(body(0, user_turns=1))
