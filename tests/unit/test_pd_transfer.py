"""runtime/disagg/transfer.py: a request's KV pages written into another process's pool through
Mooncake over loopback TCP, in both transfer modes (direct: by page id; staged: through a receive
slot the receiver scatters), arrive bit for bit (digest of the receiver's pages equals the
sender's), pages outside the request stay untouched, and the oracles fire on planted bugs."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
import zlib
from multiprocessing import shared_memory
from pathlib import Path

import pytest
import torch

from runtime.disagg import transfer
from runtime.disagg.transfer import KVTransfer, PoolDescriptor, TransferError, kv_digest, page_runs, unavailable_reason
from runtime.faults import NO_FAULTS, FaultSet
from tests import pd_peer

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))
ROOT = Path(__file__).resolve().parents[2]


def sender(faults: FaultSet = NO_FAULTS, mode: str = "staged") -> KVTransfer:
    latent, index_keys = pd_peer.pool()
    torch.manual_seed(0)
    latent.copy_(torch.randn_like(latent))
    index_keys.copy_(torch.randn_like(index_keys))
    return KVTransfer(latent, index_keys, pd_peer.PAGE, faults=faults, mode=mode)


class Peer:
    """tests/pd_peer.py in its own process: the receiving pool, in one transfer mode."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        assert proc.stdout is not None
        self.descriptor = PoolDescriptor.from_dict(json.loads(proc.stdout.readline()))

    def ask(self, command):
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def digest(self, pages: list[int], tokens: int) -> str:
        return self.ask([pages, tokens])

    def put(self, src: KVTransfer, src_pages: list[int], dst_pages: list[int]):
        """One request's transfer as the PD sides run it: in staged mode the receiver reserves a slot,
        the sender writes into it, the receiver scatters it into its pages and frees it."""
        offset = self.ask({"reserve": len(dst_pages)}) if self.descriptor.mode == "staged" else None
        stats = src.write_pages(self.descriptor, src_pages, dst_pages, staging_offset=offset)
        if offset is not None:
            assert self.ask({"receive": [offset, dst_pages]}) == "ok"
        return stats


@pytest.fixture(params=transfer.MODES)
def peer(request):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "tests.pd_peer", request.param], cwd=ROOT, env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        yield Peer(proc)
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_page_runs_coalesce_only_where_both_sides_are_consecutive():
    assert page_runs([3, 4, 5, 9], [0, 1, 7, 8]) == [(3, 0, 2), (5, 7, 1), (9, 8, 1)]
    assert page_runs([], []) == []


def test_pages_written_into_another_process_arrive_intact(peer):
    src = sender(mode=peer.descriptor.mode)
    src_pages, dst_pages, tokens = [1, 2, 5], [6, 3, 4], 20  # 20 tokens: the last page is partial
    before = peer.digest([0, 7], 16)  # pages the write must not touch
    stats = peer.put(src, src_pages, dst_pages)
    assert stats.bytes == 2 * 3 * pd_peer.PAGE * (pd_peer.LATENT + pd_peer.INDEX) * 4
    assert stats.chunks == (1 if peer.descriptor.mode == "staged" else 2 * 2 * 3)  # staged: one write
    assert peer.digest(dst_pages, tokens) == kv_digest(src.latent, src.index_keys, src_pages, pd_peer.PAGE, tokens)
    assert peer.digest([0, 7], 16) == before
    if peer.descriptor.mode == "staged":
        assert peer.ask({"slots_in_use": None}) == 0 and src.staging is not None and src.staging.slots_in_use == 0


def test_kv_corrupt_fault_is_caught_by_the_digest(peer):
    """Negative control: pd-kv-corrupt flips one byte in transit; the receiver's digest differs."""
    src = sender(FaultSet(["pd-kv-corrupt"]), mode=peer.descriptor.mode)
    peer.put(src, [1, 2], [3, 4])
    assert peer.digest([3, 4], 16) != kv_digest(src.latent, src.index_keys, [1, 2], pd_peer.PAGE, 16)


def test_a_wrong_page_order_on_the_receiver_is_caught_by_the_digest(peer):
    """Negative control for the staged path: the receiver scattering the slot into its pages in
    another order than the sender gathered them (pages carry no ids in the slot) changes the digest."""
    if peer.descriptor.mode != "staged":
        pytest.skip("direct writes address pages by id: no order to get wrong on the receiver")
    src = sender(mode="staged")
    offset = peer.ask({"reserve": 2})
    src.write_pages(peer.descriptor, [1, 2], [3, 4], staging_offset=offset)
    peer.ask({"receive": [offset, [4, 3]]})  # the planted bug: the receiver's pages swapped
    assert peer.digest([3, 4], 16) != kv_digest(src.latent, src.index_keys, [1, 2], pd_peer.PAGE, 16)


