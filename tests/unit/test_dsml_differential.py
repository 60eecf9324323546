"""Issue 18 item 2: our DSML parser against the other readers of the format, on generated AND
malformed replies, under every chunking.

- SGLang 0.5.23's `DeepSeekV4Detector`, one-shot (`detect_and_parse`) and streamed
  (`parse_streaming_increment` + `finish`) with the same chunks as ours;
- DeepSeek's V4 reference output parser (`deepseek_recipe.StreamProcessor`, the Rust processor its
  serving stack uses), streamed with the same chunks, with its finish_reason for a natural stop and
  for max_tokens;
- DeepSeek's V3.2 reference parser is compared byte for byte in tests/unit/test_dsml_incomplete.py.

A reply is built from invokes of known kinds, so each kind says what we return and what SGLang
returns. Where they differ, `DIFFERENCES` says why, and every difference is one where the other
reader loses or changes data: it drops the call, drops text, or turns a declared JSON value into a
string. Random markup noise has no known answer; there the differential is one of data loss: a call
SGLang finds is either ours too or its markup is in our content, and a call only we report is one of
the listed kinds. All of it runs in CI (tests/reference_impls.py: a missing reference fails there).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from runtime.server.dsml import DSML, DsmlParser, ParsedCall, ParseResult, collect, parse
from runtime.server.output import ChoiceBuilder, OutputOptions, fold
from runtime.tokenizer import ByteTokenizer
from tests.reference_impls import DeepSeekV4Detector, Function, Tool, deepseek_recipe, needs_recipe, needs_sglang

pytestmark = pytest.mark.unit

NAMES = ("get_weather", "f")
TOK = ByteTokenizer(320, 256, 257, 258)

# Why each kind of invoke reads differently elsewhere; every entry is a loss or change on their side.
DIFFERENCES = {
    "string whitespace": "SGLang strips string values; we keep them, as DeepSeek's reference parsers do",
    "swapped attributes": "SGLang's parameter pattern wants name= before string=: it drops the call",
    "no string attribute": "SGLang's parameter pattern requires string=: it drops the call",
    "value holding a close tag": "SGLang ends the invoke at the first close tag, inside the value: it drops the call",
    "string=false not JSON": "SGLang turns a value the markup declared JSON into a string; we return the invoke as content",
    "stray text": "SGLang drops text between parameters; we return the invoke as content",
    "bad direct JSON": "both report no call; SGLang drops the markup, we return it as content",
    "unclosed parameter": "both report no call; SGLang drops the markup, we return it as content",
    "malformed invoke tag": "both report no call; SGLang drops the markup, we return it as content",
    "invoke outside a closed block": "once a reply has a tool_calls block, SGLang reads only inside closed ones: it "
                                     "drops the calls of a block cut by max_tokens and the invokes around blocks",
    "invoke inside an unclosed invoke": "SGLang reads a following invoke as the body of one that never closed and "
                                        "drops both; we return the unclosed one as content and report the next",
    "value holding an invoke tag": "inside an invoke, <｜DSML｜invoke starts the next invoke, so a parameter "
                                   "not closed before it was cut: we return that invoke as content; SGLang keeps the "
                                   "tag in the value when the parameter's close tag comes later",
    "text after the block": "SGLang and the V4 reference drop text after the block; we return it as content",
    "direct JSON (V4 reference)": "the V4 reference reads no direct-JSON body: it reports {} and drops the arguments",
    "second block (V4 reference)": "the V4 reference reads only the first block: it drops the later calls",
    "self-closing invoke (V4 reference)": "the V4 reference reads <invoke name=\"x\"/> as an opening tag: the next "
                                          "invoke's arguments become x's and that call is lost",
    "leading newlines (V4 reference)": "the V4 reference drops the newlines a reply starts with; we return the "
                                       "text as the model wrote it",
    "repeated key (V4 reference)": "the V4 reference writes every value of a repeated parameter into the "
                                   "arguments; a JSON reader keeps the last, our only one",
    "cut invoke (V4 reference)": "the V4 reference reports the invoke a cut left open as a call, with its partial "
                                 "arguments (often not JSON); we report only closed invokes",
}


@dataclass(frozen=True)
class Invoke:
    markup: str
    ours: tuple[str, str] | None  # our call (name, arguments exactly), or None: the markup is content
    sglang: tuple[str, dict] | None  # SGLang's call (name, parsed arguments), or None: dropped
    kind: str  # "" (well formed, read alike everywhere) or a DIFFERENCES key

    @property
    def well_formed(self) -> bool:
        return self.kind in ("", "string whitespace")


def param(name: str, value: str, string: str | None = "true", swapped: bool = False) -> str:
    if string is None:
        attrs = f'name="{name}"'
    else:
        attrs = f'string="{string}" name="{name}"' if swapped else f'name="{name}" string="{string}"'
    return f"<{DSML}parameter {attrs}>{value}</{DSML}parameter>\n"


def invoke_markup(name: str, body: str) -> str:
    return f'<{DSML}invoke name="{name}">\n{body}</{DSML}invoke>\n'


def arguments_text(pairs: list[tuple[str, str]]) -> str:
    """Our arguments for (key, JSON text) pairs: a repeated key keeps its place and its last value."""
    merged = dict(pairs)
    return "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {v}" for k, v in merged.items()) + "}"


# Text without the characters that would make a tag; values may carry outer whitespace.
_word = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="<>\"\uff5c"), max_size=8)
_padded = st.tuples(st.sampled_from(["", " ", "\n", "  "]), _word, st.sampled_from(["", " ", "\n"])).map("".join)
_json_raw = st.one_of(st.integers(-10**6, 10**6).map(str), st.sampled_from(["1.50", "1e400", "-0.0", "true", "null"]),
                      st.lists(st.integers(0, 9), max_size=3).map(json.dumps),
                      st.dictionaries(st.sampled_from("ab"), st.integers(0, 9), max_size=2).map(json.dumps))
_key = st.from_regex(r"[a-z]{1,4}", fullmatch=True)
_name = st.sampled_from(NAMES)


@st.composite
def parameters_invoke(draw) -> Invoke:
    """Well-formed parameter tags (a key may repeat: the last value wins everywhere)."""
    name = draw(_name)
    pairs = draw(st.lists(st.tuples(_key, st.one_of(_padded.map(lambda v: (v, "true")),
                                                     _json_raw.map(lambda v: (v, "false")))), max_size=4))
    ours = arguments_text([(k, json.dumps(v, ensure_ascii=False) if s == "true" else v) for k, (v, s) in pairs])
    theirs = {k: v.strip() if s == "true" else json.loads(v) for k, (v, s) in pairs}
    stripped = any(s == "true" and v != v.strip() for _, (v, s) in pairs)
    body = "".join(param(k, v, s) for k, (v, s) in pairs)
    return Invoke(invoke_markup(name, body), (name, ours), (name, theirs), "string whitespace" if stripped else "")


@st.composite
def direct_json_invoke(draw) -> Invoke:
    name = draw(_name)
    args = draw(st.dictionaries(_key, st.integers(0, 99) | _word, max_size=3))
    text = json.dumps(args, ensure_ascii=False, indent=draw(st.sampled_from([None, 2])))
    return Invoke(invoke_markup(name, text + "\n"), (name, text), (name, args), "")


_self_closing = _name.map(lambda n: Invoke(f'<{DSML}invoke name="{n}"/>\n', (n, "{}"), (n, {}), ""))


@st.composite
def listed_invoke(draw) -> Invoke:
    """An invoke of a kind that SGLang reads differently (DIFFERENCES says why)."""
    name, key, word = draw(_name), draw(_key), draw(_word.map(str.strip).filter(bool))
    kind = draw(st.sampled_from(["swapped attributes", "no string attribute", "value holding a close tag",
                                 "string=false not JSON", "stray text", "bad direct JSON", "unclosed parameter",
                                 "malformed invoke tag"]))
    if kind == "swapped attributes":
        return Invoke(invoke_markup(name, param(key, "[1, 2]", "false", swapped=True)),
                      (name, arguments_text([(key, "[1, 2]")])), None, kind)
    if kind == "no string attribute":  # undeclared: JSON when it is JSON, else text
        value = draw(st.sampled_from(["x" + word, "[1, 2]", "7"]))
        as_json = value if value[0] != "x" else json.dumps(value, ensure_ascii=False)
        return Invoke(invoke_markup(name, param(key, value, None)), (name, arguments_text([(key, as_json)])), None,
                      kind)
    if kind == "value holding a close tag":
        value = f"{word}</{DSML}invoke>{word}"
        return Invoke(invoke_markup(name, param(key, value)),
                      (name, arguments_text([(key, json.dumps(value, ensure_ascii=False))])), None, kind)
    if kind == "string=false not JSON":
        value = "x" + word  # never a JSON value
        return Invoke(invoke_markup(name, param(key, value, "false")), None, (name, {key: value}), kind)
    if kind == "stray text":
        return Invoke(invoke_markup(name, param(key, word) + "x" + word + "\n" + param(key + "z", "1", "false")),
                      None, (name, {key: word, key + "z": 1}), kind)
    if kind == "bad direct JSON":
        body = draw(st.sampled_from(['{"city": }', '{"a": 1} trailing', '{"a": NaN}', "[1, 2]", '{"a": 1e400']))
        return Invoke(invoke_markup(name, body + "\n"), None, None, kind)
    if kind == "unclosed parameter":
        return Invoke(invoke_markup(name, f'<{DSML}parameter name="{key}" string="true">{word}\n'), None, None, kind)
    return Invoke(f'<{DSML}invoke name={name}>\n{param(key, word)}</{DSML}invoke>\n', None, None, kind)


_well_formed = st.one_of(parameters_invoke(), direct_json_invoke(), _self_closing)
_any_invoke = st.one_of(_well_formed, listed_invoke())


@dataclass(frozen=True)
class Reply:
    prose: str
    invokes: tuple[Invoke, ...]
    layout: str  # "tool_calls" | "function_calls" | "bare" | "two blocks"
    after: str  # text after the markup

    @property
    def text(self) -> str:
        if not self.invokes:
            return self.prose + self.after
        if self.layout == "bare":
            return self.prose + "\n\n" + "".join(i.markup for i in self.invokes) + self.after
        if self.layout == "two blocks":
            half = (len(self.invokes) + 1) // 2
            blocks = [self.invokes[:half], self.invokes[half:]]
            return self.prose + "\n\n" + "\n\n".join(_block("tool_calls", b) for b in blocks if b) + self.after
        return self.prose + "\n\n" + _block(self.layout, self.invokes) + self.after

    @property
    def content(self) -> str:
        """Our content: the prose, each rejected invoke's markup, and the text after the markup."""
        rejected = "".join(i.markup.strip() for i in self.invokes if i.ours is None)
        return self.prose + rejected + (self.after.lstrip() if self.invokes else self.after)


