"""`KVTransfer`: the paged KV pool registered with a transfer engine, and writes of one request's
pages into a peer's pool, in one of two modes (both sides must use the same one):

- `direct`: both pools are registered and pages are written by page id. The pool
  (runtime/kvcache/kv_cache.py) is two tensors [layers, slots, dim]; page p of layer l is one
  contiguous run of `page_size * dim` elements, so a request's KV is `2 * layers` chunks per run of
  consecutive pages, written in one batch call. Host pools only.
- `staged`: each side registers a host staging arena (runtime/disagg/staging.py); the sender gathers
  the request's pages into a slot of its own, writes it into the slot the receiver reserved for the
  request in one engine write, and the receiver scatters it into its pages (`receive_staged`). The
  only mode for CUDA pools (the non-CUDA Mooncake engine registers host memory only), and the
  default (`DEFAULT_MODE` says why).

The engine is Mooncake's `TransferEngine` over TCP (RDMA where a NIC exists): both sides register
their memory once at start-up, the peer's addresses come with its bootstrap registration
(`PoolDescriptor`), and a write is a one-sided put into them.

A write that returned has landed: Mooncake's TCP transport acknowledges a write once the receiver
applied its last byte (its "v2" framing, in the pinned 0.3.13.post1; RDMA's reliable connections
complete on the remote's acknowledgement too). The PD sides rely on it: a room's pages go back to the
decode pool as soon as the prefill side says its write ended or can no longer start
(runtime/disagg/decode.py), and a late byte would land in another request's KV. `MC_TCP_PROTO=1`
(the legacy framing, which completes once the last byte left the sender's socket) breaks that: on
loopback 11 of 20 64 MiB writes returned before their last byte landed, and a write into a receiver
process stopped with SIGSTOP returns at once (tests/unit/test_pd_transfer.py); `KVTransfer` refuses it.
"""

from __future__ import annotations

import os
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import torch

from runtime.disagg.staging import (
    StagingArena,
    default_staging_bytes,
    gather_pages,
    pages_view,
    scatter_pages,
    staged_bytes,
)
from runtime.faults import NO_FAULTS, FaultSet
from runtime.server.trace import NO_TRACE, Trace

# The wheel and the Debian packages it links against (Makefile `install` target).
INSTALL_HINT = ("Mooncake's transfer engine is not installed: `make install` adds "
                "mooncake-transfer-engine-non-cuda and the Debian packages libibverbs1 librdmacm1")
# Entries per batch call: Mooncake 0.3.13 fails a batch somewhere between 2,048 and 3,000 entries.
MAX_BATCH = 1024
MODES = ("direct", "staged")
# How long a sender waits for staging space of its own (each slot is held for one gather + write).
SEND_SLOT_WAIT_S = 10.0
# The default transfer mode, on CPU pools too (CUDA pools have no other). Measured with
# bench/pd_transfer.py on loopback TCP, 2,048 tokens (docs/results.md "PD KV transfer on loopback"):
# staged beats direct 3.5-10x on scattered pages (canary 1.7 vs 16-20 ms, DSV4-sized 108-115 vs 375-380
# ms) and loses 1.5-2x on contiguous ones (canary 1.7 vs 0.8-0.9 ms, DSV4-sized 106 vs 69 ms). The page pool's
# free list is FIFO, so under concurrent requests a prompt's pages are scattered: staged wins where it
# matters, and CPU CI runs the very path the GPU servers run.
DEFAULT_MODE = "staged"


class TransferUnavailable(RuntimeError):
    """No transfer engine in this environment (the PD tests skip with this reason)."""


class TransferError(RuntimeError):
    """A write that the engine reported as failed (peer gone, bad address)."""


def mode_unsupported(mode: str, device: str | torch.device) -> str | None:
    """Why a KV pool on `device` cannot move its pages in transfer `mode`, or None when it can: the
    one rule, checked when a server starts (before its engine) and by `KVTransfer` itself."""
    if mode == "direct" and torch.device(device).type != "cpu":
        return (f"direct KV transfer registers the KV pool itself, which is on {device}: the non-CUDA Mooncake "
                f"engine registers host memory only (it cannot register device memory); use 'staged' (the default)")
    return None


def mooncake_engine_class():
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:  # the wheel is missing, or libibverbs/librdmacm are
        raise TransferUnavailable(f"{INSTALL_HINT} ({exc})") from None
    return TransferEngine


