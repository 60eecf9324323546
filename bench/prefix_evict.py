"""Host cost of the prefix cache's eviction once the pool is full of cached pages: the GPU server's case
(an 8,192-page pool that multi-turn sessions fill with cached chains, after which allocations evict).
200 allocations of 8 pages, each held, each needing eviction.

    python -m bench.prefix_evict
"""

from __future__ import annotations

import random
import time

from runtime.faults import FaultSet
from runtime.kvcache.page_pool import PagePool
from runtime.kvcache.prefix_cache import PrefixCache

POOL_PAGES, PAGE_SIZE, CHAIN_PAGES, ALLOCATIONS, ALLOCATION_PAGES = 8192, 16, 64, 200, 8


def main() -> None:
    pool = PagePool(POOL_PAGES, PAGE_SIZE, FaultSet(()))
    cache = PrefixCache(pool)
    rng = random.Random(0)
    finished = 0
    while pool.can_allocate(CHAIN_PAGES):  # finished requests' chains fill the pool
        owner = f"done-{finished}"
        finished += 1
        ids = [rng.randrange(1000) for _ in range(CHAIN_PAGES * PAGE_SIZE)]
        pool.free(owner, cache.insert(owner, ids, pool.allocate(owner, CHAIN_PAGES)))
    cached, evicted = cache.num_pages, cache.evicted_pages
    start = time.perf_counter()
    for i in range(ALLOCATIONS):
        assert cache.make_room(ALLOCATION_PAGES)
        pool.allocate(f"running-{i}", ALLOCATION_PAGES)
    seconds = time.perf_counter() - start
    print(f"{cached} pages cached; {ALLOCATIONS} allocations of {ALLOCATION_PAGES} pages evicted "
          f"{cache.evicted_pages - evicted} in {seconds * 1e3:.1f} ms: "
          f"{seconds / ALLOCATIONS * 1e3:.3f} ms per allocation")


if __name__ == "__main__":
    main()