def same_content(content: str, reply: Reply) -> bool:
    """Exactly the expected content; where markup went back to it, the same up to whitespace (the
    whitespace around tags is markup)."""
    if all(i.ours is not None for i in reply.invokes):
        return content == reply.content
    return re.sub(r"\s", "", content) == re.sub(r"\s", "", reply.content)


def _block(name: str, invokes) -> str:
    return f"<{DSML}{name}>\n" + "".join(i.markup for i in invokes) + f"</{DSML}{name}>"


# Prose never ends in a blank line (the template's "\n\n" before the markup is the markup's) and holds
# no "<" (SGLang's streamer holds prose that could start a tag).
_prose = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="<\uff5c"), max_size=10).filter(
    lambda s: not s.endswith("\n"))
_after = st.sampled_from(["", "", "\nDone.", " ok"])


def replies(invokes=_any_invoke) -> st.SearchStrategy[Reply]:
    return st.builds(Reply, _prose, st.lists(invokes, max_size=4).map(tuple),
                     st.sampled_from(["tool_calls", "function_calls", "bare", "two blocks"]), _after)


@st.composite
def chunkings(draw, text: str) -> list[str]:
    cuts = sorted(draw(st.sets(st.integers(0, len(text)), max_size=16)))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def every_chunking(text: str):
    """One character per chunk, the whole text, and every split into two."""
    yield list(text)
    yield [text]
    for cut in range(1, len(text)):
        yield [text[:cut], text[cut:]]


