"""`TPLauncher`: rank 0's side of tensor parallelism: spawn the workers, broadcast every plan,
check the ranks agree, stop everything cleanly.

Lifecycle: `start()` spawns ranks 1..tp-1 (spawn context, daemonic, each watching a pipe to this
process so it exits if rank 0 dies), joins the gloo group and compares weight hashes.
`publish(plan)` broadcasts a `StepMessage` before rank 0 executes the plan; with DSV4_TP_CHECK it
all-gathers per-field plan digests and raises `DesyncError` naming the step and fields.
`shutdown()` sends "stop", then joins, then terminates, then kills: no orphan survives it.
"""

from __future__ import annotations

import multiprocessing as mp
import shutil
import tempfile
from pathlib import Path

import torch

from runtime.config import PRESETS, EngineConfig, ModelConfig
from runtime.distributed.collectives import Collectives, init_collectives, uses_nccl
from runtime.distributed.errors import WorkerStartError
from runtime.distributed.messages import RequestSpec, StepMessage, find_desync, plan_field_digests
from runtime.distributed.sharding import check_divisible, shard_weights
from runtime.distributed.worker import worker_main
from runtime.engine.plan import StepPlan
from runtime.engine.request import Request
from runtime.env import Env
from runtime.faults import FaultSet
from runtime.models.loader import LoadedModel


def _model_ref(loaded: LoadedModel) -> str | LoadedModel:
    """Workers load the model themselves when it has a name or path; otherwise it is shipped."""
    if loaded.path is not None:
        return str(loaded.path)
    return loaded.name if loaded.name in PRESETS else loaded


class TPLauncher:
    def __init__(self, coll: Collectives, procs: list, pipes: list, rundir: str, env: Env) -> None:
        self.collectives = coll
        self.all_reduce = coll.all_reduce  # rank 0's model reduces through the group's collectives
        self.procs = procs
        self._pipes = pipes  # kept open: closing them tells the workers rank 0 is gone
        self._rundir = rundir
        self._check = env.tp_check
        self._join_s = env.tp_timeout_s
        self._sent: set[str] = set()
        self._released: list[str] = []
        self._stopped = False
        # True from a plan's broadcast until rank 0 has executed it (`end_step`): a shutdown in between
        # (a signal mid-step) cannot say goodbye in order, the workers are inside the step's collectives.
        self._mid_step = False

    @classmethod
    def start(cls, loaded: LoadedModel, cfg: EngineConfig, faults: FaultSet, env: Env, world: int,
              overlap: bool) -> TPLauncher:
        check_divisible(loaded.config, world)
        ctx = mp.get_context("spawn")
        rundir = tempfile.mkdtemp(prefix="dsv4-tp-")
        init_file = str(Path(rundir) / "rendezvous")
        procs, pipes = [], []
        for rank in range(1, world):
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(target=worker_main, name=f"dsv4-tp-rank{rank}", daemon=True,
                               args=(rank, world, init_file, _model_ref(loaded), cfg, faults.names, env, overlap,
                                     child_end))
            proc.start()
            child_end.close()
            procs.append(proc)
            pipes.append(parent_end)
        try:
            coll = init_collectives(0, world, init_file, env.tp_startup_timeout_s, env.tp_timeout_s,
                                    env.tp_watchdog_grace_s, nccl=uses_nccl(cfg))
        except BaseException as exc:  # also SIGTERM / Ctrl-C while the group forms: no orphan
            cls._reap(procs, 1.0)
            shutil.rmtree(rundir, ignore_errors=True)
            if not isinstance(exc, Exception):
                raise
            raise WorkerStartError(f"tensor-parallel group of {world} did not form: {exc}") from exc
        launcher = cls(coll, procs, pipes, rundir, env)
        try:
            hashes = coll.all_gather({"weights": loaded.weights_hash})
            if (error := find_desync(0, hashes)) is not None:
                raise error
        except BaseException:
            launcher.shutdown()
            raise
        return launcher

    def shard(self, model_cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rank 0's shard of the weights (the workers cut their own)."""
        return shard_weights(model_cfg, weights, 0, self.collectives.world)

    def publish(self, plan: StepPlan, requests: dict[str, Request]) -> None:
        new = []
        for ext in plan.prefill:
            if ext.rid not in self._sent:
                req = requests[ext.rid]
                new.append(RequestSpec(req.rid, tuple(req.prompt_ids), req.params))
                self._sent.add(ext.rid)
        released, self._released = tuple(self._released), []
        self.collectives.step = plan.step
        self._mid_step = True
        self.collectives.broadcast(StepMessage("step", plan, tuple(new), released))
        if self._check:
            gathered = self.collectives.all_gather(plan_field_digests(plan, released))
            if (error := find_desync(plan.step, gathered)) is not None:
                raise error

    def end_step(self) -> None:
        """Rank 0 has executed the published plan: the workers are out of its collectives."""
        self._mid_step = False

    def released(self, rid: str) -> None:
        """A request finished on rank 0: the workers free it with the next message."""
        if rid in self._sent:
            self._sent.discard(rid)
            self._released.append(rid)

    def rank_stats(self) -> list[dict]:
        """Accounting of every worker rank (pages in use, live requests, future slots)."""
        released, self._released = tuple(self._released), []
        self.collectives.broadcast(StepMessage("stats", released=released))
        return self.collectives.all_gather({})[1:]

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        coll = self.collectives
        orderly = not coll.broken and not self._mid_step and all(p.is_alive() for p in self.procs)
        if orderly:
            try:
                coll.broadcast(StepMessage("stop"))
            except Exception:  # noqa: BLE001 - a failed goodbye only means we escalate below
                orderly = False
        self._reap(self.procs, self._join_s if orderly else 0.5)
        for pipe in self._pipes:
            pipe.close()
        coll.close()
        shutil.rmtree(self._rundir, ignore_errors=True)

    @staticmethod
    def _reap(procs: list, join_s: float) -> None:
        """join, then SIGTERM, then SIGKILL (a SIGSTOPped worker only dies to the last)."""
        for proc in procs:
            proc.join(join_s)
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
