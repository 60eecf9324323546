"""The first-token relay's pieces of the PD protocol (runtime/disagg/protocol.py): which first tokens the
prefill server relays, how both servers read the token's fields from the prompt's outcome, the relay
line as the router reads it back, and the shared `created`."""

from __future__ import annotations

import pytest

from runtime.disagg.protocol import (
    CREATED_HEADER,
    completion_id,
    created_of,
    first_token_of,
    relay_line,
    relayed_bytes,
    relays_first_token,
)

pytestmark = pytest.mark.unit
EOS = 2


@pytest.mark.parametrize(("token", "stop_ids", "relayed"), [
    (65, (), True), (EOS, (), False), (65, (65,), False), (66, (65,), True)])
def test_a_stop_token_is_not_relayed_and_any_other_token_is(token, stop_ids, relayed):
    """A stop token's text depends on why the request ends there, which the decode side decides."""
    assert relays_first_token(token, EOS, stop_ids) is relayed


def test_the_tokens_fields_are_read_alike_on_both_servers_with_logprobs_only_where_asked():
    outcome = {"token": 7, "logprob": -0.25, "top": [[7, -0.25], [8, -1.5]]}
    assert first_token_of(outcome, logprobs=True) == (7, -0.25, [(7, -0.25), (8, -1.5)])
    assert first_token_of({**outcome, "logprob": None, "top": []}, logprobs=False) == (7, 0.0, [])


@pytest.mark.parametrize("text", ['data: {"a": "é"}\n\n', 'data: {"b": "\\u2028 \\n"}\n\n'])
def test_a_relay_line_reads_back_as_the_same_bytes(text):
    line = relay_line(text)
    assert line.endswith(b"\n") and line.count(b"\n") == 1  # one JSON line, whatever the text holds
    assert relayed_bytes(line.rstrip(b"\n")) == text.encode()


@pytest.mark.parametrize("line", [relay_line(None), b"", b"not json", b'{"relay": 3}', b'["relay"]', b'{"relay": ""}'])
def test_a_null_missing_or_malformed_relay_line_relays_nothing(line):
    """The router then waits for the decode stream's own first token, or names a relay lost."""
    assert relayed_bytes(line.rstrip(b"\n")) is None


def test_both_servers_write_one_id_and_the_routers_created():
    assert completion_id("abc") == "chatcmpl-abc"
    assert created_of({CREATED_HEADER: "1796669806"}, 5) == 1796669806
    for bad in ({}, {CREATED_HEADER: "-1"}, {CREATED_HEADER: "12.5"}, {CREATED_HEADER: "soon"}):
        assert created_of(bad, 5) == 5