# ---- the other readers ---------------------------------------------------------------------------
TOOLS = None if DeepSeekV4Detector is None else [
    Tool(type="function", function=Function(name=n, parameters={"type": "object"})) for n in NAMES]


@pytest.fixture(autouse=True)
def _quiet_parsers():
    """Both parsers log every malformed invoke; thousands of examples would flood the report."""
    logging.disable(logging.WARNING)
    yield
    logging.disable(logging.NOTSET)


def sglang_one_shot(text: str) -> tuple[str, list[tuple[str, dict]]]:
    result = DeepSeekV4Detector().detect_and_parse(text, TOOLS)
    return result.normal_text, [(c.name, json.loads(c.parameters)) for c in result.calls]


def sglang_streamed(chunks: list[str]) -> list[tuple[str, dict]]:
    detector, calls = DeepSeekV4Detector(), []
    for chunk in chunks:
        calls += detector.parse_streaming_increment(chunk, TOOLS).calls
    calls += detector.finish(TOOLS).calls
    return [(c.name, json.loads(c.parameters)) for c in calls]


def recipe_reply(chunks: list[str], finish: str) -> tuple[str, list[tuple[str, str]], str]:
    """DeepSeek's V4 output parser on text chunks: (content, calls, finish_reason)."""
    body = {"model": "DeepSeek-V4-Pro", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "thinking": {"type": "disabled"},
            "tools": [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in NAMES]}
    request = deepseek_recipe.ChatCompletionRequest(body).convert(deepseek_recipe.ConversionOptions())
    options = request.parsing_options
    processor = deepseek_recipe.StreamProcessor(
        deepseek_recipe.ChatCompletionRequest.chunk_generator(request, "r", "m"), options)
    response = deepseek_recipe.ChatCompletionResponse("r", "m", 0, 0, 0)
    events = processor.push(deepseek_recipe.InferenceChunk.ready())
    for chunk in chunks:
        events += processor.push(deepseek_recipe.InferenceChunk.text(chunk, 1))
    reason = {"stop": deepseek_recipe.InferenceFinishReason.Stop,
              "length": deepseek_recipe.InferenceFinishReason.Length}[finish]
    events += processor.push(deepseek_recipe.InferenceChunk.finish(reason))
    events += processor.finish()
    for event in events:
        response.accumulate(event)
    choice = json.loads(response.to_json())["choices"][0]
    message = choice["message"]
    return (message.get("content") or "",
            [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []],
            choice["finish_reason"])


