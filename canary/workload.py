"""What the gate's sessions exercise beyond greedy tool-call turns: the production paths that break.

Per session, drawn from its seed (so a run is reproducible and a golden store stays valid):
- a seeded sampling probe (temperature and top-p with a seed): the turn's final request sent again
  sampled; the load-vs-solo oracle replays every seeded request and it must match token for token;
- a stop-string probe: the turn's final request sent again with a stop string cut from its own
  greedy answer; the reply must be that answer up to the stop string (canary/oracles/stop_strings.py);
- a multi-byte probe: the turn's final request again with multi-byte text (CJK, emoji with ZWJ and
  variation selectors, combining marks) in its user message and its tool results, which the server
  must carry through the chat template, the tokenizer and the stream unharmed.
Client aborts are `DriverOptions.abort_ratio` (the driver's own). A probe's reply is checked by
every oracle that does not depend on the exact greedy answer (and, like every request, by the golden
store and the load-vs-solo replays), and never enters the conversation: the canary model was trained
on ASCII sessions, and multi-byte notes in its context make it misquote values (measured: 14 of 16
sessions failed grounding with a note in every tool result), which would be a false alarm.

The small-pool run (canary/small_pool.py) is the same workload against a server whose KV pool is
smaller than its working set, so requests really are preempted and recomputed.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

# Each is a different way multi-byte text goes wrong: 3-byte CJK, 4-byte emoji (one with a
# variation selector, one a ZWJ sequence), a combining acute (e + U+0301, not U+00E9), Hangul, Greek.
MULTIBYTE_NOTES = ("東京の天気は晴れ", "雨のち晴れ 🌧️→☀️", "cafe\u0301 ou café", "👩\u200d💻 Zoë Ångström",
                   "서울 날씨", "Ελληνικά ✓")
# The canary model is sure of nearly every token (in the CPU golden store 88 of 21,858 positions
# have a top-2 gap under 4 nats): at temperature 0.8 / top-p 0.9 a draw never mattered, and a sampler
# drawing from one generator for the whole batch passed the gate (measured). Temperature 2 (the API's
# maximum) with top-p 0.99 keeps two or more tokens where the gap is under ~9 nats, so the seed
# decides the output; the reply is short (max_tokens 64), since it is off the model's distribution.
SAMPLED_TEMPERATURE = 2.0
SAMPLED_TOP_P = 0.99
SAMPLED_MAX_TOKENS = 64
# The gate's mix (canary/pytest_plugin.py defaults): fractions of sessions with each probe, and of
# streamed requests the client aborts mid-stream. 80 sessions: 10-20 probes of each kind, ~13 aborts.
DEFAULT_SAMPLED_RATIO = 0.25
DEFAULT_STOP_RATIO = 0.25
DEFAULT_MULTIBYTE_RATIO = 0.25
DEFAULT_ABORT_RATIO = 0.05
# Probe turns are drawn from this many, whatever `--turns` cuts a session to, so a shorter run's
# requests are numbered as the full run's are and its transcripts line up with the golden store.
MAX_TURNS = 5
# The small-pool run: 24 sessions x 2 turns of canary-moe-v2 (DeepSeek's V4 prompts: a first turn
# needs ~65 pages of 16 tokens, a second up to ~115) hold ~1,800 pages at once. 144 pages admit two
# first turns and leave too little for both to grow, so the scheduler preempts (9 preemptions on the
# CPU; 96 pages, v1's figure, admit one request at a time and preempt nothing: docs/results.md).
DEFAULT_SMALL_POOL_PAGES = 144


@dataclass(frozen=True)
class SessionMix:
    sampled_turn: int | None  # the user turn whose final request gets a seeded sampling probe
    stop_turn: int | None  # the user turn whose final answer gets a stop-string probe
    multibyte_turn: int | None  # the user turn whose final request gets a multi-byte probe
    rng_seed: str  # for the probes' own draws (stop string, sampling seed)


def plan_session(options, scenario) -> SessionMix:
    """`options`: DriverOptions (its sampled/stop/multibyte ratios and seed); `scenario`: the session."""
    rng = random.Random(f"mix:{options.seed}:{scenario.seed}")

    def pick(ratio: float) -> int | None:
        hit = rng.random() < ratio  # drawn even at ratio 0, so one knob does not move the others' picks
        turn = rng.randrange(MAX_TURNS)
        return turn if hit and turn < len(scenario.user_turns) else None

    sampled, stop, multibyte = pick(options.sampled_ratio), pick(options.stop_ratio), pick(options.multibyte_ratio)
    return SessionMix(sampled, stop, multibyte, f"probe:{options.seed}:{scenario.seed}")


def multibyte_messages(messages: list[dict[str, Any]], mix: SessionMix, turn: int) -> list[dict[str, Any]]:
    """`messages` with a multi-byte note after the last user message and in each tool result after
    it (kept as UTF-8 in the JSON, not `\\u` escapes, so the bytes reach the tokenizer)."""
    rng = random.Random(f"{mix.rng_seed}:multibyte:{turn}")
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    out = [dict(m) for m in messages]
    out[last_user]["content"] = f"{out[last_user]['content']} ({rng.choice(MULTIBYTE_NOTES)})"
    for m in out[last_user + 1:]:
        if m["role"] == "tool":
            m["content"] = json.dumps({**json.loads(m["content"]), "note": rng.choice(MULTIBYTE_NOTES)},
                                      ensure_ascii=False)
    return out


def sampled_request(kwargs: dict[str, Any], mix: SessionMix, turn: int) -> dict[str, Any]:
    """The request sent again with seeded temperature/top-p sampling: its seed alone fixes its output."""
    seed = random.Random(f"{mix.rng_seed}:sampled:{turn}").randrange(2**31)
    return {**kwargs, "temperature": SAMPLED_TEMPERATURE, "top_p": SAMPLED_TOP_P, "seed": seed,
            "max_tokens": SAMPLED_MAX_TOKENS}


def choose_stop(content: str, mix: SessionMix, turn: int) -> str | None:
    """A stop string cut from the answer itself, 1-4 characters from its second half (past the
    nonce), so the reply must end right before its first occurrence. None: nothing to cut."""
    rng = random.Random(f"{mix.rng_seed}:stop:{turn}")
    if len(content) < 8:
        return None
    for _ in range(8):
        start = rng.randrange(len(content) // 2, len(content) - 1)
        stop = content[start:start + rng.randint(1, 4)]
        if stop.strip() and content.find(stop) > 0:
            return stop
    return None
