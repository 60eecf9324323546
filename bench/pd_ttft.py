"""Time to first token of the PD pair (router -> prefill + decode, Mooncake over loopback) against the
colocated server on the same requests, one at a time (issue 16's target: PD <= 1.2x colocated).
All four servers run on threads of this process with the canary model (tests/e2e/pd_pair.py).

    python -m bench.pd_ttft --repeats 10 --words 8,400
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import httpx

from canary.provenance import git_commit
from tests.e2e.pd_pair import pd_pair, serve_state, server_state


def ttft(url: str, words: int, i: int) -> float:
    body = {"model": "canary-moe-v1", "stream": True, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": " ".join(f"w{i}x{k}" for k in range(words))}]}
    started = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as reply:
        for line in reply.iter_lines():
            if '"content"' in line and '"content": ""' not in line:
                return time.perf_counter() - started
    raise RuntimeError("no token came back")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--words", default="8,400", help="prompt lengths in words, comma-separated")
    args = parser.parse_args(argv)
    rows = {}
    with pd_pair() as pair, serve_state(server_state()) as colocated:
        for words in map(int, args.words.split(",")):
            ttft(pair.router, words, -1), ttft(colocated, words, -1)  # warm both paths
            pd, co = [], []
            for i in range(args.repeats):  # interleaved: a load spike on the shared CPU hits both
                pd.append(ttft(pair.router, words, i))
                co.append(ttft(colocated, words, i))
            rows[words] = {"pd_ms": round(statistics.median(pd) * 1e3, 1),
                           "colocated_ms": round(statistics.median(co) * 1e3, 1),
                           "ratio": round(statistics.median(pd) / statistics.median(co), 2)}
            print(words, rows[words], flush=True)
    print(json.dumps({"commit": git_commit(), "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