def tcp_engine(host: str = "127.0.0.1"):
    """A Mooncake TransferEngine listening on `host` over TCP, ready to register memory. P2PHANDSHAKE:
    peers exchange segment metadata directly, no metadata server (etcd) to run."""
    engine = mooncake_engine_class()()
    if engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
        raise TransferUnavailable(f"Mooncake TransferEngine.initialize({host!r}, tcp) failed")
    return engine


def unacknowledged_writes() -> str | None:
    """Why this process's writes would return before they landed (see the module doc), or None."""
    if os.environ.get("MC_TCP_PROTO") == "1":
        return ("MC_TCP_PROTO=1 selects Mooncake's legacy TCP framing, whose writes complete before they "
                "landed: a KV page given back after its write ended could still receive its bytes and corrupt "
                "another request's KV. Unset it (both PD sides run the same Mooncake version)")
    return None


def unavailable_reason() -> str | None:
    """Why PD cannot run here, or None when it can."""
    try:
        mooncake_engine_class()
    except TransferUnavailable as exc:
        return str(exc)
    return None


@dataclass(frozen=True)
class PoolDescriptor:
    """What a peer needs to write into this pool: its engine session and the pool's layout."""

    session: str  # "host:rpc_port" of the peer's transfer engine
    latent_ptr: int
    index_ptr: int
    num_layers: int
    num_slots: int
    latent_dim: int
    index_dim: int
    element_size: int
    page_size: int
    mode: str = "direct"
    # staged mode: the peer's staging arena (latent_ptr and index_ptr are 0 there: pools unregistered)
    staging_ptr: int = 0
    staging_bytes: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> PoolDescriptor:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})

    def layout(self) -> tuple:
        """Everything but the addresses: two pools must agree on it before pages can move."""
        return (self.num_layers, self.latent_dim, self.index_dim, self.element_size, self.page_size)


