"""Request models of the OpenAI chat-completions API, validated strictly (no type coercion), and
the checks that need more than one field (tool_choice against tools, JSON Schemas of tools)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from runtime.server.errors import bad_request
from runtime.server.tool_schemas import VERDICTS

MAX_STOP_STRINGS = 4
MAX_TOP_LOGPROBS = 20


class _Strict(BaseModel):
    # Unknown fields are ignored (clients send extras such as `user`); known ones must have the
    # right JSON type: "5" is not an integer.
    model_config = ConfigDict(strict=True, extra="ignore")


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_\-.]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class CalledFunction(_Strict):
    name: str
    arguments: str


class ToolCallIn(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class TextPart(_Strict):
    type: Literal["text"]
    text: str


# Fields of OpenAI's response message that clients send back as they received them: accepted
# while empty (as this server's replies have them), a 400 otherwise (none is rendered).
ECHOED_MESSAGE_FIELDS = ("refusal", "annotations", "audio", "function_call")


class Message(_Strict):
    # Any other field is a 400: DeepSeek's `prefix` (continue this assistant message) or a
    # `reasoning_content` would change what the model sees, and ignoring them answers another question.
    model_config = ConfigDict(strict=True, extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    refusal: Any = None
    annotations: Any = None
    audio: Any = None
    function_call: Any = None

    @model_validator(mode="after")
    def _content_rules(self) -> Message:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        if self.role == "assistant":
            if not text and not self.tool_calls:
                raise ValueError("an assistant message needs content or tool_calls")
        elif not text:
            raise ValueError(f"a {self.role} message needs non-empty content")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages may carry tool_calls")
        for name in ECHOED_MESSAGE_FIELDS:
            if getattr(self, name):
                raise ValueError(f"{name} is not supported in messages (only null or empty)")
        return self


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Strict):
    model_config = ConfigDict(strict=True, extra="forbid")  # an unknown stream option would be ignored

    include_usage: bool = False
    include_obfuscation: bool | None = None  # no obfuscation field is ever added: only false is honoured


# Options of the OpenAI API this server does not implement: any value but "not set" is a 400, so a
# client never believes an option took effect when it did not.
UNSUPPORTED_OPTIONS = ("functions", "function_call", "audio", "prediction", "web_search_options",
                       "reasoning_effort", "verbosity")
# Informational options: they label the request and change nothing in the output, so accepting
# them is honouring them (prompt caching is automatic here). `service_tier` only as "auto" or
# "default": the one tier there is.
INFORMATIONAL_OPTIONS = ("user", "metadata", "service_tier", "safety_identifier", "prompt_cache_key")
SERVICE_TIERS = (None, "auto", "default")


class ChatCompletionRequest(_Strict):
    # Every field the server reads is declared; anything else is a 400, not silently ignored.
    model_config = ConfigDict(strict=True, extra="forbid")

    model: str
    messages: list[Message] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    # The range torch.Generator.manual_seed accepts: a larger seed is a 400 here, not a rejection later.
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    stop: str | list[str] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    n: int = Field(default=1, ge=1, le=1)
    # Declared so they can be refused when set (check() says why each one is not implemented).
    response_format: dict[str, Any] | None = None
    logit_bias: dict[str, float] | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    modalities: list[str] | None = None
    store: bool | None = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_rules(cls, stop):
        stops = [stop] if isinstance(stop, str) else (stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stop

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def tool_choice_mode(self) -> str:
        """none | auto | required | function (a named function)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "function"
        return self.tool_choice or ("auto" if self.tools else "none")

    def check(self) -> None:
        """Cross-field checks pydantic cannot express on one field; raises ApiError."""
        if self.top_logprobs and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs=true", param="top_logprobs")
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            # One of the two would be ignored: max_completion_tokens replaces the deprecated max_tokens.
            raise bad_request("max_tokens and max_completion_tokens disagree; send one of them",
                              param="max_completion_tokens")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream=true", param="stream_options")
        self._check_options()
        self._check_tool_call_ids()
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise bad_request("tools contain duplicate function names", param="tools")
        if self.tool_choice_mode in ("required", "function") and not self.tools:
            raise bad_request(f"tool_choice {self.tool_choice_mode!r} needs tools", param="tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise bad_request(f"tool_choice names function {self.tool_choice.function.name!r}, which is not "
                              f"in tools", param="tool_choice")
        for i, tool in enumerate(self.tools or []):
            check_tool_schema(tool.function, f"tools[{i}].function.parameters")


    def _check_options(self) -> None:
        for name in UNSUPPORTED_OPTIONS:
            if getattr(self, name) is not None:
                raise bad_request(f"{name} is not supported by this server", param=name, code="unsupported_parameter")
        if self.response_format is not None and self.response_format != {"type": "text"}:
            # JSON mode and JSON-schema outputs need grammar-constrained decoding, which the engine
            # does not have; plain text ({"type": "text"}) is what every reply already is.
            raise bad_request("response_format: only {\"type\": \"text\"} is supported (no constrained JSON "
                              "decoding)", param="response_format", code="unsupported_parameter")
        if self.logit_bias:
            # Greedy rows are an argmax on the device over the batch's logits (batch-invariant and
            # golden-exact); a per-request bias would be a new per-row input to every step.
            raise bad_request("logit_bias is not supported by this server", param="logit_bias",
                              code="unsupported_parameter")
        for name in ("presence_penalty", "frequency_penalty"):
            # Penalties need each request's token counts on the device at every step; 0 (no
            # penalty, the default) is what the sampler does.
            if getattr(self, name) != 0:
                raise bad_request(f"{name} is not supported by this server (only 0)", param=name,
                                  code="unsupported_parameter")
        if self.modalities is not None and self.modalities != ["text"]:
            raise bad_request("modalities: only [\"text\"] is supported", param="modalities",
                              code="unsupported_parameter")
        if self.store:
            raise bad_request("store=true is not supported: this server keeps no completions", param="store",
                              code="unsupported_parameter")
        if self.service_tier not in SERVICE_TIERS:
            raise bad_request("service_tier: this server has one tier, \"auto\" or \"default\"", param="service_tier",
                              code="unsupported_parameter")
        if self.stream_options is not None and self.stream_options.include_obfuscation:
            raise bad_request("stream_options.include_obfuscation=true is not supported: chunks carry no "
                              "obfuscation field", param="stream_options.include_obfuscation",
                              code="unsupported_parameter")
        for i, tool in enumerate(self.tools or []):
            if tool.function.strict:
                # Strict function calling guarantees arguments that match the schema, which needs
                # schema-constrained decoding; the parser only guarantees valid JSON.
                raise bad_request(f"tools[{i}].function.strict=true is not supported (no schema-constrained "
                                  f"decoding)", param=f"tools.{i}.function.strict", code="unsupported_parameter")

    def _check_tool_call_ids(self) -> None:
        """A tool result must answer a call of an earlier assistant message: one that answers no
        call would be rendered as a result of some other call."""
        calls: set[str] = set()
        for i, message in enumerate(self.messages):
            if message.role == "assistant":
                calls.update(call.id for call in message.tool_calls or [])
            elif message.role == "tool" and message.tool_call_id not in calls:
                raise bad_request(f"messages[{i}].tool_call_id {message.tool_call_id!r} matches no tool call of an "
                                  f"earlier assistant message", param=f"messages.{i}.tool_call_id")


def check_tool_schema(function: FunctionDef, param: str) -> None:
    if function.parameters is None:
        return
    error = VERDICTS.error(function.parameters)
    if error is not None:
        raise bad_request(f"parameters of tool {function.name!r}: {error}", param=param)
