"""The stop-string oracle: a request sent with a stop string cut from its own greedy answer must
return that answer up to (not including) the stop string's first occurrence, with finish_reason
"stop". Catches a stop string matched late (text after it leaks out, typically when it spans two
tokens or two stream chunks), matched early, or matched but left in the reply."""

from __future__ import annotations

from canary.oracles.turn import Failure, Turn


def check_stop_string(turn: Turn, answer: str, stop: str) -> list[Failure]:
    """`turn`: the reply to the request with `stop`; `answer`: the same request's greedy reply without it."""
    expected = answer[:answer.find(stop)]
    problems = []
    if turn.finish_reason != "stop":
        problems.append(f"finish_reason {turn.finish_reason!r}, want 'stop'")
    if stop in turn.content:
        problems.append("the stop string is in the reply")
    if turn.content != expected:
        problems.append(f"reply {turn.content!r} != the answer up to the stop string {expected!r}")
    if turn.tool_calls:
        problems.append(f"{len(turn.tool_calls)} tool calls in a reply cut from a plain answer")
    if not problems:
        return []
    return [Failure("stop-string", turn.session, turn.turn, f"stop {stop!r}: " + "; ".join(problems),
                    turn.content[:300])]