def page_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src_page, dst_page, count) for each stretch where both page lists advance by one."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def kv_digest(latent: torch.Tensor, index_keys: torch.Tensor, pages: list[int], page_size: int,
              num_tokens: int) -> str:
    """Checksum of the KV of positions 0..num_tokens-1 stored in `pages`: the sender's and the
    receiver's must match, whatever page ids each side used. CRC-32: it catches every burst of up to
    32 flipped bits (a flipped byte in transit) and a block of KV in the wrong place, which is what
    it is for; a cryptographic hash guards against nobody here, and blake2b took 4 ms a side for a
    2,290-token canary prompt on the CPU host (CRC-32: 0.8 ms), on every PD request's critical path."""
    used = torch.tensor(pages[:-(-num_tokens // page_size)], dtype=torch.long)
    crc = 0
    for pool in (latent, index_keys):
        layers, _, dim = pool.shape
        # Whole pages in one index_select on the pool's device, one copy to the host, then each
        # layer's first num_tokens rows (contiguous): the bytes of the positions in order.
        rows = pages_view(pool, page_size).index_select(1, used.to(pool.device)).view(layers, -1, dim).cpu()
        for layer in rows:
            crc = zlib.crc32(layer[:num_tokens].view(torch.uint8).reshape(-1).numpy(), crc)
    return f"{crc:08x}"


def digest_workers() -> ThreadPoolExecutor:
    """The threads a PD side computes its KV digests on (the sender's beside each write, the receiver's
    before admission), off the event loop and the engine thread. zlib's CRC and the device-to-host copy
    release the GIL, so a few threads digest concurrent requests side by side; a server is one side, so
    one pool per server."""
    return ThreadPoolExecutor(max_workers=4, thread_name_prefix="pd-digest")


def _byte_at(address: int) -> int:
    import ctypes

    return ctypes.c_uint8.from_address(address).value


@dataclass(frozen=True)
class WriteStats:
    bytes: int
    chunks: int
    seconds: float  # the whole write, gather included
    gather_seconds: float = 0.0  # staged mode: pages into the send slot


def mode_mismatch(mine: PoolDescriptor, peer: PoolDescriptor) -> str | None:
    """Why two pools cannot exchange pages in their transfer modes, or None when they can."""
    if peer.mode != mine.mode:
        return (f"transfer modes differ: the peer's pool is {peer.mode!r}, ours {mine.mode!r} (both sides must "
                f"run the same mode; CUDA pools need 'staged')")
    return None


class KVTransfer:
    """One process's transfer engine with its KV pool (direct) or its staging arena (staged) registered."""

    def __init__(self, latent: torch.Tensor, index_keys: torch.Tensor, page_size: int, host: str = "127.0.0.1",
                 faults: FaultSet = NO_FAULTS, mode: str = DEFAULT_MODE, staging_bytes: int | None = None) -> None:
        """`staging_bytes`: the staged mode's arena, shared by the requests in flight (receiver) or the
        writes in progress (sender); default: a decode server's default for this pool (the larger of
        the two roles' defaults, `default_staging_bytes`)."""
        if not (latent.is_contiguous() and index_keys.is_contiguous()):
            raise ValueError("the KV pool must be contiguous to be registered")
        if mode not in MODES:
            raise ValueError(f"transfer mode must be one of {MODES}, got {mode!r}")
        unsupported = mode_unsupported(mode, latent.device)
        if unsupported:
            raise TransferUnavailable(unsupported)
        unacknowledged = unacknowledged_writes()
        if unacknowledged:
            raise ValueError(unacknowledged)
        self.latent, self.index_keys, self.page_size, self.mode = latent, index_keys, page_size, mode
        self.faults = faults
        self.engine = tcp_engine(host)
        self.staging: StagingArena | None = None
        registered = [latent, index_keys]
        if mode == "staged":
            whole_pool = staged_bytes(latent, index_keys, latent.shape[1] // page_size, page_size)
            capacity = staging_bytes or default_staging_bytes("decode", one_prompt=0, whole_pool=whole_pool)
            self.staging = StagingArena(capacity, pinned=latent.device.type == "cuda")
            registered = [self.staging.buffer]
        for tensor in registered:
            if self.engine.register_memory(tensor.data_ptr(), tensor.numel() * tensor.element_size()) != 0:
                raise TransferUnavailable(f"Mooncake could not register the KV {mode} buffers")
        self._registered_tensors = registered
        # A registered byte of our own: the source of the pd-kv-corrupt fault's planted write.
        self._scratch = torch.zeros(64, dtype=torch.uint8)
        if self.engine.register_memory(self._scratch.data_ptr(), self._scratch.numel()) != 0:
            raise TransferUnavailable("Mooncake could not register its scratch buffer")
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self._registered = True

    def close(self) -> None:
        """Unregister the pool (idempotent): from now on the engine refuses a peer's write into it
        ("not within any registered buffer"), so a peer holding our old descriptor gets an error
        instead of storing into memory that may belong to something else by then."""
        if self._registered:
            for tensor in (*self._registered_tensors, self._scratch):
                self.engine.unregister_memory(tensor.data_ptr())
            self._registered = False

    def descriptor(self) -> PoolDescriptor:
        staging = self.staging
        direct = staging is None
        return PoolDescriptor(self.session, self.latent.data_ptr() if direct else 0,
                              self.index_keys.data_ptr() if direct else 0,
                              self.latent.shape[0], self.latent.shape[1], self.latent.shape[2],
                              self.index_keys.shape[2], self.latent.element_size(), self.page_size, self.mode,
                              staging.buffer.data_ptr() if staging else 0, staging.capacity if staging else 0)

    def _check_peer(self, peer: PoolDescriptor) -> None:
        mine = self.descriptor()
        if peer.layout() != mine.layout():
            raise TransferError(f"peer pool layout {peer.layout()} differs from ours {mine.layout()}")
        mismatch = mode_mismatch(mine, peer)
        if mismatch:
            raise TransferError(mismatch)

    def write_pages(self, peer: PoolDescriptor, src_pages: list[int], dst_pages: list[int],
                    staging_offset: int | None = None, trace: Trace = NO_TRACE) -> WriteStats:
        """Put this pool's `src_pages` into the peer's `dst_pages` (same order, same count); in staged
        mode through the peer's receive slot at `staging_offset` of its arena (reserved by the peer
        for this request, `staged_bytes` long), which the peer then scatters into `dst_pages`
        (`receive_staged`). `trace` gets "kv_gathered" (staged) once the send slot is filled."""
        if len(src_pages) != len(dst_pages):
            raise ValueError(f"{len(src_pages)} source pages for {len(dst_pages)} destination pages")
        self._check_peer(peer)
        if dst_pages and max(dst_pages) * self.page_size >= peer.num_slots:
            raise TransferError(f"destination page {max(dst_pages)} is outside the peer's pool")
        if not src_pages:
            return WriteStats(0, 0, 0.0)
        if self.staging is not None:
            return self._write_staged(peer, src_pages, staging_offset, trace)
        srcs, dsts, lens = [], [], []
        for tensor, peer_base, dim in ((self.latent, peer.latent_ptr, peer.latent_dim),
                                       (self.index_keys, peer.index_ptr, peer.index_dim)):
            esize, slots = tensor.element_size(), tensor.shape[1]
            for layer in range(tensor.shape[0]):
                for s, d, n in page_runs(src_pages, dst_pages):
                    offset_src = ((layer * slots + s * self.page_size) * dim) * esize
                    offset_dst = ((layer * peer.num_slots + d * self.page_size) * dim) * esize
                    srcs.append(tensor.data_ptr() + offset_src)
                    dsts.append(peer_base + offset_dst)
                    lens.append(n * self.page_size * dim * esize)
        started = time.perf_counter()
        self._put(peer.session, srcs, dsts, lens)
        return WriteStats(sum(lens), len(srcs), time.perf_counter() - started)

    def _write_staged(self, peer: PoolDescriptor, src_pages: list[int], staging_offset: int | None,
                      trace: Trace) -> WriteStats:
        assert self.staging is not None
        used = staged_bytes(self.latent, self.index_keys, len(src_pages), self.page_size)
        if staging_offset is None or staging_offset < 0 or staging_offset + used > peer.staging_bytes:
            raise TransferError(f"a staged write of {used} bytes needs a receive slot inside the peer's "
                                f"{peer.staging_bytes}-byte staging arena, got offset {staging_offset}")
        started = time.perf_counter()
        mine = self.staging.allocate(used, SEND_SLOT_WAIT_S)
        if mine is None:
            raise TransferError(f"no {used}-byte send staging slot came free within {SEND_SLOT_WAIT_S:g} s")
        try:
            gather_pages(self.latent, self.index_keys, src_pages, self.page_size, self.staging.view(mine, used))
            gathered = time.perf_counter()
            trace.mark("kv_gathered")
            # One entry: the slot is contiguous on both sides, and Mooncake cuts a large write into
            # slices itself (176 MB on loopback TCP: 63 ms as one entry, 67-70 ms as 2-32 MiB entries).
            self._put(peer.session, [self.staging.address(mine)], [peer.staging_ptr + staging_offset], [used])
        finally:
            self.staging.free(mine)
        return WriteStats(used, 1, time.perf_counter() - started, gathered - started)

    def staged_bytes(self, num_pages: int) -> int:
        """The receive slot a request of `num_pages` pages needs (staged mode)."""
        return staged_bytes(self.latent, self.index_keys, num_pages, self.page_size)

    def receive_staged(self, staging_offset: int, dst_pages: list[int]) -> float:
        """Scatter what a peer wrote into our receive slot at `staging_offset` into `dst_pages` (the
        pages the request reserved, in the order the sender was given them); returns its seconds."""
        if self.staging is None:
            raise TransferError("receive_staged on a pool in direct mode")
        started = time.perf_counter()
        slot = self.staging.view(staging_offset, self.staged_bytes(len(dst_pages)))
        scatter_pages(slot, self.latent, self.index_keys, dst_pages, self.page_size)
        return time.perf_counter() - started

    def _put(self, session: str, srcs: list[int], dsts: list[int], lens: list[int]) -> None:
        for at in range(0, len(srcs), MAX_BATCH):  # the engine refuses batches of a few thousand entries
            part = slice(at, at + MAX_BATCH)
            if self.engine.batch_transfer_sync_write(session, srcs[part], dsts[part], lens[part]) != 0:
                raise TransferError(f"KV write to {session} failed ({len(srcs)} chunks)")
        if self.faults.enabled("pd-kv-corrupt"):
            # The bug: one block arrives with a flipped byte (a transport that loses integrity).
            self._scratch[0] = _byte_at(srcs[0]) ^ 0x01
            if self.engine.transfer_sync_write(session, self._scratch.data_ptr(), dsts[0], 1) != 0:
                raise TransferError("pd-kv-corrupt: the planted write failed")
