"""Worker ranks (1..tp-1): receive each `StepMessage` from rank 0 and execute exactly its plan.

A worker makes no scheduling decision of its own: no clock, no abort, no admission. It mirrors
the request table (prompts, sampled tokens, page ownership) only to execute plans, and frees a
request only when rank 0 says so. The `tp-local-abort` fault breaks exactly that rule, the way the
production bug did: the last rank drops a request on a local whim (as if a local timeout fired).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import traceback

import torch

from runtime.config import DTYPES, EngineConfig
from runtime.distributed.collectives import Collectives, init_collectives, uses_nccl
from runtime.distributed.messages import StepMessage, find_desync, plan_field_digests
from runtime.distributed.mirror_pool import MirrorPool
from runtime.distributed.sharding import shard_weights
from runtime.engine.plan import StepPlan
from runtime.engine.request import Request
from runtime.engine.runners import build_runner
from runtime.env import Env
from runtime.faults import FaultSet
from runtime.models.loader import LoadedModel, load_model

# The tp-local-abort fault fires on the first plan at or after this step that has a decode row.
LOCAL_ABORT_STEP = 4


class PlanFollower:
    def __init__(self, loaded: LoadedModel, cfg: EngineConfig, faults: FaultSet, env: Env, overlap: bool,
                 coll: Collectives) -> None:
        self.coll, self.faults, self.check = coll, faults, env.tp_check
        device = cfg.device if cfg.device == "cpu" else f"cuda:{coll.rank}"
        weights = {k: v.to(device, DTYPES[cfg.dtype]) for k, v in loaded.weights.items()}
        weights = shard_weights(loaded.config, weights, coll.rank, coll.world)
        self.pool = MirrorPool(cfg.num_pages, cfg.page_size)
        # Faults apply on every rank, as a bug in the build would (tp-local-abort is the follower's own).
        self.runner = build_runner(loaded.config, weights, dataclasses.replace(cfg, device=device), self.pool,
                                   faults, env, all_reduce=coll.all_reduce, overlap=overlap)
        self.requests: dict[str, Request] = {}
        self.pending: list = []  # executed steps' outputs not yet appended (see _settle)
        self.local_aborts = 0

    def run(self) -> None:
        while True:
            msg: StepMessage = self.coll.broadcast()
            for rid in msg.released:
                self._drop(rid)
            if msg.kind == "stop":
                return
            if msg.kind == "stats":
                self.coll.all_gather(self.stats())
                continue
            self.execute(msg)

    def execute(self, msg: StepMessage) -> None:
        assert msg.plan is not None, f"a {msg.kind!r} message reached execute"
        self.coll.step = msg.plan.step
        for spec in msg.new_requests:
            self.requests[spec.rid] = Request(spec.rid, list(spec.prompt_ids), spec.params)
        plan = self._local_view(msg.plan)
        if self.check:
            gathered = self.coll.all_gather(plan_field_digests(plan, msg.released))
            if (error := find_desync(plan.step, gathered)) is not None:
                raise error
        for rid in plan.aborted:
            self._drop(rid)
        for rid in plan.preempted:
            self.pool.release(rid)
        for ext in plan.extends:
            self.pool.claim(ext.rid, ext.first_page, ext.new_pages)
        if self._needs_host_tokens(plan):
            self._settle()
        self.pending.append(self.runner.execute(plan, self.requests))
        if self.runner.future is None:
            self._settle()

    def _needs_host_tokens(self, plan: StepPlan) -> bool:
        """Rows built from the host token lists: prompts (incl. preemption recompute), every decode
        row without the future buffer, and the `overlap-stale-token` fault's decode rows."""
        return bool(plan.prefill) or self.runner.future is None or self.faults.enabled("overlap-stale-token")

    def _settle(self) -> None:
        """Append the sampled tokens of executed steps to the mirrored requests. With the overlap
        loop's future buffer this waits until a step needs host tokens, so a GPU worker does not
        sync with its device every step (rank 0 does the same through PendingOutputs)."""
        for outputs in self.pending:
            for rid, out in outputs.items():
                # Every rank samples the same token (same all-reduced logits, same per-request seed).
                if rid in self.requests:
                    self.requests[rid].output_ids.append(out.token)
        self.pending.clear()

    def _local_view(self, plan: StepPlan) -> StepPlan:
        """The plan this rank will execute: rank 0's, unless the tp-local-abort fault is on."""
        if (self.faults.enabled("tp-local-abort") and self.coll.rank == self.coll.world - 1
                and not self.local_aborts and plan.step >= LOCAL_ABORT_STEP and plan.decode):
            victim = plan.decode[-1].rid
            self.local_aborts += 1
            self._drop(victim)
            return dataclasses.replace(plan, decode=plan.decode[:-1], aborted=plan.aborted + (victim,))
        return plan

    def _drop(self, rid: str) -> None:
        self.pool.release(rid)
        self.runner.release(rid)
        self.requests.pop(rid, None)

    def stats(self) -> dict:
        future = self.runner.future
        return {"rank": self.coll.rank, "pages_in_use": self.pool.pages_in_use, "requests": len(self.requests),
                "future_slots": future.live if future is not None else 0}


def _exit_when_parent_dies(parent_alive) -> None:
    """The launcher holds the other end of this pipe; EOF means rank 0 is gone: never linger."""
    def watch() -> None:
        try:
            parent_alive.recv()
        except (EOFError, OSError):
            pass
        os._exit(0)

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()


def worker_main(rank: int, world: int, init_file: str, model_ref: str | LoadedModel, cfg: EngineConfig,
                fault_names: tuple[str, ...], env: Env, overlap: bool, parent_alive) -> None:
    # Ctrl-C reaches the whole process group; rank 0 handles it and stops the workers in order.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_when_parent_dies(parent_alive)
    if env.num_threads:
        torch.set_num_threads(env.num_threads)
    coll = init_collectives(rank, world, init_file, env.tp_startup_timeout_s, env.tp_timeout_s,
                            env.tp_watchdog_grace_s, nccl=uses_nccl(cfg))
    try:
        loaded = model_ref if isinstance(model_ref, LoadedModel) else load_model(model_ref)
        # Handshake before building the runner: rank 0 builds its own runner only after the
        # handshake, and GPU runners capture graphs whose warm-up all-reduces must pair with rank 0's
        # (the other order deadlocks: this rank in an NCCL all-reduce, rank 0 in the gloo handshake).
        coll.all_gather({"weights": loaded.weights_hash})  # startup handshake (rank 0 compares)
        follower = PlanFollower(loaded, cfg, FaultSet(fault_names), env, overlap, coll)
        follower.run()
    except BaseException:
        traceback.print_exc(file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)  # a failed rank never lingers in a group the others are blocked on
    coll.close()
