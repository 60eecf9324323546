"""`start_engine`: an `Engine`, as rank 0 of a tensor-parallel group when `tp > 1`.

The group is started here and handed to the engine (`Engine(tp_group=...)`), so the arrow runs one
way: distributed/ drives engine/, and engine/ never imports distributed/.
"""

from __future__ import annotations

from runtime.config import EngineConfig
from runtime.distributed.launcher import TPLauncher
from runtime.engine.engine import Engine
from runtime.env import Env
from runtime.faults import FaultSet
from runtime.models.loader import LoadedModel
from runtime.streams.tasks import StreamExecutor


def start_engine(loaded: LoadedModel, cfg: EngineConfig | None = None, faults: FaultSet | None = None,
                 env: Env | None = None, streams: StreamExecutor | None = None, *, overlap: bool = False,
                 tp: int = 1, disaggregation: str | None = None) -> Engine:
    """`Engine(...)` with the same defaults; with `tp > 1` the worker ranks are spawned first (they get
    the same config, faults and env as rank 0) and stop with `Engine.shutdown`."""
    if tp <= 1:
        return Engine(loaded, cfg, faults, env, streams, overlap=overlap, disaggregation=disaggregation)
    env = env or Env.load()
    cfg = cfg or EngineConfig()
    faults = faults if faults is not None else FaultSet.from_env(env)
    group = TPLauncher.start(loaded, cfg, faults, env, tp, overlap)
    return Engine(loaded, cfg, faults, env, streams, overlap=overlap, tp_group=group, disaggregation=disaggregation)
