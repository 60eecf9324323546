"""Requests, their sampling parameters, and when a request's last token ends it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from runtime.tokenizer import Tokenizer


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    # Constrained decoding of a fixed opening: the first len(forced_ids) tokens are these, whatever
    # the model prefers (tool_choice="required" forces the tool-call block's opening tag).
    forced_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0 <= self.top_logprobs <= 20:
            raise ValueError("top_logprobs must be in [0, 20]")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity semantics: two requests with equal fields are still two requests
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: int = 0  # order of arrival; ties in scheduling go to the earlier request
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    matched_stop: str | int | None = None
    pages: list[int] = field(default_factory=list)
    pages_planned: int = 0  # pages[:pages_planned] were sent in a plan: the runner's table holds them
    num_computed: int = 0  # tokens whose KV is in the cache
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    num_sampled: int = 0  # tokens sampled so far, counted by the sampler (ahead of output_ids when overlapped)
    # PD prefill: when the request finishes (not aborted) its pages stay allocated to it, holding its
    # KV, and `pages` keeps listing them; whoever submitted it frees them (runtime/disagg/prefill.py).
    keep_pages: bool = False

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError(f"request {self.rid}: empty prompt")
        if self.generator is None:
            # A private generator per request: the same seed gives the same tokens whatever the batch.
            seed = self.params.seed if self.params.seed is not None else 0
            self.generator = torch.Generator().manual_seed(seed)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def ids_between(self, start: int, end: int) -> list[int]:
        """`all_ids[start:end]` without building `all_ids`: a decode row needs one id, and copying
        the whole sequence for it was per-row work in every step."""
        split = len(self.prompt_ids)
        if start >= split:
            return self.output_ids[start - split:end - split]
        if end <= split:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[:end - split]

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


def stop_reason(req: Request, tokenizer: Tokenizer, max_model_len: int) -> str | None:
    """Why `req`'s last token ends it, or None (sets `matched_stop`). A function of the request, the
    tokenizer and the length limit, none of them state of the engine thread: the scheduler asks it
    of every token, and the PD decode side, on the event loop, of the first token it streams before
    the engine has the request (runtime/disagg/decode.py)."""
    token, params = req.output_ids[-1], req.params
    if token == tokenizer.eos_token_id and not params.ignore_eos:
        req.matched_stop = token
        return "stop"
    if token in params.stop_token_ids:
        req.matched_stop = token
        return "stop"
    if params.stop:
        # Only the tail can complete a new match: decode enough tokens to cover the longest stop.
        tail_tokens = max(len(s) for s in params.stop) + 8
        tail = tokenizer.decode(req.output_ids[-tail_tokens:])
        for stop in params.stop:
            if stop in tail:
                req.matched_stop = stop
                return "stop"
    if len(req.output_ids) >= params.max_tokens or req.total_len >= max_model_len:
        return "length"
    return None
