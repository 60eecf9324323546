"""`KVTransfer`: the paged KV pool registered with a transfer engine, and page-id-addressed writes of
one request's pages into a peer's pool.

The pool (runtime/kvcache/kv_cache.py) is two tensors [layers, slots, dim]; page p of layer l is one
contiguous run of `page_size * dim` elements, so a request's KV is `2 * layers` chunks per run of
consecutive pages, written in one batch call. The engine is Mooncake's `TransferEngine` over TCP
(RDMA where a NIC exists): both sides register their pool once at start-up, the peer's addresses come
with its bootstrap registration (`PoolDescriptor`), and a write is a one-sided put into them.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import asdict, dataclass

import torch

from runtime.faults import NO_FAULTS, FaultSet

# The wheel and the Debian packages it links against (Makefile `install` target).
INSTALL_HINT = ("Mooncake's transfer engine is not installed: `make install` adds "
                "mooncake-transfer-engine-non-cuda and the Debian packages libibverbs1 librdmacm1")
# Entries per batch call: Mooncake 0.3.13 fails a batch somewhere between 2,048 and 3,000 entries.
MAX_BATCH = 1024


class TransferUnavailable(RuntimeError):
    """No transfer engine in this environment (the PD tests skip with this reason)."""


class TransferError(RuntimeError):
    """A write that the engine reported as failed (peer gone, bad address)."""


def mooncake_engine_class():
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:  # the wheel is missing, or libibverbs/librdmacm are
        raise TransferUnavailable(f"{INSTALL_HINT} ({exc})") from None
    return TransferEngine


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

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> PoolDescriptor:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__})

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
    """Hash of the KV of positions 0..num_tokens-1 stored in `pages`: the sender's and the receiver's
    must match, whatever page ids each side used (a flipped byte in transit changes it)."""
    positions = torch.arange(num_tokens)
    slots = torch.tensor(pages, dtype=torch.long)[positions // page_size] * page_size + positions % page_size
    h = hashlib.blake2b(digest_size=16)
    for tensor in (latent, index_keys):
        h.update(tensor[:, slots.to(tensor.device)].contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _byte_at(address: int) -> int:
    import ctypes

    return ctypes.c_uint8.from_address(address).value


@dataclass(frozen=True)
class WriteStats:
    bytes: int
    chunks: int
    seconds: float


class KVTransfer:
    """One process's transfer engine with its KV pool registered."""

    def __init__(self, latent: torch.Tensor, index_keys: torch.Tensor, page_size: int, host: str = "127.0.0.1",
                 faults: FaultSet = NO_FAULTS) -> None:
        if not (latent.is_contiguous() and index_keys.is_contiguous()):
            raise ValueError("the KV pool must be contiguous to be registered")
        self.latent, self.index_keys, self.page_size = latent, index_keys, page_size
        self.faults = faults
        self.engine = mooncake_engine_class()()
        # P2PHANDSHAKE: peers exchange segment metadata directly, no metadata server (etcd) to run.
        if self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
            raise TransferUnavailable(f"Mooncake TransferEngine.initialize({host!r}, tcp) failed")
        for tensor in (latent, index_keys):
            if self.engine.register_memory(tensor.data_ptr(), tensor.numel() * tensor.element_size()) != 0:
                raise TransferUnavailable("Mooncake could not register the KV pool")
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
            for tensor in (self.latent, self.index_keys, self._scratch):
                self.engine.unregister_memory(tensor.data_ptr())
            self._registered = False

    def descriptor(self) -> PoolDescriptor:
        return PoolDescriptor(self.session, self.latent.data_ptr(), self.index_keys.data_ptr(),
                              self.latent.shape[0], self.latent.shape[1], self.latent.shape[2],
                              self.index_keys.shape[2], self.latent.element_size(), self.page_size)

    def write_pages(self, peer: PoolDescriptor, src_pages: list[int], dst_pages: list[int]) -> WriteStats:
        """Put this pool's `src_pages` into the peer's `dst_pages` (same order, same count)."""
        if len(src_pages) != len(dst_pages):
            raise ValueError(f"{len(src_pages)} source pages for {len(dst_pages)} destination pages")
        if peer.layout() != self.descriptor().layout():
            raise TransferError(f"peer pool layout {peer.layout()} differs from ours {self.descriptor().layout()}")
        if dst_pages and max(dst_pages) * self.page_size >= peer.num_slots:
            raise TransferError(f"destination page {max(dst_pages)} is outside the peer's pool")
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
        if not srcs:
            return WriteStats(0, 0, 0.0)
        started = time.perf_counter()
        for at in range(0, len(srcs), MAX_BATCH):  # the engine refuses batches of a few thousand entries
            part = slice(at, at + MAX_BATCH)
            if self.engine.batch_transfer_sync_write(peer.session, srcs[part], dsts[part], lens[part]) != 0:
                raise TransferError(f"KV write to {peer.session} failed ({len(srcs)} chunks)")
        if self.faults.enabled("pd-kv-corrupt"):
            # The bug: one block arrives with a flipped byte (a transport that loses integrity).
            self._scratch[0] = _byte_at(srcs[0]) ^ 0x01
            if self.engine.transfer_sync_write(peer.session, self._scratch.data_ptr(), dsts[0], 1) != 0:
                raise TransferError("pd-kv-corrupt: the planted write failed")
        return WriteStats(sum(lens), len(srcs), time.perf_counter() - started)
