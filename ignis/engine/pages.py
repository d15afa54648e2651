"""Which pages of the attention K/V pool each lane holds: the free list, and the table entries the next round writes.

Owns: handing pages to a lane as its positions grow, taking them back (all of them, or those past a length), the
count of what is free and held, and the block-table writes that follow from both (`updates`, applied by the runner
before the round). Decisions only, as plain data: the table and the pages themselves are ignis.model.pool's, and who
must give pages up when there are too few (preempting a request, evicting a retained slot) is the scheduler's.

A lane's pages cover its positions from 0 in order: lane l holds pages for positions 0..held(l) * page - 1. A page
belongs to at most one lane; a freed page is written as the null page in its lane's row before anything else can map
it, so no table row ever names a page another lane holds.
"""

from __future__ import annotations


class Pages:
    def __init__(self, *, pages: int, page: int, lanes: int, width: int) -> None:
        """pages: the pool's pages (ids 1..pages; 0 is the null page); page: positions a page; width: the most
        pages one lane may hold."""
        self.total = pages
        self.page = page
        self.width = width
        self.free: list[int] = list(range(pages, 0, -1))  # pop() hands out the lowest id first
        self.lanes: list[list[int]] = [[] for _ in range(lanes)]  # pages of each lane, in position order
        self.updates: list[tuple[int, int, int]] = []  # (lane, index, page) table writes not yet taken

    def covering(self, positions: int) -> int:
        """Pages that hold positions 0..positions-1."""
        return -(-positions // self.page)

    def needs(self, lane: int, positions: int) -> int:
        """Pages `lane` lacks for positions 0..positions-1."""
        return max(0, min(self.covering(positions), self.width) - len(self.lanes[lane]))

    @property
    def used(self) -> int:
        return self.total - len(self.free)

    def held(self, lane: int) -> int:
        return len(self.lanes[lane])

    def grow(self, lane: int, positions: int) -> bool:
        """Give `lane` pages for positions 0..positions-1; False (and nothing given) when too few are free."""
        n = self.needs(lane, positions)
        if n > len(self.free):
            return False
        mine = self.lanes[lane]
        for _ in range(n):
            page = self.free.pop()
            self.updates.append((lane, len(mine), page))
            mine.append(page)
        return True

    def trim(self, lane: int, positions: int) -> int:
        """Take back `lane`'s pages past those covering positions 0..positions-1; returns how many."""
        mine = self.lanes[lane]
        keep = self.covering(positions)
        n = max(0, len(mine) - keep)
        for _ in range(n):
            self.updates.append((lane, len(mine) - 1, 0))
            self.free.append(mine.pop())
        return n

    def release(self, lane: int) -> int:
        """Take back every page of `lane`; returns how many."""
        return self.trim(lane, 0)

    def take_updates(self) -> list[tuple[int, int, int]]:
        """The table writes since the last call, in order (a page freed and given again in one plan is unmapped in
        its old lane's row before its new lane maps it)."""
        out, self.updates = self.updates, []
        return out