def same_calls(reference: list[tuple[str, str]], ours: list[tuple[str, str]]) -> bool:
    """Byte for byte, except where a key repeats: listed, "repeated key (V4 reference)"."""
    if reference == ours:
        return True
    repeated = any(len(json.loads(a)) < len(re.findall(r'(?:\{|, )"[^"]*": ', a)) for _, a in reference)
    return repeated and parsed(reference) == parsed(ours)


def our_reply(text: str, finish: str) -> tuple[str, list[tuple[str, str]], str]:
    """Our server's output path on `text`, byte tokens, ended by EOS ("stop") or by max_tokens."""
    builder = ChoiceBuilder(TOK, OutputOptions(parse_tools=True, tool_names=frozenset(NAMES)))
    deltas = [builder.push(t, 0.0, [], False) for t in TOK.encode(text)]
    if finish == "stop":
        deltas.append(builder.push(TOK.eos_token_id, 0.0, [], True))
    last, reason = builder.finish(finish)
    message = fold([*deltas, last])["message"]
    return (message["content"] or "",
            [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []], reason)


def calls_of(result: ParseResult) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in result.calls]


def parsed(calls: list[tuple[str, str]]) -> list[tuple[str, dict]]:
    return [(name, json.loads(arguments)) for name, arguments in calls]


# ---- generated and malformed replies of known kinds ---------------------------------------------
# An invoke the model never closed, then a well-formed one: the first is content, the second a call.
UNCLOSED_THEN_CALL = Reply("hi", (
    Invoke(invoke_markup("f", f'<{DSML}parameter name="a" string="true">cut\n'), None, None, "unclosed parameter"),
    Invoke(invoke_markup("get_weather", param("city", "Oslo")), ("get_weather", '{"city": "Oslo"}'),
           ("get_weather", {"city": "Oslo"}), "")), "tool_calls", "")


