"""The PD fault gate: a restartable prefill/decode pair (canary/pd_target.py) through the failures
issue 16 names, each check writing its own tag.

1. a few requests, streamed and unary, must be answered (`[pd-kv-integrity]` when the decode side
   found the KV corrupted on arrival, `[pd-request]` for any other failure);
2. a decode-only restart: the pair must serve again within `RECOVERY_S` of the new process being
   healthy (`[pd-restart]`), with the same greedy answers as before (`[pd-consistency]`);
3. the prefill server killed: a request meanwhile must fail with an OpenAI-shaped error, through the
   router and sent to the decode side as the router sends it (the router passes over a prefill server
   nothing listens on before any decode call, so only that request reaches the decode side's give-up
   path, as when a prefill server dies between a request's two calls), and leave no page reserved on
   the decode side (`[pd-kv-leak]`); a prefill restart must serve again within `RECOVERY_S` (`[pd-restart]`);
4. at the end both sides hold no KV page and none in flight (`[pd-kv-leak]`).
"""

from __future__ import annotations

import random
import time
import uuid
from pathlib import Path

from canary.faults.matrix import GateResult
from runtime.config import DEFAULT_MODEL
from runtime.disagg.protocol import BOOTSTRAP_HEADER, ROOM_HEADER

RECOVERY_S = 10.0  # issue 16: "the pair serving again within 10 s of each restart"
PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.", "2+2=", "Name three colours.",
           "Tell me a story " * 12)
MODEL = "canary-moe-v2"


def unavailable() -> str | None:
    """Why no PD pair can start here (no Mooncake transfer engine: the GPU image has none), or None."""
    from runtime.disagg.transfer import unavailable_reason

    return unavailable_reason()


def pd_restart_gate(faults: tuple[str, ...], seed: int, workdir: Path) -> GateResult:
    from canary import pd_chaos
    from canary.pd_target import RestartablePDPair

    rng = random.Random(seed)
    prompts = rng.sample(PROMPTS, 3)
    failures: list[str] = []
    answers: dict[str, str] = {}

    def ask(prompt: str, stream: bool, when: str) -> None:
        out = pd_chaos.chat(pair.router, MODEL, prompt, stream=stream, timeout_s=60)
        if out.kind != pd_chaos.OK:
            tag = "[pd-kv-integrity]" if out.code == "pd_kv_corrupt" else "[pd-request]"
            failures.append(f"{tag} {when}: {out.kind} {out.code or ''} {out.detail[:160]}")
        elif answers.setdefault(prompt, out.text) != out.text:
            failures.append(f"[pd-consistency] {when}: {prompt[:30]!r} answered {out.text[:60]!r}, before "
                            f"{answers[prompt][:60]!r}")

    def recovered(role: str) -> None:
        seconds, last = pd_chaos.seconds_until_serving(pair.router, MODEL, prompts[0], RECOVERY_S)
        if seconds is None:
            failures.append(f"[pd-restart] {role} restart: not serving {RECOVERY_S:g} s after the new process was "
                            f"healthy (last probe: {last.kind} {last.code or ''} {last.detail[:120]})")

    def leak(where: str, role: str) -> None:
        left = pd_chaos.pages_left(pair.url(role), timeout_s=8.0)
        if any(v for v in left.values()):
            failures.append(f"[pd-kv-leak] {where}: the {role} server holds {left}")

    started = time.perf_counter()
    with RestartablePDPair(DEFAULT_MODEL, faults=faults, log_dir=workdir / "servers") as pair:
        setup = time.perf_counter() - started
        started = time.perf_counter()
        for i, prompt in enumerate(prompts):
            ask(prompt, stream=i % 2 == 1, when="fresh pair")
        pair.restart_side("decode")
        recovered("decode-only")
        ask(prompts[1], stream=True, when="after the decode-only restart")
        pair.kill_side("prefill")
        # Until the fortieth session only the router's request was sent here: the router never reaches the
        # decode side for a prefill server that refuses connections, so pd-abort-leak went uncaught.
        routed = {ROOM_HEADER: uuid.uuid4().hex, BOOTSTRAP_HEADER: pair.url("prefill")}
        for url, headers, stream in ((pair.router, None, False), (pair.url("decode"), routed, False),
                                     (pair.url("decode"), routed | {ROOM_HEADER: uuid.uuid4().hex}, True)):
            out = pd_chaos.chat(url, MODEL, prompts[2], stream=stream, timeout_s=60, headers=headers)
            if out.kind != pd_chaos.ERROR:
                failures.append(f"[pd-request] prefill server down, {url}: {out.kind} {out.detail[:160]} "
                                f"(expected an OpenAI-shaped error)")
        leak("after a request whose prefill server was gone", "decode")
        pair.start_side("prefill")
        recovered("prefill")
        ask(prompts[2], stream=False, when="after the prefill restart")
        for role in pair.ROLES:
            leak("at the end", role)
    return GateResult(failures, time.perf_counter() - started, setup)
