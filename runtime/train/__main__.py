"""`python -m runtime.train --out DIR ...`: tokenizer, then model, written as a loadable model dir.

DIR receives config.json, model.safetensors, tokenizer.json, chat_template.jinja (what the server
renders with), train_log.jsonl and train_summary.json. `--preset smoke` is the few-step CPU run
the test suite makes; `--preset canary` is the shipped model (run on the GPU by
scripts/gpu_train_canary.sh).
"""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import replace
from pathlib import Path

# A run takes minutes to hours: a Ctrl-C during torch's import (which swallows it, runtime/interrupts.py)
# must still stop it, so as a program the interrupt is noted while the modules below import.
from runtime.interrupts import INTERRUPTED_RC, held_while_importing

_LATCH = held_while_importing(__name__)

from runtime.config import ModelConfig  # noqa: E402
from runtime.models.loader import load_model, save_model  # noqa: E402
from runtime.server.chat_template import DEFAULT_TEMPLATE, TEMPLATE_NAME  # noqa: E402
from runtime.train.encode import load_tokenizer, special_ids  # noqa: E402
from runtime.train.loop import TrainConfig, train  # noqa: E402
from runtime.train.template import BOS, PAD  # noqa: E402
from runtime.train.tokenizer_train import train_tokenizer  # noqa: E402

# The shipped architecture: small enough for the 2-core CPU stress gate, window + topk = 64 so
# every late-turn context (hundreds of tokens) runs the sparse path.
CANARY = ModelConfig(hidden_size=192, num_layers=3, num_heads=4, kv_latent_dim=64, rope_dim=16,
                     index_heads=4, index_dim=32, index_topk=32, sliding_window=32, n_routed_experts=8,
                     num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=96,
                     routed_scaling_factor=1.5, max_position_embeddings=4096)
SMOKE = ModelConfig(hidden_size=32, num_layers=2, num_heads=2, kv_latent_dim=16, rope_dim=8, index_heads=2,
                    index_dim=8, index_topk=8, sliding_window=8, n_routed_experts=4, num_experts_per_tok=2,
                    moe_intermediate_size=16)
# What --init needs from a model directory: its config and weights, and the tokenizer its ids come from.
INIT_FILES = ("config.json", "model.safetensors", "tokenizer.json")
PRESETS = {
    "canary": (CANARY, dict(vocab=1280, tokenizer_sessions=3000, batch_size=64, steps=100_000, log_every=25)),
    "smoke": (SMOKE, dict(vocab=400, tokenizer_sessions=40, batch_size=4, steps=3, log_every=1)),
}


def main(argv: list[str] | None = None) -> int:
    if _LATCH.release():  # the imports are in: Ctrl-C raises again
        return INTERRUPTED_RC
    ap = argparse.ArgumentParser(prog="python -m runtime.train", description=__doc__)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="canary")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--time-budget-s", type=float, default=1e9)
    ap.add_argument("--batch-size", type=int)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--dense-fraction", type=float, default=0.25)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init", type=Path, help="continue from this model directory: its weights and tokenizer, "
                    "a fresh LR schedule (give another --seed, so the run sees new sessions)")
    args = ap.parse_args(argv)

    arch, opts = PRESETS[args.preset]
    # Checked before anything is written: a preset name or a half-written directory would otherwise
    # load (or fail) somewhere deeper, after the output directory was started.
    missing = [name for name in INIT_FILES if args.init and not (args.init / name).is_file()]
    if missing:
        raise SystemExit(f"--init {args.init}: not a model directory (no {', '.join(missing)}); "
                         "give a directory that `python -m runtime.train --out` wrote")
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    tok_path = out / "tokenizer.json"
    init = None
    if args.init:
        # The token ids the weights were trained on: the tokenizer is copied, never retrained.
        loaded = load_model(str(args.init))
        if args.init.resolve() != out.resolve():
            shutil.copyfile(args.init / "tokenizer.json", tok_path)
        init = loaded.weights
    else:
        train_tokenizer(opts["vocab"], opts["tokenizer_sessions"], tok_path)
    tok = load_tokenizer(str(tok_path))
    ids = special_ids(tok)
    vocab = -(-tok.get_vocab_size() // 64) * 64  # pad the embedding to a multiple of 64 rows
    model_cfg = replace(arch, vocab_size=vocab, bos_token_id=tok.token_to_id(BOS), eos_token_id=ids["eos"],
                  pad_token_id=tok.token_to_id(PAD))
    if args.init and model_cfg != loaded.config:
        raise SystemExit(f"--init {args.init}: its config is not the {args.preset} preset's")
    assert tok.token_to_id(PAD) == ids["pad"]
    tc = TrainConfig(steps=args.steps or opts["steps"], time_budget_s=args.time_budget_s,
                     batch_size=args.batch_size or opts["batch_size"], lr=args.lr,
                     dense_fraction=args.dense_fraction, seed=args.seed, workers=args.workers,
                     log_every=opts["log_every"], device=args.device)
    weights, summary = train(model_cfg, tc, str(tok_path), ids["pad"], out / "train_log.jsonl", init)
    if args.init:
        earlier = args.init / "train_summary.json"
        summary["init"] = {"from": str(args.init), **(json.loads(earlier.read_text()) if earlier.is_file() else {})}
    save_model(out, model_cfg, weights)
    shutil.copyfile(DEFAULT_TEMPLATE, out / TEMPLATE_NAME)
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({"out": str(out), **{k: summary[k] for k in ("steps", "tokens", "elapsed_s")}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
