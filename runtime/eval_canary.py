"""`python -m runtime.eval_canary`: play held-out canary sessions through the real engine scheduler.

Each session is the corpus generator's reference conversation (seeds below TRAIN_SEED_BASE, never
trained on). Up to `--concurrency` sessions run at once; every request is rendered with the model's
own chat template, generated greedily by `Engine.step()`, parsed with the server's DSML parser and
compared exactly: tool calls by name + parsed arguments, answers by text. Tools run locally. After a
miss the reference message is used for the history (teacher forcing), so one error costs one
score, not the rest of the session.

sparse_fraction: of all decode-attention steps (one per generated token after the first), the share
whose query saw more than window + topk tokens, i.e. where the indexer's selection dropped at least
one earlier token. `late` restricts it to turns 3 and later.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import deque
from dataclasses import dataclass, field

from runtime.config import EngineConfig
from runtime.engine.engine import Engine
from runtime.engine.request import SamplingParams
from runtime.env import Env
from runtime.faults import FaultSet
from runtime.models.loader import LoadedModel, load_model
from runtime.server.dsml import parse as parse_dsml
from runtime.train.corpus import TRAIN_SEED_BASE, Call, Session, call_message, make_session, tool_messages
from runtime.train.template import EOS, render
from runtime.train.tools import TOOL_NAMES, TOOLS

LATE_TURN = 2  # turns with index >= this count as "late" (contexts far beyond window + topk)


@dataclass
class Tally:
    calls: int = 0
    calls_ok: int = 0
    answers: int = 0
    answers_ok: int = 0
    decode_steps: int = 0
    sparse_steps: int = 0
    late_decode_steps: int = 0
    late_sparse_steps: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    failures: list[dict] = field(default_factory=list)


class SessionPlayer:
    """One session's conversation state; yields prompts and scores the replies."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.messages: list[dict] = [{"role": "system", "content": session.system}]
        self.turn = 0
        self.awaiting_answer = False  # False: the turn's first request (calls or a direct answer)
        self.messages.append({"role": "user", "content": session.turns[0].user})

    @property
    def done(self) -> bool:
        return self.turn >= len(self.session.turns)

    def prompt(self) -> str:
        return render(self.messages, TOOLS, self.session.tool_choice)

    def consume(self, text: str, tally: Tally) -> None:
        turn = self.session.turns[self.turn]
        parsed = parse_dsml(text, set(TOOL_NAMES))
        if turn.calls and not self.awaiting_answer:
            got = [_as_call(c.name, c.arguments) for c in parsed.calls]
            tally.calls += len(turn.calls)
            ok = [i < len(got) and got[i] == c for i, c in enumerate(turn.calls)]
            tally.calls_ok += sum(ok)
            if not all(ok) or len(got) != len(turn.calls):
                tally.failures.append({"seed": self.session.seed, "turn": self.turn, "kind": "call", "output": text})
            self.messages.append(call_message(turn.calls))
            self.messages.extend(tool_messages(turn.calls))
            self.awaiting_answer = True
            return
        tally.answers += 1
        if text == turn.answer and not parsed.calls:
            tally.answers_ok += 1
        else:
            tally.failures.append({"seed": self.session.seed, "turn": self.turn, "kind": "answer", "output": text,
                                   "expected": turn.answer})
        self.messages.append({"role": "assistant", "content": turn.answer})
        self.turn += 1
        self.awaiting_answer = False
        if not self.done:
            self.messages.append({"role": "user", "content": self.session.turns[self.turn].user})


def _as_call(name: str, arguments: str) -> Call | None:
    try:
        return Call(name, json.loads(arguments))
    except ValueError:
        return None


def evaluate(loaded: LoadedModel, seeds: list[int], concurrency: int, faults: tuple[str, ...] = (),
             max_tokens: int = 256, env: Env | None = None) -> dict:
    if any(s >= TRAIN_SEED_BASE for s in seeds):
        raise ValueError("evaluation seeds must lie below TRAIN_SEED_BASE (the training range)")
    cfg = loaded.config
    engine = Engine(loaded, EngineConfig(num_pages=max(512, 96 * concurrency),
                                         max_running_requests=max(1, concurrency)),
                    faults=FaultSet(faults), env=env or Env(num_threads=1))
    tok = engine.tokenizer
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    pending = deque(SessionPlayer(make_session(s)) for s in seeds)
    active: dict[str, tuple[SessionPlayer, int]] = {}
    tally = Tally()
    counter = 0

    def submit(player: SessionPlayer) -> None:
        nonlocal counter
        ids = tok.encode(player.prompt())
        tally.prompt_tokens += len(ids)
        rid = f"s{player.session.seed}-r{counter}"
        counter += 1
        engine.add_request(ids, params, rid)
        active[rid] = (player, len(ids))

    started = time.perf_counter()
    while pending or active:
        while pending and len({id(p) for p, _ in active.values()}) < concurrency:
            submit(pending.popleft())
        for req in engine.step().finished:
            player, prompt_len = active.pop(req.rid)
            out = req.output_ids
            tally.generated_tokens += len(out)
            # Decode steps feed positions prompt_len .. prompt_len + n - 2; the query at position q
            # sees q + 1 tokens, and the selection drops some once q + 1 > window + topk.
            steps = range(prompt_len, prompt_len + len(out) - 1)
            sparse = sum(1 for q in steps if q + 1 > cfg.selected_tokens)
            tally.decode_steps += len(steps)
            tally.sparse_steps += sparse
            if player.turn >= LATE_TURN:
                tally.late_decode_steps += len(steps)
                tally.late_sparse_steps += sparse
            text = tok.decode(out)
            player.consume(text.removesuffix(EOS), tally)
            if not player.done:
                submit(player)
    wall = time.perf_counter() - started
    return {
        "model": loaded.name, "sessions": len(seeds), "concurrency": concurrency, "faults": list(faults),
        "seeds": [min(seeds), max(seeds)] if seeds else [],
        "tool_call_exact_match": tally.calls_ok / max(1, tally.calls), "tool_calls": tally.calls,
        "answer_exact_match": tally.answers_ok / max(1, tally.answers), "answers": tally.answers,
        "sparse_fraction": tally.sparse_steps / max(1, tally.decode_steps),
        "sparse_fraction_late_turns": tally.late_sparse_steps / max(1, tally.late_decode_steps),
        "generated_tokens": tally.generated_tokens, "prompt_tokens": tally.prompt_tokens,
        "wall_s": round(wall, 2), "tokens_per_s": round(tally.generated_tokens / wall, 1),
        "failures": tally.failures[:5], "num_failures": len(tally.failures),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m runtime.eval_canary", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="golden/models/canary-moe-v2")
    ap.add_argument("--sessions", type=int, default=50)
    ap.add_argument("--seed-base", type=int, default=0)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--fault", action="append", default=[], help="inject a runtime fault (repeatable)")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args = ap.parse_args(argv)
    # One intra-op thread unless DSV4_NUM_THREADS says otherwise: this model's matmuls are tiny, and
    # on a busy 2-core machine torch's thread pool spins (measured: 5 ms vs 21 us per [16,192]x[192,96]).
    env = Env.load()
    env = env if env.num_threads else Env(faults=env.faults, num_threads=1)
    loaded = load_model(args.model)
    result = evaluate(loaded, list(range(args.seed_base, args.seed_base + args.sessions)), args.concurrency,
                      tuple(args.fault), env=env)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            if key != "failures":
                print(f"{key:>28}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
