"""Staged KV transfer's buffers: `StagingArena`, a host buffer handed out as slots (one per request
in flight, sized to it), and `gather_pages` / `scatter_pages`, which move a request's pages between
a KV pool (CPU or CUDA) and one slot.

A slot holds a request's KV as two blocks, latent then index keys, each [layers, pages, page_size,
dim] in the pool's dtype: the sender gathers its pages into its slot, writes the slot's used bytes
into the receiver's slot in one engine write, and the receiver scatters them into its own pages.
Page ids never travel: the order of the pages in the slot is the order of the page lists, so both
sides must pass their pages in request order (a wrong order lands KV in the wrong positions, which
the digest check catches).

Slots are host memory because the non-CUDA Mooncake engine registers host memory only; pinned when
the pool is on CUDA, so the device copies are DMA and not staged again by the driver.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import torch

# The arena's least size: room for many short prompts in flight at once (canary prompts of a few
# hundred tokens take ~0.5 MB each); never less than one prompt of --max-model-len tokens.
MIN_STAGING_BYTES = 64 << 20
# A decode server reserves a request's receive slot when its room opens and holds it while the
# prompt waits for, and goes through, the prefill server: under load every room in flight holds one.
# Those rooms hold their pages in the pool too, so an arena of the pool's KV never makes a room the
# pool admitted wait; twice that leaves the first-fit arena room for its fragmentation. (The 80-session
# PD gate failed 11 requests on 64 MiB: 80 rooms of ~1.8 MB waited 30 s for slots.) Pinned host memory
# is dear, so the default stops at this cap; above it a room may wait for staging, up to the PD
# timeout, then fails with `pd_out_of_staging`.
DECODE_STAGING_CAP_BYTES = 8 << 30


def default_staging_bytes(role: str, one_prompt: int, whole_pool: int) -> int:
    """The arena a side gets when nobody sized it (the one place that decides): a prefill server's
    send slots live for one gather + write each (MIN_STAGING_BYTES); a decode server's receive slots
    for a room's whole wait, so it gets twice its pool's KV (`whole_pool` bytes) up to
    DECODE_STAGING_CAP_BYTES. Never less than `one_prompt`, the bytes of one longest prompt."""
    if role == "decode":
        return max(MIN_STAGING_BYTES, one_prompt, min(2 * whole_pool, DECODE_STAGING_CAP_BYTES))
    if role == "prefill":
        return max(MIN_STAGING_BYTES, one_prompt)
    raise ValueError(f"a staging arena's role is 'prefill' or 'decode', got {role!r}")


def staged_bytes(latent: torch.Tensor, index_keys: torch.Tensor, num_pages: int, page_size: int) -> int:
    """Bytes one request of `num_pages` pages fills in a slot."""
    per_slot_row = latent.shape[0] * (latent.shape[2] * latent.element_size()
                                      + index_keys.shape[2] * index_keys.element_size())
    return num_pages * page_size * per_slot_row


def pages_view(pool: torch.Tensor, page_size: int) -> torch.Tensor:
    """A KV pool by page: [layers, slots, dim] -> [layers, pages, page_size, dim], no copy (the pool is
    contiguous); also what `kv_digest` gathers whole pages from."""
    layers, slots, dim = pool.shape
    return pool.view(layers, slots // page_size, page_size, dim)


def _blocks(buffer: torch.Tensor, latent: torch.Tensor, index_keys: torch.Tensor, num_pages: int,
            page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The latent and index-key blocks of a slot (a uint8 buffer), typed and shaped like the pool."""
    views = []
    at = 0
    for pool in (latent, index_keys):
        shape = (pool.shape[0], num_pages, page_size, pool.shape[2])
        size = shape[0] * shape[1] * shape[2] * shape[3] * pool.element_size()
        views.append(buffer[at:at + size].view(pool.dtype).view(shape))
        at += size
    return views[0], views[1]


def gather_pages(latent: torch.Tensor, index_keys: torch.Tensor, pages: list[int], page_size: int,
                 slot: torch.Tensor) -> int:
    """Copy `pages` of every layer of both pools into `slot` (host, uint8, at least `staged_bytes`
    long); returns the bytes used.
    Synchronous: the slot is complete when it returns (the engine reads it right after)."""
    used = staged_bytes(latent, index_keys, len(pages), page_size)
    if used > slot.numel():
        raise ValueError(f"{len(pages)} pages need {used} staging bytes, a slot has {slot.numel()}")
    ids = torch.tensor(pages, dtype=torch.long, device=latent.device)
    for pool, block in zip((latent, index_keys), _blocks(slot, latent, index_keys, len(pages), page_size)):
        if pool.device.type == "cpu":  # straight into the slot, no temporary
            torch.index_select(pages_view(pool, page_size), 1, ids, out=block)
        else:  # one gather on the device, then one DMA into the pinned slot
            block.copy_(pages_view(pool, page_size).index_select(1, ids), non_blocking=True)
    if latent.device.type == "cuda":
        torch.cuda.current_stream(latent.device).synchronize()
    return used


