"""runtime/disagg/transfer.py: a request's KV pages written by page id into another process's pool
through Mooncake over loopback TCP arrive bit for bit (digest of the receiver's pages equals the
sender's), pages outside the request stay untouched, and the oracles fire on planted bugs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runtime.disagg.transfer import KVTransfer, PoolDescriptor, TransferError, kv_digest, page_runs, unavailable_reason
from runtime.faults import NO_FAULTS, FaultSet
from tests import pd_peer

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))
ROOT = Path(__file__).resolve().parents[2]


def sender(faults: FaultSet = NO_FAULTS) -> KVTransfer:
    latent, index_keys = pd_peer.pool()
    torch.manual_seed(0)
    latent.copy_(torch.randn_like(latent))
    index_keys.copy_(torch.randn_like(index_keys))
    return KVTransfer(latent, index_keys, pd_peer.PAGE, faults=faults)


@pytest.fixture
def peer():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "tests.pd_peer"], cwd=ROOT, env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        descriptor = PoolDescriptor.from_dict(json.loads(proc.stdout.readline()))

        def digest(pages: list[int], tokens: int) -> str:
            proc.stdin.write(json.dumps([pages, tokens]) + "\n")
            proc.stdin.flush()
            return proc.stdout.readline().strip()

        yield descriptor, digest
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_page_runs_coalesce_only_where_both_sides_are_consecutive():
    assert page_runs([3, 4, 5, 9], [0, 1, 7, 8]) == [(3, 0, 2), (5, 7, 1), (9, 8, 1)]
    assert page_runs([], []) == []


def test_pages_written_into_another_process_arrive_intact(peer):
    descriptor, digest = peer
    src = sender()
    src_pages, dst_pages, tokens = [1, 2, 5], [6, 3, 4], 20  # 20 tokens: the last page is partial
    before = digest([0, 7], 16)  # pages the write must not touch
    stats = src.write_pages(descriptor, src_pages, dst_pages)
    assert stats.bytes == 2 * 3 * pd_peer.PAGE * (pd_peer.LATENT + pd_peer.INDEX) * 4
    assert digest(dst_pages, tokens) == kv_digest(src.latent, src.index_keys, src_pages, pd_peer.PAGE, tokens)
    assert digest([0, 7], 16) == before


def test_kv_corrupt_fault_is_caught_by_the_digest(peer):
    """Negative control: pd-kv-corrupt flips one byte in transit; the receiver's digest differs."""
    descriptor, digest = peer
    src = sender(FaultSet(["pd-kv-corrupt"]))
    src.write_pages(descriptor, [1, 2], [3, 4])
    assert digest([3, 4], 16) != kv_digest(src.latent, src.index_keys, [1, 2], pd_peer.PAGE, 16)


def test_digest_depends_on_every_position_and_not_on_page_ids():
    src = sender()
    moved = src.latent.clone(), src.index_keys.clone()
    moved[0][:, 5 * pd_peer.PAGE:6 * pd_peer.PAGE] = src.latent[:, 1 * pd_peer.PAGE:2 * pd_peer.PAGE]
    moved[1][:, 5 * pd_peer.PAGE:6 * pd_peer.PAGE] = src.index_keys[:, 1 * pd_peer.PAGE:2 * pd_peer.PAGE]
    reference = kv_digest(src.latent, src.index_keys, [1], pd_peer.PAGE, 8)
    assert kv_digest(*moved, [5], pd_peer.PAGE, 8) == reference
    moved[1][1, 5 * pd_peer.PAGE + 7, 3] += 1  # the last position of the last layer's index key
    assert kv_digest(*moved, [5], pd_peer.PAGE, 8) != reference


def test_bad_peers_are_errors_not_hangs():
    src = sender()
    good = src.descriptor()
    with pytest.raises(TransferError, match="layout"):
        src.write_pages(PoolDescriptor(**{**good.to_dict(), "page_size": 16}), [0], [0])
    with pytest.raises(TransferError, match="outside"):
        src.write_pages(good, [0], [pd_peer.SLOTS // pd_peer.PAGE])
    with pytest.raises(TransferError, match="failed"):  # nobody listens there
        src.write_pages(PoolDescriptor(**{**good.to_dict(), "session": "127.0.0.1:1"}), [0], [1])
    with pytest.raises(ValueError, match="destination pages"):
        src.write_pages(good, [0, 1], [1])


def test_a_closed_pool_refuses_writes():
    src, dst = sender(), sender()
    dst.close()
    with pytest.raises(TransferError, match="failed"):
        src.write_pages(dst.descriptor(), [0], [1])
    dst.close()  # idempotent
