"""GPU idle time between decode steps, normal vs overlap scheduler loop (issue 8), on the GPU engine.

Each executed step records CUDA events at the start and the end of its device work
(static_runner.StepTimeline); idle = the gaps between one step's end and the next one's start, i.e.
the time the GPU waited for the CPU to schedule, build and launch the next step. Measured over
decode-only steps after every request has been prefilled, with CUDA graphs and multi-stream on.

    python -m bench.idle_time --model canary --batch-sizes 1,4,16,64 --out $OUT/idle_canary.json
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from bench.decode_step import SLICE, random_weights
from canary.provenance import git_commit
from runtime.config import EngineConfig, default_model
from runtime.engine.engine import Engine
from runtime.engine.request import SamplingParams
from runtime.engine.static_runner import StaticModelRunner, StepTimeline
from runtime.env import Env
from runtime.faults import FaultSet
from runtime.models.loader import LoadedModel, load_model
from runtime.tokenizer import ByteTokenizer


def load(name: str) -> LoadedModel:
    if name == "canary":
        return load_model(default_model())
    tok = ByteTokenizer(SLICE.vocab_size, SLICE.bos_token_id, SLICE.eos_token_id, SLICE.pad_token_id)
    return LoadedModel("dsv4-slice", SLICE, random_weights(SLICE, small=False), tok, None)


def measure(loaded: LoadedModel, bs: int, overlap: bool, steps: int, prompt_len: int) -> dict:
    cfg = EngineConfig(device="cuda", dtype="bfloat16", num_pages=max(256, bs * (prompt_len + steps + 64) // 16),
                       max_running_requests=max(bs, 1), max_model_len=2048)
    engine = Engine(loaded, cfg, FaultSet(), Env(), overlap=overlap)
    # The step timeline and the graph replays are the static (GPU) runner's, which cuda picks.
    assert isinstance(engine.runner, StaticModelRunner), type(engine.runner).__name__
    rng = random.Random(bs)
    params = SamplingParams(max_tokens=steps + 16, ignore_eos=True)
    for _ in range(bs):
        engine.add_request([rng.randrange(3, loaded.tokenizer.vocab_size) for _ in range(prompt_len)], params)
    while any(r.num_computed < len(r.prompt_ids) for r in engine.scheduler.requests.values()):
        engine.step()  # prefill every request first: the timeline then sees decode steps only
    for _ in range(3):
        engine.step()  # warm-up decode steps
    engine.runner.timeline = StepTimeline()
    for _ in range(steps):
        engine.step()
    figures = engine.runner.timeline.summary(skip=1)
    engine.runner.timeline = None
    while engine.has_work:
        engine.step()
    return {"bs": bs, "loop": "overlap" if overlap else "normal", **figures,
            "step_ms": figures["busy_ms"] / max(figures["steps"], 1),
            "graph_replays": engine.runner.graphs.replays}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["canary", "dsv4-slice"], default="canary")
    parser.add_argument("--batch-sizes", default="1,4,16,64")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    loaded = load(args.model)
    rows = []
    for bs in (int(b) for b in args.batch_sizes.split(",")):
        for overlap in (False, True):
            row = measure(loaded, bs, overlap, args.steps, args.prompt_len)
            print(json.dumps(row), flush=True)
            rows.append(row)
    summary = {"model": args.model, "commit": git_commit(), "device": torch.cuda.get_device_name(),
               "torch": torch.__version__, "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