def scatter_pages(slot: torch.Tensor, latent: torch.Tensor, index_keys: torch.Tensor, pages: list[int],
                  page_size: int) -> None:
    """Copy a slot filled by `gather_pages` (same page count) into `pages` of the pools."""
    ids = torch.tensor(pages, dtype=torch.long, device=latent.device)
    for pool, block in zip((latent, index_keys), _blocks(slot, latent, index_keys, len(pages), page_size)):
        pages_view(pool, page_size).index_copy_(1, ids, block.to(pool.device, non_blocking=True))
    if latent.device.type == "cuda":  # the slot may be handed out again once this returns
        torch.cuda.current_stream(latent.device).synchronize()


class StagingArena:
    """One host buffer (registered with the engine by its owner) handed out as slots: one contiguous
    run of bytes per request in flight, sized to that request, first fit. Sized slots rather than
    fixed ones: a fixed slot must hold the longest prompt, so the short prompts of a busy server would
    need many times the memory. Thread-safe: the prefill side takes slots on the engine thread and on
    worker threads, the decode side on its event loop."""

    ALIGN = 4096  # slot offsets and sizes: whole host pages

    def __init__(self, capacity: int, pinned: bool) -> None:
        capacity = -(-capacity // self.ALIGN) * self.ALIGN
        if capacity <= 0:
            raise ValueError(f"a staging arena needs a positive capacity, got {capacity}")
        self.capacity = capacity
        # Not zeroed: a decode arena is up to 8 GiB, and no byte is read before it is written. The
        # sender gathers into its slot before the engine reads it; the receiver scatters the pages of
        # its request, as many as the sender wrote (both sides count pages_for_tokens(prompt)), and
        # its digest covers the prompt's positions, all inside those pages.
        self.buffer = torch.empty(capacity, dtype=torch.uint8, pin_memory=pinned)
        self._free: list[tuple[int, int]] = [(0, capacity)]  # (offset, size), sorted, never adjacent
        self._used: dict[int, int] = {}  # offset -> size of each slot handed out
        self._cond = threading.Condition()

    @property
    def slots_in_use(self) -> int:
        with self._cond:
            return len(self._used)

    @property
    def bytes_in_use(self) -> int:
        with self._cond:
            return sum(self._used.values())

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        with self._cond:
            size = self._used.get(offset)
        if size is None or nbytes > size:
            raise ValueError(f"no staging slot of {nbytes} bytes at offset {offset}")
        return self.buffer[offset:offset + nbytes]

    def address(self, offset: int) -> int:
        return self.buffer.data_ptr() + offset

    def allocate(self, nbytes: int, timeout_s: float = 0.0,
                 cancelled: Callable[[], bool] = lambda: False) -> int | None:
        """The offset of a new slot of at least `nbytes`, waiting up to `timeout_s` for other slots to be
        freed (0: no wait); None at the deadline, or as soon as `cancelled()` is true (looked at whenever
        a free or `wake()` wakes the waiters). First fit."""
        if nbytes > self.capacity:
            raise ValueError(f"a staging slot of {nbytes} bytes exceeds the whole arena ({self.capacity} bytes)")
        size = max(1, -(-nbytes // self.ALIGN)) * self.ALIGN
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                offset = self._take(size)
                left = deadline - time.monotonic()
                if offset is not None or left <= 0 or cancelled():
                    return offset
                self._cond.wait(left)

    async def allocate_async(self, nbytes: int, timeout_s: float) -> int | None:
        """`allocate` for an event loop: the wait runs on a thread of its own (a slot is often free at
        once, and then no thread starts). Cancelling the caller stops the wait, and a slot the thread
        took meanwhile is freed: a request given up while it waited holds nothing."""
        offset = self.allocate(nbytes)
        if offset is not None:
            return offset
        loop = asyncio.get_running_loop()
        got: asyncio.Future[int | None] = loop.create_future()
        stop = threading.Event()

        def settle(offset: int | None) -> None:  # on the loop
            if not got.cancelled():
                got.set_result(offset)
            elif offset is not None:
                self.free(offset)

        def wait() -> None:
            offset = self.allocate(nbytes, timeout_s, stop.is_set)
            try:
                loop.call_soon_threadsafe(settle, offset)
            except RuntimeError:  # the loop is closed (server shutdown): nobody takes the slot
                if offset is not None:
                    self.free(offset)

        threading.Thread(target=wait, name="staging-wait", daemon=True).start()
        try:
            return await got
        except asyncio.CancelledError:
            stop.set()
            self.wake()
            raise

    def wake(self) -> None:
        """Make waiting `allocate` calls look at their `cancelled` check now."""
        with self._cond:
            self._cond.notify_all()

    def _take(self, size: int) -> int | None:
        # Caller holds the lock; `size` is whole host pages.
        for i, (offset, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (offset + size, free - size)
                self._used[offset] = size
                return offset
        return None

    def free(self, offset: int) -> None:
        with self._cond:
            size = self._used.pop(offset, None)
            if size is None:
                raise ValueError(f"staging slot at offset {offset} is not in use")
            self._free.append((offset, size))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for start, length in self._free:  # coalesce neighbours, so large slots fit again
                if merged and merged[-1][0] + merged[-1][1] == start:
                    merged[-1] = (merged[-1][0], merged[-1][1] + length)
                else:
                    merged.append((start, length))
            self._free = merged
            self._cond.notify_all()
