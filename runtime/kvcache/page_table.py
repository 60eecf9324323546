"""`PageTables`: each request's page table, kept by a model runner across steps.

A step's plan carries only the pages a request received since its last extend (`Extend.new_pages`,
appended at `Extend.first_page`), not its whole table: rebuilding and flattening every request's
full page list every step made the host's step work grow with the batch's total KV pages. The
runner appends the new pages to the request's row of a preallocated block [rows, max_pages]
(padded with `pad_page`) and reads the step's tables out of it in one gather: a decode step's host
work is O(batch), as in vLLM's block table and SGLang's req_to_token pool.

A row is freed when its request finishes, is aborted or preempted (`release`). The plan says where
the new pages go, and the row must agree: a fresh table (`first_page == 0`) over a row still held,
or new pages that do not continue the row, mean a release was missed (a stale row would point a
request at pages another request now owns), and raise instead of running.
"""

from __future__ import annotations

import numpy as np

from runtime.engine.plan import Extend


class StalePageTableError(RuntimeError):
    """A plan's page-table delta does not continue the row this runner holds for the request."""


class PageTables:
    def __init__(self, max_pages: int, pad_page: int, rows: int = 64, *, mirrored: bool = False) -> None:
        self.max_pages, self.pad_page = max_pages, pad_page
        self.block = np.full((max(rows, 1), max_pages), pad_page, dtype=np.int64)  # [rows, max_pages]
        self.length: dict[str, int] = {}  # pages in each live request's table
        self._row: dict[str, int] = {}
        self._free = list(range(len(self.block) - 1, -1, -1))  # pop() hands out the lowest row first
        # mirrored: a device copy follows the block; (row, start, stop) of the entries written since
        # the last `take_changes` are what it must copy.
        self._changed: list[tuple[int, int, int]] | None = [] if mirrored else None

    @property
    def live(self) -> int:
        return len(self._row)

    def apply(self, ext: Extend) -> int:
        """Append the extend's new pages to its request's row (a fresh row when `first_page` is 0);
        returns the row."""
        rid, first = ext.rid, ext.first_page
        row = self._row.get(rid)
        if first == 0:
            if row is not None:
                raise StalePageTableError(f"{rid}: plan starts a fresh page table, but this runner still holds "
                                          f"its old one ({self.length[rid]} pages): a missed release")
            row = self._take(rid)
        elif row is None or self.length[rid] != first:
            held = "none" if row is None else f"{self.length[rid]} pages"
            raise StalePageTableError(f"{rid}: plan appends pages at {first}, this runner holds {held}")
        new = ext.new_pages
        if new:
            end = first + len(new)
            if end > self.max_pages:
                raise RuntimeError(f"{end} pages exceed max_model_len ({self.max_pages} pages)")
            self.block[row, first:end] = new
            self.length[rid] = end
            if self._changed is not None:
                self._changed.append((row, first, end))
        return row

    def pages(self, rid: str) -> np.ndarray:
        """[length] the request's page table (a view: valid until its row changes)."""
        return self.block[self._row[rid], :self.length[rid]]

    def release(self, rid: str) -> None:
        """Free the row of a finished, aborted or preempted request (idempotent). The row is padded
        again, so a later owner's table never shows this request's pages past its own length."""
        row = self._row.pop(rid, None)
        if row is None:
            return
        length = self.length.pop(rid)
        if length:
            self.block[row, :length] = self.pad_page
            if self._changed is not None:
                self._changed.append((row, 0, length))
        self._free.append(row)

    def take_changes(self) -> np.ndarray:
        """Flat indices into `block` (row * max_pages + column) of every entry written since the last
        call, each once and sorted (a mirrored runner copies `block.ravel()` at them to the device:
        the values are the block's current ones, so a release and a new owner's pages in one row
        between two calls give the new owner's, with no index written twice in one scatter)."""
        assert self._changed is not None, "take_changes on a table without a device copy"
        changed, self._changed = self._changed, []
        if not changed:
            return np.empty(0, dtype=np.int64)
        return np.unique(np.concatenate([np.arange(row * self.max_pages + start, row * self.max_pages + stop)
                                         for row, start, stop in changed]))

    def _take(self, rid: str) -> int:
        if not self._free:  # more live requests than rows: double the block (rare; rows are reused)
            grown = len(self.block)
            self.block = np.concatenate([self.block, np.full_like(self.block, self.pad_page)])
            self._free = list(range(2 * grown - 1, grown - 1, -1))
        row = self._free.pop()
        self._row[rid] = row
        self.length[rid] = 0
        return row
