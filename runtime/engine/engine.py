"""`Engine`: one model, KV pool and scheduler, driven by one of two loops, side by side as methods:
`normal_step` and `overlap_step` (one iteration each; `Engine(overlap=...)` picks).

normal:  schedule N -> execute N -> postprocess N.
overlap: schedule N+1 -> launch N+1 -> postprocess N (which ran while the CPU scheduled N+1).

In the overlap loop the scheduler plans N+1 without N's tokens: decode inputs come from the
device-side `FutureTokens` buffer, a request whose in-flight token will finish it by length is
not scheduled again, and a row whose request finished or was aborted before the row was
processed is discarded (counted in `Scheduler.discarded_rows`), so no token is lost or
duplicated. The same workload gives the same tokens and logprobs in both loops.

On CPU "launch" computes eagerly; what the loop preserves is the data flow of the device version:
the scheduler never reads step N's results before it has planned step N+1.

Given a `tp_group` this process is rank 0 of a tensor-parallel group: it alone schedules, and every
plan is broadcast to the worker ranks before it runs. The group is started by
`runtime.distributed.tp_engine.start_engine` and handed in, so the engine never imports the layer
that drives it.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from runtime.config import DTYPES, EngineConfig, ModelConfig
from runtime.engine.plan import StepPlan
from runtime.engine.request import Request, SamplingParams, Status
from runtime.engine.runners import build_runner
from runtime.engine.sampler import SampleOutput
from runtime.engine.scheduler import Scheduler
from runtime.engine.slow_step import SlowStep
from runtime.env import Env
from runtime.faults import FaultSet
from runtime.kvcache.page_pool import PagePool
from runtime.kvcache.prefix_cache import CACHE_OWNER, PrefixCache
from runtime.models.loader import LoadedModel
from runtime.streams.tasks import StreamExecutor


class TPGroup(Protocol):
    """Rank 0's side of a tensor-parallel group, as the engine uses it (`TPLauncher` is the one)."""

    @property
    def all_reduce(self) -> Callable[[torch.Tensor], torch.Tensor]: ...  # read-only: a bound method will do

    def shard(self, model_cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...

    def publish(self, plan: StepPlan, requests: dict[str, Request]) -> None: ...

    def end_step(self) -> None: ...

    def released(self, rid: str) -> None: ...

    def shutdown(self) -> None: ...


@dataclass(frozen=True)
class Launched:
    """A step handed to the device whose results the CPU has not looked at yet."""

    plan: StepPlan
    outputs: Mapping[str, SampleOutput]


@dataclass
class StepResult:
    plan: StepPlan
    outputs: dict[str, SampleOutput] = field(default_factory=dict)
    finished: list[Request] = field(default_factory=list)
    seconds: float = 0.0


class Engine:
    def __init__(self, loaded: LoadedModel, cfg: EngineConfig | None = None, faults: FaultSet | None = None,
                 env: Env | None = None, streams: StreamExecutor | None = None, *, overlap: bool = False,
                 tp_group: TPGroup | None = None, disaggregation: str | None = None) -> None:
        self.env = env or Env.load()
        self.disaggregation = disaggregation  # PD: "prefill" or "decode" (runtime/disagg); None = colocated
        self.cfg = cfg or EngineConfig()
        self.faults = faults if faults is not None else FaultSet.from_env(self.env)
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        if self.env.num_threads:
            torch.set_num_threads(self.env.num_threads)
        weights = {k: v.to(self.cfg.device, DTYPES[self.cfg.dtype]) for k, v in loaded.weights.items()}
        self.overlap = overlap
        self.in_flight: Launched | None = None  # overlap loop: the step launched but not processed
        self.tp = tp_group
        all_reduce = None
        if tp_group is not None:
            weights = tp_group.shard(loaded.config, weights)
            all_reduce = tp_group.all_reduce
        self.pool = PagePool(self.cfg.num_pages, self.cfg.page_size, self.faults)
        self.runner = build_runner(loaded.config, weights, self.cfg, self.pool, self.faults, self.env,
                                   all_reduce=all_reduce, streams=streams, overlap=overlap)
        self.model, self.kv, self.streams = self.runner.model, self.runner.kv, self.runner.streams
        use_cache = self.use_prefix_cache(self.cfg, self.env, tensor_parallel=tp_group is not None,
                                          disaggregation=disaggregation)
        self.prefix_cache = PrefixCache(self.pool) if use_cache else None
        self.scheduler = Scheduler(self.cfg, self.pool, self.tokenizer, self.faults, self.prefix_cache)
        self._ids = itertools.count()
        self.slow_step = SlowStep(self.env.slow_step_ms, self.env.slow_step_pct, self.cfg.device)

    @staticmethod
    def prefix_cache_refusal(cfg: EngineConfig, env: Env, *, tensor_parallel: bool = False,
                             disaggregation: str | None = None) -> str | None:
        """Why the prefix cache may not run on such an engine; None where its hits are proven bit-exact,
        colocated or on a PD prefill server, without TP: the eager CPU runner with the fast kernels
        (segment-invariant: tests/unit/test_prefix_cache.py) and the GPU runner with the Triton kernels
        (a prompt token's bits do not depend on its prefill chunk: tests/gpu/test_prefix_cache_gpu.py).
        The one place this rule lives (`use_prefix_cache`, runtime.serve and `admit_prefilled` ask it)."""
        if disaggregation == "decode":
            return ("a PD decode server (--disaggregation-mode decode) allocates the pages of the KV it receives "
                    "itself; no cache may hold them")
        if tensor_parallel:
            return "hits are not proven exact under tensor parallelism (--tp > 1)"
        if cfg.device == "cpu":
            if cfg.static_runner:
                return "hits are proven exact on the CPU only with the eager runner (this engine runs the static one)"
            if env.reference_kernels:
                return "hits are proven exact on the CPU only with the fast kernels (DSV4_REFERENCE_KERNELS is set)"
            return None
        if not cfg.static_runner or not cfg.moe_kernel == cfg.attention_kernel == "triton":
            runner = "static" if cfg.static_runner else "eager"
            return (f"hits are proven exact on a GPU only with the static runner and the Triton kernels (this engine: "
                    f"the {runner} runner, --moe-kernel {cfg.moe_kernel}, --attention-kernel {cfg.attention_kernel})")
        return None

    @classmethod
    def use_prefix_cache(cls, cfg: EngineConfig, env: Env, *, tensor_parallel: bool = False,
                         disaggregation: str | None = None) -> bool:
        """`cfg.prefix_cache` resolved: None = on where allowed (`prefix_cache_refusal`) and it pays, False
        = off, True = on, a ValueError naming the reason where it is not allowed.

        It pays on the CPU, where prefill is the engine's time (the 80-session CPU gate: 504.8 s -> 186.8 s
        of sessions). On a GPU it is exact but off unless asked for: on the H200 the canary's prefill is
        cheap beside the cache's host work, and the 80-session gate ran 1,874 tok/s with it against
        2,188 without (same call, docs/results.md, fourteenth session)."""
        refusal = cls.prefix_cache_refusal(cfg, env, tensor_parallel=tensor_parallel, disaggregation=disaggregation)
        if cfg.prefix_cache and refusal is not None:
            raise ValueError(f"the prefix cache (--prefix-cache) is refused here: {refusal}")
        if cfg.prefix_cache is None:
            return refusal is None and cfg.device == "cpu"
        return cfg.prefix_cache

    # ---- requests -----------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams, rid: str | None = None, *,
                    keep_pages: bool = False) -> str:
        """Queue a request. With `keep_pages` its pages outlive it (`Request.keep_pages`): the caller
        gives them back with `scheduler.release_pages(rid, req.pages, ...)` once it has used the KV they hold."""
        if any(not 0 <= t < self.loaded.config.vocab_size for t in prompt_ids):
            raise ValueError("prompt contains token ids outside the vocabulary")
        rid = rid if rid is not None else f"req-{next(self._ids)}"
        self.scheduler.add(Request(rid, list(prompt_ids), params, keep_pages=keep_pages))
        return rid

    def abort(self, rid: str, reason: str = "abort") -> bool:
        return self.scheduler.abort(rid, reason)

    def admit_prefilled(self, req: Request) -> str | None:
        """PD decode: take over a request prefilled elsewhere (KV in `req.pages`, first token in
        `output_ids`); returns its finish reason when that token already ended it."""
        if self.prefix_cache is not None:  # an engine built for decode (`disaggregation="decode"`) has none
            refusal = self.prefix_cache_refusal(self.cfg, self.env, disaggregation="decode")
            raise RuntimeError(f"PD decode runs without the prefix cache: {refusal}")
        if self.runner.future is not None:
            self.scheduler.on_promote = self._seed_future
        reason = self.scheduler.admit_prefilled(req)
        if reason is not None:
            self.scheduler.finished.remove(req)
            self.scheduler.requests.pop(req.rid, None)
        return reason

    def _seed_future(self, req: Request) -> None:
        """Overlap loop: a prefilled request's decode input comes from the future buffer, which only a
        step of this engine fills; its first token is put there as it joins the batch (not earlier:
        queued requests must not hold future slots)."""
        assert self.runner.future is not None
        self.runner.future.write([req.rid], torch.tensor(req.output_ids[-1:], dtype=torch.long))

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self.in_flight is not None

    @property
    def pages_in_use(self) -> int:
        """Pages held by requests: idle at 0. The prefix cache's pages are `pages_cached`."""
        return self.pool.pages_in_use - self.pool.pages_held(CACHE_OWNER)

    @property
    def pages_cached(self) -> int:
        return self.pool.pages_held(CACHE_OWNER)

    # ---- the loop -----------------------------------------------------------------------------
    def step(self) -> StepResult:
        """One loop iteration; the result holds the outputs that landed in it (overlap: the
        previous launch's)."""
        return self.overlap_step() if self.overlap else self.normal_step()

    def normal_step(self) -> StepResult:
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        delivered = self.deliverable(self.dispatch(plan))
        self.scheduler.postprocess(plan, delivered)  # it reads exactly the delivered rows' outputs
        return self.finish_step(plan, delivered, started)

    def overlap_step(self) -> StepResult:
        started = time.perf_counter()
        launched = None
        if self.scheduler.has_work:
            plan = self.scheduler.schedule()
            launched = Launched(plan, self.dispatch(plan))
        last, self.in_flight = self.in_flight, launched
        if last is None:  # the first step of a burst (or an idle call): nothing has landed yet
            plan = launched.plan if launched else StepPlan(self.scheduler.step, (), ())
            return self.finish_step(plan, {}, started)
        delivered = self.deliverable(last.outputs)
        self.scheduler.postprocess(last.plan, delivered)  # it reads exactly the delivered rows' outputs
        return self.finish_step(last.plan, delivered, started)

    def deliverable(self, outputs: Mapping[str, SampleOutput]) -> dict[str, SampleOutput]:
        """The outputs postprocess will append: not those of requests that finished (or were aborted)
        while their row was in flight. Callers stream exactly these, so no token is sent twice."""
        requests = self.scheduler.requests
        return {rid: out for rid, out in outputs.items()
                if (req := requests.get(rid)) is not None and req.status is not Status.FINISHED}

    def dispatch(self, plan: StepPlan) -> Mapping[str, SampleOutput]:
        """Run a plan on every rank: broadcast it first (tp > 1), then execute it here."""
        if self.tp is None:
            return self.runner.execute(plan, self.scheduler.requests)
        self.tp.publish(plan, self.scheduler.requests)
        outputs = self.runner.execute(plan, self.scheduler.requests)
        self.tp.end_step()
        return outputs

    def finish_step(self, plan: StepPlan, outputs: dict[str, SampleOutput], started: float) -> StepResult:
        if self.faults.enabled("slow-step"):
            self.slow_step.delay(time.perf_counter() - started)
        finished, self.scheduler.finished = self.scheduler.finished, []
        for req in finished:
            self.runner.release(req.rid)
            if self.tp is not None:
                self.tp.released(req.rid)
        return StepResult(plan, outputs, finished, time.perf_counter() - started)

    def shutdown(self) -> None:
        """Stop the worker ranks (with a TP group); idempotent. The engine is unusable afterwards."""
        if self.tp is not None:
            self.tp.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def run_until_done(self, max_steps: int = 1_000_000) -> list[StepResult]:
        results = []
        while self.has_work:
            if len(results) >= max_steps:
                raise RuntimeError(f"engine still busy after {max_steps} steps")
            results.append(self.step())
        return results

    def generate(self, prompts: list[list[int]], params: list[SamplingParams] | SamplingParams) -> list[Request]:
        """Offline batch generation: all prompts submitted at once, run to completion."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        rids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        self.run_until_done()
        return [self.scheduler.requests[rid] for rid in rids]
