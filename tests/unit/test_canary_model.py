"""The shipped canary model plays held-out sessions exactly through the engine, and the
kv-slot-reuse fault (pages shared between live requests) visibly breaks it (negative control)."""

from __future__ import annotations

import pytest

from runtime.env import Env
from runtime.eval_canary import evaluate
from runtime.models.loader import load_model

pytestmark = pytest.mark.unit

MODEL = "golden/models/canary-moe-v2"
SEEDS = list(range(200, 206))


@pytest.fixture(scope="module")
def canary():
    return load_model(MODEL)


def test_canary_model_fits_the_budget_and_exercises_the_sparse_path(canary):
    size = sum(w.numel() * w.element_size() for w in canary.weights.values())
    assert size <= 12 * 2**20
    assert canary.config.selected_tokens < 100


def test_held_out_sessions_are_exact_at_concurrency(canary):
    result = evaluate(canary, SEEDS, concurrency=6, env=Env(num_threads=1))
    assert result["tool_call_exact_match"] >= 0.995 and result["answer_exact_match"] >= 0.99, result["failures"]
    assert result["sparse_fraction_late_turns"] > 0.5


def test_kv_slot_reuse_fault_breaks_exact_match(canary):
    result = evaluate(canary, SEEDS, concurrency=6, faults=("kv-slot-reuse",), env=Env(num_threads=1))
    assert result["answer_exact_match"] < 0.9, result
