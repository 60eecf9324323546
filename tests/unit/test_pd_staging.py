"""runtime/disagg/staging.py without a transfer engine: `gather_pages` / `scatter_pages` move a
request's pages through a staging slot into another pool's pages in request order, on CPU pools and
(marked gpu) on CUDA pools with a pinned arena, the GPU servers' path; `StagingArena` hands out sized
slots, takes them back, and its counts show a slot nobody freed. Each oracle has a negative control."""

from __future__ import annotations

import threading

import pytest
import torch

from runtime.disagg.staging import StagingArena, gather_pages, scatter_pages, staged_bytes
from runtime.disagg.transfer import TransferUnavailable, kv_digest

LAYERS, PAGES, PAGE, LATENT, INDEX = 3, 12, 4, 10, 6
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def pools(device: str, dtype: torch.dtype, fill: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    made = []
    for dim in (LATENT, INDEX):
        values = torch.randn(LAYERS, PAGES * PAGE, dim, generator=generator)
        made.append((values if fill is None else torch.full_like(values, fill)).to(device, dtype))
    return made[0], made[1]


def move(device: str, dtype: torch.dtype, src_pages: list[int], dst_pages: list[int],
         scatter_order: list[int] | None = None) -> tuple[str, str]:
    """The digests of the sender's pages and of the receiver's after a gather into a slot of a
    (pinned, on CUDA) arena and a scatter of it; `scatter_order` plants a receiver-side page order."""
    src, dst = pools(device, dtype), pools(device, dtype, fill=float("nan"))
    arena = StagingArena(staged_bytes(*src, PAGES, PAGE), pinned=device == "cuda")
    nbytes = staged_bytes(*src, len(src_pages), PAGE)
    offset = arena.allocate(nbytes)
    assert offset is not None
    assert gather_pages(*src, src_pages, PAGE, arena.view(offset, nbytes)) == nbytes
    scatter_pages(arena.view(offset, nbytes), *dst, scatter_order or dst_pages, PAGE)
    arena.free(offset)
    tokens = len(src_pages) * PAGE - 1  # the last page partly used
    return kv_digest(*src, src_pages, PAGE, tokens), kv_digest(*dst, dst_pages, PAGE, tokens)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pages_go_through_a_slot_into_other_pages_in_request_order(device, dtype):
    sent, received = move(device, dtype, [7, 2, 9, 3], [0, 11, 5, 6])
    assert sent == received


@pytest.mark.parametrize("device", DEVICES)
def test_a_wrong_page_order_is_seen(device):
    """Negative control: the receiver scattering in another order than the sender gathered."""
    sent, received = move(device, torch.float32, [7, 2, 9, 3], [0, 11, 5, 6], scatter_order=[11, 0, 5, 6])
    assert sent != received


@pytest.mark.parametrize("device", DEVICES)
def test_the_scatter_touches_only_the_request_pages(device):
    src, dst = pools(device, torch.float32), pools(device, torch.float32, fill=-1.0)
    slot = torch.zeros(staged_bytes(*src, 2, PAGE), dtype=torch.uint8, pin_memory=device == "cuda")
    gather_pages(*src, [4, 5], PAGE, slot)
    scatter_pages(slot, *dst, [1, 8], PAGE)
    for pool in dst:
        touched = torch.zeros(PAGES * PAGE, dtype=torch.bool)
        touched[1 * PAGE:2 * PAGE] = touched[8 * PAGE:9 * PAGE] = True
        assert bool((pool[:, ~touched.to(device)] == -1.0).all())
        assert not bool((pool[:, touched.to(device)] == -1.0).any())


def test_a_slot_too_small_is_refused():
    src = pools("cpu", torch.float32)
    with pytest.raises(ValueError, match="staging bytes"):
        gather_pages(*src, [0, 1], PAGE, torch.zeros(staged_bytes(*src, 1, PAGE), dtype=torch.uint8))


def test_staged_bytes_count_both_pools_of_every_layer():
    src = pools("cpu", torch.bfloat16)
    assert staged_bytes(*src, 3, PAGE) == 3 * PAGE * LAYERS * (LATENT + INDEX) * 2


def test_the_arena_hands_out_sized_slots_and_takes_them_back():
    arena = StagingArena(4 * StagingArena.ALIGN, pinned=False)
    a = arena.allocate(100)  # rounds up to one host page
    b = arena.allocate(2 * StagingArena.ALIGN)
    assert (a, b) == (0, StagingArena.ALIGN) and arena.slots_in_use == 2
    assert arena.bytes_in_use == 3 * StagingArena.ALIGN
    assert arena.allocate(2 * StagingArena.ALIGN) is None  # one page left
    arena.free(a)
    assert arena.allocate(2 * StagingArena.ALIGN) is None  # two pages free, but not side by side
    arena.free(b)  # coalesces with the first: the whole arena again
    assert arena.slots_in_use == 0 and arena.bytes_in_use == 0
    assert arena.allocate(4 * StagingArena.ALIGN) == 0


def test_an_unfreed_slot_shows_in_the_counts():
    """Negative control for the leak oracle the PD servers export (dsv4_pd_staging_slots_in_use): a
    request path that forgets its slot leaves the count above 0, and the slot's space stays taken."""
    arena = StagingArena(2 * StagingArena.ALIGN, pinned=False)
    freed, forgotten = arena.allocate(StagingArena.ALIGN), arena.allocate(StagingArena.ALIGN)
    assert freed is not None and forgotten is not None
    arena.free(freed)  # the planted bug: `forgotten` is never freed
    assert arena.slots_in_use == 1 and arena.bytes_in_use == StagingArena.ALIGN
    assert arena.allocate(2 * StagingArena.ALIGN) is None


def test_misuse_is_an_error():
    arena = StagingArena(StagingArena.ALIGN, pinned=False)
    offset = arena.allocate(8)
    assert offset is not None
    with pytest.raises(ValueError, match="no staging slot"):
        arena.view(offset, StagingArena.ALIGN + 1)  # past the slot
    arena.free(offset)
    with pytest.raises(ValueError, match="not in use"):
        arena.free(offset)  # double free
    with pytest.raises(ValueError, match="no staging slot"):
        arena.view(offset, 8)  # a freed slot
    with pytest.raises(ValueError, match="exceeds the whole arena"):
        arena.allocate(2 * StagingArena.ALIGN)


def test_allocate_waits_for_a_free_and_gives_up_at_its_deadline():
    arena = StagingArena(StagingArena.ALIGN, pinned=False)
    held = arena.allocate(1)
    assert held is not None
    assert arena.allocate(1, timeout_s=0.05) is None  # nobody frees: None at the deadline
    threading.Timer(0.05, arena.free, [held]).start()
    assert arena.allocate(1, timeout_s=5.0) == 0


def test_a_new_arena_does_not_touch_its_memory():
    """A decode arena is up to 8 GiB: making it must not write it (torch.zeros did, at every start-up).
    Control: writing the buffer does show in the RSS, so the oracle can see an arena that is touched."""
    import os

    from canary.soak.rss import read_rss_bytes

    size = 512 << 20
    before = read_rss_bytes(os.getpid())
    arena = StagingArena(size, pinned=False)
    made = read_rss_bytes(os.getpid())
    arena.buffer.fill_(1)
    touched = read_rss_bytes(os.getpid())
    assert before is not None and made is not None and touched is not None
    assert made - before < size // 8
    assert touched - before > size // 2


def test_a_cancelled_wait_for_a_slot_ends_at_once():
    """`allocate` waits on the arena's condition, not in a loop: a free wakes it, and so does a cancel
    (`wake`), long before its deadline."""
    import time

    arena = StagingArena(StagingArena.ALIGN, pinned=False)
    held = arena.allocate(1)
    assert held is not None
    stop = threading.Event()
    got: list[int | None] = []
    waiter = threading.Thread(target=lambda: got.append(arena.allocate(1, timeout_s=30.0, cancelled=stop.is_set)))
    started = time.monotonic()
    waiter.start()
    time.sleep(0.05)
    stop.set()
    arena.wake()
    waiter.join(timeout=5.0)
    assert got == [None] and time.monotonic() - started < 5.0
    assert arena.slots_in_use == 1  # the cancelled waiter took nothing


class _CountingCondition:
    """The arena's condition with a count of how often anyone takes its lock."""

    def __init__(self, cond: threading.Condition) -> None:
        self.cond, self.entered = cond, 0

    def __enter__(self):
        self.entered += 1
        return self.cond.__enter__()

    def __exit__(self, *exc):
        return self.cond.__exit__(*exc)

    def wait(self, timeout=None):
        return self.cond.wait(timeout)

    def notify_all(self):
        self.cond.notify_all()


def decode_side_on(arena: StagingArena, timeout_s: float = 10.0):
    """A DecodeSide with only what `_reserve_staging` uses: the arena, 1 page = 1 host page of KV."""
    from types import SimpleNamespace

    from runtime.disagg.decode import DecodeSide

    transfer = SimpleNamespace(staging=arena, staged_bytes=lambda pages: pages * StagingArena.ALIGN)
    return DecodeSide(None, transfer, "decode-test", None, timeout_s, None)  # type: ignore[arg-type]


def test_a_room_waiting_for_staging_sleeps_until_a_slot_is_freed():
    """The decode side used to look at the arena every 5 ms while a room waited for a slot (~60 looks
    in 0.3 s); now the wait sleeps until a free wakes it, and gets the freed slot."""
    import asyncio

    arena = StagingArena(2 * StagingArena.ALIGN, pinned=False)
    held = arena.allocate(2 * StagingArena.ALIGN)
    assert held is not None
    counting = _CountingCondition(arena._cond)
    arena._cond = counting  # type: ignore[assignment]
    side = decode_side_on(arena)

    async def run() -> int | None:
        room = asyncio.ensure_future(side._reserve_staging("room-1", 1))
        await asyncio.sleep(0.3)
        looks = counting.entered
        assert not room.done()
        arena.free(held)
        offset = await asyncio.wait_for(room, 5.0)
        assert looks < 10, f"the waiting room looked at the arena {looks} times in 0.3 s"
        return offset

    assert asyncio.run(run()) == 0
    assert arena.slots_in_use == 1


def test_a_room_cancelled_while_it_waits_for_staging_holds_nothing():
    """A request given up while its room waits for a slot (client gone) takes no slot, even when a
    free comes right after the cancel."""
    import asyncio

    arena = StagingArena(StagingArena.ALIGN, pinned=False)
    held = arena.allocate(1)
    assert held is not None
    side = decode_side_on(arena)

    async def run() -> None:
        room = asyncio.ensure_future(side._reserve_staging("room-1", 1))
        await asyncio.sleep(0.05)
        room.cancel()
        arena.free(held)
        with pytest.raises(asyncio.CancelledError):
            await room
        await asyncio.sleep(0.2)  # the waiting thread settles

    asyncio.run(run())
    assert arena.slots_in_use == 0 and arena.allocate(StagingArena.ALIGN) == 0


def test_a_room_that_finds_no_slot_in_time_is_a_named_error():
    import asyncio

    from runtime.server.errors import ApiError

    arena = StagingArena(StagingArena.ALIGN, pinned=False)
    assert arena.allocate(1) is not None
    with pytest.raises(ApiError, match="no staging space") as refused:
        asyncio.run(decode_side_on(arena, timeout_s=0.1)._reserve_staging("room-1", 1))
    assert refused.value.code == "pd_out_of_staging"


def test_direct_mode_off_the_host_is_one_rule_with_one_message():
    """Start-up (`transfer_mode`) and `KVTransfer` refuse a direct transfer of a device pool with the
    same words: one rule, checked in both places."""
    from runtime.disagg.setup import transfer_mode
    from runtime.disagg.transfer import KVTransfer
    from runtime.serve import parse_args

    args = parse_args(["--model", "tiny-random", "--disaggregation-mode", "decode",
                       "--disaggregation-transfer", "direct"])
    with pytest.raises(ValueError) as at_start:
        transfer_mode(args, "meta")
    latent, index_keys = (torch.empty(LAYERS, PAGES * PAGE, dim, device="meta") for dim in (LATENT, INDEX))
    with pytest.raises(TransferUnavailable) as in_transfer:
        KVTransfer(latent, index_keys, PAGE, mode="direct")
    assert str(in_transfer.value) in str(at_start.value)


def test_serve_refuses_direct_transfer_on_a_cuda_pool():
    """`runtime.serve --disaggregation-transfer direct` on a GPU is a clear start-up error (the
    non-CUDA engine cannot register device memory); the same flags on CPU, and the default mode on a
    GPU, are accepted (the control: the refusal is about the device, not the flag)."""
    from runtime.disagg.setup import transfer_mode
    from runtime.serve import parse_args

    direct = parse_args(["--model", "tiny-random", "--disaggregation-mode", "decode",
                         "--disaggregation-transfer", "direct"])
    assert transfer_mode(direct, "cpu") == "direct"
    with pytest.raises(ValueError, match="host memory only"):
        transfer_mode(direct, "cuda")
    assert transfer_mode(parse_args(["--model", "tiny-random", "--disaggregation-mode", "prefill"]), "cuda") == "staged"


def live_slots_overlap(arena: StagingArena, seed: int) -> bool:
    """Random allocations and frees (rooms opening and closing in any order): does any slot handed out
    share a byte with another live one? Every live slot is filled with its own mark and checked."""
    import random

    rng = random.Random(seed)
    live: list[tuple[int, int, int]] = []  # (offset, size, mark) of each slot handed out and not freed
    for step in range(300):
        if live and rng.random() < 0.45:
            offset, size, mark = live.pop(rng.randrange(len(live)))
            if not bool((arena.buffer[offset:offset + size] == mark).all()):
                return True
            try:
                arena.free(offset)
            except ValueError:  # the slot was already freed: handed out twice
                return True
            continue
        size = rng.randint(1, 3 * StagingArena.ALIGN)
        offset = arena.allocate(size)
        if offset is not None:
            mark = step % 251 + 1
            arena.view(offset, size).fill_(mark)
            live.append((offset, size, mark))
    return any(not bool((arena.buffer[o:o + s] == m).all()) for o, s, m in live)


@pytest.mark.parametrize("seed", range(5))
def test_live_slots_never_overlap(seed):
    arena = StagingArena(16 * StagingArena.ALIGN, pinned=False)
    assert not live_slots_overlap(arena, seed)


def test_overlapping_slots_are_seen(monkeypatch):
    """Negative control: an arena that hands out a free run without taking it off the free list (so
    two rooms get the same bytes) is caught by the overlap check."""
    arena = StagingArena(16 * StagingArena.ALIGN, pinned=False)
    real = arena._take

    def leaky(size: int) -> int | None:
        free = list(arena._free)
        offset = real(size)
        arena._free = free  # the planted bug
        return offset

    monkeypatch.setattr(arena, "_take", leaky)
    assert live_slots_overlap(arena, 0)


# ---------------------------------------------------------------- the decode side's default arena

def rooms_that_wait(capacity: int, page_bytes: int, pool_pages: int, seed: int, steps: int = 4000) -> int:
    """Rooms drawn as a loaded decode server sees them (prompts of 1-128 pages, opened while the pool
    has their pages, closed in random order), each asking for its receive slot: how many found no
    slot although the pool had admitted them."""
    import random
    rng = random.Random(seed)
    arena = StagingArena(capacity, pinned=False)
    open_rooms: list[tuple[int, int]] = []  # (offset, pages)
    pages_held = waited = 0
    for _ in range(steps):
        if open_rooms and (rng.random() < 0.45 or pages_held > pool_pages - 128):
            offset, pages = open_rooms.pop(rng.randrange(len(open_rooms)))
            arena.free(offset)
            pages_held -= pages
            continue
        pages = rng.randint(1, 128)
        if pages_held + pages > pool_pages:
            continue  # the pool itself refuses it: not the arena's doing
        offset = arena.allocate(pages * page_bytes)
        if offset is None:
            waited += 1
            continue
        open_rooms.append((offset, pages))
        pages_held += pages
    return waited


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_decode_arena_by_default_never_makes_an_admitted_room_wait(seed):
    """A decode server holds a receive slot per room for its whole wait (the 80-session PD gate failed
    11 rooms on 64 MiB): its default arena, twice its pool's KV, serves every room the pool admits."""
    from runtime.disagg.staging import default_staging_bytes
    page_bytes, pool_pages = 21_504, 8192  # the canary's KV per 16-token page; a gate server's pool
    capacity = default_staging_bytes("decode", one_prompt=128 * page_bytes, whole_pool=pool_pages * page_bytes)
    assert rooms_that_wait(capacity, page_bytes, pool_pages, seed) == 0


def test_rooms_wait_on_the_old_64_mib_arena():
    """Negative control: the prefill side's 64 MiB (the decode side's old default) makes rooms wait."""
    from runtime.disagg.staging import default_staging_bytes
    page_bytes, pool_pages = 21_504, 8192
    capacity = default_staging_bytes("prefill", one_prompt=128 * page_bytes, whole_pool=pool_pages * page_bytes)
    assert capacity == 64 << 20
    assert rooms_that_wait(capacity, page_bytes, pool_pages, seed=0) > 0


def test_the_decode_arena_default_stops_at_its_cap():
    from runtime.disagg.staging import DECODE_STAGING_CAP_BYTES, default_staging_bytes
    assert default_staging_bytes("decode", one_prompt=1 << 20, whole_pool=64 << 30) == DECODE_STAGING_CAP_BYTES
    assert default_staging_bytes("decode", one_prompt=12 << 30, whole_pool=64 << 30) == 12 << 30  # one prompt fits
