"""Host time per engine step on the GPU runner's code path, with the device work taken out.

The overlap loop keeps the GPU busy only while the host's work for the next step (schedule, build
the rows, launch, sample bookkeeping, process the previous step's tokens) fits inside the current
step's device time. This runs the engine with the static (GPU) runner on the CPU and replaces the
model's forward by a lookup of precomputed logits, so an engine step's wall time is that host work
alone. Compare with the GPU step times in docs/results.md (canary on the H200: 0.84 ms at bs 1-4,
0.88 ms at bs 16, 3.1 ms at bs 64). An estimate, not a bound either way: the GPU's host also pays
CUDA launches and copies (graph replay, sampler kernels, the future buffer, the pinned output copy),
absent here, while the sampler's arithmetic, device work on a GPU, runs here inside the measured time.

    python -m bench.host_step --batch-sizes 1,4,16,64 --out host_step.json [--clock cpu]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from canary.provenance import device_name, git_commit
from runtime.config import EngineConfig, default_model
from runtime.engine.engine import Engine
from runtime.engine.request import SamplingParams
from runtime.engine.static_runner import StaticModelRunner
from runtime.env import Env
from runtime.faults import FaultSet
from runtime.models.loader import LoadedModel, load_model


def without_device_work(engine: Engine) -> None:
    """Every forward returns rows of one precomputed logits table (the sampler still runs)."""
    runner = engine.runner
    if not isinstance(runner, StaticModelRunner):
        raise TypeError(f"host_step times the static (GPU) runner's path, got {type(runner).__name__}")
    table = torch.randn(runner.max_rows, engine.loaded.config.vocab_size,
                        generator=torch.Generator().manual_seed(0))
    # Instance attributes that shadow this GraphRunner's methods (a deliberate monkeypatch).
    vars(runner.graphs).update(forward=lambda inp: table[:inp.batch_size],
                               eager=lambda chunk: table[:chunk.batch_size])


def measure(loaded: LoadedModel, bs: int, overlap: bool, steps: int, prompt_len: int, repeats: int,
            clock=time.perf_counter) -> dict:
    cfg = EngineConfig(device="cpu", dtype="float32", runner="static", cuda_graphs=False, multi_stream=False,
                       num_pages=max(256, bs * (prompt_len + repeats * steps + 64) // 16 + 16),
                       max_running_requests=max(bs, 1), max_model_len=4096)
    engine = Engine(loaded, cfg, FaultSet(), Env(), overlap=overlap)
    without_device_work(engine)
    rng = random.Random(bs)
    params = SamplingParams(max_tokens=repeats * steps + 16, ignore_eos=True)
    for _ in range(bs):
        engine.add_request([rng.randrange(3, loaded.tokenizer.vocab_size) for _ in range(prompt_len)], params)
    while any(r.num_computed < len(r.prompt_ids) for r in engine.scheduler.requests.values()):
        engine.step()
    for _ in range(3):
        engine.step()
    per_step = []
    for _ in range(repeats):  # the best of a few runs: the least disturbed by this machine's neighbours
        started = clock()
        for _ in range(steps):
            engine.step()
        per_step.append((clock() - started) / steps * 1e3)
    while engine.has_work:
        engine.step()
    return {"bs": bs, "loop": "overlap" if overlap else "normal", "host_ms_per_step": min(per_step),
            "median_ms_per_step": statistics.median(per_step)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,4,16,64")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: this process's CPU time, steadier than wall time on a shared machine")
    args = parser.parse_args()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(1)  # the host work is one Python thread
    loaded = load_model(default_model())
    rows = []
    for bs in (int(b) for b in args.batch_sizes.split(",")):
        for overlap in (False, True):
            row = measure(loaded, bs, overlap, args.steps, args.prompt_len, args.repeats, clock)
            print(json.dumps(row), flush=True)
            rows.append(row)
    summary = {"model": "canary", "commit": git_commit(), "machine": device_name(),
               "command": "python -m bench.host_step " + " ".join(sys.argv[1:]), "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
