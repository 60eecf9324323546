"""Process-group setup and timed collectives: a stuck collective becomes an error, never a hang.

Two layers keep every collective bounded:
- the step group is created with `collective_timeout_s`, so gloo (NCCL: its own timeout) raises
  when a peer does not show up; `Collectives` turns that into a `CollectiveError` naming the rank,
  the operation and the step;
- a watchdog thread backs this up: if a collective is still running `grace_s` after its deadline
  (the backend failed to time out), it prints which rank is stuck where and exits the process
  with `WATCHDOG_EXIT_CODE`, so the caller and the launcher see a dead rank rather than silence.
Startup (rendezvous, model loading on the workers) uses the default group's longer timeout.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from runtime.distributed.errors import CollectiveError

WATCHDOG_EXIT_CODE = 70


class Watchdog:
    def __init__(self, rank: int, timeout_s: float, grace_s: float) -> None:
        self.rank = rank
        self.limit_s = timeout_s + grace_s
        self._armed: tuple[str, int, float] | None = None  # (op, step, started)
        self._wake = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._watch, name=f"tp-watchdog-{rank}", daemon=True)
        self._thread.start()

    def arm(self, op: str, step: int) -> None:
        with self._wake:
            self._armed = (op, step, time.monotonic())
            self._wake.notify()

    def disarm(self) -> None:
        with self._wake:
            self._armed = None

    def stop(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()

    def _watch(self) -> None:
        with self._wake:
            while not self._stopped:
                if self._armed is None:
                    self._wake.wait()
                    continue
                op, step, started = self._armed
                left = started + self.limit_s - time.monotonic()
                if left > 0:
                    self._wake.wait(left)
                    continue
                print(f"tp watchdog: rank {self.rank} stuck in {op} at step {step} for more than "
                      f"{self.limit_s:g}s; exiting with code {WATCHDOG_EXIT_CODE}", file=sys.stderr, flush=True)
                os._exit(WATCHDOG_EXIT_CODE)


class Collectives:
    """The step-time collectives of one rank, each bounded by the timeout and the watchdog."""

    def __init__(self, rank: int, world: int, group, timeout_s: float, grace_s: float, tensor_group=None) -> None:
        self.rank, self.world, self.group, self.timeout_s = rank, world, group, timeout_s
        # GPU ranks all-reduce activations over NCCL; plans and digests stay on the gloo group.
        self.tensor_group = tensor_group if tensor_group is not None else group
        self.step = 0  # the plan step being executed, named in errors
        self.broken = False  # a collective failed: the group cannot be trusted any more
        self.watchdog = Watchdog(rank, timeout_s, grace_s)

    def _run(self, op: str, fn):
        self.watchdog.arm(op, self.step)
        try:
            return fn()
        except RuntimeError as exc:  # gloo raises RuntimeError (DistBackendError) on timeout / peer loss
            self.broken = True
            raise CollectiveError(self.rank, op, self.step, self.timeout_s, exc) from exc
        finally:
            self.watchdog.disarm()

    def broadcast(self, obj=None):
        """rank 0 sends `obj`, the others receive it."""
        box = [obj]
        self._run("broadcast", lambda: dist.broadcast_object_list(box, src=0, group=self.group))
        return box[0]

    def all_gather(self, obj) -> list:
        out = [None] * self.world
        self._run("all_gather", lambda: dist.all_gather_object(out, obj, group=self.group))
        return out

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        group = self.tensor_group if tensor.is_cuda else self.group
        self._run("all_reduce", lambda: dist.all_reduce(tensor, group=group))
        return tensor

    def close(self) -> None:
        self.watchdog.stop()
        if dist.is_initialized():
            dist.destroy_process_group()


def uses_nccl(cfg) -> bool:
    """GPU ranks of the static runner all-reduce over NCCL (rank r on cuda:r)."""
    return cfg.static_runner and cfg.device != "cpu"


def init_collectives(rank: int, world: int, init_file: str, startup_timeout_s: float, timeout_s: float,
                     grace_s: float, nccl: bool = False) -> Collectives:
    """`nccl`: GPU ranks (rank r on cuda:r) also get an NCCL group for activation all-reduces;
    every rank must pass the same value (group creation is collective)."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=startup_timeout_s))
    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=timeout_s), backend="gloo")
    tensor_group = None
    if nccl:
        torch.cuda.set_device(rank)
        tensor_group = dist.new_group(list(range(world)), timeout=timedelta(seconds=timeout_s), backend="nccl")
    return Collectives(rank, world, group, timeout_s, grace_s, tensor_group)
