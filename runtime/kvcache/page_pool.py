"""Page allocator with exact accounting and ownership.

Every page is either free or owned by exactly one request (or by the prefix cache, whose owner
id is `runtime/kvcache/prefix_cache.py`'s CACHE_OWNER). Freeing a page the caller does not own
(double free) and touching pages after they were freed (use after free) raise instead of silently
corrupting another request's KV. `pages_in_use` must return to its idle level after every request
finishes or aborts; tests and the harness check that.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection

from runtime.faults import NO_FAULTS, FaultSet


class PageAccountingError(RuntimeError):
    pass


class DoubleFreeError(PageAccountingError):
    pass


class UseAfterFreeError(PageAccountingError):
    pass


class OutOfPagesError(PageAccountingError):
    pass


class PagePool:
    def __init__(self, num_pages: int, page_size: int, faults: FaultSet = NO_FAULTS) -> None:
        if num_pages <= 0 or page_size <= 0:
            raise ValueError("num_pages and page_size must be > 0")
        self.num_pages = num_pages
        self.page_size = page_size
        self._faults = faults
        self._free: deque[int] = deque(range(num_pages))
        self._owner: dict[int, str] = {}
        # The same ownership by owner, so a step's check of a row's pages is one C-level subset
        # test instead of a Python loop over the pages (per row, per step: the engine's hot path).
        self._held: dict[str, set[int]] = {}
        # Pages a request received through the kv-slot-reuse fault: it believes it owns them.
        self._aliased: dict[str, list[int]] = {}

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def pages_in_use(self) -> int:
        return self.num_pages - len(self._free)

    def pages_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= len(self._free)

    def allocate(self, owner: str, num_pages: int) -> list[int]:
        if num_pages < 0:
            raise ValueError("num_pages must be >= 0")
        if num_pages > len(self._free):
            raise OutOfPagesError(f"{owner}: asked for {num_pages} pages, {len(self._free)} free")
        pages: list[int] = []
        if num_pages and self._faults.enabled("kv-slot-reuse"):
            stolen = self._page_owned_by_another(owner)
            if stolen is not None:
                # The bug: a page still owned by a live request is handed out again.
                self._aliased.setdefault(owner, []).append(stolen)
                pages.append(stolen)
        held = self._held.setdefault(owner, set()) if len(pages) < num_pages else set()
        while len(pages) < num_pages:
            page = self._free.popleft()
            self._owner[page] = owner
            held.add(page)
            pages.append(page)
        return pages

    def free(self, owner: str, pages: list[int]) -> None:
        aliased = self._aliased.get(owner, [])
        for page in pages:
            if self._owner.get(page) == owner:
                del self._owner[page]
                self._held[owner].discard(page)
                self._free.append(page)
            elif page in aliased:
                aliased.remove(page)
            else:
                raise DoubleFreeError(f"{owner} freed page {page} owned by {self._owner.get(page)!r}")
        if not aliased:
            self._aliased.pop(owner, None)
        if not self._held.get(owner, True):
            del self._held[owner]

    def transfer(self, owner: str, new_owner: str, pages: list[int]) -> None:
        """Hand `owner`'s pages to `new_owner` (a finished request's KV to the prefix cache)."""
        for page in pages:
            if self._owner.get(page) != owner:
                raise UseAfterFreeError(f"{owner} handed over page {page} owned by {self._owner.get(page)!r}")
        held = self._held.setdefault(new_owner, set())
        for page in pages:
            self._owner[page] = new_owner
            self._held[owner].discard(page)
            held.add(page)
        if not self._held.get(owner, True):
            del self._held[owner]
        if not held:
            del self._held[new_owner]

    def pages_held(self, owner: str) -> int:
        return len(self._held.get(owner, ()))

    def check_owned(self, owner: str, pages: Collection[int]) -> None:
        held = self._held.get(owner)
        if held is not None and held.issuperset(pages):
            return
        aliased = self._aliased.get(owner, ())
        for page in pages:
            if self._owner.get(page) != owner and page not in aliased:
                raise UseAfterFreeError(f"{owner} touched page {page} owned by {self._owner.get(page)!r}")

    def check_table(self, owner: str, new_pages: Collection[int], num_pages: int) -> None:
        """A step's check of a request's page table, O(its new pages): the new pages are the owner's,
        and the owner holds exactly the table's `num_pages` pages, so none of the pages checked in
        earlier steps has been freed since (a freed page lowers the count)."""
        self.check_owned(owner, new_pages)
        if owner in self._aliased:
            return  # the kv-slot-reuse fault's aliased pages: no exact count (a page may come back twice)
        held = len(self._held.get(owner, ()))
        if held != num_pages:
            raise UseAfterFreeError(f"{owner}: its page table has {num_pages} pages, it holds {held}")

    def _page_owned_by_another(self, owner: str) -> int | None:
        others = [page for page, who in self._owner.items() if who != owner]
        return min(others) if others else None
