"""Offline generation CLI.

    python -m runtime.generate --model tiny-random --requests N --max-tokens T --seed S [--solo] --json
                               [--tp N] [--overlap]

Draws N prompts of mixed lengths from the seed (long enough that the indexer must drop tokens),
generates them batched (or each alone with --solo, same prompts) and prints the token ids,
logprobs, the KV pages still in use afterwards, the step count and the throughput.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time

# Ctrl-C while the modules below import (torch alone takes a second or more) must still stop the run,
# but importing torch swallows a KeyboardInterrupt raised inside it (runtime/interrupts.py): as a
# program, the interrupt is only noted while they import, and `main` ends the run if one came. An
# importer (a test) keeps its own handler.
from runtime.interrupts import INTERRUPTED_RC, held_while_importing

_LATCH = held_while_importing(__name__)

from runtime.config import EngineConfig  # noqa: E402
from runtime.distributed.tp_engine import start_engine  # noqa: E402
from runtime.engine.engine import Engine  # noqa: E402
from runtime.engine.request import Request, SamplingParams  # noqa: E402
from runtime.faults import REGISTRY, FaultSet  # noqa: E402
from runtime.models.loader import load_model  # noqa: E402
from runtime.workload import draw_prompts  # noqa: E402


def request_params(args: argparse.Namespace, index: int) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed * 100_003 + index, ignore_eos=args.ignore_eos,
                          logprobs=True)


def run(args: argparse.Namespace) -> dict:
    loaded = load_model(args.model)
    cfg = EngineConfig(num_pages=args.num_pages, page_size=args.page_size, max_running_requests=args.max_running)
    engine = start_engine(loaded, cfg, faults=FaultSet(args.inject_fault), overlap=args.overlap, tp=args.tp)
    with engine:  # tp > 1: the worker ranks stop with the engine, also on SIGTERM / Ctrl-C
        return _generate(args, engine, loaded)


def _generate(args: argparse.Namespace, engine: Engine, loaded) -> dict:
    prompts = draw_prompts(loaded.config, args.requests, args.seed)
    params = [request_params(args, i) for i in range(len(prompts))]
    started = time.perf_counter()
    steps = 0
    if args.solo:
        finished: list[Request] = []
        for prompt, sp in zip(prompts, params):
            finished += engine.generate([prompt], sp)
            steps = engine.scheduler.step
    else:
        finished = engine.generate(prompts, params)
        steps = engine.scheduler.step
    elapsed = time.perf_counter() - started
    generated = sum(len(r.output_ids) for r in finished)
    return {
        "model": loaded.name,
        "requests": [{"prompt_ids": r.prompt_ids, "token_ids": r.output_ids, "logprobs": r.output_logprobs,
                      "finish_reason": r.finish_reason} for r in finished],
        "pages_in_use": engine.pages_in_use,
        "steps": steps,
        "tokens_per_s": generated / elapsed if elapsed > 0 else 0.0,
        "faults": list(engine.faults.names),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m runtime.generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-random", help="model directory or preset name")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--solo", action="store_true", help="run each request alone (same prompts)")
    parser.add_argument("--json", action="store_true", help="print the full result as JSON")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--num-pages", type=int, default=EngineConfig.num_pages)
    parser.add_argument("--page-size", type=int, default=EngineConfig.page_size)
    parser.add_argument("--max-running", type=int, default=EngineConfig.max_running_requests)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (gloo on CPU)")
    parser.add_argument("--overlap", action="store_true", help="overlap scheduler loop (same tokens as normal)")
    parser.add_argument("--inject-fault", action="append", default=[], choices=sorted(REGISTRY), metavar="NAME",
                        help="switch on a named fault (repeatable): " + ", ".join(sorted(REGISTRY)))
    args = parser.parse_args(argv)
    if args.requests < 1:
        parser.error("--requests must be >= 1")
    if args.max_tokens < 1:
        parser.error("--max-tokens must be >= 1")
    if args.tp < 1:
        parser.error("--tp must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    if _LATCH.release():  # the imports are in: Ctrl-C raises again
        return INTERRUPTED_RC
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C does, so the engine's shutdown stops the worker ranks.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        result = run(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    if args.json:
        print(json.dumps(result))
    else:
        n = len(result["requests"])
        tokens = sum(len(r["token_ids"]) for r in result["requests"])
        print(f"{n} requests, {tokens} tokens in {result['steps']} steps, {result['tokens_per_s']:.1f} tok/s, "
              f"pages in use after: {result['pages_in_use']}")
        for i, r in enumerate(result["requests"][:4]):
            print(f"  [{i}] prompt {len(r['prompt_ids'])} tokens -> {r['token_ids'][:12]}... ({r['finish_reason']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
