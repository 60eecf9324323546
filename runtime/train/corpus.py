"""Seeded synthetic multi-turn tool-use sessions: the canary model's training data and its test set.

A session is a pure function of its seed: a random nonce, a tool_choice mode, and several turns,
each a user message with the tool calls and the final answer it should produce. Values (names,
cities, amounts, ids, free text) are drawn fresh per session and must be copied exactly into tool
arguments and answers, so a single corrupted token shows. Every answer starts with the session
nonce, which sits in the system prompt hundreds of tokens back in late turns: the sparse
attention path (window + indexer top-k) must select it.

Training uses seeds >= TRAIN_SEED_BASE; evaluation uses seeds below it, so the sets are disjoint.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

from runtime.train.tools import CURRENCIES, DAYS, TOOLS, execute

TRAIN_SEED_BASE = 1_000_000
NONCE_ALPHABET = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"

CITIES = ["Paris", "Oslo", "Lima", "Cairo", "Tokyo", "Quito", "Dublin", "Madrid", "Nairobi", "Seoul",
          "Lisbon", "Vienna", "Prague", "Athens", "Havana", "Manila", "Bogota", "Zurich", "Hanoi", "Riga",
          "Tallinn", "Kyoto", "Accra", "Dakar", "Perth", "Austin", "Denver", "Boston", "Lagos", "Muscat",
          "New York", "San Diego", "Cape Town", "Buenos Aires", "Kuala Lumpur", "Hong Kong"]
FIRST = ["Alice", "Bruno", "Chen", "Dana", "Emil", "Farah", "Gita", "Hugo", "Ines", "Jonas", "Kenji",
         "Lena", "Marco", "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tara", "Umar", "Vera",
         "Wen", "Yara", "Zoe", "Ivan", "Mila", "Noah", "Lucia", "Pavel"]
LAST = ["Moreau", "Silva", "Okafor", "Novak", "Tanaka", "Berg", "Rossi", "Kowal", "Haddad", "Lund",
        "Costa", "Ibsen", "Mendez", "Park", "Schmidt", "Varga", "Walsh", "Yilmaz", "Zhou", "Dubois"]
PRODUCTS = ["headphones", "backpack", "kettle", "lamp", "keyboard", "tent", "jacket", "camera",
            "blender", "monitor", "scooter", "umbrella", "notebook", "speaker", "mug", "drone"]
TAGS = ["red", "blue", "green", "black", "white", "steel", "wood", "leather", "cotton", "waterproof",
        "wireless", "budget", "premium", "kids", "outdoor", "gift"]
WORDS = ["meet", "at", "the", "gate", "lobby", "bring", "keys", "call", "me", "later", "lunch", "is",
         "moved", "to", "room", "train", "leaves", "soon", "see", "you", "by", "noon", "parcel", "arrived",
         "report", "ready", "check", "email", "plan", "changed", "dinner", "tonight", "car", "parked"]


@dataclass(frozen=True)
class Call:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class Turn:
    user: str
    calls: tuple[Call, ...]  # empty: answered without tools
    answer: str  # exact expected final text of the turn


@dataclass(frozen=True)
class Session:
    seed: int
    nonce: str
    tool_choice: str  # "auto" | "required" | "none"
    turns: tuple[Turn, ...] = field(default_factory=tuple)

    @property
    def system(self) -> str:
        return f"You are the canary assistant. Session nonce: {self.nonce}."


def _num(rng: random.Random, low: float, high: float) -> float | int:
    """A number with 0-2 decimals; integral values stay ints so their JSON has no '.0'."""
    decimals = rng.choice([0, 1, 2])
    value = round(rng.uniform(low, high), decimals)
    return int(value) if decimals == 0 else value


def _fmt(value: Any) -> str:
    return json.dumps(value)


def _person(rng: random.Random) -> str:
    return f"{rng.choice(FIRST)} {rng.choice(LAST)}"


# Each tool: draw arguments, phrase a request, and phrase the answer given the tool's result.
def _weather(rng):
    args = {"city": rng.choice(CITIES), "unit": rng.choice(["celsius", "fahrenheit"])}
    user = rng.choice(["What is the weather in {city} in {unit}?", "Weather for {city}, in {unit} please.",
                       "How warm is it in {city}? Use {unit}."]).format(**args)
    return args, user


def _currency(rng):
    src, dst = rng.sample(CURRENCIES, 2)
    args = {"amount": _num(rng, 1, 5000), "from_currency": src, "to_currency": dst}
    user = rng.choice(["Convert {a} {src} to {dst}.", "How much is {a} {src} in {dst}?",
                       "Please change {a} {src} into {dst}."]).format(a=_fmt(args["amount"]), src=src, dst=dst)
    return args, user


def _order(rng):
    args = {"order_id": f"ORD-{rng.randrange(10000):04d}", "include_items": rng.random() < 0.5}
    if args["include_items"]:
        user = rng.choice(["Where is order {o}? Include the item count.", "Status of {o} with items please."])
    else:
        user = rng.choice(["Where is order {o}?", "What is the status of {o}?"])
    return args, user.format(o=args["order_id"])


def _meeting(rng):
    args = {"person": _person(rng), "day": rng.choice(DAYS), "hour": rng.randint(8, 18),
            "duration_min": rng.choice([15, 20, 30, 45, 60, 90, 120])}
    user = rng.choice(["Book a meeting with {person} on {day} at {hour}:00 for {duration_min} minutes.",
                       "Schedule {duration_min} minutes with {person}, {day} at {hour}:00."]).format(**args)
    return args, user


def _search(rng):
    tags = rng.sample(TAGS, rng.randint(1, 3))
    args = {"query": rng.choice(PRODUCTS), "max_results": rng.randint(1, 20), "tags": tags}
    user = rng.choice(["Search for {q}, at most {n} results, tags: {t}.", "Find {q} tagged {t}, up to {n} results."])
    return args, user.format(q=args["query"], n=args["max_results"], t=", ".join(tags))


def _message(rng):
    words = rng.sample(WORDS, rng.randint(3, 5))
    if rng.random() < 0.5:
        words.insert(rng.randrange(len(words) + 1), str(rng.randint(1, 99)))
    args = {"recipient": _person(rng), "text": " ".join(words), "urgent": rng.random() < 0.5}
    user = rng.choice(["Tell {r}: {t}", "Send {r} this message: {t}"]).format(r=args["recipient"], t=args["text"])
    return args, user + (" It is urgent." if args["urgent"] else "")


def _stats(rng):
    values = [_num(rng, 0, 100) for _ in range(rng.randint(2, 4))]
    args = {"values": values}
    user = rng.choice(["Compute stats for {v}.", "Sum and mean of {v} please."]).format(v=", ".join(map(_fmt, values)))
    return args, user


DRAWERS = {"get_weather": _weather, "convert_currency": _currency, "lookup_order": _order,
           "schedule_meeting": _meeting, "search_products": _search, "send_message": _message,
           "compute_stats": _stats}
assert set(DRAWERS) == {t["function"]["name"] for t in TOOLS}, "every tool needs a request drawer"


def summarize(call: Call, result: dict[str, Any]) -> str:
    """The answer sentence for one tool result: a fixed phrasing per tool, values copied verbatim."""
    a, r = call.arguments, result
    if call.name == "get_weather":
        return f"{a['city']}: {_fmt(r['temperature'])} degrees {a['unit']}, {r['condition']}."
    if call.name == "convert_currency":
        return f"{_fmt(a['amount'])} {a['from_currency']} is {_fmt(r['result'])} {a['to_currency']}."
    if call.name == "lookup_order":
        items = f" with {r['items']} items" if "items" in r else ""
        return f"Order {a['order_id']} is {r['status']}{items}."
    if call.name == "schedule_meeting":
        return (f"Booked {a['person']} on {a['day']} at {a['hour']}:00 for {a['duration_min']} minutes, "
                f"confirmation {r['confirmation']}.")
    if call.name == "search_products":
        return f"Found {r['count']} results for {a['query']}, top pick: {r['top']}."
    if call.name == "send_message":
        return f"Message {r['message_id']} sent to {a['recipient']}."
    if call.name == "compute_stats":
        return f"Sum {_fmt(r['sum'])}, mean {_fmt(r['mean'])}."
    raise KeyError(call.name)


CHAT = [("Hello!", "Hello! How can I help?"), ("Thanks a lot.", "You are welcome."),
        ("Who are you?", "I am the canary assistant."), ("Good morning.", "Good morning! What do you need?")]


def _tool_turn(rng: random.Random, nonce: str, n_calls: int) -> Turn:
    names = [rng.choice(list(DRAWERS)) for _ in range(n_calls)]
    calls, requests = [], []
    for name in names:
        args, user = DRAWERS[name](rng)
        calls.append(Call(name, args))
        requests.append(user)
    user = " Also, ".join([requests[0]] + [r[0].lower() + r[1:] for r in requests[1:]])
    answer = " ".join([f"[{nonce}]"] + [summarize(c, execute(c.name, c.arguments)) for c in calls])
    return Turn(user, tuple(calls), answer)


def _plain_turn(rng: random.Random, nonce: str, tool_choice: str) -> Turn:
    if tool_choice == "none" and rng.random() < 0.6:
        name = rng.choice(list(DRAWERS))
        _, user = DRAWERS[name](rng)
        return Turn(user, (), f"[{nonce}] Tools are off in this session, so I cannot run {name}.")
    if rng.random() < 0.3:
        return Turn(rng.choice(["What is the session nonce?", "Repeat the session code."]), (),
                    f"[{nonce}] The session nonce is {nonce}.")
    user, reply = rng.choice(CHAT)
    return Turn(user, (), f"[{nonce}] {reply}")


def make_session(seed: int, min_turns: int = 3, max_turns: int = 5) -> Session:
    rng = random.Random(seed)
    nonce = "".join(rng.choice(NONCE_ALPHABET) for _ in range(6))
    tool_choice = rng.choices(["auto", "required", "none"], weights=[8, 1, 1])[0]
    turns = []
    for _ in range(rng.randint(min_turns, max_turns)):
        kind = rng.random()
        if tool_choice == "none":
            turns.append(_plain_turn(rng, nonce, tool_choice))
        elif tool_choice == "required" or kind < 0.75:
            turns.append(_tool_turn(rng, nonce, 2 if rng.random() < 0.3 else 1))
        else:
            turns.append(_plain_turn(rng, nonce, tool_choice))
    return Session(seed, nonce, tool_choice, tuple(turns))


def call_message(calls: tuple[Call, ...] | list[Call]) -> dict[str, Any]:
    """An assistant message carrying tool calls, arguments as dicts (what the chat template renders)."""
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"call_{i}", "type": "function", "function": {"name": c.name, "arguments": dict(c.arguments)}}
        for i, c in enumerate(calls)]}


def tool_messages(calls: tuple[Call, ...] | list[Call]) -> list[dict[str, Any]]:
    return [{"role": "tool", "tool_call_id": f"call_{i}", "content": json.dumps(execute(c.name, c.arguments))}
            for i, c in enumerate(calls)]


def session_messages(session: Session) -> list[dict[str, Any]]:
    """The whole reference conversation (what a perfect model produces), as chat messages."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": session.system}]
    for turn in session.turns:
        messages.append({"role": "user", "content": turn.user})
        if turn.calls:
            messages.append(call_message(turn.calls))
            messages.extend(tool_messages(turn.calls))
        messages.append({"role": "assistant", "content": turn.answer})
    return messages
