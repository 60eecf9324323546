"""The prefix cache on the GPU runner (graphs, side stream; normal and overlap loops): a hit gives the
bits of a full prefill, tokens and logprobs, and nothing leaks.

Why it can be exact here: a prompt token's bits do not depend on the prefill chunk it lands in
(tests/gpu/test_engine_gpu.py::test_prompt_bits_do_not_depend_on_the_prefill_chunk), and a hit is a
prefill that starts after copied pages. This test is the proof the engine's rule relies on for CUDA.
Negative control: `prefix-cache-stale-page` (one matched page copied from the entry before it)."""

from __future__ import annotations

import pytest

from runtime.config import EngineConfig, default_model
from runtime.engine.engine import Engine
from runtime.env import Env
from runtime.faults import FaultSet
from runtime.models.loader import load_model
from tests.unit.test_prefix_cache import assert_idle, converse

pytestmark = [pytest.mark.gpu]


@pytest.fixture(scope="module")
def loaded():
    return load_model(default_model())


def gpu_engine(loaded, prefix_cache: bool, faults=(), overlap=False, dtype="bfloat16") -> Engine:
    cfg = EngineConfig(device="cuda", dtype=dtype, num_pages=2048, max_running_requests=16, prefix_cache=prefix_cache)
    return Engine(loaded, cfg, FaultSet(faults), Env(), overlap=overlap)


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_multi_turn_with_cache_equals_without_bit_for_bit_on_the_gpu(loaded, overlap, dtype):
    on = gpu_engine(loaded, True, overlap=overlap, dtype=dtype)
    with_cache = converse(on, sessions=6, turns=4)
    off = gpu_engine(loaded, False, overlap=overlap, dtype=dtype)
    assert off.prefix_cache is None
    assert with_cache == converse(off, sessions=6, turns=4), "a prefix-cache hit changed a token or logprob"
    cache = on.prefix_cache
    assert cache.hit_tokens > cache.lookup_tokens / 3, (cache.hit_tokens, cache.lookup_tokens)
    assert on.runner.graphs.replays > 0
    assert_idle(on)
    assert_idle(off)


def test_stale_page_fault_breaks_the_equality_on_the_gpu(loaded):
    faulty = converse(gpu_engine(loaded, True, faults=["prefix-cache-stale-page"]), sessions=6, turns=4)
    assert faulty != converse(gpu_engine(loaded, False), sessions=6, turns=4)
