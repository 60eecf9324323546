"""Session scenarios for the harness: the canary corpus's held-out sessions, phrased for the target.

The embedded canary model gets exactly the prompts it was trained on (the corpus system prompt);
any other model (SGLang, vLLM with a real LLM) gets the same tools and user turns plus a plain-words
instruction to call the tools and to begin every answer with the session nonce.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Held-out seeds (training uses seeds >= runtime.train.corpus.TRAIN_SEED_BASE).
SCENARIO_SEED_BASE = 500_000

GENERIC_SYSTEM = ("You are a careful assistant with tools. Session nonce: {nonce}. When a request needs a tool, "
                  "call the tool with exactly the values the user gave. Begin every final answer with [{nonce}] "
                  "and never mention any other nonce.")


@dataclass(frozen=True)
class Scenario:
    index: int
    seed: int
    nonce: str
    system: str
    tool_choice: str
    user_turns: tuple[str, ...]
    tools: list[dict[str, Any]]
    schemas: dict[str, dict]
    # Per user turn, the (name, arguments) of each tool call the corpus says the turn makes: the
    # required-calls oracle holds a turn's calls to these.
    required_calls: tuple[tuple[tuple[str, dict[str, Any]], ...], ...] = ()


def make_scenario(index: int, turns: int | None, generic: bool) -> Scenario:
    from runtime.train.corpus import make_session
    from runtime.train.tools import SCHEMAS, TOOLS

    seed = SCENARIO_SEED_BASE + index
    session = make_session(seed)
    user_turns = tuple(t.user for t in session.turns)
    required = tuple(tuple((c.name, dict(c.arguments)) for c in t.calls) for t in session.turns)
    if turns is not None:
        user_turns, required = user_turns[:turns], required[:turns]
    system = GENERIC_SYSTEM.format(nonce=session.nonce) if generic else session.system
    return Scenario(index, seed, session.nonce, system, session.tool_choice, user_turns, TOOLS, SCHEMAS, required)


def execute_tool(name: str, arguments: dict[str, Any]) -> str:
    """Run a tool locally and deterministically; the result is what the model sees next."""
    import json

    from runtime.train.tools import execute

    return json.dumps(execute(name, arguments))
