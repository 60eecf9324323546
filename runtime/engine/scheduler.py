"""Continuous-batching scheduler (normal loop): admission, decode growth, preemption, stops, aborts.

`schedule()` turns the queue state into a `StepPlan` (allocating the pages it needs) and
`postprocess()` applies the sampled tokens. Decisions are made here and only here.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping

from runtime.config import EngineConfig
from runtime.engine.plan import Extend, StepPlan
from runtime.engine.request import Request, Status, stop_reason
from runtime.engine.sampler import SampleOutput
from runtime.faults import NO_FAULTS, FaultSet
from runtime.kvcache.page_pool import PagePool
from runtime.kvcache.prefix_cache import PrefixCache
from runtime.tokenizer import Tokenizer


class RequestRejected(ValueError):
    """A request that can never run under this engine's limits."""


class Scheduler:
    def __init__(self, cfg: EngineConfig, pool: PagePool, tokenizer: Tokenizer, faults: FaultSet = NO_FAULTS,
                 prefix_cache: PrefixCache | None = None) -> None:
        self.cfg = cfg
        self.pool = pool
        # Finished requests' KV pages for later prompts with the same start (None: off; Engine decides).
        self.prefix_cache = prefix_cache
        self.faults = faults
        self.tokenizer = tokenizer
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order; the newest is preempted first
        self.requests: dict[str, Request] = {}
        # PD decode: requests prefilled elsewhere (KV already in their pages) waiting for a running slot.
        self.prefilled: deque[Request] = deque()
        self.on_promote: Callable[[Request], None] | None = None  # a prefilled request joins the batch
        self.finished: list[Request] = []  # finished since the caller last drained it
        self.step = 0
        self.num_preemptions = 0
        # Tokens scheduled but not yet postprocessed, per request. Always 0 between steps of the
        # normal loop; 1 for a request whose decode is still in flight in the overlap loop.
        self.in_flight: dict[str, int] = {}
        self.aborts_in_flight = 0  # aborts applied while the request had a step in flight
        self.discarded_rows = 0  # rows computed for a request that finished before they were processed
        self._pending_aborts: list[tuple[str, str]] = []  # (rid, finish reason)
        # Preempted since the last plan: the next plan lists them, so every runner (and TP rank)
        # drops their page tables, whether the preemption made room in `schedule` or came between steps.
        self._preempted: list[str] = []
        self._copies: list[tuple[int, int]] = []  # this plan's (cached page, request page) KV copies
        self._arrivals = 0

    # ---- intake -------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self._check_limits(req)
        req.arrival = self._arrivals
        self._arrivals += 1
        self.requests[req.rid] = req
        self.waiting.append(req)

    def _check_limits(self, req: Request) -> None:
        if req.rid in self.requests:
            raise RequestRejected(f"duplicate request id {req.rid!r}")
        longest = len(req.prompt_ids) + req.params.max_tokens
        if longest > self.cfg.max_model_len:
            raise RequestRejected(f"prompt ({len(req.prompt_ids)}) + max_tokens ({req.params.max_tokens}) "
                                  f"exceeds max_model_len {self.cfg.max_model_len}")
        if longest > self.cfg.max_prefill_tokens:
            # Preempted requests are recomputed in one prefill, so the whole sequence must fit.
            raise RequestRejected(f"prompt + max_tokens ({longest}) exceeds max_prefill_tokens "
                                  f"{self.cfg.max_prefill_tokens}")
        if self.pool.pages_for_tokens(longest) > self.pool.num_pages:
            raise RequestRejected(f"request needs more KV pages than the pool holds ({self.pool.num_pages})")

    def admit_prefilled(self, req: Request) -> str | None:
        """PD decode: a request whose prompt KV is already in `req.pages` (owned by `req.rid`) and whose
        first token is in `output_ids` joins the running batch as if this scheduler had prefilled it.
        Returns the finish reason if that first token already ends it (its pages are then freed)."""
        self._check_limits(req)  # the same limits as a request prefilled here
        self.pool.check_owned(req.rid, req.pages)
        req.arrival = self._arrivals
        self._arrivals += 1
        req.status = Status.RUNNING
        req.num_computed = len(req.prompt_ids)
        req.pages_planned = 0  # its first decode extend sends the whole table to this engine's runner
        self.requests[req.rid] = req
        self.prefilled.append(req)
        reason = stop_reason(req, self.tokenizer, self.cfg.max_model_len)
        if reason is not None:
            self._finish(req, reason)
        return reason

    def abort(self, rid: str, reason: str = "abort") -> bool:
        """End a request before its own end, at the next plan. `reason` is its finish reason: "abort"
        (the client gave up) or, where the server ended a complete reply itself ("stop": a reply that
        ended at its last allowed tool call), the reason it is counted under."""
        req = self.requests.get(rid)
        if req is None or req.finished:
            return False
        self._pending_aborts.append((rid, reason))
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.prefilled or self._pending_aborts)

    # ---- planning -----------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        self.step += 1
        aborted = self._apply_aborts()
        while self.prefilled and len(self.running) < self.cfg.max_running_requests:
            promoted = self.prefilled.popleft()
            self.running.append(promoted)  # decodes from this step on
            if self.on_promote is not None:
                self.on_promote(promoted)
        decode = self._plan_decode()
        prefill = self._plan_prefill()
        for ext in decode + prefill:
            self.in_flight[ext.rid] = self.in_flight.get(ext.rid, 0) + 1
        preempted, self._preempted = self._preempted, []
        copies, self._copies = self._copies, []
        if self.prefix_cache is not None:
            self.prefix_cache.unpin()  # the plan's copies read the matched pages before anything else runs
        return StepPlan(self.step, tuple(prefill), tuple(decode), tuple(aborted), tuple(preempted), tuple(copies))

    def _make_room(self, num_pages: int) -> bool:
        """Whether `num_pages` can be allocated, evicting cached pages first if that makes room."""
        if self.pool.can_allocate(num_pages):
            return True
        return self.prefix_cache is not None and self.prefix_cache.make_room(num_pages)

    def _apply_aborts(self) -> list[str]:
        aborted = []
        for rid, reason in self._pending_aborts:
            req = self.requests[rid]
            if req.finished:
                continue
            if self.in_flight.get(rid):
                self.aborts_in_flight += 1  # its in-flight row is discarded when it lands
            self._finish(req, reason)
            aborted.append(rid)
        self._pending_aborts.clear()
        return aborted

    def _plan_decode(self) -> list[Extend]:
        # One pass per running request per step: lookups hoisted and lengths computed inline (this
        # loop's per-row Python is part of every step's host time).
        decode = []
        in_flight_of = self.in_flight.get
        max_len, page_size = self.cfg.max_model_len, self.pool.page_size
        for req in list(self.running):
            if req.status is not Status.RUNNING:  # preempted while making room for an earlier request
                continue  # (a status test: `req in self.running` made this loop quadratic in the batch)
            # Count the token still in flight (overlap loop): its result lands after this plan runs.
            produced = len(req.output_ids) + in_flight_of(req.rid, 0)
            length = len(req.prompt_ids) + produced
            if produced >= req.params.max_tokens or length >= max_len:
                continue  # the in-flight token finishes it by length: no extra decode
            needed = -(-length // page_size) - len(req.pages)
            if needed > 0:
                while not self._make_room(needed):
                    victim = self.running[-1]
                    self._preempt(victim)
                    if victim is req:
                        break
                if req.status is not Status.RUNNING:
                    continue
                req.pages += self.pool.allocate(req.rid, needed)
            planned = req.pages_planned  # only the pages the runner has not seen travel in the plan
            decode.append(Extend(req.rid, length - 1, 1, planned, tuple(req.pages[planned:])))
            req.pages_planned = len(req.pages)
        return decode

    def _plan_prefill(self) -> list[Extend]:
        prefill: list[Extend] = []
        budget = self.cfg.max_prefill_tokens
        while self.waiting and len(self.running) < self.cfg.max_running_requests:
            req = self.waiting[0]
            if self.in_flight.get(req.rid):
                break  # preempted with a token in flight: recompute once that token has landed
            total = req.total_len  # after a preemption the whole sequence is recomputed
            pages = self.pool.pages_for_tokens(total)
            matched = self._match_prefix(req)
            while matched and self.prefix_cache is not None and not self._make_room(pages):
                # Its own pages and the matched ones (pinned until their copies ran) do not fit together
                # (a long context in a small pool): shorten the match, so eviction may take its tail too.
                self.prefix_cache.release(matched[-1:])
                matched.pop()
            start = len(matched) * self.pool.page_size
            if total - start > budget or not self._make_room(pages):
                break
            self.waiting.popleft()
            req.pages = self.pool.allocate(req.rid, pages)
            req.status = Status.RUNNING
            req.num_computed = 0
            self.running.append(req)
            budget -= total - start
            if self.prefix_cache is not None:
                self._copies += self._copy_matched(matched, req.pages)
                self.prefix_cache.hit_tokens += start
                self.prefix_cache.lookup_tokens += total
            prefill.append(Extend(req.rid, start, total - start, 0, tuple(req.pages)))
            req.pages_planned = len(req.pages)
        return prefill

    def _match_prefix(self, req: Request) -> list:
        """The cached pages a waiting request's ids start with, leaving at least one token to compute
        (its logits are the next token's)."""
        if self.prefix_cache is None:
            return []
        return self.prefix_cache.match(req.all_ids, (req.total_len - 1) // self.pool.page_size)

    def _copy_matched(self, matched: list, pages: list[int]) -> list[tuple[int, int]]:
        copies = [(entry.page, page) for entry, page in zip(matched, pages)]
        if len(copies) > 1 and self.faults.enabled("prefix-cache-stale-page"):
            # The bug: the last matched page's KV is copied from the page before it (an off-by-one
            # walk of the chain), so the request attends over the wrong tokens' KV there.
            copies[-1] = (copies[-2][0], copies[-1][1])
        return copies

    def release_pages(self, rid: str, pages: list[int], final_ids: list[int] | None) -> None:
        """Give back request `rid`'s pages. With `final_ids` (the ids whose KV the pages hold, final: a
        request that finished normally, `all_ids[:num_computed]` - not its last sampled token, which has
        no KV) its full pages go to the prefix cache when it is on, and the rest (the partial last page,
        pages the cache already holds) are freed. None (an abort: the KV may be partial): all freed."""
        if (final_ids is not None and self.prefix_cache is not None
                and self.pool.pages_held(rid) == len(pages)):  # (not under the kv-slot-reuse fault's aliases)
            pages = self.prefix_cache.insert(rid, final_ids, pages)
        self.pool.free(rid, pages)

    def _preempt(self, req: Request) -> None:
        """Retract a running request: free its pages and queue it first for recomputation."""
        self.running.remove(req)
        self.pool.free(req.rid, req.pages)
        req.pages, req.pages_planned = [], 0
        req.num_computed = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        self._preempted.append(req.rid)

    # ---- results ------------------------------------------------------------------------------
    def postprocess(self, plan: StepPlan, outputs: Mapping[str, SampleOutput]) -> list[Request]:
        done = []
        requests, in_flight = self.requests, self.in_flight
        for ext in plan.extends:
            rid = ext.rid
            req = requests.get(rid)  # a caller may drop a finished request from the table
            left = in_flight[rid] - 1
            if left:
                in_flight[rid] = left
            else:
                del in_flight[rid]
            if req is None or req.status is Status.FINISHED:
                self.discarded_rows += 1  # finished (stop or abort) while this row was in flight
                continue
            if req.status is Status.RUNNING:  # a preempted request keeps its token, not its KV
                req.num_computed = ext.start + ext.num_new
            out = outputs[rid]
            req.output_ids.append(out.token)
            if req.params.logprobs:
                req.output_logprobs.append(out.logprob)
                req.output_top_logprobs.append(out.top)
            reason = stop_reason(req, self.tokenizer, self.cfg.max_model_len)
            if reason is not None:
                self._finish(req, reason)
                done.append(req)
        return done

    def _finish(self, req: Request, reason: str) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.prefilled:
            self.prefilled.remove(req)
        elif req.status is Status.WAITING:  # queued, or preempted while its last token was in flight
            self.waiting.remove(req)
        final = reason != "abort" and req.status is Status.RUNNING  # its KV is complete for [0, num_computed)
        if req.keep_pages and final:
            pass  # PD prefill: the pages stay the request's (with its KV) until its owner gives them back
        else:
            # The `abort-leak` fault forgets an aborted request's pages: the pool never gets them back.
            if req.pages and not (reason == "abort" and self.faults.enabled("abort-leak")):
                self.release_pages(req.rid, req.pages, req.all_ids[:req.num_computed] if final else None)
            req.pages = []
        req.pages_planned = 0
        req.status = Status.FINISHED
        req.finish_reason = reason
        self.finished.append(req)
