"""`MirrorPool`: a worker rank's page accounting, driven only by rank 0's plans.

Rank 0's `PagePool` decides which pages a request gets; the plan lists them and a worker claims
exactly those. A page claimed while another request still holds it means the ranks disagree about
the KV layout, which is a desync, not something to paper over.
"""

from __future__ import annotations

from runtime.kvcache.page_pool import DoubleFreeError, UseAfterFreeError


class MirrorPool:
    def __init__(self, num_pages: int, page_size: int) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self._owner: dict[int, str] = {}
        self._pages: dict[str, list[int]] = {}

    @property
    def pages_in_use(self) -> int:
        return len(self._owner)

    def claim(self, owner: str, first_page: int, new_pages: tuple[int, ...]) -> None:
        """Take the pages a plan appends to `owner`'s table at index `first_page` (an `Extend`'s delta)."""
        held = self._pages.setdefault(owner, [])
        if len(held) != first_page:
            raise UseAfterFreeError(f"{owner}: plan appends pages at {first_page}, this rank holds {len(held)}")
        for page in new_pages:
            if page in self._owner:
                raise DoubleFreeError(f"rank plan gives page {page} to {owner}, still held by {self._owner[page]}")
            self._owner[page] = owner
            held.append(page)

    def release(self, owner: str) -> None:
        for page in self._pages.pop(owner, []):
            del self._owner[page]

    def check_owned(self, owner: str, pages: list[int]) -> None:
        for page in pages:
            if self._owner.get(page) != owner:
                raise UseAfterFreeError(f"{owner} touched page {page} owned by {self._owner.get(page)!r}")

    def check_table(self, owner: str, new_pages: tuple[int, ...], num_pages: int) -> None:
        """`PagePool.check_table`: the new pages are the owner's and it holds exactly `num_pages`."""
        self.check_owned(owner, list(new_pages))
        held = len(self._pages.get(owner, ()))
        if held != num_pages:
            raise UseAfterFreeError(f"{owner}: its page table has {num_pages} pages, this rank holds {held}")
