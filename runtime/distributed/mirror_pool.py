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

    def claim(self, owner: str, pages: tuple[int, ...]) -> None:
        held = self._pages.setdefault(owner, [])
        for page in pages[len(held):]:
            if page in self._owner:
                raise DoubleFreeError(f"rank plan gives page {page} to {owner}, still held by {self._owner[page]}")
            self._owner[page] = owner
            held.append(page)
        if tuple(held) != tuple(pages):
            raise UseAfterFreeError(f"{owner}: plan pages {pages} do not extend the held pages {held}")

    def release(self, owner: str) -> None:
        for page in self._pages.pop(owner, []):
            del self._owner[page]

    def check_owned(self, owner: str, pages: list[int]) -> None:
        for page in pages:
            if self._owner.get(page) != owner:
                raise UseAfterFreeError(f"{owner} touched page {page} owned by {self._owner.get(page)!r}")
