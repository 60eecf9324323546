"""In-process gates over the engine and the model (no server), each returning a `GateResult`.

- overlap vs normal: one seeded workload (staggered arrivals, greedy and seeded sampling, a pool
  large enough that nothing is preempted) through `Engine(overlap=False)` and `Engine(overlap=True)`;
  every request's tokens, logprobs and finish reason must be identical.
- TP plan check: a seeded workload at TP=2 with the per-step plan check on; a `DesyncError` is the
  check firing (any other exception is a crash, not a catch).
- stream emulator: one prefill step of the model on the in-order executor vs the adversarial CPU
  stream emulator (late and random modes); the logits must be identical bit for bit.
Model: the `tiny-random` preset (these gates compare two executions of one build; no golden data).

`Arrival` + `drive` are also the one engine workload driver of the tests (tests/unit/test_overlap.py,
test_static_runner.py, tests/gpu/): arrivals by iteration, aborts by tokens seen or by iteration,
rows per request counted from each `StepResult.plan`.
"""

from __future__ import annotations

import os
import random
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import torch

from canary.faults.matrix import GateResult
from canary.oracles.logprob_close import first_mismatch
from runtime.config import EngineConfig
from runtime.distributed.tp_engine import start_engine
from runtime.engine.engine import Engine
from runtime.engine.request import Request, SamplingParams
from runtime.env import Env
from runtime.faults import FaultSet
from runtime.models.loader import LoadedModel, load_model
from runtime.workload import draw_prompts

MODEL = "tiny-random"
OVERLAP_REQUESTS, TP_REQUESTS = 16, 6
MAX_ITERATIONS = 10_000  # a workload that has not drained by then is a hang, not a slow run


@dataclass(frozen=True)
class Arrival:
    iteration: int  # driver iteration at which the request is added
    prompt: list[int]
    params: SamplingParams  # stop strings, if any, are here: the engine ends the request itself
    abort_after: int | None = None  # abort once the caller has seen this many tokens (0: at once)
    abort_at: int | None = None  # abort at this driver iteration, wherever the request is


def at_once(prompts: list[list[int]], params: list[SamplingParams]) -> list[Arrival]:
    """Every request at iteration 0: what `Engine.generate` does, through the same driver."""
    return [Arrival(0, prompt, sp) for prompt, sp in zip(prompts, params)]


def workload(loaded: LoadedModel, seed: int, num: int, max_tokens: int = 16) -> list[Arrival]:
    """Mixed prompt lengths (dense and sparse attention), staggered arrivals so decode rows of old
    requests share steps with prefills of new ones, greedy and seeded temperature sampling."""
    rng = random.Random(seed)
    prompts = draw_prompts(loaded.config, num, seed)
    return [Arrival(rng.randint(0, 8), prompt,
                    SamplingParams(max_tokens=rng.randint(4, max_tokens), ignore_eos=True, logprobs=True,
                                   top_logprobs=5, temperature=rng.choice([0.0, 0.8]), seed=seed * 1000 + i))
            for i, prompt in enumerate(prompts)]


@dataclass
class Driven:
    requests: list[Request]  # in workload order
    rows: dict[str, int] = field(default_factory=dict)  # rows scheduled per request id
    streamed: dict[str, list[int]] = field(default_factory=dict)  # tokens as a caller received them


def count_rows(plan, rows: dict[str, int], counted: set[int]) -> None:
    # The overlap loop reports a burst's first plan twice (launched, then landed): count each
    # scheduled step once. An idle step's empty plan repeats the last step number, so it is skipped.
    if plan.extends and plan.step not in counted:
        counted.add(plan.step)
        for ext in plan.extends:
            rows[ext.rid] = rows.get(ext.rid, 0) + 1


def drive(engine: Engine, arrivals: list[Arrival], *, rid_prefix: str | None = "r",
          drop_finished: bool = False) -> Driven:
    """Add each request at its iteration, abort it when its arrival says so, step until everything
    finished. `rid_prefix=None` lets the engine name requests (unique across calls on one engine, as
    `Engine.generate`); `drop_finished` removes finished requests from the table, as the server does."""
    driven = Driven(cast("list[Request]", [None] * len(arrivals)))  # filled as requests arrive
    counted: set[int] = set()
    last_arrival = max(a.iteration for a in arrivals)
    iteration = 0
    while iteration <= last_arrival or engine.has_work:
        for i, arrival in enumerate(arrivals):
            if arrival.iteration == iteration:
                rid = engine.add_request(arrival.prompt, arrival.params,
                                         rid=None if rid_prefix is None else f"{rid_prefix}{i}")
                driven.requests[i] = engine.scheduler.requests[rid]
        for arrival, req in zip(arrivals, driven.requests):
            if req is None or req.finished:
                continue
            if (arrival.abort_after is not None and len(req.output_ids) >= arrival.abort_after) \
                    or arrival.abort_at == iteration:
                engine.abort(req.rid)
        result = engine.step()
        count_rows(result.plan, driven.rows, counted)
        for rid, out in result.outputs.items():
            driven.streamed.setdefault(rid, []).append(out.token)
        if drop_finished:
            for req in result.finished:
                del engine.scheduler.requests[req.rid]
        iteration += 1
        if iteration > MAX_ITERATIONS:
            raise RuntimeError(f"workload did not drain in {MAX_ITERATIONS} iterations")
    return driven


def outcome(req: Request) -> tuple:
    return req.output_ids, req.output_logprobs, req.finish_reason


