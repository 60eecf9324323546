"""Configs validate themselves; faults and env knobs parse strictly."""

from __future__ import annotations

import pytest

from runtime.config import PRESETS, EngineConfig, ModelConfig
from runtime.env import Env
from runtime.faults import REGISTRY, FaultSet, UnknownFaultError

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("bad", [
    dict(hidden_size=0), dict(rope_dim=3), dict(index_dim=4, rope_dim=8), dict(num_experts_per_tok=9),
    dict(n_group=3), dict(topk_group=2), dict(eos_token_id=999), dict(sliding_window=0),
])
def test_model_config_rejects_bad_values(bad):
    with pytest.raises(ValueError):
        ModelConfig(**bad)


def test_model_config_round_trips_and_rejects_unknown_keys():
    cfg = PRESETS["tiny-random"]
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown keys"):
        ModelConfig.from_dict({**cfg.to_dict(), "hiden_size": 3})
    assert cfg.selected_tokens == cfg.sliding_window + cfg.index_topk


def test_engine_config_rejects_bad_values():
    with pytest.raises(ValueError):
        EngineConfig(page_size=0)
    with pytest.raises(ValueError):
        EngineConfig(dtype="int8")


def test_every_design_fault_is_registered_and_off_by_default():
    design = {"stream-race", "stale-graph-metadata", "kv-slot-reuse", "tp-local-abort", "overlap-stale-token",
              "tool-json-corrupt", "slow-step"}
    assert design <= set(REGISTRY)
    assert FaultSet.from_env(Env()).names == ()


def test_unknown_fault_is_a_clear_error():
    with pytest.raises(UnknownFaultError, match="known faults"):
        FaultSet(["kv-slot-reus"])


def test_env_parses_knobs_strictly():
    env = Env.load({"DSV4_FAULTS": "slow-step, kv-slot-reuse", "DSV4_SLOW_STEP_MS": "5",
                    "DSV4_REFERENCE_KERNELS": "yes"})
    assert env.faults == ("slow-step", "kv-slot-reuse") and env.slow_step_ms == 5.0 and env.reference_kernels
    with pytest.raises(ValueError):
        Env.load({"DSV4_REFERENCE_KERNELS": "maybe"})
