"""Corpus, tool set and chat template: schema-valid arguments, prefix-stable rendering, DSML that
the server's parser reads back exactly, tokenization that splits cleanly at markers."""

from __future__ import annotations

import json

import jsonschema
import pytest

from runtime.server.dsml import parse as parse_dsml
from runtime.train.corpus import TRAIN_SEED_BASE, Call, call_message, make_session, session_messages
from runtime.train.encode import encode_session, load_tokenizer
from runtime.train.template import MARKERS, render
from runtime.train.tools import SCHEMAS, TOOL_NAMES, TOOLS, execute

pytestmark = pytest.mark.unit

SEEDS = range(40)
CANARY_TOKENIZER = "golden/models/canary-moe-v2/tokenizer.json"


def test_tool_set_covers_the_parameter_types():
    kinds = {spec.get("type") for s in SCHEMAS.values() for spec in s["properties"].values()}
    kinds |= {"enum" for s in SCHEMAS.values() for spec in s["properties"].values() if "enum" in spec}
    assert len(TOOLS) >= 6
    assert {"string", "integer", "number", "boolean", "array", "enum"} <= kinds


def test_sessions_are_seeded_varied_and_schema_valid():
    sessions = [make_session(s) for s in SEEDS]
    assert make_session(3) == make_session(3)
    assert len({s.nonce for s in sessions}) == len(sessions)
    assert {s.tool_choice for s in sessions} == {"auto", "required", "none"}
    calls = [c for s in sessions for t in s.turns for c in t.calls]
    assert any(len(t.calls) == 2 for s in sessions for t in s.turns), "parallel calls must occur"
    assert any(not t.calls for s in sessions if s.tool_choice == "auto" for t in s.turns)
    for call in calls:
        jsonschema.validate(call.arguments, SCHEMAS[call.name])
        assert execute(call.name, call.arguments) == execute(call.name, json.loads(json.dumps(call.arguments)))
    for s in sessions:
        assert all(t.answer.startswith(f"[{s.nonce}]") for t in s.turns)
        if s.tool_choice == "none":
            assert not any(t.calls for t in s.turns)
        if s.tool_choice == "required":
            assert all(t.calls for t in s.turns)


@pytest.mark.parametrize("seed", [0, 1, 2, 5])
def test_rendering_is_prefix_stable_and_whitespace_setting_free(seed):
    session = make_session(seed)
    messages = session_messages(session)
    full = render(messages, TOOLS, session.tool_choice)
    assert full == render(messages, TOOLS, session.tool_choice, trim_blocks=False)
    for k in range(2, len(messages)):
        if messages[k]["role"] == "assistant":
            assert full.startswith(render(messages[:k], TOOLS, session.tool_choice))


def test_rendered_dsml_parses_back_to_the_same_calls():
    calls = [c for s in map(make_session, SEEDS) for t in s.turns for c in (t.calls,) if c]
    for group in calls:
        text = render([call_message(group)], None).split("<｜begin▁of▁sentence｜>", 1)[1]
        parsed = parse_dsml(text.removesuffix("<｜end▁of▁sentence｜>"), set(TOOL_NAMES))
        assert [Call(c.name, json.loads(c.arguments)) for c in parsed.calls] == list(group)


def test_markers_are_single_tokens_and_the_loss_covers_only_assistant_text():
    tok = load_tokenizer(CANARY_TOKENIZER)
    for marker in MARKERS:
        assert len(tok.encode(marker, add_special_tokens=False).ids) == 1, marker
    session = make_session(TRAIN_SEED_BASE + 7)
    example = encode_session(session, CANARY_TOKENIZER)
    supervised = tok.decode([i for i, m in zip(example.ids, example.loss_mask) if m], skip_special_tokens=False)
    for turn in session.turns:
        assert turn.answer in supervised
        assert turn.user not in supervised