def first_difference(a: Request, b: Request) -> str:
    """Where two runs of one request part (the gates that use it want them identical)."""
    pos = first_mismatch(a.output_ids, b.output_ids)
    if pos is not None and pos < min(len(a.output_ids), len(b.output_ids)):
        return f"token {pos}: {a.output_ids[pos]} vs {b.output_ids[pos]}"
    if pos is not None:
        return f"lengths {len(a.output_ids)} vs {len(b.output_ids)}"
    if a.output_logprobs != b.output_logprobs:
        return "same tokens, different logprobs"
    return f"finish {a.finish_reason} vs {b.finish_reason}"


def overlap_vs_normal(faults: tuple[str, ...], seed: int, workdir: Path) -> GateResult:
    started = time.perf_counter()
    loaded = load_model(MODEL)
    arrivals = workload(loaded, seed, OVERLAP_REQUESTS)
    setup = time.perf_counter() - started
    started = time.perf_counter()
    runs = {}
    for overlap in (False, True):
        engine = Engine(loaded, EngineConfig(num_pages=512), faults=FaultSet(faults), env=Env(), overlap=overlap)
        runs[overlap] = drive(engine, arrivals).requests
    normal, overlapped = runs[False], runs[True]
    differ = [i for i, (a, b) in enumerate(zip(normal, overlapped)) if outcome(a) != outcome(b)]
    failures = []
    if differ:
        i = differ[0]
        failures.append(f"[overlap-vs-normal] {len(differ)}/{len(arrivals)} requests differ between the loops "
                        f"(seed {seed}); first r{i}, normal vs overlap at {first_difference(normal[i], overlapped[i])}")
    return GateResult(failures, time.perf_counter() - started, setup)


@contextmanager
def stderr_to(path: Path) -> Iterator[None]:
    """Point file descriptor 2 at `path` (inherited by spawned worker ranks, whose tracebacks of an
    expected DesyncError would otherwise be printed over the report), then restore it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with path.open("ab") as log:
            os.dup2(log.fileno(), 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def tp_plan_check(faults: tuple[str, ...], seed: int, workdir: Path) -> GateResult:
    from runtime.distributed.errors import DesyncError

    loaded = load_model(MODEL)
    arrivals = workload(loaded, seed, TP_REQUESTS)
    env = Env(tp_check=True, num_threads=1, tp_timeout_s=30.0)
    failures = []
    with stderr_to(workdir / f"tp-workers-{'+'.join(faults) or 'clean'}-seed{seed}.log"):
        started = time.perf_counter()
        engine = start_engine(loaded, EngineConfig(num_pages=512), faults=FaultSet(faults), env=env, tp=2)
        setup = time.perf_counter() - started
        started = time.perf_counter()
        try:
            drive(engine, arrivals)
        except DesyncError as err:
            failures.append(f"[tp-plan-check] DesyncError: {err}")
        finally:
            engine.shutdown()
    return GateResult(failures, time.perf_counter() - started, setup)


def prefill_batch(prompts: list[list[int]]):
    """One prefill step of every prompt, request i in its own slot range from slot i * stride."""
    from runtime.models.batch import ForwardBatch, Segment

    stride = max(len(p) for p in prompts)
    ids, positions, slots, segments, row = [], [], [], [], 0
    for i, prompt in enumerate(prompts):
        n = len(prompt)
        own = i * stride + torch.arange(n)
        ids.append(torch.tensor(prompt, dtype=torch.long))
        positions.append(torch.arange(n))
        slots.append(own)
        segments.append(Segment(row, row + n, own))
        row += n
    batch = ForwardBatch(torch.cat(ids), torch.cat(positions), torch.cat(slots), tuple(segments))
    return batch, len(prompts) * stride


def stream_emulator(faults: tuple[str, ...], seed: int, workdir: Path) -> GateResult:
    from runtime.kernels import cpu
    from runtime.kvcache.kv_cache import KVCache
    from runtime.models.dsv4_mini import DSV4Mini
    from runtime.streams.emulator import MODES, AdversarialExecutor
    from runtime.streams.tasks import InOrderExecutor

    started = time.perf_counter()
    loaded = load_model(MODEL)
    cfg = loaded.config
    rng = random.Random(seed)
    span = cfg.selected_tokens
    # Mixed lengths; the last prompt is long enough that the indexer really drops tokens, so a
    # stale selection changes the result.
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 3 * span))] for _ in range(3)]
    prompts.append([rng.randrange(256) for _ in range(2 * span + rng.randint(1, span))])
    batch, num_slots = prefill_batch(prompts)
    page_size = 16
    engine_cfg = EngineConfig(page_size=page_size, num_pages=-(-num_slots // page_size))

    def forward(model: DSV4Mini, streams) -> torch.Tensor:
        return model.forward(batch, KVCache(cfg, engine_cfg, torch.float32), streams)  # fresh (NaN-poisoned) cache

    def build() -> DSV4Mini:
        return DSV4Mini(cfg, loaded.weights, cpu, faults=FaultSet(faults))

    setup = time.perf_counter() - started
    started = time.perf_counter()
    reference = forward(build(), InOrderExecutor())
    failures = []
    for mode in MODES:
        model = build()
        # A serving model has run earlier steps: warm the workspace, so that a read racing its
        # writer finds real (finite, stale) selections, not only an empty workspace.
        forward(model, AdversarialExecutor(seed=seed, mode=mode))
        emulated = forward(model, AdversarialExecutor(seed=seed, mode=mode))
        if not torch.equal(emulated, reference):
            rows = int((emulated != reference).flatten(1).any(-1).sum())
            failures.append(f"[stream-emulator] {mode} mode (seed {seed}): logits differ from in-order execution "
                            f"in {rows} of {reference.shape[0]} rows")
    return GateResult(failures, time.perf_counter() - started, setup)
