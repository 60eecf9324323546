"""`python -m canary golden record|check|compare`: offline golden transcripts through the real engine.

Scenarios are seeded prompts (mixed lengths, long enough for the sparse path) decoded greedily
with top-k logprobs. `check` exits 0 when every scenario matches (or diverges only at a recorded
near-tie), 3 on a regression, and anything else on an error, so bisect can tell them apart.
`compare A B` says whether two stores (offline or the gate's) hold the same transcripts, metadata aside:
the evidence `canary.gate.SAME_NUMERICS_AS` needs before one GPU kind is checked against another's store.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from canary.oracles.golden import (
    DEFAULT_NEAR_TIE,
    EXIT_REGRESSION,
    Transcript,
    first_divergence,
    read_store,
    write_store,
)
from canary.oracles.logprob_close import first_mismatch
from canary.provenance import device_name, git_commit, versions

SCENARIO_SEED = 20261130
TOP_K = 5


def run_scenarios(model: str, num: int, max_tokens: int) -> tuple[dict, list[Transcript]]:
    from runtime.engine.engine import Engine
    from runtime.engine.request import SamplingParams
    from runtime.models.loader import load_model
    from runtime.workload import draw_prompts

    loaded = load_model(model)
    engine = Engine(loaded)
    prompts = draw_prompts(loaded.config, num, SCENARIO_SEED, token_limit=min(256, loaded.tokenizer.vocab_size))
    params = SamplingParams(max_tokens=max_tokens, logprobs=True, top_logprobs=TOP_K)
    finished = engine.generate(prompts, params)
    transcripts = [Transcript(f"prompt-{i:03d}", r.output_ids, [list(t) for t in r.output_top_logprobs],
                              {"prompt_ids": r.prompt_ids}) for i, r in enumerate(finished)]
    metadata = {"model": loaded.name, "config_fingerprint": loaded.config.fingerprint,
                "model_hash": loaded.weights_hash, "commit": git_commit(), "device": device_name(),
                "scenarios": num, "max_tokens": max_tokens, **versions(),
                "faults": list(engine.faults.names)}
    return metadata, transcripts


def record(args: argparse.Namespace) -> int:
    metadata, transcripts = run_scenarios(args.model, args.scenarios, args.max_tokens)
    write_store(Path(args.store), metadata, transcripts)
    print(f"recorded {len(transcripts)} scenarios to {args.store} (commit {metadata['commit']})")
    return 0


def check(args: argparse.Namespace) -> int:
    path = Path(args.store)
    if not path.is_file():
        print(f"error: no golden store at {path}; record one with `python -m canary golden record`", file=sys.stderr)
        return 2
    metadata, golden = read_store(path)
    _, runs = run_scenarios(args.model, metadata["scenarios"], metadata["max_tokens"])
    regressions, benign = [], []
    for run in runs:
        if run.scenario not in golden:
            continue
        div = first_divergence(golden[run.scenario], run, args.near_tie)
        if div is not None:
            (benign if div.benign else regressions).append(div)
    for div in benign + regressions:
        print(div.describe())
    summary = {"scenarios": len(runs), "regressions": len(regressions), "benign_near_ties": len(benign),
               "golden_commit": metadata.get("commit")}
    print(json.dumps(summary))
    return EXIT_REGRESSION if regressions else 0


def compare(args: argparse.Namespace) -> int:
    """0 when both stores hold the same transcripts bit for bit (tokens, logprobs, top-k, extras; the metadata
    line aside), 3 when not (the first differences named), 2 when a store is missing or of another model."""
    stores = []
    for name in (args.a, args.b):
        if not Path(name).is_file():
            print(f"error: no golden store at {name}", file=sys.stderr)
            return 2
        stores.append(read_store(Path(name)))
    (meta_a, a), (meta_b, b) = stores
    if meta_a.get("model_hash") != meta_b.get("model_hash"):
        print(f"error: the stores are of other weights (model hash {meta_a.get('model_hash')} against "
              f"{meta_b.get('model_hash')}): nothing to compare", file=sys.stderr)
        return 2
    shared = sorted(set(a) & set(b))
    differ = [k for k in shared if a[k] != b[k]]
    for key in differ[:5]:
        pos = first_mismatch(a[key].tokens, b[key].tokens)
        if pos is None:
            print(f"{key}: the same tokens, other logprobs or top-k alternatives")
        else:
            token_a, token_b = (t.tokens[pos] if pos < len(t.tokens) else "(ended)" for t in (a[key], b[key]))
            print(f"{key}: the tokens part at position {pos}: {token_a!r} in A, {token_b!r} in B")
    summary = {"shared": len(shared), "differ": len(differ), "only_in_a": len(set(a) - set(b)),
               "only_in_b": len(set(b) - set(a)), "a": {k: meta_a.get(k) for k in ("device", "commit")},
               "b": {k: meta_b.get(k) for k in ("device", "commit")}}
    print(json.dumps(summary))
    same = not differ and summary["only_in_a"] == summary["only_in_b"] == 0
    print(f"{'the same' if same else 'NOT the same'} transcripts: {len(shared)} shared, {len(differ)} differ")
    return 0 if same else EXIT_REGRESSION


def add_parser(sub: argparse._SubParsersAction) -> None:
    golden = sub.add_parser("golden", help="record or check golden transcripts")
    verbs = golden.add_subparsers(dest="verb", required=True)
    rec = verbs.add_parser("record", help="decode the scenarios and store tokens + top-k logprobs")
    rec.add_argument("--model", default=None, help="model directory or preset (default: the canary model)")
    rec.add_argument("--scenarios", type=int, default=16)
    rec.add_argument("--max-tokens", type=int, default=32)
    rec.add_argument("--store", default=None, help="JSONL path (default: golden/transcripts/<model>.jsonl)")
    rec.set_defaults(func=_with_defaults(record))
    chk = verbs.add_parser("check", help="re-run the stored scenarios and report the first divergence")
    chk.add_argument("--model", default=None)
    chk.add_argument("--store", default=None)
    chk.add_argument("--near-tie", type=float, default=DEFAULT_NEAR_TIE)
    chk.set_defaults(func=_with_defaults(check))
    cmp = verbs.add_parser("compare", help="whether two stores hold the same transcripts (metadata aside)")
    cmp.add_argument("a")
    cmp.add_argument("b")
    cmp.set_defaults(func=compare)


def _with_defaults(fn):
    def wrapped(args: argparse.Namespace) -> int:
        if args.model is None:
            from runtime.config import default_model

            args.model = default_model()
        if args.store is None:
            args.store = f"golden/transcripts/{Path(args.model).name}.jsonl"
        return fn(args)

    return wrapped