def test_digest_depends_on_every_position_and_not_on_page_ids():
    src = sender()
    moved = src.latent.clone(), src.index_keys.clone()
    moved[0][:, 5 * pd_peer.PAGE:6 * pd_peer.PAGE] = src.latent[:, 1 * pd_peer.PAGE:2 * pd_peer.PAGE]
    moved[1][:, 5 * pd_peer.PAGE:6 * pd_peer.PAGE] = src.index_keys[:, 1 * pd_peer.PAGE:2 * pd_peer.PAGE]
    reference = kv_digest(src.latent, src.index_keys, [1], pd_peer.PAGE, 8)
    assert kv_digest(*moved, [5], pd_peer.PAGE, 8) == reference
    moved[1][1, 5 * pd_peer.PAGE + 7, 3] += 1  # the last position of the last layer's index key
    assert kv_digest(*moved, [5], pd_peer.PAGE, 8) != reference


@pytest.mark.parametrize("tokens", [1, 15, 16, 17, 3 * pd_peer.PAGE - 1])
def test_digest_is_the_crc32_of_the_positions_bytes_in_order(tokens):
    """The definition both sides must share, against a per-position reference: the bytes of positions
    0..tokens-1 of every layer, latent then index keys, whatever the pages (scattered, out of order,
    a last page partly used). A CRC-32, not blake2b: 4 ms a side at 2K canary tokens on the CPU host."""
    src = sender()
    pages = [6, 2, 5]
    positions = torch.arange(tokens)
    slots = torch.tensor(pages)[positions // pd_peer.PAGE] * pd_peer.PAGE + positions % pd_peer.PAGE
    crc = 0
    for pool in (src.latent, src.index_keys):
        crc = zlib.crc32(pool[:, slots].contiguous().view(torch.uint8).numpy().tobytes(), crc)
    assert kv_digest(src.latent, src.index_keys, pages, pd_peer.PAGE, tokens) == f"{crc:08x}"


def test_bad_peers_are_errors_not_hangs():
    src = sender(mode="direct")
    good = src.descriptor()
    with pytest.raises(TransferError, match="layout"):
        src.write_pages(PoolDescriptor(**{**good.to_dict(), "page_size": 16}), [0], [0])
    with pytest.raises(TransferError, match="outside"):
        src.write_pages(good, [0], [pd_peer.SLOTS // pd_peer.PAGE])
    with pytest.raises(TransferError, match="failed"):  # nobody listens there
        src.write_pages(PoolDescriptor(**{**good.to_dict(), "session": "127.0.0.1:1"}), [0], [1])
    with pytest.raises(ValueError, match="destination pages"):
        src.write_pages(good, [0, 1], [1])


def test_bad_staged_peers_are_errors_not_hangs():
    src, dst = sender(mode="staged"), sender(mode="staged")
    good = dst.descriptor()
    with pytest.raises(TransferError, match="receive slot"):  # no slot given
        src.write_pages(good, [0], [1])
    with pytest.raises(TransferError, match="receive slot"):  # a slot running past the peer's arena
        src.write_pages(good, [0], [1], staging_offset=good.staging_bytes - 8)
    with pytest.raises(TransferError, match="failed"):  # nobody listens there
        src.write_pages(PoolDescriptor(**{**good.to_dict(), "session": "127.0.0.1:1"}), [0], [1], staging_offset=0)
    assert src.staging is not None and src.staging.slots_in_use == 0  # the send slot came back after the failure


def test_transfer_modes_that_differ_are_a_clear_error():
    """Both pools must run the same mode: a staged sender refuses a direct peer's descriptor (and the
    other way round) with an error naming the modes, before anything is written."""
    staged, direct = sender(mode="staged"), sender(mode="direct")
    with pytest.raises(TransferError, match="transfer modes differ"):
        staged.write_pages(direct.descriptor(), [0], [1], staging_offset=0)
    with pytest.raises(TransferError, match="transfer modes differ"):
        direct.write_pages(staged.descriptor(), [0], [1])


def test_direct_mode_refuses_a_pool_off_the_host():
    latent, index_keys = (t.to("meta") for t in pd_peer.pool())
    with pytest.raises(transfer.TransferUnavailable, match="staged"):
        KVTransfer(latent, index_keys, pd_peer.PAGE, mode="direct")


def test_an_unsized_arena_gets_the_one_default():
    """`KVTransfer` without `staging_bytes` sizes its arena as `default_staging_bytes` does for a decode
    server (it used to have a default of its own: the whole pool's KV, 8 KiB here)."""
    from runtime.disagg.staging import default_staging_bytes, staged_bytes

    made = sender()
    assert made.staging is not None
    whole_pool = staged_bytes(made.latent, made.index_keys, pd_peer.SLOTS // pd_peer.PAGE, pd_peer.PAGE)
    assert made.staging.capacity == default_staging_bytes("decode", one_prompt=0, whole_pool=whole_pool)


@pytest.mark.parametrize("mode", transfer.MODES)
def test_a_closed_pool_refuses_writes(mode):
    src, dst = sender(mode=mode), sender(mode=mode)
    dst.close()
    with pytest.raises(TransferError, match="failed"):
        src.write_pages(dst.descriptor(), [0], [1], staging_offset=0)
    dst.close()  # idempotent


# How long a write into a stopped receiver gets to return. An acknowledged write cannot return
# while no thread of the receiver runs, however long it waits (a second of not returning is the
# check); the legacy framing returns at once (its bytes fit the loopback socket buffers), and is given
# longer only so a loaded host's scheduling cannot fail the control.
ACKED_WAIT_S, LEGACY_WAIT_S = 1.0, 10.0
# Small enough to sit in loopback's socket buffers while the receiver is stopped.
STOPPED_WRITE_BYTES = 64 << 10


def _stop(pid: int) -> None:
    """SIGSTOP `pid` and wait until every thread of it is stopped: kill() returns before they are (a
    thread stops when it next handles the signal), and on a loaded host a receiving thread woken by
    the write's bytes could otherwise still answer it (seen once in 15 writes with both cores busy)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 30
    while not all(_thread_state(stat) in "tT" for stat in Path(f"/proc/{pid}/task").glob("*/stat")):
        assert time.monotonic() < deadline, f"process {pid} did not stop"
        time.sleep(0.001)


def _thread_state(stat: Path) -> str:
    """The state letter of /proc/PID/task/TID/stat (after the parenthesised name, which may hold spaces);
    a thread gone meanwhile reads as stopped (it cannot run)."""
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return "T"


def _write_to_a_stopped_receiver(wait_s: float) -> tuple[bool, bool]:
    """Write into another process's registered memory while that process is stopped (SIGSTOP), after
    one write with it running (so the connection and the peer's segment are open). Returns whether
    the write returned within `wait_s` while the receiver was stopped - then it returned before landing, since no
    receiving thread could run - and whether every byte was there once the receiver ran again and
    the write returned. Timing-free: the receiver is not slow, it is stopped."""
    size = STOPPED_WRITE_BYTES
    shm = shared_memory.SharedMemory(create=True, size=size)
    landing = torch.frombuffer(shm.buf, dtype=torch.uint8)
    landing.fill_(0)
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    receiver = context.Process(target=pd_peer.raw_receiver, args=(shm.name, size, theirs), daemon=True)
    receiver.start()
    try:
        assert ours.poll(60), "the receiving process did not come up"
        port, address = ours.recv()
        engine = transfer.tcp_engine()
        source = torch.full((size,), 1, dtype=torch.uint8)
        assert engine.register_memory(source.data_ptr(), size) == 0
        peer = f"127.0.0.1:{port}"
        assert engine.transfer_sync_write(peer, source.data_ptr(), address, size) == 0
        # Only to open the connection; the legacy framing may return before it landed, so wait for it.
        deadline = time.monotonic() + 30
        while not bool((landing == 1).all()):
            assert time.monotonic() < deadline, "a write to a running receiver never landed"
            time.sleep(0.001)
        source.fill_(2)
        _stop(receiver.pid)
        outcome: dict[str, int] = {}
        writer = threading.Thread(
            target=lambda: outcome.update(rc=engine.transfer_sync_write(peer, source.data_ptr(), address, size)),
            daemon=True)
        writer.start()
        writer.join(wait_s)
        returned_while_stopped = not writer.is_alive()
        os.kill(receiver.pid, signal.SIGCONT)
        writer.join(30)
        assert not writer.is_alive(), "the write did not return after the receiver ran again"
        assert outcome["rc"] == 0
        return returned_while_stopped, bool((landing == 2).all())
    finally:
        if receiver.is_alive():
            os.kill(receiver.pid, signal.SIGCONT)
            ours.send(None)
            receiver.join(10)
        if receiver.is_alive():
            receiver.kill()
        del landing
        shm.close()
        shm.unlink()


def test_a_write_that_returned_has_landed(monkeypatch):
    """What the decode side's page reuse rests on (runtime/disagg/transfer.py's module doc): once a
    write returned on the sender, every byte is in the receiver's memory. The receiver is stopped
    while the write is in flight, so this holds on any host, fast or slow. Negative control: the
    legacy framing (MC_TCP_PROTO=1), which completes when the last byte left the sender's socket,
    returns while the receiver is stopped."""
    monkeypatch.delenv("MC_TCP_PROTO", raising=False)
    assert _write_to_a_stopped_receiver(ACKED_WAIT_S) == (False, True)
    monkeypatch.setenv("MC_TCP_PROTO", "1")
    returned_while_stopped, _ = _write_to_a_stopped_receiver(LEGACY_WAIT_S)
    assert returned_while_stopped


def test_a_transfer_refuses_the_legacy_tcp_framing(monkeypatch):
    monkeypatch.setenv("MC_TCP_PROTO", "1")
    with pytest.raises(ValueError, match="MC_TCP_PROTO=1 selects Mooncake's legacy TCP framing"):
        sender()
    monkeypatch.setenv("MC_TCP_PROTO", "2")
    assert transfer.unacknowledged_writes() is None
    monkeypatch.delenv("MC_TCP_PROTO")
    sender().close()