@given(reply=replies(), data=st.data())
@example(reply=UNCLOSED_THEN_CALL, data=None)
def test_each_kind_reads_as_listed(reply, data):
    """Ours exactly as the kinds say, one-shot and under every chunking (one character per chunk,
    every split in two, random ones): the oracle for the differentials below."""
    ours = parse(reply.text, set(NAMES))
    assert reads_as_listed(ours, reply)
    if data is not None:
        assert collect(DsmlParser(set(NAMES)), data.draw(chunkings(reply.text))) == ours
    for chunks in every_chunking(reply.text):
        assert collect(DsmlParser(set(NAMES)), chunks) == ours


def reads_as_listed(result: ParseResult, reply: Reply) -> bool:
    return calls_of(result) == [i.ours for i in reply.invokes if i.ours is not None] and \
        same_content(result.content, reply)


@needs_sglang
@given(reply=replies(), data=st.data())
@example(reply=Reply("hi", (Invoke(invoke_markup("f", param("a", " x ")), ("f", '{"a": " x "}'), ("f", {"a": "x"}),
                                   "string whitespace"),), "tool_calls", ""), data=None)
@example(reply=UNCLOSED_THEN_CALL, data=None)
def test_sglang_detector_differs_only_as_listed(reply, data):
    """SGLang, one-shot and streamed with random chunks, reports each kind's listed call; its
    content is the prose (it drops the text after the block: listed)."""
    expected = [i.sglang for i in reply.invokes if i.sglang is not None]
    content, calls = sglang_one_shot(reply.text)
    assert calls == expected
    assert content == reply.prose + ("" if reply.invokes else reply.after)
    chunks = data.draw(chunkings(reply.text)) if data is not None else [reply.text]
    assert sglang_streamed(chunks) == expected
    # And where the kinds agree, the calls agree.
    agreed = [i for i in reply.invokes if i.kind == ""]
    assert [i.sglang for i in agreed] == parsed([i.ours for i in agreed if i.ours is not None])


@needs_sglang
@given(reply=replies(_well_formed))
def test_sglang_streamed_under_every_chunking_on_well_formed_replies(reply):
    expected = [i.sglang for i in reply.invokes]
    for chunks in every_chunking(reply.text):
        assert sglang_streamed(chunks) == expected


