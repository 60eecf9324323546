"""`PrefixCache`: finished requests' full KV pages, kept for later requests that start with the same tokens.

A request that finishes normally hands its full pages whose KV is final (every position it wrote: the
prompt and the generated tokens but the last, which has no KV) to the cache instead of freeing them;
the pool's ownership of those pages moves to `CACHE_OWNER`. A page is a node keyed by its parent
node and its own token ids, so a page's key chains every page before it (a hash chain over the
pages' ids, whose dict lookups also compare the ids: no collision can match a wrong page).

On admission the scheduler matches the longest chain of cached pages a request's ids start with,
copies their KV (every layer's latent and index keys) into the request's own pages (`StepPlan.copies`,
run before the step's forward) and prefills from there. Exact only where a row's bits do not depend
on where its segment starts (the eager CPU runner: runtime/kernels/cpu.py; the GPU runner with the
Triton kernels, whose prompt bits do not depend on the prefill chunk); `Engine` allows it only there
(`Engine.prefix_cache_refusal`: colocated or on a PD prefill server, whose finished prompts' pages come
here once their KV is sent) and turns it on by default on the CPU only (`Engine.use_prefix_cache`).
Eviction: least recently used leaf pages first, whenever an
allocation would fail, before any preemption; pages matched in the step being planned are pinned
until the plan is built (its copies read them first thing when it runs). The leaves wait in a heap by
(last use, node), pushed when a node becomes a leaf or a leaf is used again, so evicting a page is
O(log N), not a scan of every cached page (quadratic when a big request evicts many); an entry whose
node has since been used again, grown a child or gone is stale and dropped when it surfaces.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from runtime.kvcache.page_pool import PagePool

CACHE_OWNER = "<prefix-cache>"  # the pool owner of cached pages (no request id has angle brackets)
ROOT = 0  # the parent of every chain's first page


@dataclass(eq=False)
class CachedPage:
    node: int
    parent: int
    ids: tuple[int, ...]
    page: int
    last_used: int
    children: int = 0


class PrefixCache:
    def __init__(self, pool: PagePool) -> None:
        self.pool = pool
        self.page_size = pool.page_size
        self._by_key: dict[tuple[int, tuple[int, ...]], CachedPage] = {}
        self._by_node: dict[int, CachedPage] = {}
        self._pinned: dict[int, int] = {}  # node -> matches in the step being planned
        self._leaves: list[tuple[int, int]] = []  # heap of (last_used, node): eviction candidates, some stale
        self._next_node = ROOT + 1
        self._clock = 0
        self.hit_tokens = 0  # prompt tokens admitted with their KV copied from the cache
        self.lookup_tokens = 0  # tokens of every admitted prefill (the hit rate's denominator)
        self.evicted_pages = 0

    @property
    def num_pages(self) -> int:
        return len(self._by_node)

    def match(self, ids: list[int], max_pages: int) -> list[CachedPage]:
        """The longest chain of cached pages that `ids` starts with, at most `max_pages`, pinned until
        `release(chain)` or `unpin()` (so making room for this very request cannot evict them)."""
        self._clock += 1
        size, chain, parent = self.page_size, [], ROOT
        for i in range(max_pages):
            entry = self._by_key.get((parent, tuple(ids[i * size:(i + 1) * size])))
            if entry is None:
                break
            entry.last_used = self._clock
            self._pinned[entry.node] = self._pinned.get(entry.node, 0) + 1
            chain.append(entry)
            parent = entry.node
        if chain:  # every entry but the chain's last has a child (the next one): only the last may be a leaf
            self._push_leaf(chain[-1])
        return chain

    def release(self, chain: list[CachedPage]) -> None:
        """Give up a match that will not be used (its pages may be evicted again)."""
        for entry in chain:
            self._pinned[entry.node] -= 1
            if not self._pinned[entry.node]:
                del self._pinned[entry.node]

    def unpin(self) -> None:
        self._pinned.clear()

    def insert(self, owner: str, ids: list[int], pages: list[int]) -> list[int]:
        """Take over `owner`'s full pages of `ids` (KV final) that the cache does not hold yet; returns
        the pages left for the caller to free (the partial last page, pages already cached)."""
        self._clock += 1
        size, parent, taken, entry = self.page_size, ROOT, [], None
        for i in range(len(ids) // size):
            key = (parent, tuple(ids[i * size:(i + 1) * size]))
            entry = self._by_key.get(key)
            if entry is None:
                entry = CachedPage(self._next_node, parent, key[1], pages[i], self._clock)
                self._next_node += 1
                self._by_key[key] = entry
                self._by_node[entry.node] = entry
                if parent != ROOT:
                    self._by_node[parent].children += 1
                taken.append(pages[i])
            entry.last_used = self._clock
            parent = entry.node
        if entry is not None:  # as in `match`: only the chain's last entry may be a leaf
            self._push_leaf(entry)
        self.pool.transfer(owner, CACHE_OWNER, taken)
        kept = set(taken)
        return [page for page in pages if page not in kept]

    def make_room(self, num_pages: int) -> bool:
        """Evict least recently used unpinned leaf pages until the pool can allocate `num_pages`."""
        pinned: list[tuple[int, int]] = []  # pinned leaves met on the way: candidates again after this plan
        try:
            while not self.pool.can_allocate(num_pages):
                entry = self._pop_leaf(pinned)
                if entry is None:
                    return False
                self._evict(entry)
            return True
        finally:
            for item in pinned:
                heapq.heappush(self._leaves, item)

    def _push_leaf(self, entry: CachedPage) -> None:
        if entry.children:
            return
        heapq.heappush(self._leaves, (entry.last_used, entry.node))
        if len(self._leaves) > 2 * len(self._by_node) + 64:  # mostly stale: rebuild from the live leaves
            self._leaves = [(e.last_used, e.node) for e in self._by_node.values() if not e.children]
            heapq.heapify(self._leaves)

    def _pop_leaf(self, pinned: list[tuple[int, int]]) -> CachedPage | None:
        """The least recently used unpinned leaf, off the heap (stale entries dropped, pinned ones set aside)."""
        while self._leaves:
            item = heapq.heappop(self._leaves)
            entry = self._by_node.get(item[1])
            if entry is None or entry.last_used != item[0] or entry.children:
                continue  # evicted, used again since (a newer entry is in the heap), or no longer a leaf
            if entry.node in self._pinned:
                pinned.append(item)
                continue
            return entry
        return None

    def _evict(self, entry: CachedPage) -> None:
        del self._by_key[(entry.parent, entry.ids)]
        del self._by_node[entry.node]
        if entry.parent != ROOT:
            parent = self._by_node[entry.parent]
            parent.children -= 1
            self._push_leaf(parent)  # its last child gone: a leaf now (a no-op while it has others)
        self.pool.free(CACHE_OWNER, [entry.page])
        self.evicted_pages += 1
