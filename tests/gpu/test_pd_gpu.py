"""Issue 16 on the GPU: the staged KV transfer between CUDA pools (gather into a pinned send slot, one
Mooncake write over loopback TCP, scatter from the receive slot into the other pool) arrives bit for
bit, and a PD pair of GPU servers (`runtime.serve --device cuda --disaggregation-mode ...`) answers
exactly as the colocated GPU server. Each check has its negative control (pd-kv-corrupt)."""

from __future__ import annotations

import httpx
import pytest
import torch

from runtime.disagg.transfer import KVTransfer, TransferUnavailable, kv_digest, unavailable_reason
from runtime.faults import NO_FAULTS, FaultSet
from tests.e2e.pd_pair import pd_pair, serve_state, server_state
from tests.e2e.test_pd import OPENING, PROMPTS, answer, body, conversation, metric, wait_pages_free, wait_staging_free

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))]

LAYERS, SLOTS, LATENT, INDEX, PAGE = 3, 256, 80, 32, 16
GPU_SERVER = ("--device", "cuda", "--dtype", "float32")  # the numerics the GPU gate records
# The prefix cache is exact on a GPU but off by default there (Engine.use_prefix_cache): asked for.
GPU_PREFILL = (*GPU_SERVER, "--prefix-cache")


def cuda_pool(faults: FaultSet = NO_FAULTS, fill: float | None = None) -> KVTransfer:
    latent = torch.randn(LAYERS, SLOTS, LATENT, device="cuda")
    index_keys = torch.randn(LAYERS, SLOTS, INDEX, device="cuda")
    if fill is not None:
        latent.fill_(fill)
        index_keys.fill_(fill)
    return KVTransfer(latent, index_keys, PAGE, faults=faults, mode="staged")


def staged_move(src: KVTransfer, dst: KVTransfer, src_pages: list[int], dst_pages: list[int]) -> None:
    assert dst.staging is not None
    offset = dst.staging.allocate(dst.staged_bytes(len(dst_pages)))
    assert offset is not None
    src.write_pages(dst.descriptor(), src_pages, dst_pages, staging_offset=offset)
    dst.receive_staged(offset, dst_pages)
    dst.staging.free(offset)


def test_staged_transfer_between_cuda_pools_arrives_intact():
    src, dst = cuda_pool(), cuda_pool(fill=float("nan"))
    assert src.staging is not None and src.staging.buffer.is_pinned()
    staged_move(src, dst, [5, 1, 9, 10], [2, 7, 3, 4])
    tokens = 4 * PAGE - 3
    assert kv_digest(dst.latent, dst.index_keys, [2, 7, 3, 4], PAGE, tokens) == kv_digest(
        src.latent, src.index_keys, [5, 1, 9, 10], PAGE, tokens)
    assert src.staging.slots_in_use == 0 and dst.staging is not None and dst.staging.slots_in_use == 0


def test_kv_corrupt_between_cuda_pools_is_caught_by_the_digest():
    """Negative control: a byte flipped in transit reaches the CUDA pool through the scatter."""
    src, dst = cuda_pool(FaultSet(["pd-kv-corrupt"])), cuda_pool(fill=float("nan"))
    staged_move(src, dst, [5, 1], [2, 7])
    assert kv_digest(dst.latent, dst.index_keys, [2, 7], PAGE, 2 * PAGE) != kv_digest(
        src.latent, src.index_keys, [5, 1], PAGE, 2 * PAGE)


def test_direct_transfer_is_refused_on_cuda_pools():
    latent, index_keys = torch.zeros(1, 16, 4, device="cuda"), torch.zeros(1, 16, 4, device="cuda")
    with pytest.raises(TransferUnavailable, match="cannot register device memory"):
        KVTransfer(latent, index_keys, PAGE, mode="direct")


@pytest.fixture(scope="module")
def gpu_servers():
    with pd_pair(prefill_args=GPU_PREFILL, decode_args=GPU_SERVER) as pair, \
            serve_state(server_state(*GPU_SERVER)) as colocated:
        yield pair, colocated


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_pd_pair_of_gpu_servers_answers_as_the_colocated_gpu_server(gpu_servers, stream):
    pair, colocated = gpu_servers
    for state in (pair.prefill_state, pair.decode_state):
        assert state.engine.cfg.device.startswith("cuda") and state.pd.transfer.mode == "staged"
    for prompt in PROMPTS:
        payload = body(prompt, stream=stream)
        assert answer(pair.router, payload) == answer(colocated, payload)
    assert wait_pages_free(pair.prefill_state, pair.decode_state) == [0, 0]
    assert wait_staging_free(pair.prefill_state, pair.decode_state) == [0, 0]
    text = httpx.get(f"{pair.decode}/metrics").text
    assert "dsv4_pd_staging_slots_in_use 0.0" in text and 'dsv4_pd_transfers_total{outcome="ok"}' in text


def test_pd_pair_of_gpu_servers_catches_kv_corrupt():
    """Negative control of the pair's digest check on CUDA pools."""
    with pd_pair(prefill_args=(*GPU_SERVER, "--inject-fault", "pd-kv-corrupt"), decode_args=GPU_SERVER) as pair:
        reply = httpx.post(f"{pair.router}/v1/chat/completions", json=body(PROMPTS[0]), timeout=120)
        assert reply.status_code == 502 and reply.json()["error"]["code"] == "pd_kv_corrupt", reply.text
        assert wait_pages_free(pair.prefill_state, pair.decode_state) == [0, 0]
        assert wait_staging_free(pair.prefill_state, pair.decode_state) == [0, 0]


def test_a_shared_prefix_hits_the_gpu_prefill_servers_cache_and_answers_as_the_colocated_gpu_server(gpu_servers):
    """The prefix cache on a GPU prefill server (static runner, Triton kernels: asked for there): a
    conversation's second turn copies the first turn's pages from it and still answers as the colocated
    GPU server, bit for bit."""
    pair, colocated = gpu_servers
    assert pair.prefill_state.engine.prefix_cache is not None and pair.decode_state.engine.prefix_cache is None
    hits = metric(pair.prefill, "dsv4_prefix_cache_hit_tokens_total")
    got = conversation(pair.router, OPENING + "(gpu)")
    assert metric(pair.prefill, "dsv4_prefix_cache_hit_tokens_total") > hits
    assert got == conversation(colocated, OPENING + "(gpu)")
    assert wait_pages_free(pair.prefill_state, pair.decode_state) == [0, 0]
    assert wait_staging_free(pair.prefill_state, pair.decode_state) == [0, 0]


def test_a_stale_page_on_the_gpu_prefill_servers_cache_is_caught(gpu_servers):
    """Negative control of the test above: prefix-cache-stale-page on the GPU prefill server."""
    _, colocated = gpu_servers
    with pd_pair(prefill_args=(*GPU_PREFILL, "--inject-fault", "prefix-cache-stale-page"),
                 decode_args=GPU_SERVER) as pair:
        got = conversation(pair.router, OPENING + "(gpu stale)")
        assert pair.prefill_state.engine.prefix_cache.hit_tokens > 2 * pair.prefill_state.engine.pool.page_size
        assert got[1] != conversation(colocated, OPENING + "(gpu stale)")[1]