@needs_recipe
@given(reply=replies(parameters_invoke()), data=st.data())
def test_deepseek_v4_reference_agrees_on_well_formed_replies(reply, data):
    """Content, calls (arguments byte for byte) and finish_reason, for a natural stop and for
    max_tokens, with random chunks; the listed differences are the layouts it drops."""
    text = reply.text
    chunks = data.draw(chunkings(text))
    for finish in ("stop", "length"):
        content, calls, reason = recipe_reply(chunks, finish)
        ours = our_reply(text, finish)
        expected_calls = [i.ours for i in reply.invokes]
        if reply.layout == "two blocks" and len(reply.invokes) > 1:  # listed: "second block (V4 reference)"
            expected_calls = expected_calls[: (len(reply.invokes) + 1) // 2]
        assert same_calls(calls, expected_calls)
        assert ours[1] == [i.ours for i in reply.invokes]
        # Listed: "text after the block", "leading newlines (V4 reference)".
        assert content == (reply.prose + ("" if reply.invokes else reply.after)).lstrip("\n")
        assert same_content(ours[0], reply)
        assert reason == ours[2]


@needs_recipe
@given(reply=replies(parameters_invoke()).filter(lambda r: r.layout == "tool_calls"), data=st.data())
def test_deepseek_v4_reference_on_cut_replies(reply, data):
    """max_tokens anywhere: both keep finish_reason "length"; every call we report the reference
    reports too, and the only call it has beyond ours is the invoke the cut left open (listed)."""
    text = reply.text
    cut = text[: data.draw(st.integers(0, len(text)))]
    content, calls, reason = recipe_reply(data.draw(chunkings(cut)), "length")
    _, ours, our_reason = our_reply(cut, "length")
    assert reason == our_reason == "length"
    assert same_calls(calls[: len(ours)], ours)
    extra = calls[len(ours):]  # listed: "cut invoke (V4 reference)"
    assert len(extra) <= 1
    if extra:  # the cut ends inside the invoke after our last call
        open_invoke = reply.invokes[len(ours)]
        start = text.index(f"<{DSML}tool_calls>\n") + len(f"<{DSML}tool_calls>\n") + sum(
            len(i.markup) for i in reply.invokes[: len(ours)])
        assert extra[0][0] == open_invoke.ours[0] and len(cut) < start + len(open_invoke.markup.rstrip())


@needs_recipe
def test_deepseek_v4_reference_misreads_a_self_closing_invoke():
    """Listed: "self-closing invoke (V4 reference)". Alone it reads as {} everywhere; followed by an
    invoke, the reference reports one call with the next one's arguments, we report both."""
    self_closing = f'<{DSML}invoke name="f"/>\n'
    weather = invoke_markup("get_weather", param("city", "Oslo"))
    assert recipe_reply([_block("tool_calls", [Invoke(self_closing, None, None, "")])], "stop")[1] == [("f", "{}")]
    text = f"<{DSML}tool_calls>\n{self_closing}{weather}</{DSML}tool_calls>"
    assert recipe_reply([text], "stop")[1] == [("f", '{"city": "Oslo"}')]
    assert our_reply(text, "stop")[1] == [("f", "{}"), ("get_weather", '{"city": "Oslo"}')]


@needs_recipe
def test_deepseek_v4_reference_drops_a_direct_json_body():
    """Listed: "direct JSON (V4 reference)". SGLang reads the object, as we do."""
    text = _block("tool_calls", [Invoke(invoke_markup("f", '{"a": 1}\n'), None, None, "")])
    assert recipe_reply([text], "stop")[1] == [("f", "{}")]
    assert our_reply(text, "stop")[1] == [("f", '{"a": 1}')]


# ---- random markup noise: no known answer, so a differential of data loss ------------------------
_NOISE = ["<", ">", "\n", " ", "x", '"', "{", "}", "/", "1", "NaN", "[", "]", ":", "1e400", "\n\n",
          f"<{DSML}tool_calls>", f"</{DSML}tool_calls>", f"<{DSML}function_calls>", f"</{DSML}function_calls>",
          f'<{DSML}invoke name="f">', f"</{DSML}invoke>", f'<{DSML}invoke name="f"/>', f"<{DSML}invoke",
          f'<{DSML}parameter name="p" string="true">', f'<{DSML}parameter name="p" string="false">',
          f'<{DSML}parameter string="false" name="q">', f'<{DSML}parameter name="r">', f"</{DSML}parameter>",
          f"<{DSML}parameter", "/>", '{"a": 1}', 'name="', '">']
_noise = st.lists(st.sampled_from(_NOISE), max_size=30).map("".join)
_SGLANG_PARAMETER = re.compile(rf'<{DSML}parameter\s+name="[^"]+"\s+string="[^"]+"\s*>')


_SGLANG_BLOCK = re.compile(rf"<{DSML}tool_calls>.*?</{DSML}tool_calls>", re.DOTALL)
_OPEN_HEAD = re.compile(rf'<{DSML}invoke\s+name="[^"]+"\s*>')


def why_only_ours(text: str, call: tuple[str, dict]) -> str | None:
    """The listed reason SGLang lacks a call we report, read off the text; None: no listed reason."""
    if f"<{DSML}tool_calls>" in text and f"<{DSML}invoke" in _SGLANG_BLOCK.sub("", text):
        return DIFFERENCES["invoke outside a closed block"]
    for head in _OPEN_HEAD.finditer(text):
        close, opened = text.find(f"</{DSML}invoke>", head.end()), text.find(f"<{DSML}invoke", head.end())
        if opened >= 0 and (close < 0 or opened < close):
            return DIFFERENCES["invoke inside an unclosed invoke"]
    if any(not _SGLANG_PARAMETER.match(text, m.start()) for m in re.finditer(f"<{DSML}parameter", text)):
        return DIFFERENCES["swapped attributes"]
    if DSML in json.dumps(call[1], ensure_ascii=False):
        return DIFFERENCES["value holding a close tag"]
    return None


@needs_sglang
@given(text=_noise, data=st.data())
@example(text=f'<{DSML}tool_calls><{DSML}invoke name="f"></{DSML}invoke>', data=None)
@example(text=f"<{DSML}invoke<{DSML}invoke name=\"f\"/>", data=None)
def test_noise_loses_nothing_sglang_finds(text, data):
    """A call SGLang reports is ours too, or its invoke is in our content for a listed reason (the
    one our parser logged); a call only we report has a listed reason; streamed equals one-shot."""
    parser = DsmlParser({"f"})
    ours = collect(parser, [text])
    assert loses_nothing(text, ours, parser.rejected, sglang_one_shot(text)[1])
    if data is not None:
        assert collect(DsmlParser({"f"}), data.draw(chunkings(text))) == ours


# Why we may return as content an invoke SGLang reports as a call (our parser logs the reason).
ONLY_THEIRS = {'a string="false" value is not valid JSON': DIFFERENCES["string=false not JSON"],
               "text between parameters": DIFFERENCES["stray text"]}


def why_only_theirs(call: tuple[str, dict], rejected: list[str]) -> str | None:
    if set(rejected) & set(ONLY_THEIRS):
        return ONLY_THEIRS[sorted(set(rejected) & set(ONLY_THEIRS))[0]]
    if "unclosed parameter" in rejected and f"<{DSML}invoke" in json.dumps(call[1], ensure_ascii=False):
        return DIFFERENCES["value holding an invoke tag"]
    return None


def loses_nothing(text: str, ours: ParseResult, rejected: list[str], theirs: list[tuple[str, dict]]) -> bool:
    ours_calls = parsed(calls_of(ours))
    returned = all(call in ours_calls or (f'invoke name="{call[0]}"' in ours.content and why_only_theirs(call, rejected))
                   for call in theirs)
    return returned and all(call in theirs or why_only_ours(text, call) is not None for call in ours_calls)


# ---- negative controls: each oracle above fails on the bug it is meant to catch ------------------
def test_negative_control_kind_oracle_catches_stripped_strings():
    """A parser that stripped string values (as SGLang does) fails the kinds' oracle."""
    reply = Reply("", (Invoke(invoke_markup("f", param("a", " x ")), ("f", '{"a": " x "}'), ("f", {"a": "x"}),
                              "string whitespace"),), "tool_calls", "")
    result = parse(reply.text)
    assert reads_as_listed(result, reply)
    stripped = ParseResult(result.content, [ParsedCall(c.name, json.dumps({k: v.strip() for k, v in
                                                                           json.loads(c.arguments).items()}))
                                            for c in result.calls])
    assert not reads_as_listed(stripped, reply)


@needs_sglang
def test_negative_control_noise_oracle_catches_a_lost_call():
    """Dropping a malformed invoke's markup (SGLang's own habit), or reporting a call SGLang lacks
    for no listed reason, fails the data-loss oracle."""
    text = f'<{DSML}invoke name="f">\n{param("p", "x", "false")}</{DSML}invoke>'
    parser = DsmlParser({"f"})
    ours = collect(parser, [text])
    theirs = sglang_one_shot(text)[1]
    assert theirs == [("f", {"p": "x"})] and ours.calls == []
    assert loses_nothing(text, ours, parser.rejected, theirs)
    assert not loses_nothing(text, ParseResult("", []), parser.rejected, theirs)  # the markup dropped
    invented = ParseResult(ours.content, [ParsedCall("f", '{"p": "y"}')])
    assert not loses_nothing(text, invented, parser.rejected, theirs)


def test_listed_differences_are_each_used():
    """Every entry of DIFFERENCES is a kind the generators make or a layout a test checks."""
    import inspect

    source = inspect.getsource(inspect.getmodule(test_listed_differences_are_each_used))
    for key in DIFFERENCES:
        assert source.count(f'"{key}"') >= 2, key
